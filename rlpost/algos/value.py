"""A*-PO: regress the policy's log-ratio onto the optimal advantage, with V* from reference samples.

"Accelerating RL for LLM Reasoning with Optimal Advantage Regression" (A*-PO,
arXiv:2505.20686; authors' code https://github.com/ZhaolinGao/A-PO). Stage 1 estimates
the optimal value of the KL-regularised objective from N samples of the reference
policy per prompt, ``V*(x) = beta1 log mean_i exp(r_i / beta1)``; stage 2 samples one
response per prompt from the current policy and minimises
``(beta2 log pi(y|x)/pi_ref(y|x) - (r(x, y) - V*(x)))^2``.

The runner draws the N reference samples of a prompt the first time the prompt is
used (from the frozen reference model, so the values are those the offline pass
would give) and caches their rewards; the ``a_star`` estimator turns them into
``r - V*``, the ``a_star_po`` loss regresses onto it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, _broadcast
from rlpost.algos.losses import PolicyLossInput, _nonempty_mean, ratio_metrics
from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
from rlpost.core.registry import param

Metrics = Dict[str, torch.Tensor]

_PAPER = ("Accelerating RL for LLM Reasoning with Optimal Advantage Regression (A*-PO, arXiv:2505.20686); "
          "authors' code https://github.com/ZhaolinGao/A-PO")


def optimal_value(reference_rewards: torch.Tensor, beta1: float) -> torch.Tensor:
    """``[B]`` float64 ``V* = beta1 log mean_i exp(r_i / beta1)`` over the ``[B, N]`` reference rewards.

    ``beta1 = 0`` gives the plain mean (the authors' code does the same); computed with
    ``logsumexp`` so large ``r / beta1`` cannot overflow.

    Raises:
        ValueError: ``beta1 < 0`` or no samples.
    """
    if beta1 < 0:
        raise ValueError(f"a_star: beta1 must be >= 0, got {beta1}")
    r = reference_rewards.double()
    if r.shape[-1] == 0:
        raise ValueError("a_star: no reference samples")
    if beta1 == 0:
        return r.mean(-1)
    return beta1 * (torch.logsumexp(r / beta1, dim=-1) - math.log(r.shape[-1]))


@dataclass(frozen=True)
class AStarParams:
    """A*-PO's V* estimate (authors' apo_math.sh: beta1 = 0.5, num_gen_to_use = 8)."""

    beta1: float = param(0.5, "temperature of V* = beta1 log mean exp(r / beta1) (authors: 0.5; 0 = the mean)")
    num_value_samples: int = param(8, "reference-policy samples per prompt for V* (authors: 8)")


@ADV_ESTIMATORS.register("a_star", paper=_PAPER, params=AStarParams, needs_reference_rewards="num_value_samples",
                         zero_variance="baseline V* from the reference policy's samples, not the group")
def a_star_advantage(inp: AdvantageInput, *, beta1: float, num_value_samples: int) -> AdvantageOutput:
    """The optimal advantage ``A*(x, y) = r(x, y) - V*(x)`` of each sequence, broadcast to its tokens.

    ``V*`` from ``inp.reference_rewards`` ``[B, N]`` (:func:`optimal_value`); one
    sample per prompt is enough (no group). Shapes: rewards ``[B]`` -> ``[B, R]``.

    Raises:
        ValueError: no ``reference_rewards``, or not ``num_value_samples`` of them.
    """
    rr = inp.reference_rewards
    if rr is None:
        raise ValueError("a_star needs the rewards of reference-policy samples (the runner's algo_inputs stage)")
    if rr.shape[-1] != num_value_samples:
        raise ValueError(f"a_star: {rr.shape[-1]} reference samples per prompt, expected {num_value_samples}")
    adv = inp.rewards.double() - optimal_value(rr, beta1)
    return AdvantageOutput(advantages=_broadcast(adv, inp.response_mask))


@dataclass(frozen=True)
class AStarPOParams:
    """A*-PO's regression scale (authors' apo_math.sh: beta2 = 1e-3)."""

    beta2: float = param(1e-3, "beta2: scale of the log-ratio log pi/pi_ref regressed onto A* (authors: 1e-3)")


def _a_star_po_example(logprobs: torch.Tensor, generator: torch.Generator) -> dict:
    """The reference policy's log-probs near the current ones (the ref_logprobs stage's output in a run)."""
    ref = logprobs + 0.2 * torch.randn(logprobs.shape, generator=generator)
    return {"extras": {"ref_logprobs": ref}, "batch_extras": {"ref_logprobs": ref}}


@POLICY_LOSSES.register("a_star_po", paper=_PAPER, params=AStarPOParams, needs_ref=True, sequence_sum=True,
                        extras=("ref_logprobs",),
                        example_inputs=_a_star_po_example)
def a_star_po_loss(inp: PolicyLossInput, *, beta2: float) -> Tuple[torch.Tensor, Metrics]:
    """A*-PO's least squares: ``(beta2 sum_t (log pi - log pi_ref) - A*)^2`` per sequence.

    ``A*`` is the sequence's advantage (``a_star``: ``r - V*``, constant over its
    tokens; read as the mean over its real tokens). Written per token as
    ``v_i / L_i`` on each of the ``L_i`` real tokens, so ``seq-mean-token-sum`` gives
    the authors' mean over sequences; rows are whole in every micro-batch. No
    clipping, no importance ratio (the regression is on-policy: one update per batch).

    Args:
        inp: needs ``ref_logprobs`` ``[B, R]`` (the loss is tagged ``needs_ref``).
    Returns:
        ``(loss_mat [B, R], metrics)``; ``seq_a_star_log_ratio`` is the mean sequence log-ratio to the reference.
    Raises:
        ValueError: no ``ref_logprobs``, or ``beta2 <= 0``.
    """
    if beta2 <= 0:
        raise ValueError(f"a_star_po: beta2 must be > 0, got {beta2}")
    if inp.extras.get("ref_logprobs") is None:
        raise ValueError("a_star_po needs ref_logprobs (the runner computes them for losses tagged needs_ref)")
    m = inp.response_mask
    L = m.sum(-1).clamp(min=1.0)
    ell = ((inp.logprobs - inp.extras.get("ref_logprobs").to(inp.logprobs.dtype)) * m).sum(-1)
    a = (inp.advantages * m).sum(-1) / L
    v = (beta2 * ell - a) ** 2
    loss = (v / L)[:, None] * m
    with torch.no_grad():
        lr = (inp.logprobs - inp.old_logprobs).clamp(-20.0, 20.0)
        metrics = {**ratio_metrics(lr.exp(), lr, m), "clip_frac": torch.zeros((), device=m.device),
                   "seq_a_star_log_ratio": _nonempty_mean(ell.detach(), m)}
    return loss, metrics
