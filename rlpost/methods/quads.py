"""QUADS: the trainer's weights pass through the rollout copy's weight quantiser.

``precision.trainer_weight_quant`` (:func:`rlpost.rollout.quads.apply_trainer_weight_quant`),
applied to the trainer's policy before any copy of it is made.
"""

from __future__ import annotations

from typing import Any

import torch

from rlpost.methods.base import METHODS, Method
from rlpost.rollout.quads import apply_trainer_weight_quant


@METHODS.register("quads", paper="QUADS: shared fake-quantised weights")
class TrainerWeightQuant(Method):
    """Attach the fake quantiser to the trainer's policy."""

    name = "quads"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return str(cfg.precision.get("trainer_weight_quant", "none") or "none") != "none"

    def attach_trainer(self, policy: torch.nn.Module) -> None:
        apply_trainer_weight_quant(self.cfg, policy)
