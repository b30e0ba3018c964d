"""How rlpost's step slows down beside CPU-bound competing processes, per OpenMP wait policy.

Runs a step workload alone and beside 1 and 3 competing CPU-bound processes
(``python -c "while True: pass"``), all pinned to the same ``--cores`` CPUs,
and prints seconds per step and the slowdown against running alone, next to the
fair-share slowdown ``max(1, (threads + competitors) / cores)`` that a
scheduler splitting the cores evenly would give. Each figure is measured under
two OpenMP wait policies: the runtime's default (idle threads spin at barriers
before sleeping; "before") and ``PASSIVE`` (they sleep; rlpost's default since
this script was written, "after").

Workloads:

* default: ``rlpost train`` with the default config (SmolLM2-135M, 8 prompts x 8
  samples x 32 tokens, one update), ``--steps`` steps, evaluation and the
  periodic checkpoints off; the figure is the mean ``time/step_s`` of the steps
  after the first.
* ``--proxy``: a torch-only stand-in of the same shapes (SmolLM2-135M's linear
  layers: 30 layers of 576 -> 960 / 576 -> 576 / 576 -> 3072 / 1536 -> 576 and a
  576 -> 49152 head): 16 decode tokens for ``--rows`` rows (default 16), then a
  forward and backward over rows x 48 tokens (a quarter of the default step's
  rows and half its tokens, so that a spinning run still finishes). Needs only
  torch, for machines without rlpost's dependencies.

Timings on a shared machine are noisy: say what else ran, and compare ratios
measured in one invocation.

Usage:
    python scripts/bench_oversubscription.py [--cores 2] [--competitors 0,1,3] [--steps 3] [--proxy]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROXY = r"""
import time, torch
torch.manual_seed(0)
import sys
H, I, V, L, P, T = 576, 1536, 49152, 30, 32, 16
B = int(sys.argv[2])
Ws = [[torch.randn(H, H + 2 * 192) * 0.02, torch.randn(H, H) * 0.02, torch.randn(H, 2 * I) * 0.02,
       torch.randn(I, H) * 0.02] for _ in range(L)]
head = torch.randn(H, V) * 0.02
def layer(x, W):
    q = x @ W[0]
    x = x + q[..., :H] @ W[1]
    g = x @ W[2]
    return x + (torch.nn.functional.silu(g[..., :I]) * g[..., I:]) @ W[3]
def step():
    t0 = time.perf_counter()
    with torch.no_grad():
        x = torch.randn(B, H)
        for _ in range(T):  # decode: one token per row per iteration
            h = x
            for W in Ws:
                h = layer(h, W)
            logits = h @ head
            x = torch.randn(B, H) + 0 * logits[:, :1]
    for W in Ws:
        for w in W:
            w.requires_grad_(True)
    h = torch.randn(B, P + T, H)
    for W in Ws:
        h = layer(h, W)
    (h @ head[:, :4096]).float().logsumexp(-1).mean().backward()
    for W in Ws:
        for w in W:
            w.requires_grad_(False); w.grad = None
    return time.perf_counter() - t0
n = int(sys.argv[1])
times = [step() for _ in range(n)]
print("STEP_TIMES", times)
"""


def _pin(cores: int):
    """preexec_fn pinning a child to CPUs 0..cores-1 (Linux)."""
    cpus = set(range(cores))
    return lambda: os.sched_setaffinity(0, cpus)


def _competitors(k: int, cores: int):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=_pin(cores)) for _ in range(k)]


def _run_step(policy: str, cores: int, steps: int, proxy: bool, rows: int = 16) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(cores), "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline",
           "PYTHONPATH": str(REPO)}
    env["OMP_WAIT_POLICY"] = policy  # "" = the OpenMP runtime's default (rlpost keeps an explicit empty value)
    if proxy:
        out = subprocess.run([sys.executable, "-c", PROXY, str(steps), str(rows)], env=env, preexec_fn=_pin(cores),
                             capture_output=True, text=True, check=True).stdout
        times = json.loads(out.split("STEP_TIMES", 1)[1].strip())
        return sum(times[1:]) / max(1, len(times) - 1)
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "rlpost.cli", "train", f"steps={steps}", "eval.at_start=false", "eval.at_end=false",
               "checkpoint.every=0", "logger=jsonl", f"hydra.run.dir={d}/run"]
        p = subprocess.run(cmd, env=env, preexec_fn=_pin(cores), capture_output=True, text=True, cwd=d)
        if p.returncode != 0:
            raise SystemExit(p.stderr[-3000:])
        recs = [json.loads(l) for l in (Path(d) / "run" / "metrics.jsonl").read_text().splitlines()]
        times = [r["time/step_s"] for r in recs]
        return sum(times[1:]) / max(1, len(times) - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cores", type=int, default=min(2, os.cpu_count() or 1), help="CPUs every process is pinned to")
    ap.add_argument("--competitors", default="0,1,3", help="comma-separated counts of competing processes")
    ap.add_argument("--steps", type=int, default=3, help="steps per measurement (the first is warm-up)")
    ap.add_argument("--proxy", action="store_true", help="torch-only stand-in of the default step")
    ap.add_argument("--rows", type=int, default=16, help="--proxy: rows decoded per step")
    ap.add_argument("--policies", default="default,PASSIVE", help="OpenMP wait policies: default, PASSIVE, ACTIVE")
    args = ap.parse_args()
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: no orphaned competitors
    counts = [int(c) for c in args.competitors.split(",")]
    policies = args.policies.split(",")
    print(f"workload: {'proxy' if args.proxy else 'default rlpost step'}; {args.cores} cores pinned; "
          f"torch threads = {args.cores}; load average before: {os.getloadavg()}")
    res = {}
    for k in counts:
        comp = _competitors(k, args.cores)
        try:
            time.sleep(0.5)
            for pol in policies:
                res[(pol, k)] = _run_step("" if pol == "default" else pol, args.cores, args.steps, args.proxy, args.rows)
                print(f"  policy={pol:<8} competitors={k}: {res[(pol, k)]:.2f} s/step", flush=True)
        finally:
            for p in comp:
                p.kill()
                p.wait()
    print("\n| competitors | fair-share slowdown | " + " | ".join(f"{p}: s/step (slowdown)" for p in policies) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in policies) + " |")
    for k in counts:
        fair = max(1.0, (args.cores + k) / args.cores)
        cells = [f"{res[(p, k)]:.2f} ({res[(p, k)] / res[(p, counts[0])]:.1f}x)" for p in policies]
        print(f"| {k} | {fair:.1f}x | " + " | ".join(cells) + " |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
