"""``rollout=hf``: batched generation with transformers models and a KV cache.

A plain decoding loop rather than ``model.generate`` so that the engine controls
exactly what it reports: the log-prob of each sampled token under the very
distribution it was drawn from (after temperature, top-k, top-p and any
per-token temperature hook), and a response mask that ends at EOS or a stop
string even when the pad token equals EOS.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any, List, Optional

import torch

from rlpost.rollout.base import GenerationResult, RolloutEngine, SamplingParams, concat_generations
from rlpost.core.batch import left_pad  # noqa: F401  (re-exported)
from rlpost.models.logprobs import eval_mode
from rlpost.models.sampling import apply_top_k_top_p
from rlpost.models.lora import is_lora, merged_model, merged_state_dict


@functools.lru_cache(maxsize=None)
def cache_kw() -> str:
    """Name of the KV-cache argument of causal-LM forward (``cache`` in transformers>=5.x).

    Asked on first use, not at import: importing transformers' model classes takes seconds,
    and commands that never generate (``rlpost list``, ``rlpost config``) import this module
    through the sampler registry.
    """
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def _get_cache(out: Any) -> Any:
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


def sample_inverse_cdf(
    probs: torch.Tensor, gen: Optional[torch.Generator] = None, u: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Draw one token per row of ``probs`` ``[B, V]`` by inverting the CDF with a uniform.

    Equivalent in distribution to ``torch.multinomial(probs, 1)`` and several
    times faster on CPU for large vocabularies. ``u`` ``[B]`` float64 in [0, 1):
    the uniforms to use (default: drawn from ``gen``). Returns ``[B]`` long.
    """
    cdf = probs.double().cumsum(-1)
    if u is None:
        u = torch.rand(probs.shape[0], generator=gen, dtype=torch.float64)
    u = u.to(torch.float64)[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    # Guard against landing on a zero-probability tail token through rounding.
    idx = idx.clamp(max=probs.shape[-1] - 1)
    bad = probs.gather(-1, idx[:, None]).squeeze(-1) <= 0
    if bool(bad.any()):
        idx = torch.where(bad, probs.argmax(-1), idx)
    return idx


_MASK64 = (1 << 64) - 1


def _wrap64(x: int) -> int:
    """``x`` modulo 2**64 as a signed int64 value (the bits row_uniforms reads)."""
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


def row_uniforms(row_seeds: "torch.Tensor", t: int) -> torch.Tensor:
    """The uniform in [0, 1) that row ``r`` uses for its token ``t``: one counter-based stream per row.

    SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014) of ``splitmix64(row_seed) + t``, top 53 bits. A
    row's draws depend only on its seed and the token position, never on the
    other rows of the call or on how a call is split into batches or across
    processes, which is what makes a data-parallel rollout equal a
    single-process one.

    Args:
        row_seeds: ``[B]`` int64 seeds (taken modulo 2**64).
        t: token position (0-based).
    Returns:
        ``[B]`` float64.
    """
    import numpy as np

    def mix(z):
        z = (z + np.uint64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    with np.errstate(over="ignore"):
        z = mix(mix(row_seeds.numpy().astype(np.uint64)) + np.uint64(t))
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)))


def _prealloc_layer_class():
    """:class:`PreallocatedLayer`, built lazily so that importing this module does not import transformers."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A ``DynamicLayer`` whose keys and values live in a buffer with room for ``capacity`` positions.

        transformers' ``DynamicLayer`` grows its ``[B, H, L, D]`` keys and values by
        ``torch.cat`` at every decode step, so step ``t`` copies the whole cache of every
        layer (about 90 MB per step for SmolLM2-135M at 32 rows and 60 positions, next to
        540 MB of fp32 weights). This layer allocates ``[B, H, capacity, D]`` once, writes each
        new position in place and returns the views ``[:, :, :L]``: the same keys and values,
        so attention sees identical numbers. Past ``capacity`` it grows by doubling (never
        needed when the capacity is prompt + ``max_new_tokens``). Rows are dropped
        (:meth:`batch_select_indices`) by indexing the buffer. Used only when every layer of
        the model's cache would be a plain ``DynamicLayer`` (no sliding windows).
        """

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = max(1, int(capacity))
            self.length = 0

        def _views(self) -> None:
            self.keys = self.kbuf[:, :, : self.length]
            self.values = self.vbuf[:, :, : self.length]

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                b, h, _, dk = key_states.shape
                self.kbuf = key_states.new_empty(b, h, self.capacity, dk)
                self.vbuf = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
            n = key_states.shape[-2]
            if self.length + n > self.kbuf.shape[2]:  # grow by doubling (amortised copies)
                cap = max(2 * self.kbuf.shape[2], self.length + n)
                for name in ("kbuf", "vbuf"):
                    old = getattr(self, name)
                    new = old.new_empty(*old.shape[:2], cap, old.shape[-1])
                    new[:, :, : self.length] = old[:, :, : self.length]
                    setattr(self, name, new)
            self.kbuf[:, :, self.length : self.length + n] = key_states
            self.vbuf[:, :, self.length : self.length + n] = value_states
            self.length += n
            self._views()
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.length > 0:
                self.kbuf, self.vbuf = self.kbuf[indices], self.vbuf[indices]
                self._views()

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("PreallocatedLayer does not crop (only the HF rollout engine uses it)")

    return PreallocatedLayer


