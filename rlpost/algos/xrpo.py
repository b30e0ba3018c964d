"""XRPO's novelty-aware advantage sharpening: GRPO's advantage plus a bonus for correct, unlikely responses.

"XRPO: Pushing the limits of GRPO with Targeted Exploration and Exploitation"
(arXiv:2510.06672; authors' code https://github.com/UIUC-MLSys/XRPO, not
reachable here). XRPO's exploitation half: a correct response that the policy
found unlikely relative to its group carries more information than a likely
one, so its advantage is raised. Its exploration half, the uncertainty-reduction
rollout allocator, is ``selector=xrpo`` (:mod:`rlpost.selectors.xrpo_allocator`); its
in-context seeding of zero-reward prompts is ``sampler=xrpo_icl``
(:mod:`rlpost.samplers.xrpo_icl`); ``recipes/xrpo_full.yaml`` runs all three.

The formula follows the grpo-composer port (github.com/Wodlfvllf/grpo-composer,
``core/advantages/novelty_sharpening.py``), since the paper's text was not
readable beyond its abstract: ``s_i`` the mean token log-likelihood of response
``i``, ``eta_i = exp(s_i - mean_group s)``, ``A+_i = A_i + min(max(lambda (1 -
eta_i), 0), kappa |A_i|)``. Departure from the port, after the abstract
("amplify low-probability yet correct responses"): the bonus goes only to
responses with a positive GRPO advantage (the correct ones under a 0/1
verifier); the port adds it to incorrect ones too, which would shrink their penalty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.utils import group_all_equal, group_ids, group_stats
from rlpost.core.registry import param

_XRPO_PAPER = "XRPO: Pushing the limits of GRPO with Targeted Exploration and Exploitation (arXiv:2510.06672)"


@dataclass(frozen=True)
class XRPOParams:
    """XRPO's novelty sharpening on GRPO's z-scored advantage (constants of the grpo-composer port: 1 and 1)."""

    novelty_coef: float = param(1.0, "lambda: scale of the novelty bonus lambda (1 - eta) (port default 1; paper not read)")
    novelty_clip: float = param(1.0, "kappa: the bonus is at most kappa x the response's own advantage (port default 1)")
    eps: float = param(1e-6, "added to the group std (GRPO reference code: 1e-6)")


def sequence_loglik(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` mean token log-likelihood ``s_i = (1/L_i) sum_t log pi(y_t)`` of each response, float64 (0 when empty)."""
    m = mask.double()
    return (logprobs.double() * m).sum(-1) / m.sum(-1).clamp(min=1.0)


@ADV_ESTIMATORS.register("xrpo", paper=_XRPO_PAPER, params=XRPOParams, needs_group=True)
def xrpo_advantage(inp: AdvantageInput, *, novelty_coef: float, novelty_clip: float, eps: float) -> AdvantageOutput:
    """GRPO's ``(r - mean_g) / (std_g + eps)`` plus XRPO's novelty bonus on correct responses.

    With ``s_i`` the mean token log-likelihood of response ``i``
    (:func:`sequence_loglik`) under the policy that sampled it
    (``inp.old_logprobs`` when the runner computed them, else the rollout
    engine's ``inp.rollout_logprobs``) and ``s_bar`` its group's mean,
    ``eta_i = exp(s_i - s_bar)`` (below 1 for a response less likely than its
    group's average) and, for ``A_i > 0`` only,

        ``A+_i = A_i + min(max(novelty_coef (1 - eta_i), 0), novelty_clip A_i)``

    (responses with ``A_i <= 0`` keep ``A_i``). The bonus never flips a sign
    and at most multiplies the advantage by ``1 + novelty_clip``. A group whose
    rewards are all equal gets 0 (no correct-vs-wrong contrast to sharpen).
    Broadcast to every response token; float32.

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]`` and
            ``old_logprobs`` or ``rollout_logprobs`` ``[B, R]``.
    Returns:
        AdvantageOutput with ``advantages [B, R]``.
    Raises:
        ValueError: neither log-prob tensor is given, or ``novelty_coef`` /
            ``novelty_clip`` negative.
    """
    if novelty_coef < 0 or novelty_clip < 0:
        raise ValueError(f"xrpo: novelty_coef and novelty_clip must be >= 0, got {novelty_coef}, {novelty_clip}")
    lp = inp.old_logprobs if inp.old_logprobs is not None else inp.rollout_logprobs
    if lp is None:
        raise ValueError("xrpo needs the responses' log-probs (AdvantageInput.old_logprobs or rollout_logprobs)")
    r = inp.rewards.double()
    mean, std, _ = group_stats(r, inp.group_index)
    flat = group_all_equal(r, inp.group_index)
    A = torch.where(flat, torch.zeros_like(r), (r - mean) / (std + eps))
    s = sequence_loglik(lp, inp.response_mask)
    inv, G = group_ids(inp.group_index)
    s_bar = torch.zeros(G, dtype=s.dtype).index_add_(0, inv, s) / torch.bincount(inv, minlength=G).double()
    eta = torch.exp(s - s_bar[inv])
    bonus = torch.minimum((novelty_coef * (1.0 - eta)).clamp(min=0.0), novelty_clip * A)
    A = torch.where(A > 0, A + bonus, A)
    return AdvantageOutput(advantages=(A[:, None] * inp.response_mask.double()).float())
