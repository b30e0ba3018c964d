"""Atomic checkpoints and resume: one map of stateful components, saved and loaded here.

Layout: ``<run dir>/checkpoints/step_000010/`` holding ``policy/`` (Hugging Face
format, loadable by ``rlpost eval eval.checkpoint=...``), ``trainer.pt`` (the
``trainer`` component: optimizer, scheduler, critic, reference) and ``state.pt``
(the step, the global RNG states and every other component's ``state_dict()``
under its name: selector, sampler, algorithm state such as MSSR's Beta tracker
and HAPO's entropy statistics, the update generator, the partial-rollout
buffer). A checkpoint is written to ``step_N.tmp`` and renamed into place, so a
crash mid-write never leaves a partial checkpoint.

The runner lists its stateful components once (:meth:`rlpost.run.runner.Run.stateful`);
:func:`save_checkpoint` and :func:`load_checkpoint` both walk that map, so a new
stateful component is one line there. A component is anything with
``state_dict()`` / ``load_state_dict(sd)``; ``None`` entries (a component this
config does not build) are skipped on save and on load.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from rlpost.core.errors import RlpostError
from rlpost.models.loader import resolve_model_dir, save_hf  # noqa: F401  (save_hf: re-exported)
from rlpost.core.errors import ConfigError
from rlpost.models.lora import (
    ADAPTER_WEIGHTS,
    is_adapter_dir,
    is_lora,
    load_adapter_state_dict,
    merged_model,
    save_adapter,
)

DONE_MARKER = "DONE"
FAILED_MARKER = "FAILED"
TRAINER_KEY = "trainer"  # the one component stored in its own file (large; collective under DeepSpeed)


def rng_state() -> Dict[str, Any]:
    """Python, NumPy and torch RNG states."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(s: Dict[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])


class GeneratorState:
    """Adapts a ``torch.Generator`` to the ``state_dict`` / ``load_state_dict`` protocol."""

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen

    def state_dict(self) -> torch.Tensor:
        """The generator's state (a uint8 tensor)."""
        return self.gen.get_state()

    def load_state_dict(self, sd: torch.Tensor) -> None:
        """Restore :meth:`state_dict`."""
        self.gen.set_state(sd)


def save_policy(policy, tokenizer, path: Path, base_model: Optional[str] = None) -> None:
    """Save the policy into ``path``: Hugging Face format, or for a LoRA policy only its adapter.

    A LoRA policy (:func:`rlpost.models.lora.is_lora`) is written as a PEFT adapter
    directory (``adapter_config.json`` + ``adapter_model.safetensors``, plus the
    tokenizer): the frozen base weights are the model config's, so a checkpoint
    holds only what training changed. Anything else: :func:`save_hf`.
    """

    if is_lora(policy):
        save_adapter(policy, path, base_model)
        tokenizer.save_pretrained(path)
    else:
        save_hf(policy, tokenizer, path)


def export_final(policy, tokenizer, path: Path, model_cfg: Any = None) -> None:
    """Write the run's ``final/``: the trained policy in Hugging Face format.

    LoRA (``model.lora.rank > 0``): the adapter goes to ``final/adapter/`` and, with
    ``model.lora.export_merged`` (default), the merged model ``W + (alpha/r) B A``
    (:func:`rlpost.models.lora.merged_model`) to ``final/`` itself, loadable by
    ``transformers.AutoModelForCausalLM.from_pretrained`` and ``rlpost eval``;
    without it ``final/`` holds the adapter (and the tokenizer) only.
    """

    path = Path(path)
    if not is_lora(policy):
        save_hf(policy, tokenizer, path)
        return
    base = None
    if model_cfg is not None and str(model_cfg.source) != "tiny":
        base = resolve_model_dir(model_cfg)
    merged = model_cfg is None or bool(model_cfg.lora.get("export_merged", True))
    if merged:
        save_hf(merged_model(policy), tokenizer, path)
        save_adapter(policy, path / "adapter", base)
    else:
        save_adapter(policy, path, base)
        tokenizer.save_pretrained(path)


def collect_states(components: Dict[str, Any]) -> Dict[str, Any]:
    """``{name: component.state_dict()}`` for every non-None component.

    Call it on every rank: the DeepSpeed trainer's ``state_dict`` is a collective.
    """
    return {k: c.state_dict() for k, c in components.items() if c is not None}


