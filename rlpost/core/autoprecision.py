"""``precision=auto``: the fastest trainer and rollout dtypes this machine supports.

The default precision preset sets ``trainer_dtype: auto`` and ``rollout_dtype: auto``;
:func:`resolve_precision` replaces them with concrete dtypes before the trainer
and the rollout engine are built, and prints the choice once per process.

* **CUDA**: bf16 for both when the GPU supports it (``torch.cuda.is_bf16_supported``:
  Ampere and later), else fp32. fp16 is never picked automatically: it needs
  loss scaling and can overflow, which is a choice a user should make.
* **CPU without bf16 instructions** (neither ``avx512_bf16`` nor AMX in
  ``/proc/cpuinfo``): fp32; torch emulates bf16 matmuls there at a fraction of
  the fp32 rate.
* **CPU with bf16 instructions**: measured, because having the instructions does
  not make bf16 faster (on an Intel Xeon with avx512_bf16 and no AMX torch 2.13
  ran a 2048^3 matmul at 291 GFLOP/s in fp32 and 154 in bf16; on an AMD EPYC with
  the same flags bf16 was 2.4x faster). About one second of matmuls: a
  training-sized GEMM decides the trainer dtype; the rollout is bf16 only when
  that GEMM and a decode-sized one (32 rows against a weight matrix, where
  reading the weights dominates) are both faster in bf16. (On the Intel Xeon
  above the decode matmul ran faster in bf16, yet the whole bf16 HF engine was
  not: attention, norms and sampling do not gain.) bf16 must beat fp32 by
  :data:`MARGIN` to be picked. The result
  is cached per machine (CPU model, flags, torch version, thread count) in
  ``$RLPOST_CACHE`` or ``~/.cache/rlpost``, so later runs do not measure again.

The choice is an engineering rule, not a paper's; the margin is ours.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

MARGIN = 1.15  # bf16 must be this many times faster than fp32 to be chosen
_PRINTED = False


@dataclass
class PrecisionChoice:
    """The resolved dtypes and why.

    Attributes:
        trainer_dtype: ``fp32`` or ``bf16`` (bf16 = autocast, fp32 master weights).
        rollout_dtype: ``fp32`` or ``bf16``.
        reason: one line for the console.
    """

    trainer_dtype: str
    rollout_dtype: str
    reason: str


def cpu_flags() -> set:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty set where unavailable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    """The CPU model name of ``/proc/cpuinfo`` (or ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def has_bf16_instructions(flags: set) -> bool:
    """True when the CPU has native bf16 dot products (``avx512_bf16`` or AMX bf16)."""
    return bool({"avx512_bf16", "amx_bf16", "avx_ne_convert"} & flags)


def measure_matmul_gflops(seconds: float = 1.0) -> Dict[str, float]:
    """Achieved GFLOP/s of fp32 and bf16 matmuls in two shapes, about ``seconds`` in all.

    ``train``: ``[2048, 576] @ [576, 1536]`` (a SmolLM2-135M MLP projection over a
    micro-batch). ``decode``: ``[32, 576] @ [576, 8192]`` (32 sequences, one token
    each, against a weight bigger than the caches). The fp32 and bf16 runs of
    each shape are interleaved so that load from other processes hits both.

    Returns:
        ``{"train_fp32", "train_bf16", "decode_fp32", "decode_bf16"}`` in GFLOP/s.
    """
    shapes = {"train": (2048, 576, 1536), "decode": (32, 576, 8192)}
    out: Dict[str, float] = {}
    budget = seconds / (2 * len(shapes))
    for name, (m, k, n) in shapes.items():
        a32, b32 = torch.randn(m, k), torch.randn(k, n)
        mats = {"fp32": (a32, b32), "bf16": (a32.bfloat16(), b32.bfloat16())}
        for a, b in mats.values():  # warm-up
            a @ b
        spent = {d: 0.0 for d in mats}
        reps = {d: 0 for d in mats}
        t_end = time.perf_counter() + 2 * budget
        while time.perf_counter() < t_end or min(reps.values()) < 3:
            for d, (a, b) in mats.items():
                t = time.perf_counter()
                a @ b
                spent[d] += time.perf_counter() - t
                reps[d] += 1
        for d in mats:
            out[f"{name}_{d}"] = 2 * m * k * n * reps[d] / max(spent[d], 1e-9) / 1e9
    return out


def choose_precision(
    device_type: str,
    *,
    cuda_bf16: bool = False,
    flags: Optional[set] = None,
    measure: Optional[Callable[[], Dict[str, float]]] = None,
) -> PrecisionChoice:
    """Pick trainer and rollout dtypes from the device, CPU flags and matmul rates.

    Args:
        device_type: ``cuda`` or ``cpu`` (others are treated as cpu).
        cuda_bf16: whether the GPU supports bf16 (``torch.cuda.is_bf16_supported()``).
        flags: CPU feature flags (see :func:`cpu_flags`).
        measure: returns the rates of :func:`measure_matmul_gflops`; called only on
            a CPU with bf16 instructions.
    Returns:
        a :class:`PrecisionChoice`.
    """
    if device_type == "cuda":
        if cuda_bf16:
            return PrecisionChoice("bf16", "bf16", "CUDA with bf16 support")
        return PrecisionChoice("fp32", "fp32", "CUDA without bf16 support")
    flags = flags or set()
    if not has_bf16_instructions(flags):
        return PrecisionChoice("fp32", "fp32", "CPU without avx512_bf16/AMX: bf16 would be emulated")
    r = measure() if measure is not None else measure_matmul_gflops()
    tr = "bf16" if r["train_bf16"] > MARGIN * r["train_fp32"] else "fp32"
    # The rollout engine also runs attention, norms and sampling in its dtype, which a faster
    # decode-shaped matmul alone does not speed up: bf16 rollouts need bf16 compute to win too.
    ro = "bf16" if tr == "bf16" and r["decode_bf16"] > MARGIN * r["decode_fp32"] else "fp32"
    why = (f"CPU with bf16 instructions; matmul GFLOP/s train fp32 {r['train_fp32']:.0f} / bf16 {r['train_bf16']:.0f}, "
           f"decode fp32 {r['decode_fp32']:.0f} / bf16 {r['decode_bf16']:.0f}")
    if ro == "fp32" and r["decode_bf16"] > MARGIN * r["decode_fp32"]:  # else the figures read as contradicting the choice
        why += "; rollouts use bf16 only when training does"
    return PrecisionChoice(tr, ro, why)


def cache_dir() -> Path:
    """``$RLPOST_CACHE`` or ``~/.cache/rlpost``."""
    return Path(os.environ.get("RLPOST_CACHE", Path.home() / ".cache" / "rlpost"))


def _machine_key(flags: set) -> str:
    ident = "|".join([cpu_model(), " ".join(sorted(flags)), torch.__version__, str(torch.get_num_threads())])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _busy() -> bool:
    """Whether more processes wait to run than this machine has cores (1-minute load average)."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return False


def cached_measure(flags: set, path: Optional[Path] = None) -> Callable[[], Dict[str, float]]:
    """A ``measure`` for :func:`choose_precision` that reads/writes this machine's cached rates.

    The cache file (``precision_auto.json``) maps a machine key (CPU model, flags,
    torch version, threads) to the rates; an unreadable file is re-measured. A
    measurement taken while the machine is busy (1-minute load average above its
    core count: other processes took part of the second) is used for this run but
    not cached, so the next run on a quieter machine measures again: contention
    slows fp32 and bf16 kernels by different factors, so a busy measurement can pick
    the slower dtype (on a 2-core Xeon with avx512_bf16: 301 fp32 / 163 bf16 GFLOP/s
    idle, 30 / 26 beside a package install).
    """
    path = path or cache_dir() / "precision_auto.json"

    def measure() -> Dict[str, float]:
        key = _machine_key(flags)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        if key in data and isinstance(data[key], dict):
            return data[key]
        rates = measure_matmul_gflops()
        if _busy():
            return rates
        data[key] = rates
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)
        except OSError:
            pass
        return rates

    return measure


def resolve_precision(cfg, device: torch.device, log: Callable[[str], None] = None) -> Optional[PrecisionChoice]:
    """Replace ``auto`` in ``cfg.precision.trainer_dtype`` / ``rollout_dtype`` by concrete dtypes (in place).

    ``cfg`` is anything with a ``precision`` DictConfig: a run config or an
    :class:`rlpost.rollout.base.EngineConfig` (whose precision node is the run's own).

    Idempotent: a config without ``auto`` is left alone and None is returned.
    The choice is printed once per process (to stderr, or through ``log``).
    """
    from omegaconf import open_dict

    p = cfg.precision
    if p.trainer_dtype != "auto" and p.rollout_dtype != "auto":
        return None
    dev = torch.device(device)
    if dev.type == "cuda":
        choice = choose_precision("cuda", cuda_bf16=bool(torch.cuda.is_bf16_supported()))
    else:
        flags = cpu_flags()
        choice = choose_precision("cpu", flags=flags, measure=cached_measure(flags))
    with open_dict(p):  # cfg may be a run config or an EngineConfig; its precision node is a DictConfig
        if p.trainer_dtype == "auto":
            p.trainer_dtype = choice.trainer_dtype
        if p.rollout_dtype == "auto":
            p.rollout_dtype = choice.rollout_dtype
    global _PRINTED
    if not _PRINTED:
        _PRINTED = True
        msg = f"precision=auto: trainer {p.trainer_dtype}, rollout {p.rollout_dtype} ({choice.reason})"
        (log or (lambda s: print(s, file=sys.stderr)))(msg)
    return choice
