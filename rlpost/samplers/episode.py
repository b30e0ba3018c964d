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

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from rlpost.registry import param
from rlpost.rollout.base import GenerationResult
from rlpost.samplers.base import SAMPLERS, SampleResult, Sampler, pad_id_of, score_rows, step_params

#: stop string that ends a model turn at a tool call (the engine keeps it in the response)
TOOL_CALL_STOP = "</tool_call>"
_SENTINEL = "\u2063RLPOST_MODEL_TURN\u2063"


def render_insert(tokenizer: Any, messages: List[Dict[str, str]], after_eos: bool) -> List[int]:
    """Token ids of environment ``messages`` inserted after a model turn, up to the next assistant header.

    The text is the chat template's own rendering of the messages, cut just after a
    stand-in assistant turn: ``template([user, assistant(S), *messages], add_generation_prompt)``
    from the end of ``S`` on. When the model's turn ended with its end-of-turn token
    (``after_eos``) that token's text, already sampled, is not inserted again; when the
    turn stopped at ``</tool_call>`` the template's end-of-turn text is inserted (no loss
    on it). Tokenizers without a chat template get ``<role>\\ncontent\\n</role>`` blocks.

    Returns:
        the inserted ids (only this text is tokenised; the model's text never is).
    """
    if getattr(tokenizer, "chat_template", None):
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        full = tokenizer.apply_chat_template(base + list(messages), tokenize=False, add_generation_prompt=True)
        delta = full[full.index(_SENTINEL) + len(_SENTINEL):]
        eos = tokenizer.eos_token or ""
        if after_eos and eos and delta.startswith(eos):
            delta = delta[len(eos):]
    else:
        delta = "\n" + "".join(f"<{m['role']}>\n{m['content']}\n</{m['role']}>\n" for m in messages)
    return list(tokenizer(delta, add_special_tokens=False)["input_ids"])


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

    def add(self, ids, mask: float, lps=None, temps=None) -> None:
        self.ids.extend(int(x) for x in ids)
        self.mask.extend([mask] * len(ids))
        self.lps.extend([float(x) for x in lps] if lps is not None else [0.0] * len(ids))
        self.temps.extend([float(x) for x in temps] if temps is not None else [0.0] * len(ids))


@dataclasses.dataclass(frozen=True)
class EpisodeSamplerParams:
    """Parameters of :class:`EpisodeSampler` (multi-turn episodes with an environment)."""

    env: str = param("tools", "registered environment (rlpost.envs.ENVS): tools or gymnasium")
    env_params: Optional[Dict[str, Any]] = param(None, "the environment's constructor arguments, e.g. {tools: [calculator]}; null: its defaults")
    max_turns: int = param(4, "model turns per episode (>= 1)")
    max_total_tokens: int = param(256, "response budget in tokens, model and environment together")
    stop_at_tool_call: bool = param(True, "end a model turn at </tool_call> so the environment answers at once")
    env_reward_weight: float = param(0.0, "weight of the summed per-turn environment rewards (component reward_env); 0 = verifier only")
    void_turn_filter: bool = param(False, "SimpleTIR's void-turn filter (arXiv:2509.02479): a void episode keeps its reward, gets no loss")
    transcripts: bool = param(True, "write one episode's transcript per step to RUN_DIR/transcripts/")


