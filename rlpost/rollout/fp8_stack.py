"""The FP8 rollout stack of FP8-RL, simulated on CPU, and its vLLM settings for a GPU run.

Paper: "FP8-RL: A Practical and Stable Low-Precision Stack for LLM Reinforcement Learning"
(Qiu et al., arXiv:2601.18150), implemented by its authors in veRL (``docs/advance/fp8.md``,
``verl/utils/vllm/vllm_fp8_utils.py``). Its three parts, and what rlpost does for each:

1. **Blockwise W8A8 linear layers**, re-quantised at every weight sync: the DeepSeek-V3 recipe veRL
   uses ("1x128 quantization for activations and 128x128 quantization for model weights", veRL's
   fp8 doc). Simulated by ``precision.rollout_dtype=fp8_blockwise_sim``
   (:func:`fake_quant_fp8_blockwise` on each decoder weight, :func:`fake_quant_fp8_token_groups`
   on each decoder linear's input); the hf engine rebuilds its copy at every sync, so the weights
   are re-quantised from the new trainer weights each step. On a GPU
   ``precision.rollout_dtype=fp8_blockwise`` with ``rollout=vllm`` asks vLLM for it
   (:func:`vllm_fp8_kwargs`).
2. **FP8 KV cache with per-step QKV scale recalibration** (``precision.kv_cache=fp8``):
   per-layer, per-tensor scales of Q, K and V computed from the first forward pass after each
   weight sync, as vLLM's ``calculate_kv_scales`` computes them (``Attention.calc_kv_scales``:
   ``scale = amax(|x|) / range`` with ``Q_SCALE_CONSTANT = K_SCALE_CONSTANT = 200`` and
   ``V_SCALE_CONSTANT = 100``), then Q, K and V rounded to fp8 e4m3 with those scales
   (:class:`Fp8KvCacheSim`). K and V are rounded after RoPE and the cache update, i.e. what an
   fp8 cache stores and attention reads back.
3. **Token-level TIS / MIS rollout correction**: already in rlpost (``precision.correction``,
   :mod:`rlpost.algos.corrections`); the presets set ``correction: tis``.

The arithmetic of the simulation is fp32 (fake quantisation): the values an fp8 GEMM multiplies,
not its speed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple

import torch

from rlpost.core.errors import ConfigError, RlpostError
from rlpost.core.registry import Choice, as_dict, param, resolve_params

FP8_E4M3_MAX = 448.0
#: vLLM's envs.Q_SCALE_CONSTANT / K_SCALE_CONSTANT / V_SCALE_CONSTANT (calculate_kv_scales' divisors)
VLLM_Q_RANGE, VLLM_K_RANGE, VLLM_V_RANGE = 200.0, 200.0, 100.0
#: the block vLLM's online ``fp8_per_block`` quantisation uses (kFp8Static128BlockSym / kFp8Dynamic128Sym)
VLLM_BLOCK = (128, 128)
VLLM_ACT_GROUP = 128

#: rollout dtypes of this stack: simulated on the hf engine / real in vLLM
BLOCKWISE_SIM = "fp8_blockwise_sim"
BLOCKWISE_VLLM = "fp8_blockwise"
KV_CACHE_CHOICES = ("none", "fp8")


class Recalibrate(Choice):
    """When the fp8 Q/K/V scales are computed: after every weight sync (the paper) or once."""

    per_step = "per_step"
    once = "once"


@dataclass(frozen=True)
class Fp8BlockwiseParams:
    """``precision.rollout_params`` of ``fp8_blockwise_sim`` / ``fp8_blockwise`` (FP8-RL, arXiv:2601.18150)."""

    weight_block: List[int] = param(factory=lambda: [128, 128],
                                    doc="[rows, cols] of a weight block sharing one scale amax/448 (DeepSeek-V3/veRL: 128x128)")
    act_group: int = param(128, "consecutive inputs of a token sharing one activation scale (veRL: 1x128)")


@dataclass(frozen=True)
class Fp8KvCacheParams:
    """``precision.kv_cache_params`` of ``precision.kv_cache=fp8`` (FP8-RL, arXiv:2601.18150; vLLM calculate_kv_scales)."""

    recalibrate: Recalibrate = param(Recalibrate.per_step,
                                     "per_step: scales from the first forward after every weight sync (the paper); once: from the first forward of the run")
    quantize_q: bool = param(True, "round the query to fp8 too (fp8 attention, as vLLM's FlashAttention-3 / FlashInfer fp8 paths do)")
    q_range: float = param(VLLM_Q_RANGE, "query scale = amax|q| / q_range (vLLM Q_SCALE_CONSTANT)")
    k_range: float = param(VLLM_K_RANGE, "key scale = amax|k| / k_range (vLLM K_SCALE_CONSTANT)")
    v_range: float = param(VLLM_V_RANGE, "value scale = amax|v| / v_range (vLLM V_SCALE_CONSTANT)")


#: rollout dtype -> its ``precision.rollout_params`` declaration
ROLLOUT_PARAMS: Dict[str, type] = {BLOCKWISE_SIM: Fp8BlockwiseParams, BLOCKWISE_VLLM: Fp8BlockwiseParams}


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` (already divided by its scale) saturated to ±448 and rounded to the e4m3 grid (torch.float8_e4m3fn)."""
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()


