"""OTR's update forward: reference log-probs plus K rewarded candidate tokens per position.

One-token rollouts (:mod:`rlpost.algos.otr`): the loss tagged
``one_token_rollout`` reads ``support_logprobs`` / ``support_rewards``
``[b, R, K]`` from :func:`rlpost.algos.otr.otr_forward`.
"""

from __future__ import annotations

from typing import Any, Optional

from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.otr import otr_forward
from rlpost.algos.validate import loss_kwargs
from rlpost.methods.base import METHODS, ForwardOut, ForwardPass, Method, Needs


@METHODS.register("otr", paper="One-token rollouts")
class OneTokenRollouts(Method):
    """The update's forward draws the candidates."""

    name = "otr"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(POLICY_LOSSES.tag(str(cfg.algo.loss), "one_token_rollout", False))

    def needs(self) -> Needs:
        return Needs(provides=("support_logprobs", "support_rewards"))

    def forward(self, fwd: ForwardPass, mb: Any, with_entropy: bool, entropy_grad: bool) -> Optional[ForwardOut]:
        return otr_forward(fwd, mb, with_entropy, entropy_grad, loss_kwargs(self.cfg.algo), fwd.seed)
