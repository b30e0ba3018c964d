"""GPU check for the flagship path, in two parts, each printing PASS/FAIL lines with their thresholds.

    python scripts/gpu_check.py --dry-run          # CPU: the plan, the memory estimates, every check on a tiny model
    python scripts/gpu_check.py --part hf          # one NVIDIA GPU, no vLLM: torch + transformers (+ DeepSpeed)
    python scripts/gpu_check.py --part vllm        # a GPU machine with vLLM installed
    python scripts/gpu_check.py --part agent       # multi-turn episodes through vLLM (--dry-run: hf engine on CPU)
    python scripts/gpu_check.py --part ray         # launcher=ray: 2 vLLM rollout workers as Ray actors (--dry-run: hf, CPU)
    python scripts/gpu_check.py --part dp          # N-way data-parallel rollouts, a vLLM engine per GPU (--dry-run: 2 CPU ranks)
    python scripts/gpu_check.py --part lora        # LoRA: update, push to vLLM's LoRA path, parity (--dry-run: hf, CPU)
    python scripts/gpu_check.py --part spec        # vLLM speculative rollouts (ngram, fp8 self-draft; mtp refused)
    python scripts/gpu_check.py --part fp8         # FP8-RL stack: vLLM fp8_per_block + fp8 KV cache (--dry-run: hf sim, CPU)
    python scripts/gpu_check.py --part device_map  # launcher.device_mapping: workers pinned to mapped GPUs (--dry-run: CPU)

Part ``hf`` needs only PyTorch, transformers, safetensors, tokenizers and the small
wheels rlpost's config needs (hydra-core, omegaconf, antlr4-python3-runtime;
DeepSpeed and pydantic for the DeepSpeed check, skipped when absent). No
network, no dataset, no task package: models are random-initialised from real
architectures' configs (Qwen3-8B's shape, :data:`SHAPES`), prompts are random
token ids, and the tokenizer is a word-level ``tokenizers`` model over the
vocabulary. It runs

1. the memory budget (:mod:`rlpost.run.memory`) of the check's own configuration
   against this GPU, and of the flagship ``algo=sao model=qwen3-8b`` on 8 x 80 GB;
2. the hf rollout engine on the full 36-layer Qwen3-8B shape in bf16:
   generation tokens/s;
3. the torch trainer (bf16 autocast, fp32 master weights, AdamW) on the
   Qwen3-8B shape with as many of its layers as the budget fits: update tokens/s,
   MFU (6 x non-embedding params x tokens / time / 989 TFLOP/s, the H100/H200
   datasheet's dense bf16 rate), peak memory beside the estimate;
4. weight push parity: the engine's log-probs of a fixed response before and
   after :meth:`sync_weights` against the trainer's (the push must move the
   engine from the old to the new weights);
5. SAO's critic (value model) on the GPU: value pass and a critic update;
6. DeepSpeed ZeRO-2 (one process) on the same batch, when DeepSpeed imports.

Part ``vllm`` builds rlpost's vLLM engine on a saved random Qwen3 model and checks
that a push changes vLLM's log-probs to within tolerance of the trainer's, for
bf16 and fp8 (the fp8 path is vLLM's worker reload), and prints tokens/s.

Part ``agent`` runs multi-turn episodes (``sampler=episode``, an environment that answers every turn)
through the vLLM engine, one call per turn inside the engine's session: every call's token-id prompt
and every row must be token-exact, the trainer's log-probs of the model tokens (environment tokens
attended to) must match vLLM's, and turns 2+ must hit vLLM's prefix cache. ``--dry-run --part agent``
runs the same check with the hf engine on CPU.

Part ``ray`` runs ``launcher=ray`` (:class:`rlpost.ray_pool.ray_workers.RayRolloutPool`) on one node: a local
Ray cluster, 2 rollout workers (vLLM on the GPU; ``--dry-run``: the hf engine on CPU), the trainer in this
process. On one GPU the workers share it (``gpus_per_worker=0.4``, weights through the object store); with
3+ GPUs each worker gets its own (``gpus_per_worker=1``, weights broadcast over NCCL). Checks: the groups are
split evenly, the workers' log-probs match the trainer's, a push moves them to the updated weights (stale
gap >= 3 x the gap after), and a worker killed during a generate call loses no row. Prints tokens/s, push
seconds and this process's peak GPU memory.

Part ``device_map`` (:func:`part_device_map`) checks ``launcher.device_mapping`` (ROLL, arXiv:2506.06122) on
this node: the mapping validated against the real device count (an id equal to it refused), the trainer on
the actor's device, each rollout worker started with its mapped device alone visible (device UUID / PCI bus
id compared with the driver's view of that id), the weight-sync mode the plan implies (NCCL only when every
worker has a device of its own), and one generate call on the pinned workers (log-probs vs the trainer).
Toy Qwen3 shape, hf engine, fp32; 1 GPU: colocated on device 0, 2: rollout on 1, 3+: rollout on 1 and 2.

Part ``dp`` (:func:`part_dp`) runs N ranks (``python -m torch.distributed.run``, as ``trainer.num_procs=N`` does; N =
the visible GPUs, at most ``--world``), each with one vLLM engine on its own GPU, and one step's ``generate`` call
through :class:`rlpost.distributed.ShardedEngine`: rows token-exact against one engine with the same per-row
seeds, every group on one rank, the gathered result identical, complete and in order on every rank; prints
tokens/s per rank and in total, step time and peak GPU memory per rank. It does no update: the
``model=qwen3-8b`` step is part ``hf``'s. ``--dry-run``: 2 CPU ranks, the hf engine, gloo.

Part ``lora`` (:func:`part_lora`) builds the policy with PEFT adapters, runs one update (only adapter
tensors change), pushes the adapter to the vLLM engine's LoRA path and checks vLLM's log-probs of a fixed
batch against the trainer's merged-weight log-probs (part ``vllm``'s tolerance) and the KL reference
(adapters disabled) against the base model; prints step time, tokens/s, peak memory. ``--dry-run``: the hf
engine with merged weights on CPU.

Parts ``dp`` and ``lora`` have only been run as ``--dry-run``; no GPU was available when they were written.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

GiB = 1024 ** 3
BF16_PEAK = 989e12  # dense bf16 FLOP/s, H100/H200 SXM datasheet

# config.json fields of the real models (Hugging Face hub), enough to build them with random weights
SHAPES: Dict[str, Dict[str, Any]] = {
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False),
    # the dry run's CPU stand-in: Qwen3's architecture at toy size
    "qwen3-tiny": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                       max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False),
}

RESULTS: List[Dict[str, Any]] = []


def report(name: str, ok: bool, detail: str, **figures: Any) -> None:
    """Print one PASS/FAIL line and keep it for the JSON summary."""
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    RESULTS.append({"check": name, "pass": bool(ok), "detail": detail, **figures})


@contextlib.contextmanager
def guard(name: str):
    """Run one check; an exception is reported as its FAIL line and the next check still runs."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - a GPU check reports every failure and carries on
        import traceback

        traceback.print_exc()
        report(name, False, f"raised {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def hf_config(shape: str, layers: Optional[int] = None):
    from transformers import AutoConfig

    kw = dict(SHAPES[shape])
    mt = kw.pop("model_type")
    if layers:
        kw["num_hidden_layers"] = int(layers)
    return AutoConfig.for_model(mt, **kw)


def build_model(shape: str, layers: Optional[int], dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A random-initialised causal LM of ``shape`` (optionally with fewer layers), built directly on ``device``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(shape, layers), dtype=dtype)
    model.config.use_cache = True
    return model


def word_tokenizer(vocab: int):
    """A real (word-level) fast tokenizer over ``vocab`` ids; id 0 is EOS/pad."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", pad_token="t0", unk_token="t1")


def grouped_prompts(B: int, P: int, G: int, V: int) -> List[List[int]]:
    """``B`` prompt rows in ``B // G`` groups of ``G`` identical random prompts of ``P`` ids in
    ``[2, V)`` (0 and 1 are EOS/pad and unk), the same on every call and every rank (seed 0)."""
    g = torch.Generator().manual_seed(0)
    uniq = [torch.randint(2, V, (P,), generator=g).tolist() for _ in range(B // G)]
    return [p for p in uniq for _ in range(G)]


def rl_config(overrides: List[str]):
    from rlpost.config.compose import compose_config

    return compose_config(["model=tiny", "logger=none", "algo=grpo", "algo.kl.coef=0", *overrides])


def batch_from(gen, group: int = 4):
    """A RolloutBatch from a GenerationResult with a fixed advantage per group (so the update moves weights)."""
    from rlpost.core.batch import RolloutBatch

    B = gen.response_ids.shape[0]
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(B, generator=g)[:, None].expand_as(gen.response_mask) * gen.response_mask
    return RolloutBatch(prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, response_ids=gen.response_ids,
                        response_mask=gen.response_mask, rollout_logprobs=gen.rollout_logprobs,
                        group_index=torch.arange(B) // group, prompt_index=torch.arange(B) // group,
                        policy_version=torch.zeros(B, dtype=torch.long),
                        extras={"advantages": adv, "temperatures": gen.temperatures})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else float("nan")


def reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def masked_abs_mean(a: torch.Tensor, b: torch.Tensor, m: torch.Tensor) -> float:
    return float(((a - b).abs() * m).sum() / m.sum().clamp(min=1))


# --------------------------------------------------------------------------- plan and budget
def budget_section(device_bytes: int, shape: str, layers: int, overrides: List[str]) -> Any:
    from rlpost.run.memory import check, estimate, shape_from_config

    print(f"\n== memory budget: {shape} with {layers} layers on this device ({device_bytes / GiB:.1f} GiB)")
    s = shape_from_config(hf_config(shape, layers).to_dict())
    b = estimate(rl_config(overrides), s, device_bytes, world_size=1)
    print(b.table())
    print("\n== memory budget: algo=sao model=qwen3-8b rollout=vllm trainer=deepspeed (8 x 80 GiB)")
    full = shape_from_config(hf_config("qwen3-8b").to_dict())
    flag = ["algo=sao", "rollout=vllm", "trainer=deepspeed", "trainer.num_procs=8"]
    try:
        check(rl_config(flag), full, 80 * GiB, world_size=8)
        print("  fits as typed")
    except Exception as e:  # noqa: BLE001 - the error text is the figure here
        print(f"  as typed: {e}")
    good = flag + ["precision=bf16", "trainer.zero_stage=3", "model.gradient_checkpointing=true",
                   "trainer.micro_batch_size=4", "rollout.gpu_memory_utilization=0.3"]
    print("  with " + " ".join(good[4:]) + ":")
    print(estimate(rl_config(good), full, 80 * GiB, world_size=8).table())
    return b


def layers_that_fit(device_bytes: int, shape: str, overrides: List[str]) -> int:
    """The most layers of ``shape`` whose trainer + hf-engine budget fits ``device_bytes`` (at least 1)."""
    from rlpost.run.memory import estimate, shape_from_config

    full = int(SHAPES[shape]["num_hidden_layers"])
    cfg = rl_config(overrides)
    for n in range(full, 0, -1):
        s = shape_from_config(hf_config(shape, n).to_dict())
        if not estimate(cfg, s, device_bytes, world_size=1).problems():
            return n
    return 1


# --------------------------------------------------------------------------- part hf
def part_hf(device: torch.device, shape: str, dry: bool) -> None:
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine
    from rlpost.trainer.torch_engine import TorchTrainer

    B, P, R = (8, 8, 8) if dry else (64, 128, 128)
    mbs = 4 if dry else 8
    overrides = ["precision=bf16", f"trainer.micro_batch_size={mbs}", "trainer.lr=1e-3", "trainer.grad_clip=0",
                 "algo.mini_batches=1", "algo.ppo_epochs=1", f"rollout.batch_size={B}", f"rollout.max_new_tokens={R}",
                 "trainer.logprob_chunk_size=128", "steps=10"]
    dev_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 141 * GiB
    n_layers = layers_that_fit(int(0.8 * dev_bytes), shape, overrides)  # 20% margin: the hf engine's copies
    budget = budget_section(dev_bytes, shape, n_layers, overrides)
    V = int(SHAPES[shape]["vocab_size"])
    tok = word_tokenizer(V)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, V, (P,), generator=g).tolist() for _ in range(B)]
    sp = SamplingParams(max_new_tokens=R, temperature=1.0, seed=7)

    # 2. rollout throughput on the full shape (bf16 weights only)
    with guard("hf_engine_generate"):
        print(f"\n== hf engine: {shape} (all {SHAPES[shape]['num_hidden_layers']} layers), bf16, {B} prompts x {P} + {R} tokens")
        reset_peak(device)
        full = build_model(shape, None, torch.bfloat16, device)
        eng = HFRolloutEngine(full, tok, B, share_weights=True, device=device)
        eng.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=1.0, seed=1))  # warm-up
        sync(device)
        t0 = time.perf_counter()
        gen = eng.generate(prompts, sp)
        sync(device)
        dt = time.perf_counter() - t0
        tps = gen.num_tokens / dt
        report("hf_engine_generate", gen.num_tokens > 0 and math.isfinite(float(gen.rollout_logprobs.sum())),
               f"{gen.num_tokens} tokens in {dt:.2f} s = {tps:,.0f} tokens/s, peak {peak_gib(device):.1f} GiB "
               "(threshold: tokens generated, finite log-probs)", tokens_per_s=tps, peak_gib=peak_gib(device))
        eng = full = None
        reset_peak(device)

    # 3. torch trainer on the largest layer count the budget fits
    with guard("torch_trainer_update"):
        print(f"\n== torch trainer: {shape} with {n_layers} of {SHAPES[shape]['num_hidden_layers']} layers, "
              "bf16 autocast over fp32 master weights, AdamW")
        cfg = rl_config(overrides)
        policy = build_model(shape, n_layers, torch.float32, device, seed=1)
        trainer = TorchTrainer.from_config(policy, cfg, device)
        eng = HFRolloutEngine(trainer.policy, tok, B, share_weights=False, convert=lambda m: m.to(torch.bfloat16),
                              device=device)
        gen = eng.generate(prompts, sp)
        batch = batch_from(gen)
        tokens = int(gen.prompt_mask.sum() + gen.response_mask.sum())
        n_nonembed = sum(p.numel() for n, p in trainer.policy.named_parameters() if "embed_tokens" not in n)
        # first update warms up kernels; the second is timed
        trainer.policy_update(batch, torch.Generator().manual_seed(0))
        sync(device)
        lp_trainer_old, _ = trainer.compute_logprobs(batch)
        eng.sync_weights(trainer.policy)
        reset_peak(device)
        t0 = time.perf_counter()
        m = trainer.policy_update(batch, torch.Generator().manual_seed(0))
        sync(device)
        dt = time.perf_counter() - t0
        flops = 6 * n_nonembed * tokens  # forward + backward of the policy loss
        mfu = flops / dt / BF16_PEAK
        peak = peak_gib(device)
        est = budget.train_peak / GiB
        report("torch_trainer_update", math.isfinite(float(m.get("actor/grad_norm", float("nan"))))
               and (peak <= est or device.type != "cuda"),
               f"{tokens} tokens in {dt:.2f} s = {tokens / dt:,.0f} tokens/s, MFU {100 * mfu:.1f}% of 989 TFLOP/s, "
               f"peak {peak:.1f} GiB vs estimate {est:.1f} GiB (threshold: finite grad norm, peak <= estimate)",
               tokens_per_s=tokens / dt, mfu=mfu, peak_gib=peak, estimate_gib=est, layers=n_layers)

    # 4. weight push parity on a fixed response: engine before push (old weights), after push (new weights)
    with guard("weight_push_parity"):
        fixed = batch
        lp_trainer, _ = trainer.compute_logprobs(fixed)
        lp_eng_before = engine_logprobs(eng, fixed, device)
        eng.sync_weights(trainer.policy)
        lp_eng_after = engine_logprobs(eng, fixed, device)
        mask = fixed.response_mask
        d_before = masked_abs_mean(lp_eng_before, lp_trainer, mask)
        d_after = masked_abs_mean(lp_eng_after, lp_trainer, mask)
        d_old = masked_abs_mean(lp_eng_before, lp_trainer_old, mask)
        tol = 0.05  # bf16 engine vs bf16-autocast trainer, nats per token
        report("weight_push_parity", d_after <= tol and d_before >= 5 * d_after,
               f"|engine - trainer| log-prob per token: before push {d_before:.4f}, after push {d_after:.4f} "
               f"(engine before push vs trainer's previous weights {d_old:.4f}); threshold: after <= {tol}, "
               "before >= 5 x after", before=d_before, after=d_after, before_vs_old=d_old, tol=tol)
        eng = None

    # 5. SAO's critic: value pass + critic update on the GPU
    with guard("sao_critic"):
        print("\n== SAO critic (value model = policy backbone copy + scalar head) on the GPU")
        trainer = policy = eng = None
        reset_peak(device)
        c_layers = max(1, n_layers // 2)
        ccfg = rl_config(overrides + ["algo.critic.enabled=true", "algo.critic.lr=1e-4"])
        policy = build_model(shape, c_layers, torch.float32, device, seed=2)
        ctr = TorchTrainer.from_config(policy, ccfg, device)
        cb = batch_from(gen)
        vals = ctr.compute_values(cb)
        cb.extras["values"] = vals
        cb.extras["returns"] = torch.randn(vals.shape, generator=torch.Generator().manual_seed(3)) * cb.response_mask
        sync(device)
        t0 = time.perf_counter()
        cm = ctr.critic_update(cb)
        sync(device)
        dt = time.perf_counter() - t0
        vals2 = ctr.compute_values(cb)
        moved = masked_abs_mean(vals2, vals, cb.response_mask)
        report("sao_critic", math.isfinite(cm["critic/value_loss"]) and moved > 0,
               f"{c_layers} layers: value pass + update {dt:.2f} s, value loss {cm['critic/value_loss']:.4f}, values moved "
               f"{moved:.4f}, peak {peak_gib(device):.1f} GiB (threshold: finite loss, values change)",
               seconds=dt, peak_gib=peak_gib(device), layers=c_layers)
        ctr = policy = None

    # 6. DeepSpeed ZeRO-2 on one process, same batch, when DeepSpeed is importable
    with guard("deepspeed_zero2"):
        try:
            import deepspeed  # noqa: F401
        except Exception as e:  # noqa: BLE001
            report("deepspeed_zero2", True, f"SKIPPED: DeepSpeed not importable here ({type(e).__name__}: {e})")
            return
        from rlpost.trainer.deepspeed_engine import DeepSpeedTrainer

        reset_peak(device)
        dcfg = rl_config(overrides + ["trainer=deepspeed", "trainer.zero_stage=2", "trainer.lr=1e-3"])
        d_layers = max(1, n_layers // 2)
        policy = build_model(shape, d_layers, torch.float32, device, seed=1)
        w0 = {n: p.detach().float().clone() for n, p in list(policy.named_parameters())[-3:]}
        tokens = int(batch.prompt_mask.sum() + batch.response_mask.sum())
        dtr = DeepSpeedTrainer.from_config(policy, dcfg, device)
        dtr.policy_update(batch, torch.Generator().manual_seed(0))
        sync(device)
        t0 = time.perf_counter()
        dm = dtr.policy_update(batch, torch.Generator().manual_seed(0))
        sync(device)
        dt = time.perf_counter() - t0
        moved = max(float((dict(dtr.policy.named_parameters())[n].detach().float() - w).abs().max()) for n, w in w0.items())
        report("deepspeed_zero2", math.isfinite(float(dm["actor/grad_norm"])) and moved > 0,
               f"{d_layers} layers: update {dt:.2f} s ({tokens / dt:,.0f} tokens/s), peak {peak_gib(device):.1f} GiB, "
               f"max weight change {moved:.2e} (threshold: finite grad norm, weights move)",
               seconds=dt, peak_gib=peak_gib(device), layers=d_layers)


@torch.no_grad()
def engine_logprobs(eng, batch, device: torch.device) -> torch.Tensor:
    """Log-probs of ``batch``'s responses under the rollout engine's own (bf16) model, teacher-forced."""
    from rlpost.models.logprobs import response_logprobs

    model = eng.model
    attn = (batch.response_mask > 0).long()
    lp = response_logprobs(model, batch.prompt_ids.to(device), batch.prompt_mask.to(device),
                           batch.response_ids.to(device), attn.to(device), 1.0)
    lp = lp[0] if isinstance(lp, tuple) else lp
    return lp.float().cpu()


# --------------------------------------------------------------------------- part vllm
def vllm_workload(shape: str):
    """The vLLM parts' workload: ``(tokenizer, prompts, sampling params)``.

    64 random prompts of 128 token ids (2 .. vocab-1, seed 0) for ``shape``'s vocabulary, 128 new
    tokens each at temperature 1 (seed 7), with the word tokenizer of :func:`word_tokenizer`.
    """
    from rlpost.rollout.base import SamplingParams

    V = int(SHAPES[shape]["vocab_size"])
    B, P, R = 64, 128, 128
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, V, (P,), generator=g).tolist() for _ in range(B)]
    return word_tokenizer(V), prompts, SamplingParams(max_new_tokens=R, temperature=1.0, seed=7)


def part_vllm(device: torch.device, shape: str, layers: int, tmp: Path) -> None:
    """vLLM engine: generate, push changed weights, compare log-probs with the trainer (bf16 and fp8)."""
    from rlpost.rollout.vllm import VLLMRolloutEngine
    from rlpost.rollout.base import EngineConfig
    from rlpost.trainer.torch_engine import TorchTrainer

    tok, prompts, sp = vllm_workload(shape)
    for prec, tol in (("bf16", 0.05), ("rollout_fp8", 0.3)):
        print(f"\n== vLLM engine, precision={prec}: {shape} with {layers} layers")
        # the fp8 arm composes the GPU recipe (recipes/fp8_rollout_qwen3_8b.yaml) on the toy-depth model
        recipe = ["+recipe=fp8_rollout_qwen3_8b", "model=tiny", "trainer=torch",
                  "model.gradient_checkpointing=false"] if prec == "rollout_fp8" else []
        cfg = rl_config(recipe + [f"precision={prec}", "rollout=vllm", "rollout.gpu_memory_utilization=0.35",
                         "trainer.lr=1e-3", "trainer.grad_clip=0", "trainer.micro_batch_size=8",
                         f"rollout.batch_size={len(prompts)}", f"model.cache_dir={tmp / prec}"])
        policy = build_model(shape, layers, torch.float32, device, seed=1)
        trainer = TorchTrainer.from_config(policy, cfg, device)
        eng = VLLMRolloutEngine(EngineConfig.of(cfg), trainer.policy, tok)
        t0 = time.perf_counter()
        gen = eng.generate(prompts, sp)
        dt = time.perf_counter() - t0
        batch = batch_from(gen)
        lp_t0, _ = trainer.compute_logprobs(batch)
        d0 = masked_abs_mean(gen.rollout_logprobs, lp_t0, gen.response_mask)
        trainer.policy_update(batch, torch.Generator().manual_seed(0))
        lp_t1, _ = trainer.compute_logprobs(batch)
        t1 = time.perf_counter()
        eng.sync_weights(trainer.policy)
        push_s = time.perf_counter() - t1
        # teacher-forced engine log-probs of the same responses: prompt_logprobs over prompt + response
        d_after = vllm_teacher_forced_gap(eng, batch, lp_t1)
        d_before_new = masked_abs_mean(gen.rollout_logprobs, lp_t1, gen.response_mask)
        report(f"vllm_{prec}_push", d_after <= tol and d_before_new >= 3 * d_after,
               f"generate {gen.num_tokens / dt:,.0f} tokens/s, push {push_s:.2f} s via {eng.push_method}; "
               f"|vLLM - trainer| per token: initial {d0:.4f}, stale engine vs updated trainer {d_before_new:.4f}, "
               f"after push {d_after:.4f} (threshold: after <= {tol}, stale >= 3 x after)",
               tokens_per_s=gen.num_tokens / dt, push_s=push_s, initial=d0, stale=d_before_new, after=d_after)
        eng.close()
        del eng, trainer, policy
        reset_peak(device)


def vllm_teacher_forced_gap(eng, batch, lp_trainer: torch.Tensor) -> float:
    """Mean |vLLM - trainer| log-prob of the batch's response tokens, vLLM scoring them as prompt tokens."""
    from vllm import SamplingParams as VSP

    eng._wake("weights")
    eng._wake("kv_cache")
    inputs = []
    for i in range(len(batch)):
        p = batch.prompt_ids[i][batch.prompt_mask[i] > 0].tolist()
        r = batch.response_ids[i][batch.response_mask[i] > 0].tolist()
        inputs.append({"prompt_token_ids": p + r})
    outs = eng.llm.generate(inputs, VSP(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)
    eng.sleep()
    tot, n = 0.0, 0
    for i, o in enumerate(outs):
        plen = int(batch.prompt_mask[i].sum())
        r = batch.response_ids[i][batch.response_mask[i] > 0].tolist()
        for j, t in enumerate(r):
            entry = o.prompt_logprobs[plen + j]
            v = entry[t]
            tot += abs(float(getattr(v, "logprob", v)) - float(lp_trainer[i, j]))
            n += 1
    return tot / max(1, n)


# --------------------------------------------------------------------------- part spec
def part_spec(device: torch.device, shape: str, layers: int, tmp: Path) -> None:
    """vLLM speculative decoding for rollouts (rollout.speculative, rlpost/rollout/vllm_spec.py).

    For a plain engine and for ``method=ngram`` (k=4) and ``method=self`` (the policy's own starting
    weights as an fp8 draft model, k=3; rollout=vllm_self_spec): generate, one update, push, generate
    again; the second generation's reported log-probs must match the updated trainer's (speculation
    must report the target's log-probs, not the drafter's: threshold part vllm's bf16 0.05), and
    tokens/s is printed against the plain engine. ``method=mtp`` on this model (no MTP layers) must
    stop with the ConfigError before any engine starts; no MTP checkpoint is available offline.
    """
    from rlpost.core.errors import ConfigError
    from rlpost.rollout.vllm import VLLMRolloutEngine
    from rlpost.rollout.base import EngineConfig
    from rlpost.trainer.torch_engine import TorchTrainer

    tok, prompts, sp = vllm_workload(shape)
    with guard("vllm_spec_mtp_refused"):
        cfg = rl_config(["precision=bf16", "rollout=vllm_mtp", f"model.cache_dir={tmp / 'mtp'}"])
        policy = build_model(shape, layers, torch.float32, device, seed=1)
        try:
            VLLMRolloutEngine(EngineConfig.of(cfg), policy, tok)
            report("vllm_spec_mtp_refused", False, "method=mtp on a model without MTP layers was not refused")
        except ConfigError as e:
            report("vllm_spec_mtp_refused", "multi-token-prediction" in str(e), f"ConfigError: {str(e)[:120]}")
        del policy
    base_tps = None
    arms = (("plain", ["rollout=vllm"]),
            ("ngram", ["rollout=vllm_self_spec", "rollout.speculative.method=ngram",
                       "rollout.speculative.quantization=null", "rollout.speculative.num_speculative_tokens=4"]),
            ("self_fp8", ["rollout=vllm_self_spec"]))
    for name, ov in arms:
        with guard(f"vllm_spec_{name}"):
            print(f"\n== vLLM speculative decoding, {name}: {shape} with {layers} layers")
            cfg = rl_config(["precision=bf16", *ov, "rollout.gpu_memory_utilization=0.35", "trainer.lr=1e-3",
                             "trainer.grad_clip=0", "trainer.micro_batch_size=8", f"rollout.batch_size={len(prompts)}",
                             f"model.cache_dir={tmp / name}"])
            policy = build_model(shape, layers, torch.float32, device, seed=1)
            trainer = TorchTrainer.from_config(policy, cfg, device)
            eng = VLLMRolloutEngine(EngineConfig.of(cfg), trainer.policy, tok)
            gen = eng.generate(prompts, sp)
            trainer.policy_update(batch_from(gen), torch.Generator().manual_seed(0))
            eng.sync_weights(trainer.policy)
            t0 = time.perf_counter()
            gen2 = eng.generate(prompts, sp)
            dt = time.perf_counter() - t0
            lp_t, _ = trainer.compute_logprobs(batch_from(gen2))
            gap = masked_abs_mean(gen2.rollout_logprobs, lp_t, gen2.response_mask)
            tps = gen2.num_tokens / dt
            base_tps = tps if name == "plain" else base_tps
            ratio = f", {tps / base_tps:.2f} x plain" if base_tps and name != "plain" else ""
            report(f"vllm_spec_{name}", gap <= 0.05,
                   f"after a push: {tps:,.0f} tokens/s{ratio}; |reported - trainer| log-prob per token {gap:.4f} "
                   f"(threshold 0.05)", tokens_per_s=tps, gap=gap)
            eng.close()
            del eng, trainer, policy
            reset_peak(device)


# --------------------------------------------------------------------------- part agent
class RecordingEngine:
    """Passes every call to a real engine and keeps ``(prompts, result, cached prompt tokens)`` of each."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.tokenizer, self.pad_id = inner.tokenizer, inner.pad_id
        self.eos_ids = getattr(inner, "eos_ids", None)

    def generate(self, prompts, params):
        gen = self.inner.generate(prompts, params)
        self.calls.append(([list(p) for p in prompts], gen, getattr(self.inner, "last_cached_tokens", None)))
        return gen

    def session(self):
        return self.inner.session()


def _register_echo_env():
    """``gpu_check_echo``: answers every turn with a short observation (a random model makes no tool calls)."""
    from rlpost.envs.base import ENVS, Env, EnvStep

    if "gpu_check_echo" in [e.name for e in ENVS]:
        return

    @ENVS.register("gpu_check_echo", description="gpu_check only: an observation after every turn")
    class Echo(Env):
        def __init__(self):
            self.k = 0

        def step(self, text):
            self.k += 1
            return EnvStep([{"role": "tool", "content": f"t5 t6 t{self.k + 7}"}], 0.0, False, {"tool_calls": 1})


def part_agent(device: torch.device, shape: str, layers: Optional[int], dry: bool, tmp: Path) -> None:
    """Multi-turn episodes through the rollout engine (vLLM on a GPU; the hf engine in --dry-run).

    One engine call per turn with token-id prompts (prompt + every earlier turn + inserted text), inside
    the engine's session (vLLM: awake, prefix cache on). Checks: (1) token exactness, each call's prompt is
    exactly what the row holds before that turn and each row is exactly sampled + inserted ids, with the
    loss mask on the sampled ones; (2) the trainer's log-probs of every model token (environment tokens
    attended to) match the engine's rollout log-probs; (3) vLLM: turns 2+ are served from the prefix cache.
    """
    from rlpost.rollout.base import SamplingParams
    from rlpost.samplers.base import SamplerContext
    from rlpost.samplers.episode import EpisodeSampler
    from rlpost.trainer.torch_engine import TorchTrainer

    _register_echo_env()
    V = int(SHAPES[shape]["vocab_size"])
    tok = word_tokenizer(V)
    B, P, G = (4, 8, 2) if dry else (32, 64, 4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, V, (P,), generator=g).tolist() for _ in range(B)]
    # random weights never stop on their own: stop strings end the turns after a few tokens
    sp = SamplingParams(max_new_tokens=32, temperature=1.0, seed=11, stop=["t3", "t7"])
    over = ["precision=bf16" if not dry else "precision=fp32", "trainer.micro_batch_size=8",
            f"rollout.batch_size={B * G}", f"model.cache_dir={tmp / 'agent'}"]
    name = "agent_episode"
    with guard(name):
        print(f"\n== multi-turn episodes through the {'hf (dry run)' if dry else 'vLLM'} engine: {shape}"
              f"{'' if layers is None else f' with {layers} layers'}, {B} prompts x {G} episodes, 3 turns")
        cfg = rl_config(over + ([] if dry else ["rollout=vllm", "rollout.gpu_memory_utilization=0.35"]))
        policy = build_model(shape, layers, torch.float32, device, seed=1)
        trainer = TorchTrainer.from_config(policy, cfg, device)
        if dry:
            from rlpost.rollout.hf import HFRolloutEngine

            inner = HFRolloutEngine(trainer.policy, tok, B * G, share_weights=True, device=device)
        else:
            from rlpost.rollout.vllm import VLLMRolloutEngine
            from rlpost.rollout.base import EngineConfig

            inner = VLLMRolloutEngine(EngineConfig.of(cfg), trainer.policy, tok)
        eng = RecordingEngine(inner)
        s = EpisodeSampler(G, env="gpu_check_echo", max_turns=3, max_total_tokens=256, transcripts=False)
        t0 = time.perf_counter()
        res = s.sample(eng, prompts, sp, SamplerContext(step=1))
        dt = time.perf_counter() - t0
        gen = res.generation
        rows = gen.response_ids.shape[0]
        turns = res.extras["episode_turns"].long().tolist()
        # (1) token exactness: call k served the rows still live at turn k, in row order
        bad, expect_mask = 0, torch.zeros_like(gen.response_mask)
        for k, (sent, out, _) in enumerate(eng.calls):
            live = [i for i in range(rows) if turns[i] > k]
            for j, i in enumerate(live):
                p = gen.prompt_ids[i][gen.prompt_mask[i] > 0].tolist()
                full = p + gen.response_ids[i][: int(res.extras["response_attn"][i].sum())].tolist()
                ids = out.response_ids[j][out.response_mask[j] > 0].tolist()
                n = len(sent[j])
                if full[:n] != sent[j] or full[n:n + len(ids)] != ids[: len(full) - n]:
                    bad += 1
                expect_mask[i, n - len(p): n - len(p) + len(ids)] = 1
        exact = bad == 0 and torch.equal(expect_mask[:, : gen.response_mask.shape[1]], gen.response_mask)
        # (2) trainer log-probs of the model tokens, environment tokens attended to
        batch = batch_from(gen, G)
        batch.extras["response_attn"] = res.extras["response_attn"]
        lp, _ = trainer.compute_logprobs(batch)
        gap = masked_abs_mean(gen.rollout_logprobs, lp, gen.response_mask)
        tol = 1e-3 if dry else 0.05
        cached = [c for _, _, c in eng.calls[1:]]
        cache_ok = dry or (all(c is not None for c in cached) and sum(cached) > 0)
        later = sum(len(p) for sent, _, _ in eng.calls[1:] for p in sent)
        cache_txt = "n/a (hf engine)" if dry else (f"{sum(c or 0 for c in cached)} of {later} prompt tokens of turns 2+ "
                                                   "served from vLLM's prefix cache")
        report(name, exact and gap <= tol and cache_ok and max(turns) >= 2,
               f"{rows} episodes, {sum(turns) / rows:.2f} turns/episode, {len(eng.calls)} engine calls, "
               f"{gen.num_tokens / dt:,.0f} model tokens/s; token-exact rows {rows - min(bad, rows)}/{rows}; "
               f"|trainer - rollout| log-prob per model token {gap:.4f}; {cache_txt} "
               f"(threshold: every call and row token-exact, mask = sampled tokens, gap <= {tol}, some episode reaches "
               f"turn 2{'' if dry else ', cached tokens > 0'})",
               turns_per_episode=sum(turns) / rows, gap=gap, seconds=dt)
        if hasattr(inner, "close"):
            inner.close()
        del eng, inner, trainer, policy
        reset_peak(device)


def part_ray(device: torch.device, shape: str, layers: Optional[int], dry: bool, tmp: Path) -> None:
    """``launcher=ray`` on one node: 2 rollout workers (vLLM on a GPU, hf in --dry-run), push, kill (see module doc)."""
    import ray

    from rlpost.ray_pool.ray_workers import RayRolloutPool
    from rlpost.rollout.base import EngineConfig, SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine
    from rlpost.trainer.torch_engine import TorchTrainer

    V = int(SHAPES[shape]["vocab_size"])
    tok = word_tokenizer(V)
    B, P, R, G = (8, 8, 12, 4) if dry else (64, 128, 128, 4)
    model_dir = tmp / "model"
    build_model(shape, layers, torch.float32, torch.device("cpu"), seed=1).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    ngpu = torch.cuda.device_count() if not dry else 0
    own = ngpu >= 3  # the trainer keeps device 0, each worker gets a whole device
    gpus = 0.0 if dry else (1.0 if own else 0.4)
    sync_mode = "collective" if (dry or own) else "object_store"  # --dry-run exercises the broadcast over gloo
    over = ["model.source=hf", f"model.path={model_dir}", "model.name=gpu_check_ray", f"model.cache_dir={tmp}",
            "launcher=ray", "launcher.num_rollout_workers=2", f"launcher.gpus_per_worker={gpus}",
            f"launcher.cpus_per_worker={1 if dry else 2}", f"launcher.weight_sync={sync_mode}",
            f"launcher.placement={'disaggregated' if own else 'colocated'}", "launcher.object_store_mb=256",
            "trainer.lr=1e-3", "trainer.grad_clip=0", "trainer.micro_batch_size=8", f"rollout.batch_size={B}",
            "precision=fp32" if dry else "precision=bf16"]
    if not dry:
        over += ["rollout=vllm", "rollout.gpu_memory_utilization=0.25"]
    cfg = rl_config(over)
    tol = 1e-3 if dry else 0.05
    prompts = grouped_prompts(B, P, G, V)
    sp = SamplingParams(max_new_tokens=R, temperature=1.0, seed=7)
    print(f"\n== launcher=ray: 2 {'hf (dry run)' if dry else 'vLLM'} rollout workers, {shape}"
          f"{'' if layers is None else f' with {layers} layers'}, {B} rows ({B // G} groups), weights via {sync_mode}")
    pool = None
    try:
        with guard("ray_generate"):
            policy = build_model(shape, layers, torch.float32, device, seed=1)
            trainer = TorchTrainer.from_config(policy, cfg, device)
            local = HFRolloutEngine(trainer.policy, tok, B, share_weights=True, device=device)
            t0 = time.perf_counter()
            pool = RayRolloutPool(cfg.launcher, EngineConfig.of(cfg), local, trainer.policy)
            start_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            gen = pool.generate(prompts, sp)
            dt = time.perf_counter() - t0
            batch = batch_from(gen, G)
            lp0, _ = trainer.compute_logprobs(batch)
            d0 = masked_abs_mean(gen.rollout_logprobs, lp0, gen.response_mask)
            report("ray_generate", pool.rows_generated == [B // 2, B // 2] and d0 <= tol,
                   f"pool start {start_s:.1f} s; {gen.num_tokens / dt:,.0f} tokens/s over 2 workers; rows per worker "
                   f"{pool.rows_generated}; |worker - trainer| log-prob per token {d0:.4f} (threshold: rows split "
                   f"evenly by groups, gap <= {tol})", tokens_per_s=gen.num_tokens / dt, start_s=start_s, gap=d0)
        with guard("ray_push"):
            trainer.policy_update(batch, torch.Generator().manual_seed(0))
            lp1, _ = trainer.compute_logprobs(batch)
            stale = masked_abs_mean(gen.rollout_logprobs, lp1, gen.response_mask)
            t0 = time.perf_counter()
            pool.sync_weights(trainer.policy)
            push_s = time.perf_counter() - t0
            gen2 = pool.generate(prompts, sp)
            b2 = batch_from(gen2, G)
            lp2, _ = trainer.compute_logprobs(b2)
            after = masked_abs_mean(gen2.rollout_logprobs, lp2, gen2.response_mask)
            report("ray_push", after <= tol and stale >= 3 * after,
                   f"push {push_s:.2f} s via {pool.weight_sync}; |worker - trainer| per token: stale {stale:.4f}, "
                   f"after push {after:.4f} (threshold: after <= {tol}, stale >= 3 x after)",
                   push_s=push_s, stale=stale, after=after)
        with guard("ray_kill"):
            pool.after_submit = lambda p, futs: ray.kill(p.workers[1])
            gen3 = pool.generate(prompts, sp)
            pool.after_submit = None
            m = pool.step_metrics()
            same = float((gen3.response_ids[:, : gen2.response_ids.shape[1]] == gen2.response_ids[:, : gen3.response_ids.shape[1]])
                         .all(-1).float().mean()) if gen3.response_ids.shape[0] == B else 0.0
            ok = gen3.response_ids.shape[0] == B and m["ray/worker_failures"] >= 1 and (same == 1.0 or not dry)
            report("ray_kill", ok, f"worker 1 killed during a generate call: {gen3.response_ids.shape[0]}/{B} rows back, "
                   f"failures {m['ray/worker_failures']:.0f}, restarts {m['ray/worker_restarts']:.0f}; rows identical "
                   f"to the unkilled call {same:.2f} (threshold: no row lost{', all identical' if dry else ''})",
                   identical=same)
        if device.type == "cuda":
            print(f"driver peak GPU memory {peak_gib(device):.2f} GiB (the workers' memory is vLLM's share each)")
    finally:
        if pool is not None:
            pool.close()
        if ray.is_initialized():
            ray.shutdown()


# --------------------------------------------------------------------------- part device_map
def part_device_map(device: torch.device, dry: bool, tmp: Path) -> None:
    """``launcher.device_mapping`` (ROLL, arXiv:2506.06122) on this node: the mapping checked against the real
    device count, each rollout worker pinned to its mapped device (compared by device UUID / PCI bus id with
    the driver's view of that id), the weight-sync mode the plan implies, and one generate call on the pinned
    workers (rows back, log-probs vs the trainer). ``--dry-run``: the same path on CPU, where ids resolve to cpu."""
    import ray

    from rlpost.config.compose import validate_config
    from rlpost.core.errors import ConfigError
    from rlpost.ray_pool import device_plan
    from rlpost.ray_pool.device_mapping import plan_from_config
    from rlpost.ray_pool.ray_workers import RayRolloutPool
    from rlpost.rollout.base import EngineConfig, SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine
    from rlpost.trainer.torch_engine import TorchTrainer

    shape = "qwen3-tiny"  # placement, not throughput: the toy shape on every device
    n = 0 if dry else torch.cuda.device_count()
    rollout = [0] if n == 1 else ([1, 2] if n >= 3 else [1])  # disaggregated from the trainer's device 0 when possible
    if dry:
        rollout = [1, 2]
    V = int(SHAPES[shape]["vocab_size"])
    tok = word_tokenizer(V)
    B, P, R, G = 8, 8, 12, 4
    model_dir = tmp / "model"
    build_model(shape, None, torch.float32, torch.device("cpu"), seed=1).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    ids = ",".join(map(str, rollout))
    over = ["model.source=hf", f"model.path={model_dir}", "model.name=gpu_check_devmap", f"model.cache_dir={tmp}",
            "launcher=ray", f"launcher.num_rollout_workers={len(rollout)}", "launcher.cpus_per_worker=1",
            f"launcher.device_mapping={{actor:[0],rollout:[{ids}]}}", "launcher.object_store_mb=256",
            "trainer.micro_batch_size=8", f"rollout.batch_size={B}", "precision=fp32", f"device={device.type}"]
    cfg = rl_config(over)
    print(f"\n== launcher.device_mapping: actor [0], rollout {rollout} on {n if not dry else 'no'} visible GPU(s)")
    pool = None
    try:
        with guard("devmap_validate"):
            validate_config(cfg)
            plan = device_plan(cfg)
            try:
                bad = rl_config([*over[:-1], f"launcher.device_mapping={{actor:[0],rollout:[{max(n, 1)}]}}",
                                 f"device={device.type}"])
                plan_from_config(bad, n_visible=max(n, 1), cuda=True)
                refused = False
            except ConfigError as e:
                refused = "visible" in str(e)
            report("devmap_validate", plan is not None and plan.cuda == (not dry) and refused,
                   f"plan: {plan.table().replace(chr(10), '; ')}; an id = the device count refused: {refused}")
        with guard("devmap_pinned"):
            from rlpost.trainer.torchrun import local_device

            dev = local_device(plan.device("actor")) if plan.cuda else device
            policy = build_model(shape, None, torch.float32, dev, seed=1)
            trainer = TorchTrainer.from_config(policy, cfg, dev)
            local = HFRolloutEngine(trainer.policy, tok, B, share_weights=True, device=dev)
            pool = RayRolloutPool(cfg.launcher, EngineConfig.of(cfg), local, trainer.policy, plan=plan)
            infos = ray.get([w.device_info.remote() for w in pool.workers])
            want_sync = "collective" if (plan.cuda and plan.rollout_exclusive()) else "object_store"
            if plan.cuda:
                def ident(i):
                    p = torch.cuda.get_device_properties(i)
                    return str(getattr(p, "uuid", "")) or str(getattr(p, "pci_bus_id", ""))

                rp = plan.stages["rollout"]
                ok = all(info["count"] == 1 and info["cuda_visible"] == rp.worker_visible[i]
                         and (info["uuid"] or info["pci_bus_id"]) == ident(rp.worker_ids[i]) for i, info in enumerate(infos))
                ok = ok and torch.cuda.current_device() == plan.stages["actor"].ids[0]
            else:
                ok = all(info["device"] == "cpu" for info in infos) and not pool.gpu
            ok = ok and pool.weight_sync == want_sync
            report("devmap_pinned", ok, f"workers {[(i['cuda_visible'], i['device']) for i in infos]}; weights via "
                   f"{pool.weight_sync} (expected {want_sync}); driver on {dev} (threshold: each worker sees exactly "
                   f"its mapped device, same UUID as the driver's id)")
        with guard("devmap_generate"):
            prompts = grouped_prompts(B, P, G, V)
            gen = pool.generate(prompts, SamplingParams(max_new_tokens=R, temperature=1.0, seed=7))
            batch = batch_from(gen, G)
            lp, _ = trainer.compute_logprobs(batch)
            gap = masked_abs_mean(gen.rollout_logprobs, lp, gen.response_mask)
            report("devmap_generate", gen.response_ids.shape[0] == B and gap <= 1e-3,
                   f"{gen.response_ids.shape[0]}/{B} rows from the pinned workers, rows per worker "
                   f"{pool.rows_generated}; |worker - trainer| log-prob per token {gap:.5f} (threshold 1e-3, fp32)")
    finally:
        if pool is not None:
            pool.close()
        if ray.is_initialized():
            ray.shutdown()


# --------------------------------------------------------------------------- part dp
class TimedEngine:
    """Passes ``generate`` to a real engine and adds up this rank's own generation seconds (no gather wait)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds, self.calls = inner, 0.0, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)

    def generate(self, prompts, params):
        t0 = time.perf_counter()
        out = self.inner.generate(prompts, params)
        self.seconds += time.perf_counter() - t0
        self.calls.append((int(params.row_offset), int(params.row_offset) + len(prompts)))  # rows this engine made
        return out


def dp_worker(shape: str, layers: Optional[int], dry: bool, tmp: Path) -> None:
    """One rank of part dp, started by ``torch.distributed.run`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set).

    Mirrors a ``trainer.num_procs=N`` run's rank: ``init_process_group`` (gloo on CPU, nccl on GPU, as
    DeepSpeed's ``init_distributed`` picks), :func:`rlpost.trainer.torchrun.local_device`, the engine from
    :func:`rlpost.rollout.build_engine` (vLLM: ``world_size=N``, vLLM's external launcher, one engine per rank
    on its current device), wrapped in :class:`rlpost.distributed.ShardedEngine`. Writes ``tmp/rank{r}.pt``:
    the gathered result, this rank's rows, timings, peak memory and (rank 0) one engine's result of the
    whole call with the same seeds.
    """
    import torch.distributed as dist

    from rlpost.distributed import ShardedEngine, local_run_rows
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.rollout.base import SamplingParams
    from rlpost.trainer.torchrun import local_device

    dist.init_process_group("gloo" if dry else "nccl")
    r, world = dist.get_rank(), dist.get_world_size()
    try:
        device = local_device("cpu" if dry else "cuda")
        V = int(SHAPES[shape]["vocab_size"])
        tok = word_tokenizer(V)
        B, P, R, G = (8, 8, 8, 2) if dry else (256, 128, 128, 8)
        prompts = grouped_prompts(B, P, G, V)
        sp = SamplingParams(max_new_tokens=R, temperature=1.0, seed=7)
        # per-rank cache_dir: each rank writes its engine's start weights to its own directory
        over = [f"rollout.batch_size={len(prompts)}", f"model.cache_dir={tmp}/rank{r}", "model.name=gpu_check_dp"]
        over += ["precision=fp32"] if dry else ["precision=bf16", "rollout=vllm", "rollout.gpu_memory_utilization=0.5"]
        cfg = rl_config(over)
        policy = build_model(shape, layers, torch.float32 if dry else torch.bfloat16, device, seed=1)  # same everywhere
        inner = TimedEngine(build_engine(EngineConfig.of(cfg), policy, tok, device))
        if not dry:
            policy = None
            reset_peak(device)
        eng = ShardedEngine(inner)
        eng.generate(prompts[: 2 * G], dataclasses_replace(sp, max_new_tokens=4))  # warm-up
        inner.seconds, inner.calls = 0.0, []
        dist.barrier()
        t0 = time.perf_counter()
        gen = eng.generate(prompts, sp)
        dt = time.perf_counter() - t0
        a, b = inner.calls[0] if inner.calls else local_run_rows([tuple(p) for p in prompts], r, world)  # (x, x): none
        out = dict(rows=(a, b), engine_calls=len(inner.calls), seconds=dt, gen_seconds=inner.seconds, local_tokens=int(gen.response_mask[a:b].sum()),
                   total_tokens=gen.num_tokens, response_ids=gen.response_ids, response_mask=gen.response_mask,
                   peak_gib=peak_gib(device), B=B, G=G)
        if r == 0:  # one engine generating the whole call, same seeds: the reference rows
            single = inner.inner.generate(prompts, sp)
            out.update(single_ids=single.response_ids, single_mask=single.response_mask)
        torch.save(out, tmp / f"rank{r}.pt")
        dist.barrier()
        if hasattr(inner.inner, "close"):
            inner.inner.close()
    finally:
        dist.destroy_process_group()


def dataclasses_replace(obj: Any, **kw: Any) -> Any:
    """``dataclasses.replace`` (kept importable for the workers)."""
    import dataclasses

    return dataclasses.replace(obj, **kw)


def part_dp(shape: str, layers: Optional[int], dry: bool, world: Optional[int], tmp: Path) -> None:
    """N-way data-parallel rollouts through :class:`rlpost.distributed.ShardedEngine` (see module doc).

    Starts N ranks of :func:`dp_worker` with PyTorch's launcher (``python -m torch.distributed.run
    --nproc_per_node=N``, as :mod:`rlpost.trainer.torchrun` does for ``trainer.num_procs=N``); each builds the
    same random model and its own engine (vLLM on its GPU; the hf engine on CPU in ``--dry-run``) and makes
    one sharded ``generate`` call of a step's groups. Checks: every row token-exact against one engine
    generating the whole call with the same seeds (per-row seed ``seed + row_offset + i``), every group
    generated by exactly one rank, the gathered result identical on every rank, complete and in order.
    Prints tokens/s per rank (its own generation time) and in total (the step), the step time and peak GPU
    memory per rank. The ``model=qwen3-8b`` update step is part ``hf``'s: this part does no update.
    """
    import socket
    import subprocess

    n = 2 if dry else torch.cuda.device_count()
    if world:
        n = min(n, int(world))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"\n== data-parallel rollouts: {n} ranks ({'hf engine, CPU, gloo' if dry else 'one vLLM engine per GPU'}), "
          f"{shape}{'' if layers is None else f' with {layers} layers'}", flush=True)
    with guard("dp_rollouts"):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", "--master_addr=127.0.0.1",
               f"--master_port={port}", str(Path(__file__).resolve()), "--dp-worker", str(tmp), "--shape", shape]
        cmd += ["--dry-run"] if dry else ["--vllm-layers", str(layers)]
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=str(REPO)).returncode
        wall = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"torch.distributed.run exited with status {rc} (the ranks' output is above)")
        outs = [torch.load(tmp / f"rank{r}.pt") for r in range(n)]
        o0 = outs[0]
        B, G = o0["B"], o0["G"]
        same_everywhere = all(torch.equal(o["response_ids"], o0["response_ids"]) for o in outs)
        spans = [o["rows"] for o in outs]
        covered = [i for a, b in spans for i in range(a, b)]
        # the rows each rank's engine was actually asked for (row_offset, count): groups are G consecutive rows
        whole_groups = all(a % G == 0 and b % G == 0 for a, b in spans) and all(o["engine_calls"] <= 1 for o in outs)
        complete = covered == list(range(B)) and o0["response_ids"].shape[0] == B
        ids, m, sids, sm = o0["response_ids"], o0["response_mask"], o0["single_ids"], o0["single_mask"]
        w = min(ids.shape[1], sids.shape[1])
        rows_equal = int(sum(int(m[i].sum()) == int(sm[i].sum()) and torch.equal(ids[i, :w] * m[i, :w], sids[i, :w] * sm[i, :w])
                             for i in range(B)))
        step_s = max(o["seconds"] for o in outs)
        per_rank = [o["local_tokens"] / o["gen_seconds"] if o["gen_seconds"] > 0 else 0.0 for o in outs]
        total_tps = o0["total_tokens"] / step_s
        peaks = [o["peak_gib"] for o in outs]
        report("dp_rollouts", same_everywhere and whole_groups and complete and rows_equal == B,
               f"{n} ranks, {B} rows ({B // G} groups of {G}); rows per rank {[b - a for a, b in spans]}; step "
               f"{step_s:.2f} s ({wall:.1f} s with start-up); tokens/s per rank "
               f"{', '.join(f'{x:,.0f}' for x in per_rank)}, total {total_tps:,.0f}; peak GPU memory per rank "
               f"{', '.join(f'{p:.1f}' for p in peaks)} GiB (torch's allocator; vLLM's KV pool is reserved up front); "
               f"rows token-exact vs one engine, same seeds: {rows_equal}/{B} (threshold: all rows equal, groups "
               "whole and each on one rank, gathered result identical on every rank, complete and in order)",
               ranks=n, step_s=step_s, tokens_per_s_per_rank=per_rank, tokens_per_s=total_tps, peak_gib=peaks,
               rows_equal=rows_equal, rows=B)


