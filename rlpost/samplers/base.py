"""Samplers: how the chosen prompts become rollouts through the rollout engine.

A sampler may call the engine several times per step (extra rounds, branches
from shared prefixes) and reports how many rollouts it spent. Samplers that
decide on rewards (extra rounds for hard prompts, variance-guided top-ups) read
them through :attr:`SamplerContext.score`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from rlpost.core.registry import Registry
from rlpost.rollout.base import GenerationResult, RolloutEngine, SamplingParams, concat_generations  # noqa: F401
from rlpost.core.errors import ConfigError

SAMPLERS = Registry("sampler", "sampler", typed_params=True)


@dataclass
class SampleResult:
    """Rollouts of one step.

    Attributes:
        generation: the concatenated :class:`GenerationResult` (``B`` rows). Its
            ``prompt_ids`` are what each row was really prompted with (a sampler may
            add a prefix), and its ``response_mask`` is the loss mask (tree
            branches zero it on the prefix they share with their parent).
        group_index: ``[B]`` long, position of each row's prompt in the step's
            prompt list (rows answering the same prompt share it).
        rollouts_spent: rollouts generated this step, including any discarded.
            A tree branch counts as one rollout.
        extras: optional ``[B]`` / ``[B, R]`` tensors for the batch (e.g.
            ``baseline_rewards``, ``shared_prefix_len``, ``replay_age``), copied into
            ``RolloutBatch.extras``.
        metrics: sampler metrics (``sampler/...``).
        rewards: ``[B]`` float rewards when the sampler already scored every row
            through :func:`score_rows` (the driver then never scores them again),
            else None (the driver scores every row once). A sampler scores all of
            its rows or none. The reward components sit in ``extras['reward_<part>']``.
        prompt_position: ``[B]`` long position of each row's prompt when
            ``group_index`` is a finer grouping than "same prompt" (3PO's
            per-parameter-sample groups); None means ``group_index`` is it.
        dropped: ``(prompt position, rewards)`` of scored rows a pruning sampler left
            out of the batch (D3S); the driver adds them to the selector's
            observations so pruning never hides a group's outcome.
    """

    generation: GenerationResult
    group_index: torch.Tensor
    rollouts_spent: int
    extras: Dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)
    rewards: Optional[torch.Tensor] = None
    prompt_position: Optional[torch.Tensor] = None
    dropped: List[Tuple[int, List[float]]] = field(default_factory=list)

    def positions(self) -> torch.Tensor:
        """``[B]`` position of each row's prompt in the step's prompt list."""
        return self.group_index if self.prompt_position is None else self.prompt_position


@dataclass
class SamplerContext:
    """What a sampler may use besides the engine.

    Attributes:
        score: ``fn(rows: list[int] prompt positions, texts: list[str], lengths: [n] generated
            tokens) -> rlpost.rewards.Rewards``: the step's one reward function,
            ``rows[i]`` being the position (in the step's prompt list) of the prompt
            that ``texts[i]`` answers; None when unavailable (samplers that need it
            raise ``ValueError``). Call it through :func:`score_rows`, once per row.
        step: the RL step.
        seed: base seed for this step's sampling (each engine call derives its own).
        prompt_indices: dataset index of each prompt of the step (parallel to the
            ``prompts`` argument), or None. Samplers with per-prompt memory (AR3PO's
            response cache) key on it.
        rollout_counts: rollouts to draw for each prompt, set by a selector that
            allocates the rollout budget (CurES); None means ``n_samples`` each.
    """

    score: Optional[Callable[[List[int], List[str], torch.Tensor], Any]] = None
    step: int = 0
    seed: int = 0
    prompt_indices: Optional[List[int]] = None
    rollout_counts: Optional[List[int]] = None


# ----------------------------------------------------------------- helpers
def pad_id_of(engine: Any) -> int:
    """The engine's pad token id (0 when it has none)."""
    return int(getattr(engine, "pad_id", 0) or 0)


def engine_model(engine: Any, needs: str) -> torch.nn.Module:
    """The rollout engine's torch model (the hf engine's ``model``), for samplers that read or feed it directly.

    Raises:
        ConfigError: the engine has none (vLLM, a remote engine); ``needs`` says what the sampler needs it for.
    """
    model = getattr(engine, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{needs}: use rollout=hf (this engine has no torch model).")
    return model


def select_rows(gen: GenerationResult, rows: Sequence[int]) -> GenerationResult:
    """The sub-result made of ``rows`` (in that order); widths are kept."""
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    return GenerationResult(
        prompt_ids=gen.prompt_ids[idx],
        prompt_mask=gen.prompt_mask[idx],
        response_ids=gen.response_ids[idx],
        response_mask=gen.response_mask[idx],
        rollout_logprobs=gen.rollout_logprobs[idx],
        temperatures=gen.temperatures[idx],
        finished=gen.finished[idx],
        texts=[gen.texts[i] for i in idx.tolist()],
    )


def merge_results(parts: Sequence[SampleResult], pad_id: int = 0) -> SampleResult:
    """Concatenate sample results that index the *same* prompt list (extra rounds).

    ``group_index`` values are kept as they are, ``rollouts_spent`` summed, extras
    concatenated (``[B, R]`` extras right-padded with 0), rewards concatenated when
    every part has them.
    """
    gen = concat_generations([p.generation for p in parts], pad_id)
    R = gen.response_ids.shape[1]
    extras: Dict[str, torch.Tensor] = {}
    keys = set().union(*(p.extras.keys() for p in parts))
    for k in keys:
        cols = []
        for p in parts:
            B = p.group_index.shape[0]
            t = p.extras.get(k)
            if t is None:
                like = next(q.extras[k] for q in parts if k in q.extras)
                t = torch.zeros((B,) + tuple(like.shape[1:]), dtype=like.dtype)
            if t.dim() == 2 and t.shape[1] != R:
                t = torch.nn.functional.pad(t, (0, R - t.shape[1]))
            cols.append(t)
        extras[k] = torch.cat(cols)
    rewards = None
    if all(p.rewards is not None for p in parts):
        rewards = torch.cat([p.rewards for p in parts])
    pp = None
    if any(p.prompt_position is not None for p in parts):
        pp = torch.cat([p.positions() for p in parts])
    return SampleResult(
        generation=gen,
        group_index=torch.cat([p.group_index for p in parts]),
        rollouts_spent=sum(p.rollouts_spent for p in parts),
        extras=extras,
        metrics={},
        rewards=rewards,
        prompt_position=pp,
        dropped=[d for p in parts for d in p.dropped],
    )


def step_params(params: SamplingParams, ctx: SamplerContext, call: int) -> SamplingParams:
    """``params`` with a seed derived from ``params.seed`` and the engine call number.

    Several engine calls in one step must not reuse one seed (identical
    continuations); when ``params.seed`` is None sampling stays unseeded. Call 0
    keeps ``params`` unchanged, so one-call samplers match plain group sampling.
    """
    if params.seed is None or call == 0:
        return params
    return dataclasses.replace(params, seed=int(params.seed) + 1_000_003 * int(call))


def generate_groups(
    engine: RolloutEngine,
    prompts: Sequence[List[int]],
    counts: Sequence[int],
    params: SamplingParams,
    positions: Optional[Sequence[int]] = None,
) -> SampleResult:
    """``counts[i]`` rollouts of ``prompts[i]`` in one engine call.

    Args:
        positions: group id written for prompt ``i`` (default ``i``).

    Returns:
        a :class:`SampleResult` (``rollouts_spent`` = ``sum(counts)``).

    Raises:
        ValueError: every count is 0.
    """
    pos = list(range(len(prompts))) if positions is None else list(positions)
    rows, gi = [], []
    for p, c, g in zip(prompts, counts, pos):
        rows.extend([p] * int(c))
        gi.extend([g] * int(c))
    if not rows:
        raise ValueError("no rollouts requested")
    gen = engine.generate(rows, params)
    return SampleResult(generation=gen, group_index=torch.tensor(gi, dtype=torch.long), rollouts_spent=len(rows))


#: per-row reward extras :func:`score_rows` writes (the components, then the format flag)
REWARD_EXTRAS = ("reward_correct", "reward_format", "reward_overlong", "reward_length", "format_ok")


def response_lengths(res: SampleResult) -> torch.Tensor:
    """``[B]`` long generated-token length of each row's whole response.

    The response mask summed, plus ``extras['shared_prefix_len']`` when present
    (a tree branch's response is its parent's prefix + its own suffix, and the
    verifier judges both). A hint (SEELE) is part of the prompt, not counted.
    """
    n = res.generation.response_mask.sum(-1).long()
    pre = res.extras.get("shared_prefix_len")
    return n + pre.long() if pre is not None else n


def _takes(fn: Any, name: str) -> bool:
    """Whether callable ``fn`` accepts keyword ``name`` (or ``**kwargs``)."""
    import inspect

    try:
        ps = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in ps)


def score_rows(ctx: SamplerContext, res: SampleResult) -> torch.Tensor:
    """Score every row of ``res`` once through ``ctx.score``; sets and returns ``res.rewards``.

    The reward components go to ``res.extras['reward_<part>']`` (``[B]``), so
    they travel with their rows through merging, filtering and replay. Rows with
    ``extras['overlong_lengths']`` (episodes: each row's longest model turn) pass it to a
    scorer that takes ``overlong_lengths``, the length DAPO's overlong shaping compares.

    Returns:
        ``[B]`` float32 rewards (``res.rewards``).
    Raises:
        ValueError: the context has no scorer (the sampler needs rewards).
    """
    if ctx.score is None:
        raise ValueError("this sampler decides on rewards and needs SamplerContext.score")
    args = ([int(p) for p in res.positions().tolist()], list(res.generation.texts), response_lengths(res))
    ol = res.extras.get("overlong_lengths")  # episodes: the longest model turn (DAPO's per-turn budget)
    out = ctx.score(*args, overlong_lengths=ol) if ol is not None and _takes(ctx.score, "overlong_lengths") else ctx.score(*args)
    res.rewards = out.total.float()
    for k, v in out.components.items():
        res.extras[f"reward_{k}"] = v.float()
    if out.format_ok is not None:
        res.extras["format_ok"] = out.format_ok.float()
    if getattr(out, "token_rewards", None) is not None:  # process rewards on step-end tokens (rlpost.rewards.process)
        from rlpost.rewards.process import place_token_rewards

        tr = place_token_rewards(out.token_rewards, res.generation.response_mask, res.extras.get("shared_prefix_len"))
        res.extras["turn_rewards"] = tr if "turn_rewards" not in res.extras else res.extras["turn_rewards"] + tr
    return res.rewards


def group_reward_stats(rewards: torch.Tensor, group_index: torch.Tensor, n_groups: int):
    """Per-group ``(count, mean, var)`` float64 tensors of length ``n_groups``.

    ``var`` is the population variance (0 for groups with < 2 rows).
    """
    r = rewards.double()
    cnt = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(r))
    s = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, r)
    mean = s / cnt.clamp(min=1)
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, (r - mean[group_index]) ** 2)
    return cnt, mean, sq / cnt.clamp(min=1)


