"""POISE's online probe: hidden-state predictions of each rollout's reward, then the probe's refit.

"Your Language Model is Its Own Critic" (POISE, :mod:`rlpost.algos.poise`). The
estimator tagged ``needs_probe`` reads ``batch.extras['probe_values']`` ``[B]``,
the probe's predictions before it learns this step's rows. The probe is saved
with every checkpoint.
"""

from __future__ import annotations

from typing import Any, Dict

from rlpost.algos.poise import PoiseProbe, probe_step
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.validate import adv_overrides
from rlpost.methods.base import METHODS, Method, Needs, RunServices


@METHODS.register("poise", paper="POISE: value estimation from the actor's hidden states")
class OnlineProbe(Method):
    """Pre-update probe predictions, then the probe's refit on the step's rows."""

    name = "poise"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        adv = str(cfg.algo.adv_estimator)
        self.params = dict(ADV_ESTIMATORS.kwargs(adv, adv_overrides(cfg.algo), "algo.adv_params"))
        self.probe = PoiseProbe(self.params)

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "needs_probe", False))

    def needs(self) -> Needs:
        return Needs(provides=("probe_values",))

    def describe(self) -> str:
        return "hidden-state probe predictions, then its refit (POISE)"

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        fwd = run.forward_pass()
        return probe_step(self.probe, batch, fwd.policy, fwd.device, run.logprobs, float(self.params["layer_frac"]),
                          int(self.params["pool_tokens"]))

    def state_dict(self) -> Dict[str, Any]:
        return {"probe": self.probe.state_dict()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if sd.get("probe"):
            self.probe.load_state_dict(sd["probe"])
