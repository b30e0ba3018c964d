"""Reward-history selectors: dynamic_filter (DAPO), greso, hive, cdas, popo."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from rlpost.core.registry import param
from rlpost.selectors.base import SELECTORS, Role, Selector, UniformSelector, append_history, is_zero_variance, success_rate


@dataclass(frozen=True)
class DynamicFilterSelectorParams:
    """Parameters of :class:`DynamicFilterSelector` (DAPO's dynamic sampling)."""

    oversample: float = param(1.5, "candidate prompts per batch slot in the first round.")
    max_rounds: int = param(4, "generation rounds per step at most.")


@SELECTORS.register(
    "dynamic_filter",
    paper="DAPO: An Open-Source LLM Reinforcement Learning System at Scale (arXiv:2503.14476), dynamic sampling",
    description="Over-sample, drop groups whose rewards are all equal, refill to the batch size.",
    params=DynamicFilterSelectorParams,
)
class DynamicFilterSelector(UniformSelector):
    """DAPO's dynamic sampling.

    :meth:`select` returns ``ceil(oversample * prompts_per_step)`` candidates in
    shuffled-epoch order; after scoring, groups whose rewards are all equal are
    dropped (:meth:`keep_group`) and the rollout driver asks :meth:`refill` for
    more candidates, up to ``max_rounds`` generation rounds, then keeps the
    first ``prompts_per_step`` surviving groups. If the rounds run out, the
    batch is smaller (never padded with zero-variance groups).

    Args:
        oversample: candidate prompts per batch slot in the first round.
        max_rounds: generation rounds per step at most.
    """

    roles = frozenset({Role.FILTER})

    def __init__(self, num_prompts: int, prompts_per_step: int, seed: int = 0, *, oversample: float, max_rounds: int) -> None:
        super().__init__(num_prompts, prompts_per_step, seed)
        self.oversample = max(1.0, float(oversample))
        self.max_rounds = max(1, int(max_rounds))
        self.dropped = 0
        self.seen_groups = 0
        self.step_prompts: List[int] = []

    def select(self, step: int) -> List[int]:  # noqa: D102 - see class
        self.dropped = 0
        self.seen_groups = 0
        self.step_prompts = self._take(math.ceil(self.oversample * self.prompts_per_step))
        return list(self.step_prompts)

    def refill(self, n: int) -> List[int]:
        """Up to ``ceil(oversample * n)`` candidates not yet tried this step (none once the split is used up)."""
        more = self._take(max(1, math.ceil(self.oversample * n)), exclude=self.step_prompts, allow_repeats=False)
        self.step_prompts += more
        return more

    def keep_group(self, rewards: Sequence[float]) -> bool:  # noqa: D102 - see class
        self.seen_groups += 1
        ok = not is_zero_variance(list(rewards))
        self.dropped += 0 if ok else 1
        return ok

    def metrics(self) -> Dict[str, float]:  # noqa: D102
        return {"selector/groups_dropped": float(self.dropped), "selector/groups_seen": float(self.seen_groups)}


@dataclass(frozen=True)
class GresoSelectorParams:
    """Parameters of :class:`GresoSelector` (GRESO's pre-rollout filter)."""

    p_easy: float = param(0.5, "initial keep probabilities per streak step.")
    p_hard: float = param(0.5, "initial keep probabilities per streak step.")
    target_easy: float = param(0.125, "wanted share of zero-variance groups of each kind.")
    target_hard: float = param(0.125, "wanted share of zero-variance groups of each kind.")
    step_size: float = param(0.01, "adaptation step of ``p_easy`` / ``p_hard``.")
    p_min: float = param(0.05, "lower bound of the keep probabilities.")
    max_skip_factor: float = param(8.0, "at most max_skip_factor * prompts_per_step candidates skipped per step")
    threshold: float = param(0.5, "reward counted as success.")


@SELECTORS.register(
    "greso",
    paper="Act Only When It Pays: Efficient RL for LLM Reasoning via Selective Rollouts (GRESO, arXiv:2506.02177)",
    description="Skip prompts whose recent groups were all-equal, with a probability that grows with the streak.",
    params=GresoSelectorParams,
)
class GresoSelector(UniformSelector):
    """GRESO's pre-rollout filter.

    Each prompt keeps the length ``z`` of its current streak of zero-variance
    groups and whether the last one was all-correct (easy) or all-wrong (hard).
    Walking the shuffled epoch order, a candidate with ``z > 0`` is kept with
    probability ``p_e ** z`` (``p_e = p_easy`` or ``p_hard``) and otherwise
    skipped; prompts never seen or last seen informative are always kept. The
    two exploration probabilities adapt each step: if the share of easy
    (hard) zero-variance groups in the batch exceeds ``target_easy``
    (``target_hard``), ``p_easy`` (``p_hard``) shrinks by ``step_size``, else it
    grows, within ``[p_min, 1]``. At most ``max_skip_factor * prompts_per_step``
    candidates are skipped per step (then the rest are taken as they come).

    Args:
        p_easy, p_hard: initial keep probabilities per streak step.
        target_easy, target_hard: wanted share of zero-variance groups of each kind.
        step_size: adaptation step of ``p_easy`` / ``p_hard``.
        p_min: lower bound of the keep probabilities.
        threshold: reward counted as success.
    """

    saved_state = ("streak", "kind")

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        seed: int = 0,
        *,
        p_easy: float,
        p_hard: float,
        target_easy: float,
        target_hard: float,
        step_size: float,
        p_min: float,
        max_skip_factor: float,
        threshold: float,
    ) -> None:
        super().__init__(num_prompts, prompts_per_step, seed)
        self.p = {"easy": float(p_easy), "hard": float(p_hard)}
        self.target = {"easy": float(target_easy), "hard": float(target_hard)}
        self.step_size, self.p_min = float(step_size), float(p_min)
        self.max_skip = int(max_skip_factor * prompts_per_step)
        self.threshold = float(threshold)
        self.streak = np.zeros(num_prompts, dtype=np.int64)
        self.kind = np.zeros(num_prompts, dtype=np.int64)  # 1 easy, 2 hard

    def keep_probability(self, i: int) -> float:
        """Probability that prompt ``i`` is rolled out when drawn."""
        z = int(self.streak[i])
        if z == 0:
            return 1.0
        return self.p["easy" if self.kind[i] == 1 else "hard"] ** z

    def select(self, step: int) -> List[int]:  # noqa: D102 - see class
        out: List[int] = []
        self.skipped = 0
        while len(out) < self.prompts_per_step:
            if self.pos >= len(self.order):
                self.order = self.rng.permutation(self.num_prompts).tolist()
                self.pos = 0
            i = self.order[self.pos]
            self.pos += 1
            if i in out:
                continue
            if self.skipped < self.max_skip and self.rng.random() >= self.keep_probability(i):
                self.skipped += 1
                continue
            out.append(i)
        return out

    def update(self, prompt_indices, rewards):  # noqa: D102 - see class
        n = max(1, len(prompt_indices))
        n_kind = {"easy": 0, "hard": 0}
        for i, r in zip(prompt_indices, rewards):
            r = list(r)
            if is_zero_variance(r):
                k = "easy" if r and r[0] >= self.threshold else "hard"
                n_kind[k] += 1
                self.streak[i] += 1
                self.kind[i] = 1 if k == "easy" else 2
            else:
                self.streak[i] = 0
                self.kind[i] = 0
        for k in ("easy", "hard"):
            d = -self.step_size if n_kind[k] / n > self.target[k] else self.step_size
            self.p[k] = float(min(1.0, max(self.p_min, self.p[k] + d)))

    def metrics(self) -> Dict[str, float]:  # noqa: D102
        return {
            "selector/prompts_skipped": float(self.skipped),
            "selector/p_easy": self.p["easy"],
            "selector/p_hard": self.p["hard"],
        }

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102
        return {**super().state_dict(), "p": dict(self.p)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # noqa: D102
        super().load_state_dict(state)
        self.p = dict(state["p"])


@dataclass(frozen=True)
class HiveSelectorParams:
    """Parameters of :class:`HiveSelector` (Two-stage selection before rollout)."""

    history_window: int = param(4, "accuracies kept per prompt.")
    uncertainty_weight: float = param(0.5, "``c``.")
    pool_multiplier: float = param(2.0, "candidate pool size / prompts_per_step.")
    entropy_threshold: float = param(0.15, "relative entropy change marking stale history.")
    threshold: float = param(0.5, "reward counted as success.")


@SELECTORS.register(
    "hive",
    paper="HIVE: History-Informed and online-VErified prompt selection (arXiv:2603.25184)",
    description="Coarse pick at the learning edge from reward history, then prune prompts whose prompt entropy shows stale history.",
    params=HiveSelectorParams,
)
class HiveSelector(Selector):
    """Two-stage selection before rollout.

    Stage 1 (history): utility ``u_i = m_i (1 - m_i) + c * s_i`` from the prompt's
    last ``history_window`` group accuracies, ``m_i`` their mean (intermediate
    difficulty) and ``s_i`` their standard deviation (uncertainty; ``c =
    uncertainty_weight``). Unseen prompts get the maximum ``0.25 + c * 0.5``,
    so they are explored. The ``pool_multiplier * k`` highest-utility prompts
    (random tie-breaks) form the candidate pool.

    Stage 2 (online verification): when a ``prompt_entropy(indices) -> list``
    function is attached (the runner attaches :meth:`rlpost.run.runner.Run.prompt_entropy`:
    the current policy's mean next-token entropy over the prompt tokens, one
    no-grad prefill), the pool's entropies ``e_i`` are computed and a candidate
    with ``|e_i - e_i^old| > entropy_threshold * max(|e_i^old|, 1e-6)``, where
    ``e_i^old`` is its entropy when its history was last recorded, has stale
    history: it is pruned from this step, its history is cleared so it
    returns as unseen. The ``k`` best remaining candidates are chosen (pruned
    ones only fill a shortfall). Without the function only stage 1 runs. The
    thresholds are our choices; the abstract gives none.

    Args:
        history_window: accuracies kept per prompt.
        uncertainty_weight: ``c``.
        pool_multiplier: candidate pool size / prompts_per_step.
        entropy_threshold: relative entropy change marking stale history.
    """

    saved_state = ("hist", "entropy_at")

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        seed: int = 0,
        *,
        history_window: int,
        uncertainty_weight: float,
        pool_multiplier: float,
        entropy_threshold: float,
        threshold: float,
    ) -> None:
        super().__init__(num_prompts, prompts_per_step, seed)
        self.window = int(history_window)
        self.hist: Dict[int, List[float]] = {}  # prompt -> its last ``window`` group accuracies
        self.c = float(uncertainty_weight)
        self.pool_multiplier = max(1.0, float(pool_multiplier))
        self.entropy_threshold = float(entropy_threshold)
        self.threshold = float(threshold)
        self.entropy_at: Dict[int, float] = {}
        self.prompt_entropy: Optional[Callable[[List[int]], List[float]]] = None
        self.pending_entropy: Dict[int, float] = {}
        self.pruned = 0

    def attach(self, **resources: Any) -> None:  # noqa: D102 - takes prompt_entropy
        if resources.get("prompt_entropy") is not None:
            self.prompt_entropy = resources["prompt_entropy"]

    def utility(self) -> np.ndarray:
        """``[N]`` stage-1 utility of every prompt."""
        u = np.full(self.num_prompts, 0.25 + 0.5 * self.c)
        for i, h in self.hist.items():
            a = np.asarray(h)
            m = a.mean()
            u[i] = m * (1 - m) + self.c * (a.std() if len(a) > 1 else 0.5)
        return u

    def select(self, step: int) -> List[int]:  # noqa: D102 - see class
        k = min(self.prompts_per_step, self.num_prompts)
        u = self.utility()
        order = np.lexsort((self.rng.random(self.num_prompts), -u))
        pool = order[: min(self.num_prompts, int(math.ceil(self.pool_multiplier * k)))].tolist()
        self.pruned = 0
        self.pending_entropy = {}
        if self.prompt_entropy is None:
            return pool[:k]
        ent = [float(e) for e in self.prompt_entropy(pool)]
        keep, stale = [], []
        for i, e in zip(pool, ent):
            self.pending_entropy[i] = e
            old = self.entropy_at.get(i)
            if old is not None and abs(e - old) > self.entropy_threshold * max(abs(old), 1e-6):
                stale.append(i)
            else:
                keep.append(i)
        for i in stale:
            self.hist.pop(i, None)
            self.entropy_at.pop(i, None)
        self.pruned = len(stale)
        self.skipped = len(stale)
        return (keep + stale)[:k]

    def update(self, prompt_indices, rewards):  # noqa: D102
        for i, r in zip(prompt_indices, rewards):
            r = list(r)
            append_history(self.hist, int(i), success_rate(r, self.threshold), self.window)
            if int(i) in self.pending_entropy:
                self.entropy_at[int(i)] = self.pending_entropy[int(i)]

    def metrics(self) -> Dict[str, float]:
        """Step log: ``selector/pruned_stale`` (candidates pruned by stage 2 in the last
        :meth:`select`), ``selector/seen`` (prompts with history), and when stage 2 ran,
        ``selector/entropy_checked`` (candidates whose entropy was computed) and
        ``selector/prompt_entropy_mean`` (their mean entropy, nats)."""
        m = {"selector/pruned_stale": float(self.pruned), "selector/seen": float(len(self.hist))}
        if self.pending_entropy:
            m["selector/entropy_checked"] = float(len(self.pending_entropy))
            m["selector/prompt_entropy_mean"] = float(np.mean(list(self.pending_entropy.values())))
        return m


