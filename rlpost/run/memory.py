"""Per-GPU memory budget of a run, checked before anything loads.

:func:`estimate` adds up, in bytes per GPU, what a run keeps on one device:
the trainer's policy (fp32 master weights: ``precision=bf16`` is autocast over
fp32 weights in rlpost), its gradients and AdamW state under the chosen ZeRO
stage (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", arXiv:1910.02054: stage 1 partitions optimizer state,
stage 2 also gradients, stage 3 also parameters), ZeRO-3's full-weight copy
kept for rollouts and checkpoints, the KL reference model, the critic (same
ZeRO stage: it is a DeepSpeed engine of its own), LoRA adapters if the config
has them, activations of one micro-batch, and the rollout engine (vLLM's
``gpu_memory_utilization`` share, or the hf engine's rollout copy and KV cache).

:func:`check` compares the estimate against the device and, when it cannot fit,
raises :class:`rlpost.core.errors.ConfigError` naming the largest items and the
cheapest single change that makes it fit (re-estimated, not guessed).
``docs/SCALING.md`` gives the numbers for Qwen3-8B and Qwen2.5-7B.

Choices the sources leave open (stated here): activation memory per layer
without recomputation is 34·s·b·h bytes in 16-bit (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198, Eq. 2, without the attention-score term since SDPA/flash
attention does not materialise it); with gradient checkpointing one 2-byte
hidden state per layer plus one layer's full activations. vLLM needs its
weights, KV cache for at least one ``max_model_len`` sequence and about 2 GiB
of activations and CUDA graphs inside its share. A CUDA context and allocator
slack of 2 GiB per GPU are reserved. The estimate is an upper-bound-style model
for planning, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from rlpost.core.errors import ConfigError

GiB = 1024 ** 3
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "fp8_sim": 2, "fp4_sim": 2, "fp8_blockwise": 1, "fp8_blockwise_sim": 2}
RESERVED = 2 * GiB  # CUDA context + allocator fragmentation per GPU
VLLM_OVERHEAD = 2 * GiB  # vLLM activations, sampler buffers and CUDA graphs inside its share


@dataclass
class ModelShape:
    """What memory depends on in a decoder-only transformer's config.

    Attributes:
        params: total parameter count (embedding and, when untied, LM head included).
        embed_params: parameters of the input embedding.
        head_params: parameters of the LM head (0 when tied to the embedding).
        layers, hidden, intermediate, heads, kv_heads, head_dim, vocab: the config's sizes.
        max_position_embeddings: the model's context length.
    """

    params: int
    embed_params: int
    head_params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_position_embeddings: int

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes per token: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def shape_from_config(config: Any) -> ModelShape:
    """:class:`ModelShape` of a Llama/Qwen2/Qwen3-family Hugging Face config, counted analytically.

    Per layer: q/k/v/o projections (+ biases when ``attention_bias`` or Qwen2's
    q/k/v biases), the gated MLP (3 x hidden x intermediate), two RMSNorms, and
    Qwen3's q/k norms (``head_dim`` each); plus the embedding, a final norm and an
    untied LM head.

    Raises:
        ConfigError: the config lacks a field this count needs.
    """
    g = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    try:
        h, inter, L = int(g("hidden_size")), int(g("intermediate_size")), int(g("num_hidden_layers"))
        nh = int(g("num_attention_heads"))
        nkv = int(g("num_key_value_heads") or nh)
        hd = int(g("head_dim") or h // nh)
        vocab = int(g("vocab_size"))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"cannot size the model from its config ({e}); it needs hidden_size, intermediate_size, "
                          "num_hidden_layers, num_attention_heads and vocab_size.") from None
    mt = str(g("model_type", "") or "")
    q, kv = h * nh * hd, h * nkv * hd
    attn = q + 2 * kv + nh * hd * h
    if mt == "qwen2" or g("attention_bias", False):
        attn += nh * hd + 2 * nkv * hd  # q/k/v biases
    norms = 2 * h + (2 * hd if mt in ("qwen3", "qwen3_moe") else 0)
    per_layer = attn + 3 * h * inter + norms
    embed = vocab * h
    head = 0 if g("tie_word_embeddings", False) else vocab * h
    return ModelShape(params=L * per_layer + embed + head + h, embed_params=embed, head_params=head, layers=L,
                      hidden=h, intermediate=inter, heads=nh, kv_heads=nkv, head_dim=hd, vocab=vocab,
                      max_position_embeddings=int(g("max_position_embeddings", 4096) or 4096))


def lora_params(shape: ModelShape, rank: int, targets: List[str]) -> int:
    """Adapter parameters of LoRA (Hu et al., arXiv:2106.09685): ``rank x (in + out)`` per targeted projection."""
    h, i, q, kv = shape.hidden, shape.intermediate, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    return shape.layers * sum(rank * sum(dims[t]) for t in targets if t in dims)


@dataclass
class Budget:
    """Bytes per GPU, by item and by phase.

    Attributes:
        items: ``{name: bytes}`` of everything resident or peaking on one GPU.
        train_peak: bytes during the update (vLLM asleep: weights offloaded, KV cache freed).
        rollout_peak: bytes during generation (trainer state stays resident).
        vllm_share: bytes vLLM reserves (``gpu_memory_utilization`` x device), 0 without vLLM.
        vllm_need: bytes vLLM needs inside its share (weights, one max-length sequence of
            KV cache, overhead), 0 without vLLM.
        device_bytes: the device's memory.
        notes: assumptions worth printing.
    """

    items: Dict[str, int]
    train_peak: int
    rollout_peak: int
    vllm_share: int
    vllm_need: int
    device_bytes: int
    notes: List[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        """The larger of the two phases."""
        return max(self.train_peak, self.rollout_peak)

    def problems(self) -> List[str]:
        """Why the run cannot fit ([] when it fits)."""
        out = []
        if self.vllm_share and self.vllm_need > self.vllm_share:
            out.append(f"vLLM needs {self.vllm_need / GiB:.1f} GiB (weights, one max_model_len sequence of KV cache, "
                       f"overhead) but rollout.gpu_memory_utilization gives it {self.vllm_share / GiB:.1f} GiB")
        if self.peak > self.device_bytes:
            phase = "rollout" if self.rollout_peak >= self.train_peak else "update"
            out.append(f"the {phase} phase needs {self.peak / GiB:.1f} GiB per GPU of {self.device_bytes / GiB:.1f} GiB")
        return out

    def table(self) -> str:
        """A printable table of the items and phases, in GiB."""
        rows = [f"  {k:<34s} {v / GiB:8.2f} GiB" for k, v in self.items.items() if v]
        rows.append(f"  {'= update phase (vLLM asleep)':<34s} {self.train_peak / GiB:8.2f} GiB")
        rows.append(f"  {'= rollout phase':<34s} {self.rollout_peak / GiB:8.2f} GiB")
        if self.vllm_share:
            rows.append(f"  {'vLLM share / need':<34s} {self.vllm_share / GiB:8.2f} / {self.vllm_need / GiB:.2f} GiB")
        rows.append(f"  {'device':<34s} {self.device_bytes / GiB:8.2f} GiB -> "
                    + ("fits" if not self.problems() else "DOES NOT FIT"))
        return "\n".join(rows + [f"  note: {n}" for n in self.notes])



def _gpu_dtype(prec: Any, key: str) -> str:
    """``precision.<key>`` as a GPU run resolves it: ``auto`` is bf16 there (every GPU this budget
    is for supports it; :func:`rlpost.core.autoprecision.resolve_precision` makes that choice at start)."""
    v = str(_get(prec, key, "fp32") or "fp32")
    return "bf16" if v == "auto" else v

def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    if isinstance(node, dict):
        return node.get(key, default)
    try:
        return node.get(key, default)  # DictConfig
    except AttributeError:
        return getattr(node, key, default)


def estimate(cfg: Any, shape: ModelShape, device_bytes: int, world_size: Optional[int] = None,
             prompt_tokens: int = 512) -> Budget:
    """The per-GPU :class:`Budget` of ``cfg`` for a model of ``shape`` on a device of ``device_bytes``.

    Args:
        cfg: run config (``precision``, ``trainer``, ``algo.kl.coef``,
            ``algo.critic.enabled``, ``rollout``, ``model.gradient_checkpointing``,
            optional ``model.lora.{rank,target_modules}``).
        shape: from :func:`shape_from_config`.
        device_bytes: memory of one GPU.
        world_size: data-parallel GPUs (default ``trainer.num_procs``).
        prompt_tokens: prompt length assumed for activations and the hf engine's KV cache.
    Returns:
        a :class:`Budget`; nothing is allocated.
    """
    P = shape.params
    t, prec, r, a = cfg.trainer, cfg.precision, cfg.rollout, cfg.algo
    world = int(world_size or _get(t, "num_procs", 1) or 1)
    deepspeed = _get(t, "engine", "torch") == "deepspeed"
    stage = int(_get(t, "zero_stage", 0)) if deepspeed else 0
    offload = bool(_get(t, "offload_optimizer", False)) and deepspeed
    lora = _get(cfg.model, "lora", None)
    lora_rank = int(_get(lora, "rank", 0) or 0)
    notes: List[str] = []

    def shard(n: int, from_stage: int) -> int:
        return n // world if stage >= from_stage else n

    items: Dict[str, int] = {}
    if lora_rank > 0:
        targets = list(_get(lora, "target_modules", None) or ["q_proj", "k_proj", "v_proj", "o_proj"])
        trainable = lora_params(shape, lora_rank, targets)
        items["policy weights (fp32)"] = shard(4 * (P + trainable), 3)
        notes.append(f"LoRA rank {lora_rank} on {','.join(targets)}: {trainable / 1e6:.1f}M trainable parameters")
    else:
        trainable = P
        items["policy weights (fp32)"] = shard(4 * P, 3)
    if stage == 3:
        items["ZeRO-3 full-weight policy copy"] = 4 * P
        items["ZeRO-3 gather (one layer)"] = 4 * (P - shape.embed_params - shape.head_params) // max(1, shape.layers)
    items["policy gradients (fp32)"] = shard(4 * trainable, 2)
    items["policy AdamW state (fp32 m, v)"] = 0 if offload else shard(8 * trainable, 1)
    if float(_get(_get(a, "kl", None), "coef", 0.0) or 0.0) > 0:
        items["KL reference (fp32)"] = 0 if lora_rank > 0 else 4 * P
    if bool(_get(_get(a, "critic", None), "enabled", False)):
        C = P - shape.head_params + shape.hidden + 1  # ValueModel: backbone + scalar head
        items["critic weights (fp32)"] = shard(4 * C, 3)
        items["critic gradients"] = shard(4 * C, 2)
        items["critic AdamW state"] = 0 if offload else shard(8 * C, 1)
    # activations of one micro-batch (training)
    mbs = int(_get(t, "micro_batch_size", 1) or 1)
    s = prompt_tokens + int(_get(r, "max_new_tokens", 64) or 64)
    act_bytes = 2 if _gpu_dtype(prec, "trainer_dtype") in ("bf16", "fp16") else 4
    if bool(_get(cfg.model, "gradient_checkpointing", False)):
        act = shape.layers * s * mbs * shape.hidden * act_bytes + 34 * s * mbs * shape.hidden * act_bytes // 2
    else:
        act = shape.layers * 34 * s * mbs * shape.hidden * act_bytes // 2
    chunk = int(_get(t, "logprob_chunk_size", 64) or 64)
    act += 3 * 4 * mbs * min(chunk, s) * shape.vocab  # fp32 logits, log-softmax and its gradient for one chunk
    items["activations (one micro-batch)"] = act
    if act_bytes == 2:
        # torch.autocast caches the 16-bit cast of every fp32 weight it uses until the forward/backward ends
        items["autocast 16-bit weight casts"] = 2 * P if stage < 3 else 2 * (P - shape.embed_params) // shape.layers
    trainer_resident = sum(v for k, v in items.items() if not k.startswith("activations") and "gradients" not in k
                           and "gather" not in k and "autocast" not in k)
    train_transient = items["activations (one micro-batch)"] + items["policy gradients (fp32)"] + \
        items.get("critic gradients", 0) + items.get("ZeRO-3 gather (one layer)", 0) + \
        items.get("autocast 16-bit weight casts", 0)

    vllm_share = vllm_need = 0
    rd = _gpu_dtype(prec, "rollout_dtype")
    if _get(r, "engine", "hf") == "vllm":
        util = float(_get(r, "gpu_memory_utilization", 0.4))
        vllm_share = int(util * device_bytes)
        mml = int(_get(r, "max_model_len", None) or shape.max_position_embeddings)
        w = P * DTYPE_BYTES.get(rd, 2)
        kv_min = mml * shape.kv_bytes_per_token(2)
        vllm_need = w + kv_min + VLLM_OVERHEAD
        items["vLLM share (gpu_memory_utilization)"] = vllm_share
        notes.append(f"vLLM: weights {w / GiB:.1f} GiB, one {mml}-token sequence of KV cache {kv_min / GiB:.2f} GiB, "
                     f"KV cache left for batching {(vllm_share - w - VLLM_OVERHEAD) / GiB:.1f} GiB "
                     f"({max(0, vllm_share - w - VLLM_OVERHEAD) // shape.kv_bytes_per_token(2):,} tokens)")
        rollout_engine = vllm_share
        asleep = 0  # level-1 sleep: weights offloaded to CPU, KV cache discarded
    else:
        share = rd == "fp32" and not offload
        copy = 0 if share else P * DTYPE_BYTES.get(rd, 2)
        B = int(_get(r, "batch_size", 64) or 64)
        kv = B * s * shape.kv_bytes_per_token(DTYPE_BYTES.get(rd, 2) if rd in ("bf16", "fp16") else 4)
        items["hf rollout copy"] = copy
        items["hf KV cache (rollout batch)"] = kv
        rollout_engine = kv
        asleep = copy
    train_peak = trainer_resident + train_transient + asleep + RESERVED
    rollout_peak = trainer_resident + rollout_engine + RESERVED
    items["CUDA context + slack"] = RESERVED
    return Budget(items=items, train_peak=train_peak, rollout_peak=rollout_peak, vllm_share=vllm_share,
                  vllm_need=vllm_need, device_bytes=int(device_bytes), notes=notes)


def _with(cfg: Any, **changes: Any) -> Any:
    """A copy of ``cfg`` (DictConfig or plain) with dotted ``changes`` applied."""
    from omegaconf import OmegaConf

    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else cfg)
    for k, v in changes.items():
        OmegaConf.update(c, k.replace("__", "."), v, force_add=True)
    return c


def _fit_util(cfg: Any, shape: ModelShape, device_bytes: int, world: int) -> Tuple[bool, Optional[float]]:
    """``(fits, vLLM share to use)``: the current share if it fits, else the largest that does (None: keep it)."""
    if not estimate(cfg, shape, device_bytes, world).problems():
        return True, None
    if _get(cfg.rollout, "engine", "hf") != "vllm":
        return False, None
    for u in [x / 100 for x in range(95, 4, -1)]:
        if not estimate(_with(cfg, rollout__gpu_memory_utilization=u), shape, device_bytes, world).problems():
            return True, u
    return False, None


def cheapest_fix(cfg: Any, shape: ModelShape, device_bytes: int, world_size: Optional[int] = None) -> Optional[str]:
    """The cheapest set of overrides after which :func:`estimate` fits; None if none found.

    Changes are added one at a time, cumulatively, in order of what they cost the
    run (re-estimated after each): a different vLLM share; ``rollout.max_model_len``
    (when unset); ``precision=bf16`` (when fp32); a higher ZeRO stage (several
    GPUs); gradient checkpointing; halving ``trainer.micro_batch_size`` down to 1;
    optimizer offload; ZeRO-3 on more GPUs.
    """
    world = int(world_size or _get(cfg.trainer, "num_procs", 1) or 1)
    steps: List[Tuple[str, Dict[str, Any]]] = []
    if _get(cfg.rollout, "engine", "hf") == "vllm" and not _get(cfg.rollout, "max_model_len", None):
        steps.append(("rollout.max_model_len=4096", {"rollout__max_model_len": 4096}))
    if _gpu_dtype(cfg.precision, "rollout_dtype") == "fp32" or _gpu_dtype(cfg.precision, "trainer_dtype") == "fp32":
        steps.append(("precision=bf16", {"precision__rollout_dtype": "bf16", "precision__trainer_dtype": "bf16"}))
    stage = int(_get(cfg.trainer, "zero_stage", 0)) if _get(cfg.trainer, "engine", "torch") == "deepspeed" else -1
    if world > 1:
        for st in range(max(stage + 1, 1), 4):
            steps.append((f"trainer=deepspeed trainer.zero_stage={st}", {"trainer__engine": "deepspeed",
                                                                        "trainer__zero_stage": st}))
    if not _get(cfg.model, "gradient_checkpointing", False):
        steps.append(("model.gradient_checkpointing=true", {"model__gradient_checkpointing": True}))
    mbs = int(_get(cfg.trainer, "micro_batch_size", 1) or 1)
    while mbs > 1:
        mbs //= 2
        steps.append((f"trainer.micro_batch_size={mbs}", {"trainer__micro_batch_size": mbs}))
    steps.append(("trainer=deepspeed trainer.zero_stage=3 trainer.offload_optimizer=true",
                  {"trainer__engine": "deepspeed", "trainer__zero_stage": 3, "trainer__offload_optimizer": True}))
    for n in (2, 4, 8, 16, 32, 64):
        if n > world:
            steps.append((f"{n} GPUs (trainer.num_procs={n} on one node, or DeepSpeed's launcher across nodes)",
                          {"trainer__num_procs": n}))
    c, applied, w = cfg, [], world
    for text, ch in [("", {})] + steps:
        if ch:
            c = _with(c, **ch)
            w = int(ch.get("trainer__num_procs", w))
            # a later, stronger step replaces earlier ones it covers (zero_stage 2 -> 3, micro-batch 8 -> 4, 2 -> 4 GPUs)
            applied = [(t, k) for t, k in applied if not k <= set(ch)] + [(text, set(ch))]
        ok, u = _fit_util(c, shape, device_bytes, w)
        if ok:
            out = [t for t, _ in applied]
            if u is not None:
                out.append(f"rollout.gpu_memory_utilization={u:.2f}")
            return " ".join(out) if out else None
    return None


def check(cfg: Any, shape: ModelShape, device_bytes: int, world_size: Optional[int] = None) -> Budget:
    """:func:`estimate`, raising when the run cannot fit.

    Raises:
        ConfigError: one line: what does not fit, the three largest items, and the
            cheapest fix (:func:`cheapest_fix`).
    """
    b = estimate(cfg, shape, device_bytes, world_size)
    probs = b.problems()
    if probs:
        top = sorted(((v, k) for k, v in b.items.items() if "context" not in k), reverse=True)[:3]
        big = ", ".join(f"{k} {v / GiB:.1f} GiB" for v, k in top)
        fix = cheapest_fix(cfg, shape, device_bytes, world_size)
        raise ConfigError(f"This run does not fit in GPU memory: {'; '.join(probs)} (largest: {big}). "
                          f"Fix: {fix or 'a smaller model, or more GPUs with trainer=deepspeed trainer.zero_stage=3'} "
                          "(see docs/SCALING.md).")
    return b


def preflight(cfg: Any, device: Any) -> Optional[Budget]:
    """Check the budget of ``cfg`` on ``device`` before the model loads; None when there is nothing to check.

    Only on CUDA devices, and only when the model's config can be read locally
    (hub presets read ``config.json`` from the Hugging Face cache or ``model.path``;
    without it the check is skipped, and loading the model would fail anyway).

    Raises:
        ConfigError: the run cannot fit (:func:`check`).
    """
    import torch

    if getattr(device, "type", str(device)) != "cuda":
        return None
    try:
        from rlpost.models.loader import resolve_model_dir
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(resolve_model_dir(cfg.model))
    except Exception:  # noqa: BLE001 - no local config: nothing to size
        return None
    if cfg.model.source == "tiny":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return check(cfg, shape_from_config(hf), total)
