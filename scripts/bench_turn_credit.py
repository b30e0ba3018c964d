#!/usr/bin/env python
"""Turn-level credit methods against turn_grpo on the calculator agent task, over matched seeds.

Every arm is the same run, ``rlpost train +recipe=agent_multiply_grpo`` (task=multiply,
env=calculator, 4 prompts x 4 episodes per step, two turns, 48 tokens per turn) started from
one supervised warm start (``python -m rlpost.experiments.warmstart``: SmolLM2-135M makes no
tool call without it, docs/AGENTS.md), at temperature 1.0 (the turn-level recipes' setting) for
the same number of steps; only ``algo=`` and ``seed=`` change. The baseline arm ``turn_grpo``
also evaluates the warm-started checkpoint (``eval_start.json``, the same greedy episodes for
every arm and seed). The report is :func:`rlpost.eval.protocol.protocol_report` with
``turn_grpo`` as the baseline: each arm's real rollout spend, held-out accuracy (32 greedy
episodes), and the paired 95% CI of its difference from turn_grpo (two-way bootstrap over seeds
and problems, :func:`rlpost.eval.compare.compare_methods`).

    python -m rlpost.experiments.warmstart --out WS -- +recipe=agent_multiply_grpo
    python scripts/bench_turn_credit.py --warm-start WS --out RUNS --seeds 0 1 2 \\
        --arms turn_grpo hgpo rtmc g2po a2tgpo seeupo spear --steps 3
    python scripts/bench_turn_credit.py --out RUNS --report-only          # the table of finished runs

An arm is a preset name (``algo=NAME``) or ``LABEL=OVERRIDE[,OVERRIDE...]`` for an arm that is
more than a preset, e.g. ``trace_tree=algo=turn_grpo,sampler.name=trace_tree`` (TRACE's tree rollouts under
turn_grpo's credit) or ``at2po=algo=at2po,sampler.params.branching=at2po`` (AT²PO with its turn tree).

Run directories are ``RUNS/<label>-s<seed>``; an arm/seed whose ``eval.json`` exists is not rerun.
Checkpoints and ``final/`` weights are deleted after each run (2 GB each). Runs one training
process at a time.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's rlpost, not an installed copy

BASELINE = "turn_grpo"


def parse_arm(spec: str) -> tuple:
    """``(label, overrides)`` of an arm: ``"hgpo"`` -> ``("hgpo", ["algo=hgpo"])``;
    ``"tt=algo=turn_grpo,sampler.name=trace_tree"`` -> ``("tt", ["algo=turn_grpo", "sampler.name=trace_tree"])``.

    Raises:
        SystemExit: a labelled arm with no override, or one without ``algo=`` (every arm names its preset).
    """
    if "=" not in spec:
        return spec, [f"algo={spec}"]
    label, rest = spec.split("=", 1)
    ovs = [o for o in rest.split(",") if o]
    if not label or not any(o.startswith("algo=") for o in ovs):
        raise SystemExit(f"arm {spec!r}: write LABEL=algo=NAME[,OVERRIDE...] (the arm's preset must be named)")
    return label, ovs


def run_arm(spec: str, seed: int, args) -> Path:
    """Train one arm for one seed (``rlpost train`` in a subprocess); returns its run directory."""
    arm, ovs = parse_arm(spec)
    d = Path(args.out) / f"{arm}-s{seed}"
    if (d / "eval.json").exists():
        return d
    cmd = [sys.executable, "-m", "rlpost.cli", "train", "+recipe=agent_multiply_grpo", *ovs, f"seed={seed}",
           "model.source=hf", f"model.path={args.warm_start}", f"rollout.temperature={args.temperature}",
           f"steps={args.steps}", f"hydra.run.dir={d}", *args.extra]
    if arm != BASELINE:
        cmd.append("eval.at_start=false")  # the warm start's evaluation is the same for every arm: once is enough
    t0 = time.time()
    d.mkdir(parents=True, exist_ok=True)
    with open(d.parent / f"{arm}-s{seed}.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    shutil.rmtree(d / "checkpoints", ignore_errors=True)
    shutil.rmtree(d / "final", ignore_errors=True)
    print(f"{arm} seed={seed}: rc={rc}, {time.time() - t0:.0f} s", flush=True)
    if rc != 0:
        raise SystemExit(f"{arm} seed={seed} failed (rc={rc}): see {d.parent / f'{arm}-s{seed}.log'}")
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder of the run directories")
    ap.add_argument("--warm-start", default=None, help="the warm-started model directory (model.path)")
    ap.add_argument("--arms", nargs="+", default=[BASELINE, "hgpo", "rtmc", "g2po", "a2tgpo", "seeupo", "spear"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every arm")
    ap.add_argument("--report-only", action="store_true", help="only print the table of the finished runs")
    args = ap.parse_args()
    arms = [BASELINE] + [a for a in args.arms if a != BASELINE]
    labels = [parse_arm(a)[0] for a in arms]
    if not args.report_only:
        if not args.warm_start:
            raise SystemExit("--warm-start DIR is needed to train (python -m rlpost.experiments.warmstart --out DIR "
                             "-- +recipe=agent_multiply_grpo makes one)")
        for s in args.seeds:  # seed-major: a stopped sweep leaves complete, pairable seeds
            for a in arms:
                run_arm(a, s, args)
    from rlpost.eval.protocol import protocol_report

    found = {a: [Path(args.out) / f"{a}-s{s}" for s in args.seeds if (Path(args.out) / f"{a}-s{s}" / "eval.json").exists()]
             for a in labels}
    found = {a: v for a, v in found.items() if v}
    if BASELINE not in found:
        raise SystemExit(f"no finished {BASELINE} run under {args.out}: train it first")
    text, _ = protocol_report(found, baseline=BASELINE)
    print(text)


if __name__ == "__main__":
    main()
