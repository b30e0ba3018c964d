"""Random second-policy inputs for the generic loss tests: losses tagged ``teacher_topk`` (rlpost.algos.distill)
read the teacher's top-K support, those tagged ``needs_ref`` (EXO) the reference log-probs, ``otr`` its
candidates' log-probs and rewards, which a plain
PolicyLossInput lacks."""

from __future__ import annotations

from typing import Dict

import torch

from rlpost.algos.registries import POLICY_LOSSES


def teacher_inputs(loss: str, lp: torch.Tensor, seed: int = 0) -> Dict[str, torch.Tensor]:
    """``PolicyLossInput`` teacher fields for ``loss`` (empty when it reads none); ``support_logprobs``
    requires grad (the student's side), log-probs of K distinct tokens of a vocabulary of 3K."""
    key = POLICY_LOSSES.tag(loss, "teacher_topk", None)
    g = torch.Generator().manual_seed(seed)
    if POLICY_LOSSES.tag(loss, "one_token_rollout", False):  # OTR: K candidates per position and their rewards
        s = torch.log_softmax(torch.randn(*lp.shape, 24, generator=g), -1)[..., :8]
        hit = torch.rand(*lp.shape, 8, generator=g) < 0.3
        return {"support_logprobs": s.clone().requires_grad_(True),
                "support_rewards": torch.where(hit, torch.ones_like(s), torch.full_like(s, -0.1))}
    if POLICY_LOSSES.tag(loss, "capo_forward", False):  # CAPO: per-token predicted objective change and Fisher KL
        return {"predicted_change": 1e-3 * torch.randn(lp.shape, generator=g),
                "predicted_kl": 2e-3 * torch.rand(lp.shape, generator=g)}
    if POLICY_LOSSES.tag(loss, "needs_ref", False):  # EXO, A*-PO: the reference policy's log-probs
        out = {"ref_logprobs": lp.detach() + 0.2 * torch.randn(lp.shape, generator=g)}
        if POLICY_LOSSES.tag(loss, "needs_first_log_normaliser", False):  # TBRM's V(s_1) / beta
            out["first_log_normaliser"] = (5.0 + torch.randn(lp.shape[0], generator=g)).requires_grad_(True)
        return out
    if POLICY_LOSSES.tag(loss, "needs_skill", None):  # SEED: the skill-context log-probs, its self-teacher
        return {"teacher_logprobs": lp.detach() + 0.3 * torch.randn(lp.shape, generator=g)}
    if "mopd_weight" in (POLICY_LOSSES.tag(loss, "extras", ()) or ()):  # Open-MOPD: routed teacher, domain weights
        return {"teacher_logprobs": lp.detach() + 0.3 * torch.randn(lp.shape, generator=g),
                "mopd_weight": 0.5 + torch.rand(lp.shape[0], generator=g)}
    if not key and not POLICY_LOSSES.tag(loss, "needs_teacher", False):
        return {}
    K = int(POLICY_LOSSES.kwargs(loss, {}, "algo.loss_params")[key]) if key else 0
    out = {"teacher_logprobs": lp.detach() + 0.1 * torch.randn(lp.shape, generator=g)}
    if K:
        s = torch.log_softmax(torch.randn(*lp.shape, 3 * K, generator=g), -1)[..., :K]
        t = torch.log_softmax(torch.randn(*lp.shape, 3 * K, generator=g), -1)[..., :K]
        out.update(support_logprobs=s.clone().requires_grad_(True), teacher_support_logprobs=t)
    return out
