"""ERC's entropy ratio: the pre-update policy's per-token entropy, from one more no-grad pass.

"Entropy Ratio Clipping as a Soft Global Constraint for Stable Reinforcement
Learning" (ERC). A loss tagged ``needs_old_entropy`` reads
``extras['old_entropy']`` ``[B, R]``; on a single on-policy pass it is the
current entropy (no pass).
"""

from __future__ import annotations

from typing import Any, Dict

from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.validate import trainer_loss_params
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method, Needs, RunServices


@METHODS.register("erc", paper="Entropy Ratio Clipping (ERC)")
class OldEntropy(Method):
    """``batch.extras['old_entropy']`` after the old log-probs."""

    name = "erc"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(POLICY_LOSSES.tag(str(cfg.algo.loss), "needs_old_entropy", False))

    def validate(self) -> None:
        if str(trainer_loss_params(self.cfg.algo).proximal) == "a3po":
            raise ConfigError(
                f"algo.loss={self.cfg.algo.loss} compares each token's entropy with the old policy's, which the runner "
                f"computes with the old log-probs; algo.offpolicy.proximal=a3po skips that pass, so the ratio would "
                f"always be 1. Use algo.offpolicy.proximal=recompute with this loss.")

    def needs(self) -> Needs:
        return Needs(provides=("old_entropy",))

    def after_old_logprobs(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        batch.extras["old_entropy"] = run.rows_pass(batch, lambda b: run.logprobs(b, with_entropy=True)[1])
        return {}