_PREALLOC_LAYER: Any = None


def preallocated_cache(model: torch.nn.Module, capacity: int) -> Optional[Any]:
    """A transformers ``DynamicCache`` for ``model`` whose layers preallocate ``capacity`` positions.

    Returns None (the caller then lets the model build its own cache) when the
    model's cache would hold anything but plain ``DynamicLayer`` s (sliding-window
    or linear-attention layers), or transformers has no such cache API.
    """
    global _PREALLOC_LAYER
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:  # pragma: no cover - transformers without the layer API
        return None
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # pragma: no cover
        return None
    n = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers) or len(cache.layers) != n:
        return None
    if _PREALLOC_LAYER is None:
        _PREALLOC_LAYER = _prealloc_layer_class()
    cache.layers = [_PREALLOC_LAYER(capacity) for _ in cache.layers]
    return cache


def _sample_step(logits: torch.Tensor, params: SamplingParams, row_seeds: Optional[torch.Tensor], t: int):
    """One decode step's tokens ``[n]``, their log-probs ``[n]``, temperatures ``[n]`` and the log-softmax ``[n, V]``
    of the distribution they were drawn from, given ``logits`` ``[n, V]``.

    Greedy: argmax at temperature 1. Else the temperature (or the sampler's per-token
    hook), top-k / top-p, then an inverse-CDF draw from each row's own counter-based
    uniform (``row_seeds`` ``[n]``; None: torch's global RNG).
    """
    n = logits.shape[0]
    if params.greedy:
        T = torch.ones(n)
        logp = torch.log_softmax(logits, -1)
        tok = logits.argmax(-1)
    else:
        T = torch.full((n,), float(params.temperature))
        if params.temperature_hook is not None:
            hookT = params.temperature_hook(logits, t)
            if hookT is not None:
                T = hookT.float().clamp(min=1e-3)
        z = apply_top_k_top_p(logits / T[:, None], params.top_k, params.top_p)
        logp = torch.log_softmax(z, -1)
        u = row_uniforms(row_seeds, t) if row_seeds is not None else torch.rand(n, dtype=torch.float64)
        tok = sample_inverse_cdf(logp.exp(), u=u)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1), T, logp


