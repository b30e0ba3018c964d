"""RIPO: Riemannian Isometric Policy Optimization (``algo=ripo``).

"Beyond Euclidean Clipping: Overcoming Exploration Collapse in LLM RL via
Riemannian Isometric Policy Optimization" (Cai, Guo, Wu, Wang, Ma, Zhang, Zhou;
arXiv:2607.10169). PPO-Clip bounds ``|r - 1| <= eps`` with one ``eps`` for every
token: a Euclidean ruler on the ratio. Under the KL geometry of the policy
manifold a token of old probability ``p`` that moves by ratio ``r`` costs about
``p (r - 1)^2 / 2`` nats, so the same ``eps`` is too tight for rare tokens and too
loose for likely ones, and exploration collapses. RIPO's Riemannian Isometric
Clip (RIC) gives each token the bound that spends the same budget ``delta``:
``eps_t = sqrt(delta / pi_old(y_t))``.

Source of the formula and defaults: we could not read the paper itself; the RIC
rule ``eps = sqrt(delta / pi_old)`` is reported identically by two independent
secondary sources (a paper summary and a third-party implementation citing
arXiv:2607.10169), the latter with ``delta = 0.05`` and outer ratio bounds
``[0.5, 10]`` as the paper's reported setting. Treat the defaults as unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from rlpost.algos.losses import Metrics, PolicyLossInput, _clip_metrics, _ppo_core, _ratio
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.utils import masked_mean
from rlpost.core.registry import param


def isometric_clip_bounds(old_logprobs: torch.Tensor, delta_low: float, delta_high: float,
                          ratio_min: Optional[float], ratio_max: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(eps_low, eps_high)`` ``[B, R]`` of the Riemannian Isometric Clip.

    ``eps = sqrt(delta / pi_old(y_t))`` (``pi_old`` floored at 1e-12), then capped so
    the ratio interval ``[1 - eps_low, 1 + eps_high]`` stays inside ``[ratio_min,
    ratio_max]`` (a bound of None is not applied).

    Raises:
        ValueError: a ``delta`` not > 0, or ``ratio_min`` outside ``[0, 1)`` / ``ratio_max`` not > 1.
    """
    if delta_low <= 0 or delta_high <= 0:
        raise ValueError(f"ripo: delta_low={delta_low} and delta_high={delta_high} must be > 0")
    if ratio_min is not None and not 0 <= ratio_min < 1:
        raise ValueError(f"ripo: ratio_min={ratio_min} must lie in [0, 1)")
    if ratio_max is not None and ratio_max <= 1:
        raise ValueError(f"ripo: ratio_max={ratio_max} must be > 1")
    p = old_logprobs.detach().float().exp().clamp_min(1e-12)
    lo = torch.sqrt(delta_low / p)
    hi = torch.sqrt(delta_high / p)
    if ratio_min is not None:
        lo = lo.clamp(max=1.0 - ratio_min)
    if ratio_max is not None:
        hi = hi.clamp(max=ratio_max - 1.0)
    return lo.to(old_logprobs.dtype), hi.to(old_logprobs.dtype)


@dataclass(frozen=True)
class RipoParams:
    """RIPO's isometric clip (arXiv:2607.10169 via secondary sources: delta 0.05, ratio bounds [0.5, 10])."""

    delta_low: float = param(0.05, "KL budget delta of the lower bound, eps_low = sqrt(delta_low / pi_old)")
    delta_high: float = param(0.05, "KL budget delta of the upper bound, eps_high = sqrt(delta_high / pi_old)")
    ratio_min: Optional[float] = param(0.5, "outer floor of the clipped ratio (null: none)")
    ratio_max: Optional[float] = param(10.0, "outer cap of the clipped ratio (null: none)")


@POLICY_LOSSES.register(
    "ripo",
    paper="Beyond Euclidean Clipping: Overcoming Exploration Collapse in LLM RL via Riemannian Isometric Policy "
    "Optimization (RIPO, arXiv:2607.10169)",
    params=RipoParams,
)
def ripo_loss(inp: PolicyLossInput, *, delta_low: float, delta_high: float, ratio_min: Optional[float],
              ratio_max: Optional[float]) -> Tuple[torch.Tensor, Metrics]:
    """PPO's clipped surrogate with per-token Riemannian Isometric Clip bounds.

    ``L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low_t, 1 + eps_high_t))`` with
    ``eps_t = sqrt(delta / pi_old(y_t))`` (:func:`isometric_clip_bounds`): a token
    of old probability 0.05 may move its ratio by 1 (delta 0.05), one of
    probability 0.8 by 0.25; for every token ``pi_old * eps^2 = delta``, the same
    second-order KL cost ``p (r - 1)^2 / 2 = delta / 2`` at the bound. Everything
    else is PPO (which side binds follows the advantage's sign).

    Args:
        inp: ``logprobs``, ``old_logprobs``, ``advantages``, ``response_mask`` ``[B, R]``.
        delta_low, delta_high, ratio_min, ratio_max: see :class:`RipoParams`.
    Returns:
        ``(loss_mat [B, R], metrics)``: PPO's clip fractions and ratio metrics plus
        ``ripo/eps_low_mean`` and ``ripo/eps_high_mean`` (token means of the bounds).
    Raises:
        ValueError: from :func:`isometric_clip_bounds`.
    """
    ratio, log_ratio = _ratio(inp)
    m = inp.response_mask
    lo, hi = isometric_clip_bounds(inp.old_logprobs, delta_low, delta_high, ratio_min, ratio_max)
    loss, low, high, extra = _ppo_core(ratio, inp.advantages, lo, hi, None, m)
    metrics = _clip_metrics(ratio, log_ratio, low, high, m)
    metrics.update(extra)
    metrics["ripo/eps_low_mean"] = masked_mean(lo, m)
    metrics["ripo/eps_high_mean"] = masked_mean(hi, m)
    return loss, metrics
