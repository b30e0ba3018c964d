"""LoRA adapters on the policy through Hugging Face PEFT (``model.lora.rank > 0``).

LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685) freezes the pretrained weight ``W`` of each targeted linear
layer and trains ``W + (alpha / r) B A`` with ``A`` ``[r, in]`` and ``B``
``[out, r]`` (``B`` starts at zero, so step 0 is the base model).

rlpost injects PEFT's LoRA layers *in place* (``peft.inject_adapter_in_model``):
the policy stays the same ``transformers`` causal LM object (its decoder and LM
head still separable for the log-prob kernel), with ``q_proj`` etc. replaced by
``peft.tuners.lora.Linear`` wrappers. Everything PEFT-specific the run needs is
here:

* :func:`apply_lora`: inject adapters; only their parameters require grad, so the
  trainers' optimizers (which take ``requires_grad`` parameters) hold nothing else.
* :func:`adapters_disabled`: the base model (the KL reference policy) on the same
  weights, no second copy.
* :func:`adapter_state_dict` / :func:`load_adapter_state_dict`: what checkpoints hold.
* :func:`merged_state_dict` / :func:`merged_model`: ``W + (alpha/r) B A`` under the
  plain Hugging Face names, for rollout engines and the merged ``final/`` export.
* :func:`save_adapter`: a PEFT adapter directory (``adapter_config.json`` +
  ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` and vLLM's
  ``LoRARequest`` load.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch

from rlpost.core.errors import ConfigError

ADAPTER = "default"  # PEFT's adapter name; rlpost trains one adapter
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Key prefix of adapter files written by ``PeftModel.save_pretrained`` (its wrapper's path to the
# causal LM), which ``PeftModel.from_pretrained`` and vLLM's LoRA loader expect.
PEFT_FILE_PREFIX = "base_model.model."


def lora_rank(model_cfg: Any) -> int:
    """``model.lora.rank`` as an int (0 when LoRA is off: rank 0, null or no ``lora`` key)."""
    lora = getattr(model_cfg, "lora", None) if not hasattr(model_cfg, "get") else model_cfg.get("lora")
    if lora is None:
        return 0
    r = lora.get("rank") if hasattr(lora, "get") else getattr(lora, "rank", 0)
    return int(r or 0)


def check_lora_config(model_cfg: Any) -> None:
    """Value checks of ``model.lora`` (the schema checks the keys and types).

    Raises:
        ConfigError: a negative rank, alpha <= 0, dropout outside [0, 1), or an empty
            ``target_modules`` with LoRA on.
    """
    r = lora_rank(model_cfg)
    if r < 0:
        raise ConfigError(f"model.lora.rank={r} is negative. Fix: a positive rank (e.g. 16), or 0 for full fine-tuning.")
    if r == 0:
        return
    lc = model_cfg.lora
    if float(lc.alpha) <= 0:
        raise ConfigError(f"model.lora.alpha={lc.alpha} must be > 0 (the update is scaled by alpha / rank). "
                          "Fix: e.g. model.lora.alpha=32 for rank 16.")
    if not 0.0 <= float(lc.dropout) < 1.0:
        raise ConfigError(f"model.lora.dropout={lc.dropout} must be in [0, 1). Fix: model.lora.dropout=0.05.")
    mts = list(getattr(lc, "modules_to_save", None) or [])
    if mts:
        raise ConfigError(
            f"model.lora.modules_to_save={mts} is not supported: a fully trained copy of those modules would need "
            "the KL reference to switch back to the base copies, every rollout engine and the merged export to take "
            "them, and vLLM's LoRA path to load them; none is built. Fix: model.lora.modules_to_save=[] (train the "
            "module with an adapter: add it to model.lora.target_modules), or full fine-tuning (model.lora.rank=0).")
    if not list(lc.target_modules or []):
        raise ConfigError("model.lora.target_modules is empty: no layer would get an adapter. "
                          "Fix: e.g. model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj].")


def apply_lora(model: torch.nn.Module, lora_cfg: Any) -> torch.nn.Module:
    """Inject LoRA adapters into ``model`` in place and freeze everything else.

    **No adapter dropout, in any pass.** PEFT applies ``lora_dropout`` whenever the module is in
    train mode, i.e. in the update's forward, while the rollout, old and reference log-probs run
    without it: on fully on-policy data the PPO ratio was then not 1 (``ratio_max`` 1.0456,
    ``approx_kl`` 3.8e-4 at ``model.lora.dropout=0.1``). TRL and OpenRLHF switch dropout off for RL
    for this reason; so does rlpost: every adapter's dropout is the identity, and
    ``model.lora.dropout`` is only recorded in the exported ``adapter_config.json`` (for later
    supervised use). rsLoRA ("A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA",
    Kalajdzievski, arXiv:2312.03732) scales by ``alpha / sqrt(rank)`` instead of ``alpha / rank``
    (``model.lora.use_rslora``, PEFT's ``use_rslora``).

    Args:
        model: a Hugging Face causal LM.
        lora_cfg: ``model.lora`` (``rank``, ``alpha``, ``dropout``, ``target_modules``, ``use_rslora``).
    Returns:
        the same ``model`` object, with ``peft.tuners.lora`` layers around each targeted
        ``nn.Linear``; only ``lora_A`` / ``lora_B`` parameters require grad. ``B`` is
        zero-initialised (PEFT's default), so the model's outputs are unchanged.
    Raises:
        ConfigError: no module of the model matches ``target_modules``; ``modules_to_save`` set.
    """
    from peft import LoraConfig, inject_adapter_in_model

    mts = list(getattr(lora_cfg, "modules_to_save", None) or [])
    if mts:
        raise ConfigError(f"model.lora.modules_to_save={mts} is not supported. Fix: model.lora.modules_to_save=[] "
                          "(see rlpost.models.lora.check_lora_config).")
    targets = [str(t) for t in lora_cfg.target_modules]
    pc = LoraConfig(r=int(lora_cfg.rank), lora_alpha=float(lora_cfg.alpha), lora_dropout=float(lora_cfg.dropout),
                    target_modules=targets, bias="none", use_rslora=bool(getattr(lora_cfg, "use_rslora", False)))
    try:
        model = inject_adapter_in_model(pc, model, adapter_name=ADAPTER)
    except ValueError as e:  # PEFT: "Target modules {...} not found in the base model"
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(f"model.lora.target_modules={targets} matches no layer of this model "
                          f"({str(e).splitlines()[0][:120]}). Fix: choose from its linear layers: "
                          f"{', '.join(names)}.") from None
    for layer in _lora_layers(model):  # no adapter dropout in any pass: the on-policy ratio stays exactly 1
        if ADAPTER in getattr(layer, "lora_dropout", {}):
            layer.lora_dropout[ADAPTER] = torch.nn.Identity()
    return model


def is_lora(model: Any) -> bool:
    """True when ``model`` carries PEFT LoRA layers (built by :func:`apply_lora`)."""
    return isinstance(model, torch.nn.Module) and bool(getattr(model, "peft_config", None))


def _lora_layers(model: torch.nn.Module) -> List[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run ``model`` as its base model: every LoRA layer returns ``base_layer(x)`` inside the block.

    PEFT's ``BaseTunerLayer.enable_adapters(False)`` per layer (what
    ``PeftModel.disable_adapter()`` does); re-enabled on exit, including after an
    exception. PEFT sets the adapters' ``requires_grad`` to False while disabled;
    each adapter parameter's flag is restored exactly on exit (an optimizer or a
    DeepSpeed engine holding them sees no change). Meant for no-grad passes (the
    KL reference).
    """
    layers = _lora_layers(model)
    flags = [(p, p.requires_grad) for layer in layers for n, p in layer.named_parameters() if ".lora_" in "." + n]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, f in flags:
            p.requires_grad_(f)


def adapter_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The adapter weights in PEFT's file naming (``...q_proj.lora_A.weight``), detached CPU clones."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}


def load_adapter_state_dict(model: torch.nn.Module, sd: Dict[str, torch.Tensor]) -> None:
    """Load :func:`adapter_state_dict` output (or an ``adapter_model.safetensors``, whose keys carry
    PEFT's ``base_model.model.`` prefix) into ``model``.

    Raises:
        RuntimeError: a key of the model's adapters is missing from ``sd`` (shape or
            rank mismatch included): a checkpoint of another ``model.lora`` config.
    """
    from peft import set_peft_model_state_dict

    n = len(PEFT_FILE_PREFIX)
    sd = {(k[n:] if k.startswith(PEFT_FILE_PREFIX) else k): v for k, v in sd.items()}
    res = set_peft_model_state_dict(model, sd, adapter_name=ADAPTER)
    missing = [k for k in getattr(res, "missing_keys", []) if ".lora_" in k]
    if missing:
        raise RuntimeError(f"adapter weights missing for {len(missing)} LoRA tensors (e.g. {missing[0]}): the "
                           "checkpoint was written with other model.lora settings")


def save_adapter(model: torch.nn.Module, path: Path, base_model: Optional[str] = None) -> Path:
    """Write a PEFT adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors``.

    Loadable by ``peft.PeftModel.from_pretrained(base, path)`` and by vLLM's
    ``LoRARequest(name, id, path)``. ``base_model`` is recorded as
    ``base_model_name_or_path`` (a hub id or directory; None for ``model=tiny``).
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    pc = model.peft_config[ADAPTER]
    d = pc.to_dict()
    d["base_model_name_or_path"] = base_model
    d["target_modules"] = sorted(d["target_modules"]) if isinstance(d.get("target_modules"), (set, list)) else d.get("target_modules")
    d["inference_mode"] = True
    (path / ADAPTER_CONFIG).write_text(json.dumps(d, indent=1, default=str))
    save_file({PEFT_FILE_PREFIX + k: v.contiguous() for k, v in adapter_state_dict(model).items()},
              str(path / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    return path


def is_adapter_dir(path: Path) -> bool:
    """True when ``path`` holds a PEFT adapter written by :func:`save_adapter` (or PEFT itself)."""
    return (Path(path) / ADAPTER_CONFIG).exists() and (Path(path) / ADAPTER_WEIGHTS).exists()


def read_adapter(path: Path) -> tuple:
    """``(lora settings dict for model.lora, adapter state dict)`` of an adapter directory."""
    from safetensors.torch import load_file

    d = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    tm = d.get("target_modules")
    settings = {"rank": int(d["r"]), "alpha": float(d["lora_alpha"]), "dropout": float(d.get("lora_dropout", 0.0)),
                "target_modules": sorted(tm) if isinstance(tm, (list, set)) else [tm],
                "use_rslora": bool(d.get("use_rslora", False))}
    return settings, load_file(str(Path(path) / ADAPTER_WEIGHTS))


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module, with_adapters: bool = True) -> Dict[str, torch.Tensor]:
    """The model's weights under plain Hugging Face names, adapters merged: ``W + (alpha/r) B A``.

    Args:
        model: a LoRA model (:func:`apply_lora`).
        with_adapters: False returns the frozen base weights (no delta).
    Returns:
        ``{hf_name: tensor}`` as the model without adapters would have them
        (``...q_proj.weight``; ``base_layer.`` removed, ``lora_*`` dropped); merged
        weights are new tensors in the base weight's dtype, the rest are the live
        parameters (not copies). The delta is PEFT's own ``get_delta_weight``.
    """
    out: Dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if ".lora_" in k:
            continue
        out[k.replace(".base_layer.", ".")] = v
    if with_adapters:
        for name, mod in model.named_modules():
            if name and hasattr(mod, "get_delta_weight") and ADAPTER in getattr(mod, "lora_A", {}):
                w = mod.get_base_layer().weight
                out[f"{name}.weight"] = w + mod.get_delta_weight(ADAPTER).to(w.dtype)
    return out


def merged_model(model: torch.nn.Module, with_adapters: bool = True) -> torch.nn.Module:
    """A plain ``transformers`` model (no PEFT layers) holding :func:`merged_state_dict` (copies), in eval mode."""
    from transformers import AutoModelForCausalLM

    dtype = next(model.parameters()).dtype
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    sd = {k: v.detach().clone() for k, v in merged_state_dict(model, with_adapters).items()}
    plain.load_state_dict(sd, strict=False, assign=True)
    if getattr(plain.config, "tie_word_embeddings", False):
        plain.tie_weights()
    missing = [n for n, p in plain.named_parameters() if p.is_meta]
    if missing:  # pragma: no cover - a model family whose names the merge does not cover
        raise RuntimeError(f"merged model lacks weights for {missing[:3]}")
    for name, buf in list(plain.named_buffers()):  # non-persistent buffers (rotary inv_freq) live outside state_dict
        if buf.is_meta:
            src = dict(model.named_buffers()).get(name)
            if src is None:
                src = dict(model.named_buffers()).get(name.replace(".base_layer.", "."))
            mod_name, _, leaf = name.rpartition(".")
            plain.get_submodule(mod_name).register_buffer(leaf, src.detach().clone(), persistent=False)
    plain.generation_config = getattr(model, "generation_config", plain.generation_config)
    return plain.eval().requires_grad_(False)


def check_model_config(cfg: Any) -> None:
    """``model``: the LoRA settings (:func:`check_lora_config`).

    Raises:
        ConfigError: as :func:`check_lora_config`.
    """
    check_lora_config(cfg.model)


def remove_lora(model: torch.nn.Module) -> torch.nn.Module:
    """Take every LoRA layer out of ``model`` in place: each ``peft.tuners.lora`` wrapper is replaced by
    its ``base_layer`` (the original ``nn.Linear``, never merged into), and PEFT's ``peft_config``
    attribute is dropped, so the model is again the plain one :func:`apply_lora` received.

    Used by transient per-problem adapters (``eval.test_time``; Policy of Thoughts, arXiv:2601.20379);
    :func:`apply_lora` then :func:`remove_lora` leaves every base weight bit for bit as it was (the
    base layers are the same tensors; only the adapters' ``A``/``B`` were trained). ``requires_grad``
    flags are not restored here (``apply_lora`` froze the base); the caller keeps them.

    Returns:
        the same ``model`` object.
    """
    from peft.tuners.lora import LoraLayer

    for name, mod in list(model.named_modules()):
        if name and isinstance(mod, LoraLayer):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, mod.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model
