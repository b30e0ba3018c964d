"""``sampler=rctp`` and ``sampler=rc_grpo``: RC-GRPO's reward-token conditioning of the prompts (both stages).

"RC-GRPO: Reward-Conditioned Group Relative Policy Optimization for Multi-Turn Tool Calling Agents"
(arXiv:2602.03025; no authors' code found). The mechanism and our reading where the paper could not
be read are in :mod:`rlpost.algos.rc_grpo`; in short:

* ``sampler=rctp`` (stage 1, ``algo=rctp``): each prompt's rollouts are drawn under the plain prompt,
  scored, and each row's prompt is then rewritten with the reward token of its own reward (hindsight
  label, :func:`rlpost.algos.rc_grpo.token_for_reward`), so the SFT loss learns ``pi(y | x, token)``
  on trajectories of mixed quality.
* ``sampler=rc_grpo`` (stage 2, ``algo=rc_grpo``): each group's rollouts get a mix of reward tokens
  (:func:`rlpost.algos.rc_grpo.assign_group_tokens`) and are drawn under the prompt tagged with theirs;
  they stay one GRPO group (the prompt's).
* Evaluation (both): :meth:`RewardTokenSampler.eval_task` wraps the task so that every held-out prompt
  carries the high-reward token (``tokens[eval_token]``).

The token is a plain-text tag on the first line of the user turn (:func:`rlpost.algos.rc_grpo.tagged_question`),
rendered by the task with its chat template; not an added special token (rlpost's model group adds
none). Extras: ``reward_token`` ``[B]`` (the row's token index, as float). Metrics:
``sampler/rc_token{k}_rows``, ``sampler/rc_token{k}_reward`` (mean reward of the rows conditioned on or
labelled with token ``k``), ``sampler/rc_mixed_groups_frac`` (groups whose rewards are not all equal).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rlpost.algos.rc_grpo import DEFAULT_TOKENS, PAPER, assign_group_tokens, tagged_question, token_for_reward
from rlpost.core.batch import left_pad
from rlpost.core.registry import Choice, param
from rlpost.samplers.base import (SAMPLERS, SampleResult, Sampler, generate_groups, group_reward_stats, pad_id_of,
                                  score_rows, step_params)


class Assign(Choice):
    """How a group's rollouts get their reward tokens (stage 2)."""

    balanced = "balanced"
    random = "random"


class TrainOn(Choice):
    """Which prompt the loss sees for a conditioned rollout (stage 2)."""

    conditioned = "conditioned"
    original = "original"


_TOKENS_DOC = ("reward tokens, best first (the paper's examples); a plain-text tag on the first line of the user "
               "turn (rlpost's model group adds no special tokens)")
_EVAL_DOC = "index in tokens of the token every evaluation prompt carries (0: the high-reward token)"


@dataclass(frozen=True)
class RCTPSamplerParams:
    """Stage 1: hindsight reward-token labels of the policy's own samples (our reading of RCTP's data)."""

    tokens: List[str] = param(factory=lambda: list(DEFAULT_TOKENS), doc=_TOKENS_DOC)
    reward_bounds: List[float] = param(factory=lambda: [1.0], doc="descending lower reward bound of each token but "
                                       "the last: a row gets the first token whose bound its reward reaches (default: "
                                       "reward 1, a correct answer, is high; anything less low)")
    eval_token: int = param(0, _EVAL_DOC)


@dataclass(frozen=True)
class RCGRPOSamplerParams:
    """Stage 2: a mix of reward tokens within each group (our reading of the per-group mix)."""

    tokens: List[str] = param(factory=lambda: list(DEFAULT_TOKENS), doc=_TOKENS_DOC)
    token_mix: List[float] = param(factory=lambda: [0.5, 0.5], doc="weight of each token in a group (default: half "
                                   "high, half low)")
    assign: Assign = param(Assign.balanced, "balanced: each group split by largest remainder (8 -> 4 + 4); random: "
                           "each rollout's token drawn independently with token_mix")
    train_on: TrainOn = param(TrainOn.conditioned, "conditioned: the loss sees the prompt with the token it was sampled "
                              "under; original: the plain prompt (the token invisible to the loss)")
    eval_token: int = param(0, _EVAL_DOC)


def _check_tokens(tokens: Sequence[str], eval_token: int) -> List[str]:
    toks = [str(t) for t in tokens]
    if len(toks) < 2 or any(not t.strip() for t in toks) or len(set(toks)) != len(toks):
        raise ValueError(f"tokens={toks} must be at least 2 distinct non-empty strings, best first")
    if not 0 <= int(eval_token) < len(toks):
        raise ValueError(f"eval_token={eval_token} must index tokens (0 .. {len(toks) - 1})")
    return toks


