"""Run every selector / sampler for a few RL steps and print rollouts spent and reward.

Usage::

    python scripts/bench_sampling.py --steps 20                      # the table (real model)
    python scripts/bench_sampling.py --steps 2 --model tiny          # smoke run
    python scripts/bench_sampling.py --only selector=vade sampler=dars
    python scripts/bench_sampling.py --only "selector=domain_mixture task=arithmetic_mix"
    python scripts/bench_sampling.py --compare --steps 20 --seeds 0 1 \
        --methods selector=uniform selector=vade selector=dynamic_filter
    python scripts/bench_sampling.py --protocol dataflex --budget-rollouts 320 --seeds 0 1 2 \
        --methods selector=vade selector=dynamic_filter

Table mode builds one run per entry (``algo=grpo`` on the default task, same
seed) and reports, over the steps: rollouts spent (total), mean training reward
per step, share of zero-variance groups, mean effective batch (rows with a
non-zero group advantage), prompts skipped, seconds. ``--compare`` trains each
method with ``rlpost.run.runner.train`` (held-out evaluation at the end) for every
seed, then prints the paired comparison against the first method
(:func:`rlpost.eval.compare.compare`, paired bootstrap over problems).
``--protocol dataflex`` is DataFlex-RL's protocol (arXiv:2609.06107,
:mod:`rlpost.eval.protocol`): ``selector=uniform`` is always the first arm, every
arm gets the same nominal rollout budget (``--budget-rollouts``, turned into
steps) and the same seeds, and the table gives each arm's real spend, its
benchmark-balanced held-out accuracy, the paired 95% CI of its difference from
uniform and whether it excludes 0, plus uniform's gain over the untrained model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ENTRIES = [
    "selector=uniform", "selector=dynamic_filter", "selector=vade", "selector=dps", "selector=cdas",
    "selector=bots", "selector=cures", "selector=greso", "selector=hive", "selector=popo",
    # domain_mixture needs several domains: it and its uniform baseline run on the two-domain task
    "selector=uniform task=arithmetic_mix", "selector=domain_mixture task=arithmetic_mix", "selector=seele",
    "sampler=group", "sampler=single", "sampler=adaptive_temperature", "sampler=vigor", "sampler=dars",
    "sampler=pilot_commit", "sampler=ar3po", "sampler=tree", "sampler=param_perturb",
]


def base_overrides(args, seed: int) -> List[str]:
    """Overrides shared by every entry (seed ``seed``)."""
    o = ["algo=grpo", f"model={args.model}", f"seed={seed}", "logger=jsonl", f"steps={args.steps}",
         f"selector.prompts_per_step={args.prompts}", f"algo.n_samples_per_prompt={args.n}",
         f"rollout.max_new_tokens={args.max_new_tokens}", "checkpoint.every=0",
         "eval.at_start=false", f"eval.at_end={'true' if args.eval_limit > 0 else 'false'}", f"eval.limit={max(1, args.eval_limit)}"]
    return o + list(args.extra)


def run_dir_of(root: Path, entry: str, seed: int) -> Path:
    """``root/<entry tag>/seed<seed>``: one run directory per (entry, seed)."""
    return root / entry.replace("=", "-").replace(" ", "_") / f"seed{seed}"


def run_entry(entry: str, seed: int, args, root: Path) -> Dict[str, float]:
    """Train one entry for ``args.steps`` steps (held-out evaluation at the end) and aggregate its metrics.

    A run directory that already holds a finished run (``DONE``) is reused, so
    ``--compare`` picks up the table's seed-0 runs. The trained weights
    (``final/``, ``checkpoints/``) are deleted afterwards to save disk; the
    metrics and ``eval.json`` stay.
    """
    from rlpost.run.checkpoint import DONE_MARKER
    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    run_dir = run_dir_of(root, entry, seed)
    if not (run_dir / DONE_MARKER).exists():
        if run_dir.exists():
            shutil.rmtree(run_dir)
        t0 = time.perf_counter()
        train(compose_config(base_overrides(args, seed) + entry.split()), run_dir)
        (run_dir / "wall_s.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
        for sub in ("final", "checkpoints"):
            shutil.rmtree(run_dir / sub, ignore_errors=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward/mean" in r]
    mean = lambda k: sum(r.get(k, 0.0) for r in rows) / max(1, len(rows))  # noqa: E731
    wall = run_dir / "wall_s.txt"
    acc = None
    if (run_dir / "eval.json").exists():
        acc = json.loads((run_dir / "eval.json").read_text()).get("accuracy")
    return {
        "spent": sum(r.get("rollout/spent", 0.0) for r in rows),
        "reward": mean("reward/mean"),
        "reward_last5": sum(r.get("reward/mean", 0.0) for r in rows[-5:]) / max(1, len(rows[-5:])),
        "zero_var": mean("rollout/zero_var_frac"),
        "eff_batch": mean("rollout/effective_batch"),
        "skipped": sum(r.get("rollout/prompts_skipped", 0.0) for r in rows),
        "step_s": mean("time/step_s"),
        "eval": acc,
        "secs": float(wall.read_text()) if wall.exists() else float("nan"),
    }


def _root(args) -> Path:
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_sampling_"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def table(args) -> None:
    """Print the per-entry table (seed ``args.seed``)."""
    entries = args.only or ENTRIES
    root = _root(args)
    print(f"# {args.steps} steps, model={args.model}, algo=grpo, {args.prompts} prompts x n={args.n}, "
          f"max_new_tokens={args.max_new_tokens}, seed={args.seed}, held-out eval on {args.eval_limit}; runs in {root}")
    print("| entry | rollouts spent | mean reward/step | reward (last 5) | zero-var share | eff. batch | skipped "
          "| s/step | held-out acc. | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for e in entries:
        try:
            m = run_entry(e, args.seed, args, root)
            acc = "-" if m["eval"] is None else f"{100 * m['eval']:.1f}%"
            print(f"| {e} | {m['spent']:.0f} | {m['reward']:.3f} | {m['reward_last5']:.3f} | {m['zero_var']:.2f} | "
                  f"{m['eff_batch']:.1f} | {m['skipped']:.0f} | {m['step_s']:.1f} | {acc} | {m['secs']:.0f} |", flush=True)
        except Exception as err:  # report and go on with the other entries
            print(f"| {e} | failed: {type(err).__name__}: {str(err)[:80]} | | | | | | | | |", flush=True)


def compare(args) -> None:
    """Matched-seed training of each method, held-out evaluation, paired statistics vs the first."""
    from rlpost.eval.compare import compare as paired

    if args.eval_limit <= 0:
        raise SystemExit("--compare needs --eval-limit > 0 (the paired statistics use the held-out records)")
    root = _root(args)
    specs = []
    for meth in args.methods:
        for s in args.seeds:
            m = run_entry(meth, s, args, root)
            print(f"{meth} seed={s}: held-out accuracy={m['eval']}, rollouts spent={m['spent']:.0f}", flush=True)
        specs.append(str(run_dir_of(root, meth, args.seeds[0]).parent))
    report, _ = paired(specs)
    print(report)


def protocol(args) -> None:
    """DataFlex-RL's protocol (:mod:`rlpost.eval.protocol`) over ``args.methods`` and ``args.seeds``."""
    from rlpost.eval.protocol import BASELINE, budget_steps, protocol_report

    if args.eval_limit <= 0:
        raise SystemExit("--protocol needs --eval-limit > 0 (the paired statistics use the held-out records)")
    if args.budget_rollouts:
        args.steps = budget_steps(args.budget_rollouts, args.prompts, args.n)
    root = _root(args)
    methods = [BASELINE] + [m for m in args.methods if m != BASELINE]
    arms = {}
    for meth in methods:
        entry = meth + (" eval.at_start=true" if meth == BASELINE else "")  # the untrained reference
        for s in args.seeds:
            m = run_entry(entry, s, args, root)
            print(f"{meth} seed={s}: held-out accuracy={m['eval']}, rollouts spent={m['spent']:.0f}", flush=True)
        arms[meth] = [run_dir_of(root, entry, s) for s in args.seeds]
    print(f"# DataFlex-RL protocol: {args.steps} steps x {args.prompts} prompts x n={args.n} "
          f"(nominal budget {args.steps * args.prompts * args.n} rollouts), model={args.model}, seeds={args.seeds}, "
          f"held-out eval on {args.eval_limit}, extra={args.extra}; runs in {root}")
    print(protocol_report(arms)[0])


def main() -> None:
    """Parse arguments and run the table, the comparison or the protocol."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every entry")
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--protocol", choices=["dataflex"], default=None, help="DataFlex-RL's evaluation protocol")
    ap.add_argument("--budget-rollouts", type=int, default=0, help="--protocol: nominal rollouts per arm (sets --steps)")
    ap.add_argument("--methods", nargs="*", default=["selector=uniform", "selector=vade", "selector=dynamic_filter"])
    ap.add_argument("--seeds", nargs="*", type=int, default=[0])
    ap.add_argument("--eval-limit", type=int, default=100, help="held-out problems scored after training (0: none)")
    ap.add_argument("--out", default=None, help="run directories go here (reused when finished); default: a temp dir")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.protocol:
        protocol(args)
    else:
        compare(args) if args.compare else table(args)


if __name__ == "__main__":
    sys.exit(main())
