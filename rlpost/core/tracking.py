"""Run logging: metrics.jsonl (always), Weights & Biases (online or offline), console, cli.log.

Messages for the user go to the ``rlpost`` logger (:data:`log`); under the CLI,
Hydra's job logging (``hydra.job_logging`` in ``conf/config.yaml``) sends them
to the console as bare lines and to ``<run dir>/cli.log`` with timestamps.
One line per step goes to ``rlpost.step``, which reaches ``cli.log`` only
(:class:`ConsoleFilter`): the console has the progress bar.

``logger=wandb`` runs online when ``WANDB_API_KEY`` is set (or the machine is
logged in) and the mode is ``auto``/``online``, and offline otherwise, writing
under ``<run dir>/wandb`` so ``wandb sync <run dir>/wandb/offline-run-*``
uploads it later.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

log = logging.getLogger("rlpost")


#: loggers whose records below ERROR stay off the console (``cli.log`` still gets them): Ray's start-up
#: notices ("Started a local Ray instance", the token-authentication notice), routed here by launcher=ray
QUIET_LOGGERS = ("ray",)


class ConsoleFilter(logging.Filter):
    """Keeps the per-step lines (logger ``rlpost.step``) and :data:`QUIET_LOGGERS`' chatter below ERROR off
    the console; ``cli.log`` still gets them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("rlpost.step"):
            return False
        quiet = any(record.name == q or record.name.startswith(q + ".") for q in QUIET_LOGGERS)
        return not (quiet and record.levelno < logging.ERROR)


