"""Response log-probs without materialising ``[B, L, V]`` logits.

The backbone runs once over prompt + response (each group's prompt once); the LM
head and log-softmax are applied only to the real response tokens, packed into
``[N, H]`` and taken ``chunk_size * B`` at a time. With gradients, each chunk runs
through :class:`_LinearLogprob`, whose backward turns the chunk's saved logits into
their gradient in place (one ``[n, V]`` block instead of autograd's four); with more
than one chunk the logits are not kept but recomputed in backward (as activation
checkpointing of the chunk would), so peak memory holds one ``[chunk_size * B, V]``
block. Heads it does not cover (autocast, top-k/top-p truncation, an entropy
gradient) take autograd's graph of the same formula, checkpointed per chunk. The entropy reuses the chunk's logits and gets
no autograd graph unless an entropy bonus needs its gradient. :func:`prompt_entropy` applies the same
chunking to the prompt positions (HIVE's prompt entropy).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterator, List, Optional, Tuple

import torch
from torch.utils.checkpoint import checkpoint
from rlpost.core.batch import left_pad


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run the block with ``model`` in eval mode (no dropout), then restore its train/eval mode.

    The no-grad scoring passes (rollout generation, old/ref log-probs, SPEC-RL's
    verification, tree and pruning features) must not change the mode the update
    trains in, also when they raise. Gradients are not touched: pair it with
    ``torch.no_grad()`` where the pass needs none.

    Yields:
        ``model`` itself.
    """
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


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


#: log-prob (nats) given to a token outside the trainer's own top-k/top-p set (no gradient)
TRUNCATED_LOGPROB = -30.0


def _chunk_logprobs(
    head: torch.nn.Module,
    h: torch.Tensor,
    targets: torch.Tensor,
    inv_temp: Optional[torch.Tensor],
    want_entropy: bool,
    entropy_grad: bool = True,
    top_k: int = 0,
    top_p: float = 1.0,
):
    """Log-probs (and entropy) of ``targets`` ``[N]`` from hidden states ``h`` ``[N, H]``.

    ``inv_temp`` ``[N]`` (None: temperature 1, no scaling pass). ``top_k`` /
    ``top_p`` truncate the temperature-scaled logits ``[N, V]`` as the sampler
    did (:func:`rlpost.models.sampling.apply_top_k_top_p`; 0 and 1 = off); a
    target outside the truncated set gets ``TRUNCATED_LOGPROB``. The entropy is
    computed from the same logits; without ``entropy_grad`` it is built under
    ``no_grad``, so it adds no autograd node and no backward work (a metric, or a
    loss input the loss treats as a constant).
    """
    logits = head(h).float()
    if inv_temp is not None:
        logits = logits * inv_temp[..., None]
    truncated = bool(top_k) or top_p < 1.0
    if truncated:
        from rlpost.models.sampling import apply_top_k_top_p

        logits = apply_top_k_top_p(logits, top_k, top_p)
    logz = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, targets[..., None]).squeeze(-1) - logz
    if truncated:
        lp = lp.clamp(min=TRUNCATED_LOGPROB)
    if not want_entropy:
        return lp, torch.zeros_like(lp)
    with nullcontext() if entropy_grad else torch.no_grad():
        p = torch.softmax(logits, dim=-1)
        plogit = torch.where(p > 0, p * logits, torch.zeros_like(logits)) if truncated else p * logits
        ent = logz - plogit.sum(-1)
    return lp, ent


