"""HAPO's entropy machinery: normalised token entropy and the adaptive-temperature hook.

HAPO ("From Uniform to Heterogeneous: Tailoring Policy Optimization to Every
Token's Nature", arXiv:2509.16591) drives four parts from one signal, the
normalised log-entropy ``h_hat`` of each token in [-1, 1]:

* ``h = (log H - pivot) / rms`` where ``pivot`` is the ``entropy_pivot``-quantile
  of ``log H`` over the batch's response tokens (the median by default) and
  ``rms`` the root-mean-square of ``log H - pivot``;
* ``h_hat = h / max(h)`` for ``h > 0`` and ``h / |min(h)|`` for ``h <= 0``, so the
  most uncertain token of the batch maps to +1 and the most confident to -1.

The loss side (token-level group average, differential advantage
redistribution, asymmetric adaptive clipping) lives in
:mod:`rlpost.algos.advantages` (``hapo``) and :mod:`rlpost.algos.losses`
(``hapo``). This module gives the sampling side: a per-token temperature
``T = T0 * (1 + tau * clip(h_hat, -1, 1))`` computed during generation from the
next-token logits with the normalisation statistics of the previous step's
rollouts (the statistics of the step's own tokens are not known while sampling).
Its only user is ``sampler=adaptive_temperature``
(:class:`rlpost.samplers.temperature.AdaptiveTemperatureSampler`), the one owner
of per-token temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from rlpost.algos.utils import masked_quantile


@dataclass
class EntropyStats:
    """Normalisation statistics of log-entropy (all in log-nats).

    Attributes:
        pivot: the ``entropy_pivot``-quantile of ``log H`` over response tokens.
        rms: root-mean-square of ``log H - pivot``.
        scale_pos: ``1 / max(h)`` over tokens with ``h > 0``.
        scale_neg: ``1 / |min(h)|`` over tokens with ``h < 0``.
    """

    pivot: float
    rms: float
    scale_pos: float
    scale_neg: float


def normalize_entropy(
    entropy: torch.Tensor, stats: EntropyStats, eps: float = 1e-8
) -> torch.Tensor:
    """``h_hat`` in [-1, 1] of ``entropy`` (any shape, nats) under fixed ``stats``.

    Values beyond the range seen when ``stats`` were computed are clipped to
    [-1, 1].
    """
    h = (torch.log(entropy.float().clamp(min=eps)) - stats.pivot) / max(stats.rms, eps)
    h_hat = torch.where(h > 0, h * stats.scale_pos, h * stats.scale_neg)
    return h_hat.clamp(-1.0, 1.0)


def entropy_hhat(
    entropy: torch.Tensor, mask: torch.Tensor, entropy_pivot: float = 0.5, eps: float = 1e-8
) -> Tuple[torch.Tensor, EntropyStats]:
    """HAPO's normalised token entropy of a batch and the statistics that produced it.

    Args:
        entropy: ``[B, R]`` token entropies (nats), detached.
        mask: ``[B, R]`` response mask; statistics use masked tokens only.
        entropy_pivot: quantile of ``log H`` used as the centre (0.5 = median).
    Returns:
        ``(h_hat [B, R] in [-1, 1], EntropyStats)``; ``h_hat`` is 0 outside the mask.
    """
    with torch.no_grad():
        logh = torch.log(entropy.float().clamp(min=eps))
        pivot = masked_quantile(logh, mask, entropy_pivot)
        h = logh - pivot
        n = mask.sum().clamp(min=1.0)
        rms = ((h**2) * mask).sum().div(n).clamp(min=eps).sqrt()
        h = h / rms
        valid = mask > 0
        pos_max = torch.where(valid & (h > 0), h, torch.zeros_like(h)).max().clamp(min=eps)
        neg_min = torch.where(valid & (h < 0), h, torch.zeros_like(h)).min().clamp(max=-eps)
        stats = EntropyStats(float(pivot), float(rms), float(1.0 / pos_max), float(1.0 / neg_min.abs()))
        h_hat = torch.where(h > 0, h * stats.scale_pos, h * stats.scale_neg).clamp(-1.0, 1.0)
        return h_hat * mask, stats


def make_temperature_hook(
    base_temperature: float,
    stats: Optional[EntropyStats],
    tau: float = 0.05,
    eps: float = 1e-8,
) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """Build HAPO's Adaptive Temperature Sampling hook for the rollout engine.

    The hook is called by the rollout engine at every generation step with the
    raw next-token logits and returns one temperature per sequence:
    ``T = base_temperature * (1 + tau * h_hat)`` where ``h_hat`` in [-1, 1] is the
    normalised log-entropy of the softmax of ``logits`` (temperature 1) under
    ``stats`` (see :func:`normalize_entropy`). High-entropy positions are sampled
    hotter, confident ones cooler; the temperature stays in
    ``[T0 (1 - tau), T0 (1 + tau)]``. ``tau = 0.05`` is the authors' released
    setting. Before any statistics exist (``stats`` None, the first step) the
    hook returns ``base_temperature`` everywhere.

    Args:
        base_temperature: ``T0`` (> 0), the configured sampling temperature.
        stats: entropy statistics of the previous training batch, or None.
        tau: relative temperature range, in [0, 1).
    Returns:
        ``hook(logits [B, V] float32, step t) -> temperatures [B]`` (float32).
    Raises:
        ValueError: ``base_temperature <= 0`` or ``tau`` outside [0, 1).
    """
    if base_temperature <= 0:
        raise ValueError(f"base_temperature must be > 0, got {base_temperature}")
    if not 0.0 <= tau < 1.0:
        raise ValueError(f"tau must be in [0, 1), got {tau}")

    def hook(logits: torch.Tensor, t: int) -> torch.Tensor:
        B = logits.shape[0]
        if stats is None or tau == 0.0:
            return torch.full((B,), float(base_temperature), dtype=torch.float32, device=logits.device)
        z = logits.float()
        logp = torch.log_softmax(z, dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
        h_hat = normalize_entropy(ent, stats, eps)
        return (base_temperature * (1.0 + tau * h_hat)).to(torch.float32)

    return hook


def adaptive_clip_range(
    h_hat: torch.Tensor, eps_low: float, eps_high: float, clip_alpha: float = 1.0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """HAPO's Asymmetric Adaptive Clipping: per-token ``(eps_low [B,R], eps_high [B,R])``.

    Low-entropy tokens (``h_hat <= 0``) get a wider *lower* bound,
    ``eps_low * (1 - alpha * h_hat)`` (up to ``(1 + alpha) eps_low``), so the
    probability of noisy confident tokens can be pushed down further;
    high-entropy tokens (``h_hat > 0``) get a wider *upper* bound,
    ``eps_high * (1 + alpha * h_hat)``, leaving room to explore. The other side
    keeps its base value. The lower range is capped below 1 so the lower ratio
    bound stays positive (our guard).
    """
    lo = torch.full_like(h_hat, float(eps_low))
    hi = torch.full_like(h_hat, float(eps_high))
    lo = torch.where(h_hat <= 0, (lo * (1.0 - clip_alpha * h_hat)).clamp(max=0.999), lo)
    hi = torch.where(h_hat > 0, hi * (1.0 + clip_alpha * h_hat), hi)
    return lo, hi


def redistribute_advantage(
    advantages: torch.Tensor,
    h_hat: torch.Tensor,
    ratio: torch.Tensor,
    eps_low: torch.Tensor,
    eps_high: torch.Tensor,
    adv_beta: float = 1.0,
) -> torch.Tensor:
    """HAPO's Differential Advantage Redistribution (no grad).

    ``A_ent = A * (1 + beta * h_hat)``. The *neutral zone* is
    ``1 - eps_low/2 < r < 1 + eps_high/2`` (the inner half of the clip range).
    High-entropy tokens (``h_hat > 0``) keep ``A`` inside the zone and get the
    amplified ``A_ent`` once their ratio has moved out of it (a clear signal);
    low-entropy tokens get the damped ``A_ent`` inside the zone and keep ``A``
    outside it.

    Shapes: all ``[B, R]``.
    """
    a_ent = advantages * (1.0 + adv_beta * h_hat)
    neutral = (ratio > 1.0 - eps_low / 2) & (ratio < 1.0 + eps_high / 2)
    high = torch.where(neutral, advantages, a_ent)
    low = torch.where(neutral, a_ent, advantages)
    return torch.where(h_hat > 0, high, low)
