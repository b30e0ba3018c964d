"""Rollout-efficiency methods against their baseline on the same config and seed.

Usage::

    python scripts/bench_rollout_efficiency.py --steps 10 --out /tmp/bench/rolleff \\
        --entries "sampler=group" "sampler=spec_rl" --extra task.train_size=8

Each entry is one ``rlpost.run.runner.train`` run (``algo=grpo``, the real model by
default, held-out evaluation at the end) built like ``scripts/bench_sampling.py``
(finished run directories are reused). The table reports, summed over the steps:
rollouts, response tokens in the training batches, tokens the rollout engine
actually decoded (``sampler/generated_tokens`` where the sampler reports it, the
batch's response tokens otherwise), rollout seconds (``time/rollout_s``), and the
held-out accuracy after the fixed step budget.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's rlpost, not an installed one

from bench_sampling import _root, run_dir_of, run_entry  # noqa: E402


def tokens(run_dir: Path) -> dict:
    """Batch response tokens, engine-decoded tokens and rollout seconds summed over a run's steps."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "reward/mean" in r]
    batch = sum(r.get("throughput/rollout_tokens_per_s", 0.0) * r.get("time/rollout_s", 0.0) for r in rows)
    gen = sum(r.get("sampler/generated_tokens", r.get("throughput/rollout_tokens_per_s", 0.0) * r.get("time/rollout_s", 0.0))
              for r in rows)
    extra = {k: sum(r.get(k, 0.0) for r in rows) for k in ("sampler/accepted_tokens", "sampler/draft_tokens",
                                                             "sampler/pruned", "sampler/pruned_unscored", "sampler/full_reuse")}
    return {"batch_tokens": batch, "generated": gen, "rollout_s": sum(r.get("time/rollout_s", 0.0) for r in rows),
            "update_s": sum(r.get("time/update_s", 0.0) for r in rows), **extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--entries", nargs="+", default=["sampler=group", "sampler=spec_rl"])
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every entry")
    ap.add_argument("--eval-limit", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = _root(args)
    print(f"# {args.steps} steps, model={args.model}, algo=grpo, {args.prompts} prompts x n={args.n}, "
          f"max_new_tokens={args.max_new_tokens}, seed={args.seed}, extra={args.extra}, "
          f"held-out eval on {args.eval_limit}; runs in {root}")
    print("| entry | rollouts | batch response tokens | engine-decoded tokens | rollout s | update s | mean reward "
          "| held-out acc. | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for e in args.entries:
        try:
            m = run_entry(e, args.seed, args, root)
            t = tokens(run_dir_of(root, e, args.seed))
            acc = "-" if m["eval"] is None else f"{100 * m['eval']:.1f}%"
            print(f"| {e} | {m['spent']:.0f} | {t['batch_tokens']:.0f} | {t['generated']:.0f} | {t['rollout_s']:.1f} | "
                  f"{t['update_s']:.1f} | {m['reward']:.3f} | {acc} | {m['secs']:.0f} |", flush=True)
            if t["sampler/draft_tokens"]:
                print(f"|  ({e}: drafts offered {t['sampler/draft_tokens']:.0f} tokens, accepted "
                      f"{t['sampler/accepted_tokens']:.0f}, rows needing no decoding {t['sampler/full_reuse']:.0f}) |",
                      flush=True)
        except Exception as err:  # report and go on
            print(f"| {e} | failed: {type(err).__name__}: {str(err)[:100]} |", flush=True)


if __name__ == "__main__":
    main()
