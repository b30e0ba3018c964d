"""Reward-adaptive samplers: extra rounds of rollouts decided from rewards seen so far.

All of them need :attr:`SamplerContext.score`, score every row they generate
exactly once (:func:`rlpost.samplers.base.score_rows`) and return those rewards
in :attr:`SampleResult.rewards`; the driver never scores them again. Group sizes
become unequal; the group estimators in :mod:`rlpost.algos` handle that through
``group_index``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from rlpost.core.apportion import apportion
from rlpost.core.registry import Choice, param
from rlpost.rollout.base import GenerationResult
from rlpost.samplers.base import (
    REWARD_EXTRAS,
    SAMPLERS,
    SampleResult,
    Sampler,
    concat_generations,
    generate_groups,
    group_reward_stats,
    merge_results,
    pad_id_of,
    score_rows,
    select_rows,
    step_params,
)


def _binary_counts(rewards: torch.Tensor, gi: torch.Tensor, n: int, thr: float):
    """Per-group rollout counts and successes (reward >= thr) as float64 numpy arrays."""
    cnt = np.bincount(gi.numpy(), minlength=n).astype(np.float64)
    succ = np.bincount(gi.numpy(), weights=(rewards >= thr).double().numpy(), minlength=n)
    return cnt, succ


class DarsSchedule(Choice):
    """DARS's extra-rollout schedule."""

    equal = "equal"
    fixed = "fixed"


@dataclass(frozen=True)
class VigorSamplerParams:
    """Parameters of :class:`VigorSampler` (Variance-guided rounds of top-up rollouts under a fixed budget)."""

    n_init: Optional[int] = param(None, "first-round rollouts per prompt (default ``max(2, n_samples // 4)``).")
    increment: int = param(2, "rollouts added per chosen prompt in a round.")
    budget_per_prompt: Optional[int] = param(None, "total budget / number of prompts (default ``n_samples``).")
    max_rounds: int = param(8, "top-up rounds at most.")
    top_fraction: float = param(0.5, "share of prompts topped up per round.")


