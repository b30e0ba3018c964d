"""MSSR's single-rollout baseline: a per-prompt Beta posterior of the success rate, kept across steps.

The estimator ``mssr`` (:mod:`rlpost.algos.advantages`) reads
``batch.extras['baseline_rewards']`` ``[B]``: the tracker's posterior mean
before this step's rewards (:class:`rlpost.algos.shaping.BetaBaselineTracker`),
which then learns them. Saved with every checkpoint.
"""

from __future__ import annotations

from typing import Any, Dict

from rlpost.algos.shaping import BetaBaselineTracker
from rlpost.methods.base import METHODS, Method, Needs, RunServices


@METHODS.register("mssr", paper="MSSR's per-prompt Beta baseline")
class BetaBaseline(Method):
    """Per-prompt Beta-posterior baseline of single-rollout MSSR."""

    name = "mssr"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.tracker = BetaBaselineTracker()

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return str(cfg.algo.adv_estimator) == "mssr"

    def needs(self) -> Needs:
        return Needs(provides=("baseline_rewards",))

    def describe(self) -> str:
        return "per-prompt Beta baseline"

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        pidx = [int(i) for i in batch.prompt_index]
        batch.extras["baseline_rewards"] = self.tracker.baseline(pidx)
        self.tracker.update(pidx, [float(r) for r in batch.rewards])
        return {"adv/beta_baseline_mean": float(batch.extras["baseline_rewards"].mean())}

    def state_dict(self) -> Dict[str, Any]:
        return {"tracker": self.tracker.state_dict()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if sd.get("tracker"):
            self.tracker.load_state_dict(sd["tracker"])
