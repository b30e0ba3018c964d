"""ERPD stage 2: the stage-1 teacher's token-level log-ratio, filtered and fitted under a trust region.

"Extreme Region Policy Distillation" (ERPD; Chen, Wang, Yan; arXiv:2605.25582;
project https://github.com/ChangyuChen347/ERPD, not in the stored index). What was
readable here: the abstract, third-party summaries of the paper and two notes of
readers who had the full text ("we first sample responses for 1,000 prompts to
construct a static dataset"; stage 2 "distills the resulting teacher's token-level
log-ratio signal into the base policy under a trust-region constraint"; the
trust-region anchor is re-set at every round of the iterative loop), and the
authors' model cards (an "MSE-based teacher loss and unlearned teacher setup",
iterative rounds of 1K prompts x 16 rollouts). The method section's equations
were not readable, so every formula below is **our reading**, not the paper's.

The mechanism. Stage 1 optimises the base policy ``pi_0`` aggressively and weakly
constrained on one fixed set of rollouts of ``pi_0`` (many off-policy epochs, no
KL: ``algo=erpd_teacher``) and ends in the "extreme region" of that optimisation:
a teacher ``pi_T`` that has both learnt from the data and drifted (log-probs pushed
to their extremes, entropy collapsed). Stage 2 (this estimator, with ``ppo_clip``
as the trust region: ``algo=erpd``) starts again from ``pi_0``, reads the
teacher's log-probs of the sampled tokens (``model.teacher`` = stage 1's
``final/``) and turns them into a per-token advantage:

    delta_t = log pi_T(y_t | s_t) - log pi_old(y_t | s_t)          (nats)
    keep_t  = 1[|delta_t| <= max_log_ratio]                         (the extreme-region filter)
    s_t     = direction * delta_t            (signal=log_ratio, a strong teacher)
            | direction * sign(delta_t)      (signal=sign, a weak / degenerate teacher)
            | A_i * |delta_t|                (signal=advantage_weighted)
    A_t     = keep_t * s_t,   loss_mask_t = keep_t

``pi_old`` is the student at rollout time: in the first (or only) step of a stage-2
run it is exactly ``pi_0``, so ``delta`` is the teacher's displacement from the
base; in later steps it is the remaining gap to the teacher (the anchor re-set per
round). The filter drops tokens whose displacement is extreme (``|delta| > 3``
nats by default, a twenty-fold probability change: a rare token pushed to
certainty, a token of a failed response pushed to zero): there the teacher's move
is mostly the drift the paper blames for the entropy collapse. They leave the
update entirely (their ``loss_mask`` is 0, so they count in no denominator). On the
tokens kept, ``ppo_clip`` bounds how far each update moves the student from
``pi_old`` (the trust region): the student follows the teacher's direction but not
its distance.

Signal modes (the abstract: "even degenerate teachers provide effective supervision
via alternative signal construction strategies"; the strategies themselves are
ours): ``log_ratio`` trusts the teacher's magnitudes; ``sign`` keeps only the
direction of each token's move (a collapsed teacher's magnitudes are dominated by
the collapse); ``advantage_weighted`` takes the direction from the verifier (the
group's GRPO advantage ``A_i`` of the row) and only the per-token weight from how
far the teacher moved that token, so even a teacher whose own moves point the
wrong way can say *which* tokens matter. ``direction = -1`` reads a teacher trained
to move away from the data's rewarded behaviour (an "unlearned" teacher) in
reverse; it does not change ``advantage_weighted``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, grpo_advantage
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.core.registry import Choice, param

_PAPER = "Extreme Region Policy Distillation (ERPD, arXiv:2605.25582); our reading of its stage 2"


class ERPDSignal(Choice):
    """How the teacher's token-level log-ratio becomes the advantage (our reading of ERPD's strategies)."""

    log_ratio = "log_ratio"
    sign = "sign"
    advantage_weighted = "advantage_weighted"


@dataclass(frozen=True)
class ERPDParams:
    """ERPD stage 2 (arXiv:2605.25582). The paper's values could not be read: every default is our choice."""

    signal: ERPDSignal = param(ERPDSignal.log_ratio, "log_ratio: A = direction * delta (strong teacher); sign: "
                               "direction * sign(delta) (weak / degenerate teacher); advantage_weighted: GRPO "
                               "advantage of the row * |delta| (our reading)")
    direction: int = param(1, "+1: the teacher moved toward the reward; -1: it moved away (an unlearned teacher, "
                           "its signal read in reverse); not used by advantage_weighted")
    max_log_ratio: float = param(3.0, "extreme-region filter: tokens with |log pi_T - log pi_old| above this many "
                                 "nats leave the update (our choice 3, a 20x probability change; .inf keeps all)")