class ConditionedTask:
    """A task whose prompts carry reward token ``token`` (evaluation of a reward-conditioned policy).

    Everything but :meth:`render_prompt` is the wrapped task's (examples, scoring, ``cfg``, ``name``).
    """

    def __init__(self, task: Any, token: str) -> None:
        self._task, self.token = task, str(token)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def render_prompt(self, example: Any, tokenizer: Any) -> List[int]:
        """The wrapped task's prompt of ``example`` with :func:`tagged_question` as its question."""
        return self._task.render_prompt(dataclasses.replace(example, question=tagged_question(example.question,
                                                                                                self.token)), tokenizer)


class RewardTokenSampler(Sampler):
    """What both stages share: the vocabulary, the tagged prompts, evaluation under the high token.

    Raises:
        ValueError: (construction) fewer than 2 tokens, duplicates or empty ones, ``eval_token`` out of range.
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int, *, tokens: Sequence[str], eval_token: int) -> None:
        super().__init__(n_samples)
        self.tokens = _check_tokens(tokens, eval_token)
        self.eval_token = int(eval_token)
        self.task: Any = None
        self.examples: Optional[List[Any]] = None
        self._cache: Dict[Tuple[int, int], List[int]] = {}

    def attach(self, task: Any = None, examples: Optional[List[Any]] = None, run_dir: Any = None) -> None:
        """The run's task (renders a tagged prompt) and its training examples."""
        self.task, self.examples = task, examples
        self._cache.clear()

    def eval_task(self, task: Any) -> ConditionedTask:
        """``task`` with every prompt conditioned on ``tokens[eval_token]`` (the paper evaluates under the high token)."""
        return ConditionedTask(task, self.tokens[self.eval_token])

    def tagged_prompt(self, engine: Any, prompt: List[int], pos: int, ctx: Any, k: int) -> List[int]:
        """Token ids of prompt position ``pos`` conditioned on token ``k``.

        With the task and examples attached: the task renders the example with :func:`tagged_question`,
        and ids the driver put after the plain rendering (a hinting selector's hint) follow it. Without
        them: the ids of ``tokens[k] + "\\n"`` in front of the prompt's ids.
        """
        tok = engine.tokenizer
        if self.task is not None and self.examples is not None and ctx.prompt_indices is not None:
            idx = int(ctx.prompt_indices[pos])
            ex = self.examples[idx]
            key = (idx, int(k))
            if key not in self._cache:
                self._cache[key] = list(self.task.render_prompt(
                    dataclasses.replace(ex, question=tagged_question(ex.question, self.tokens[k])), tok))
            if (idx, -1) not in self._cache:
                self._cache[(idx, -1)] = list(self.task.render_prompt(ex, tok))
            plain = self._cache[(idx, -1)]
            tail = list(prompt)[len(plain):] if list(prompt)[: len(plain)] == plain else []
            return self._cache[key] + tail
        return list(tok.encode(self.tokens[k] + "\n", add_special_tokens=False)) + list(prompt)

    def _metrics(self, res: SampleResult, labels: torch.Tensor, n_groups: int) -> Dict[str, float]:
        out: Dict[str, float] = {}
        r = res.rewards
        for k in range(len(self.tokens)):
            sel = labels == k
            out[f"sampler/rc_token{k}_rows"] = float(sel.sum())
            out[f"sampler/rc_token{k}_reward"] = float(r[sel].double().mean()) if r is not None and bool(sel.any()) else 0.0
        if r is not None:
            cnt, _, var = group_reward_stats(r, res.group_index, n_groups)
            have = cnt > 0
            out["sampler/rc_mixed_groups_frac"] = float((var[have] > 0).double().mean()) if bool(have.any()) else 0.0
        return out

    @staticmethod
    def _set_prompts(res: SampleResult, rows: Sequence[List[int]], pad_id: int) -> None:
        ids, mask = left_pad([list(r) for r in rows], pad_id)
        res.generation.prompt_ids, res.generation.prompt_mask = ids.long(), mask.to(res.generation.prompt_mask.dtype)


@SAMPLERS.register("rctp", paper=PAPER + ", stage 1 (RCTP)", params=RCTPSamplerParams,
                   description="Rollouts under the plain prompt, relabelled with the reward token of their reward.")
