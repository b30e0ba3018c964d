"""``rollout=vllm`` + ``rollout.speculative``: vLLM's own speculative decoding for rollouts.

Pure functions (tested without vLLM or a GPU) that turn ``rollout.speculative`` into the
``speculative_config`` argument of ``vllm.LLM`` (``vllm/config/speculative.py``
``SpeculativeConfig``; keys used here: ``method``, ``num_speculative_tokens``, ``model``,
``quantization``, ``prompt_lookup_max``, ``prompt_lookup_min``). This module owns the keys of
``rollout.speculative`` when ``rollout.engine=vllm``; :mod:`rlpost.rollout.self_spec` owns them
for ``rollout=hf``.

Methods:

* ``mtp``: the checkpoint's own multi-token-prediction layers draft (DeepSeek-V3 / MiMo / GLM-4.5
  / Qwen3-Next style ``num_nextn_predict_layers`` or ``mtp_num_hidden_layers`` in the config). This
  is the rollout set-up of Bebop ("Breaking Entropy Bounds: Accelerating RL Training via MTP with
  Rejection Sampling", Li, Jiang, Xu et al., arXiv:2606.12370): MTP drafts verified by
  probabilistic rejection sampling (vLLM's default for temperature > 0), MTP heads trained before
  RL and not updated during it. A model whose config declares no MTP layers is refused
  (:class:`~rlpost.core.errors.ConfigError`). The trainer (transformers) does not load MTP weights, so
  the directory rlpost writes for vLLM's start has none; the drafter therefore loads from
  ``rollout.speculative.model`` or, by default, ``model.path`` (the original checkpoint). The
  weight push after each update reaches the target model only: the MTP layers keep their
  pre-RL weights, as Bebop recommends.
* ``ngram``: prompt-lookup drafts (no drafter weights; ``prompt_lookup_max`` / ``_min``).
* ``draft_model``: a separate small model (``rollout.speculative.model``, required).
* ``self``: the vLLM counterpart of ``rollout=hf_self_spec`` (EfficientRollout, arXiv:2606.18967):
  vLLM's ``draft_model`` method with the policy's own starting weights as the drafter, quantised
  with ``quantization`` (e.g. ``fp8``; vLLM quantises the bf16 checkpoint on load). Differences
  from the hf engine, all from vLLM: the drafter is loaded once and not refreshed by the weight
  push (``LLM.apply_model`` / ``reload_weights`` reach the target model only), so acceptance falls
  as the policy drifts while exactness holds; vLLM speculates for every row (no row-count toggle)
  with a fixed ``num_speculative_tokens`` (no adaptive draft length).

Exactness: vLLM's rejection sampler keeps the target model's distribution for temperature > 0
(lossless speculative decoding; for ``draft_model`` it is passed no draft probabilities, which
amounts to a one-hot proposal: still exact, lower acceptance). Log-probs with speculation need
vLLM >= 0.14: before, a request asking for log-probs silently turned speculation off
(``is_spec_decode_unsupported`` in ``vllm/v1/spec_decode/utils.py``), so :data:`MIN_VLLM_SPEC`
is enforced by the engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from rlpost.core.errors import ConfigError

#: ``rollout.speculative`` keys for rollout=vllm and their defaults
VLLM_SPEC_DEFAULTS: Dict[str, Any] = {
    "method": None,
    "num_speculative_tokens": 1,
    "model": None,
    "quantization": None,
    "prompt_lookup_max": None,
    "prompt_lookup_min": None,
}
VLLM_SPEC_METHODS = ("mtp", "ngram", "draft_model", "self")
#: vLLM returns log-probs together with speculative decoding only from 0.14 on (see module docstring)
MIN_VLLM_SPEC = (0, 14, 0)
#: config fields that declare a checkpoint's multi-token-prediction layers
MTP_CONFIG_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "mtp_num_layers", "n_mtp_layers")


def mtp_layers(hf_config: Any) -> int:
    """Number of MTP layers a Hugging Face config declares (0: none).

    Reads :data:`MTP_CONFIG_FIELDS` on the config and on its ``text_config`` (multimodal wrappers);
    ``hf_config`` is a ``PretrainedConfig`` or a plain dict (``config.json``).

    Returns:
        The largest declared count (int >= 0).
    """
    def get(obj: Any, k: str) -> Any:
        return obj.get(k) if isinstance(obj, Mapping) else getattr(obj, k, None)

    holders = [hf_config]
    sub = get(hf_config, "text_config")
    if sub is not None:
        holders.append(sub)
    n = 0
    for h in holders:
        for k in MTP_CONFIG_FIELDS:
            v = get(h, k)
            if isinstance(v, int) and not isinstance(v, bool):
                n = max(n, v)
    return n


def vllm_spec_settings(spec: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """``rollout.speculative`` for rollout=vllm checked and completed, or None when unset.

    Raises:
        ConfigError: an unknown key (the hf engine's ``drafter`` / ``switch_batch`` ... included:
            they have no vLLM meaning), a method outside :data:`VLLM_SPEC_METHODS`,
            ``num_speculative_tokens < 1``, ``draft_model`` without ``model``, prompt-lookup
            bounds on a method other than ``ngram`` or with ``min > max``.
    """
    if not spec:
        return None
    given = dict(spec)
    bad = sorted(set(given) - set(VLLM_SPEC_DEFAULTS))
    if bad:
        raise ConfigError(f"rollout.speculative has key(s) {bad} that rollout=vllm does not take; valid: "
                          f"{', '.join(VLLM_SPEC_DEFAULTS)} (drafter/switch_batch/draft_len are rollout=hf's)")
    c = {**VLLM_SPEC_DEFAULTS, **given}
    if c["method"] is None:
        return None
    m = str(c["method"])
    if m not in VLLM_SPEC_METHODS:
        raise ConfigError(f"rollout.speculative.method={m!r} is unknown; valid: {', '.join(VLLM_SPEC_METHODS)} "
                          "(or null: off)")
    c["method"] = m
    k = int(c["num_speculative_tokens"])
    if k < 1:
        raise ConfigError(f"rollout.speculative.num_speculative_tokens must be >= 1, got {k}")
    c["num_speculative_tokens"] = k
    if m == "draft_model" and not c["model"]:
        raise ConfigError("rollout.speculative.method=draft_model needs rollout.speculative.model=<draft model "
                          "path or hub id> (or use method=self for a quantised copy of the policy)")
    lo, hi = c["prompt_lookup_min"], c["prompt_lookup_max"]
    if (lo is not None or hi is not None) and m != "ngram":
        raise ConfigError("rollout.speculative.prompt_lookup_min/max apply to method=ngram only")
    if lo is not None and hi is not None and int(lo) > int(hi):
        raise ConfigError(f"rollout.speculative needs prompt_lookup_min <= prompt_lookup_max, got {lo} > {hi}")
    if c["quantization"] is not None and m not in ("self", "draft_model"):
        raise ConfigError("rollout.speculative.quantization applies to method=self or draft_model only "
                          "(vLLM quantises draft-model weights only)")
    return c


def read_hf_config(model_dir: str) -> Dict[str, Any]:
    """``<model_dir>/config.json`` as a dict ({} when absent: a hub id vLLM resolves itself)."""
    p = Path(model_dir) / "config.json"
    if not p.exists():
        return {}
    return json.loads(p.read_text())


def vllm_speculative_config(c: Optional[Dict[str, Any]], hf_config: Any, model_dir: str,
                            checkpoint: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The ``speculative_config`` dict for ``vllm.LLM`` from checked settings (pure).

    Args:
        c: output of :func:`vllm_spec_settings` (None: no speculation).
        hf_config: the policy's config (``PretrainedConfig`` or ``config.json`` dict), for the MTP check.
        model_dir: the directory vLLM starts the target from (the policy's weights, written by rlpost).
        checkpoint: the original checkpoint (``model.path``), where MTP layers live.
    Returns:
        None, or e.g. ``{"method": "mtp", "num_speculative_tokens": 2, "model": "/ckpt"}``,
        ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}``,
        ``{"method": "draft_model", "num_speculative_tokens": 3, "model": model_dir,
        "quantization": "fp8"}`` (method=self).
    Raises:
        ConfigError: method=mtp on a model whose config declares no MTP layers, or without a
            checkpoint to load them from.
    """
    if c is None:
        return None
    m, k = c["method"], int(c["num_speculative_tokens"])
    out: Dict[str, Any] = {"method": m, "num_speculative_tokens": k}
    if m == "mtp":
        n = mtp_layers(hf_config)
        if n == 0:
            raise ConfigError("rollout.speculative.method=mtp needs a model with multi-token-prediction heads, and "
                              f"this model's config declares none ({'/'.join(MTP_CONFIG_FIELDS)} unset). Fix: a "
                              "model with MTP layers (e.g. DeepSeek-V3, MiMo, Qwen3-Next), or method=ngram / self")
        src = c["model"] or checkpoint
        if not src:
            raise ConfigError("rollout.speculative.method=mtp loads the MTP layers from the original checkpoint; "
                              "set model.path or rollout.speculative.model")
        out["model"] = str(src)
    elif m == "ngram":
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            if c[key] is not None:
                out[key] = int(c[key])
    elif m == "draft_model":
        out["model"] = str(c["model"])
        if c["quantization"]:
            out["quantization"] = str(c["quantization"])
    elif m == "self":
        out["method"] = "draft_model"
        out["model"] = str(model_dir)
        if c["quantization"]:
            out["quantization"] = str(c["quantization"])
    return out