class Sampler:
    """Base class. ``n_samples``: rollouts per prompt (the group size).

    ``uses_rollout_counts``: whether :meth:`sample` honours a selector's per-prompt
    rollout budget (``ctx.rollout_counts``, CurES); see :func:`check_allocation`.

    Optional hooks the runner calls when a sampler defines them: ``attach(task=,
    examples=, run_dir=)`` right after it is built, and ``setup(services)`` once the
    trainer and engines exist, with the run's
    :class:`rlpost.methods.base.RunServices` (the trainer's policy, its frozen
    reference when one is kept: ``sampler=lens`` scores prompt tokens with both).

    Raises:
        ValueError: ``n_samples < 1``.
        TypeError: parameters this sampler does not take.
    """

    uses_rollout_counts = False

    def __init__(self, n_samples: int, **params: Any) -> None:
        if params:
            raise TypeError(f"{type(self).__name__} takes no parameters {sorted(params)}")
        if n_samples < 1:
            raise ValueError("n_samples must be >= 1")
        self.n_samples = n_samples

    def sample(
        self, engine: RolloutEngine, prompts: List[List[int]], params: SamplingParams, ctx: SamplerContext
    ) -> SampleResult:
        """Rollouts for ``prompts`` (one token-id list per chosen prompt)."""
        raise NotImplementedError

    def counts(self, n_prompts: int, ctx: SamplerContext) -> List[int]:
        """Rollouts per prompt: the selector's allocation when given, else ``n_samples``."""
        if ctx.rollout_counts is not None:
            if len(ctx.rollout_counts) != n_prompts:
                raise ValueError("rollout_counts must have one entry per prompt")
            return [max(0, int(c)) for c in ctx.rollout_counts]
        return [self.n_samples] * n_prompts

    def state_dict(self) -> Dict[str, Any]:
        """Sampler state for checkpoints."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    def eval_task(self, task: Any) -> Any:
        """The task held-out evaluation renders its prompts with (default: ``task`` itself).

        A sampler that conditions its prompts (RC-GRPO's reward tokens, :mod:`rlpost.samplers.rc_grpo`)
        returns a wrapper whose ``render_prompt`` adds the evaluation-time condition; everything else
        (examples, scoring) must stay the task's.
        """
        return task


@SAMPLERS.register("group", description="n rollouts per prompt in one engine call (GRPO-style groups).")
class GroupSampler(Sampler):
    """``n_samples`` independent rollouts of every prompt, in one engine call.

    When a selector allocates the rollout budget (``ctx.rollout_counts``), prompt
    ``i`` gets that many rollouts instead.
    """

    uses_rollout_counts = True

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see base
        return generate_groups(engine, prompts, self.counts(len(prompts), ctx), step_params(params, ctx, 0))


@SAMPLERS.register("single", description="One rollout per prompt (SAO, MSSR).")
class SingleSampler(GroupSampler):
    """One rollout per prompt, whatever ``algo.n_samples_per_prompt`` says."""

    uses_rollout_counts = False

    def __init__(self, n_samples: int = 1, **params: Any) -> None:
        super().__init__(1, **params)

    def counts(self, n_prompts, ctx):  # noqa: D102 - always one
        return [1] * n_prompts


def runs_episodes(name: str) -> bool:
    """Whether sampler ``name`` produces multi-turn episodes (its registry tag ``episodes``).

    Such a sampler subclasses :class:`rlpost.samplers.episode.EpisodeSampler` (environments, turn
    limits, ``attach``), so the run evaluates with episodes and checks episode rewards for it.
    Raises:
        ConfigError: unknown sampler.
    """
    return bool(SAMPLERS.tag(str(name), "episodes", False))


def build_sampler(cfg: Any, n_samples: int) -> Sampler:
    """Instantiate ``cfg.name`` with ``cfg.params`` and the algorithm's group size.

    Raises:
        ConfigError: unknown sampler or parameter.
    """

    cls = SAMPLERS.get(cfg.name)
    try:
        return cls(n_samples, **dict(cfg.params or {}))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"sampler={cfg.name}: bad sampler.params {dict(cfg.params or {})}: {e}") from None
