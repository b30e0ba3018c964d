"""VCPO: an importance-weighted minimum-variance baseline and an ESS-scaled learning rate.

"VCPO" (arXiv:2602.17616). Two independent switches:

* ``algo.adv_params.baseline=min_variance``: the group baseline weights each
  sequence by ``pi_old / pi_behav``, so the old log-probs are needed;
* ``algo.offpolicy.vcpo_lr=true``: each optimizer step's learning rate is
  scaled by :func:`rlpost.algos.offpolicy.vcpo_lr_scale` of the effective
  sample size fraction of the mini-batch's importance weights
  ``exp(old - rollout)`` over its response tokens.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from rlpost.algos.offpolicy import vcpo_lr_scale
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.validate import adv_overrides, trainer_loss_params
from rlpost.methods.base import METHODS, Method, Needs


def _min_variance(algo_cfg: Any) -> bool:
    kw = ADV_ESTIMATORS.kwargs(algo_cfg.adv_estimator, adv_overrides(algo_cfg), "algo.adv_params")
    return str(kw.get("baseline")) == "min_variance"  # estimators without a baseline parameter never need it


@METHODS.register("vcpo", paper="VCPO (arXiv:2602.17616)")
class ESSScaledStep(Method):
    """Old log-probs for the baseline; the ESS of each mini-batch scales its step."""

    name = "vcpo"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        tp = trainer_loss_params(cfg.algo)
        self.lr_on, self.power, self.floor = bool(tp.vcpo_lr), float(tp.vcpo_power), float(tp.vcpo_min_scale)
        self.sums = [0.0, 0.0, 0.0]

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(trainer_loss_params(cfg.algo).vcpo_lr) or _min_variance(cfg.algo)

    def needs(self) -> Needs:
        return Needs(old_logprobs=_min_variance(self.cfg.algo))

    def observe_weights(self, mb: Any, old_logprobs: torch.Tensor) -> None:
        if not self.lr_on:
            return
        m = mb.response_mask.to(old_logprobs.device)
        with torch.no_grad():
            iw = torch.exp((old_logprobs.float() - mb.rollout_logprobs.to(old_logprobs.device).float()).clamp(-20, 20)) * m
            self.sums = [self.sums[0] + float(iw.sum()), self.sums[1] + float((iw * iw).sum()), self.sums[2] + float(m.sum())]

    def lr_scale(self) -> Tuple[float, Dict[str, float]]:
        if not self.lr_on:
            return 1.0, {}
        s1, s2, n = self.sums
        self.sums = [0.0, 0.0, 0.0]
        ef = (s1 * s1 / (s2 * n)) if (s2 > 0 and n > 0) else 1.0
        scale = vcpo_lr_scale(ef, self.power, self.floor)
        return scale, {"offpolicy/vcpo_lr_scale": scale, "offpolicy/ess_frac": ef}