@SAMPLERS.register(
    "vigor",
    paper="Learning as Reasoning Unfolds: Progressive Rollout Allocation for Efficient Reinforcement Learning (VIGOR, arXiv:2607.22002)",
    description="Few rollouts per prompt, then rounds of top-ups for the highest-variance groups.",
    params=VigorSamplerParams,
)
class VigorSampler(Sampler):
    """Variance-guided rounds of top-up rollouts under a fixed budget.

    Every prompt first gets ``n_init`` rollouts. Then, round after round, the
    prompts whose groups show the largest empirical reward variance get
    ``increment`` more rollouts each, until the budget (``budget_per_prompt`` x
    number of prompts, default ``n_samples``) is spent or ``max_rounds`` is
    reached. The paper motivates this by reward variance controlling the
    gradient magnitude under RLVR.

    Choices where the abstract is silent (documented here): a round tops up the
    ``ceil(P / 2)`` highest-variance prompts (ties broken at random with the
    step's seed); prompts whose variance is exactly 0 are topped up only if no
    prompt with positive variance is left, so an all-equal group of 2 can still
    be revisited later in the budget.

    Args:
        n_samples: default budget per prompt.
        n_init: first-round rollouts per prompt (default ``max(2, n_samples // 4)``).
        increment: rollouts added per chosen prompt in a round.
        budget_per_prompt: total budget / number of prompts (default ``n_samples``).
        max_rounds: top-up rounds at most.
        top_fraction: share of prompts topped up per round.

    Raises:
        ValueError: (in sample) no ``ctx.score``.
    """

    def __init__(
        self,
        n_samples: int,
        *,
        n_init: Optional[int],
        increment: int,
        budget_per_prompt: Optional[int],
        max_rounds: int,
        top_fraction: float,
    ) -> None:
        super().__init__(n_samples)
        self.n_init = int(n_init) if n_init else max(2, n_samples // 4)
        self.increment = max(1, int(increment))
        self.budget_per_prompt = int(budget_per_prompt or n_samples)
        self.max_rounds = int(max_rounds)
        self.top_fraction = float(top_fraction)

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        P = len(prompts)
        budget = self.budget_per_prompt * P
        first = generate_groups(engine, prompts, [min(self.n_init, self.budget_per_prompt)] * P, step_params(params, ctx, 0))
        score_rows(ctx, first)
        parts = [first]
        spent = first.rollouts_spent
        rng = np.random.default_rng(ctx.seed + 17)
        rounds = 0
        while spent + self.increment <= budget and rounds < self.max_rounds:
            cur = merge_results(parts, pad_id_of(engine))
            _, _, var = group_reward_stats(cur.rewards, cur.group_index, P)
            var = var.numpy()
            k = min(max(1, math.ceil(P * self.top_fraction)), (budget - spent) // self.increment)
            order = np.lexsort((rng.random(P), -var))  # highest variance first, random ties
            pos = [i for i in order if var[i] > 0][:k]
            if len(pos) < k:
                pos += [i for i in order if var[i] <= 0][: k - len(pos)]
            rounds += 1
            extra = generate_groups(
                engine, [prompts[i] for i in pos], [self.increment] * len(pos), step_params(params, ctx, rounds), pos
            )
            score_rows(ctx, extra)
            parts.append(extra)
            spent += extra.rollouts_spent
        out = merge_results(parts, pad_id_of(engine))
        out.metrics = {"sampler/rounds": float(rounds + 1)}
        return out


@dataclass(frozen=True)
class DarsSamplerParams:
    """Parameters of :class:`DarsSampler` (Difficulty Adaptive Rollout Sampling: multi-stage extra rollouts for hard prompts)."""

    hard_threshold: float = param(0.5, "accuracy below which a prompt is hard.")
    stages: int = param(2, "extra stages at most.")
    max_total: Optional[int] = param(None, "cap of rollouts per prompt (default ``4 * n_samples``).")
    schedule: DarsSchedule = param(DarsSchedule.equal, "equal: every stage adds to the hard prompts equally; fixed: extra_per_stage each")
    extra_per_stage: Optional[int] = param(None, "rollouts per stage for ``fixed``.")
    correct_threshold: float = param(0.5, "reward counted as a success.")


@SAMPLERS.register(
    "dars",
    paper="Depth-Breadth Synergy in RLVR: Unlocking LLM Reasoning Gains with Adaptive Exploration (DARS, arXiv:2508.13755)",
    description="Difficulty-adaptive rollout sampling: extra rollouts for low-accuracy prompts.",
    params=DarsSamplerParams,
)
class DarsSampler(Sampler):
    """Difficulty Adaptive Rollout Sampling: multi-stage extra rollouts for hard prompts.

    After ``n_samples`` rollouts per prompt, prompts with accuracy ``a`` below
    ``hard_threshold`` are re-sampled in up to ``stages`` further stages. The
    extra count rebalances GRPO's cumulative advantage: a group of ``n`` binary
    rewards with accuracy ``a`` carries total absolute std-normalised advantage
    ``2 n sqrt(a (1-a))``, which equals ``n`` at ``a = 0.5``. So a hard prompt
    gets a total of ``n / (2 sqrt(a' (1-a')))`` rollouts, ``a'`` being the
    accuracy smoothed as ``(s + 0.5) / (cnt + 1)`` (so an all-wrong group still
    gets a finite schedule), capped at ``max_total`` (``equal`` schedule, our
    reading of the paper's equal-treatment rule). ``schedule=fixed`` instead
    adds ``extra_per_stage`` rollouts per stage to every hard prompt.

    Args:
        hard_threshold: accuracy below which a prompt is hard.
        stages: extra stages at most.
        max_total: cap of rollouts per prompt (default ``4 * n_samples``).
        schedule: ``equal`` | ``fixed``.
        extra_per_stage: rollouts per stage for ``fixed``.
        correct_threshold: reward counted as a success.
    """

    uses_rollout_counts = True

    def __init__(
        self,
        n_samples: int,
        *,
        hard_threshold: float,
        stages: int,
        max_total: Optional[int],
        schedule: str,
        extra_per_stage: Optional[int],
        correct_threshold: float,
    ) -> None:
        super().__init__(n_samples)
        if schedule not in ("equal", "fixed"):
            raise ValueError("dars schedule must be 'equal' or 'fixed'")
        self.hard_threshold = float(hard_threshold)
        self.stages = int(stages)
        self.max_total = int(max_total or 4 * n_samples)
        self.schedule = schedule
        self.extra_per_stage = int(extra_per_stage or n_samples)
        self.correct_threshold = float(correct_threshold)

    def target_total(self, cnt: float, succ: float) -> int:
        """Total rollouts the equal-treatment rule wants for a prompt with ``succ``/``cnt`` successes."""
        a = (succ + 0.5) / (cnt + 1.0)
        return int(min(self.max_total, math.ceil(self.n_samples / (2.0 * math.sqrt(a * (1.0 - a))))))

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        P = len(prompts)
        base = generate_groups(engine, prompts, self.counts(P, ctx), step_params(params, ctx, 0))
        score_rows(ctx, base)
        parts = [base]
        hard_prompts = 0
        for stage in range(1, self.stages + 1):
            cur = merge_results(parts, pad_id_of(engine))
            cnt, succ = _binary_counts(cur.rewards, cur.group_index, P, self.correct_threshold)
            acc = succ / np.maximum(cnt, 1)
            pos, add = [], []
            for i in range(P):
                if acc[i] >= self.hard_threshold or cnt[i] >= self.max_total:
                    continue
                if self.schedule == "fixed":
                    want = min(self.extra_per_stage, self.max_total - int(cnt[i]))
                else:
                    remaining_stages = self.stages - stage + 1
                    want = math.ceil((self.target_total(cnt[i], succ[i]) - cnt[i]) / remaining_stages)
                if want > 0:
                    pos.append(i)
                    add.append(int(want))
            if stage == 1:
                hard_prompts = len(pos)
            if not pos:
                break
            extra = generate_groups(engine, [prompts[i] for i in pos], add, step_params(params, ctx, stage), pos)
            score_rows(ctx, extra)
            parts.append(extra)
        out = merge_results(parts, pad_id_of(engine))
        out.metrics = {"sampler/hard_prompts": float(hard_prompts)}
        return out


@dataclass(frozen=True)
class PilotCommitSamplerParams:
    """Parameters of :class:`PilotCommitSampler` (Two-phase budget: a pilot phase measures informativeness, a commit phase spends the rest)."""

    pilot_fraction: float = param(0.5, "share of the per-prompt budget used by the pilot.")
    pilot_n: Optional[int] = param(None, "explicit pilot size (overrides ``pilot_fraction``).")
    skip_threshold: float = param(0.1, "informativeness below which a prompt is skipped.")
    max_per_prompt: Optional[int] = param(None, "cap of total rollouts per prompt (default ``2 * n_samples``).")
    correct_threshold: float = param(0.5, "reward counted as a success.")


@SAMPLERS.register(
    "pilot_commit",
    paper="Spend Your Rollouts Where It Counts: Rollout Allocation for Group-Based RL Post-Training (Pilot-Commit, arXiv:2605.26606)",
    description="Pilot rollouts estimate each prompt's informativeness; the rest of the budget goes to informative prompts.",
    params=PilotCommitSamplerParams,
)
class PilotCommitSampler(Sampler):
    """Two-phase budget: a pilot phase measures informativeness, a commit phase spends the rest.

    Pilot: ``pilot_n`` rollouts per prompt (default ``round(pilot_fraction *
    n_samples)``, at least 2). Informativeness of prompt ``i`` is the posterior
    expected reward variance ``E[p (1-p)]`` under a Jeffreys ``Beta(0.5 + s,
    0.5 + f)`` posterior from its pilot successes ``s`` and failures ``f`` (our
    choice; the abstract gives no formula). Prompts below ``skip_threshold`` are
    skipped: their pilot rollouts are dropped from the batch (still counted as
    spent). The commit budget (``n_samples * P`` minus the pilot) is split among
    the kept prompts in proportion to informativeness, capped at ``max_per_prompt``.

    Args:
        pilot_fraction: share of the per-prompt budget used by the pilot.
        pilot_n: explicit pilot size (overrides ``pilot_fraction``).
        skip_threshold: informativeness below which a prompt is skipped.
        max_per_prompt: cap of total rollouts per prompt (default ``2 * n_samples``).
        correct_threshold: reward counted as a success.
    """

    def __init__(
        self,
        n_samples: int,
        *,
        pilot_fraction: float,
        pilot_n: Optional[int],
        skip_threshold: float,
        max_per_prompt: Optional[int],
        correct_threshold: float,
    ) -> None:
        super().__init__(n_samples)
        self.pilot_n = int(pilot_n) if pilot_n else max(2, int(round(pilot_fraction * n_samples)))
        self.skip_threshold = float(skip_threshold)
        self.max_per_prompt = int(max_per_prompt or 2 * n_samples)
        self.correct_threshold = float(correct_threshold)

    @staticmethod
    def informativeness(succ: np.ndarray, cnt: np.ndarray) -> np.ndarray:
        """Posterior expected Bernoulli variance under Beta(0.5+s, 0.5+f); arrays of equal shape."""
        a = 0.5 + succ
        b = 0.5 + (cnt - succ)
        return a * b / ((a + b) * (a + b + 1.0))

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        P = len(prompts)
        pilot = generate_groups(engine, prompts, [self.pilot_n] * P, step_params(params, ctx, 0))
        score_rows(ctx, pilot)
        cnt, succ = _binary_counts(pilot.rewards, pilot.group_index, P, self.correct_threshold)
        info = self.informativeness(succ, cnt)
        keep = info >= self.skip_threshold
        budget = max(0, self.n_samples * P - pilot.rollouts_spent)
        add = apportion(np.where(keep, info, 0.0), budget, cap=[self.max_per_prompt - self.pilot_n] * P)
        parts = []
        rows = [r for r in range(pilot.group_index.shape[0]) if keep[int(pilot.group_index[r])]]
        spent = pilot.rollouts_spent
        if rows:
            kept = SampleResult(
                generation=select_rows(pilot.generation, rows),
                group_index=pilot.group_index[rows],
                rollouts_spent=0,
                extras={k: v[rows] for k, v in pilot.extras.items()},
                rewards=pilot.rewards[rows],
            )
            parts.append(kept)
        pos = [i for i in range(P) if add[i] > 0]
        if pos:
            commit = generate_groups(engine, [prompts[i] for i in pos], [add[i] for i in pos], step_params(params, ctx, 1), pos)
            score_rows(ctx, commit)
            spent += commit.rollouts_spent
            parts.append(commit)
        if not parts:  # every prompt skipped: keep the pilot so the step still has a batch
            parts = [pilot]
            keep[:] = True
        out = merge_results(parts, pad_id_of(engine))
        out.rollouts_spent = spent
        out.metrics = {"sampler/prompts_skipped": float((~keep).sum()), "sampler/pilot_rollouts": float(pilot.rollouts_spent)}
        return out


def _cached_row(template: GenerationResult, row: int, ids: List[int], lps: List[float], text: str) -> GenerationResult:
    """A one-row result with ``template``'s prompt ``row`` and a stored response."""
    L = len(ids)
    return GenerationResult(
        prompt_ids=template.prompt_ids[row : row + 1],
        prompt_mask=template.prompt_mask[row : row + 1],
        response_ids=torch.tensor([ids], dtype=torch.long),
        response_mask=torch.ones(1, L),
        rollout_logprobs=torch.tensor([lps], dtype=torch.float32),
        temperatures=torch.ones(1, L),
        finished=torch.tensor([True]),
        texts=[text],
    )


@dataclass(frozen=True)
class Ar3poSamplerParams:
    """Parameters of :class:`Ar3poSampler` (Adaptive rollout with response reuse)."""

    n_stage: Optional[int] = param(None, "rollouts per stage (default ``max(2, n_samples // 2)``).")
    stop_correct: int = param(1, "correct responses that end a prompt's sampling.")
    reuse: bool = param(True, "put cached correct responses into all-wrong groups.")
    max_age: int = param(50, "oldest usable cached response, in steps.")
    correct_threshold: float = param(0.5, "reward counted as correct.")


@SAMPLERS.register(
    "ar3po",
    paper="Improving Sampling Efficiency in RLVR through Adaptive Rollout and Response Reuse (AR3PO, arXiv:2509.25808)",
    description="Staged rollouts that stop early on solved prompts, plus reuse of a past correct response in all-wrong groups.",
    params=Ar3poSamplerParams,
)
class Ar3poSampler(Sampler):
    """Adaptive rollout with response reuse.

    Stage 1 draws ``n_stage`` rollouts per prompt. A prompt with at least
    ``stop_correct`` correct responses stops; the others get another stage of
    ``n_stage`` until ``n_samples`` rollouts. A group that ends all-wrong while a
    correct response to the same prompt was seen in an earlier step gets that
    response in place of one of its rows (its stored behaviour log-probs stay in
    ``rollout_logprobs``, and ``extras['replay_age']`` says how many steps old
    it is, so an off-policy correction can use it). The cache keeps the latest
    correct response per dataset prompt (``ctx.prompt_indices``), at most
    ``max_age`` steps old, and is saved in :meth:`state_dict`.

    Args:
        n_stage: rollouts per stage (default ``max(2, n_samples // 2)``).
        stop_correct: correct responses that end a prompt's sampling.
        reuse: put cached correct responses into all-wrong groups.
        max_age: oldest usable cached response, in steps.
        correct_threshold: reward counted as correct.
    """

    def __init__(
        self,
        n_samples: int,
        *,
        n_stage: Optional[int],
        stop_correct: int,
        reuse: bool,
        max_age: int,
        correct_threshold: float,
    ) -> None:
        super().__init__(n_samples)
        self.n_stage = int(n_stage) if n_stage else max(2, n_samples // 2)
        self.stop_correct = int(stop_correct)
        self.reuse = bool(reuse)
        self.max_age = int(max_age)
        self.correct_threshold = float(correct_threshold)
        self.cache: Dict[int, Dict[str, Any]] = {}

    def _key(self, ctx, i: int, prompt: List[int]) -> int:
        if ctx.prompt_indices is not None:
            return int(ctx.prompt_indices[i])
        return hash(tuple(prompt))

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        P = len(prompts)
        pad = pad_id_of(engine)
        parts: List[SampleResult] = []
        active = list(range(P))
        stage = 0
        while active:
            cur_cnt = np.zeros(P)
            if parts:
                cur = merge_results(parts, pad)
                cur_cnt, succ = _binary_counts(cur.rewards, cur.group_index, P, self.correct_threshold)
                active = [i for i in active if succ[i] < self.stop_correct and cur_cnt[i] < self.n_samples]
                if not active:
                    break
            add = [int(min(self.n_stage, self.n_samples - cur_cnt[i])) for i in active]
            res = generate_groups(engine, [prompts[i] for i in active], add, step_params(params, ctx, stage), active)
            score_rows(ctx, res)
            parts.append(res)
            stage += 1
        out = merge_results(parts, pad)
        gi, rw, gen = out.group_index, out.rewards, out.generation
        reused = 0
        age = torch.zeros(gi.shape[0])
        rows = list(range(gi.shape[0]))
        replace: Dict[int, GenerationResult] = {}
        for i in range(P):
            key = self._key(ctx, i, prompts[i])
            mine = [r for r in rows if int(gi[r]) == i]
            correct = [r for r in mine if float(rw[r]) >= self.correct_threshold]
            if correct:
                r = correct[0]
                m = gen.response_mask[r] > 0
                self.cache[key] = {
                    "ids": gen.response_ids[r][m].tolist(),
                    "lps": gen.rollout_logprobs[r][m].tolist(),
                    "text": gen.texts[r],
                    "reward": float(rw[r]),
                    "parts": {k: float(out.extras[k][r]) for k in REWARD_EXTRAS if k in out.extras},
                    "step": int(ctx.step),
                }
            elif self.reuse and key in self.cache and mine:
                c = self.cache[key]
                if ctx.step - c["step"] <= self.max_age and c["step"] < ctx.step:
                    r = mine[-1]
                    replace[r] = _cached_row(gen, r, c["ids"], c["lps"], c["text"])
                    rw[r] = c["reward"]  # the cached response keeps the reward it was scored with
                    for k, v in c.get("parts", {}).items():
                        if k in out.extras:
                            out.extras[k][r] = v
                    age[r] = float(ctx.step - c["step"])
                    reused += 1
        if replace:
            pieces = [replace[r] if r in replace else select_rows(gen, [r]) for r in rows]
            out.generation = concat_generations(pieces, pad)
        out.extras["replay_age"] = age
        out.metrics = {"sampler/stages": float(stage), "sampler/reused": float(reused)}
        return out

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102 - the response cache
        return {"cache": {int(k): dict(v) for k, v in self.cache.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # noqa: D102
        self.cache = {int(k): dict(v) for k, v in state.get("cache", {}).items()}
