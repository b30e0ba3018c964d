"""The one batch object that flows through a step's stages.

Stages read the fields they need and add their own (``old_logprobs``,
``advantages``...). Tensors are on CPU between stages; engines move what they
need to their device.

Shapes: ``B`` = number of sequences (prompts x samples per prompt), ``P`` = padded
prompt length (left-padded), ``R`` = padded response length (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch


def pad_cat(tensors: List[torch.Tensor], value: float = 0, left: bool = False,
            width: Optional[int] = None) -> torch.Tensor:
    """Concatenate ``[b_i, w_i]`` tensors along dim 0, padding each to ``width`` columns.

    Args:
        tensors: 2-D tensors of any widths ``w_i <= width``.
        value: fill value of the padding (a pad token id, or 0 for masks/log-probs).
        left: pad on the left (prompts, left-padded) instead of the right (responses).
        width: target width; default ``max(w_i)``.
    Returns:
        ``[sum b_i, width]``.
    Raises:
        RuntimeError: (from torch) a tensor wider than ``width``.
    """
    W = max(t.shape[1] for t in tensors) if width is None else width
    pad = (lambda t: (W - t.shape[1], 0)) if left else (lambda t: (0, W - t.shape[1]))
    return torch.cat([torch.nn.functional.pad(t, pad(t), value=value) for t in tensors])


@dataclass
class RolloutBatch:
    """Rollouts of one step plus everything later stages attach to them.

    Attributes:
        prompt_ids: ``[B, P]`` long, left-padded prompt token ids.
        prompt_mask: ``[B, P]`` long, 1 on real prompt tokens.
        response_ids: ``[B, R]`` long, right-padded sampled tokens (pad after EOS).
        response_mask: ``[B, R]`` float, 1 on tokens that carry loss (sampled
            tokens up to and including EOS; 0 on padding and on tokens a sampler
            marks as shared prefix).
        rollout_logprobs: ``[B, R]`` float, log-prob of each sampled token under the
            distribution it was sampled from (after temperature / top-p / top-k),
            in nats; 0 on padding.
        group_index: ``[B]`` long; sequences with the same value answer the same
            prompt in this step (group id for group-relative baselines).
        prompt_index: ``[B]`` long, the dataset index of the prompt.
        policy_version: ``[B]`` long, the trainer version that produced each sample
            (0 = initial weights); staleness = current version - this. For
            partial rollouts (:mod:`rlpost.core.partial`) the version of the row's
            oldest token; ``extras['token_version']`` ``[B, R]`` then holds each
            token's version (-1 on padding) and ``rollout_logprobs`` each token's
            log-prob under that version (CoPRIS cross-stage behaviour log-probs).
        rewards: ``[B]`` float, scalar reward per sequence (filled by the reward stage).
        response_texts: decoded responses, length ``B``.
        answers: gold answers (task-specific objects), length ``B``.
        meta: per-sample task metadata, length ``B``.
        extras: other named tensors added by stages, each ``[B]`` or ``[B, R]``:
            ``old_logprobs``, ``ref_logprobs``, ``values``, ``advantages``,
            ``returns``, ``entropy``, ``token_rewards``, ``temperatures`` ...
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    group_index: torch.Tensor
    prompt_index: torch.Tensor
    policy_version: Optional[torch.Tensor] = None
    rewards: Optional[torch.Tensor] = None
    response_texts: List[str] = field(default_factory=list)
    answers: List[Any] = field(default_factory=list)
    meta: List[Dict[str, Any]] = field(default_factory=list)
    extras: Dict[str, torch.Tensor] = field(default_factory=dict)

    _TENSOR_FIELDS = (
        "prompt_ids",
        "prompt_mask",
        "response_ids",
        "response_mask",
        "rollout_logprobs",
        "group_index",
        "prompt_index",
        "policy_version",
        "rewards",
    )

    def __len__(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def response_lengths(self) -> torch.Tensor:
        """``[B]`` long, number of loss-carrying response tokens per sequence."""
        return self.response_mask.sum(-1).long()

    def select(self, idx: torch.Tensor | List[int]) -> "RolloutBatch":
        """Return the sub-batch of rows ``idx`` (a list or a 1-D long tensor).

        All per-row tensors, lists and extras are indexed consistently.
        """
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        idx_l = idx_t.tolist()
        kw: Dict[str, Any] = {}
        for name in self._TENSOR_FIELDS:
            v = getattr(self, name)
            kw[name] = None if v is None else v[idx_t]
        kw["response_texts"] = [self.response_texts[i] for i in idx_l] if self.response_texts else []
        kw["answers"] = [self.answers[i] for i in idx_l] if self.answers else []
        kw["meta"] = [self.meta[i] for i in idx_l] if self.meta else []
        kw["extras"] = {k: v[idx_t] for k, v in self.extras.items()}
        return RolloutBatch(**kw)

    @staticmethod
    def concat(batches: List["RolloutBatch"], pad_token_id: int = 0) -> "RolloutBatch":
        """Concatenate batches along ``B``, re-padding prompts (left) and responses (right).

        Raises:
            ValueError: if ``batches`` is empty.
        """
        if not batches:
            raise ValueError("concat needs at least one batch")
        if len(batches) == 1:
            return batches[0]
        R = max(b.response_ids.shape[1] for b in batches)
        out: Dict[str, Any] = {
            "prompt_ids": pad_cat([b.prompt_ids for b in batches], pad_token_id, left=True),
            "prompt_mask": pad_cat([b.prompt_mask for b in batches], 0, left=True),
            "response_ids": pad_cat([b.response_ids for b in batches], pad_token_id),
            "response_mask": pad_cat([b.response_mask for b in batches], 0),
            "rollout_logprobs": pad_cat([b.rollout_logprobs for b in batches], 0),
            "group_index": torch.cat([b.group_index for b in batches]),
            "prompt_index": torch.cat([b.prompt_index for b in batches]),
        }
        for name in ("policy_version", "rewards"):
            vals = [getattr(b, name) for b in batches]
            out[name] = None if any(v is None for v in vals) else torch.cat(vals)
        out["response_texts"] = sum((b.response_texts for b in batches), [])
        out["answers"] = sum((b.answers for b in batches), [])
        out["meta"] = sum((b.meta for b in batches), [])
        keys = set.intersection(*(set(b.extras) for b in batches))
        extras = {}
        for k in keys:
            ts = [b.extras[k] for b in batches]
            extras[k] = pad_cat(ts, 0, width=R) if ts[0].dim() == 2 else torch.cat(ts)
        out["extras"] = extras
        return RolloutBatch(**out)


def left_pad(seqs: List[List[int]], pad_id: int):
    """Left-pad token lists to ``[B, P]`` ids and mask (long)."""
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, P - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, P - len(s):] = 1
    return ids, mask
