"""TBRM's ``V(s_1)``: the log-normaliser of the first response position's logits, with gradient.

"Trajectory Bellman Residual Minimization" (:mod:`rlpost.algos.tbrm`): a loss
tagged ``needs_first_log_normaliser`` reads ``extras['first_log_normaliser']`` ``[b]``.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.tbrm import first_position_log_normaliser
from rlpost.methods.base import METHODS, ForwardPass, Method, Needs


@METHODS.register("tbrm", paper="Trajectory Bellman Residual Minimization (TBRM)")
class FirstLogNormaliser(Method):
    """One more forward over each micro-batch's prompts."""

    name = "tbrm"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(POLICY_LOSSES.tag(str(cfg.algo.loss), "needs_first_log_normaliser", False))

    def needs(self) -> Needs:
        return Needs(provides=("first_log_normaliser",))

    def loss_extras(self, fwd: ForwardPass, mb: Any) -> Dict[str, torch.Tensor]:
        with fwd.autocast():
            v = first_position_log_normaliser(fwd.model, mb.prompt_ids.to(fwd.device), mb.prompt_mask.to(fwd.device),
                                              fwd.temperature(mb))
        return {"first_log_normaliser": v}
