"""MIPU's update gate: a candidate step is kept only if the inference copy improves by a proxy.

(:mod:`rlpost.algos.mipu`, arXiv:2606.29526), ``algo.update_gate``: the update
runs, the engine loads the candidate, an inference-side gap proxy decides, and
a rejected candidate is rolled back exactly (weights, optimizer, schedule).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from rlpost.algos.mipu import MIPUGate, check_update_gate
from rlpost.methods.base import METHODS, Method, RunServices


@METHODS.register("mipu", paper="MIPU (arXiv:2606.29526)")
class UpdateGate(Method):
    """Accept or roll back each policy update."""

    name = "mipu"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.gate: Optional[MIPUGate] = None

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return cfg.algo.get("update_gate", None) is not None

    def validate(self) -> None:
        c = check_update_gate(self.cfg)
        self.gate = MIPUGate(min_gain=c["min_gain"], max_kl=c["max_kl"], temperature=float(self.cfg.rollout.temperature))

    def wrap_update(self, update: Callable[[], Dict[str, Any]], run: RunServices, batch: Any) -> Optional[Dict[str, Any]]:
        return self.gate.update(update, run.local_engine, batch, run.policy, run.snapshot, run.restore)
