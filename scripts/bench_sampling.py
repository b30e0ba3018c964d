"""Run every selector / sampler for a few RL steps and print rollouts spent and reward.

Usage::

    python scripts/bench_sampling.py --steps 20                      # the table (real model)
    python scripts/bench_sampling.py --steps 2 --model tiny          # smoke run
    python scripts/bench_sampling.py --only selector=vade sampler=dars
    python scripts/bench_sampling.py --compare --steps 20 --seeds 0 1 \
        --methods selector=uniform selector=vade selector=dynamic_filter

Table mode builds one run per entry (``algo=grpo`` on the default task, same
seed) and reports, over the steps: rollouts spent (total), mean training reward
per step, share of zero-variance groups, mean effective batch (rows with a
non-zero group advantage), prompts skipped, seconds. ``--compare`` trains each
method with ``rlpost.runner.train`` (held-out evaluation at the end) for every
seed, then prints the paired comparison against the first method
(:func:`rlpost.eval.compare.compare`, paired bootstrap over problems).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ENTRIES = [
    "selector=uniform", "selector=dynamic_filter", "selector=vade", "selector=dps", "selector=cdas",
    "selector=bots", "selector=cures", "selector=greso", "selector=hive", "selector=popo",
    "selector=domain_mixture", "selector=seele",
    "sampler=group", "sampler=single", "sampler=adaptive_temperature", "sampler=vigor", "sampler=dars",
    "sampler=pilot_commit", "sampler=ar3po", "sampler=tree", "sampler=param_perturb",
]


def base_overrides(args) -> List[str]:
    """Overrides shared by every entry."""
    o = ["algo=grpo", f"model={args.model}", f"seed={args.seed}", "logger=jsonl", f"steps={args.steps}",
         f"selector.prompts_per_step={args.prompts}", f"algo.n_samples_per_prompt={args.n}",
         f"rollout.max_new_tokens={args.max_new_tokens}", "eval.at_end=false", "checkpoint.every=0"]
    return o + list(args.extra)


def run_entry(entry: List[str], args) -> Dict[str, float]:
    """Train one entry for ``args.steps`` steps in a temporary directory; aggregate its metrics."""
    from rlpost.config.compose import compose_config
    from rlpost.runner import Run

    cfg = compose_config(base_overrides(args) + entry)
    with tempfile.TemporaryDirectory() as d:
        run = Run(cfg, Path(d))
        rows = []
        t0 = time.perf_counter()
        try:
            for _ in range(args.steps):
                rows.append(run.train_step())
        finally:
            run.close()
        secs = time.perf_counter() - t0
    mean = lambda k: sum(r.get(k, 0.0) for r in rows) / max(1, len(rows))  # noqa: E731
    return {
        "spent": sum(r.get("rollout/spent", 0.0) for r in rows),
        "reward": mean("reward/mean"),
        "reward_last5": sum(r.get("reward/mean", 0.0) for r in rows[-5:]) / max(1, len(rows[-5:])),
        "zero_var": mean("rollout/zero_var_frac"),
        "eff_batch": mean("rollout/effective_batch"),
        "skipped": sum(r.get("rollout/prompts_skipped", 0.0) for r in rows),
        "secs": secs,
    }


def table(args) -> None:
    """Print the per-entry table."""
    entries = args.only or ENTRIES
    print(f"# {args.steps} steps, model={args.model}, algo=grpo, {args.prompts} prompts x n={args.n}, "
          f"max_new_tokens={args.max_new_tokens}, seed={args.seed}")
    print("| entry | rollouts spent | mean reward/step | reward (last 5) | zero-var share | eff. batch | skipped | s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for e in entries:
        try:
            m = run_entry(e.split(), args)
            print(f"| {e} | {m['spent']:.0f} | {m['reward']:.3f} | {m['reward_last5']:.3f} | {m['zero_var']:.2f} | "
                  f"{m['eff_batch']:.1f} | {m['skipped']:.0f} | {m['secs']:.0f} |", flush=True)
        except Exception as err:  # report and go on with the other entries
            print(f"| {e} | failed: {type(err).__name__}: {str(err)[:80]} | | | | | | |", flush=True)


def compare(args) -> None:
    """Matched-seed training of each method, held-out evaluation, paired statistics vs the first."""
    from rlpost.config.compose import compose_config
    from rlpost.eval.compare import compare as paired
    from rlpost.runner import train

    root = Path(args.out or tempfile.mkdtemp(prefix="bench_cmp_"))
    specs = []
    for meth in args.methods:
        tag = meth.replace("=", "-").replace(" ", "_")
        for s in args.seeds:
            args.seed = s
            o = [x for x in base_overrides(args) if not x.startswith("eval.at_end")] + ["eval.at_end=true", f"eval.limit={args.eval_limit}"]
            cfg = compose_config(o + meth.split())
            last = train(cfg, root / tag / f"seed{s}")
            print(f"{meth} seed={s}: eval/accuracy={last.get('eval/accuracy')}", flush=True)
        specs.append(str(root / tag))
    report, _ = paired(specs)
    print(report)


def main() -> None:
    """Parse arguments and run the table or the comparison."""
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
    ap.add_argument("--methods", nargs="*", default=["selector=uniform", "selector=vade", "selector=dynamic_filter"])
    ap.add_argument("--seeds", nargs="*", type=int, default=[0])
    ap.add_argument("--eval-limit", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    compare(args) if args.compare else table(args)


if __name__ == "__main__":
    sys.exit(main())
