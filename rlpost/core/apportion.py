"""Largest-remainder apportioning: split an integer budget in proportion to weights.

A neutral helper shared by selectors (CurES's per-prompt rollout budget, the
domain mixture's per-domain quotas) and samplers (Pilot-Commit's commit
budget); it depends on nothing else in rlpost.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np


def apportion(weights: Sequence[float], total: int, cap: Optional[Sequence[int]] = None) -> List[int]:
    """Split ``total`` integer units in proportion to ``weights`` (largest remainder, Hamilton's method).

    Args:
        weights: non-negative weights; all-zero weights give all-zero counts.
        total: units to hand out (>= 0).
        cap: optional per-entry maxima; units that do not fit go to the others.

    Returns:
        counts summing to ``total`` when the entries with positive weight can hold
        it (their caps allow), else to what they can hold: a zero-weight entry
        never gets a unit.

    Raises:
        ValueError: a weight is NaN or infinite.
    """
    w = np.clip(np.asarray(weights, dtype=np.float64), 0, None)
    if not np.isfinite(w).all():
        raise ValueError(f"apportion: weights must be finite, got {w.tolist()}")
    n = len(w)
    out = np.zeros(n, dtype=np.int64)
    capv = np.full(n, np.iinfo(np.int64).max) if cap is None else np.asarray(cap, dtype=np.int64)
    left = int(total)
    while left > 0:
        free = (out < capv) & (w > 0)
        if not free.any():
            break
        share = np.where(free, w, 0.0)
        share = share / share.sum() * left
        add = np.minimum(np.floor(share).astype(np.int64), capv - out)
        out += add
        left -= int(add.sum())
        # the units the floors left go one each to the largest fractional remainders
        # (ties: lower index); units a cap refuses are handed out in the next pass
        rem = np.where(free & (out < capv), share - np.floor(share), -1.0)
        for j in np.argsort(-rem, kind="stable"):
            if left == 0 or rem[j] < 0:
                break
            out[j] += 1
            left -= 1
    return out.tolist()