@dataclass(frozen=True)
class CdasSelectorParams:
    """Parameters of :class:`CdasSelector` (Competence-difficulty alignment (our reading of the abstract, on a logit scale))."""

    threshold: float = param(0.5, "reward counted as success.")
    fixed_point_iters: int = param(50, "iterations of the competence update.")


@SELECTORS.register(
    "cdas",
    paper="Rethinking the Sampling Criteria in Reinforcement Learning for LLM Reasoning: A Competence-Difficulty Alignment Perspective (CDAS, arXiv:2505.17652)",
    description="Difficulty from aggregated performance discrepancies, competence by a fixed point; pick problems aligned with competence.",
    params=CdasSelectorParams,
)
class CdasSelector(Selector):
    """Competence-difficulty alignment (our reading of the abstract, on a logit scale).

    Model: ``P(solve x) = sigmoid(theta - D(x))`` with model competence ``theta``
    and problem difficulty ``D(x)``. Each time ``x`` is rolled out at step
    ``t`` its performance discrepancy is ``delta_t(x) = theta_t - logit(acc_t(x))``
    (the difficulty that step's accuracy implies; accuracy smoothed as ``(s +
    0.5) / (n + 1)``), and ``D(x)`` is the mean of its discrepancies, steadier
    than one step's pass rate. Competence is the fixed point of ``theta =
    theta + (mean acc - mean_x sigmoid(theta - D(x)))`` over the step's
    problems, iterated with the discrepancies to convergence. Unseen problems
    have ``D = theta``. Selection is symmetric around competence: half the batch
    from the problems with ``D >= theta`` closest to it, half from ``D < theta``
    (the other side fills any shortfall), ties broken at random.

    Args:
        threshold: reward counted as success.
        fixed_point_iters: iterations of the competence update.
    """

    saved_state = ("sum_delta", "n_obs")

    def __init__(self, num_prompts: int, prompts_per_step: int, seed: int = 0, *, threshold: float, fixed_point_iters: int) -> None:
        super().__init__(num_prompts, prompts_per_step, seed)
        self.theta = 0.0
        self.sum_delta = np.zeros(num_prompts)
        self.n_obs = np.zeros(num_prompts)
        self.threshold = float(threshold)
        self.iters = int(fixed_point_iters)

    @property
    def difficulty(self) -> np.ndarray:
        """``[N]`` difficulty estimates (unseen: current competence)."""
        return np.where(self.n_obs > 0, self.sum_delta / np.maximum(self.n_obs, 1), self.theta)

    def select(self, step: int) -> List[int]:  # noqa: D102 - see class
        k = min(self.prompts_per_step, self.num_prompts)
        D = self.difficulty
        gap = np.abs(D - self.theta) + 1e-9 * self.rng.random(self.num_prompts)
        above = [i for i in np.argsort(gap, kind="stable") if D[i] >= self.theta]
        below = [i for i in np.argsort(gap, kind="stable") if D[i] < self.theta]
        h = k - k // 2
        out = above[:h] + below[: k // 2]
        rest = [i for i in np.argsort(gap, kind="stable") if i not in set(out)]
        out += rest[: k - len(out)]
        return [int(i) for i in out]

    def update(self, prompt_indices, rewards):  # noqa: D102 - see class
        idx = [int(i) for i in prompt_indices]
        if not idx:
            return
        acc = np.array([(sum(1 for x in r if x >= self.threshold) + 0.5) / (len(r) + 1.0) for r in rewards])
        la = np.log(acc) - np.log1p(-acc)
        prev_sum, prev_n = self.sum_delta[idx].copy(), self.n_obs[idx].copy()
        theta = self.theta
        for _ in range(self.iters):
            D = (prev_sum + (theta - la)) / (prev_n + 1)
            new = theta + (acc.mean() - (1 / (1 + np.exp(-(theta - D)))).mean())
            if abs(new - theta) < 1e-8:
                theta = new
                break
            theta = new
        self.theta = float(theta)
        self.sum_delta[idx] = prev_sum + (self.theta - la)
        self.n_obs[idx] = prev_n + 1

    def metrics(self) -> Dict[str, float]:  # noqa: D102
        return {"selector/competence": self.theta}

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102
        return {**super().state_dict(), "theta": self.theta}

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # noqa: D102
        super().load_state_dict(state)
        self.theta = float(state["theta"])
