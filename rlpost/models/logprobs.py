"""Response log-probs without materialising ``[B, L, V]`` logits.

The backbone runs once over prompt + response; the LM head and log-softmax are
applied only at response positions, ``chunk_size`` positions at a time. With
gradients, each chunk is wrapped in activation checkpointing, so the backward
pass recomputes that chunk's logits instead of keeping all of them: peak memory
holds one ``[B, chunk, V]`` block.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.utils.checkpoint import checkpoint


def backbone_and_head(model: torch.nn.Module) -> Tuple[torch.nn.Module, torch.nn.Module]:
    """The decoder stack (returns hidden states) and the LM head of a causal LM.

    Raises:
        TypeError: the model has no separable base model / output embeddings.
    """
    base = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or base is model or head is None:
        raise TypeError(f"{type(model).__name__} has no separable decoder and LM head")
    return base, head


def build_inputs(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_attn: torch.Tensor,
):
    """Concatenate left-padded prompts and right-padded responses.

    Returns:
        ``(input_ids [B, P+R], attention_mask [B, P+R], position_ids [B, P+R])``.
    """
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    attn = torch.cat([prompt_mask.long(), response_attn.long()], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return ids, attn, pos


def _chunk_logprobs(
    head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor, want_entropy: bool
):
    logits = head(h).float() * inv_temp[..., None]
    logz = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, targets[..., None]).squeeze(-1) - logz
    if not want_entropy:
        return lp, torch.zeros_like(lp)
    p = torch.softmax(logits, dim=-1)
    ent = logz - (p * logits).sum(-1)
    return lp, ent


def response_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_attn: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int = 64,
    with_entropy: bool = False,
    checkpoint_chunks: Optional[bool] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probs (nats) of ``response_ids`` under ``model`` at ``temperature``.

    Args:
        model: a transformers causal LM (``base_model`` + output embeddings).
        prompt_ids, prompt_mask: ``[B, P]`` left-padded.
        response_ids: ``[B, R]`` right-padded.
        response_attn: ``[B, R]`` 1 on real response tokens (attended to), 0 on
            padding. (Distinct from the loss mask, which may exclude real tokens.)
        temperature: scalar, or ``[B, R]`` per-token temperatures (0 entries are
            treated as 1); logits are divided by it, matching the rollout engine.
        chunk_size: response positions per LM-head/log-softmax chunk.
        with_entropy: also return the entropy of each position's distribution.
        checkpoint_chunks: recompute chunk logits in backward. Default: when grad
            is enabled and the response spans more than one chunk (with a single
            chunk the full block exists during recomputation anyway, so
            checkpointing would only add work).
    Returns:
        ``(logprobs [B, R], entropy [B, R] or None)``, float32. Values on padding
        positions are meaningless; mask them.
    """
    base, head = backbone_and_head(model)
    ids, attn, pos = build_inputs(prompt_ids, prompt_mask, response_ids, response_attn)
    P, R = prompt_ids.shape[1], response_ids.shape[1]
    hidden = base(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
    h = hidden[:, P - 1 : P + R - 1]
    if isinstance(temperature, torch.Tensor):
        T = temperature.float().to(h.device)
        T = torch.where(T > 0, T, torch.ones_like(T))
        inv_temp = 1.0 / T
    else:
        inv_temp = torch.full(response_ids.shape, 1.0 / float(temperature), device=h.device)
    if checkpoint_chunks is None:
        use_ckpt = torch.is_grad_enabled() and R > chunk_size
    else:
        use_ckpt = checkpoint_chunks
    lps, ents = [], []
    for s in range(0, R, chunk_size):
        e = min(R, s + chunk_size)
        args = (head, h[:, s:e], response_ids[:, s:e].to(h.device), inv_temp[:, s:e], with_entropy)
        if use_ckpt:
            lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        lps.append(lp)
        ents.append(ent)
    logprobs = torch.cat(lps, dim=1)
    entropy = torch.cat(ents, dim=1) if with_entropy else None
    return logprobs, entropy