def resolve_keep_last(cfg: Any, device: Any) -> int:
    """``checkpoint.keep_last`` made concrete in ``cfg`` (in place) and returned.

    ``null`` (the default) keeps 1 checkpoint for full fine-tuning on a CPU and 2 otherwise. On a
    CPU the default run's checkpoint is 1.6 GB (SmolLM2-135M in fp32, mostly Adam's moments), a
    second one only lets a run go back one more checkpoint, and one is enough to resume: a
    checkpoint is written to ``step_N.tmp`` and renamed, and the older one is removed only after
    that, so a kill during a write leaves the previous one. A LoRA checkpoint holds the adapter
    only (small), and GPU runs are longer and worth a spare.

    Raises:
        ConfigError: ``keep_last`` < 1.
    """
    from omegaconf import open_dict

    k = cfg.checkpoint.get("keep_last")
    if k is None:
        lora = int((cfg.model.get("lora") or {}).get("rank", 0) or 0) > 0
        k = 1 if str(getattr(device, "type", device)) == "cpu" and not lora else 2
        with open_dict(cfg):
            cfg.checkpoint.keep_last = k
    if int(k) < 1:
        raise ConfigError(f"checkpoint.keep_last={k}: keep at least 1 checkpoint (resume=auto needs one), "
                          f"or null for the default (1 on CPU with full fine-tuning, else 2)")
    return int(k)


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.data_ptr(), t.numel())
        if key not in seen:  # tied weights (embeddings and LM head) are one tensor, saved once
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _tokenizer_bytes(tokenizer: Any) -> int:
    """About the size of the tokenizer files ``save_pretrained`` writes (its ``tokenizer.json``); 0 if unknown."""
    try:
        return len(tokenizer.backend_tokenizer.to_str(pretty=True).encode())  # save_pretrained writes it pretty
    except Exception:  # a slow (Python) tokenizer: its files are small next to the weights
        return 0


def estimate_disk(trainer: Any, keep_last: int, tokenizer: Any = None) -> Dict[str, float]:
    """Expected disk use of a run directory, in bytes, from the trainer's modules.

    One checkpoint holds the policy (a LoRA policy: its trainable adapter only), the
    optimizer's two moments per trainable weight (Adam/AdamW, the trainers' optimizers), a
    critic with its moments and a reference model when the run has them; ``final/`` holds the
    full policy. Both hold the tokenizer's files (``tokenizer``: counted when given). The default run (SmolLM2-135M, fp32) comes to 0.54 + 1.08 GB per checkpoint
    and 0.54 GB for ``final/``, as measured (README). Returns ``{"checkpoint", "final",
    "total"}`` with ``total = keep_last * checkpoint + final``.
    """

    policy = trainer.policy
    trainable = _tensor_bytes(p for p in policy.parameters() if p.requires_grad)
    full = _tensor_bytes(list(policy.state_dict().values()))
    tok = _tokenizer_bytes(tokenizer) if tokenizer is not None else 0
    ckpt = (trainable if is_lora(policy) else full) + 2 * trainable + tok
    full += tok
    critic = getattr(trainer, "critic", None)
    if critic is not None:
        ckpt += _tensor_bytes(list(critic.state_dict().values())) + 2 * _tensor_bytes(
            p for p in critic.parameters() if p.requires_grad)
    ref = getattr(trainer, "ref", None)
    if ref is not None:
        ckpt += _tensor_bytes(list(ref.state_dict().values()))
    return {"checkpoint": float(ckpt), "final": float(full), "total": float(keep_last * ckpt + full)}


def disk_line(run_dir: Path, est: Dict[str, float], keep_last: int) -> str:
    """The start-of-run line: the run directory and its expected disk use (:func:`estimate_disk`)."""
    gb = 1e9
    return (f"run directory: {run_dir} (expected disk use about {est['total'] / gb:.2f} GB: "
            f"{keep_last} checkpoint(s) of {est['checkpoint'] / gb:.2f} GB (checkpoint.keep_last={keep_last}) "
            f"and final/ {est['final'] / gb:.2f} GB; one more checkpoint while the next is written)")