class OnceFilter(logging.Filter):
    """Lets each distinct message through once (console warnings: a library's retry notice is shown once)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


class BelowWarning(logging.Filter):
    """Passes records below WARNING (the stdout handler's share; warnings and errors go to stderr)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


def step_seconds(m: Dict[str, Any]) -> Optional[str]:
    """A step's seconds as both the console progress bar and ``cli.log`` print them (``"12.3 s/step"``).

    The one definition: ``time/step_s``, the wall time of that step's rollout, reward and
    update; evaluations and checkpoint writes between steps are not in it (they have their
    own lines). None when the metrics have no ``time/step_s``.
    """
    v = m.get("time/step_s")
    return None if v is None else f"{float(v):.1f} s/step"


def step_line(m: Dict[str, Any], steps: int) -> str:
    """One human-readable line for a step's metrics (for ``cli.log``)."""
    parts = [f"step {int(m.get('step', 0))}/{steps}"]
    for key, fmt in (("reward/mean", "reward {:.3f}"), ("response/length_mean", "length {:.1f}"),
                     ("loss/policy", "loss {:.4f}"), ("eval/accuracy", "eval/accuracy {:.3f}")):
        if m.get(key) is not None:
            parts.append(fmt.format(float(m[key])))
    if step_seconds(m) is not None:
        parts.append(step_seconds(m))
    return "  ".join(parts)


def eval_line(res: Dict[str, Any], when: str) -> str:
    """One line for an evaluation's result and time (for ``cli.log`` and ``rlpost eval``'s console).

    ``when`` says which evaluation (``"at step 0"``, ``"of the base model"``); ``res`` is an
    :func:`rlpost.eval.evaluate.evaluate` result (``task``, ``n``, ``accuracy``, its CI, ``time_s``).
    """
    ci = (f" 95% CI [{res['ci_low']:.3f}, {res['ci_high']:.3f}]" if res.get("ci_low") is not None else "")
    took = f" in {_duration(float(res['time_s']))}" if res.get("time_s") is not None else ""
    return f"evaluation {when}: {res.get('task', '?')} accuracy {float(res['accuracy']):.3f}{ci} (n={res.get('n', '?')}){took}"


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


def resolve_wandb_mode(mode: str) -> str:
    """``logger.mode`` as W&B takes it: ``auto`` becomes ``online`` when an API key is set (``WANDB_API_KEY``
    or a ``~/.netrc`` entry for api.wandb.ai) and ``WANDB_MODE`` is not ``offline``, else ``offline``."""
    if mode != "auto":
        return mode
    netrc = Path.home() / ".netrc"
    has_key = bool(os.environ.get("WANDB_API_KEY")) or netrc.exists() and "api.wandb.ai" in netrc.read_text()
    return "online" if has_key and os.environ.get("WANDB_MODE") != "offline" else "offline"


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
        self.wandb_info: Optional[Dict[str, Any]] = None  # mode, run directory, URL, offline segments; kept after close()
        if backend == "wandb":
            self._init_wandb(config or {}, name, project, entity, mode, tags or [])

    def _init_wandb(self, config, name, project, entity, mode, tags) -> None:
        import wandb

        mode = resolve_wandb_mode(mode)
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
        run_path = Path(self.wandb.dir).parent  # <run dir>/wandb/<offline-run|run>-<time>-<id>
        url = (getattr(self.wandb, "url", None) or "") if mode == "online" else ""  # offline: wandb warns on .url
        self.wandb_info = {"mode": mode, "dir": str(run_path), "url": url}
        if mode == "offline":
            # a resumed run (same id) writes a new offline-run-<time>-<id> folder per segment; `wandb sync` given
            # them all uploads them in order of start time into one run, given only the last it drops the others
            segs = sorted(str(p) for p in (self.run_dir / "wandb").glob(f"offline-run-*-{run_id}") if p.is_dir())
            self.wandb_info["segments"] = segs if str(run_path) in segs else segs + [str(run_path)]

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


def _read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _acc(res: Optional[Dict[str, Any]]) -> str:
    if not res or res.get("accuracy") is None:
        return "not evaluated"
    ci = f" [{res['ci_low']:.3f}, {res['ci_high']:.3f}]" if res.get("ci_low") is not None else ""
    return f"{res['accuracy']:.3f}{ci}"


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600} h {s % 3600 // 60} min" if s >= 3600 else (f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s")


def format_summary(run_dir: Path, cfg: Any, wall_s: float, peak_mb: Dict[str, float],
                   wandb: Optional[Dict[str, str]] = None) -> str:
    """The closing summary of a finished run (several lines).

    Reads ``metrics.jsonl`` (reward and response length at the start and end:
    means over the first and last ``min(5, max(1, steps // 2))`` logged steps: the two windows never
    overlap),
    ``eval_start.json`` (base accuracy, ``eval.at_start``) and ``eval.json``
    (final accuracy); accuracies carry their 95% bootstrap CIs.

    Args:
        run_dir: the run directory.
        cfg: the run's config (task name, steps).
        wall_s: wall time in seconds.
        peak_mb: ``{"rss": MiB}`` and optionally ``{"cuda": MiB}``.
        wandb: :attr:`RunLogger.wandb_info` or None (no W&B). Offline, ``segments`` lists the
            offline-run folders of this run id (one per resume), all named in the upload command.
    """
    run_dir = Path(run_dir)
    recs: List[Dict[str, Any]] = []
    mpath = run_dir / "metrics.jsonl"
    if mpath.exists():
        for line in mpath.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("step", 0) > 0 and r.get("reward/mean") is not None:
                recs.append(r)
    base, final = _read_json(run_dir / "eval_start.json"), _read_json(run_dir / "eval.json")
    n = (final or base or {}).get("n")
    lines = [f"done: {cfg.name}, {len(recs)} step{'' if len(recs) == 1 else 's'}"]
    lines.append(f"  held-out accuracy ({cfg.task.name}{f', n={n}' if n else ''}, 95% CI): "
                 f"base {_acc(base)} -> final {_acc(final)}")
    if recs:
        k = min(5, max(1, len(recs) // 2))  # disjoint windows (3 steps: step 1 -> step 3, not 1-2 -> 2-3)
        first, lastk = recs[:k], recs[-k:]

        def mean(rs: List[Dict[str, Any]], key: str) -> float:
            v = [float(r[key]) for r in rs if r.get(key) is not None]
            return sum(v) / max(1, len(v))

        span = lambda rs: f"steps {rs[0]['step']}-{rs[-1]['step']}" if len(rs) > 1 else f"step {rs[0]['step']}"  # noqa: E731
        lines.append(f"  reward/mean: {mean(first, 'reward/mean'):.3f} ({span(first)}) -> "
                     f"{mean(lastk, 'reward/mean'):.3f} ({span(lastk)})")
        lines.append(f"  response length: {mean(first, 'response/length_mean'):.1f} -> "
                     f"{mean(lastk, 'response/length_mean'):.1f} tokens")
    mem = f"peak memory {peak_mb['rss'] / 1024:.2f} GiB resident"
    if "cuda" in peak_mb:
        mem += f", {peak_mb['cuda'] / 1024:.2f} GiB GPU"
    lines.append(f"  wall time {_duration(wall_s)}, {mem}")
    lines.append(f"  run directory: {run_dir}")
    if final is not None:
        lines.append(f"  eval.json: {run_dir / 'eval.json'}")
    if wandb:
        if wandb.get("mode") == "offline":
            segs = wandb.get("segments") or [wandb["dir"]]
            earlier = len(segs) - 1
            lines.append(f"  W&B (offline): {wandb['dir']}" + (
                f" (and {earlier} earlier segment{'s' if earlier > 1 else ''}: the run was resumed)" if earlier else ""))
            lines.append(f"  upload with: wandb sync {' '.join(segs)}")
        else:
            lines.append(f"  W&B: {wandb.get('url') or wandb['dir']}")
    return "\n".join(lines)