def fake_quant_fp8_blockwise(w: torch.Tensor, block: Tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Round a weight ``w`` ``[out, in]`` to fp8 e4m3 with one scale per ``block[0] x block[1]`` block.

    FP8-RL (arXiv:2601.18150) part (i), the DeepSeek-V3 / veRL block quantisation of weights:
    ``s_b = amax_b / 448`` over the block, ``q = e4m3(w / s_b) * s_b`` (ties to even, as
    ``torch.float8_e4m3fn`` casts). Edge blocks are partial (``out`` and ``in`` need not be
    multiples of the block); an all-zero block stays zero. Returns ``w``'s shape and dtype.

    Raises:
        ValueError: ``w`` not 2-D, or a block side < 1.
    """
    if w.dim() != 2:
        raise ValueError(f"blockwise fp8 quantises a 2-D weight [out, in], got shape {tuple(w.shape)}")
    br, bc = int(block[0]), int(block[1])
    if br < 1 or bc < 1:
        raise ValueError(f"fp8 weight block must be >= 1 x 1, got {br} x {bc}")
    wf = w.detach().float()
    o, i = wf.shape
    po, pi = (-o) % br, (-i) % bc
    padded = torch.nn.functional.pad(wf, (0, pi, 0, po))
    blocks = padded.reshape((o + po) // br, br, (i + pi) // bc, bc)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (_e4m3(blocks / scale) * scale).reshape(o + po, i + pi)[:o, :i]
    return q.to(w.dtype)


def fake_quant_fp8_token_groups(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Round activations ``x`` ``[..., in]`` to fp8 e4m3 with one dynamic scale per token and group of ``group`` inputs.

    FP8-RL (arXiv:2601.18150) part (i), the activation side of W8A8 (veRL: "1x128 quantization
    for activations"; vLLM's ``per_token_group_quant_fp8``): for every token ``t`` and group
    ``g`` of ``group`` consecutive inputs, ``s = amax / 448``, ``q = e4m3(x / s) * s``; the last
    group of a row may be shorter; an all-zero group stays zero. Returns ``x``'s shape and dtype.

    Raises:
        ValueError: ``group < 1``.
    """
    if group < 1:
        raise ValueError(f"fp8 activation group must be >= 1, got {group}")
    shape = x.shape
    xf = x.detach().float().reshape(-1, shape[-1])
    n = shape[-1]
    pad = (-n) % group
    g = torch.nn.functional.pad(xf, (0, pad)).reshape(xf.shape[0], -1, group)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (_e4m3(g / scale) * scale).reshape(xf.shape[0], -1)[:, :n]
    return q.reshape(shape).to(x.dtype)


def _decoder_linears(model: torch.nn.Module):
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and mod is not head:
            yield name, mod


def blockwise_w8a8_converter(params: Optional[Fp8BlockwiseParams] = None) -> Callable[[torch.nn.Module], torch.nn.Module]:
    """``fn(model) -> model``: every decoder linear (not the LM head) made a simulated blockwise W8A8 layer.

    The weight is replaced by :func:`fake_quant_fp8_blockwise` of itself (``params.weight_block``)
    and a forward pre-hook rounds the layer's input by :func:`fake_quant_fp8_token_groups`
    (``params.act_group``). Applied by the hf engine to its private copy at build and at every
    :meth:`~rlpost.rollout.hf.HFRolloutEngine.sync_weights` (the copy is rebuilt from the new trainer
    weights): the per-step re-quantisation of FP8-RL (arXiv:2601.18150). Embeddings, norms and the
    LM head stay full precision, as vLLM keeps ``lm_head`` unquantised.
    """
    p = params or Fp8BlockwiseParams()
    block = (int(p.weight_block[0]), int(p.weight_block[1]))
    group = int(p.act_group)

    def convert(model: torch.nn.Module) -> torch.nn.Module:
        with torch.no_grad():
            for _, lin in _decoder_linears(model):
                lin.weight.copy_(fake_quant_fp8_blockwise(lin.weight, block))
                lin.register_forward_pre_hook(
                    lambda mod, args: (fake_quant_fp8_token_groups(args[0], group),) + tuple(args[1:]))
        return model

    return convert


class Fp8KvCacheSim:
    """Simulated fp8 KV cache (and fp8 query) with per-layer scales recalibrated after each weight sync.

    FP8-RL (arXiv:2601.18150) part (ii). Scales follow vLLM's ``calculate_kv_scales``
    (``Attention.calc_kv_scales`` in vLLM <= 0.11, which FP8-RL's veRL stack runs): on the first
    forward pass a layer sees, ``s_q = amax|Q| / q_range``, ``s_k = amax|K| / k_range``,
    ``s_v = amax|V| / v_range`` (one scalar each per layer; ranges 200, 200, 100 by default);
    afterwards every call rounds ``Q``, ``K``, ``V`` (``[batch, heads, seq, head_dim]``, K and V
    after RoPE and the cache update, so the whole cache) to ``e4m3(x / s) * s``, saturating at
    ±448. Rounding an already rounded cache entry again with the same scale gives it back, so
    this equals storing the cache in fp8. The attention itself runs in the model's own
    implementation (``sdpa`` / ``eager``) on the rounded tensors.

    Our reading: the paper says "per-step QKV scale recalibration" without the calibration batch;
    we calibrate on the first forward after the sync, i.e. the prefill of the step's first
    rollout batch, as vLLM calibrates on the first forward after its flag is set. With
    ``recalibrate=once`` the scales of the run's first forward are kept across syncs (vLLM's
    behaviour without the per-step reset, the ablation).

    Use :meth:`install` on the rollout copy (the hf engine's converter does it, :func:`precision_converter`).
    ``scales[layer_idx] = (s_q, s_k, s_v)`` (floats) holds the current calibration; ``calibrations``
    counts how often a layer-0 calibration ran.
    """

    PREFIX = "rlpost_fp8kv_"

    def __init__(self, params: Optional[Fp8KvCacheParams] = None) -> None:
        self.params = params or Fp8KvCacheParams()
        self.scales: Dict[int, Tuple[float, float, float]] = {}
        self.calibrations = 0

    def reset(self) -> None:
        """Forget the scales: the next forward recalibrates (called at each rebuild with ``per_step``)."""
        self.scales = {}

    def quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """``x`` rounded to fp8 e4m3 with the per-tensor ``scale`` (returned in ``x``'s dtype and shape)."""
        return (_e4m3(x.float() / scale) * scale).to(x.dtype)

    def _scale(self, x: torch.Tensor, rng: float) -> float:
        amax = float(x.detach().abs().max()) if x.numel() else 0.0
        return amax / rng if amax > 0 else 1.0

    def attend(self, base: Callable, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               *args: Any, **kwargs: Any) -> Any:
        """The attention call with Q/K/V rounded; calibrates the layer's scales on its first call."""
        idx = int(getattr(module, "layer_idx", 0) or 0)
        if idx not in self.scales:
            p = self.params
            self.scales[idx] = (self._scale(query, float(p.q_range)), self._scale(key, float(p.k_range)),
                                self._scale(value, float(p.v_range)))
            if idx == 0:
                self.calibrations += 1
        sq, sk, sv = self.scales[idx]
        q = self.quantize(query, sq) if self.params.quantize_q else query
        return base(module, q, self.quantize(key, sk), self.quantize(value, sv), *args, **kwargs)

    def install(self, model: torch.nn.Module) -> torch.nn.Module:
        """Route ``model``'s attention through :meth:`attend` (a registered transformers attention
        implementation named ``rlpost_fp8kv_<base>`` wrapping the model's own ``<base>``).

        Raises:
            RlpostError: the model's attention implementation is unknown to transformers' interface.
        """
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        cfg = model.config
        base_name = getattr(cfg, "_attn_implementation", None) or "eager"
        if base_name.startswith(self.PREFIX):
            base_name = base_name[len(self.PREFIX):]
        if base_name == "eager":
            from transformers.models.llama.modeling_llama import eager_attention_forward as base
        elif base_name in ALL_ATTENTION_FUNCTIONS:
            base = ALL_ATTENTION_FUNCTIONS[base_name]
        else:
            raise RlpostError(f"precision.kv_cache=fp8 (simulated) wraps the model's attention, but its implementation "
                              f"{base_name!r} is not one transformers knows. Fix: model attn implementation sdpa or eager.")
        name = f"{self.PREFIX}{base_name}_{id(self)}"

        def fn(module, query, key, value, *args, **kwargs):
            return self.attend(base, module, query, key, value, *args, **kwargs)

        AttentionInterface.register(name, fn)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base_name])
        for sub in model.modules():
            c = getattr(sub, "config", None)
            if c is not None and getattr(c, "_attn_implementation", None) is not None:
                c._attn_implementation = name
        return model


