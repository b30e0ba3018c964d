"""Majority vote over extracted answers, shared by TTRL's pseudo-labels (:mod:`rlpost.rewards.scoring`)
and maj@k (:mod:`rlpost.eval.stats`). Plain Python: no torch, so the statistics commands stay light."""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Optional, Sequence


def majority_vote(answers: Sequence[Optional[Hashable]]) -> Optional[int]:
    """Position of a representative of the most frequent non-None answer.

    Ties are broken by the answer that appears first; None answers (nothing
    extracted) never win. Returns None when every answer is None.
    """
    keys = [a for a in answers if a is not None]
    if not keys:
        return None
    counts = Counter(keys)
    best = max(counts.values())
    for i, a in enumerate(answers):
        if a is not None and counts[a] == best:
            return i
    return None  # unreachable