# --------------------------------------------------------------------------- part lora
def part_lora(device: torch.device, shape: str, layers: Optional[int], dry: bool, tmp: Path) -> None:
    """LoRA (PEFT adapters, :mod:`rlpost.models.lora`): update, push to the engine, log-prob parity.

    Builds the policy, injects adapters (rank 8, q/k/v/o), one update step (only adapter parameters may
    change), pushes to the engine (vLLM with ``model.lora.rank > 0``: the adapter as a ``LoRARequest``;
    ``--dry-run``: the hf engine with merged weights) and checks, on a fixed batch, the engine's log-probs
    under the adapter against the trainer's merged-weight log-probs (:func:`merged_model`), and the KL
    reference (adapters disabled) against a separately built base model.
    """
    from rlpost.models.logprobs import response_logprobs
    from rlpost.models.lora import adapters_disabled, apply_lora, merged_model
    from rlpost.rollout.base import SamplingParams
    from rlpost.trainer.torch_engine import TorchTrainer

    V = int(SHAPES[shape]["vocab_size"])
    tok = word_tokenizer(V)
    B, P, R, G = (8, 8, 8, 4) if dry else (64, 128, 128, 4)
    prompts = grouped_prompts(B, P, G, V)
    sp = SamplingParams(max_new_tokens=R, temperature=1.0, seed=7)
    over = ["precision=fp32" if dry else "precision=bf16", "model.lora.rank=8", "model.lora.alpha=16",
            "model.lora.dropout=0", "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]", "trainer.lr=1e-2",
            "trainer.grad_clip=0", "trainer.micro_batch_size=8", f"rollout.batch_size={len(prompts)}", "algo.kl.coef=0.01",
            f"model.cache_dir={tmp}", "model.name=gpu_check_lora"]
    if not dry:
        over += ["rollout=vllm", "rollout.gpu_memory_utilization=0.35"]
    cfg = rl_config(over)
    tol = 1e-3 if dry else 0.05  # part vllm's bf16 tolerance on the GPU; fp32 on CPU
    print(f"\n== LoRA: {shape}{'' if layers is None else f' with {layers} layers'}, rank 8 on q/k/v/o, engine "
          f"{'hf (merged weights, dry run)' if dry else 'vLLM (LoRARequest per push)'}")

    def lp_of(model, batch) -> torch.Tensor:
        with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=not dry):
            lp = response_logprobs(model, batch.prompt_ids.to(device), batch.prompt_mask.to(device),
                                   batch.response_ids.to(device), (batch.response_mask > 0).long().to(device), 1.0)
        return (lp[0] if isinstance(lp, tuple) else lp).float().cpu()

    eng = None
    with guard("lora_update"):
        base = build_model(shape, layers, torch.float32, device, seed=1)  # the base model, kept for the KL check
        policy = build_model(shape, layers, torch.float32, device, seed=1)
        policy = apply_lora(policy, cfg.model.lora)
        trainer = TorchTrainer.from_config(policy, cfg, device)
        if dry:
            from rlpost.rollout.hf import HFRolloutEngine

            eng = HFRolloutEngine(trainer.policy, tok, B, share_weights=False, device=device)
        else:
            from rlpost.rollout.vllm import VLLMRolloutEngine
            from rlpost.rollout.base import EngineConfig

            eng = VLLMRolloutEngine(EngineConfig.of(cfg), trainer.policy, tok)
        gen = eng.generate(prompts, sp)
        batch = batch_from(gen, G)
        tokens = int(gen.prompt_mask.sum() + gen.response_mask.sum())
        before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        m = trainer.policy_update(batch, torch.Generator().manual_seed(0))
        sync(device)
        dt = time.perf_counter() - t0
        after = dict(trainer.policy.named_parameters())
        moved = {n: float((after[n].detach() - w).abs().max()) for n, w in before.items()}
        ad_moved = [v for n, v in moved.items() if ".lora_" in n]
        base_moved = [v for n, v in moved.items() if ".lora_" not in n]
        n_train = sum(p.numel() for p in trainer.policy.parameters() if p.requires_grad)
        report("lora_update", math.isfinite(float(m.get("actor/grad_norm", float("nan")))) and max(ad_moved) > 0
               and max(base_moved) == 0.0,
               f"update {dt:.2f} s ({tokens / dt:,.0f} tokens/s), {n_train:,} trainable parameters; adapter "
               "(lora_B; lora_A gets no gradient while B = 0) "
               f"tensors changed {sum(v > 0 for v in ad_moved)}/{len(ad_moved)}, base max change {max(base_moved):.1e}, "
               f"peak {peak_gib(device):.1f} GiB (threshold: adapters move, base exactly unchanged)",
               seconds=dt, tokens_per_s=tokens / dt, peak_gib=peak_gib(device))
    with guard("lora_push_parity"):
        merged = merged_model(trainer.policy).to(device)
        lp_merged = lp_of(merged, batch)
        lp_trainer, _ = trainer.compute_logprobs(batch)
        mask = batch.response_mask
        stale = masked_abs_mean(lp_of(eng.model, batch) if dry else vllm_prompt_logprobs(eng, batch, lora=True),
                                lp_merged, mask)  # before the push: the engine still has B = 0 (the base model)
        t1 = time.perf_counter()
        eng.sync_weights(trainer.policy)
        push_s = time.perf_counter() - t1
        lp_eng = lp_of(eng.model, batch) if dry else vllm_prompt_logprobs(eng, batch, lora=True)
        d = masked_abs_mean(lp_eng, lp_merged, mask)
        d_tm = masked_abs_mean(lp_trainer, lp_merged, mask)
        t1 = time.perf_counter()
        gen2 = eng.generate(prompts, sp)
        gdt = time.perf_counter() - t1
        report("lora_push_parity", d <= tol and d_tm <= tol and stale >= 3 * d,
               f"push {push_s:.2f} s; |engine - trainer merged weights| per token: stale {stale:.4f}, after push {d:.4f}; "
               f"|trainer PEFT - merged| {d_tm:.4f}; generate with the adapter {gen2.num_tokens / gdt:,.0f} tokens/s "
               f"(threshold: after and PEFT-vs-merged <= {tol}, stale >= 3 x after)",
               gap=d, stale=stale, trainer_vs_merged=d_tm, push_s=push_s, tokens_per_s=gen2.num_tokens / gdt, tol=tol)
        merged = None
    with guard("lora_kl_reference"):
        lp_ref, _ = trainer.compute_logprobs(batch, which="ref")
        lp_base = lp_of(base, batch) if dry else None
        if not dry:  # the trainer's pass runs under its own autocast: compare like with like
            lp_base, _ = TorchTrainer.from_config(base, rl_config(over + ["model.lora.rank=0", "algo.kl.coef=0"]),
                                      device).compute_logprobs(batch)
        with adapters_disabled(trainer.policy):
            lp_off = lp_of(trainer.policy, batch)
        d_ref = masked_abs_mean(lp_ref, lp_base, batch.response_mask)
        d_off = masked_abs_mean(lp_off, lp_of(base, batch), batch.response_mask)
        d_pol = masked_abs_mean(lp_trainer, lp_ref, batch.response_mask)
        rtol = 1e-5 if dry else 1e-3
        report("lora_kl_reference", d_ref <= rtol and d_off <= rtol and d_pol > 10 * rtol,
               f"|reference (adapters disabled) - base model| per token {d_ref:.2e} (trainer pass), {d_off:.2e} "
               f"(direct); policy vs reference {d_pol:.4f} (threshold: reference = base within {rtol}, the adapter "
               "moved the policy)", ref_vs_base=d_ref, policy_vs_ref=d_pol)
    if eng is not None and hasattr(eng, "close"):
        eng.close()
    reset_peak(device)


