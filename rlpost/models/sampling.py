"""Logit transforms of the sampling distribution, shared by generation and scoring.

The trainer must compute log-probs of the same distribution the rollout engine
sampled from, so temperature / top-k / top-p live in one place.
"""

from __future__ import annotations

import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask logits ``[B, V]`` outside the top-k set and the top-p nucleus with -inf.

    The most likely token is always kept. ``top_k`` 0 and ``top_p`` 1 are no-ops.
    """
    if top_k and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = probs.cumsum(-1)
        remove = (cum - probs) > top_p  # keep tokens until mass top_p is reached
        remove[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits
