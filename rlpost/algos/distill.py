"""Distillation losses: a frozen teacher (``model.teacher``) scores the student's own rollouts.

The teacher's log-probs are computed by the runner's ``teacher_logprobs`` stage
(:class:`rlpost.models.teacher.Teacher`), like the reference log-probs; losses
here read them from :class:`rlpost.algos.losses.PolicyLossInput`
(``teacher_logprobs``, and for the top-K support ``support_logprobs`` /
``teacher_support_logprobs``). Registry tags:

* ``needs_teacher=True``: the run must set ``model.teacher`` (a ConfigError otherwise);
* ``teacher_topk="<param>"``: the teacher stage also returns the teacher's top-K
  token ids per position, K being the loss's parameter of that name, and the
  trainer computes the student's log-probs at those ids with gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.losses import PolicyLossInput, ratio_metrics
from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
from rlpost.algos.utils import masked_mean
from rlpost.core.registry import param

Metrics = Dict[str, torch.Tensor]


def truncated_reverse_kl(student_lp: torch.Tensor, teacher_lp: torch.Tensor, renormalise: bool = True) -> torch.Tensor:
    """Reverse KL ``KL(student || teacher)`` restricted to a per-position token support.

    Args:
        student_lp: ``[..., K]`` student log-probs at the support's K tokens (with
            grad), normalised over the full vocabulary.
        teacher_lp: ``[..., K]`` teacher log-probs at the same tokens.
        renormalise: renormalise both to distributions over the K tokens first
            (``log_softmax`` over K), so the value is a proper KL >= 0 and 0 when
            the two agree on the support's relative probabilities; otherwise the
            full-vocabulary probabilities are used as they are:
            ``sum_v p_s(v) (log p_s(v) - log p_t(v))`` over the support.
    Returns:
        ``[...]`` per-position truncated reverse KL (nats).
    """
    if renormalise:
        student_lp = torch.log_softmax(student_lp, dim=-1)
        teacher_lp = torch.log_softmax(teacher_lp, dim=-1)
    return (student_lp.exp() * (student_lp - teacher_lp)).sum(-1)


@dataclass(frozen=True)
class TopKReverseKLParams:
    """Teacher top-K local support matching (arXiv:2603.25562; authors' run script: K = 32, renormalised)."""

    top_k: int = param(32, "K: size of the teacher's top-K support at each position (authors' math run: 32)")
    renormalise: bool = param(True, "renormalise student and teacher over the K tokens before the KL (authors: true)")


def _topk_reverse_kl_example(logprobs: torch.Tensor, generator: torch.Generator) -> dict:
    """A random teacher: log-probs of K = top_k distinct tokens of a vocabulary of 3K for the student (a leaf with
    grad) and the teacher on the support; for a trainer-level test, the teacher stage's top-K record."""
    K = TopKReverseKLParams().top_k
    shape = tuple(logprobs.shape)
    s = torch.log_softmax(torch.randn(*shape, 3 * K, generator=generator), -1)[..., :K]
    t = torch.log_softmax(torch.randn(*shape, 3 * K, generator=generator), -1)[..., :K]
    return {"extras": {"teacher_logprobs": logprobs + 0.1 * torch.randn(shape, generator=generator),
                       "support_logprobs": s.clone().requires_grad_(True), "teacher_support_logprobs": t},
            "batch_extras": {"teacher_topk_ids": torch.randint(0, 1000, (*shape, K), generator=generator),
                             "teacher_topk_logprobs": -torch.rand(*shape, K, generator=generator) * 8,
                             "teacher_logprobs": -torch.rand(shape, generator=generator)}}


@POLICY_LOSSES.register(
    "topk_reverse_kl",
    paper="Revisiting On-Policy Distillation: Empirical Failure Modes and Simple Fixes (arXiv:2603.25562); "
    "code https://github.com/hhh675597/revisiting_opd",
    params=TopKReverseKLParams,
    needs_teacher=True,
    teacher_topk="top_k", extras=("support_logprobs", "teacher_support_logprobs"),
    example_inputs=_topk_reverse_kl_example)
def topk_reverse_kl_loss(inp: PolicyLossInput, *, top_k: int, renormalise: bool) -> Tuple[torch.Tensor, Metrics]:
    """On-policy distillation by teacher top-K local support matching: a truncated reverse KL per token.

    At every response position t of a student rollout, with ``S_t`` the teacher's
    K most probable next tokens,

        L_t = sum_{v in S_t} pi_hat(v) (log pi_hat(v) - log q_hat(v)),

    ``pi_hat`` / ``q_hat`` the student / teacher distributions renormalised over
    ``S_t`` (``renormalise=True``, the authors' ``norm_to_one_for_kl``). The
    gradient flows through the student's probabilities on ``S_t`` analytically
    (no sampled-token score function), which replaces the one-token signal
    ``log q(y_t) - log pi(y_t)`` of sampled-token OPD. The sequence-level
    future-reward coupling is dropped (token-level OPD, the paper's low-variance
    choice). There is no advantage term: ``algo.adv_estimator`` is computed and
    logged but does not enter this loss (the authors' run sets a placeholder
    estimator and a KL coefficient of 1).

    Where the paper leaves it open: the support is the teacher's top-K (not the
    student's); both distributions are at the rollout temperature, untruncated by
    the sampler's top-k/top-p; the authors' optional sampled tail term
    (``use_tail_sampling``) and special-token masking are not implemented (off in
    their math run script).

    Args:
        inp: needs ``support_logprobs`` and ``teacher_support_logprobs`` ``[B, R, K]``
            (the trainer fills them when the loss is tagged ``teacher_topk``) and
            ``response_mask`` ``[B, R]``.
        top_k: K (read by the teacher stage; the tensors' last dimension must equal it).
        renormalise: see :func:`truncated_reverse_kl`.
    Returns:
        ``(loss_mat [B, R], metrics)``: the per-token truncated reverse KL, 0 on
        padding; metrics ``opd/topk_reverse_kl`` (token mean), ``opd/teacher_topk_mass``
        and ``opd/student_topk_mass`` (probability mass of the support under each model).
    Raises:
        ValueError: the support tensors are missing or their K differs from ``top_k``.
    """
    s, t = inp.extras.get("support_logprobs"), inp.extras.get("teacher_support_logprobs")
    if s is None or t is None:
        raise ValueError("topk_reverse_kl needs the teacher's top-K support: set model.teacher (the runner's "
                         "teacher_logprobs stage fills it)")
    if s.shape[-1] != top_k or t.shape != s.shape:
        raise ValueError(f"topk_reverse_kl: support of K={s.shape[-1]} (teacher {tuple(t.shape)}) but top_k={top_k}")
    m = inp.response_mask
    t = t.to(s.device, s.dtype)
    loss = truncated_reverse_kl(s, t, renormalise) * m
    with torch.no_grad():
        log_ratio = (inp.logprobs - inp.old_logprobs).clamp(-20.0, 20.0)
        metrics = {
            **ratio_metrics(log_ratio.exp(), log_ratio, m),  # drift from the rollout-time weights (no clip here)
            "clip_frac": torch.zeros((), device=m.device),
            "opd/topk_reverse_kl": masked_mean(loss.detach(), m),
            "opd/teacher_topk_mass": masked_mean(t.exp().sum(-1), m),
            "opd/student_topk_mass": masked_mean(s.detach().exp().sum(-1), m),
        }
    return loss, metrics


@ADV_ESTIMATORS.register(
    "opd_token",
    paper="Revisiting On-Policy Distillation: Empirical Failure Modes and Simple Fixes (arXiv:2603.25562), "
    "its sampled-token OPD baseline",
    needs_teacher=True,
    zero_variance="not a reward baseline: the teacher's minus the student's log-prob of each token",
)
def opd_token_advantage(inp: AdvantageInput) -> AdvantageOutput:
    """Sampled-token on-policy distillation: ``A_t = log q(y_t | s_t) - log pi_old(y_t | s_t)`` per token.

    The one-token reverse-KL signal that the top-K loss replaces (the paper's
    baseline): the teacher's log-prob of the sampled token minus the student's at
    rollout time (``old_logprobs`` when the runner computed them, else the rollout
    engine's), token-level (no future-reward sum, the paper's low-variance
    choice), no outcome reward. With a policy-gradient loss (``ppo_clip``) this is
    reverse-KL distillation on the sampled tokens. With ``rollout.top_p < 1`` the
    student side is the truncated sampling distribution, the teacher's is not.

    Shapes: ``teacher_logprobs`` and the student's ``[B, R]`` -> advantages ``[B, R]``,
    0 outside the mask.

    Raises:
        ValueError: no ``teacher_logprobs`` (set ``model.teacher``) or no student log-probs.
    """
    if inp.teacher_logprobs is None:
        raise ValueError("opd_token needs the teacher's log-probs: set model.teacher (the teacher_logprobs stage)")
    student = inp.old_logprobs if inp.old_logprobs is not None else inp.rollout_logprobs
    if student is None:
        raise ValueError("opd_token needs the student's rollout-time log-probs (old or rollout log-probs)")
    m = inp.response_mask
    adv = (inp.teacher_logprobs.double() - student.double()) * m.double()
    return AdvantageOutput(advantages=adv.float())