def save_checkpoint(run_dir: Path, step: int, policy, tokenizer, states: Dict[str, Any],
                    keep_last: int = 2) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the newest ``keep_last``.

    Args:
        run_dir: the run directory (checkpoints go to ``run_dir/checkpoints``).
        step: RL steps completed.
        policy, tokenizer: saved in Hugging Face format under ``policy/``.
        states: :func:`collect_states` of the run's components; ``trainer`` goes to
            ``trainer.pt``, the rest to ``state.pt``.
        keep_last: complete checkpoints to keep (at least 1).
    Returns:
        the checkpoint directory.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_policy(policy, tokenizer, tmp / "policy")
    states = dict(states)
    torch.save(states.pop(TRAINER_KEY, {}), tmp / "trainer.pt")
    torch.save({**states, "step": step, "rng": rng_state()}, tmp / "state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    ckpts = sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp"))
    for old in ckpts[: max(0, len(ckpts) - max(1, keep_last))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(ckpt: Path, policy, components: Dict[str, Any]) -> int:
    """Load checkpoint ``ckpt`` into ``policy`` and ``components``; returns its step.

    The policy weights come from ``policy/*.safetensors`` (tied embeddings re-tied;
    a LoRA policy's adapter from ``policy/adapter_model.safetensors``),
    ``trainer`` from ``trainer.pt``, every other component from its entry in
    ``state.pt`` (a component absent from an older checkpoint keeps its fresh
    state), then the global RNG states.
    """
    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    if is_lora(policy) != is_adapter_dir(ckpt / "policy"):
        held, run = (("full weights", "trains LoRA (model.lora.rank > 0)") if is_lora(policy)
                     else ("a LoRA adapter", "has model.lora.rank=0"))
        raise RlpostError(f"{ckpt} holds {held} but this run {run}. Fix: resume with the model.lora settings of "
                          f"the run that wrote it, or start a fresh run.")
    if is_lora(policy):
        try:
            load_adapter_state_dict(policy, load_file(str(ckpt / "policy" / ADAPTER_WEIGHTS)))
        except RuntimeError as e:
            raise RlpostError(f"{ckpt}: {e}. Fix: resume with the same model.lora settings.") from None
    else:
        sd: Dict[str, torch.Tensor] = {}
        for f in sorted((ckpt / "policy").glob("*.safetensors")):
            sd.update(load_file(str(f)))
        policy.load_state_dict(sd, strict=False)
        if getattr(policy.config, "tie_word_embeddings", False):
            policy.tie_weights()
    state = torch.load(ckpt / "state.pt", weights_only=False)
    for name, comp in components.items():
        if comp is None:
            continue
        if name == TRAINER_KEY:
            comp.load_state_dict(torch.load(ckpt / "trainer.pt", weights_only=False))
        elif state.get(name) is not None:
            comp.load_state_dict(state[name])
    set_rng_state(state["rng"])
    return int(state["step"])


def describe_checkpoint(ckpt: Path) -> str:
    """One line naming what a checkpoint holds and its size on disk, e.g. for the interrupt message."""
    ckpt = Path(ckpt)
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    parts: List[str] = ["policy weights"]
    if (ckpt / "trainer.pt").exists():
        parts.append("optimizer/trainer state")
    try:
        names = [k for k in torch.load(ckpt / "state.pt", weights_only=False) if k not in ("step", "rng")]
    except Exception:  # pragma: no cover - a description must never fail
        names = []
    parts += names + ["RNG states"]
    return f"{ckpt} ({', '.join(parts)}; {size / 2**20:.1f} MiB)"


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """Newest complete checkpoint of a run directory, or None."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return None
    ckpts = sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp") and (p / "state.pt").exists())
    return ckpts[-1] if ckpts else None


def find_resume_checkpoint(resume: Optional[str], run_dir: Path) -> Optional[Path]:
    """Resolve ``resume`` into a checkpoint directory.

    * None: fresh run.
    * ``auto``: the latest checkpoint of ``run_dir``; else of the newest
      unfinished sibling run directory (same parent, i.e. same run name); else
      None (a fresh run).
    * a run directory or a ``checkpoints/step_N`` directory.

    Raises:
        RlpostError: an explicit path that holds no checkpoint.
    """
    if resume in (None, "", "none", "null"):
        return None
    run_dir = Path(run_dir)
    if resume == "auto":
        c = latest_checkpoint(run_dir)
        if c is not None:
            return c
        parent = run_dir.parent
        if parent.exists():
            sibs = sorted((p for p in parent.iterdir() if p.is_dir() and p != run_dir), key=lambda p: p.stat().st_mtime, reverse=True)
            for s in sibs:
                if (s / DONE_MARKER).exists():
                    continue
                c = latest_checkpoint(s)
                if c is not None:
                    return c
        return None
    p = Path(resume).expanduser()
    if (p / "state.pt").exists():
        return p
    c = latest_checkpoint(p)
    if c is None:
        raise RlpostError(f"resume={resume!r}: no checkpoint found there. Fix: pass a run directory that has "
                          f"checkpoints/step_*/ or resume=auto.")
    return c
