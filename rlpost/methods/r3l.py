"""R^3L's optional importance weight on retried rows needs the pre-update log-probs.

"R^3L: Reflect-then-Retry Reinforcement Learning with Language-Guided Exploration,
Pivotal Credit, and Positive Amplification" (arXiv:2601.03715). With
``algo.adv_params.retry_is_cap > 0`` the ``r3l`` estimator (:mod:`rlpost.algos.r3l`)
weighs each retried row by ``min(cap, exp(mean (old - rollout log-prob)))`` over its
suffix, so the run must compute ``old_logprobs`` even with one optimizer step per
batch. This method only asks for that pass; with the release's default (0) it is off.
"""

from __future__ import annotations

from typing import Any

from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.validate import adv_overrides
from rlpost.methods.base import METHODS, Method, Needs


def _retry_is_cap(algo_cfg: Any) -> float:
    """``algo.adv_params.retry_is_cap`` of an ``adv_estimator=r3l`` config, else 0."""
    if str(algo_cfg.adv_estimator) != "r3l":
        return 0.0
    return float(ADV_ESTIMATORS.kwargs("r3l", adv_overrides(algo_cfg), "algo.adv_params")["retry_is_cap"])


@METHODS.register("r3l", paper="R^3L (arXiv:2601.03715)")
class RetryImportanceWeight(Method):
    """Requests the old log-probs for ``r3l``'s ``retry_is_cap > 0`` (module docstring)."""

    name = "r3l"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return _retry_is_cap(cfg.algo) > 0

    def needs(self) -> Needs:
        return Needs(old_logprobs=True)
