"""Pure input preparation that some methods need beyond rollouts and rewards.

Tensor and text functions only; the hook files of :mod:`rlpost.methods` call
them (SSPO's subsentences, SFT's reference answers).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch


#: characters that end a subsentence (SSPO): the token containing one is the subsentence's last
SUBSENTENCE_END = (",", ".", ";", ":", "!", "?", "\n")


def subsentence_ids(response_ids: torch.Tensor, mask: torch.Tensor, tokenizer: Any) -> torch.Tensor:
    """``[B, R]`` long subsentence index of each response token (SSPO, arXiv:2511.04256).

    A subsentence ends after a token whose text contains one of
    :data:`SUBSENTENCE_END` (our choice of delimiters; the paper splits on
    punctuation); indices count from 0 in each row, and only positions in
    ``mask`` advance them.
    """
    B, R = response_ids.shape
    ends: Dict[int, bool] = {}
    out = torch.zeros(B, R, dtype=torch.long)
    for b in range(B):
        k = 0
        for t in range(R):
            out[b, t] = k
            if mask[b, t] <= 0:
                continue
            tid = int(response_ids[b, t])
            if tid not in ends:
                txt = tokenizer.decode([tid])
                ends[tid] = any(c in txt for c in SUBSENTENCE_END)
            if ends[tid]:
                k += 1
    return out.clamp(max=max(R - 1, 0))


def reference_response(answer: Any, answer_format: str) -> str:
    """The reference completion an SFT step trains on, in the task's answer format.

    ``tags`` -> ``<answer>A</answer>``, ``boxed`` -> ``\\boxed{A}``, otherwise ``A``.
    """
    a = str(answer)
    if answer_format == "tags":
        return f"<answer>{a}</answer>"
    if answer_format == "boxed":
        return f"\\boxed{{{a}}}"
    return a


def reference_tensors(texts: List[str], tokenizer: Any, max_len: int):
    """Tokenise reference completions (+ EOS) into right-padded ``(ids [B, R], mask [B, R])``."""
    eos = tokenizer.eos_token_id
    rows = []
    for t in texts:
        ids = list(tokenizer(t, add_special_tokens=False)["input_ids"])[: max(1, max_len - 1)]
        rows.append(ids + ([eos] if eos is not None else []))
    R = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    ids = torch.full((len(rows), R), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), R)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1.0
    return ids, mask
