"""One step of prompt selection + rollout + scoring: the producer contract the runner consumes.

:func:`collect_rollouts` asks the selector for prompts, applies the roles the
selector declares (:class:`rlpost.selectors.base.Role`: hints, rollout budgets,
group filtering with refills, batch replay), runs the sampler, scores every
generated row exactly once through the step's one scorer (unless the sampler
already did, for its own rounds), and computes the rollout accounting metrics
(rollouts spent, prompts skipped, zero-variance share, effective batch size).
The result, :class:`StepRollouts`, is the one scored object every producer
(this driver, :meth:`rlpost.run.runner.Run._partial_rollouts`, the async
executor's producer thread) hands to the learner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from rlpost.core.batch import RolloutBatch
from rlpost.core.errors import ConfigError
from rlpost.rollout.base import RolloutEngine, SamplingParams
from rlpost.samplers.base import (
    SAMPLERS,
    SampleResult,
    Sampler,
    SamplerContext,
    group_reward_stats,
    merge_results,
    pad_id_of,
    score_rows,
    select_rows,
    step_params,
)
from rlpost.selectors.base import Role


@dataclass
class StepRollouts:
    """The scored rollouts of one step: what every producer hands the learner.

    Attributes:
        result: the sampler's output restricted to the batch; ``result.positions()``
            index ``prompt_indices``; ``group_index`` holds compact group ids;
            ``result.extras`` holds the reward components per row
            (``reward_correct``, ``reward_format``, ``reward_overlong``,
            ``reward_length``, summing to ``rewards``) and ``format_ok``.
        prompt_indices: dataset index of each prompt position.
        rewards: ``[B]`` float32 rewards of the batch rows: exactly the numbers
            training uses and the selector learns from.
        observed: ``(dataset index, rewards)`` of every group scored this step,
            including groups dropped by a filter: what ``selector.update`` gets.
        metrics: ``rollout/...``, ``sampler/...``, ``selector/...`` and ``partial/...`` values.
        reward_metrics: ``reward/...`` values (batch means of the components, the
            scorer's verifier-call and failure counts); see :meth:`finish`.
    """

    result: SampleResult
    prompt_indices: List[int]
    rewards: Optional[torch.Tensor]
    observed: List[Tuple[int, List[float]]] = field(default_factory=list)
    metrics: Dict[str, float] = field(default_factory=dict)
    reward_metrics: Dict[str, float] = field(default_factory=dict)

    @property
    def row_prompt_index(self) -> torch.Tensor:
        """``[B]`` long dataset index of each row's prompt."""
        idx = torch.tensor(self.prompt_indices, dtype=torch.long)
        return idx[self.result.positions()]

    def group_rewards(self) -> List[List[float]]:
        """Rewards of each batch group (compact group id order): the per-group statistics' input."""
        gi = self.result.group_index
        n = int(gi.max()) + 1 if len(gi) else 0
        return [[float(x) for x in self.rewards[gi == g]] for g in range(n)]

    def group_stats(self) -> Dict[str, torch.Tensor]:
        """Per batch group: ``count``, ``mean``, ``std`` (population) float64 ``[G]`` of :attr:`rewards`."""

        gi = self.result.group_index
        n = int(gi.max()) + 1 if len(gi) else 0
        cnt, mean, var = group_reward_stats(self.rewards, gi, n)
        return {"count": cnt, "mean": mean, "std": var.sqrt()}

    def finish(self, scorer_metrics: Dict[str, float]) -> "StepRollouts":
        """Set :attr:`reward_metrics`: batch means of ``reward_correct`` / ``format_ok``
        (``reward/correct_mean``, ``reward/format_mean``) plus ``scorer_metrics``; returns self."""
        ex = self.result.extras
        rm: Dict[str, float] = {}
        if "reward_correct" in ex and len(ex["reward_correct"]):
            rm["reward/correct_mean"] = float(ex["reward_correct"].mean())
        if "format_ok" in ex and len(ex["format_ok"]):
            rm["reward/format_mean"] = float(ex["format_ok"].mean())
        self.reward_metrics = {**rm, **scorer_metrics}
        return self

    def to_batch(self, answers: List[Any], version: int, weights_step: int) -> Any:
        """The learner's :class:`rlpost.core.batch.RolloutBatch` of these rollouts.

        Args:
            answers: gold answer of each row (``[B]``, row order).
            version: trainer version (optimizer steps) of the engine weights;
                ``policy_version [B]``, or each row's oldest token's version when
                ``extras['token_version']`` is present (partial rollouts).
            weights_step: RL steps completed by those weights (``extras['policy_step']``
                unless the producer set it per row).
        """

        res, gen = self.result, self.result.generation
        gi = res.group_index
        extras = {"temperatures": gen.temperatures, "policy_step": torch.full((len(gi),), weights_step), **res.extras}
        pversion = torch.full((len(gi),), version, dtype=torch.long)
        if "token_version" in extras:  # partial rollouts: a row is as old as its oldest token
            pversion = row_oldest(extras["token_version"], gen.response_mask)
        return RolloutBatch(
            prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, response_ids=gen.response_ids,
            response_mask=gen.response_mask, rollout_logprobs=gen.rollout_logprobs, group_index=gi,
            prompt_index=self.row_prompt_index, policy_version=pversion, response_texts=gen.texts,
            answers=list(answers), meta=[{} for _ in answers], extras=extras, rewards=self.rewards,
        )

    def update_selector(self, selector: Any) -> None:
        """Feed :attr:`observed` to ``selector.update`` (no-op when nothing was scored)."""
        if self.observed:
            selector.update([i for i, _ in self.observed], [r for _, r in self.observed])


def row_oldest(token_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` smallest of ``token_values`` ``[B, R]`` over each row's ``mask`` (the row's oldest token; -1 if empty)."""
    big = torch.iinfo(token_values.dtype).max
    m = torch.where(mask > 0, token_values, torch.full_like(token_values, big)).min(-1).values
    return torch.where(m == big, torch.full_like(m, -1), m)


def _groups(res: SampleResult) -> Dict[int, List[int]]:
    out: Dict[int, List[int]] = {}
    for r, g in enumerate(res.group_index.tolist()):
        out.setdefault(g, []).append(r)
    return out


def _compact(res: SampleResult, rows: List[int], n_offset_pos: Dict[int, int]) -> SampleResult:
    """Rows ``rows`` of ``res`` with positions remapped through ``n_offset_pos`` and compact group ids."""
    gen = select_rows(res.generation, rows)
    pos = torch.tensor([n_offset_pos[int(res.positions()[r])] for r in rows], dtype=torch.long)
    gmap: Dict[int, int] = {}
    gi = torch.tensor([gmap.setdefault(int(res.group_index[r]), len(gmap)) for r in rows], dtype=torch.long)
    extras = {k: v[rows] for k, v in res.extras.items()}
    rw = res.rewards[rows] if res.rewards is not None else None
    return SampleResult(gen, gi, 0, extras, {}, rw, pos)


def _round_prompts(cur: List[int], encode: Callable[[int], List[int]], selector: Any,
                   hint: Optional[Callable[[int, float], Any]], score: Callable[..., Any]) -> tuple:
    """``(prompt ids, hint texts or None, scorer)`` of one round's prompts ``cur``.

    A hinting selector's hint ids are appended to the prompt; a hinted completion is
    judged together with its hint (the hint is not generated), so the scorer puts it in front.
    """
    prompts = [list(encode(i)) for i in cur]
    fr = selector.hint_fractions(cur) if selector.plays(Role.HINT) else None
    hint_text: Optional[List[str]] = None
    if fr is not None and hint is not None:
        hints = [hint(i, f) if f > 0 else None for i, f in zip(cur, fr)]
        prompts = [p + list(h.ids) if h is not None else p for p, h in zip(prompts, hints)]
        hint_text = [h.text if h is not None else "" for h in hints]

    def score_hinted(rows: List[int], texts: List[str], lengths: torch.Tensor,
                     overlong_lengths: Optional[torch.Tensor] = None) -> Any:
        if hint_text is not None:
            texts = [hint_text[r] + t for r, t in zip(rows, texts)]
        if overlong_lengths is None:  # a plain scorer need not take it
            return score([cur[r] for r in rows], texts, lengths)
        # episodes: each row's longest model turn, the length DAPO's per-turn overlong window compares
        return score([cur[r] for r in rows], texts, lengths, overlong_lengths=overlong_lengths)

    return prompts, hint_text, score_hinted


def _keep_groups(res: SampleResult, cur: List[int], pos: torch.Tensor, selector: Any, target: int, n_kept: int,
                 observed: List[Tuple[int, List[float]]]) -> Tuple[List[int], int, int]:
    """One round's groups through a filtering selector (None: keep all); every scored group is observed.

    Returns ``(kept rows in order, groups kept so far, groups the filter dropped this round)``.
    """
    keep_rows: List[int] = []
    dropped = 0
    left_out: Dict[int, List[float]] = {}  # scored rows a pruning sampler kept out of the batch
    for p_, rs in res.dropped:
        left_out.setdefault(int(p_), []).extend(float(x) for x in rs)
    for g, rows in _groups(res).items():
        r = res.rewards[rows].tolist()
        observed.append((cur[int(pos[rows[0]])], r + left_out.pop(int(pos[rows[0]]), [])))
        if selector is not None and (n_kept >= target or not selector.keep_group(r)):
            dropped += 1 if n_kept < target else 0
            continue
        n_kept += 1
        keep_rows.extend(rows)
    observed.extend((cur[p_], rs) for p_, rs in left_out.items())  # groups pruned whole: still observed
    return sorted(keep_rows), n_kept, dropped


def _merge_rounds(kept_parts: List[SampleResult], engine: RolloutEngine, spent: int) -> Tuple[SampleResult, List[int]]:
    """The kept groups of every round as one result: group ids renumbered across rounds, prompt positions
    compacted to those in use; returns ``(merged, used positions in round order)``."""
    gi_off, pieces = 0, []
    for part in kept_parts:
        part.group_index = part.group_index + gi_off
        gi_off = int(part.group_index.max()) + 1
        pieces.append(part)
    merged = merge_results(pieces, pad_id_of(engine)) if len(pieces) > 1 else pieces[0]
    used = sorted(set(merged.positions().tolist()))
    remap = {p: j for j, p in enumerate(used)}
    merged.prompt_position = torch.tensor([remap[int(p)] for p in merged.positions()], dtype=torch.long)
    if bool((merged.prompt_position == merged.group_index).all()):
        merged.prompt_position = None
    merged.rollouts_spent = spent
    return merged, used


def collect_rollouts(
    selector: Any,
    sampler: Sampler,
    engine: RolloutEngine,
    params: SamplingParams,
    *,
    step: int,
    encode: Callable[[int], List[int]],
    score: Callable[[List[int], List[str], torch.Tensor], Any],
    hint: Optional[Callable[[int, float], Any]] = None,
    seed: int = 0,
) -> StepRollouts:
    """Select prompts and produce the step's scored rollouts.

    Args:
        selector: a :class:`rlpost.selectors.Selector`.
        sampler: a :class:`Sampler`.
        engine: the rollout engine.
        params: sampling parameters (``seed`` set for reproducible rollouts).
        step: the RL step.
        encode: ``fn(dataset index) -> prompt token ids``.
        score: the step's one scorer, ``fn(dataset indices, texts, lengths [n] generated
            tokens) -> rlpost.rewards.Rewards`` (:class:`rlpost.rewards.StepScorer`).
            Each generated row is passed to it exactly once.
        hint: ``fn(dataset index, fraction) -> Hint`` (:class:`rlpost.selectors.mixture.Hint`)
            for selectors that give hints (SEELE); ignored when None. Its ids are
            appended to the prompt (no loss on them); its text is put in front of
            each completion for scoring and in the returned texts.
        seed: base seed of the step's samplers.

    Returns:
        :class:`StepRollouts`. The caller trains on ``result`` and then calls
        ``out.update_selector(selector)``.

    Raises:
        ValueError: the selector chose no prompts.
    """
    filters = selector.plays(Role.FILTER)
    target = selector.prompts_per_step
    max_rounds = selector.max_rounds if filters else 1
    idx = list(selector.select(step))
    if not idx:
        raise ValueError(f"selector {type(selector).__name__} chose no prompts at step {step}; check selector.params")
    skipped_by_selector = int(selector.skipped)
    all_idx: List[int] = []
    kept_parts: List[SampleResult] = []
    observed: List[Tuple[int, List[float]]] = []
    spent = 0
    rounds = 0
    n_kept = 0
    dropped = 0
    smetrics: Dict[str, List[float]] = {}
    fallback = None
    while idx:
        cur = list(idx)
        prompts, hint_text, score_hinted = _round_prompts(cur, encode, selector, hint, score)
        ctx = SamplerContext(
            score=score_hinted,
            step=step,
            seed=seed + 7919 * rounds,
            prompt_indices=cur,
            rollout_counts=selector.rollout_counts(cur) if selector.plays(Role.ALLOCATE) else None,
        )
        res = sampler.sample(engine, prompts, step_params(params, ctx, 97 * rounds), ctx)
        spent += res.rollouts_spent
        for k, v in res.metrics.items():
            smetrics.setdefault(k, []).append(float(v))
        pos = res.positions()
        if res.rewards is None:  # the sampler did not score its rows: score each once now
            score_rows(ctx, res)
        if hint_text is not None:  # the batch's texts are whole answers: hint + completion
            res.generation.texts = [hint_text[int(g)] + t for g, t in zip(pos, res.generation.texts)]
        keep_rows, n_kept, d = _keep_groups(res, cur, pos, selector if filters else None, target, n_kept, observed)
        dropped += d
        if filters and not keep_rows and not kept_parts:
            # remember the first groups of this round in case every round is filtered out
            fallback_rows = sorted(r for g, rows in list(_groups(res).items())[:target] for r in rows)
            fallback = (res, fallback_rows, len(all_idx), len(cur))
        base = len(all_idx)
        all_idx.extend(cur)
        if keep_rows:
            kept_parts.append(_compact(res, keep_rows, {p: base + p for p in range(len(cur))}))
        rounds += 1
        if not filters or n_kept >= target or rounds >= max_rounds:
            break
        idx = list(selector.refill(target - n_kept))
    exhausted = 0.0
    if not kept_parts:
        # Every candidate group was filtered out within max_rounds: train on the
        # last round's groups rather than stop the run (reported as exhausted).
        res, rows, base, n = fallback
        kept_parts.append(_compact(res, rows, {p: base + p for p in range(n)}))
        exhausted = 1.0
    merged, used = _merge_rounds(kept_parts, engine, spent)
    out = StepRollouts(merged, [all_idx[p] for p in used], merged.rewards, observed)
    if selector.plays(Role.REPLAY):
        out = selector.postprocess(out, step)
    out.metrics = _step_metrics(out, selector, smetrics, spent, rounds, skipped_by_selector + dropped,
                                exhausted if filters else None)
    return out


def _step_metrics(out: StepRollouts, selector: Any, smetrics: Dict[str, List[float]], spent: int, rounds: int,
                  skipped: int, exhausted: Optional[float]) -> Dict[str, float]:
    """The step's ``sampler/...``, ``rollout/...`` and selector metrics (``exhausted``: None without a filter)."""
    merged_metrics = _merge_round_metrics(smetrics)
    skipped += int(merged_metrics.get("sampler/prompts_skipped", 0))
    m = {**merged_metrics, **rollout_metrics(out, spent, rounds, skipped)}
    if exhausted is not None:
        m["rollout/filter_exhausted"] = exhausted
    try:
        m.update(selector.metrics())
    except Exception:  # pragma: no cover - metrics must never break a step
        pass
    return m


def _merge_round_metrics(per_round: Dict[str, List[float]]) -> Dict[str, float]:
    """One value per sampler metric over a step's rounds: means, fractions and rates
    (``mean``/``frac``/``rate``/``avg`` in the name) are averaged, counts summed."""
    out: Dict[str, float] = {}
    for k, vs in per_round.items():
        averaged = any(w in k.rsplit("/", 1)[-1] for w in ("mean", "frac", "rate", "avg"))
        out[k] = sum(vs) / len(vs) if averaged else sum(vs)
    return out


def rollout_metrics(out: StepRollouts, spent: int, rounds: int, skipped: int) -> Dict[str, float]:
    """Rollout accounting of one step.

    Keys: ``rollout/spent`` (rollouts generated, discarded ones included),
    ``rollout/rounds`` (sampler calls), ``rollout/prompts_skipped`` (by the
    selector before rollout, by a filter after it, or by the sampler),
    ``rollout/batch_rows``, ``rollout/batch_prompts``, ``rollout/zero_var_frac``
    (share of scored groups whose rewards were all equal), ``rollout/batch_zero_var_frac``
    (same over the batch's groups), ``rollout/effective_batch`` (batch rows in
    groups with reward variance, i.e. with a non-zero group-relative advantage),
    ``rollout/reward_scored`` (mean reward of everything scored).
    """
    res = out.result
    m = {
        "rollout/spent": float(spent),
        "rollout/rounds": float(rounds),
        "rollout/prompts_skipped": float(skipped),
        "rollout/batch_rows": float(res.group_index.shape[0]),
        "rollout/batch_prompts": float(len(out.prompt_indices)),
    }
    if out.observed:
        zv = [max(r) - min(r) <= 1e-9 for _, r in out.observed if r]
        m["rollout/zero_var_frac"] = float(sum(zv) / max(1, len(zv)))
        allr = [x for _, r in out.observed for x in r]
        m["rollout/reward_scored"] = float(sum(allr) / max(1, len(allr)))
    if out.rewards is not None:
        eff, zero, n = 0, 0, 0
        for rows in _groups(res).values():
            r = out.rewards[rows]
            n += 1
            if float(r.max() - r.min()) > 1e-9:
                eff += len(rows)
            else:
                zero += 1
        m["rollout/effective_batch"] = float(eff)
        m["rollout/batch_zero_var_frac"] = float(zero / max(1, n))
    return m


def check_allocation(selector: Any, sampler: Sampler, selector_name: str, sampler_name: str) -> None:
    """Refuse a selector that allocates rollouts per prompt with a sampler that would ignore it.

    Raises:
        ConfigError: the selector plays ``Role.ALLOCATE`` (CurES) and the sampler's
            ``uses_rollout_counts`` is False; the message lists the samplers that honour it.
    """
    if selector.plays(Role.ALLOCATE) and not sampler.uses_rollout_counts:
        ok = [n for n in SAMPLERS.names() if SAMPLERS.get(n).uses_rollout_counts]
        raise ConfigError(
            f"selector={selector_name} allocates rollouts per prompt, but sampler={sampler_name} ignores that budget; "
            f"use sampler={' or sampler='.join(ok)}, or set selector.params.allocate=false"
        )