class _LinearLogprob(torch.autograd.Function):
    """``log softmax(h W^T + b) [target]`` per row with a backward that reuses the saved logits in place.

    Autograd's graph for ``gather(z) - logsumexp(z)`` keeps the ``[n, V]`` logits and,
    in backward, builds ``exp(z - lse)``, the scattered gradient of the gather and
    their sum: three more ``[n, V]`` blocks, all alive while every layer's activations
    still wait for their own backward (the update's memory peak). Here the backward
    turns the saved logits into ``grad_z = g * (onehot(target) - softmax(z))`` in place
    (the same formula autograd evaluates: logsumexp's backward is ``g * exp(z - lse)``),
    then ``grad_h = grad_z W`` and ``grad_W = grad_z^T h``. One ``[n, V]`` block in all.
    With ``recompute`` the logits are not kept: backward recomputes them from ``h``
    (what activation checkpointing of the chunk did), so nothing ``[n, V]`` outlives the chunk.
    The graph may be backpropagated once (the saved logits are consumed).
    """

    @staticmethod
    def forward(ctx, h, weight, bias, targets, inv_temp, want_entropy: bool, recompute: bool):
        z = torch.nn.functional.linear(h, weight, bias).float()
        if inv_temp is not None:
            z.mul_(inv_temp[:, None])
        lse = torch.logsumexp(z, dim=-1)
        lp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
        ent = torch.zeros_like(lp)
        if want_entropy:  # H = lse - sum_v p_v z_v, in row blocks so only a slice of p exists at once
            for s in range(0, z.shape[0], 256):
                zs = z[s : s + 256]
                ent[s : s + 256] = lse[s : s + 256] - (torch.softmax(zs, dim=-1) * zs).sum(-1)
        ctx.recompute = recompute
        ctx.has_bias = bias is not None
        ctx.save_for_backward(h, weight, bias if bias is not None else h.new_empty(0), targets,
                              inv_temp if inv_temp is not None else h.new_empty(0), lse,
                              h.new_empty(0) if recompute else z)
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g, _g_ent):
        h, weight, bias, targets, inv_temp, lse, z = ctx.saved_tensors
        if ctx.recompute:
            z = torch.nn.functional.linear(h, weight, bias if ctx.has_bias else None).float()
            if inv_temp.numel():
                z.mul_(inv_temp[:, None])
        # grad_z = g * (onehot - exp(z - lse)), written over z
        gz = z.sub_(lse[:, None]).exp_().mul_(-g[:, None]).scatter_add_(-1, targets[:, None], g[:, None])
        if inv_temp.numel():
            gz.mul_(inv_temp[:, None])
        gz = gz.to(h.dtype)
        grad_h = gz @ weight if ctx.needs_input_grad[0] else None
        grad_w = gz.t() @ h if ctx.needs_input_grad[1] else None
        grad_b = gz.sum(0) if (ctx.has_bias and ctx.needs_input_grad[2]) else None
        return grad_h, grad_w, grad_b, None, None, None, None


def _fused_head_ok(head: torch.nn.Module, h: torch.Tensor, top_k: int, top_p: float, entropy_grad: bool) -> bool:
    """Whether :class:`_LinearLogprob` computes this chunk: a plain ``nn.Linear`` head in the
    hidden states' dtype, no autocast, no top-k/top-p truncation, no entropy gradient, and a
    weight that is all here: a DeepSpeed ZeRO-3 parameter (``ds_id``) is a partition that only
    the module's own forward hooks gather, so such a head keeps the module call."""
    return (type(head) is torch.nn.Linear and not hasattr(head.weight, "ds_id") and head.weight.dtype == h.dtype
            and not top_k and top_p >= 1.0 and not entropy_grad and not torch.is_autocast_enabled(h.device.type))


def _cache_kw(base: torch.nn.Module) -> str:
    """Name of the decoder's KV-cache argument (``cache`` in transformers >= 5, ``past_key_values`` before)."""
    import inspect

    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _shared_prefix_hidden(
    base: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_attn: torch.Tensor,
) -> Optional[torch.Tensor]:
    """Hidden states ``[B, R, H]`` that predict each response token, prompts computed once each.

    Rows with identical (left-padded) prompt ids and mask form one prompt; the
    decoder runs on the ``U`` distinct prompts with a KV cache, the cache is
    indexed out to all ``B`` rows, and the ``B`` responses run on top of it.
    The state that predicts response token 0 is the prompt's last position;
    token ``t > 0`` is predicted from response position ``t - 1``. Indexing is
    differentiable, so the backward pass sums every row's gradient into its
    prompt's computation, exactly as the unshared forward would.

    This is the token reduction of "DualKV: Shared-Prompt Flash Attention for Efficient
    RL Training with Large Rollouts and Long Contexts" (arXiv:2605.15422): a group of N
    rows costs P + N R decoder tokens instead of N (P + R), a factor
    ``rho = N (P + R) / (P + N R)`` for every per-token operation. DualKV also fuses the
    attention over the shared and the per-row KV regions into one CUDA kernel that reads
    the prompt's KV once; here the cache index copies it per row and attention is the
    model's own. ``scripts/bench_shared_prompt.py`` measures the two forwards.

    Returns:
        The hidden states, or None when no prompt repeats (``U == B``) or the
        decoder returns no cache; the caller then runs the plain forward.
    """
    B, P = prompt_ids.shape
    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)
    U = uniq.shape[0]
    if U == B:
        return None
    first = torch.full((U,), B, dtype=torch.long, device=inverse.device).scatter_reduce(
        0, inverse, torch.arange(B, device=inverse.device), reduce="amin")
    p_mask = prompt_mask.long()
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    kw = _cache_kw(base)
    out = base(input_ids=prompt_ids[first], attention_mask=p_mask[first], position_ids=p_pos[first],
               use_cache=True, **{kw: None})
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return None
    cache.batch_select_indices(inverse.to(out.last_hidden_state.device))
    attn = torch.cat([p_mask, response_attn.long()], dim=1)
    r_pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, P:]
    out_r = base(input_ids=response_ids, attention_mask=attn, position_ids=r_pos, use_cache=False, **{kw: cache})
    h_last_prompt = out.last_hidden_state[:, -1:][inverse]
    return torch.cat([h_last_prompt, out_r.last_hidden_state[:, :-1]], dim=1)