def rollout_settings(precision: Any) -> Tuple[Optional[Fp8BlockwiseParams], str, Fp8KvCacheParams]:
    """``(rollout params or None, kv_cache, kv params)`` of a ``precision`` config section, checked.

    Raises:
        ConfigError: ``precision.rollout_params`` set for a rollout dtype that declares none, or a key
            its declaration lacks; ``precision.kv_cache`` not none | fp8; ``kv_cache_params`` without
            ``kv_cache=fp8`` or with an unknown key; a block side, group or range < 1 / <= 0.
    """
    get = (lambda k, d=None: precision.get(k, d)) if hasattr(precision, "get") else (lambda k, d=None: getattr(precision, k, d))
    rd = str(get("rollout_dtype", "fp32"))
    rp = as_dict(get("rollout_params"))
    kv = str(get("kv_cache", "none") or "none")
    kp = as_dict(get("kv_cache_params"))
    params = None
    if rd in ROLLOUT_PARAMS:
        params = resolve_params(ROLLOUT_PARAMS[rd], rp, "precision.rollout_params", f"rollout_dtype={rd}")
        wb = list(params.weight_block)
        if len(wb) != 2 or min(int(v) for v in wb) < 1:
            raise ConfigError(f"precision.rollout_params.weight_block={wb} must be [rows, cols] with both >= 1 "
                              "(the paper's 128x128: [128, 128]).")
        if int(params.act_group) < 1:
            raise ConfigError(f"precision.rollout_params.act_group={params.act_group} must be >= 1 (the paper's 128).")
    elif rp:
        raise ConfigError(f"precision.rollout_params={rp} but rollout_dtype={rd} takes none; they belong to "
                          f"{', '.join(ROLLOUT_PARAMS)}. Fix: drop precision.rollout_params, or set precision.rollout_dtype.")
    if kv not in KV_CACHE_CHOICES:
        raise ConfigError(f"precision.kv_cache={kv!r}: valid choices are {', '.join(KV_CACHE_CHOICES)}.")
    if kp and kv == "none":
        raise ConfigError(f"precision.kv_cache_params={kp} but precision.kv_cache=none. Fix: precision.kv_cache=fp8, "
                          "or drop the kv_cache_params.")
    kvp = resolve_params(Fp8KvCacheParams, kp, "precision.kv_cache_params", "kv_cache=fp8")
    for k in ("q_range", "k_range", "v_range"):
        if float(getattr(kvp, k)) <= 0:
            raise ConfigError(f"precision.kv_cache_params.{k}={getattr(kvp, k)} must be > 0 (scale = amax / {k}).")
    return params, kv, kvp


