"""The DataFlex-RL evaluation protocol for data policies (selectors, samplers).

"DataFlex-RL: An Evaluation Platform for RLVR Data Policies" (arXiv:2609.06107)
compares rollout-selection, reweighting and mixture methods under one shared
GRPO recipe, over matched seeds, each against uniform GRPO, by the paired 95%
confidence interval of the difference in domain-balanced held-out accuracy;
it also reports uniform GRPO's gain over the untrained checkpoint (the scale a
difference is read against). Its finding: no selection or reweighting method's
interval excluded zero. This module turns finished runs into that report:

* **one recipe, one budget**: every arm runs the same recipe for the same number
  of steps; :func:`budget_steps` turns a rollout budget into steps (nominal:
  ``steps * prompts_per_step * n``). Methods that draw extra rollouts (refilling
  filters) spend more than the nominal budget; the report gives every arm's
  real spend (rollouts, rollout tokens, rollout seconds) so that shows, and
  flags an arm that spent more than ``overspend`` of the baseline's rollouts
  (our choice: the paper matches the recipe, and the abstract does not say how
  extra rollouts are charged);
* **matched seeds and the uniform baseline**: arms are paired by seed with the
  baseline (``selector=uniform``, required);
* **the statistics**: :func:`rlpost.eval.compare.compare_methods` (two-way paired
  bootstrap over seeds and problems, benchmark-balanced over the evaluated
  tasks), reported as "CI excludes 0" or not;
* **the untrained reference**: the baseline's start-of-run evaluation
  (``eval_start.json``, identical weights across arms of one seed) against its
  end, the "uniform gain" line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from rlpost.core.errors import DataError
from rlpost.eval.compare import compare_methods, load_run

#: the required baseline arm
BASELINE = "selector=uniform"


def budget_steps(budget_rollouts: int, prompts_per_step: int, n_samples: int) -> int:
    """Steps giving ``budget_rollouts`` nominal rollouts (``ceil(budget / (prompts * n))``).

    Raises:
        ValueError: a non-positive argument.
    """
    if budget_rollouts < 1 or prompts_per_step < 1 or n_samples < 1:
        raise ValueError(f"budget ({budget_rollouts}), prompts per step ({prompts_per_step}) and group size "
                         f"({n_samples}) must all be >= 1")
    return int(math.ceil(budget_rollouts / (prompts_per_step * n_samples)))


def run_spend(run_dir: Path) -> Dict[str, float]:
    """``{"rollouts", "rollout_tokens", "rollout_s"}`` summed over a finished run's steps (``metrics.jsonl``).

    Rollout tokens are the engine-decoded ones where the sampler reports them
    (``sampler/generated_tokens``), else the throughput times the rollout seconds.
    """
    f = Path(run_dir) / "metrics.jsonl"
    if not f.is_file():
        raise DataError(f"{run_dir} has no metrics.jsonl")
    rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "reward/mean" in r]
    tok = sum(r.get("sampler/generated_tokens",
                    r.get("throughput/rollout_tokens_per_s", 0.0) * r.get("time/rollout_s", 0.0)) for r in rows)
    return {"rollouts": float(sum(r.get("rollout/spent", 0.0) for r in rows)), "rollout_tokens": float(tok),
            "rollout_s": float(sum(r.get("time/rollout_s", 0.0) for r in rows))}


def _start_eval(run_dir: Path) -> Optional[float]:
    f = Path(run_dir) / "eval_start.json"
    if not f.is_file():
        return None
    d = json.loads(f.read_text())
    return float(d.get("macro_accuracy", d.get("accuracy", float("nan"))))


def protocol_report(arms: Dict[str, List[Path]], baseline: str = BASELINE, overspend: float = 0.10,
                    n_boot: int = 2000) -> Tuple[str, List[Dict[str, Any]]]:
    """The DataFlex-RL report of finished runs.

    Args:
        arms: ``{method label: run directories, one per seed}``; must hold ``baseline``.
        baseline: the label every other arm is compared against.
        overspend: flag an arm whose mean rollouts exceed the baseline's by this share.
    Returns:
        ``(markdown text, rows)``; a row per arm: ``method``, ``seeds``, ``rollouts``,
        ``rollout_tokens``, ``rollout_s`` (means over seeds), ``acc`` (mean
        benchmark-balanced accuracy), and for the other arms ``diff``, ``ci_low``,
        ``ci_high``, ``excludes_zero``, ``over_budget``.
    Raises:
        DataError: no baseline arm, an arm without runs, or runs that cannot be paired.
    """

    if baseline not in arms:
        raise DataError(f"the protocol compares every arm with {baseline!r}; add it to the methods")
    for k, v in arms.items():
        if not v:
            raise DataError(f"arm {k!r} has no finished run")
    evals = {k: [load_run(p) for p in v] for k, v in arms.items()}
    spend = {k: [run_spend(p) for p in v] for k, v in arms.items()}

    def mean(xs: Sequence[float]) -> float:
        return float(sum(xs) / max(1, len(xs)))

    rows: List[Dict[str, Any]] = []
    base_roll = mean([s["rollouts"] for s in spend[baseline]])
    for k in [baseline] + [a for a in arms if a != baseline]:
        row: Dict[str, Any] = {"method": k, "seeds": len(arms[k]),
                               **{f: mean([s[f] for s in spend[k]]) for f in ("rollouts", "rollout_tokens", "rollout_s")}}
        if k == baseline:
            c = compare_methods(evals[baseline], evals[baseline], k, k, n_boot=10)
            row["acc"] = c["overall"]["mean_a"]
        else:
            c = compare_methods(evals[baseline], evals[k], baseline, k, n_boot=n_boot)
            o = c["overall"]
            row.update(acc=o["mean_b"], diff=o["diff"], ci_low=o["ci_low"], ci_high=o["ci_high"],
                       excludes_zero=bool(o["significant"]), seeds=len(c["seeds"]),
                       over_budget=bool(row["rollouts"] > (1 + overspend) * base_roll))
        rows.append(row)
    starts = [s for s in (_start_eval(p) for p in arms[baseline]) if s is not None]
    name = "uniform" if baseline == BASELINE else baseline  # what the baseline is called in the text
    lines = [f"| method | seeds | rollouts | rollout tokens | rollout s | held-out acc. | diff vs {name} [95% CI] "
             "| CI excludes 0 |", "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        cmp_txt = "(baseline)" if r["method"] == baseline else (
            f"{100 * r['diff']:+.1f} [{100 * r['ci_low']:+.1f}, {100 * r['ci_high']:+.1f}] pts")
        flag = "" if r["method"] == baseline else ("yes" if r["excludes_zero"] else "no")
        if r.get("over_budget"):
            flag += f" (spent {r['rollouts'] / max(base_roll, 1):.2f}x the baseline's rollouts)"
        lines.append(f"| {r['method']} | {r['seeds']} | {r['rollouts']:.0f} | {r['rollout_tokens']:.0f} | "
                     f"{r['rollout_s']:.1f} | {100 * r['acc']:.1f}% | {cmp_txt} | {flag} |")
    if starts:
        gain = rows[0]["acc"] - mean(starts)
        lines.append(f"\n{name} gain over the untrained checkpoint: {100 * gain:+.1f} pts "
                     f"({100 * mean(starts):.1f}% -> {100 * rows[0]['acc']:.1f}%, {len(starts)} seed(s))")
    if any(r["seeds"] < 2 for r in rows):
        lines.append("one seed only: the intervals cover problem sampling, not seed-to-seed variance")
    return "\n".join(lines), rows