def vllm_prompt_logprobs(eng, batch, lora: bool = False) -> torch.Tensor:
    """``[B, R]`` vLLM log-probs of the batch's response tokens, scored as prompt tokens (with the pushed adapter)."""
    from vllm import SamplingParams as VSP

    eng._wake("weights")
    eng._wake("kv_cache")
    inputs = []
    for i in range(len(batch)):
        p = batch.prompt_ids[i][batch.prompt_mask[i] > 0].tolist()
        r = batch.response_ids[i][batch.response_mask[i] > 0].tolist()
        inputs.append({"prompt_token_ids": p + r})
    extra = {"lora_request": eng.lora_request} if lora and eng.lora_request is not None else {}
    outs = eng.llm.generate(inputs, VSP(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False, **extra)
    eng.sleep()
    lp = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
    for i, o in enumerate(outs):
        plen = int(batch.prompt_mask[i].sum())
        r = batch.response_ids[i][batch.response_mask[i] > 0].tolist()
        for j, t in enumerate(r):
            v = o.prompt_logprobs[plen + j][t]
            lp[i, j] = float(getattr(v, "logprob", v))
    return lp


# --------------------------------------------------------------------------- main
# --------------------------------------------------------------------------- part fp8
def part_fp8(device: torch.device, shape: str, layers: Optional[int], dry: bool, tmp: Path) -> None:
    """FP8-RL's rollout stack (arXiv:2601.18150): the vLLM settings of precision=rollout_fp8_blockwise on CUDA
    (blockwise fp8 weights, fp8 KV cache with calibrated scales), push parity, and the simulated stack beside it.

    GPU: the engine is built with :func:`rlpost.rollout.fp8_stack.vllm_fp8_kwargs`' settings; checks that vLLM
    holds fp8 linear weights and the fp8 KV cache dtype asked for, that a push moves vLLM's teacher-forced
    log-probs to within 0.3 nats/token of the updated trainer's (stale >= 3 x after), and, with
    calculate_kv_scales, that a push re-arms the Q/K/V scale calibration (the scales change with the weights).
    ``dry`` (CPU): the simulated stack (precision=rollout_fp8_blockwise_sim, hf engine) on the toy shape:
    a mismatch against the trainer, and the key scales recalibrated after a push; the vLLM settings printed.
    """
    from rlpost.rollout.base import EngineConfig
    from rlpost.rollout.fp8_stack import kv_kwargs_for, vllm_fp8_kwargs
    from rlpost.trainer.torch_engine import TorchTrainer

    tok, prompts, sp = vllm_workload(shape)
    if dry:
        prompts, sp = prompts[:8], dataclasses_replace(sp, max_new_tokens=16)
    base = ["trainer.lr=1e-3", "trainer.grad_clip=0", "trainer.micro_batch_size=8", f"rollout.batch_size={len(prompts)}"]
    # the simulated stack on the hf engine (CPU and GPU alike): mismatch and per-step recalibration
    with guard("fp8_sim_stack"):
        from rlpost.rollout import build_engine

        cfg = rl_config(base + ["precision=rollout_fp8_blockwise_sim"])
        policy = build_model(shape, layers, torch.float32, device, seed=1)
        trainer = TorchTrainer.from_config(policy, cfg, device)
        eng = build_engine(EngineConfig.of(cfg), trainer.policy, tok, device)
        sim = eng.convert.kv_sim
        gen = eng.generate(prompts, sp)
        batch = batch_from(gen)
        lp0, _ = trainer.compute_logprobs(batch)
        gap = masked_abs_mean(gen.rollout_logprobs, lp0, gen.response_mask)
        k0 = [s[1] for _, s in sorted(sim.scales.items())]
        trainer.policy_update(batch, torch.Generator().manual_seed(0))
        eng.sync_weights(trainer.policy)
        eng.generate(prompts[:2], sp)
        k1 = [s[1] for _, s in sorted(sim.scales.items())]
        report("fp8_sim_stack", gap > 0 and sim.calibrations == 2 and k1 != k0,
               f"simulated W8A8 + fp8 KV: |rollout - trainer| {gap:.4f} nats/token (> 0), calibrations {sim.calibrations} "
               f"(2 after one push), layer-0 key scale {k0[0]:.4g} -> {k1[0]:.4g} (changes with the weights)",
               gap=gap, calibrations=sim.calibrations)
        del eng, trainer, policy
        reset_peak(device)
    cfg = rl_config(base + ["precision=rollout_fp8_blockwise", "rollout=vllm", "rollout.gpu_memory_utilization=0.35",
                            f"model.cache_dir={tmp / 'fp8'}"])
    if dry:
        old = (["fp8_per_block"], ["calculate_kv_scales"], ["fp8"])
        new = (["fp8_per_block"], [], ["fp8", "fp8_per_token_head"])
        print(f"vLLM settings on CUDA: with calculate_kv_scales {vllm_fp8_kwargs(cfg.precision, 'cuda', *old)}; "
              f"without (vLLM >= 0.12) {vllm_fp8_kwargs(cfg.precision, 'cuda', *new)}")
        return
    with guard("vllm_fp8_blockwise_push"):
        from rlpost.rollout.vllm import VLLMRolloutEngine

        kw = kv_kwargs_for(cfg.precision, "cuda")
        print(f"\n== vLLM FP8-RL stack: {kw} on {shape} with {layers} layers")
        policy = build_model(shape, layers, torch.float32, device, seed=1)
        trainer = TorchTrainer.from_config(policy, cfg, device)
        eng = VLLMRolloutEngine(EngineConfig.of(cfg), trainer.policy, tok)
        dtypes = eng.llm.apply_model(lambda m: sorted({str(p.dtype) for n, p in m.named_parameters() if "proj" in n}))[0]
        cache = str(eng.llm.llm_engine.vllm_config.cache_config.cache_dtype)

        def k_scales(m):
            return [float(x._k_scale) for x in m.modules() if hasattr(x, "_k_scale")][:4]

        ks0 = eng.llm.apply_model(k_scales)[0]
        t0 = time.perf_counter()
        gen = eng.generate(prompts, sp)
        dt = time.perf_counter() - t0
        ks1 = eng.llm.apply_model(k_scales)[0]
        batch = batch_from(gen)
        trainer.policy_update(batch, torch.Generator().manual_seed(0))
        lp1, _ = trainer.compute_logprobs(batch)
        eng.sync_weights(trainer.policy)
        after = vllm_teacher_forced_gap(eng, batch, lp1)
        ks2 = eng.llm.apply_model(k_scales)[0]
        stale = masked_abs_mean(gen.rollout_logprobs, lp1, gen.response_mask)
        report("vllm_fp8_blockwise_weights", any("float8" in d for d in dtypes),
               f"vLLM linear parameter dtypes {dtypes} (an fp8 one expected)", dtypes=dtypes)
        report("vllm_fp8_kv_cache", cache.startswith("fp8"), f"cache_dtype={cache} (fp8* expected)", cache=cache)
        report("vllm_fp8_blockwise_push", after <= 0.3 and stale >= 3 * after,
               f"generate {gen.num_tokens / dt:,.0f} tokens/s; |vLLM - trainer| stale {stale:.4f}, after push {after:.4f} "
               "(threshold: after <= 0.3, stale >= 3 x after)", tokens_per_s=gen.num_tokens / dt, stale=stale, after=after)
        if kw.get("calculate_kv_scales"):
            report("vllm_fp8_kv_recalibrated", ks1 != ks0 and ks2 != ks1,
                   f"layer k_scales at build {ks0}, after the first generate {ks1}, after push + scoring {ks2}", ks=[ks0, ks1, ks2])
        else:
            print(f"(kv_cache_dtype={kw.get('kv_cache_dtype')}: per-token-head scales, no calibration to re-arm; "
                  f"k_scales {ks0} -> {ks2})")
        eng.close()
        del eng, trainer, policy
        reset_peak(device)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["hf", "vllm", "agent", "ray", "dp", "lora", "spec", "fp8", "device_map"],
                    default="hf")
    ap.add_argument("--world", type=int, default=None, help="part dp: at most this many ranks (default: every GPU)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: plan, memory estimates, every hf check on a toy Qwen3")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--vllm-layers", type=int, default=8, help="layers of --shape for the vLLM part")
    ap.add_argument("--json", default=None, help="write the PASS/FAIL records here")
    ap.add_argument("--dp-worker", default=None, help=argparse.SUPPRESS)  # part dp: one torch.distributed.run rank
    a = ap.parse_args(argv)
    if a.dp_worker:
        dp_worker("qwen3-tiny" if a.dry_run else a.shape, None if a.dry_run else a.vllm_layers, a.dry_run,
                  Path(a.dp_worker))
        return 0
    if a.dry_run:
        device, shape = torch.device("cpu"), "qwen3-tiny"
        print("gpu_check --dry-run: CPU, Qwen3 architecture at toy size; estimates below are for a 141 GiB device.")
        print("Plan (GPU part hf): memory budget -> hf engine tokens/s (full shape, bf16) -> torch trainer update "
              "(layers the budget fits) -> weight push parity -> SAO critic -> DeepSpeed ZeRO-2.")
        print("Plan (GPU part vllm): bf16 and fp8 vLLM engines: generate, update, push, teacher-forced parity.")
        ov = ["precision=bf16", "trainer.micro_batch_size=8", "rollout.batch_size=64", "rollout.max_new_tokens=128",
              "trainer.logprob_chunk_size=128"]
        n = layers_that_fit(int(0.8 * 141 * GiB), "qwen3-8b", ov)
        from rlpost.run.memory import estimate, shape_from_config

        b = estimate(rl_config(ov), shape_from_config(hf_config("qwen3-8b", n).to_dict()), 141 * GiB, world_size=1)
        print(f"\n== on a 141 GiB GPU the trainer check would use {n} of Qwen3-8B's 36 layers:\n{b.table()}")
        if a.part == "agent":
            print("Plan (GPU part agent): multi-turn episodes through vLLM: token exactness per call, trainer vs "
                  "rollout log-probs with environment tokens attended, prefix-cache hits on turns 2+.")
            import tempfile

            part_agent(device, shape, None, True, Path(tempfile.mkdtemp(prefix="rlpost_agent_")))
        elif a.part == "ray":
            print("Plan (GPU part ray): a local Ray cluster, 2 vLLM rollout workers: generate, update, push, kill one.")
            import tempfile

            part_ray(device, shape, None, True, Path(tempfile.mkdtemp(prefix="rlpost_ray_")))
        elif a.part == "device_map":
            print("Plan (GPU part device_map): launcher.device_mapping checked against the visible GPUs, rollout "
                  "workers pinned to their mapped devices (UUIDs compared), weight-sync mode, one generate call.")
            import tempfile

            part_device_map(device, True, Path(tempfile.mkdtemp(prefix="rlpost_devmap_")))
        elif a.part == "dp":
            print("Plan (GPU part dp): N ranks (torch.distributed.run), one vLLM engine per GPU, one sharded "
                  "generate call: rows token-exact vs one engine, groups whole per rank, tokens/s per rank, peak memory.")
            import tempfile

            part_dp(shape, None, True, a.world, Path(tempfile.mkdtemp(prefix="rlpost_dp_")))
        elif a.part == "fp8":
            print("Plan (GPU part fp8): FP8-RL's stack: the simulated hf stack (mismatch, per-step KV scale "
                  "recalibration), then vLLM with fp8_per_block weights + fp8 KV cache: dtypes, push parity, scales.")
            import tempfile

            part_fp8(device, shape, None, True, Path(tempfile.mkdtemp(prefix="rlpost_fp8_")))
        elif a.part == "lora":
            print("Plan (GPU part lora): PEFT adapters, one update (base frozen), push to vLLM's LoRA path, vLLM "
                  "log-probs vs the trainer's merged weights, KL reference = base model.")
            import tempfile

            part_lora(device, shape, None, True, Path(tempfile.mkdtemp(prefix="rlpost_lora_")))
        else:
            part_hf(device, shape, dry=True)
    else:
        if not torch.cuda.is_available():
            print("FAIL  gpu: no CUDA GPU visible (use --dry-run on CPU)")
            return 1
        from rlpost.trainer.torchrun import local_device

        device = local_device("cuda")
        p = torch.cuda.get_device_properties(device)
        print(f"GPU: {p.name}, {p.total_memory / GiB:.1f} GiB, torch {torch.__version__}")
        if a.part == "hf":
            part_hf(device, a.shape, dry=False)
        elif a.part == "agent":
            import tempfile

            part_agent(device, a.shape, a.vllm_layers, False, Path(tempfile.mkdtemp(prefix="rlpost_agent_")))
        elif a.part == "ray":
            import tempfile

            part_ray(device, a.shape, a.vllm_layers, False, Path(tempfile.mkdtemp(prefix="rlpost_ray_")))
        elif a.part == "device_map":
            import tempfile

            part_device_map(device, False, Path(tempfile.mkdtemp(prefix="rlpost_devmap_")))
        elif a.part == "dp":
            import tempfile

            part_dp(a.shape, a.vllm_layers, False, a.world, Path(tempfile.mkdtemp(prefix="rlpost_dp_")))
        elif a.part == "lora":
            import tempfile

            part_lora(device, a.shape, a.vllm_layers, False, Path(tempfile.mkdtemp(prefix="rlpost_lora_")))
        elif a.part == "fp8":
            import tempfile

            part_fp8(device, a.shape, a.vllm_layers, False, Path(tempfile.mkdtemp(prefix="rlpost_fp8_")))
        elif a.part == "spec":
            import tempfile

            part_spec(device, a.shape, a.vllm_layers, Path(tempfile.mkdtemp(prefix="rlpost_spec_")))
        else:
            import tempfile

            part_vllm(device, a.shape, a.vllm_layers, Path(tempfile.mkdtemp(prefix="rlpost_vllm_")))
    failed = [r["check"] for r in RESULTS if not r["pass"]]
    print(f"\ngpu_check: {len(RESULTS) - len(failed)}/{len(RESULTS)} passed" + (f"; FAILED: {failed}" if failed else ""))
    if a.json:
        Path(a.json).write_text(json.dumps(RESULTS, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
