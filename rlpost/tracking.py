"""Run logging: metrics.jsonl (always), Weights & Biases (online or offline), console.

``logger=wandb`` runs online when ``WANDB_API_KEY`` is set (or the machine is
logged in) and the mode is ``auto``/``online``, and offline otherwise, writing
under ``<run dir>/wandb`` so ``wandb sync <run dir>/wandb/offline-run-*``
uploads it later.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import Any, Dict, Optional


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class RunLogger:
    """Writes one JSON line per step to ``metrics.jsonl`` and mirrors it to W&B.

    Args:
        run_dir: the run directory.
        backend: wandb | jsonl | none (none still writes metrics.jsonl).
        config: resolved config dict (sent to W&B).
        name, project, entity, mode, tags: W&B settings.
        resume_step: when resuming, drop lines with ``step`` greater than this.
    """

    def __init__(
        self,
        run_dir: Path,
        backend: str = "jsonl",
        config: Optional[Dict[str, Any]] = None,
        name: str = "run",
        project: str = "rlpost",
        entity: Optional[str] = None,
        mode: str = "auto",
        tags: Optional[list] = None,
        resume_step: Optional[int] = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            keep = []
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", -1) <= resume_step:
                        keep.append(line)
                except json.JSONDecodeError:
                    continue
            self.path.write_text("".join(k + "\n" for k in keep))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._fh = open(self.path, "a")
        self.wandb = None
        self.wandb_mode: Optional[str] = None
        if backend == "wandb":
            self._init_wandb(config or {}, name, project, entity, mode, tags or [])

    def _init_wandb(self, config, name, project, entity, mode, tags) -> None:
        import wandb

        if mode == "auto":
            has_key = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").exists() and "api.wandb.ai" in (
                Path.home() / ".netrc"
            ).read_text()
            mode = "online" if has_key and os.environ.get("WANDB_MODE") != "offline" else "offline"
        id_file = self.run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self.wandb = wandb.init(
            project=project,
            entity=entity,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),
            mode=mode,
            config=config,
            tags=list(tags),
            settings=wandb.Settings(silent=True, console="off"),
        )
        self.wandb_mode = mode

    def log(self, metrics: Dict[str, Any]) -> None:
        """Append one record (must contain ``step``)."""
        rec = {k: _clean(v) for k, v in metrics.items()}
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()
        if self.wandb is not None:
            step = rec.get("step")
            self.wandb.log({k: v for k, v in rec.items() if k != "step" and v is not None}, step=step)

    def close(self) -> None:
        """Flush and finish the W&B run."""
        self._fh.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