class HFRolloutEngine(RolloutEngine):
    """Generation with a transformers causal LM on CPU or one GPU.

    Args:
        model: the policy (shared with the trainer when ``share_weights``; a LoRA policy
            then runs with its adapters unmerged, otherwise the copy holds merged weights).
        tokenizer: its tokenizer (EOS ends a sequence).
        batch_size: sequences decoded together; larger requests are split.
        share_weights: use the trainer's module directly (same dtype, no copy);
            otherwise keep a private copy converted by ``convert`` and refresh it
            in :meth:`sync_weights`.
        convert: ``fn(module) -> module`` applied to the private copy (e.g. cast to
            bf16, or fake-quantize for precision studies). A converter with the
            attribute ``dtype_cast = True`` is a pure dtype cast: :meth:`sync_weights`
            then copies the weights into the existing copy instead of rebuilding it.
        device: where generation runs.
        compact: drop finished rows from the decode batch (and their KV cache) as
            soon as they finish, so the remaining steps run on the live rows only.
            Off: finished rows keep decoding padding, as a plain batched loop does
            (kept for A/B measurements; outputs are the same).
        prealloc_cache: keep the KV cache in buffers sized prompt + ``max_new_tokens``
            written in place (:func:`preallocated_cache`) instead of transformers'
            default cache, which copies itself by ``torch.cat`` at every decode step.
            Same keys and values, so the same samples; off only for A/B measurements.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        batch_size: int = 64,
        share_weights: bool = True,
        convert: Optional[Any] = None,
        device: str | torch.device = "cpu",
        compact: bool = True,
        prealloc_cache: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.compact = compact
        self.prealloc_cache = prealloc_cache
        # when a list: one entry per model forward of generate(), naming the rows (and, for decode
        # steps, the response position) it covers; rlpost.models.moe_replay records routes with it
        self.forward_log: Optional[list] = None
        self._row_offset = 0
        self.batch_size = max(1, int(batch_size))
        self.share_weights = share_weights
        self.convert = convert
        self.device = torch.device(device)
        eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            self.eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids))
        if share_weights:
            self.model = model
        else:
            self.model = self._make_copy(model)

    def _make_copy(self, model: torch.nn.Module) -> torch.nn.Module:

        # LoRA: a plain model holding the merged weights W + (alpha/r) B A (no adapter matmuls per token)
        m = merged_model(model) if is_lora(model) else copy.deepcopy(model)
        # the layers' own flag and activation_checkpointing_disable where transformers has it: its older
        # gradient_checkpointing names now warn (FutureWarning) on every use, on the console of every run
        if any(getattr(mod, "gradient_checkpointing", False) for mod in m.modules()):
            (getattr(m, "activation_checkpointing_disable", None) or m.gradient_checkpointing_disable)()
        if self.convert is not None:
            m = self.convert(m)
        m.requires_grad_(False)
        return m.eval()

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Refresh the private copy from ``policy`` (no-op when weights are shared).

        A LoRA policy is merged on the push (:func:`rlpost.models.lora.merged_state_dict`):
        the copy is a plain model with ``W + (alpha/r) B A`` in each adapted layer.
        """

        if self.share_weights:
            return
        if self.convert is None or getattr(self.convert, "dtype_cast", False):
            # a plain copy or a dtype cast: copy_ rounds exactly as .to(dtype) does, no rebuild
            self.model.load_state_dict(merged_state_dict(policy) if is_lora(policy) else policy.state_dict())
        else:
            # Conversions (quantization) are not invertible: rebuild from the source weights.
            self.model = self._make_copy(policy)

    @torch.no_grad()
    def generate(self, prompts: List[List[int]], params: SamplingParams) -> GenerationResult:
        """Sample one response per prompt. See :class:`GenerationResult` for shapes.

        Raises:
            ValueError: empty prompt list or a non-positive temperature without greedy.
        """
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        if not params.greedy and params.temperature <= 0:
            raise ValueError("temperature must be > 0 for sampling (use greedy decoding for argmax)")
        seeds = None
        if params.seed is not None:  # one stream per row: seed + row_offset + row (see SamplingParams)
            base = int(params.seed) + int(params.row_offset)
            seeds = torch.tensor([_wrap64(base + i) for i in range(len(prompts))], dtype=torch.int64)
        parts = []
        for i in range(0, len(prompts), self.batch_size):
            self._row_offset = i  # rows of this call covered by the batch (forward_log, MoE route recording)
            parts.append(self._generate_batch(prompts[i : i + self.batch_size], params,
                                              None if seeds is None else seeds[i : i + self.batch_size]))
        return concat_generations(parts, self.pad_id)

    def _stop_hit(self, tokens: List[int], stop: List[str]) -> bool:
        tail = self.tokenizer.decode(tokens[-16:], skip_special_tokens=True)
        return any(s in tail for s in stop)

    def _prefill(self, model: Any, prompts: List[List[int]], ids: torch.Tensor, mask: torch.Tensor, max_new: int):
        """Prefill each distinct prompt once (a group of n samples shares its prompt), then expand the KV
        cache to the full batch; returns ``(cache, last logits [B, V], next positions [B])``."""
        B = ids.shape[0]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        uniq: dict = {}
        inverse = torch.tensor([uniq.setdefault(tuple(p), len(uniq)) for p in prompts], dtype=torch.long)
        first = torch.tensor([inverse.tolist().index(u) for u in range(len(uniq))], dtype=torch.long)
        if self.forward_log is not None:  # which rows / positions each forward covers (MoE route recording)
            self.forward_log.append(("prefill", self._row_offset, first.clone(), inverse.clone(), ids.shape[1]))
        cache0 = preallocated_cache(model, ids.shape[1] + max_new) if self.prealloc_cache else None
        out = model(
            input_ids=ids[first], attention_mask=mask[first], position_ids=pos[first],
            use_cache=True, logits_to_keep=1, **{cache_kw(): cache0},
        )
        past = _get_cache(out)
        logits = out.logits[:, -1, :].float()
        if len(uniq) < B:
            past.batch_select_indices(inverse.to(self.device))
            logits = logits[inverse]
        return past, logits, pos[:, -1] + 1

    def _generate_batch(self, prompts: List[List[int]], params: SamplingParams,
                        row_seeds: Optional[torch.Tensor]) -> GenerationResult:
        model = self.model
        with eval_mode(model):
            ids, mask = left_pad(prompts, self.pad_id)
            B = ids.shape[0]
            ids, mask = ids.to(self.device), mask.to(self.device)
            p_mask = mask
            past, logits, next_pos = self._prefill(model, prompts, ids, mask, params.max_new_tokens)
            Tn = params.max_new_tokens
            # Outputs for all B rows; the decode batch holds only the rows still running ("live"),
            # so finished rows stop costing forward passes. Each row draws from its own stream
            # (row_uniforms), so its samples do not depend on when or whether other rows run.
            resp = torch.full((B, Tn), self.pad_id, dtype=torch.long)
            lp_out = torch.zeros(B, Tn)
            t_out = torch.zeros(B, Tn)
            alive = torch.zeros(B, Tn)
            finished = torch.zeros(B, dtype=torch.bool)
            rows = torch.arange(B)  # original row of each live decode row
            eos = torch.tensor(sorted(self.eos_ids))
            history: List[List[int]] = [[] for _ in range(B)]
            steps = 0
            for t in range(Tn):
                steps = t + 1
                tok, lp, T, logp = _sample_step(logits.cpu(), params, None if row_seeds is None else row_seeds[rows], t)
                embeds = None
                if params.decode_hook is not None:  # e.g. N-GRPO's neighbour mixing: other tokens or inputs
                    tok, embeds = params.decode_hook(logp, tok, rows + self._row_offset, t)
                    lp = logp.gather(-1, tok[:, None]).squeeze(-1)
                live = ~finished[rows]  # all True when compacting
                r = rows[live]
                resp[r, t] = tok[live]
                lp_out[r, t] = lp[live]
                t_out[r, t] = T[live]
                alive[r, t] = 1.0
                newly = live & torch.isin(tok, eos)
                if params.stop:
                    for j in torch.nonzero(live & ~newly).flatten().tolist():
                        i = int(rows[j])
                        history[i].append(int(tok[j]))
                        if self._stop_hit(history[i], params.stop):
                            newly[j] = True
                finished[rows[newly]] = True
                tok = torch.where(finished[rows], torch.full_like(tok, self.pad_id), tok)
                if bool(finished.all()) or t == Tn - 1:
                    break
                if self.compact and bool(newly.any()):  # drop finished rows from the batch and its KV cache
                    keep = torch.nonzero(~newly).flatten()
                    past.batch_select_indices(keep.to(self.device))
                    kd = keep.to(mask.device)
                    rows, tok, mask, next_pos = rows[keep], tok[keep], mask[kd], next_pos[kd]
                    embeds = None if embeds is None else embeds[keep]
                mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype, device=mask.device)], dim=1)
                if self.forward_log is not None:
                    self.forward_log.append(("decode", self._row_offset, rows.clone(), t, ids.shape[1]))
                feed = ({"input_ids": tok[:, None].to(self.device)} if embeds is None else
                        {"inputs_embeds": embeds[:, None].to(self.device, model.get_input_embeddings().weight.dtype)})
                out = model(
                    **feed,
                    attention_mask=mask,
                    position_ids=next_pos[:, None],
                    use_cache=True,
                    **{cache_kw(): past},
                )
                past = _get_cache(out)
                logits = out.logits[:, -1, :].float()
                next_pos = next_pos + 1
            resp, lp_out, t_out, rmask = resp[:, :steps], lp_out[:, :steps], t_out[:, :steps], alive[:, :steps]
            texts = [
                self.tokenizer.decode(resp[i][rmask[i] > 0].tolist(), skip_special_tokens=True) for i in range(B)
            ]
            return GenerationResult(
                prompt_ids=ids.cpu(),
                prompt_mask=p_mask.cpu(),
                response_ids=resp,
                response_mask=rmask,
                rollout_logprobs=lp_out,
                temperatures=t_out,
                finished=finished,
                texts=texts,
            )