@SAMPLERS.register(
    "episode",
    description="Multi-turn episodes with an environment (tools, sandboxed Python, Gymnasium games); one row per episode.",
    params=EpisodeSamplerParams,
)
class EpisodeSampler(Sampler):
    """Multi-turn episodes: generate a turn for every live episode (one engine call per turn),
    let each episode's environment answer, insert its messages, repeat.

    An episode ends when the environment says done (for ``env=tools``: a turn without a tool
    call, the final answer the task's verifier scores), after ``max_turns`` model turns, when a
    turn hits ``rollout.max_new_tokens`` without ending (truncated), or when the response
    (model + environment tokens) would exceed ``max_total_tokens`` (truncated).

    Args:
        n_samples: episodes per prompt (``algo.n_samples_per_prompt``; SAO uses 1).
        env: registered environment (``rlpost.envs.ENVS``): ``tools`` or ``gymnasium``.
        env_params: its constructor arguments (``{tools: [calculator]}``).
        max_turns: model turns per episode (>= 1).
        max_total_tokens: response budget in tokens, model and environment together.
        stop_at_tool_call: end a model turn at ``</tool_call>`` (so the environment answers at once).
        env_reward_weight: weight of the summed per-turn environment rewards added to the
            verifier's reward (component ``reward_env``); 0 = verifier only. Non-zero makes the
            sampler score its own rows.
        void_turn_filter: SimpleTIR's filter ("SimpleTIR: End-to-End Reinforcement Learning for
            Multi-Turn Tool-Integrated Reasoning", arXiv:2509.02479): an episode with a void turn
            (no well-formed tool call and no final answer; for tool envs a final turn counts as
            void when the task extracts no answer from it) keeps its reward but gets no loss
            (its response mask is zeroed). Our reading of "void" for non-code tools is this one.
        transcripts: write one episode's transcript per step to ``RUN_DIR/transcripts/``.

    Raises:
        ValueError / TypeError / ConfigError: bad values, unknown environment or tool.
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int = 1, *, env: str, env_params: Optional[Dict[str, Any]], max_turns: int,
                 max_total_tokens: int, stop_at_tool_call: bool, env_reward_weight: float, void_turn_filter: bool,
                 transcripts: bool) -> None:
        super().__init__(n_samples)
        from rlpost.envs import make_env

        if int(max_turns) < 1:
            raise ValueError("max_turns must be >= 1")
        if int(max_total_tokens) < 1:
            raise ValueError("max_total_tokens must be >= 1")
        self.env_name, self.env_params = env, dict(env_params or {})
        make_env(env, self.env_params)  # unknown env / tool / parameter: fail at build time
        self.max_turns, self.max_total_tokens = int(max_turns), int(max_total_tokens)
        self.stop_at_tool_call = bool(stop_at_tool_call)
        self.env_reward_weight = float(env_reward_weight)
        self.void_turn_filter = bool(void_turn_filter)
        self.transcripts = bool(transcripts)
        self.task: Any = None
        self.examples: Optional[List[Any]] = None
        self.run_dir: Optional[Path] = None

    def attach(self, task: Any = None, examples: Optional[List[Any]] = None, run_dir: Any = None) -> None:
        """Give the sampler the task (prompt rendering, answer extraction), the training examples
        (``ctx.prompt_indices`` index them; environments reset on them) and the run directory."""
        self.task, self.examples = task, examples
        self.run_dir = Path(run_dir) if run_dir is not None else None

    def _example(self, ctx: Any, pos: int) -> Any:
        from rlpost.tasks.base import Example

        if self.examples is not None and ctx.prompt_indices is not None:
            return self.examples[int(ctx.prompt_indices[pos])]
        return Example(index=pos, question="", answer=None)

    def sample(self, engine, prompts, params, ctx):  # noqa: C901 - one readable loop
        """Run every episode of the step to its end; see the class docstring."""
        from rlpost.envs import make_env
        from rlpost.rollout.hf import left_pad
        from rlpost.tasks.base import Example

        tok = getattr(engine, "tokenizer", None)
        if tok is None:
            raise ValueError("sampler=episode needs a rollout engine with a tokenizer (rollout=hf or vllm)")
        eos_ids = set(getattr(engine, "eos_ids", None) or [tok.eos_token_id])
        counts = self.counts(len(prompts), ctx)
        eps: List[_Episode] = []
        gi: List[int] = []
        for pos, (p, c) in enumerate(zip(prompts, counts)):
            for _ in range(int(c)):
                env = make_env(self.env_name, self.env_params)
                example = self._example(ctx, pos)
                t0 = time.perf_counter()
                obs = env.reset(example)
                prompt = list(p)
                if obs:  # an initial observation joins the user turn (the prompt is what the row was prompted with)
                    if self.task is None:
                        raise ValueError(f"env={self.env_name} starts with an observation; the sampler needs attach(task=...)")
                    ex = Example(example.index, f"{example.question}\n\n{obs}".strip(), example.answer, example.meta)
                    prompt = list(self.task.render_prompt(ex, tok))
                e = _Episode(prompt, env)
                e.env_seconds += time.perf_counter() - t0
                eps.append(e)
                gi.append(pos)
        if not eps:
            raise ValueError("no rollouts requested")
        stop = list(params.stop) + ([TOOL_CALL_STOP] if self.stop_at_tool_call else [])
        for turn in range(self.max_turns):
            live = [e for e in eps if not e.done]
            if not live:
                break
            room = [self.max_total_tokens - len(e.ids) for e in live]
            sp = dataclasses.replace(step_params(params, ctx, turn), stop=stop,
                                     max_new_tokens=max(1, min(int(params.max_new_tokens), max(room))))
            gen = engine.generate([e.prompt + e.ids for e in live], sp)
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
                e.transcript.append({"role": "assistant", "content": text, "tokens": len(ids)})
                if cut or not bool(gen.finished[j]):  # the turn did not end: the episode is truncated
                    e.done, e.truncated, e.finished = True, True, False
                    continue
                step, secs = _timed_step(e.env, text)
                e.env_seconds += secs
                e.env_reward += float(step.reward)
                info = step.info
                e.tool_calls += int(info.get("tool_calls", 0))
                e.tool_errors += int(info.get("tool_errors", 0))
                e.tool_timeouts += int(info.get("tool_timeouts", 0))
                e.env_errors += int(info.get("env_errors", 0))
                e.void = e.void or bool(info.get("void", 0))
                if step.done:
                    e.done, e.finished = True, True
                    continue
                if turn == self.max_turns - 1:  # out of turns while still acting
                    e.done, e.truncated = True, True
                    continue
                ins = render_insert(tok, step.messages, after_eos=int(ids[-1]) in eos_ids) if len(ids) else []
                e.transcript.extend({"role": m["role"], "content": m["content"], "tokens": len(ins)} for m in step.messages)
                if len(e.ids) + len(ins) >= self.max_total_tokens:
                    e.done, e.truncated = True, True
                    continue
                e.add(ins, 0.0)
        res = self._assemble(eps, gi, engine, prompts, left_pad)
        if self.void_turn_filter and self.task is not None:
            for i, e in enumerate(eps):  # a final turn without an answer is void too (SimpleTIR)
                if e.finished and self.task.extract_answer(e.final_text) is None:
                    e.void = True
        if self.env_reward_weight or self.void_turn_filter:
            score_rows(ctx, res)  # then zero the loss of void episodes / add environment rewards
            if self.env_reward_weight:
                env_r = self.env_reward_weight * torch.tensor([e.env_reward for e in eps], dtype=torch.float32)
                res.rewards = res.rewards + env_r
                res.extras["reward_env"] = env_r
            if self.void_turn_filter:
                void = torch.tensor([e.void for e in eps], dtype=torch.bool)
                res.generation.response_mask[void] = 0.0
                res.metrics["episode/void_filtered_frac"] = float(void.float().mean())
        self._write_transcript(ctx, eps, res)
        return res

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
        # the trainer and the critic attend to every real response token, environment text included (their
        # default, the loss mask, would hide the tool results the model saw when it sampled the next turn)
        attn = torch.zeros(B, R, dtype=torch.long)
        for i, e in enumerate(eps):
            attn[i, : len(e.ids)] = 1
        extras["response_attn"] = attn
        n_calls = sum(e.tool_calls for e in eps)
        metrics = {
            "episode/turns_mean": float(sum(e.turns for e in eps) / B),
            "episode/tool_calls_mean": float(n_calls / B),
            "episode/tool_call_frac": float(sum(e.tool_calls > 0 for e in eps) / B),
            "episode/tool_error_rate": float(sum(e.tool_errors for e in eps) / max(1, n_calls)),
            "episode/tool_timeout_rate": float(sum(e.tool_timeouts for e in eps) / max(1, n_calls)),
            "episode/env_error_frac": float(sum(e.env_errors > 0 for e in eps) / B),
            "episode/truncated_frac": float(sum(e.truncated for e in eps) / B),
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


def _timed_step(env: Any, text: str):
    from rlpost.envs.base import timed_step

    return timed_step(env, text)
