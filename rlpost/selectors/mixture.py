"""``selector=domain_mixture`` (Apriel-Reasoner) and ``selector=seele`` (hint lengths from an IRT fit)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from rlpost.core.apportion import apportion
from rlpost.core.errors import ConfigError
from rlpost.core.registry import param
from rlpost.selectors.base import (
    Role,
    SELECTORS,
    Selector,
    UniformSelector,
    append_history,
    is_zero_variance,
    success_rate,
)
from rlpost.tasks.base import stored_solution


@dataclass(frozen=True)
class DomainMixtureSelectorParams:
    """Parameters of :class:`DomainMixtureSelector` (Keep the *realised* domain ratios on target)."""

    targets: Optional[Dict[str, float]] = param(None, "``{domain: ratio}`` (default: equal shares).")
    domains: Optional[List[str]] = param(None, "per-prompt labels (overrides examples).")
    ema: float = param(0.8, "smoothing of the per-domain effective share.")
    floor: float = param(0.05, "lowest effective share used in the correction.")


@SELECTORS.register(
    "domain_mixture",
    paper="Apriel-Reasoner: RL Post-Training for General-Purpose and Efficient Reasoning (arXiv:2604.02007)",
    description="Ratio-preserving multi-domain sampling: quotas corrected by each domain's share of effective groups.",
    params=DomainMixtureSelectorParams,
)
class DomainMixtureSelector(Selector):
    """Keep the *realised* domain ratios on target.

    Domains come from ``attach(examples=...)`` (``example.meta['domain']``, else
    ``'default'``) or the ``domains`` parameter (one label per prompt). What is
    "realised" is measured per domain as an exponential moving average (factor
    ``ema``) of the share of its groups that are effective (mixed rewards), since
    zero-variance groups add nothing to a GRPO update; domains whose groups are
    less often effective (or, in the paper, whose rollouts are longer) would
    otherwise be under-represented. Quotas per step are ``target_d /
    eff_d`` normalised and rounded by largest remainder; prompts are drawn
    uniformly without replacement inside each domain.

    Args:
        targets: ``{domain: ratio}`` (default: equal shares).
        domains: per-prompt labels (overrides examples).
        ema: smoothing of the per-domain effective share.
        floor: lowest effective share used in the correction.

    Raises:
        ValueError / ConfigError (at attach): ``targets`` names an unknown domain.
    """

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        seed: int = 0,
        *,
        targets: Optional[Dict[str, float]],
        domains: Optional[Sequence[str]],
        ema: float,
        floor: float,
    ) -> None:
        super().__init__(num_prompts, prompts_per_step, seed)
        self.targets_cfg = dict(targets or {})
        self.ema, self.floor = float(ema), float(floor)
        self.eff: Dict[str, float] = {}
        self.realised: Dict[str, float] = {}
        self.fixed_domains = domains is not None
        self._set_domains(list(domains) if domains is not None else ["default"] * num_prompts, check=self.fixed_domains)

    def _set_domains(self, labels: List[str], check: bool = True) -> None:
        if len(labels) != self.num_prompts:
            raise ValueError("domain_mixture needs one domain label per prompt")
        self.labels = [str(x) for x in labels]
        self.by_domain: Dict[str, List[int]] = {}
        for i, d in enumerate(self.labels):
            self.by_domain.setdefault(d, []).append(i)
        names = sorted(self.by_domain)
        unknown = sorted(set(map(str, self.targets_cfg)) - set(names))
        if check and unknown:
            raise ValueError(
                f"domain_mixture: selector.params.targets names domains {unknown} that the data does not have; "
                f"its domains are {names}"
            )
        t = {d: float(self.targets_cfg.get(d, 0.0 if self.targets_cfg else 1.0)) for d in names}
        tot = sum(t.values()) or 1.0
        self.targets = {d: v / tot for d, v in t.items()}
        # domains that no longer exist (the placeholder 'default' before attach) are dropped
        self.eff = {d: self.eff.get(d, 1.0) for d in names}
        self.realised = {d: v for d, v in self.realised.items() if d in self.by_domain}

    def attach(self, **resources: Any) -> None:
        """Take the domains from ``examples`` (``meta['domain']``) unless ``domains`` was given.

        Raises:
            ConfigError: ``targets`` names a domain the examples do not have.
        """

        ex = resources.get("examples")
        if ex is not None and len(ex) == self.num_prompts and not self.fixed_domains:
            try:
                self._set_domains([str((getattr(e, "meta", {}) or {}).get("domain", "default")) for e in ex])
            except ValueError as e:
                raise ConfigError(str(e)) from None

    def quotas(self) -> Dict[str, int]:
        """Prompts per domain for the next step."""

        names = [d for d in sorted(self.by_domain) if self.targets.get(d, 0) > 0]
        w = [self.targets[d] / max(self.eff[d], self.floor) for d in names]
        q = apportion(w, self.prompts_per_step, cap=[len(self.by_domain[d]) for d in names])
        return dict(zip(names, q))

    def select(self, step: int) -> List[int]:  # noqa: D102 - see class
        out: List[int] = []
        for d, q in self.quotas().items():
            if q:
                out += self.rng.choice(self.by_domain[d], size=q, replace=False).tolist()
        return out

    def update(self, prompt_indices, rewards):  # noqa: D102 - see class
        n: Dict[str, int] = {}
        e: Dict[str, int] = {}
        for i, r in zip(prompt_indices, rewards):
            d = self.labels[int(i)]
            n[d] = n.get(d, 0) + 1
            e[d] = e.get(d, 0) + (0 if is_zero_variance(list(r)) else 1)
        for d in n:
            self.eff[d] = self.ema * self.eff[d] + (1 - self.ema) * e[d] / n[d]
        tot = sum(e.values())
        if tot:
            for d in self.by_domain:
                self.realised[d] = self.ema * self.realised.get(d, self.targets.get(d, 0)) + (1 - self.ema) * e.get(d, 0) / tot

    def metrics(self) -> Dict[str, float]:
        """``selector/realised_<d>`` (EMA share of effective groups), ``selector/effective_<d>``
        (EMA effective share within the domain) and ``selector/quota_<d>`` (prompts per step).

        The driver reads these before the step's rewards update the selector, so
        a step logs the quotas it used and the shares from the steps before it.
        """
        out = {f"selector/realised_{d}": v for d, v in self.realised.items()}
        out.update({f"selector/effective_{d}": v for d, v in self.eff.items()})
        out.update({f"selector/quota_{d}": float(q) for d, q in self.quotas().items()})
        return out

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102
        return {**super().state_dict(), "eff": dict(self.eff), "realised": dict(self.realised), "labels": list(self.labels)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # noqa: D102
        super().load_state_dict(state)
        self._set_domains(list(state["labels"]))
        self.eff = dict(state["eff"])
        self.realised = dict(state["realised"])


def fit_irt_difficulty(h: Sequence[float], acc: Sequence[float], n: Sequence[float], slope: float, prior_mean: float, prior_sd: float, iters: int = 25) -> float:
    """MAP difficulty ``b`` of a one-parameter logistic IRT curve ``P(h) = sigmoid(slope (h - b))``.

    Args:
        h: hint fractions of past rounds.
        acc: observed accuracies at those hints (in [0, 1]).
        n: rollouts behind each accuracy (binomial weights).
        slope: fixed discrimination ``a``.
        prior_mean, prior_sd: Gaussian prior on ``b``.
    Returns:
        the posterior-mode ``b`` (Newton's method on the binomial log-likelihood).
    """
    h, acc, n = (np.asarray(x, dtype=np.float64) for x in (h, acc, n))
    b = float(prior_mean)
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-slope * (h - b)))
        g = float((n * (acc - p) * -slope).sum()) - (b - prior_mean) / prior_sd**2
        H = float(-(n * p * (1 - p) * slope**2).sum()) - 1.0 / prior_sd**2
        step = g / H
        b -= step
        if abs(step) < 1e-8:
            break
    return b


@dataclass(frozen=True)
class SeeleSelectorParams:
    """Parameters of :class:`SeeleSelector` (Per-prompt hint length from an item-response-theory fit)."""

    target: float = param(0.5, "accuracy to aim for.")
    slope: float = param(6.0, "IRT discrimination ``a`` (per unit of hint fraction).")
    prior_b: float = param(0.3, "prior mean of ``b_x`` (start hint = prior_b + logit(target) / a).")
    prior_sd: float = param(0.5, "prior standard deviation of ``b_x``.")
    max_hint: float = param(0.9, "largest hint fraction.")
    threshold: float = param(0.5, "reward at or above which a rollout counts as a success.")


@SELECTORS.register(
    "seele",
    paper="Staying in the Sweet Spot: Responsive Reasoning Evolution via Capability-Adaptive Hint Scaffolding (SEELE, arXiv:2509.06923)",
    description="Uniform prompts, each with a hint (prefix of its reference solution) sized by a per-prompt IRT fit to hit a target accuracy.",
    params=SeeleSelectorParams,
)
class SeeleSelector(UniformSelector):
    """Per-prompt hint length from an item-response-theory fit.

    A prompt's accuracy as a function of the hint fraction ``h`` (share of its
    reference solution appended after the prompt) is modelled as ``sigmoid(a (h
    - b_x))``, slope ``a`` shared and fixed, difficulty ``b_x`` fitted by MAP
    (Gaussian prior) to all ``(h, accuracy)`` pairs of that prompt so far
    (:func:`fit_irt_difficulty`). The next hint solves ``sigmoid(a (h - b_x)) =
    target``: ``h = b_x + logit(target) / a``, clipped to ``[0, max_hint]``.
    Each selection of a prompt is one round (the paper runs several rounds
    inside a step; here rounds are spread over steps, our simplification).
    Prompts are drawn like ``uniform``. The hint is a prefix of the task's
    worked solution (:meth:`rlpost.tasks.base.Task.reference_solution`; for the
    default arithmetic task ``"58 + 3 = 61"``) built by :func:`make_hint_fn`;
    its tokens open the assistant turn (no loss on them) and the verifier
    scores hint + completion as one answer, as in the paper.

    Paper: "Staying in the Sweet Spot: Responsive Reasoning Evolution via
    Capability-Adaptive Hint Scaffolding" (SEELE, arXiv:2509.06923). The paper
    fits a three-parameter logistic IRT model; we fit only the difficulty with
    a fixed shared slope and no guessing floor (one parameter per prompt, from a
    handful of observations per prompt): our choice.

    Args:
        target: accuracy to aim for.
        slope: IRT discrimination ``a`` (per unit of hint fraction).
        prior_b: prior mean of ``b_x`` (start hint = prior_b + logit(target) / a).
        prior_sd: prior standard deviation of ``b_x``.
        max_hint: largest hint fraction.
        threshold: reward at or above which a rollout counts as a success.

    Raises:
        ValueError: ``target`` outside (0, 1).
    """

    roles = frozenset({Role.HINT})
    saved_state = ("obs", "last_hint")

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        seed: int = 0,
        *,
        target: float,
        slope: float,
        prior_b: float,
        prior_sd: float,
        max_hint: float,
        threshold: float,
    ) -> None:
        super().__init__(num_prompts, prompts_per_step, seed)
        if not 0 < target < 1:
            raise ValueError("seele target must be in (0, 1)")
        self.target, self.slope = float(target), float(slope)
        self.prior_b, self.prior_sd, self.max_hint = float(prior_b), float(prior_sd), float(max_hint)
        self.threshold = float(threshold)
        self.obs: Dict[int, List[List[float]]] = {}
        self.last_hint: Dict[int, float] = {}
        self.step_hints: List[float] = []

    def hint_for(self, i: int) -> float:
        """Hint fraction for prompt ``i`` from its current IRT fit."""
        o = self.obs.get(int(i))
        b = self.prior_b if not o else fit_irt_difficulty(*zip(*o), slope=self.slope, prior_mean=self.prior_b, prior_sd=self.prior_sd)
        h = b + np.log(self.target / (1 - self.target)) / self.slope
        return float(np.clip(h, 0.0, self.max_hint))

    def hint_fractions(self, prompt_indices: List[int]) -> Optional[List[float]]:  # noqa: D102 - see class
        out = [self.hint_for(i) for i in prompt_indices]
        self.step_hints = list(out)
        for i, h in zip(prompt_indices, out):
            self.last_hint[int(i)] = h
        return out

    def update(self, prompt_indices, rewards):  # noqa: D102 - see class
        for i, r in zip(prompt_indices, rewards):
            r = list(r)
            if not r:
                continue
            append_history(self.obs, int(i), [self.last_hint.get(int(i), 0.0), success_rate(r, self.threshold), float(len(r))])

    def metrics(self) -> Dict[str, float]:
        """``selector/hint_mean``: mean hint fraction of this step's prompts (0 before any)."""
        h = self.step_hints
        return {"selector/hint_mean": float(np.mean(h)) if h else 0.0}


