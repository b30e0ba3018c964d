"""Rollout engines. :func:`build_engine` picks one from the config."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

from rlpost.core.errors import ConfigError
from rlpost.rollout.base import EngineConfig, GenerationResult, RolloutEngine, SamplingParams  # noqa: F401
from rlpost.core.autoprecision import resolve_precision
from rlpost.rollout.hf import HFRolloutEngine
from rlpost.rollout.fp8_stack import precision_converter
from rlpost.rollout.mtp_draft import mtp_engine
from rlpost.rollout.precision import rollout_converter
from rlpost.rollout.self_spec import MTP_DRAFTER, SelfSpeculativeEngine, check_speculative, speculative_settings  # noqa: F401

ROLLOUT_DTYPES = ("fp32", "bf16", "fp16")


def build_engine(ec: EngineConfig, policy: torch.nn.Module, tokenizer: Any, device: torch.device,
                 run_dir: Any = None, prompts: Any = None) -> RolloutEngine:
    """The rollout engine named by ``ec.rollout.engine`` for ``policy``.

    With ``rollout.speculative`` set, the hf engine is wrapped by the self-speculative engine
    (:mod:`rlpost.rollout.self_spec`: a quantised copy of the policy drafts, the policy verifies),
    or, with ``drafter=mtp_head``, by the MTP-head engine (:mod:`rlpost.rollout.mtp_draft`), whose
    head is read from ``rollout.speculative.mtp_head_path`` or ``<run_dir>/mtp_head.pt``, or fitted
    here on ``prompts(n)`` (``n`` token-id training prompts) and saved to ``run_dir``.

    ``hf`` shares the trainer's module when the rollout dtype is the trainer's master dtype (fp32)
    and ``ec.share_weights`` allows it, and otherwise keeps a converted copy that is refreshed after
    each update.

    Args:
        ec: the engine's config sections (:class:`EngineConfig`; ``EngineConfig.of(cfg)`` from a run config).
    Raises:
        TypeError: ``ec`` is not an :class:`EngineConfig` (a whole run config: pass ``EngineConfig.of(cfg)``).
        ConfigError: unknown engine or rollout dtype, or bad speculative settings
            (:func:`wrap_speculative`).
    """

    _check_engine_config(ec)
    spec = speculative_settings(ec.rollout, ec.model)  # before building: a bad setting stops the run before any weights move
    return wrap_speculative(ec, _plain_engine(ec, policy, tokenizer, device), spec, policy=policy,
                            run_dir=run_dir, prompts=prompts)


def _check_engine_config(ec: Any) -> None:
    if not isinstance(ec, EngineConfig):
        raise TypeError(f"rollout engines are built from an EngineConfig (its rollout, precision, model sections and "
                        f"seed), got {type(ec).__name__}. Fix: pass rlpost.rollout.EngineConfig.of(cfg).")


def _plain_engine(ec: EngineConfig, policy: torch.nn.Module, tokenizer: Any, device: torch.device) -> RolloutEngine:
    """:func:`build_engine` without the speculative wrapper."""

    resolve_precision(ec, device)  # precision=auto (no-op when already concrete)
    rd = ec.precision.rollout_dtype
    if ec.rollout.engine == "vllm":
        from rlpost.rollout.vllm import VLLMRolloutEngine  # lazy: vLLM is optional and GPU-only

        # one engine per torchrun rank, on the rank's current device (external launcher)
        return VLLMRolloutEngine(ec, policy, tokenizer, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    if ec.rollout.engine != "hf":
        raise ConfigError(f"Unknown rollout engine rollout.engine={ec.rollout.engine!r}. Valid choices: hf, vllm.")

    # FP8-RL's stack (rlpost.rollout.fp8_stack): blockwise W8A8 weights / an fp8 KV cache with recalibrated scales
    if rd == "fp8_blockwise_sim" or str(ec.precision.get("kv_cache", "none") or "none") != "none":
        base = None if rd in ("fp32", "fp8_blockwise_sim") else _cast_converter(rd) if rd in ("bf16", "fp16") \
            else rollout_converter(rd)
        return HFRolloutEngine(policy, tokenizer, ec.rollout.batch_size, share_weights=False,
                               convert=precision_converter(ec.precision, base), device=device)
    if rd == "fp32":
        return HFRolloutEngine(policy, tokenizer, ec.rollout.batch_size, share_weights=ec.share_weights, device=device)
    if rd in ("bf16", "fp16"):
        return HFRolloutEngine(policy, tokenizer, ec.rollout.batch_size, share_weights=False, convert=_cast_converter(rd),
                               device=device)
    try:
        from rlpost.rollout.precision import rollout_converter
    except ImportError:
        rollout_converter = None
    if rollout_converter is None:
        raise ConfigError(f"precision.rollout_dtype={rd!r} is not available; valid: {', '.join(ROLLOUT_DTYPES)}.")
    return HFRolloutEngine(
        policy, tokenizer, ec.rollout.batch_size, share_weights=False, convert=rollout_converter(rd), device=device
    )


def _cast_converter(rd: str) -> Any:
    """The bf16 / fp16 rollout copy's converter: a dtype cast, marked invertible (weights refreshed in place)."""
    dt = torch.bfloat16 if rd == "bf16" else torch.float16

    def cast(m: torch.nn.Module) -> torch.nn.Module:
        return m.to(dt)

    cast.dtype_cast = True  # invertible: weights are refreshed in place, not rebuilt
    return cast


def wrap_speculative(ec: EngineConfig, engine: Any, c: Optional[Dict[str, Any]] = None, policy: Any = None,
                     run_dir: Any = None, prompts: Any = None) -> Any:
    """``engine`` wrapped for ``rollout.speculative`` when it is set, else ``engine`` itself.

    A quantised drafter gives a :class:`rlpost.rollout.self_spec.SelfSpeculativeEngine`; ``drafter=mtp_head`` gives a
    :class:`rlpost.rollout.mtp_draft.MTPSpeculativeEngine` whose head is loaded or fitted once here
    (:func:`rlpost.rollout.mtp_draft.mtp_engine`).

    Args:
        ec: the engine's config sections (:class:`EngineConfig`).
        engine: the plain hf engine.
        c: settings already checked by :func:`rlpost.rollout.self_spec.speculative_settings` (checked here when None).
        policy: the trainer's policy (drafter=mtp_head: the head is fitted on it; None: ``engine.model``).
        run_dir: the run directory (drafter=mtp_head: ``mtp_head.pt`` is reused from / saved there).
        prompts: ``fn(n) -> n`` token-id prompts of the task's training split (drafter=mtp_head:
            what the head's fit samples the policy on; None: the head must come from a file).
    Raises:
        TypeError: ``ec`` is not an :class:`EngineConfig`.
        ConfigError: see :func:`rlpost.rollout.self_spec.speculative_settings` and :func:`rlpost.rollout.mtp_draft.mtp_engine`.
    """

    _check_engine_config(ec)
    c = speculative_settings(ec.rollout, ec.model) if c is None else c
    if c is None:
        return engine
    if c["drafter"] == MTP_DRAFTER:
        return mtp_engine(ec, engine, c, policy=policy, run_dir=run_dir, prompts=prompts)
    return SelfSpeculativeEngine(engine, rollout_converter(c["drafter"]), switch_batch=c["switch_batch"],
                                 draft_len=c["draft_len"], min_draft_len=c["min_draft_len"],
                                 max_draft_len=c["max_draft_len"], adaptive=c["adaptive"])
