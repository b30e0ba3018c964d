"""CAPO's update forward: log-probs plus each token's predicted objective change and Fisher KL.

:func:`rlpost.algos.capo.capo_forward` (the loss tagged ``capo_forward``); its
shadow Adam state lives in the trainer's ``loss_state`` and is one process's own.
"""

from __future__ import annotations

from typing import Any, Optional

from rlpost.algos.capo import capo_forward
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.validate import loss_kwargs
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, ForwardOut, ForwardPass, Method, Needs


@METHODS.register("capo", paper="CAPO's curvature-aware token mask")
class CurvatureMask(Method):
    """The update's forward computes CAPO's per-token predictions."""

    name = "capo"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(POLICY_LOSSES.tag(str(cfg.algo.loss), "capo_forward", False))

    def validate(self) -> None:
        t = self.cfg.trainer
        if str(t.engine) != "torch" or int(t.get("num_procs", 1) or 1) > 1:
            raise ConfigError("algo.loss=capo keeps its shadow Adam state in one process. "
                              "Fix: trainer.engine=torch trainer.num_procs=1.")

    def needs(self) -> Needs:
        return Needs(provides=("predicted_change", "predicted_kl"))

    def forward(self, fwd: ForwardPass, mb: Any, with_entropy: bool, entropy_grad: bool) -> Optional[ForwardOut]:
        if fwd.multi_process:
            raise ConfigError("algo.loss=capo keeps its shadow Adam state in one process. Fix: trainer.engine=torch.")
        return capo_forward(fwd, mb, with_entropy, entropy_grad, loss_kwargs(self.cfg.algo), int(fwd.seed or 0))
