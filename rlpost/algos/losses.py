"""Policy losses: per-token surrogate objectives.

Calling convention: ``fn(inp: PolicyLossInput, **params) -> (loss_mat, metrics)``
where ``loss_mat`` is ``[B, R]`` (to be minimised; the caller aggregates it with a
:mod:`rlpost.algos.aggregation` mode) and ``metrics`` maps names to 0-d tensors
(masked means over response tokens).

Standard metric names: ``clip_frac`` (share of tokens whose gradient is cut by the
clip), ``clip_frac_low`` / ``clip_frac_high`` (per side), ``ratio_mean``,
``ratio_max``, ``approx_kl`` (k3 estimate of KL(old || new)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.utils import masked_mean

Metrics = Dict[str, torch.Tensor]


@dataclass
class PolicyLossInput:
    """Inputs every policy loss may read. All tensors ``[B, R]``.

    Attributes:
        logprobs: log pi_theta(a_t|s_t) of the current policy, with grad, nats.
        old_logprobs: log-probs of the policy that the update's trust region is
            anchored to (the trainer's weights at rollout time), no grad.
        advantages: per-token advantages, no grad.
        response_mask: 0/1 float mask.
        rollout_logprobs: log-probs reported by the rollout engine (behaviour
            policy), or None.
        entropy: per-token policy entropy (nats), detached, or None.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None


def _ratio(inp: PolicyLossInput, max_log_ratio: float = 20.0) -> Tuple[torch.Tensor, torch.Tensor]:
    log_ratio = (inp.logprobs - inp.old_logprobs).clamp(-max_log_ratio, max_log_ratio)
    return torch.exp(log_ratio), log_ratio


def ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """``ratio_mean``, ``ratio_max`` and ``approx_kl`` (k3 of KL(old||new)) over masked tokens."""
    with torch.no_grad():
        big = torch.where(mask > 0, ratio, torch.zeros_like(ratio))
        return {
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": big.max() if big.numel() else torch.tensor(0.0),
            "approx_kl": masked_mean(ratio - 1 - log_ratio, mask),
        }


@POLICY_LOSSES.register(
    "ppo_clip",
    paper="Proximal Policy Optimization Algorithms (arXiv:1707.06347); decoupled eps_low/eps_high "
    "from DAPO (arXiv:2503.14476); dual-clip from Mastering Complex Control in MOBA Games (arXiv:1912.09729)",
)
def ppo_clip_loss(
    inp: PolicyLossInput,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: Optional[float] = None,
    **_: object,
) -> Tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` per token.

    A token whose ratio is outside the clip range on the side that binds for the
    sign of its advantage (``r > 1+eps_high`` with ``A > 0``, ``r < 1-eps_low``
    with ``A < 0``) gets zero gradient. With ``dual_clip = c > 1``, tokens with
    ``A < 0`` have their loss capped at ``-c A`` (no gradient there), which bounds
    the update from very large ratios on negative samples.

    Args:
        inp: see :class:`PolicyLossInput`.
        eps_low, eps_high: clip range (DAPO's clip-higher uses eps_high > eps_low).
        dual_clip: the dual-clip constant c (> 1), or None.
    Returns:
        ``(loss_mat [B, R], metrics)``.
    Raises:
        ValueError: ``dual_clip`` not > 1.
    """
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages
    surr1 = -A * ratio
    surr2 = -A * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(surr1, surr2)
    m = inp.response_mask
    with torch.no_grad():
        low = ((ratio < 1.0 - eps_low) & (A < 0)).float()
        high = ((ratio > 1.0 + eps_high) & (A > 0)).float()
    metrics: Metrics = {}
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        surr3 = -A * dual_clip
        capped = torch.minimum(loss, surr3)
        loss = torch.where(A < 0, capped, loss)
        with torch.no_grad():
            dual = ((A < 0) & (surr3 < torch.maximum(surr1, surr2))).float()
        metrics["clip_frac_dual"] = masked_mean(dual, m)
        low = torch.clamp(low + dual, max=1.0)
    metrics.update(
        clip_frac=masked_mean(torch.clamp(low + high, max=1.0), m),
        clip_frac_low=masked_mean(low, m),
        clip_frac_high=masked_mean(high, m),
        **ratio_metrics(ratio, log_ratio, m),
    )
    return loss, metrics


@POLICY_LOSSES.register(
    "strict_double_clip",
    paper="SAO: Single-rollout Asynchronous Optimization (seed abstract 1)",
)
def strict_double_clip_loss(
    inp: PolicyLossInput, eps_low: float = 0.2, eps_high: float = 0.2, **_: object
) -> Tuple[torch.Tensor, Metrics]:
    """SAO's strict double-sided token-level clipping.

    Unlike PPO, where only the side matching the advantage's sign binds, both
    bounds bind for every token: any token whose ratio leaves
    ``[1-eps_low, 1+eps_high]`` contributes no gradient, whatever the sign of its
    advantage. (PPO keeps the gradient of e.g. a token with ``r > 1+eps`` and
    ``A < 0``, which in off-policy asynchronous training lets stale samples push
    the policy far.) Loss per token: ``-A * r`` inside the range, and the constant
    ``-A * clip(r)`` (no gradient) outside. The abstract gives no eps; defaults
    are PPO's 0.2 (our choice).

    Returns:
        ``(loss_mat [B, R], metrics)`` with ``clip_frac`` = share of tokens outside
        the range on either side.
    """
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    inside = ((ratio >= lo) & (ratio <= hi)).float()
    clipped_ratio = torch.clamp(ratio, lo, hi)
    # Inside: gradient of r; outside: clamp's gradient is exactly 0.
    loss = -A * clipped_ratio
    m = inp.response_mask
    with torch.no_grad():
        low = (ratio < lo).float()
        high = (ratio > hi).float()
    metrics = dict(
        clip_frac=masked_mean(1.0 - inside, m),
        clip_frac_low=masked_mean(low, m),
        clip_frac_high=masked_mean(high, m),
        **ratio_metrics(ratio, log_ratio, m),
    )
    return loss, metrics


def compute_policy_loss(name: str, inp: PolicyLossInput, **params: object) -> Tuple[torch.Tensor, Metrics]:
    """Run registered policy loss ``name``; see module docstring for the convention.

    Raises:
        ConfigError: unknown loss name.
    """
    return POLICY_LOSSES.get(name)(inp, **params)
