"""Sweep summaries: one ``summary.json`` and ``summary.md`` per Hydra multirun directory.

``rlpost train -m ...`` runs every combination through a Hydra launcher: the
default (one job after another in this process), ``hydra/launcher=joblib``
(local processes in parallel, the ``hydra-joblib-launcher`` plugin) or
``hydra/launcher=submitit_slurm`` (SLURM jobs, the ``hydra-submitit-launcher``
plugin; ``submitit_local`` runs the same jobs as local processes). Whichever
launcher runs the jobs, :class:`SweepSummary` (a Hydra callback set in
``conf/config.yaml``) rewrites the sweep's summary after every job and once
more at the end, so the sweep directory has one file listing each job's
overrides, status and final metrics, even when a job failed and Hydra stopped
the sweep.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.experimental.callback import Callback
from rlpost.run.checkpoint import DONE_MARKER, FAILED_MARKER

SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"

#: Final-step metrics copied into the summary (when the run logged them).
FINAL_KEYS = ("reward/mean", "response/length_mean", "actor/entropy", "actor/clip_frac", "actor/kl_ref",
              "actor/approx_kl")


def _overrides(job_dir: Path) -> List[str]:
    f = job_dir / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return []
    from omegaconf import OmegaConf

    return [str(o) for o in (OmegaConf.load(f) or [])]


def _job_num(job_dir: Path) -> int:
    head = job_dir.name.split("_", 1)[0]
    return int(head) if head.isdigit() else 1 << 30


def job_summary(job_dir: Path) -> Dict[str, Any]:
    """One job's row: overrides, status, steps logged, wall time and final metrics.

    ``status`` is ``done`` (``DONE`` written), ``failed`` (``FAILED`` written,
    ``error`` holds its first line) or ``incomplete`` (running, killed, or not
    started). ``train_wall_s`` sums the logged ``time/step_s`` and evaluation
    ``time_s`` (model loading and checkpoint writing are not in it).
    ``final`` holds the last logged value of each :data:`FINAL_KEYS` metric;
    ``eval`` the held-out accuracy of ``eval.json`` with its 95% bootstrap CI.
    """

    row: Dict[str, Any] = {"job": job_dir.name, "overrides": _overrides(job_dir)}
    if (job_dir / DONE_MARKER).is_file():
        row["status"] = "done"
    elif (job_dir / FAILED_MARKER).is_file():
        row["status"] = "failed"
        row["error"] = ((job_dir / FAILED_MARKER).read_text().splitlines() or [""])[0]
    else:
        row["status"] = "incomplete"
    final: Dict[str, float] = {}
    steps, wall = 0, 0.0
    mpath = job_dir / "metrics.jsonl"
    if mpath.is_file():
        for line in mpath.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            wall += float(rec.get("time/step_s") or 0.0) + sum(
                float(v or 0.0) for k, v in rec.items() if k.startswith("eval/") and k.endswith("/time_s"))
            if rec.get("step", 0) > 0 and "reward/mean" in rec:
                steps = max(steps, int(rec["step"]))
            for k in FINAL_KEYS:
                if rec.get(k) is not None:
                    final[k] = float(rec[k])
    row["steps"] = steps
    row["train_wall_s"] = round(wall, 3)
    row["final"] = final
    ev = job_dir / "eval.json"
    if ev.is_file():
        try:
            res = json.loads(ev.read_text())
            row["eval"] = {k: res[k] for k in ("task", "accuracy", "ci_low", "ci_high", "n") if k in res}
        except (json.JSONDecodeError, TypeError):
            row["eval"] = None
    return row


def write_summary(sweep_dir: str | Path) -> Optional[Path]:
    """Write ``summary.json`` and ``summary.md`` in ``sweep_dir`` from its job directories.

    A job directory is a child holding ``.hydra/overrides.yaml``; jobs are listed
    in job-number order. Files are replaced atomically (parallel jobs may
    finish together). Returns the JSON path, or None when the folder holds no job.
    """
    sweep = Path(sweep_dir)
    if not sweep.is_dir():
        return None
    jobs = sorted((d for d in sweep.iterdir() if (d / ".hydra" / "overrides.yaml").is_file()),
                  key=lambda d: (_job_num(d), d.name))
    if not jobs:
        return None
    rows = [job_summary(d) for d in jobs]
    payload = {"sweep_dir": str(sweep), "n_jobs": len(rows),
               "status": {s: sum(r["status"] == s for r in rows) for s in ("done", "failed", "incomplete")},
               "jobs": rows}
    _atomic_write(sweep / SUMMARY_JSON, json.dumps(payload, indent=1))
    _atomic_write(sweep / SUMMARY_MD, format_markdown(payload))
    return sweep / SUMMARY_JSON


def format_markdown(payload: Dict[str, Any]) -> str:
    """The summary as a Markdown table (one row per job)."""
    st = payload["status"]
    lines = [f"# Sweep {payload['sweep_dir']}", "",
             f"{payload['n_jobs']} jobs: {st['done']} done, {st['failed']} failed, {st['incomplete']} incomplete.", "",
             "| job | overrides | status | steps | reward/mean | held-out accuracy (95% CI) | length | wall s |",
             "|---|---|---|---|---|---|---|---|"]

    def f(v: Optional[float], fmt: str = "{:.3f}") -> str:
        return "" if v is None else fmt.format(v)

    for r in payload["jobs"]:
        ev = r.get("eval") or {}
        acc = ""
        if ev.get("accuracy") is not None:
            acc = f"{ev['accuracy']:.3f}"
            if ev.get("ci_low") is not None:
                acc += f" [{ev['ci_low']:.3f}, {ev['ci_high']:.3f}]"
        status = r["status"] + (f": {r['error']}" if r.get("error") else "")
        lines.append(f"| {r['job'].split('_', 1)[0]} | {' '.join(r['overrides'])} | {status} | {r['steps']} | "
                     f"{f(r['final'].get('reward/mean'))} | {acc} | {f(r['final'].get('response/length_mean'), '{:.1f}')} | "
                     f"{r['train_wall_s']:.1f} |")
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _sweep_dir(config: Any) -> Optional[Path]:
    try:
        return Path(str(config.hydra.sweep.dir))
    except Exception:  # noqa: BLE001 - no sweep dir: nothing to summarise
        return None


def summarize_current_sweep() -> None:
    """Rewrite the summary of the sweep this Hydra job belongs to (nothing outside a multirun).

    Called by the CLI when a job fails: Hydra calls no callback after a job that
    exits (``sys.exit``) or stops the sweep, so the failed job is recorded here.
    Never raises.
    """
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            write_summary(Path(str(hc.sweep.dir)))
    except Exception:  # noqa: BLE001 - a summary must never hide the job's own error
        pass


class SweepSummary(Callback):
    """Hydra callback: rewrite the sweep's summary after each job and at the end of the multirun.

    Runs wherever the launcher runs the hook (the launching process, a joblib
    worker or a SLURM node; the sweep directory must be on a shared file system
    for SLURM, as Hydra's own outputs already require). A single run
    (``rlpost train`` without ``-m``) writes no summary.
    """

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        """After each job of a multirun (in the process that ran it): rewrite the summary."""
        from hydra.types import RunMode

        try:
            if config.hydra.mode != RunMode.MULTIRUN:
                return
        except Exception:  # noqa: BLE001
            return
        d = _sweep_dir(config)
        if d is not None:
            write_summary(d)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        """After the last job (in the launching process): the final summary."""
        d = _sweep_dir(config)
        if d is not None:
            write_summary(d)
