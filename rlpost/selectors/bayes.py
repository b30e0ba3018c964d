"""Bayesian prompt selectors: per-prompt posteriors over the chance of solving a prompt.

``vade`` (Beta posteriors, Thompson sampling, two-scale decay), ``bots`` (Beta
posteriors with implicit evidence for unselected prompts), ``cures``
(posterior-weighted prompt sampling and rollout allocation) and ``dps`` (hidden
Markov model of solve state with Bayesian filtering).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np

from rlpost.core.apportion import apportion
from rlpost.core.registry import param
from rlpost.selectors.base import Role, SELECTORS, Selector, success_counts


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-4, 1 - 1e-4)
    return np.log(p) - np.log1p(-p)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


@dataclass(frozen=True)
class BetaSelectorParams:
    """Parameters of :class:`BetaSelector` (Shared machinery: ``Beta(alpha_i, beta_i)`` per prompt over its success probability)."""

    alpha0: float = param(1.0, "prior pseudo-counts.")
    beta0: float = param(1.0, "prior pseudo-counts.")
    binary: bool = param(False, "count a reward as success when ``>= threshold`` (else fractional evidence).")
    threshold: float = param(0.5, "success threshold for ``binary``.")


class BetaSelector(Selector):
    """Shared machinery: ``Beta(alpha_i, beta_i)`` per prompt over its success probability.

    Args:
        alpha0, beta0: prior pseudo-counts.
        binary: count a reward as success when ``>= threshold`` (else fractional evidence).
        threshold: success threshold for ``binary``.
    """

    saved_state = ("alpha", "beta", "seen")

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        seed: int = 0,
        *,
        alpha0: float,
        beta0: float,
        binary: bool,
        threshold: float,
    ) -> None:
        super().__init__(num_prompts, prompts_per_step, seed)
        if alpha0 <= 0 or beta0 <= 0:
            raise ValueError("Beta prior pseudo-counts must be > 0")
        self.alpha0, self.beta0 = float(alpha0), float(beta0)
        self.alpha = np.full(num_prompts, self.alpha0)
        self.beta = np.full(num_prompts, self.beta0)
        self.binary, self.threshold = bool(binary), float(threshold)
        self.seen = np.zeros(num_prompts, dtype=bool)

    @property
    def mean(self) -> np.ndarray:
        """``[N]`` posterior mean success probability."""
        return self.alpha / (self.alpha + self.beta)

    def decay(self, idx: Any, rate: float) -> None:
        """Shrink the evidence of ``idx`` toward the prior: ``a <- a0 + rate (a - a0)``."""
        self.alpha[idx] = self.alpha0 + rate * (self.alpha[idx] - self.alpha0)
        self.beta[idx] = self.beta0 + rate * (self.beta[idx] - self.beta0)

    def observe(self, i: int, rewards: List[float]) -> None:
        """Add the evidence of one group of rewards to prompt ``i``."""
        s, f = success_counts(rewards, self.threshold, self.binary)
        self.alpha[i] += s
        self.beta[i] += f
        self.seen[i] = True

    def metrics(self) -> Dict[str, float]:  # noqa: D102
        m = self.mean
        return {
            "selector/posterior_mean": float(m.mean()),
            "selector/seen_frac": float(self.seen.mean()),
            "selector/mid_frac": float(((m > 0.2) & (m < 0.8)).mean()),
        }

    def _pool(self) -> np.ndarray:
        pool = getattr(self, "pool_size", None)
        if pool and pool < self.num_prompts:
            return self.rng.choice(self.num_prompts, size=int(pool), replace=False)
        return np.arange(self.num_prompts)


@dataclass(frozen=True)
class VadeSelectorParams(BetaSelectorParams):
    """Parameters of :class:`VadeSelector` (Variance-aware selection by Thompson sampling)."""

    slow_decay: float = param(0.995, "per-step retention of all evidence (1 = none forgotten).")
    fast_decay: float = param(0.8, "retention of a prompt's old evidence when it is re-observed.")
    pool_size: Optional[int] = param(None, "candidates per step (None: all prompts).")


@SELECTORS.register(
    "vade",
    paper="VADE: Variance-Aware Dynamic Sampling via Online Sample-Level Difficulty Estimation for Multimodal RL (arXiv:2511.18902)",
    description="Beta posterior per prompt; Thompson-sampled reward variance p(1-p) picks prompts; two-scale decay.",
    params=VadeSelectorParams,
)
class VadeSelector(BetaSelector):
    """Variance-aware selection by Thompson sampling.

    Each step draws ``p_i ~ Beta(alpha_i, beta_i)`` for the candidates (the whole
    split, or ``pool_size`` random ones) and takes the ``prompts_per_step`` with
    the largest ``p_i (1 - p_i)``, the Bernoulli reward variance that GRPO's
    gradient scales with; prompts with success near 0.5 therefore dominate.

    Two-scale decay keeps the posteriors current as the policy moves (our reading
    of the abstract's "two-scale prior decay"): every step all posteriors relax
    toward the prior with the slow factor ``slow_decay``; a prompt that is
    observed first has its old evidence multiplied by ``fast_decay`` (recent
    outcomes count more than stale ones) before its new rewards are added.

    Args:
        slow_decay: per-step retention of all evidence (1 = none forgotten).
        fast_decay: retention of a prompt's old evidence when it is re-observed.
        pool_size: candidates per step (None: all prompts).
    """

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        seed: int = 0,
        *,
        slow_decay: float,
        fast_decay: float,
        pool_size: Optional[int],
        **beta: Any,
    ) -> None:
        super().__init__(num_prompts, prompts_per_step, seed, **beta)
        self.slow_decay, self.fast_decay = float(slow_decay), float(fast_decay)
        self.pool_size = pool_size

    def select(self, step: int) -> List[int]:  # noqa: D102 - see class
        cand = self._pool()
        p = self.rng.beta(self.alpha[cand], self.beta[cand])
        score = p * (1.0 - p)
        k = min(self.prompts_per_step, len(cand))
        top = np.argsort(-score, kind="stable")[:k]
        return cand[top].tolist()

    def update(self, prompt_indices, rewards):  # noqa: D102 - see class
        self.decay(slice(None), self.slow_decay)
        for i, r in zip(prompt_indices, rewards):
            self.decay(i, self.fast_decay)
            self.observe(int(i), list(r))


@dataclass(frozen=True)
class BotsSelectorParams(BetaSelectorParams):
    """Parameters of :class:`BotsSelector` (Bayesian online task selection)."""

    target: float = param(0.5, "success probability sought (0.5: most informative for GRPO).")
    decay: float = param(0.9, "retention of a prompt's old evidence when re-observed.")
    implicit_weight: float = param(0.5, "weight of the implicit evidence (0 = off).")
    pool_size: Optional[int] = param(None, "candidates per step (None: all).")


@SELECTORS.register(
    "bots",
    paper="BOTS: A Unified Framework for Bayesian Online Task Selection in LLM Reinforcement Finetuning (arXiv:2510.26374)",
    description="Beta posterior per prompt with explicit and implicit evidence; Thompson sampling toward a target success rate.",
    params=BotsSelectorParams,
)
class BotsSelector(BetaSelector):
    """Bayesian online task selection.

    Explicit evidence: a selected prompt's rewards update its Beta posterior
    (after a forgetting factor ``decay`` on its old evidence). Implicit evidence
    for the unselected prompts (our reading of the "light interpolation
    plug-in"): the step's mean change of posterior-mean logit among the selected
    prompts, ``delta``, is taken as the policy's overall progress and each
    unselected, already-seen prompt's posterior mean is moved by ``implicit_weight
    * delta`` in logit space, keeping its pseudo-count total (so no evidence is
    invented, only its centre shifts). Selection: Thompson draw ``p_i`` and take
    the prompts with ``|p_i - target|`` smallest.

    Args:
        target: success probability sought (0.5: most informative for GRPO).
        decay: retention of a prompt's old evidence when re-observed.
        implicit_weight: weight of the implicit evidence (0 = off).
        pool_size: candidates per step (None: all).
    """

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        seed: int = 0,
        *,
        target: float,
        decay: float,
        implicit_weight: float,
        pool_size: Optional[int],
        **beta: Any,
    ) -> None:
        super().__init__(num_prompts, prompts_per_step, seed, **beta)
        self.target, self.decay_rate = float(target), float(decay)
        self.implicit_weight = float(implicit_weight)
        self.pool_size = pool_size
        self.last_delta = 0.0

    def select(self, step: int) -> List[int]:  # noqa: D102 - see class
        cand = self._pool()
        p = self.rng.beta(self.alpha[cand], self.beta[cand])
        k = min(self.prompts_per_step, len(cand))
        return cand[np.argsort(np.abs(p - self.target), kind="stable")[:k]].tolist()

    def update(self, prompt_indices, rewards):  # noqa: D102 - see class
        idx = np.asarray([int(i) for i in prompt_indices], dtype=np.int64)
        if idx.size == 0:
            return
        before = _logit(self.mean[idx])
        was_seen = self.seen[idx].copy()
        for i, r in zip(idx, rewards):
            self.decay(int(i), self.decay_rate)
            self.observe(int(i), list(r))
        after = _logit(self.mean[idx])
        delta = float((after - before)[was_seen].mean()) if was_seen.any() else 0.0
        self.last_delta = delta
        if self.implicit_weight > 0 and delta != 0.0:
            other = np.ones(self.num_prompts, dtype=bool)
            other[idx] = False
            other &= self.seen
            if other.any():
                tot = self.alpha[other] + self.beta[other]
                m = _sigmoid(_logit(self.mean[other]) + self.implicit_weight * delta)
                self.alpha[other] = m * tot
                self.beta[other] = (1 - m) * tot

    def metrics(self) -> Dict[str, float]:  # noqa: D102
        return {**super().metrics(), "selector/implicit_delta": self.last_delta}


@dataclass(frozen=True)
class CuresSelectorParams(BetaSelectorParams):
    """Parameters of :class:`CuresSelector` (Posterior-weighted prompt sampling and rollout allocation)."""

    n_samples: int = param(8, "rollouts per prompt on average; build_selector sets it to algo.n_samples_per_prompt unless given")
    allocate: bool = param(True, "return per-prompt rollout counts.")
    min_rollouts: int = param(2, "lower bound per prompt (>= 2 keeps a group baseline).")
    floor: float = param(0.02, "added to sampling weights.")
    decay: float = param(0.9, "retention of a prompt's old evidence when re-observed.")


@SELECTORS.register(
    "cures",
    paper="CurES: From Gradient Analysis to Efficient Curriculum Learning for Reasoning LLMs (arXiv:2510.01037)",
    description="Beta-posterior prompt sampling weights and per-prompt rollout allocation.",
    params=CuresSelectorParams,
)
class CuresSelector(BetaSelector):
    """Posterior-weighted prompt sampling and rollout allocation.

    Prompt sampling: ``k`` prompts without replacement with probability
    proportional to ``sqrt(m_i (1 - m_i)) + floor``, ``m_i`` the posterior mean
    success rate: the expected gradient norm of a binary-reward prompt under a
    group baseline grows like the reward standard deviation, which favours
    medium-difficulty prompts (``floor`` keeps every prompt reachable).

    Rollout allocation (:meth:`rollout_counts`, read by the samplers through
    ``SamplerContext.rollout_counts``): the step budget ``n_samples * k`` is split
    in proportion to ``m_i (1 - m_i)`` (the Neyman allocation that minimises the
    variance of the weighted gradient estimate), at least ``min_rollouts`` each.
    These exact forms are our derivation; the paper gives closed forms we could
    not read.

    Args:
        n_samples: rollouts per prompt on average (set to the algorithm's group size
            by :func:`build_selector` when ``allocate``).
        allocate: return per-prompt rollout counts.
        min_rollouts: lower bound per prompt (>= 2 keeps a group baseline).
        floor: added to sampling weights.
        decay: retention of a prompt's old evidence when re-observed.
    """

    roles = frozenset({Role.ALLOCATE})

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        seed: int = 0,
        *,
        n_samples: int,
        allocate: bool,
        min_rollouts: int,
        floor: float,
        decay: float,
        **beta: Any,
    ) -> None:
        super().__init__(num_prompts, prompts_per_step, seed, **beta)
        self.n_samples, self.allocate = int(n_samples), bool(allocate)
        self.min_rollouts, self.floor, self.decay_rate = int(min_rollouts), float(floor), float(decay)
        if not self.allocate:  # prompt choice only: the sampler's own group size
            self.roles = frozenset()

    def weights(self) -> np.ndarray:
        """``[N]`` normalised prompt sampling probabilities."""
        m = self.mean
        w = np.sqrt(m * (1 - m)) + self.floor
        return w / w.sum()

    def select(self, step: int) -> List[int]:  # noqa: D102 - see class
        k = min(self.prompts_per_step, self.num_prompts)
        return self.rng.choice(self.num_prompts, size=k, replace=False, p=self.weights()).tolist()

    def rollout_counts(self, prompt_indices: List[int]) -> Optional[List[int]]:  # noqa: D102 - see class

        k = len(prompt_indices)
        m = self.mean[np.asarray(prompt_indices, dtype=np.int64)]
        base = [self.min_rollouts] * k
        extra = apportion(m * (1 - m) + 1e-6, max(0, self.n_samples * k - self.min_rollouts * k))
        return [b + e for b, e in zip(base, extra)]

    def update(self, prompt_indices, rewards):  # noqa: D102
        for i, r in zip(prompt_indices, rewards):
            self.decay(int(i), self.decay_rate)
            self.observe(int(i), list(r))


UNSOLVED, PARTIAL, SOLVED = 0, 1, 2


@dataclass(frozen=True)
class DpsSelectorParams:
    """Parameters of :class:`DpsSelector` (Dynamics-predictive sampling)."""

    prior: Optional[List[float]] = param(None, "initial belief ``[unsolved, partial, solved]``.")
    stay_prior: float = param(4.0, "Dirichlet pseudo-count on the diagonal of ``T``.")
    explore: float = param(0.02, "Gumbel noise scale on the selection scores.")
    obs_noise: float = param(0.05, "weight of the uniform belief mixed into an observation.")
    threshold: float = param(0.5, "reward counted as success.")


@SELECTORS.register(
    "dps",
    paper="Dynamics-Predictive Sampling for Active RL Finetuning of Large Reasoning Models (arXiv:2603.10887)",
    description="HMM of each prompt's solve state (unsolved/partial/solved), filtered online; picks predicted-partial prompts.",
    params=DpsSelectorParams,
)
class DpsSelector(Selector):
    """Dynamics-predictive sampling.

    Each prompt has a belief over three solve states: unsolved (all rollouts
    fail), partially solved (mixed rewards), solved (all succeed). One transition
    matrix ``T`` shared by all prompts describes how a state evolves in one
    training step; it is learned online as the posterior mean of Dirichlet
    counts (prior ``stay_prior`` on the diagonal, 1 elsewhere). Each step every
    belief is propagated ``b <- b T`` (prediction), and the ``k`` prompts with the
    highest predicted probability of being partially solved are chosen (ties
    and near-ties broken by a Gumbel perturbation of scale ``explore``), before
    any rollout. When a prompt is rolled out its state is observed from the
    group (``obs_noise`` mixes the one-hot observation with a uniform belief to
    allow for small groups), and the transition from its previous observed
    state is counted once, whatever the gap (our simplification).

    Args:
        prior: initial belief ``[unsolved, partial, solved]``.
        stay_prior: Dirichlet pseudo-count on the diagonal of ``T``.
        explore: Gumbel noise scale on the selection scores.
        obs_noise: weight of the uniform belief mixed into an observation.
        threshold: reward counted as success.
    """

    saved_state = ("belief", "counts", "last_obs")

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        seed: int = 0,
        *,
        prior: Optional[List[float]],
        stay_prior: float,
        explore: float,
        obs_noise: float,
        threshold: float,
    ) -> None:
        super().__init__(num_prompts, prompts_per_step, seed)
        pr = np.asarray(prior if prior is not None else [1 / 3, 1 / 3, 1 / 3], dtype=np.float64)
        self.belief = np.tile(pr / pr.sum(), (num_prompts, 1))
        self.counts = np.ones((3, 3)) + np.eye(3) * (float(stay_prior) - 1.0)
        self.last_obs = np.full(num_prompts, -1, dtype=np.int64)
        self.explore, self.obs_noise, self.threshold = float(explore), float(obs_noise), float(threshold)

    @property
    def transition(self) -> np.ndarray:
        """``[3, 3]`` row-stochastic transition matrix (posterior mean)."""
        return self.counts / self.counts.sum(1, keepdims=True)

    def state_of(self, rewards: List[float]) -> int:
        """Observed solve state of one group of rewards."""
        s = sum(1 for r in rewards if r >= self.threshold)
        return SOLVED if s == len(rewards) else (UNSOLVED if s == 0 else PARTIAL)

    def select(self, step: int) -> List[int]:  # noqa: D102 - see class
        self.belief = self.belief @ self.transition
        score = self.belief[:, PARTIAL] + self.explore * self.rng.gumbel(size=self.num_prompts)
        k = min(self.prompts_per_step, self.num_prompts)
        return np.argsort(-score, kind="stable")[:k].tolist()

    def update(self, prompt_indices, rewards):  # noqa: D102 - see class
        for i, r in zip(prompt_indices, rewards):
            i = int(i)
            s = self.state_of(list(r))
            if self.last_obs[i] >= 0:
                self.counts[self.last_obs[i], s] += 1.0
            self.last_obs[i] = s
            b = np.full(3, self.obs_noise / 3)
            b[s] += 1.0 - self.obs_noise
            self.belief[i] = b

    def metrics(self) -> Dict[str, float]:  # noqa: D102
        T = self.transition
        return {
            "selector/pred_partial_mean": float(self.belief[:, PARTIAL].mean()),
            "selector/T_stay_partial": float(T[PARTIAL, PARTIAL]),
            "selector/T_partial_to_solved": float(T[PARTIAL, SOLVED]),
        }