def erpd_log_ratio(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor,
                   response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` float64 ``delta_t = log pi_T(y_t) - log pi_old(y_t)`` on response tokens, 0 elsewhere (nats)."""
    return (teacher_logprobs.double() - student_logprobs.double()) * response_mask.double()


def extreme_region_keep(delta: torch.Tensor, response_mask: torch.Tensor, max_log_ratio: float) -> torch.Tensor:
    """``[B, R]`` 0/1 float64: response tokens outside the extreme region, ``|delta_t| <= max_log_ratio``."""
    return ((delta.abs() <= max_log_ratio) & (response_mask > 0)).double()


@ADV_ESTIMATORS.register("erpd", paper=_PAPER, params=ERPDParams, needs_teacher=True,
                         zero_variance=("not a reward baseline: the stage-1 teacher's minus the student's log-prob of "
                                        'each token (ERPD)'))
def erpd_advantage(inp: AdvantageInput, *, signal: str, direction: int, max_log_ratio: float) -> AdvantageOutput:
    """ERPD stage 2's token advantage from a frozen teacher (our reading; see the module docstring).

    Shapes: ``inp.teacher_logprobs`` and the student's log-probs ``[B, R]`` (nats;
    ``old_logprobs`` when the runner computed them, else the rollout engine's),
    ``inp.response_mask`` ``[B, R]``; ``signal=advantage_weighted`` also reads
    ``rewards`` ``[B]`` and ``group_index`` ``[B]`` (GRPO: ``(r - mean_g) / (std_g + 1e-6)``,
    0 for a group of one). Returns ``advantages`` ``[B, R]`` (0 outside the mask and
    in the extreme region) and ``loss_mask`` ``[B, R]`` (1 on the tokens kept), no
    returns.

    Raises:
        ValueError: no teacher log-probs (set ``model.teacher``), no student
            log-probs, ``direction`` not +1 / -1, ``max_log_ratio <= 0`` or NaN,
            an unknown ``signal``.
    """
    if direction not in (1, -1):
        raise ValueError(f"erpd: direction must be +1 or -1, got {direction!r}")
    if not max_log_ratio > 0:
        raise ValueError(f"erpd: max_log_ratio must be > 0 nats (.inf keeps every token), got {max_log_ratio!r}")
    if inp.teacher_logprobs is None:
        raise ValueError("erpd needs the teacher's log-probs: set model.teacher to the stage-1 policy "
                         "(e.g. outputs/<stage-1 run>/final)")
    student = inp.old_logprobs if inp.old_logprobs is not None else inp.rollout_logprobs
    if student is None:
        raise ValueError("erpd needs the student's rollout-time log-probs (old or rollout log-probs)")
    m = inp.response_mask
    delta = erpd_log_ratio(inp.teacher_logprobs, student, m)
    keep = extreme_region_keep(delta, m, max_log_ratio)
    signal = str(signal)
    if signal == "log_ratio":
        s = direction * delta
    elif signal == "sign":
        s = direction * torch.sign(delta)
    elif signal == "advantage_weighted":
        a = grpo_advantage(inp, norm_by_std=True, eps=1e-6, baseline="mean", unbiased_std=True, std_scope="group")
        s = a.advantages.double() * delta.abs()
    else:
        raise ValueError(f"erpd: unknown signal {signal!r} (log_ratio, sign, advantage_weighted)")
    return AdvantageOutput(advantages=(s * keep).float(), returns=None, loss_mask=keep.to(m.dtype))