def packed_response_states(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_attn: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    share_prefix: bool = True,
) -> Tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The final hidden states that predict real response tokens, packed, ready for the LM head.

    One backbone forward (each group's prompt once when ``share_prefix`` and the model
    allows it, see :func:`_shared_prefix_hidden`); the LM head then runs only where a
    label exists. Shared by :func:`response_logprobs` and
    :func:`rlpost.models.teacher.support_logprobs`.

    Args:
        prompt_ids, prompt_mask: ``[B, P]`` left-padded.
        response_ids, response_attn: ``[B, R]`` right-padded ids; 1 on real tokens.
        temperature: scalar or ``[B, R]`` (0 entries count as 1).
    Returns:
        ``(head, flat_idx [N], hs [N, H], targets [N], inv_temp [N] or None)``: the LM
        head module, the indices of the N real tokens in the flattened ``[B * R]``
        grid, their hidden states and token ids, and 1 / temperature per token
        (None when every temperature is 1, so the head skips a ``[N, V]`` pass).
    """
    base, head = backbone_and_head(model)
    P, R = prompt_ids.shape[1], response_ids.shape[1]
    h = None
    if share_prefix and not getattr(base, "gradient_checkpointing", False):
        h = _shared_prefix_hidden(base, prompt_ids, prompt_mask, response_ids, response_attn)
    if h is None:
        ids, attn, pos = build_inputs(prompt_ids, prompt_mask, response_ids, response_attn)
        hidden = base(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
        h = hidden[:, P - 1 : P + R - 1]
    B = response_ids.shape[0]
    flat_idx = (response_attn > 0).to(h.device).reshape(-1).nonzero().squeeze(-1)
    hs = h.reshape(B * R, -1).index_select(0, flat_idx)
    tgt = response_ids.to(h.device).reshape(-1).index_select(0, flat_idx)
    inv_temp = None
    if isinstance(temperature, torch.Tensor):
        T = temperature.float().to(h.device).reshape(-1).index_select(0, flat_idx)
        T = torch.where(T > 0, T, torch.ones_like(T))
        if not bool((T == 1).all()):  # x * 1.0 == x: skip a [N, V] pass when every temperature is 1
            inv_temp = 1.0 / T
    elif float(temperature) != 1.0:
        inv_temp = torch.full((hs.shape[0],), 1.0 / float(temperature), device=h.device)
    return head, flat_idx, hs, tgt, inv_temp


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
    share_prefix: bool = True,
    entropy_grad: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
    fused_head: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probs (nats) of ``response_ids`` under ``model`` at ``temperature``.

    When several rows share the same prompt (a GRPO group of ``n`` samples) and
    ``share_prefix`` is on, the backbone runs once per distinct prompt, its KV
    cache is expanded to the rows (an index, so gradients from every row add
    up on the shared prompt) and only the responses run per row: see
    :func:`_shared_prefix_hidden`. Same values and gradients as the full
    forward up to float summation order; about ``n`` times fewer prompt tokens.

    Args:
        model: a transformers causal LM (``base_model`` + output embeddings).
        prompt_ids, prompt_mask: ``[B, P]`` left-padded.
        response_ids: ``[B, R]`` right-padded.
        response_attn: ``[B, R]`` 1 on real response tokens (attended to), 0 on
            padding. (Distinct from the loss mask, which may exclude real tokens.)
        temperature: scalar, or ``[B, R]`` per-token temperatures (0 entries are
            treated as 1); logits are divided by it, matching the rollout engine.
        chunk_size: response positions per LM-head/log-softmax chunk: the head
            runs on ``chunk_size * B`` packed real response tokens at a time.
        with_entropy: also return the entropy of each position's distribution,
            computed without gradient (a metric or a constant loss input).
        checkpoint_chunks: recompute chunk logits in backward. Default: when grad
            is enabled and the tokens span more than one chunk (with a single
            chunk the full block exists during recomputation anyway, so
            checkpointing would only add work).
        share_prefix: compute each distinct prompt once (off automatically under
            gradient checkpointing, which cannot return a KV cache).
        entropy_grad: return the entropy with its gradient (an entropy bonus in
            the loss); implies ``with_entropy``.
        top_k, top_p: the sampler's truncation (0 and 1 = off). The log-probs are
            those of the distribution the rollout engine drew from: the
            temperature-scaled logits truncated by
            :func:`rlpost.models.sampling.apply_top_k_top_p` and renormalised,
            so on the sampling weights they equal the engine's rollout
            log-probs. A token outside this model's own truncated set (possible
            once the weights moved) gets ``TRUNCATED_LOGPROB`` (-30 nats) and no
            gradient; the entropy is that of the truncated distribution.
        fused_head: with gradients, compute each chunk's log-probs with
            :class:`_LinearLogprob` (one ``[n, V]`` block through forward and backward
            instead of four) when the head is a plain linear layer in the hidden
            states' dtype, outside autocast, without truncation or entropy gradient;
            otherwise, and with ``False`` (A/B), autograd's graph of the same formula.
    Returns:
        ``(logprobs [B, R], entropy [B, R] or None)``, float32, 0 on padding
        positions (``response_attn == 0``): the LM head and log-softmax run only
        on real response tokens, packed.
    """
    head, flat_idx, hs, tgt, inv_temp = packed_response_states(
        model, prompt_ids, prompt_mask, response_ids, response_attn, temperature, share_prefix)
    B, R = response_ids.shape
    rows = max(1, chunk_size * B)  # same peak as chunk_size positions of all B rows
    N = hs.shape[0]
    if checkpoint_chunks is None:
        use_ckpt = torch.is_grad_enabled() and N > rows
    else:
        use_ckpt = checkpoint_chunks
    want_ent, ent_grad = with_entropy or entropy_grad, entropy_grad
    fused = fused_head and _fused_head_ok(head, hs, top_k, top_p, ent_grad)
    lps, ents = [], []
    for s in range(0, N, rows):
        e = min(N, s + rows)
        it = None if inv_temp is None else inv_temp[s:e]
        if fused and torch.is_grad_enabled():
            lp, ent = _LinearLogprob.apply(hs[s:e], head.weight, head.bias, tgt[s:e], it, want_ent, use_ckpt)
            lps.append(lp)
            ents.append(ent)
            continue
        args = (head, hs[s:e], tgt[s:e], it, want_ent, ent_grad, top_k, top_p)
        if use_ckpt:
            lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        lps.append(lp)
        ents.append(ent)

    def unpack(parts: List[torch.Tensor]) -> torch.Tensor:
        # no real token (an empty micro-batch): an empty view of ``hs`` keeps the result on the
        # autograd graph, so a loss built from it still backpropagates (zero gradients)
        flat = torch.cat(parts) if parts else hs.float().sum(-1)
        return torch.zeros(B * R, dtype=torch.float32, device=hs.device).index_copy(0, flat_idx, flat).view(B, R)

    logprobs = unpack(lps)
    entropy = unpack(ents) if want_ent else None
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

    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompt_entropy needs non-empty prompts")
    base, head = backbone_and_head(model)
    device = next(model.parameters()).device
    out: List[float] = []
    with eval_mode(model):
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
    return out
