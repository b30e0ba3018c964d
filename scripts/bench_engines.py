#!/usr/bin/env python
"""Seconds per RL step for the update engines and executors on the same config.

Usage::

    python scripts/bench_engines.py                     # default config (SmolLM2-135M), 3 steps each
    python scripts/bench_engines.py --steps 4 -o model=tiny rollout.max_new_tokens=12

Settings: ``trainer=torch`` (= ``executor=sync``), ``trainer=deepspeed`` on 1
and 2 processes (ZeRO-2, gloo on CPU), and ``executor=async``
(``max_staleness=1``), with and without partial rollouts. Each runs as its own ``rlpost train`` process (so
DeepSpeed's two-process case goes through the real torchrun launch), logging to
a temporary directory. The first step is a warm-up and is excluded.

Columns: median wall seconds per step (``time/step_s`` of rank 0), its
min-max, median update seconds (``time/update_s``), and CPU seconds per step of
all processes of the run (``RUSAGE_CHILDREN`` delta over the run, start-up
included, divided by the step count). On a shared machine wall time is noisy;
CPU time is the steadier measure of work, wall time the measure of overlap
(the asynchronous executor trades no CPU for wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = [
    ("trainer=torch, executor=sync", ["trainer=torch", "executor=sync"]),
    ("trainer=deepspeed, 1 proc (ZeRO-2)", ["trainer=deepspeed", "trainer.num_procs=1", "trainer.zero_stage=2"]),
    ("trainer=deepspeed, 2 procs (ZeRO-2)", ["trainer=deepspeed", "trainer.num_procs=2", "trainer.zero_stage=2"]),
    ("executor=async (max_staleness=1)", ["trainer=torch", "executor=async", "executor.max_staleness=1"]),
    ("executor=async + partial rollouts (APRIL, 16-token rounds, over-provision 1.5)",
     ["trainer=torch", "executor=async", "executor.max_staleness=1", "executor.partial_rollout=true",
      "executor.partial_chunk_tokens=16", "executor.over_provision=1.5"]),
]


def run(name, overrides, steps, extra, root):
    run_dir = Path(root) / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    args = [sys.executable, "-m", "rlpost.cli", "train", *overrides, f"steps={steps}", "eval.at_start=false", "eval.at_end=false",
            "checkpoint.every=0", "logger=jsonl", *extra, f"hydra.run.dir={run_dir}"]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    p = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    wall = time.time() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        return {"name": name, "error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"}
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = recs[1:] or recs
    st = [r["time/step_s"] for r in steady]
    up = [r["time/update_s"] for r in steady]
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    return {"name": name, "step_s": statistics.median(st), "min": min(st), "max": max(st),
            "update_s": statistics.median(up), "cpu_per_step": cpu / steps, "run_wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="steps per setting (the first is a warm-up)")
    ap.add_argument("-o", "--overrides", nargs="*", default=[], help="extra Hydra overrides for every setting")
    ap.add_argument("--only", nargs="*", type=int, help="indices of SETTINGS to run")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlpost_bench_engines_") as root:
        for i, (name, ov) in enumerate(SETTINGS):
            if a.only and i not in a.only:
                continue
            rows.append(run(name, ov, a.steps, a.overrides, root))
            print(f"done: {name}", file=sys.stderr, flush=True)
    print(f"\nsteps={a.steps} (first excluded), overrides: {' '.join(a.overrides) or '(default config)'}")
    print("| setting | s/step median | s/step min-max | update s | CPU s/step (all procs) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | error: {r['error']} | | | |")
        else:
            print(f"| {r['name']} | {r['step_s']:.2f} | {r['min']:.2f}-{r['max']:.2f} | {r['update_s']:.2f} | {r['cpu_per_step']:.1f} |")


if __name__ == "__main__":
    main()
