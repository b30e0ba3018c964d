"""``sampler=episode``: multi-turn episodes (the model acts, an environment answers, repeat).

One row per episode: the prompt, then one response made of the model's turns and the
environment's inserted messages, with a loss mask that is 1 exactly on the model's sampled
tokens. The result is the same :class:`rlpost.samplers.base.SampleResult` every other sampler
returns, so every advantage estimator, loss, selector and correction runs on episodes
unchanged (advantage estimators treat mask-0 positions inside a response as transitions, not
as ends: :func:`rlpost.algos.advantages.discounted_gae`).

Token exactness: the ids the engine sampled are kept as sampled (never decoded and
re-tokenised; re-tokenisation drift makes training silently off-policy), and only the
inserted environment text is tokenised (:func:`render_insert`). Rollout log-probs and
temperatures are the engine's on model tokens and 0 on environment tokens.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import random
import re
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from rlpost.core.registry import Choice, param
from rlpost.rollout.base import GenerationResult
from rlpost.samplers.base import SAMPLERS, SampleResult, Sampler, pad_id_of, score_rows, step_params
from rlpost.samplers.turn_tree import TurnTree, expand as expand_tree
from rlpost.tasks.chat import _PLAIN, _PLAIN_RE, _special_strings, encode_framed, encode_plain, template_parts  # noqa: F401
from rlpost.envs import make_env
from rlpost.envs.base import timed_step
from rlpost.rollout.hf import left_pad
from rlpost.tasks.base import Example

#: stop string that ends a model turn at a tool call (the engine keeps it in the response)
TOOL_CALL_STOP = "</tool_call>"
_SENTINEL = "\u2063RLPOST_MODEL_TURN\u2063"


def normalize_turn_answer(answer: Any) -> str:
    """A turn's extracted answer as the episode sampler records it: lower-cased, every whitespace removed.

    The normalisation of the authors' ``normalize_answer`` in "DRIFT: Decoupled Rollouts and
    Importance-Weighted Fine-Tuning for Efficient Multi-Turn Optimization" (arXiv:2605.31455;
    github.com/2020-qqtcg/DRIFT, ``src/prompting.py``): two turns gave the same answer when these
    strings are equal. An answer of only whitespace gives ``""``.
    """
    return re.sub(r"\s+", "", str(answer).strip().lower())


def render_insert(tokenizer: Any, messages: List[Dict[str, str]], after_eos: bool) -> List[int]:
    """Token ids of environment ``messages`` inserted after a model turn, up to the next assistant header.

    The text is the chat template's own rendering of the messages, cut just after a
    stand-in assistant turn: ``template([user, assistant(S), *messages], add_generation_prompt)``
    from the end of ``S`` on. When the model's turn ended with its end-of-turn token
    (``after_eos``) that token's text, already sampled, is not inserted again; when the
    turn stopped at ``</tool_call>`` the template's end-of-turn text is inserted (no loss
    on it). Tokenizers without a chat template get ``<role>\\ncontent\\n</role>`` blocks.

    Environment text is plain text: only the template's framing may carry special ids; a tool
    result or observation holding ``<|im_end|>\\n<|im_start|>assistant`` is encoded as those
    characters (:func:`encode_framed`), so it cannot close the turn or forge an assistant header.

    Returns:
        the inserted ids (only this text is tokenised; the model's text never is).
    """
    if getattr(tokenizer, "chat_template", None):
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        framing, contents = template_parts(tokenizer, base + list(messages), True, after=_SENTINEL)
        eos = tokenizer.eos_token or ""
        if after_eos and eos and framing[0].startswith(eos):
            framing[0] = framing[0][len(eos):]
        return encode_framed(tokenizer, framing, contents)
    delta = "\n" + "".join(f"<{m['role']}>\n{m['content']}\n</{m['role']}>\n" for m in messages)
    return encode_plain(tokenizer, delta)


@dataclasses.dataclass
class _Episode:
    prompt: List[int]
    env: Any
    ids: List[int] = dataclasses.field(default_factory=list)
    mask: List[float] = dataclasses.field(default_factory=list)
    lps: List[float] = dataclasses.field(default_factory=list)
    temps: List[float] = dataclasses.field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    env_errors: int = 0
    void: bool = False
    done: bool = False
    truncated: bool = False
    finished: bool = False
    final_text: str = ""
    env_reward: float = 0.0
    env_seconds: float = 0.0
    transcript: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    pos: int = 0  # the prompt's position in the step (group id)
    turn_rewards: List[tuple] = dataclasses.field(default_factory=list)  # (index of the turn's last model token, reward)
    parent: int = -1  # branching: index of the episode this one branched from (-1: a global episode)
    prefix_len: int = 0  # branching: response tokens shared with the parent, id for id
    can_branch: bool = True
    after_tool: bool = False  # the next model turn follows inserted environment text
    h_first: Optional[float] = None  # mean surprisal (nats) of the first turn's first k tokens
    consecutive: int = 0  # AEPO: consecutive branching steps along this path
    vers: List[int] = dataclasses.field(default_factory=list)  # partial rollouts: policy version of each token
    rounds: int = 0  # partial rollouts: rounds (turns) this episode took part in
    resumed: bool = False  # partial rollouts: continued in a later step than it began
    turn_lens: List[int] = dataclasses.field(default_factory=list)  # model tokens of each turn (overlong shaping)
    calls_skipped: int = 0  # tool calls of a turn at the turn cap, never executed
    node_path: List[int] = dataclasses.field(default_factory=list)  # branching=at2po: turn-tree node of each turn
    initial_obs: str = ""  # the environment's observation at reset (joined to the user turn of the prompt)
    answers: List[str] = dataclasses.field(default_factory=list)  # each answering turn's answer (normalize_turn_answer)
    void_turns: List[int] = dataclasses.field(default_factory=list)  # index of the last model token of each void turn

    def add(self, ids, mask: float, lps=None, temps=None) -> None:
        self.ids.extend(int(x) for x in ids)
        self.mask.extend([mask] * len(ids))
        self.lps.extend([float(x) for x in lps] if lps is not None else [0.0] * len(ids))
        self.temps.extend([float(x) for x in temps] if temps is not None else [0.0] * len(ids))


class RewardAt(Choice):
    """``sampler.params.env_reward_at``: where the per-turn environment rewards go."""

    episode = "episode"
    turn = "turn"


class Branching(Choice):
    """``sampler.params.branching``: tree-structured episode sampling at tool steps."""

    none = "none"
    arpo = "arpo"
    aepo = "aepo"
    at2po = "at2po"


@dataclasses.dataclass(frozen=True)
class EpisodeSamplerParams:
    """Parameters of :class:`EpisodeSampler` (multi-turn episodes with an environment)."""

    env: str = param("tools", "registered environment (rlpost.envs.ENVS): tools or gymnasium")
    env_params: Optional[Dict[str, Any]] = param(None, "the environment's constructor arguments, e.g. {tools: [calculator]}; null: its defaults")
    max_turns: int = param(4, "model turns per episode (>= 1)")
    max_total_tokens: int = param(256, "response budget in tokens, model and environment together")
    stop_at_tool_call: bool = param(True, "end a model turn at </tool_call> so the environment answers at once")
    env_reward_weight: float = param(0.0, "weight of the per-turn environment rewards; 0 = verifier only")
    env_reward_at: RewardAt = param(RewardAt.episode, "episode: summed into the row reward (component reward_env); turn: token rewards on each turn's last model token (estimators tagged uses_token_rewards: turn_grpo, sao, gae, reinforce_pp)")
    void_turn_filter: bool = param(False, "SimpleTIR's void-turn filter (arXiv:2509.02479): a void episode keeps its reward, gets no loss")
    transcripts: bool = param(True, "write one episode's transcript per step to RUN_DIR/transcripts/")
    branching: Branching = param(Branching.none, "none | arpo (arXiv:2507.19849: entropy-triggered branching after tool responses) | aepo (arXiv:2510.14545: entropy-balanced budget and consecutive-branch penalty) | at2po (arXiv:2601.04767: entropy-guided turn-tree expansion after whole episodes, rlpost/samplers/turn_tree.py)")
    initial_rollouts: int = param(0, "arpo, at2po: global episodes per prompt started from the prompt (0 = half the group); the rest of the group is the branch budget")
    branch_width: int = param(2, "branches (Z) spawned at one branching step")
    branch_probability: float = param(0.5, "alpha of P = alpha + beta * dH, the branching probability at a step after a tool response")
    entropy_weight: float = param(0.2, "beta of P = alpha + beta * dH (dH in nats)")
    entropy_window: int = param(20, "k: tokens at the start of a turn whose mean surprisal is the step's entropy")
    aepo_sensitivity: float = param(1.0, "aepo: beta of m = group * sigmoid(beta * (H_root - H_tool)) global episodes per prompt")
    aepo_penalty: float = param(0.5, "aepo: P is multiplied by (1 - penalty)^l after l consecutive branching steps on the path")
    expansion_iterations: int = param(2, "at2po: expansion rounds sharing the branch budget (authors' script: 2)")
    branch_penalty: float = param(0.05, "at2po: alpha of the node score H - alpha * (siblings - 1) (authors' code: 0.05)")


@SAMPLERS.register(
    "episode",
    description="Multi-turn episodes with an environment (tools, sandboxed Python, Gymnasium games); one row per episode.",
    params=EpisodeSamplerParams,
    episodes=True,
)
class EpisodeSampler(Sampler):
    """Multi-turn episodes: generate a turn for every live episode (one engine call per turn),
    let each episode's environment answer, insert its messages, repeat.

    An episode ends when the environment says done (for ``env=tools``: a turn without a tool
    call, the final answer the task's verifier scores), after ``max_turns`` model turns, when a
    turn hits ``rollout.max_new_tokens`` without ending (truncated), or when the response
    (model + environment tokens) would exceed ``max_total_tokens`` (truncated).

    **Per-turn rewards** (``env_reward_at=turn``): the environment's reward for turn ``k``
    times ``env_reward_weight`` is a token reward on turn ``k``'s last model token
    (``extras['turn_rewards']`` ``[B, R]``, added by the runner to the estimator's token
    rewards); the row reward is then the verifier's alone. ``env_reward_at=episode`` sums them
    into the row reward instead (component ``reward_env``).

    **Branching** (``branching=arpo|aepo``), tree-structured episodes for group methods. A
    group of ``G`` (``algo.n_samples_per_prompt``) rows per prompt starts with ``N`` global
    episodes; the other ``G - N`` rows are the branch budget. After every model turn that
    followed inserted environment text (a tool response), the step's entropy ``H_t`` is the mean
    surprisal ``-log pi(y)`` of the turn's first ``entropy_window`` sampled tokens (an unbiased
    one-sample estimate of the mean token entropy; engines report the sampled token's log-prob,
    not the full distribution: our choice), ``dH = H_t - H_1`` against the episode's first turn,
    and the episode branches with probability ``P = clip(alpha + beta * dH, 0, 1)`` (a seeded
    Bernoulli draw: our reading of the paper's threshold test as a probability). A branch is a
    copy of the episode *before* that turn (ids, masks, rollout log-probs, counters, environment
    state; so it shares the prefix token ids exactly) that samples the turn anew;
    ``branch_width`` branches per step, never beyond the budget. Prompts whose budget is not spent
    when all episodes end get fresh global episodes, so every prompt has ``G`` rows.

    * ``arpo``: "Agentic Reinforced Policy Optimization" (ARPO, arXiv:2507.19849), entropy-based
      adaptive rollout after tool responses; ``N = initial_rollouts`` (0: ``G // 2``).
    * ``aepo``: "Agentic Entropy-Balanced Policy Optimization" (AEPO, arXiv:2510.14545), its
      dynamic entropy-balanced rollout: entropy pre-monitoring sets
      ``N = round(G * sigmoid(aepo_sensitivity * (H_root - H_tool)))`` (clipped to ``[1, G]``),
      where ``H_root`` / ``H_tool`` are the mean first-turn / after-tool-response entropies
      measured on the **previous** step's episodes (our choice: no separate probe rollout; the
      first step uses ``G // 2``), and the branching probability is multiplied by
      ``(1 - aepo_penalty) ** l`` after ``l`` consecutive branching steps on the path (the
      consecutive-branch penalty against over-branching; the penalty's functional form is our
      choice). AEPO's entropy-balanced policy update is a loss, not part of this sampler.

    Loss on shared prefixes: every row keeps the loss on its whole response, so a token shared by
    several branches is trained once per row, each with its row's advantage: in sum it gets the
    mean advantage of the rows sharing it (ARPO's "soft" advantage attribution, their default).
    ``extras['branch_parent']`` (row of the parent, -1 for global episodes) and
    ``extras['branch_prefix_len']`` (shared response tokens) record the tree.

    **Per-turn records** for estimators and methods that judge an episode's turns: with a task
    attached, every model turn's text goes through ``task.extract_answer``;
    ``extras['episode_answer_turns']`` ``[B]`` counts the turns that gave an answer and
    ``extras['episode_distinct_answers']`` ``[B]`` the distinct non-empty ones among them
    (compared after :func:`normalize_turn_answer`; DRIFT's repeat penalty,
    :mod:`rlpost.algos.drift`). ``extras['turn_void']`` ``[B, R]`` is 1 on the last model token of
    every turn the environment reported void (``info['void']``: no well-formed action and no final
    answer; SPEAR's invalid-action penalty, :mod:`rlpost.methods.spear`).

    Args:
        n_samples: episodes per prompt (``algo.n_samples_per_prompt``; SAO uses 1).
        env: registered environment (``rlpost.envs.ENVS``): ``tools`` or ``gymnasium``.
        env_params: its constructor arguments (``{tools: [calculator]}``).
        max_turns: model turns per episode (>= 1).
        max_total_tokens: response budget in tokens, model and environment together.
        stop_at_tool_call: end a model turn at ``</tool_call>`` (so the environment answers at once).
        env_reward_weight: weight of the per-turn environment rewards; 0 = verifier only.
            Non-zero with ``env_reward_at=episode`` makes the sampler score its own rows.
        env_reward_at: ``episode`` or ``turn`` (see above).
        void_turn_filter: SimpleTIR's filter ("SimpleTIR: End-to-End Reinforcement Learning for
            Multi-Turn Tool-Integrated Reasoning", arXiv:2509.02479): an episode with a void turn
            (no well-formed tool call and no final answer; for tool envs a final turn counts as
            void when the task extracts no answer from it) keeps its reward but gets no loss
            (its response mask is zeroed). Our reading of "void" for non-code tools is this one.
        transcripts: write one episode's transcript per step to ``RUN_DIR/transcripts/``.
        branching, initial_rollouts, branch_width, branch_probability, entropy_weight,
        entropy_window, aepo_sensitivity, aepo_penalty: see above.
        expansion_iterations, branch_penalty: ``branching=at2po``, AT²PO's Entropy-Guided Tree Expansion
            ("AT²PO: Agentic Turn-based Policy Optimization via Tree Search", arXiv:2601.04767): the
            ``N`` global episodes run to their end, then ``expansion_iterations`` rounds each re-sample
            the top-scored turns of every prompt's turn tree (score ``H - branch_penalty * (siblings - 1)``)
            from the state before them; :mod:`rlpost.samplers.turn_tree`.

    Raises:
        ValueError / TypeError / ConfigError: bad values, unknown environment or tool.
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int = 1, *, env: str, env_params: Optional[Dict[str, Any]], max_turns: int,
                 max_total_tokens: int, stop_at_tool_call: bool, env_reward_weight: float, env_reward_at: str,
                 void_turn_filter: bool, transcripts: bool, branching: str, initial_rollouts: int, branch_width: int,
                 branch_probability: float, entropy_weight: float, entropy_window: int, aepo_sensitivity: float,
                 aepo_penalty: float, expansion_iterations: int = 2, branch_penalty: float = 0.05) -> None:
        super().__init__(n_samples)

        if int(max_turns) < 1:
            raise ValueError("max_turns must be >= 1")
        if int(max_total_tokens) < 1:
            raise ValueError("max_total_tokens must be >= 1")
        self.env_name, self.env_params = env, dict(env_params or {})
        make_env(env, self.env_params)  # unknown env / tool / parameter: fail at build time
        self.max_turns, self.max_total_tokens = int(max_turns), int(max_total_tokens)
        self.stop_at_tool_call = bool(stop_at_tool_call)
        self.env_reward_weight = float(env_reward_weight)
        self.env_reward_at = str(getattr(env_reward_at, "value", env_reward_at))
        if self.env_reward_at not in ("episode", "turn"):
            raise ValueError(f"env_reward_at={self.env_reward_at!r}: valid choices are episode, turn")
        self.void_turn_filter = bool(void_turn_filter)
        self.transcripts = bool(transcripts)
        self.branching = str(getattr(branching, "value", branching))
        if self.branching not in ("none", "arpo", "aepo", "at2po"):
            raise ValueError(f"branching={self.branching!r}: valid choices are none, arpo, aepo, at2po")
        if int(expansion_iterations) < 1 or float(branch_penalty) < 0:
            raise ValueError(f"expansion_iterations must be >= 1 and branch_penalty >= 0, got {expansion_iterations}, "
                             f"{branch_penalty} (sampler.params.expansion_iterations / branch_penalty)")
        self.expansion_iterations, self.branch_penalty = int(expansion_iterations), float(branch_penalty)
        self._tree: Any = None  # branching=at2po: the step's turn trees (rlpost.samplers.turn_tree.TurnTree)
        if int(initial_rollouts) < 0 or int(branch_width) < 1 or int(entropy_window) < 1:
            raise ValueError("initial_rollouts must be >= 0, branch_width and entropy_window >= 1")
        if not 0.0 <= float(aepo_penalty) <= 1.0:
            raise ValueError("aepo_penalty must be in [0, 1]")
        self.initial_rollouts, self.branch_width = int(initial_rollouts), int(branch_width)
        self.alpha, self.beta, self.k = float(branch_probability), float(entropy_weight), int(entropy_window)
        self.aepo_sensitivity, self.aepo_penalty = float(aepo_sensitivity), float(aepo_penalty)
        self._h_root: Optional[float] = None  # AEPO pre-monitoring: last step's mean first-turn entropy
        self._h_tool: Optional[float] = None  # ... and mean after-tool-response entropy
        self.task: Any = None
        self.examples: Optional[List[Any]] = None
        self.run_dir: Optional[Path] = None

    def attach(self, task: Any = None, examples: Optional[List[Any]] = None, run_dir: Any = None) -> None:
        """Give the sampler the task (prompt rendering, answer extraction), the training examples
        (``ctx.prompt_indices`` index them; environments reset on them) and the run directory."""
        self.task, self.examples = task, examples
        self.run_dir = Path(run_dir) if run_dir is not None else None

    def _example(self, ctx: Any, pos: int) -> Any:

        if self.examples is not None and ctx.prompt_indices is not None:
            return self.examples[int(ctx.prompt_indices[pos])]
        return Example(index=pos, question="", answer=None)

    def n_global(self, group: int) -> int:
        """Global episodes started per prompt for a group of ``group`` rows (all of them without branching)."""
        if self.branching == "none" or group <= 1:
            return group
        if self.branching in ("arpo", "at2po"):
            n = self.initial_rollouts or group // 2
        elif self._h_root is None or self._h_tool is None:
            n = group // 2  # AEPO, first step: sigmoid(0) = 1/2
        else:
            n = round(group / (1.0 + math.exp(-self.aepo_sensitivity * (self._h_root - self._h_tool))))
        return max(1, min(group, int(n)))

    def _new_episode(self, ctx: Any, pos: int, prompt: List[int], tok: Any) -> _Episode:

        env = make_env(self.env_name, self.env_params)
        example = self._example(ctx, pos)
        t0 = time.perf_counter()
        obs = env.reset(example)
        prompt = list(prompt)
        if obs:  # an initial observation joins the user turn (the prompt is what the row was prompted with)
            if self.task is None:
                raise ValueError(f"env={self.env_name} starts with an observation; the sampler needs attach(task=...)")
            ex = Example(example.index, f"{example.question}\n\n{obs}".strip(), example.answer, example.meta)
            prompt = list(self.task.render_prompt(ex, tok))
        e = _Episode(prompt, env, pos=pos, initial_obs=str(obs or ""))
        e.env_seconds += time.perf_counter() - t0
        return e

    def sample(self, engine, prompts, params, ctx):
        """Run every episode of the step to its end; see the class docstring."""

        tok = getattr(engine, "tokenizer", None)
        if tok is None:
            raise ValueError("sampler=episode needs a rollout engine with a tokenizer (rollout=hf or vllm)")
        eos_ids = set(getattr(engine, "eos_ids", None) or [tok.eos_token_id])
        counts = [int(c) for c in self.counts(len(prompts), ctx)]
        eps: List[_Episode] = [self._new_episode(ctx, pos, p, tok)
                               for pos, (p, c) in enumerate(zip(prompts, counts)) for _ in range(self.n_global(c))]
        if not eps:
            raise ValueError("no rollouts requested")
        budget = [c - self.n_global(c) for c in counts]  # branch rows left per prompt
        rng = random.Random(0 if params.seed is None else int(params.seed) * 7919 + int(getattr(ctx, "step", 0) or 0))
        stats = {"root": [], "tool": [], "branches": 0}
        session = getattr(engine, "session", None)
        self._tree = TurnTree() if self.branching == "at2po" and any(budget) else None
        with (session() if session is not None else contextlib.nullcontext()):  # vLLM: prefix cache kept across turns
            if self._tree is not None:  # AT²PO: whole episodes first, then the entropy-guided expansion rounds
                call = self._run(engine, eps, params, ctx, tok, eos_ids, [0] * len(counts), rng, stats, 0)
                call = expand_tree(self, engine, eps, prompts, counts, params, ctx, tok, eos_ids, stats, call,
                                   self._tree, rng)
                budget = [0] * len(counts)
                self._tree = None  # the snapshots (episode copies) are not kept past the step
            else:
                call = self._run(engine, eps, params, ctx, tok, eos_ids, budget, rng, stats, 0)
            fill = [pos for pos, b in enumerate(budget) for _ in range(b)]  # unspent branch budget: fresh global episodes
            if fill:
                more = [self._new_episode(ctx, pos, prompts[pos], tok) for pos in fill]
                for e in more:
                    e.can_branch = False
                eps.extend(more)
                self._run(engine, more, params, ctx, tok, eos_ids, budget, rng, stats, call)
        if self.branching == "aepo" and max(counts) > 1:  # pre-monitoring for the next step (not from evaluation)
            if stats["root"]:
                self._h_root = sum(stats["root"]) / len(stats["root"])
            if stats["tool"]:
                self._h_tool = sum(stats["tool"]) / len(stats["tool"])
        order = sorted(range(len(eps)), key=lambda i: eps[i].pos)  # rows grouped by prompt, creation order kept
        new_row = {old: new for new, old in enumerate(order)}
        eps = [eps[i] for i in order]
        for e in eps:
            e.parent = new_row[e.parent] if e.parent >= 0 else -1
        res = self._assemble(eps, [e.pos for e in eps], engine, prompts, left_pad)
        if stats.get("prompt_tokens"):  # engines that report prefix-cache hits (rollout=vllm)
            res.metrics["episode/prefix_cached_frac"] = stats["cached_tokens"] / stats["prompt_tokens"]
        if self.branching != "none":
            res.metrics["episode/branches"] = float(stats["branches"])
            res.metrics["episode/global_per_prompt"] = float(sum(self.n_global(c) for c in counts) / max(1, len(counts)))
        if self.void_turn_filter and self.task is not None:
            for e in eps:  # a final turn without an answer is void too (SimpleTIR)
                if e.finished and self.task.extract_answer(e.final_text) is None:
                    e.void = True
        episode_env = self.env_reward_weight and self.env_reward_at == "episode"
        if episode_env or self.void_turn_filter:
            score_rows(ctx, res)  # then zero the loss of void episodes / add environment rewards
            if episode_env:
                env_r = self.env_reward_weight * torch.tensor([e.env_reward for e in eps], dtype=torch.float32)
                res.rewards = res.rewards + env_r
                res.extras["reward_env"] = env_r
            if self.void_turn_filter:
                void = torch.tensor([e.void for e in eps], dtype=torch.bool)
                res.generation.response_mask[void] = 0.0
                res.metrics["episode/void_filtered_frac"] = float(void.float().mean())
        self._write_transcript(ctx, eps, res)
        return res

    def _entropy(self, lps: List[float]) -> float:
        """Mean surprisal (nats) of the first ``entropy_window`` sampled tokens of a turn."""
        head = lps[: self.k]
        return -sum(head) / len(head) if head else 0.0

    def _run(self, engine, eps, params, ctx, tok, eos_ids, budget, rng, stats, call):  # noqa: C901 - one readable loop
        """Advance ``eps`` (and the branches they spawn, appended to ``eps``) turn by turn until all are done.

        One engine call per round for every live episode. Returns the next engine-call number
        (the seed of call ``c`` is :func:`step_params`'s; call 0 keeps ``params.seed``).
        """
        while True:
            live = [e for e in eps if not e.done]
            if not live:
                return call
            self.round(engine, live, step_params(params, ctx, call), tok, eos_ids, eps, budget, rng, stats)
            call += 1

    def round(self, engine, live: List[_Episode], params, tok, eos_ids, eps=None, budget=None, rng=None,
              stats=None) -> None:
        """One engine call: every episode of ``live`` (not done) speaks one turn and its environment answers.

        Used turn by turn by :meth:`sample` and, across RL steps, by the partial-rollout producer
        (:class:`rlpost.samplers.episode_partial.EpisodePartialProducer`), which carries the
        ``_Episode`` objects (ids, masks, log-probs, turn count, environment) between steps.
        ``eps``, ``budget``, ``rng``, ``stats``: branching only (branches are appended to ``eps``).
        """
        stop = list(params.stop) + ([TOOL_CALL_STOP] if self.stop_at_tool_call else [])
        stats = stats if stats is not None else {"root": [], "tool": [], "branches": 0}
        room = [self.max_total_tokens - len(e.ids) for e in live]
        sp = dataclasses.replace(params, stop=stop,
                                 max_new_tokens=max(1, min(int(params.max_new_tokens), max(room))))
        # branching candidates: the state before a turn that follows a tool response (copied lazily)
        snaps = {}
        if self.branching in ("arpo", "aepo") and eps is not None:
            for e in live:
                if e.after_tool and e.can_branch and budget[e.pos] > 0:
                    snaps[id(e)] = copy.deepcopy(e)
        tree = self._tree if self.branching == "at2po" else None
        if tree is not None:
            for e in live:  # AT²PO: the node of this turn, and the state before it (rlpost/samplers/turn_tree.py)
                tree.before_turn(e)
        gen = engine.generate([e.prompt + e.ids for e in live], sp)
        cached = getattr(engine, "last_cached_tokens", None)  # rollout=vllm: prompt tokens served from its prefix cache
        if cached is not None:
            stats["cached_tokens"] = stats.get("cached_tokens", 0) + int(cached)
            stats["prompt_tokens"] = stats.get("prompt_tokens", 0) + sum(len(e.prompt) + len(e.ids) for e in live)
        for j, e in enumerate(live):
            keep = gen.response_mask[j] > 0
            ids, lps, temps = gen.response_ids[j][keep], gen.rollout_logprobs[j][keep], gen.temperatures[j][keep]
            cut = len(ids) > room[j]
            text = gen.texts[j]
            if cut:
                ids, lps, temps = ids[: room[j]], lps[: room[j]], temps[: room[j]]
                text = tok.decode(ids.tolist(), skip_special_tokens=True)
            e.add(ids.tolist(), 1.0, lps.tolist(), temps.tolist())
            e.turns += 1
            e.final_text = text
            if self.task is not None:  # the turn's answer, if the task extracts one (DRIFT's repeat penalty)
                a = self.task.extract_answer(text)
                if a is not None:
                    e.answers.append(normalize_turn_answer(a))
            e.transcript.append({"role": "assistant", "content": text, "tokens": len(ids)})
            if tree is not None:
                tree.after_turn(e, lps.tolist())
            if self.branching in ("arpo", "aepo"):
                h = self._entropy(lps.tolist())
                if e.turns == 1:
                    e.h_first = h
                    stats["root"].append(h)
                elif e.after_tool:
                    stats["tool"].append(h)
                if id(e) in snaps and budget is not None:
                    self._maybe_branch(e, snaps[id(e)], h, eps, budget, rng, stats)
            e.after_tool = False
            e.turn_lens.append(int(len(ids)))
            if cut or not bool(gen.finished[j]):  # the turn did not end: the episode is truncated
                e.done, e.truncated, e.finished = True, True, False
                continue
            # at the turn cap no observation can be used: the environment answers without acting
            # (Env.step_at_cap: a tool environment runs no tool; a game still takes its last action)
            step, secs = _timed_step(e.env, text, last=e.turns >= self.max_turns)
            e.env_seconds += secs
            e.env_reward += float(step.reward)
            if float(step.reward) != 0.0 and len(e.ids):  # on the turn's last model token
                e.turn_rewards.append((len(e.ids) - 1, float(step.reward)))
            info = step.info
            e.tool_calls += int(info.get("tool_calls", 0))
            e.tool_errors += int(info.get("tool_errors", 0))
            e.tool_timeouts += int(info.get("tool_timeouts", 0))
            e.env_errors += int(info.get("env_errors", 0))
            e.calls_skipped += int(info.get("tool_calls_skipped", 0))
            e.void = e.void or bool(info.get("void", 0))
            if info.get("void", 0) and len(e.ids):  # the turn's last model token (SPEAR's invalid-action penalty)
                e.void_turns.append(len(e.ids) - 1)
            if step.done:
                e.done, e.finished = True, True
                continue
            if e.turns >= self.max_turns:  # out of turns while still acting
                e.done, e.truncated = True, True
                continue
            ins = render_insert(tok, step.messages, after_eos=int(ids[-1]) in eos_ids) if len(ids) else []
            e.transcript.extend({"role": m["role"], "content": m["content"], "tokens": len(ins)} for m in step.messages)
            if len(e.ids) + len(ins) >= self.max_total_tokens:
                e.done, e.truncated = True, True
                continue
            e.add(ins, 0.0)
            e.after_tool = True

    def _maybe_branch(self, e: _Episode, snap: _Episode, h: float, eps: List[_Episode], budget: List[int],
                      rng: random.Random, stats: Dict[str, Any]) -> None:
        """ARPO / AEPO branching decision at episode ``e``'s turn that followed a tool response.

        ``snap`` is ``e`` before that turn; each branch is a deep copy of it (same prefix ids,
        masks, log-probs, counters, environment state) that samples the turn anew.
        """
        dh = h - (e.h_first if e.h_first is not None else h)
        p = self.alpha + self.beta * dh
        if self.branching == "aepo":
            p *= (1.0 - self.aepo_penalty) ** e.consecutive
        p = min(1.0, max(0.0, p))
        if rng.random() >= p:
            e.consecutive = 0
            return
        e.consecutive += 1
        parent = next(i for i, x in enumerate(eps) if x is e)  # identity: a dataclass == compares fields
        for _ in range(min(self.branch_width, budget[e.pos])):
            b = copy.deepcopy(snap)
            b.parent, b.prefix_len, b.consecutive = parent, len(snap.ids), e.consecutive
            b.after_tool = False  # it samples the branching turn now; it may branch again at later tool steps
            eps.append(b)
            budget[e.pos] -= 1
            stats["branches"] += 1

    def _assemble(self, eps: List[_Episode], gi: List[int], engine: Any, prompts: Any, left_pad: Any) -> SampleResult:
        pad = pad_id_of(engine)
        B, R = len(eps), max(1, max(len(e.ids) for e in eps))
        p_ids, p_mask = left_pad([e.prompt for e in eps], pad)
        ids = torch.full((B, R), pad, dtype=torch.long)
        mask, lps, temps = torch.zeros(B, R), torch.zeros(B, R), torch.zeros(B, R)
        for i, e in enumerate(eps):
            n = len(e.ids)
            ids[i, :n] = torch.tensor(e.ids, dtype=torch.long)
            mask[i, :n] = torch.tensor(e.mask)
            lps[i, :n] = torch.tensor(e.lps)
            temps[i, :n] = torch.tensor(e.temps)
        gen = GenerationResult(p_ids, p_mask, ids, mask, lps, temps,
                               torch.tensor([e.finished for e in eps], dtype=torch.bool), [e.final_text for e in eps])
        f = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
        extras = {"episode_turns": f([e.turns for e in eps]), "episode_tool_calls": f([e.tool_calls for e in eps])}
        # DAPO's overlong shaping of an episode compares its longest model turn with the per-turn budget
        # (rollout.max_new_tokens), never the model tokens summed over turns (docs/AGENTS.md)
        extras["overlong_lengths"] = torch.tensor([max(e.turn_lens, default=0) for e in eps], dtype=torch.long)
        if self.task is not None:  # turns whose text held an answer, and how many distinct answers they gave
            extras["episode_answer_turns"] = f([len(e.answers) for e in eps])
            extras["episode_distinct_answers"] = f([len({a for a in e.answers if a}) for e in eps])
        void = torch.zeros(B, R)
        for i, e in enumerate(eps):
            for t in e.void_turns:
                void[i, t] = 1.0
        extras["turn_void"] = void
        # the trainer and the critic attend to every real response token, environment text included (their
        # default, the loss mask, would hide the tool results the model saw when it sampled the next turn)
        attn = torch.zeros(B, R, dtype=torch.long)
        for i, e in enumerate(eps):
            attn[i, : len(e.ids)] = 1
        extras["response_attn"] = attn
        if self.env_reward_at == "turn" and self.env_reward_weight:
            tr = torch.zeros(B, R)
            for i, e in enumerate(eps):
                for t, r in e.turn_rewards:
                    tr[i, t] += self.env_reward_weight * r
            extras["turn_rewards"] = tr
        if self.branching != "none":
            extras["branch_parent"] = torch.tensor([e.parent for e in eps], dtype=torch.long)
            extras["branch_prefix_len"] = torch.tensor([e.prefix_len for e in eps], dtype=torch.long)
        n_calls = sum(e.tool_calls for e in eps)
        metrics = {
            "episode/turns_mean": float(sum(e.turns for e in eps) / B),
            "episode/tool_calls_mean": float(n_calls / B),
            "episode/tool_call_frac": float(sum(e.tool_calls > 0 for e in eps) / B),
            "episode/tool_error_rate": float(sum(e.tool_errors for e in eps) / max(1, n_calls)),
            "episode/tool_timeout_rate": float(sum(e.tool_timeouts for e in eps) / max(1, n_calls)),
            "episode/env_error_frac": float(sum(e.env_errors > 0 for e in eps) / B),
            "episode/truncated_frac": float(sum(e.truncated for e in eps) / B),
            "episode/tool_calls_skipped_mean": float(sum(e.calls_skipped for e in eps) / B),
            "episode/void_frac": float(sum(e.void for e in eps) / B),
            "episode/env_tokens_mean": float(sum(len(e.ids) - sum(e.mask) for e in eps) / B),
            "episode/env_seconds": float(sum(e.env_seconds for e in eps)),
        }
        return SampleResult(gen, torch.tensor(gi, dtype=torch.long), B, extras, metrics)

    def _write_transcript(self, ctx: Any, eps: List[_Episode], res: SampleResult) -> None:
        """``RUN_DIR/transcripts/step_NNNNNN.json``: the first episode of the step (turns, counters, reward if known)."""
        if not self.transcripts or self.run_dir is None:
            return
        try:
            e = eps[0]
            d = self.run_dir / "transcripts"
            d.mkdir(parents=True, exist_ok=True)
            rec = {"step": ctx.step, "prompt_index": (ctx.prompt_indices or [None])[0], "turns": e.turns,
                   "tool_calls": e.tool_calls, "tool_errors": e.tool_errors, "truncated": e.truncated,
                   "void": e.void, "reward": float(res.rewards[0]) if res.rewards is not None else None,
                   "transcript": e.transcript}
            (d / f"step_{int(ctx.step):06d}.json").write_text(json.dumps(rec, indent=1))
        except OSError:  # pragma: no cover - a full disk must not stop training
            pass


def _timed_step(env: Any, text: str, last: bool = False):

    return timed_step(env, text, last=last)
