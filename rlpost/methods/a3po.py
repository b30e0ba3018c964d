"""A-3PO's proximal log-probs: an interpolation between the behaviour and the current policy, no pass.

"A-3PO" (arXiv:2512.06547), ``algo.offpolicy.proximal=a3po``: several
optimizer steps per batch anchor their ratios to
:func:`rlpost.algos.offpolicy.a3po_proximal_logprobs` of the rollout log-probs
and the current ones (per token from ``extras['token_version']`` for partial
rollouts), so the ``old_logprobs`` pass is skipped.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from rlpost.algos.offpolicy import a3po_proximal_logprobs
from rlpost.algos.validate import trainer_loss_params
from rlpost.methods.base import METHODS, Method, Needs


@METHODS.register("a3po", paper="A-3PO (arXiv:2512.06547)")
class InterpolatedProximal(Method):
    """Proximal log-probs without a forward pass."""

    name = "a3po"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return str(trainer_loss_params(cfg.algo).proximal) == "a3po"

    def needs(self) -> Needs:
        return Needs(skip_old_logprobs=True)

    def proximal(self, mb: Any, logprobs: torch.Tensor, version_start: int, version: int) -> Optional[torch.Tensor]:
        if mb.policy_version is None:
            return None
        bv = mb.extras.get("token_version", mb.policy_version)
        return a3po_proximal_logprobs(mb.rollout_logprobs.to(logprobs.device), logprobs, bv, version_start, version)
