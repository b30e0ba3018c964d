"""SP3O's sparse critic supervision: the value loss at a few states per response.

``algo.critic.supervised_states > 0`` (:mod:`rlpost.algos.sp3o`): the states
are drawn once per critic update for the whole batch, so every micro-batch
and process uses the same positions.
"""

from __future__ import annotations

from typing import Any

from rlpost.algos.sp3o import with_critic_mask
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method


@METHODS.register("sp3o", paper="SP3O: sparse critic supervision")
class SparseCriticStates(Method):
    """The critic's loss mask."""

    name = "sp3o"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return int(cfg.algo.critic.get("supervised_states", 0) or 0) != 0

    def validate(self) -> None:
        n = int(self.cfg.algo.critic.get("supervised_states", 0) or 0)
        if n < 0:
            raise ConfigError(f"algo.critic.supervised_states={n} must be >= 0 "
                              "(0: the value loss on every response token; n > 0: SP3O's n sparse states)")

    def critic_batch(self, batch: Any, seed: int) -> Any:
        return with_critic_mask(batch, self.cfg.algo.critic, seed)
