#!/usr/bin/env python
"""Run every named algorithm preset for N steps and print a comparison table.

Usage::

    python scripts/bench_algos.py                       # 20 steps, real model, default task
    python scripts/bench_algos.py --steps 3 --presets grpo dapo gspo
    python scripts/bench_algos.py --steps 2 -o model=tiny rollout.max_new_tokens=8

Each preset runs in-process with ``algo=NAME`` plus the ``-o`` overrides (Hydra
syntax), logging to a temporary directory. The table reports, per preset: the
mean reward over the first and the last five steps and at the final step, policy entropy (nats), clip fraction, the mean
seconds per step, the largest |loss| seen, and a status (``ok``, ``nan`` if any
logged loss or gradient norm was not finite, ``diverged``, or the error).
``--json`` also writes the rows to a file. ``--off-policy`` gives every preset
that would make one on-policy pass per batch (``algo.mini_batches=1`` and
``algo.ppo_epochs=1``) two mini-batches instead, so the second update of each
batch is off-policy and clip / weight rules act; presets that already reuse
their batch keep their own schedule. The ``passes`` column shows
mini-batches x epochs as run.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List

def _all_presets() -> List[str]:
    """Every preset under conf/algo (the base file excluded), in name order."""
    root = Path(__file__).resolve().parent.parent / "conf" / "algo"
    return sorted(p.stem for p in root.glob("*.yaml") if not p.stem.startswith("base"))


NAMED = _all_presets()


def _finite(x: Any) -> bool:
    return not (isinstance(x, float) and (math.isnan(x) or math.isinf(x)))


def run_preset(name: str, steps: int, overrides: List[str], keep: bool = False,
               rollouts_per_step: int = 0, off_policy: bool = False) -> Dict[str, Any]:
    """Train preset ``name`` for ``steps`` steps; returns one table row.

    With ``rollouts_per_step > 0`` the prompts per step are set to
    ``max(1, rollouts_per_step // algo.n_samples_per_prompt)``, so group presets
    (n = 8: 2 prompts for 16) and single-rollout presets (SAO, MSSR, n = 1: 16
    prompts) spend the same rollouts per step. With ``off_policy`` a preset
    whose own schedule is one mini-batch and one epoch runs two mini-batches.

    The temporary run directory (checkpoint and final model, about 1-2 GB for
    the real model) is deleted afterwards unless ``keep``.
    """
    from rlpost.config.compose import compose_config
    from rlpost.core.errors import TrainingDiverged
    from rlpost.run.runner import train

    row: Dict[str, Any] = {"preset": name, "steps": 0, "status": "ok"}
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    t0 = time.perf_counter()
    try:
        base = [f"algo={name}", f"steps={steps}", "logger=jsonl", "eval.at_start=false", "eval.at_end=false", "checkpoint.every=0"]
        cfg = compose_config([*base, *overrides])
        from rlpost.algos.validate import uses_teacher

        # distillation without a teacher (one, or one per domain in model.teachers): the model is its own teacher
        if uses_teacher(cfg.algo) and not cfg.model.get("teacher") and not cfg.model.get("teachers"):
            base.append(f"model.teacher={cfg.model.name}")
            cfg = compose_config([*base, *overrides])
        if off_policy and int(cfg.algo.mini_batches) == 1 and int(cfg.algo.ppo_epochs) == 1:
            base.append("algo.mini_batches=2")
            cfg = compose_config([*base, *overrides])
        if rollouts_per_step > 0:
            k = max(1, rollouts_per_step // int(cfg.algo.n_samples_per_prompt))
            cfg = compose_config([*base, f"selector.prompts_per_step={k}", *overrides])
        row["passes"] = f"{int(cfg.algo.mini_batches)}x{int(cfg.algo.ppo_epochs)}"
        row["rollouts_per_step"] = int(cfg.selector.prompts_per_step) * int(cfg.algo.n_samples_per_prompt)
        train(cfg, run_dir)
    except TrainingDiverged as e:
        row["status"] = "diverged"
        row["error"] = str(e)[:200]
    except Exception as e:  # report, keep benchmarking the others
        row["status"] = f"error: {type(e).__name__}"
        row["error"] = str(e)[:300]
        traceback.print_exc()
    row["wall_s"] = time.perf_counter() - t0
    mfile = run_dir / "metrics.jsonl"
    rows = [json.loads(l) for l in mfile.read_text().splitlines() if l.strip()] if mfile.exists() else []
    rows = [r for r in rows if "reward/mean" in r]
    if rows:
        last = rows[-1]
        row["steps"] = len(rows)
        row["reward"] = last.get("reward/mean")
        rew = [r.get("reward/mean", 0.0) for r in rows]
        row["reward_first5"] = sum(rew[:5]) / len(rew[:5])
        row["reward_last5"] = sum(rew[-5:]) / len(rew[-5:])
        # the rows sampled this step (every scored group, before a filter drops or a replay selector adds rows)
        scored = [r["rollout/reward_scored"] for r in rows if "rollout/reward_scored" in r]
        row["reward_scored_last5"] = sum(scored[-5:]) / len(scored[-5:]) if scored else None
        row["entropy"] = last.get("actor/entropy")
        row["clip_frac"] = last.get("actor/clip_frac")
        row["s_per_step"] = sum(r.get("time/step_s", 0.0) for r in rows) / len(rows)
        losses = [r.get("loss/policy") for r in rows if r.get("loss/policy") is not None]
        row["max_abs_loss"] = max((abs(x) for x in losses), default=None)
        norms = [r.get("actor/grad_norm") for r in rows if r.get("actor/grad_norm") is not None]
        row["max_grad_norm"] = max(norms, default=None)
        row["grad_steps"] = sum(1 for x in norms if _finite(x) and x > 0)  # steps whose update moved the policy
        bad = [k for r in rows for k in ("loss/policy", "actor/grad_norm") if k in r and not _finite(r[k])]
        if bad and row["status"] == "ok":
            row["status"] = "nan"
    if keep:
        row["run_dir"] = str(run_dir)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    return row


def fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def table(rows: List[Dict[str, Any]]) -> str:
    head = ["preset", "rollouts/step", "passes", "steps", "reward (steps 1-5)", "reward (last 5)", "scored (last 5)", "final reward",
            "entropy", "clip_frac", "s/step", "max|loss|", "max grad norm", "steps with grad > 0", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["preset"], str(r.get("rollouts_per_step", "-")), r.get("passes", "-"), str(r["steps"]), fmt(r.get("reward_first5")),
            fmt(r.get("reward_last5")), fmt(r.get("reward_scored_last5")), fmt(r.get("reward")), fmt(r.get("entropy")), fmt(r.get("clip_frac")),
            fmt(r.get("s_per_step"), 1), fmt(r.get("max_abs_loss")), fmt(r.get("max_grad_norm")), str(r.get("grad_steps", "-")), r["status"],
        ]) + " |")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--presets", nargs="*", default=NAMED)
    ap.add_argument("-o", "--overrides", nargs="*", default=[], help="extra Hydra overrides for every run")
    ap.add_argument("--json", type=str, default=None, help="also write the rows here")
    ap.add_argument("--keep", action="store_true", help="keep each preset's run directory")
    ap.add_argument("--off-policy", action="store_true",
                    help="two mini-batches per batch for presets whose own schedule is one on-policy pass")
    ap.add_argument("--rollouts-per-step", type=int, default=0,
                    help="equal rollouts per step for every preset (prompts = this // n); 0: the presets' own")
    args = ap.parse_args(argv)
    rows = []
    for name in args.presets:
        row = run_preset(name, args.steps, args.overrides, keep=args.keep, rollouts_per_step=args.rollouts_per_step,
                         off_policy=args.off_policy)
        rows.append(row)
        print(f"[bench] {name}: {row['status']} steps={row['steps']} reward={fmt(row.get('reward'))} "
              f"s/step={fmt(row.get('s_per_step'), 1)}", file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
