"""Masked tensor helpers shared by the algorithm library."""

from __future__ import annotations

from typing import Optional

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of ``x * mask`` over ``dim`` (all elements when None)."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1; 0 when the mask is empty."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements of ``x`` (Bessel-corrected when ``unbiased``)."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to unit variance (and zero mean if ``shift_mean``) over masked positions.

    Computed in float64 and returned in ``x.dtype``. When every masked value is
    equal (no variance: e.g. a batch whose rewards are all equal) the result is
    exactly 0 with ``shift_mean`` (``x`` itself without): the check compares the
    values, never a floating-point variance, so rounding residue cannot leak in.
    Shapes: ``x``, ``mask`` ``[B, R]`` -> ``[B, R]``, 0 outside ``mask``.
    """
    x64, m64 = x.double(), mask.double()
    sel = x64[mask > 0]
    if sel.numel() == 0 or bool((sel == sel[0]).all()):
        return (torch.zeros_like(x64) if shift_mean else x64 * m64).to(x.dtype)
    mean = masked_mean(x64, m64)
    var = masked_var(x64, m64)
    out = (x64 - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return (out * m64).to(x.dtype)


def group_stats(values: torch.Tensor, group_index: torch.Tensor):
    """Per-group mean, unbiased std and size, broadcast back to each element, in float64.

    The statistics stay float64 (never cast back to ``values.dtype``) so that a
    baseline subtracted from float32 rewards costs no rounding: in a
    low-variance group a float32 mean is off by ~1e-4 relative after division
    by the std. Do not test ``std > 0`` to find zero-variance groups (rounding
    can leave a tiny positive std); use :func:`group_all_equal`.

    Args:
        values: ``[B]`` float.
        group_index: ``[B]`` long group ids (any integers).
    Returns:
        ``(mean [B], std [B], count [B])`` float64; std is 0 for groups of one element.
    """
    _, inv = torch.unique(group_index, return_inverse=True)
    G = int(inv.max().item()) + 1 if inv.numel() else 0
    v = values.double()
    cnt = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, torch.ones_like(v))
    s = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, v)
    mean = s / cnt
    sq = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, (v - mean[inv]) ** 2)
    std = torch.where(cnt > 1, (sq / (cnt - 1).clamp(min=1)).sqrt(), torch.zeros_like(cnt))
    return mean[inv], std[inv], cnt[inv]


def group_all_equal(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: True where every member of the element's group has exactly the same value.

    The zero-variance test of the group-baseline estimators: it compares the
    rewards themselves (group max == group min), so a group of equal rewards is
    recognised whatever rounding a mean or std computation would leave. A group
    of one element is all-equal.

    Args:
        values: ``[B]`` float.
        group_index: ``[B]`` long group ids (any integers).
    """
    inv, G = group_ids(group_index)
    v = values.double()
    hi = torch.full((G,), -torch.inf, dtype=torch.float64).scatter_reduce_(0, inv, v, reduce="amax")
    lo = torch.full((G,), torch.inf, dtype=torch.float64).scatter_reduce_(0, inv, v, reduce="amin")
    return (hi == lo)[inv]


def group_ids(group_index: torch.Tensor):
    """Dense group ids: ``(inv [B] long in [0, G), G)`` for any integer ``group_index`` ``[B]``."""
    _, inv = torch.unique(group_index, return_inverse=True)
    G = int(inv.max().item()) + 1 if inv.numel() else 0
    return inv, G


def group_median(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Per-group median broadcast back to each element.

    For an even group size the lower of the two middle values is used
    (``torch.median`` convention), so the median is always one of the group's
    own values.

    Args:
        values: ``[B]`` float.
        group_index: ``[B]`` long group ids.
    Returns:
        ``[B]`` median of each element's group.
    """
    inv, G = group_ids(group_index)
    out = torch.empty_like(values)
    for g in range(G):
        sel = inv == g
        out[sel] = values[sel].median()
    return out


def masked_quantile(x: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q``-quantile (nearest rank) of the masked elements of ``x``; 0 when the mask is empty."""
    vals = x[mask > 0]
    if vals.numel() == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    vals, _ = torch.sort(vals.float())
    k = int(round(q * (vals.numel() - 1)))
    return vals[min(max(k, 0), vals.numel() - 1)].to(x.dtype)
