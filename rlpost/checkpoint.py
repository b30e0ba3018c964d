"""Atomic checkpoints and resume.

Layout: ``<run dir>/checkpoints/step_000010/`` holding ``policy/`` (Hugging Face
format, loadable by ``rlpost eval eval.checkpoint=...``), ``trainer.pt``
(optimizer, scheduler, critic, reference), ``state.pt`` (step, RNG states,
selector, sampler and algorithm state, e.g. MSSR's Beta tracker and HAPO's
entropy statistics). A checkpoint is written to ``step_N.tmp`` and
renamed into place, so a crash mid-write never leaves a partial checkpoint.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

from rlpost.errors import RlpostError

DONE_MARKER = "DONE"


def rng_state() -> Dict[str, Any]:
    """Python, NumPy and torch RNG states."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(s: Dict[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])


def save_checkpoint(run_dir: Path, step: int, policy, tokenizer, trainer_state: Dict[str, Any],
                    state: Dict[str, Any], keep_last: int = 2) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the newest ``keep_last``.

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
    policy.save_pretrained(tmp / "policy")
    tokenizer.save_pretrained(tmp / "policy")
    torch.save(trainer_state, tmp / "trainer.pt")
    torch.save({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    ckpts = sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp"))
    for old in ckpts[: max(0, len(ckpts) - max(1, keep_last))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


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
