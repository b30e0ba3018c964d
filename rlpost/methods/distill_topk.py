"""Top-K distillation's update forward: the student's log-probs on the teacher's top-K support.

A loss tagged ``teacher_topk`` (:mod:`rlpost.algos.distill`) reads
``support_logprobs`` (with grad) and ``teacher_support_logprobs`` ``[b, R, K]``
(:func:`rlpost.models.teacher.student_support_pass`), from the teacher stage's
``extras['teacher_topk_ids']``.
"""

from __future__ import annotations

from typing import Any, Optional

from rlpost.algos.registries import POLICY_LOSSES
from rlpost.methods.base import METHODS, ForwardOut, ForwardPass, Method, Needs
from rlpost.models.teacher import student_support_pass


@METHODS.register("distill_topk", paper="top-K on-policy distillation")
class TeacherSupport(Method):
    """The update's forward on the teacher's support."""

    name = "distill_topk"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(POLICY_LOSSES.tag(str(cfg.algo.loss), "teacher_topk", None))

    def needs(self) -> Needs:
        return Needs(provides=("support_logprobs", "teacher_support_logprobs"))

    def forward(self, fwd: ForwardPass, mb: Any, with_entropy: bool, entropy_grad: bool) -> Optional[ForwardOut]:
        if "teacher_topk_ids" not in mb.extras:
            return None
        return student_support_pass(fwd, mb, with_entropy, entropy_grad)
