"""Per-token entropy of the rollout tokens for estimators that read it (tag ``needs_entropy``).

One no-grad pass of the current policy before the advantages; e.g. MSSR's
entropy-shaped advantages (:mod:`rlpost.algos.advantages`).
"""

from __future__ import annotations

from typing import Any, Dict

from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.methods.base import METHODS, Method, Needs, RunServices


@METHODS.register("rollout_entropy", paper="input of entropy-aware estimators")
class RolloutEntropy(Method):
    """``batch.extras['entropy']`` ``[B, R]`` (nats) under the current policy."""

    name = "rollout_entropy"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "needs_entropy", False))

    def needs(self) -> Needs:
        return Needs(provides=("entropy",))

    def describe(self) -> str:
        return "token entropy"

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        batch.extras["entropy"] = run.logprobs(batch, with_entropy=True)[1]
        return {}
