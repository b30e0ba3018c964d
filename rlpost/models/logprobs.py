"""Response log-probs without materialising ``[B, L, V]`` logits.

The backbone runs once over prompt + response; the LM head and log-softmax are
applied only at response positions, ``chunk_size`` positions at a time. With
gradients, each chunk is wrapped in activation checkpointing, so the backward
pass recomputes that chunk's logits instead of keeping all of them: peak memory
holds one ``[B, chunk, V]`` block. :func:`prompt_entropy` applies the same
chunking to the prompt positions (HIVE's prompt entropy).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager, List, Optional, Tuple

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


@torch.no_grad()
def prompt_entropy(
    model: torch.nn.Module,
    prompts: List[List[int]],
    pad_id: int,
    batch_size: int = 16,
    chunk_size: int = 64,
    autocast: Optional[Callable[[], ContextManager]] = None,
) -> List[float]:
    """Mean next-token entropy (nats) of ``model`` over each prompt's tokens: HIVE's prompt entropy.

    The online check of HIVE ("HIVE: History-Informed and online-VErified
    prompt selection", arXiv:2603.25184) needs a cheap signal of how the policy
    currently sees a prompt, without rolling it out. Ours is one prefill per
    prompt: at every real (non-pad) position ``t`` of the prompt, the entropy
    ``H_t = -sum_v p(v | x_<=t) log p(v | x_<=t)`` of the model's next-token
    distribution at temperature 1, averaged over the prompt's positions. The
    last position's distribution is that of the first response token. No
    generation, no sampling, so the value is deterministic for given weights.

    Prompts are left-padded and run ``batch_size`` at a time; the LM head and
    softmax are applied ``chunk_size`` positions at a time, so at most a
    ``[batch_size, chunk_size, V]`` block of logits exists. Runs in eval mode
    under ``torch.no_grad`` and restores the model's training flag.

    Args:
        model: a transformers causal LM (``base_model`` + output embeddings).
        prompts: token ids of each prompt (each non-empty).
        pad_id: id used for left padding (masked out).
        batch_size: prompts per forward pass.
        chunk_size: positions per LM-head chunk.
        autocast: returns a context manager entered around each forward pass
            (e.g. the trainer's ``autocast`` method for bf16), or None.
    Returns:
        one float per prompt, in nats, in ``[0, log V]``.
    Raises:
        ValueError: an empty prompt.
        TypeError: the model has no separable decoder and LM head.
    """
    from rlpost.rollout.hf import left_pad

    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompt_entropy needs non-empty prompts")
    base, head = backbone_and_head(model)
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    out: List[float] = []
    try:
        for b in range(0, len(prompts), max(1, int(batch_size))):
            ids, mask = left_pad(prompts[b : b + max(1, int(batch_size))], pad_id)
            ids, mask = ids.to(device), mask.to(device)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            with autocast() if autocast is not None else nullcontext():
                h = base(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
                total = torch.zeros(ids.shape[0], device=device)
                for s in range(0, ids.shape[1], max(1, int(chunk_size))):
                    e = min(ids.shape[1], s + max(1, int(chunk_size)))
                    logp = torch.log_softmax(head(h[:, s:e]).float(), dim=-1)
                    ent = -(logp.exp() * logp).sum(-1)
                    total += (ent * mask[:, s:e]).sum(-1)
            out.extend((total / mask.sum(-1)).tolist())
    finally:
        model.train(was)
    return out
