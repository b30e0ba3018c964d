"""Write a verified exemplar file for ``sampler=xrpo_icl`` (XRPO's in-context seeding) from a task's own answers.

"XRPO: Pushing the limits of GRPO with Targeted Exploration and Exploitation"
(arXiv:2510.06672) seeds a prompt whose rollouts all failed with solved
examples of similar problems. The seed corpus is a jsonl file, one exemplar a
line: ``{"task": NAME, "question": ..., "solution": ..., "answer": ...}``. This
script takes ``--n`` examples spread evenly over the task's *training* split
(never the held-out split), writes each one's worked solution
(``task.reference_solution``) and keeps it only when the task's own verifier
gives it full credit (``task.score(solution, example) == 1``).

Usage (the shipped file for the default task):
    python scripts/make_exemplars.py --out rlpost/samplers/exemplars/arithmetic.jsonl
    python scripts/make_exemplars.py --n 16 --out my.jsonl task=gsm8k   # Hydra overrides after the flags
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def make_exemplars(overrides: list, n: int) -> list:
    """``n`` verified exemplar records of the task the ``overrides`` compose (training split, even stride)."""
    from rlpost.config.compose import compose_config
    from rlpost.tasks.base import build_task

    cfg = compose_config(["model=tiny", *overrides])
    task = build_task(cfg.task)
    examples = task.train_examples()
    stride = max(1, len(examples) // max(1, n))
    out = []
    for ex in examples[::stride]:
        sol = task.reference_solution(ex)
        if float(task.score(sol, ex)) >= 1.0:  # verified by the task's own verifier
            out.append({"task": str(cfg.task.name), "question": ex.question, "solution": sol, "answer": str(ex.answer)})
        if len(out) == n:
            break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32, help="exemplars to write (default 32)")
    ap.add_argument("--out", type=Path, required=True, help="jsonl file to write")
    args, overrides = ap.parse_known_args(argv)
    rows = make_exemplars(overrides, args.n)
    if not rows:
        print("no example's reference solution passed the task's verifier; nothing written", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} verified exemplars of task {rows[0]['task']} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