@dataclass(frozen=True)
class Hint:
    """A SEELE hint: ``ids`` (token ids appended after the rendered prompt, opening the
    assistant turn, carrying no loss) and ``text`` (their text, put in front of the
    completion when it is scored, so the verifier judges hint + completion as one answer)."""

    ids: List[int]
    text: str


def make_hint_fn(examples: Sequence[Any], tokenizer: Any, solution: Optional[Callable[[Any], str]] = None) -> Callable[[int, float], Hint]:
    """``fn(dataset index, fraction) -> Hint``: the first ``fraction`` of a worked solution.

    Args:
        examples: the training examples (indexed by dataset index).
        tokenizer: the policy's tokenizer.
        solution: ``fn(example) -> worked solution text`` (the task's
            :meth:`rlpost.tasks.base.Task.reference_solution`); default
            :func:`rlpost.tasks.base.stored_solution`.

    The prefix is cut at a character boundary (``round(len * fraction)``
    characters; an empty hint for 0). SEELE (arXiv:2509.06923) scores the model's
    continuation together with the hint, so :func:`rlpost.run.collect.collect_rollouts`
    prepends :attr:`Hint.text` to each completion before scoring.
    """

    sol_of = solution or stored_solution

    def fn(i: int, fraction: float) -> Hint:
        sol = sol_of(examples[int(i)])
        k = int(round(len(sol) * max(0.0, min(1.0, fraction))))
        if k <= 0:
            return Hint([], "")
        text = sol[:k]
        return Hint(list(tokenizer.encode(text, add_special_tokens=False)), text)

    return fn