def check_precision_rollout(cfg: Any) -> None:
    """Config check (``GROUP_CHECKS``): ``precision.rollout_params`` / ``kv_cache`` / ``kv_cache_params``
    as :func:`rollout_settings`, and the vLLM-only / hf-only rollout dtypes on the right engine.

    Raises:
        ConfigError: as :func:`rollout_settings`; ``fp8_blockwise`` without ``rollout=vllm``;
            ``fp8_blockwise_sim`` with ``rollout=vllm``.
    """
    prec = cfg.precision
    params, _, _ = rollout_settings(prec)
    rd = str(prec.rollout_dtype)
    engine = str(cfg.rollout.engine)
    if rd == BLOCKWISE_VLLM and engine != "vllm":
        raise ConfigError("precision.rollout_dtype=fp8_blockwise is vLLM's real blockwise fp8 and needs rollout=vllm on a GPU. "
                          "Fix: add rollout=vllm, or use precision=rollout_fp8_blockwise_sim to simulate it on CPU.")
    if rd == BLOCKWISE_VLLM and params is not None and (tuple(int(v) for v in params.weight_block) != VLLM_BLOCK
                                                        or int(params.act_group) != VLLM_ACT_GROUP):
        raise ConfigError(f"vLLM's fp8_per_block quantisation has fixed 128x128 weight blocks and 1x128 activation groups; "
                          f"got weight_block={list(params.weight_block)}, act_group={params.act_group}. Fix: drop "
                          "precision.rollout_params, or simulate other sizes with rollout=hf precision.rollout_dtype=fp8_blockwise_sim.")


