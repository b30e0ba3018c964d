"""CSCR's privileged contexts: each response token's log-prob shift under a correct- and a wrong-answer hint.

Three no-grad passes of the current policy (:func:`rlpost.algos.cscr.privileged_shifts`);
the estimator tagged ``needs_privileged_shifts`` (``cscr``) reads
``batch.extras['privileged_shifts']`` ``[B, R, 2]``, which the advantages stage consumes.
"""

from __future__ import annotations

from typing import Any, Dict

from rlpost.algos.cscr import privileged_shifts
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.methods.base import METHODS, Method, Needs, RunServices


@METHODS.register("cscr", paper="Counterfactual Sensitivity Credit Reallocation (CSCR)")
class PrivilegedShifts(Method):
    """``batch.extras['privileged_shifts']`` from three teacher-forced passes."""

    name = "cscr"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "needs_privileged_shifts", False))

    def needs(self) -> Needs:
        return Needs(provides=("privileged_shifts",))

    def describe(self) -> str:
        return "privileged-context log-prob shifts (CSCR)"

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        sh = privileged_shifts(batch, run.logprobs, run.tokenizer)
        batch.extras["privileged_shifts"] = sh
        return {"adv/privileged_shift_abs_mean": float(sh.abs().mean(-1).sum() / batch.response_mask.sum().clamp(min=1))}