class RCTPSampler(RewardTokenSampler):
    """Stage 1: plain-prompt rollouts, each row's prompt then tagged with the token of its reward.

    One engine call (the prompts as the driver gave them, ``n_samples`` each or the selector's
    allocation), every row scored; row ``b`` gets token ``token_for_reward(r_b, reward_bounds)`` and
    its prompt ids become that token's tagged prompt. The engine's log-probs refer to the plain prompt
    (the stage-1 loss, ``gpg`` with weight 1, uses none of them).

    Raises:
        ValueError: (construction) see :class:`RewardTokenSampler`; ``reward_bounds`` not one per token
            but the last, or not descending.
    """

    def __init__(self, n_samples: int, *, tokens: Sequence[str], reward_bounds: Sequence[float],
                 eval_token: int) -> None:
        super().__init__(n_samples, tokens=tokens, eval_token=eval_token)
        b = [float(x) for x in reward_bounds]
        if len(b) != len(self.tokens) - 1:
            raise ValueError(f"reward_bounds={b} needs one bound per token but the last ({len(self.tokens) - 1})")
        if any(b[i] < b[i + 1] for i in range(len(b) - 1)):
            raise ValueError(f"reward_bounds={b} must be descending (tokens are best first)")
        self.bounds = b

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        res = generate_groups(engine, prompts, self.counts(len(prompts), ctx), step_params(params, ctx, 0))
        rewards = score_rows(ctx, res)
        labels = torch.tensor([token_for_reward(float(r), self.bounds) for r in rewards.tolist()], dtype=torch.long)
        rows = [self.tagged_prompt(engine, prompts[int(g)], int(g), ctx, int(k))
                for g, k in zip(res.group_index.tolist(), labels.tolist())]
        self._set_prompts(res, rows, pad_id_of(engine))
        res.extras["reward_token"] = labels.float()
        res.metrics = self._metrics(res, labels, len(prompts))
        return res


@SAMPLERS.register("rc_grpo", paper=PAPER, params=RCGRPOSamplerParams,
                   description="Each group's rollouts conditioned on a mix of reward tokens in the prompt.")
class RCGRPOSampler(RewardTokenSampler):
    """Stage 2: every group's rollouts split over the reward tokens, each drawn under its tagged prompt.

    One engine call; the rows of group ``i`` come token by token (``tokens[0]``'s first), all with
    group id ``i``. ``assign=random`` draws the tokens from a generator seeded with ``ctx.seed`` and
    ``ctx.step``. Rows are scored here (for the per-token metrics) when the context has a scorer.

    Raises:
        ValueError: (construction) see :class:`RewardTokenSampler`; ``token_mix`` not one weight per
            token, negative, or summing to 0; an unknown ``assign`` / ``train_on``.
    """

    def __init__(self, n_samples: int, *, tokens: Sequence[str], token_mix: Sequence[float], assign: str,
                 train_on: str, eval_token: int) -> None:
        super().__init__(n_samples, tokens=tokens, eval_token=eval_token)
        mix = [float(w) for w in token_mix]
        if len(mix) != len(self.tokens) or any(w < 0 for w in mix) or sum(mix) <= 0:
            raise ValueError(f"token_mix={mix} needs one non-negative weight per token ({len(self.tokens)}), "
                             f"with a positive sum")
        if str(assign) not in ("balanced", "random"):
            raise ValueError(f"assign={assign!r} must be balanced or random")
        if str(train_on) not in ("conditioned", "original"):
            raise ValueError(f"train_on={train_on!r} must be conditioned or original")
        self.mix, self.assign, self.train_on = mix, str(assign), str(train_on)

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        counts = self.counts(len(prompts), ctx)
        g = torch.Generator().manual_seed((int(ctx.seed) * 1_000_003 + int(ctx.step)) % (2 ** 63 - 1))
        per_group = assign_group_tokens(counts, self.mix, self.assign, g)
        rows, cnt, pos, labels = [], [], [], []
        for i, toks in enumerate(per_group):
            for k in range(len(self.tokens)):
                n = sum(1 for t in toks if t == k)
                if n:
                    rows.append(self.tagged_prompt(engine, prompts[i], i, ctx, k))
                    cnt.append(n)
                    pos.append(i)
                    labels.extend([k] * n)
        res = generate_groups(engine, rows, cnt, step_params(params, ctx, 0), positions=pos)
        lab = torch.tensor(labels, dtype=torch.long)
        res.extras["reward_token"] = lab.float()
        if ctx.score is not None:
            score_rows(ctx, res)
        if self.train_on == "original":
            self._set_prompts(res, [prompts[int(p)] for p in res.group_index.tolist()], pad_id_of(engine))
        res.metrics = self._metrics(res, lab, len(prompts))
        return res