def precision_converter(precision: Any, base: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None
                        ) -> Optional[Callable[[torch.nn.Module], torch.nn.Module]]:
    """The hf engine's converter for this stack's settings of ``precision``, or None when it sets none of them.

    ``fp8_blockwise_sim``: :func:`blockwise_w8a8_converter` with ``precision.rollout_params``; otherwise
    ``base`` (the rollout dtype's own converter, or None for the plain fp32 copy). With
    ``precision.kv_cache=fp8`` an :class:`Fp8KvCacheSim` is installed after it; with
    ``recalibrate=per_step`` its scales are reset at every rebuild (each weight sync). The
    returned function carries the simulator as ``.kv_sim`` (None without a KV cache).

    Raises:
        ConfigError: as :func:`rollout_settings`.
    """
    params, kv, kvp = rollout_settings(precision)
    rd = str(precision.get("rollout_dtype") if hasattr(precision, "get") else precision.rollout_dtype)
    weights = blockwise_w8a8_converter(params) if rd == BLOCKWISE_SIM else base
    if kv == "none":
        return weights
    sim = Fp8KvCacheSim(kvp)

    def convert(model: torch.nn.Module) -> torch.nn.Module:
        if weights is not None:
            model = weights(model)
        if str(sim.params.recalibrate) == Recalibrate.per_step.value:
            sim.reset()
        return sim.install(model)

    convert.kv_sim = sim
    return convert


