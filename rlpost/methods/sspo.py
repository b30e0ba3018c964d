"""SSPO's subsentences: the subsentence index of every response token.

"SSPO: Subsentence-level Policy Optimization" (arXiv:2511.04256). Losses tagged
``needs_segments`` read ``extras['segment_ids']`` ``[B, R]``
(:func:`rlpost.algos.inputs.subsentence_ids`).
"""

from __future__ import annotations

from typing import Any, Dict

from rlpost.algos.inputs import subsentence_ids
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.methods.base import METHODS, Method, Needs, RunServices


@METHODS.register("sspo", paper="SSPO (arXiv:2511.04256)")
class Subsentences(Method):
    """``batch.extras['segment_ids']`` from the tokenizer's token texts."""

    name = "sspo"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(POLICY_LOSSES.tag(str(cfg.algo.loss), "needs_segments", False))

    def needs(self) -> Needs:
        return Needs(provides=("segment_ids",))

    def describe(self) -> str:
        return "subsentence ids"

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        seg = subsentence_ids(batch.response_ids, batch.response_mask, run.tokenizer)
        batch.extras["segment_ids"] = seg
        return {"sspo/subsentences_mean": float(((seg * batch.response_mask.long()).amax(-1) + 1).float().mean())}
