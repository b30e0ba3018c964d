"""XRPO's rollout allocator: spend a step's rollouts where they shrink the uncertainty of a prompt's mean reward most.

"XRPO: Pushing the limits of GRPO with Targeted Exploration and Exploitation"
(arXiv:2510.06672). The uncertainty of prompt ``q``'s estimated mean reward
after ``n`` rollouts is the half-width of its Student-t confidence interval,
``h_q(n) = t_{1 - alpha/2, n - 1} s_q / sqrt(n)``; one more rollout reduces it by
``Delta_q(n) = h_q(n) - h_q(n + 1)``, and the allocator hands out rollouts one
at a time to the prompt with the largest ``Delta_q`` plus an exploration bonus
(the half-width formula is as a review of the paper quotes it; the rest of the
paper was not readable here). XRPO's novelty-aware advantage sharpening is
``algo.adv_estimator=xrpo`` (:mod:`rlpost.algos.xrpo`).

Departures, all ours: (1) the paper allocates within a step, after a first
round of rollouts of every prompt; the selector interface fixes the counts
before generation, so ``s_q`` is the std of the rewards the prompt earned in
earlier steps (a never-seen prompt, or one seen once, has the prior ``s_q =
prior_std``, the largest std of a 0/1 reward); (2) the exploration bonus is
``explore_coef sqrt(ln(1 + N) / (1 + N_q))`` (``N_q`` rewards seen for the
prompt, ``N`` for all), UCB's form. In-context seeding is ``sampler=xrpo_icl``
(:mod:`rlpost.samplers.xrpo_icl`), which splits each prompt's allocated rollouts
into probes and a seeded rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from rlpost.core.registry import param
from rlpost.selectors.base import SELECTORS, Role, UniformSelector


def t_two_sided_mass(t: float, df: int) -> float:
    """``P(|T| < t)`` for Student's t with integer ``df >= 1`` and ``t >= 0`` (closed forms, Abramowitz & Stegun 26.7.3-4).

    With ``theta = atan(t / sqrt(df))``: odd ``df``: ``(2/pi) (theta + sin(theta)
    (cos(theta) + 2/3 cos^3(theta) + ... ))``; even ``df``: ``sin(theta) (1 + 1/2
    cos^2(theta) + 1*3/(2*4) cos^4(theta) + ...)``, each series to ``cos^(df-2)``.
    """
    th = math.atan(t / math.sqrt(df))
    c, s = math.cos(th), math.sin(th)
    if df % 2 == 1:
        acc, term = 0.0, c
        for k in range(1, (df - 1) // 2 + 1):  # terms cos, 2/3 cos^3, (2*4)/(3*5) cos^5, ... up to cos^(df-2)
            if k > 1:
                term *= (2 * k - 2) / (2 * k - 1) * c * c
            acc += term
        return (2 / math.pi) * (th + (s * acc if df > 1 else 0.0))
    acc, term = 1.0, 1.0
    for k in range(1, (df - 2) // 2 + 1):  # terms 1/2 cos^2, (1*3)/(2*4) cos^4, ... up to cos^(df-2)
        term *= (2 * k - 1) / (2 * k) * c * c
        acc += term
    return s * acc


def t_quantile(p: float, df: int) -> float:
    """Quantile ``t_{p, df}`` of Student's t distribution (``0.5 < p < 1``, integer ``df >= 1``).

    Bisection (to 1e-10 relative) on the exact CDF ``(1 + P(|T| < t)) / 2``
    (:func:`t_two_sided_mass`).

    Raises:
        ValueError: ``p`` outside (0.5, 1) or ``df < 1``.
    """
    if not 0.5 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile: need 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    target = 2 * p - 1
    lo, hi = 0.0, 1.0
    while t_two_sided_mass(hi, df) < target:
        hi *= 2
    while hi - lo > 1e-10 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_mass(mid, df) < target else (lo, mid)
    return (lo + hi) / 2


def half_width(n: int, std: float, alpha: float) -> float:
    """``h(n) = t_{1 - alpha/2, n - 1} std / sqrt(n)``; infinite for ``n < 2`` (no interval from one sample)."""
    if n < 2:
        return math.inf
    return t_quantile(1 - alpha / 2, n - 1) * std / math.sqrt(n)


@dataclass(frozen=True)
class XRPOSelectorParams:
    """XRPO's allocator; the constants are our choices (the paper's were not readable here)."""

    n_samples: int = param(8, "rollouts per prompt on average; build_selector sets it to algo.n_samples_per_prompt unless given")
    min_rollouts: int = param(2, "rollouts every prompt gets first (>= 2: a group baseline and a t interval)")
    alpha: float = param(0.05, "confidence level 1 - alpha of the t interval (our choice: 95%)")
    explore_coef: float = param(0.1, "weight of the UCB-style bonus sqrt(ln(1 + N) / (1 + N_q)) (our choice)")
    prior_std: float = param(0.5, "reward std assumed for a prompt with fewer than 2 rewards seen (0/1 reward's largest)")
    decay: float = param(1.0, "retention of a prompt's earlier reward statistics when it is seen again (1: keep all)")


@SELECTORS.register(
    "xrpo",
    paper="XRPO: Pushing the limits of GRPO with Targeted Exploration and Exploitation (arXiv:2510.06672)",
    description="Shuffled prompts; rollouts allocated greedily by t-interval uncertainty reduction plus a UCB bonus.",
    params=XRPOSelectorParams,
)
class XRPOSelector(UniformSelector):
    """Prompt choice as ``uniform``; per-prompt rollout counts by XRPO's uncertainty-reduction priority.

    :meth:`rollout_counts`: every prompt of the step gets ``min_rollouts``; the
    rest of the budget ``n_samples * k`` goes one rollout at a time to the
    prompt maximising ``Delta_q(n_q) + bonus_q`` (:func:`half_width` at the
    prompt's planned count ``n_q``; ties to the earlier prompt), so a prompt
    whose rewards varied gets more rollouts and one always solved or always
    failed gets ``min_rollouts`` plus what the bonus earns it.

    Args: see :class:`XRPOSelectorParams`.
    Raises:
        ValueError: ``min_rollouts < 2``, ``n_samples < min_rollouts``,
            ``alpha`` outside (0, 1), negative ``explore_coef`` / ``prior_std``,
            or ``decay`` outside (0, 1].
    """

    roles = frozenset({Role.ALLOCATE})
    saved_state = ("count", "total", "total_sq")

    def __init__(self, num_prompts: int, prompts_per_step: int, seed: int = 0, *, n_samples: int, min_rollouts: int,
                 alpha: float, explore_coef: float, prior_std: float, decay: float) -> None:
        super().__init__(num_prompts, prompts_per_step, seed)
        if min_rollouts < 2 or n_samples < min_rollouts:
            raise ValueError(f"xrpo needs 2 <= min_rollouts <= n_samples, got {min_rollouts}, {n_samples}")
        if not 0 < alpha < 1 or explore_coef < 0 or prior_std < 0 or not 0 < decay <= 1:
            raise ValueError(f"xrpo: need 0 < alpha < 1, explore_coef >= 0, prior_std >= 0, 0 < decay <= 1; got "
                             f"{alpha}, {explore_coef}, {prior_std}, {decay}")
        self.n_samples, self.min_rollouts = int(n_samples), int(min_rollouts)
        self.alpha, self.explore_coef, self.prior_std, self.decay = float(alpha), float(explore_coef), float(prior_std), float(decay)
        self.count = np.zeros(num_prompts, dtype=np.float64)  # (decayed) rewards seen per prompt
        self.total = np.zeros(num_prompts, dtype=np.float64)
        self.total_sq = np.zeros(num_prompts, dtype=np.float64)
        self.last_counts: List[int] = []

    def reward_std(self, i: int) -> float:
        """Bessel-corrected std of prompt ``i``'s rewards seen so far, ``prior_std`` with fewer than 2."""
        n = self.count[i]
        if n < 2:
            return self.prior_std
        var = (self.total_sq[i] - self.total[i] ** 2 / n) / (n - 1)
        return math.sqrt(max(var, 0.0))

    def priority(self, i: int, n: int) -> float:
        """``Delta_q(n) + bonus_q`` of prompt ``i`` with ``n`` rollouts planned (see the module docstring)."""
        s = self.reward_std(i)
        gain = half_width(n, s, self.alpha) - half_width(n + 1, s, self.alpha)
        bonus = self.explore_coef * math.sqrt(math.log1p(float(self.count.sum())) / (1.0 + self.count[i]))
        return gain + bonus

    def rollout_counts(self, prompt_indices: List[int]) -> Optional[List[int]]:  # noqa: D102 - see class
        k = len(prompt_indices)
        counts = [self.min_rollouts] * k
        for _ in range(max(0, self.n_samples * k - self.min_rollouts * k)):
            pr = [self.priority(int(i), c) for i, c in zip(prompt_indices, counts)]
            counts[int(np.argmax(pr))] += 1
        self.last_counts = counts
        return counts

    def update(self, prompt_indices: List[int], rewards: Sequence[Sequence[float]]) -> None:  # noqa: D102
        for i, r in zip(prompt_indices, rewards):
            i = int(i)
            x = np.asarray(list(r), dtype=np.float64)
            self.count[i] = self.decay * self.count[i] + len(x)
            self.total[i] = self.decay * self.total[i] + x.sum()
            self.total_sq[i] = self.decay * self.total_sq[i] + (x * x).sum()

    def metrics(self) -> Dict[str, float]:  # noqa: D102
        c = self.last_counts
        return {**super().metrics(), "selector/rollouts_max": float(max(c)) if c else 0.0,
                "selector/rollouts_min": float(min(c)) if c else 0.0}