def vllm_fp8_kwargs(precision: Any, device: str, quant_methods: Collection[str] = (),
                    cache_fields: Collection[str] = (), cache_dtypes: Collection[str] = ()) -> Dict[str, Any]:
    """``vllm.LLM`` keyword arguments for this stack's settings of ``precision`` on vLLM platform ``device`` (pure).

    * ``rollout_dtype=fp8_blockwise``: ``quantization="fp8_per_block"``, vLLM's online blockwise
      fp8 (static 128x128 weight blocks quantised from the bf16 weights at load and at every
      ``reload_weights``, dynamic 1x128 activation groups): part (i) of FP8-RL (arXiv:2601.18150).
    * ``kv_cache=fp8``: ``kv_cache_dtype="fp8"`` (e4m3 on CUDA) and, where this vLLM's
      ``CacheConfig`` has it, ``calculate_kv_scales=True`` (scales from the first forward pass;
      the vLLM engine re-arms it after each weight push, part (ii)). A vLLM without
      ``calculate_kv_scales`` (0.12 and later removed it) gets ``kv_cache_dtype="fp8_per_token_head"``
      where offered: scales computed per token and head as the cache is written, so they follow
      every weight update by construction (our reading of "per-step recalibration" on such a vLLM).

    Args:
        precision: the ``precision`` config section.
        device: vLLM's platform, ``cuda`` or ``cpu``.
        quant_methods: this vLLM's ``--quantization`` names (``QUANTIZATION_METHODS``).
        cache_fields: this vLLM's ``CacheConfig`` field names.
        cache_dtypes: this vLLM's accepted ``kv_cache_dtype`` values (``CacheDType``).
    Returns:
        ``{}`` when neither is set, else the keys above.
    Raises:
        RlpostError: either on ``device="cpu"`` (vLLM's CPU backend has no fp8 GEMM; its fp8 KV cache
            has no scale calibration, so the cache would use unit scales); blockwise fp8 on a vLLM
            without ``fp8_per_block``; an fp8 KV cache on a vLLM with neither ``calculate_kv_scales``
            nor ``fp8_per_token_head``.
    """
    _, kv, _ = rollout_settings(precision)
    rd = str(precision.get("rollout_dtype") if hasattr(precision, "get") else precision.rollout_dtype)
    kw: Dict[str, Any] = {}
    if rd != BLOCKWISE_VLLM and kv == "none":
        return kw
    if device != "cuda":
        raise RlpostError(f"precision.rollout_dtype={rd} / kv_cache={kv} with rollout=vllm needs a CUDA GPU: vLLM's CPU "
                          "backend has no fp8 GEMM, and its fp8 KV cache (AVX-512/AMX) has no scale calibration (unit "
                          "scales). Fix: rollout=hf precision=rollout_fp8_blockwise_sim simulates both on CPU.")
    if rd == BLOCKWISE_VLLM:
        if "fp8_per_block" not in quant_methods:
            raise RlpostError("precision.rollout_dtype=fp8_blockwise needs vLLM's online blockwise fp8 "
                              "(quantization='fp8_per_block'), which this vLLM lacks. Fix: pip install -U vllm, "
                              "or precision=rollout_fp8 (per-tensor scales).")
        kw["quantization"] = "fp8_per_block"
    if kv == "fp8":
        if "calculate_kv_scales" in cache_fields:
            kw.update(kv_cache_dtype="fp8", calculate_kv_scales=True)
        elif "fp8_per_token_head" in cache_dtypes:
            kw["kv_cache_dtype"] = "fp8_per_token_head"
        else:
            raise RlpostError("precision.kv_cache=fp8 needs calibrated fp8 KV scales: vLLM's calculate_kv_scales or "
                              "kv_cache_dtype='fp8_per_token_head'; this vLLM has neither. Fix: pip install -U vllm, "
                              "or precision.kv_cache=none.")
    return kw


def vllm_features() -> Tuple[List[str], List[str], List[str]]:
    """``(quant_methods, cache_fields, cache_dtypes)`` of the installed vLLM, for :func:`vllm_fp8_kwargs`
    (empty lists when vLLM is not importable)."""
    import typing

    try:
        from vllm.config.cache import CacheConfig, CacheDType
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    except Exception:  # noqa: BLE001 - no vLLM, or one laid out differently: no features
        return [], [], []
    fields = [f.name for f in dataclasses.fields(CacheConfig)] if dataclasses.is_dataclass(CacheConfig) else \
        list(getattr(CacheConfig, "model_fields", {}) or vars(CacheConfig).get("__annotations__", {}))
    return list(QUANTIZATION_METHODS), fields, list(typing.get_args(CacheDType))


def online_fp8_name(quant_methods: Collection[str]) -> str:
    """vLLM's ``--quantization`` name for per-tensor fp8 quantised online from a bf16 checkpoint (pure).

    vLLM 0.32 moved online quantisation to shorthand names: ``quantization="fp8"`` now means an
    fp8-serialised checkpoint and refuses a bf16 one ("no longer supports online quantization"),
    and ``fp8_per_tensor`` is the online per-tensor method (static per-tensor weight scales computed
    at load and at every ``reload_weights``, dynamic activation scales). Older vLLMs have no
    shorthand and quantise online under ``fp8``.

    Args:
        quant_methods: this vLLM's ``QUANTIZATION_METHODS`` (:func:`vllm_features`; empty without vLLM).
    Returns:
        ``"fp8_per_tensor"`` where this vLLM offers it, else ``"fp8"``.
    """
    return "fp8_per_tensor" if "fp8_per_tensor" in quant_methods else "fp8"


def kv_kwargs_for(precision: Any, device: str) -> Dict[str, Any]:
    """:func:`vllm_fp8_kwargs` with the installed vLLM's features (vLLM is imported only when the stack is asked for)."""
    _, kv, _ = rollout_settings(precision)
    rd = str(precision.get("rollout_dtype") if hasattr(precision, "get") else precision.rollout_dtype)
    if rd != BLOCKWISE_VLLM and kv == "none":
        return {}
    q, f, d = vllm_features()
    return vllm_fp8_kwargs(precision, device, q, f, d)
