"""``rlpost compare``: paired comparison of methods over matched seeds and problems.

Each method is given as one or more run directories (a run directory, a folder
of runs, or a glob). Given a single Hydra sweep folder (``multirun/<time>/``),
its runs are split into methods by the overrides they differ in, seed aside
(:func:`split_sweep`): ``rlpost train -m algo=grpo,dr_grpo seed=1,2`` then
``rlpost compare multirun/<time>`` compares dr_grpo against grpo over seeds 1-2. Every run holds an
``eval.json`` written by ``rlpost train`` / ``rlpost eval`` with per-problem
records. Runs of two methods are paired by seed and task, problems by their
index (and text); the difference B - A gets a paired bootstrap 95% CI
(:func:`rlpost.eval.stats.paired_bootstrap`), the evaluation standard of
DataFlex-RL, and the report says plainly whether the interval excludes zero.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from rlpost.core.errors import DataError, RlpostError
from rlpost.eval.stats import paired_bootstrap

EVAL_FILE = "eval.json"


@dataclass
class RunEval:
    """The evaluation of one run: ``{task: {problem index: (question, score)}}`` and its seed."""

    path: Path
    seed: Optional[int]
    scores: Dict[str, Dict[int, Tuple[str, float]]] = field(default_factory=dict)


def _results_in(payload: Any, path: Path) -> List[Dict[str, Any]]:
    """Evaluation results in an eval.json payload: one result, a list, or ``{task: result}``."""
    if isinstance(payload, dict) and "records" in payload and "task" in payload:
        return [payload]
    if isinstance(payload, list):
        return [r for r in payload if isinstance(r, dict) and "records" in r]
    if isinstance(payload, dict):
        found = [r for r in payload.values() if isinstance(r, dict) and "records" in r and "task" in r]
        if found:
            return found
    raise DataError(f"{path} holds no per-problem evaluation records; re-run the evaluation with a current rlpost")


def _seed_of(run_dir: Path, results: List[Dict[str, Any]]) -> Optional[int]:
    for r in results:
        if r.get("seed") is not None:
            return int(r["seed"])
    cfg = run_dir / "config.yaml"
    if cfg.is_file():
        from omegaconf import OmegaConf

        try:
            seed = OmegaConf.load(cfg).get("seed")
            return int(seed) if seed is not None else None
        except Exception:  # noqa: BLE001 - an unreadable config only loses the seed
            return None
    return None


def load_run(run_dir: str | Path, metric: str = "correct") -> RunEval:
    """Read ``run_dir/eval.json`` into a :class:`RunEval`.

    Args:
        run_dir: a run directory (holding ``eval.json``) or the file itself.
        metric: per-problem record field compared: ``correct`` (greedy
            accuracy) or a sampled figure such as ``pass@4`` / ``maj@4`` / ``mean@8``.
    Raises:
        DataError: no eval.json, malformed JSON, or records without ``metric``.
    """
    p = Path(run_dir)
    f = p if p.is_file() else p / EVAL_FILE
    if not f.is_file():
        raise DataError(f"{p} has no {EVAL_FILE}; give run directories produced by `rlpost train` or `rlpost eval`")
    try:
        payload = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{f} is not valid JSON: {e}") from None
    results = _results_in(payload, f)
    run = RunEval(path=f.parent, seed=_seed_of(f.parent, results))
    for res in results:
        per: Dict[int, Tuple[str, float]] = {}
        for rec in res["records"]:
            if metric not in rec:
                have = sorted(k for k in rec if k == "correct" or "@" in k)
                raise DataError(f"{f}: task {res['task']!r} records have no {metric!r}; available: {', '.join(have)}")
            per[int(rec["index"])] = (str(rec.get("question", "")), float(rec[metric]))
        run.scores[str(res["task"])] = per
    return run


def discover_runs(spec: str) -> List[Path]:
    """Run directories of one method spec: a run dir, a folder of runs (searched
    recursively for ``eval.json``) or a glob pattern.

    Raises:
        DataError: nothing matched.
    """
    paths = [Path(p) for p in sorted(glob.glob(spec))] if any(c in spec for c in "*?[") else [Path(spec)]
    runs: List[Path] = []
    for p in paths:
        if (p / EVAL_FILE).is_file() or (p.is_file() and p.name == EVAL_FILE):
            runs.append(p if p.is_dir() else p.parent)
        elif p.is_dir():
            runs.extend(sorted(f.parent for f in p.rglob(EVAL_FILE)))
    if not runs:
        raise DataError(f"no run with {EVAL_FILE} found under {spec!r}; give a run directory, a sweep folder or a glob")
    return runs


def _run_overrides(run_dir: Path) -> Dict[str, str]:
    """A sweep run's own overrides (``.hydra/overrides.yaml``), ``{key: value}``, without ``hydra.*``."""
    f = run_dir / ".hydra" / "overrides.yaml"
    out: Dict[str, str] = {}
    if f.is_file():
        from omegaconf import OmegaConf

        for o in OmegaConf.load(f) or []:
            k, _, v = str(o).partition("=")
            k = k.lstrip("+~")
            if not k.startswith("hydra."):
                out[k] = v
    return out


def split_sweep(folder: str | Path) -> List[Tuple[str, List[Path]]]:
    """Split the runs of one sweep folder into methods: ``[(label, run dirs)]``, in job order.

    Runs with the same overrides apart from ``seed`` form one method; its label
    names the overrides whose values differ between methods (e.g. ``algo=dr_grpo``).
    The first method (lowest job number) is the baseline.

    Raises:
        DataError: no run with eval.json under ``folder``.
    """
    runs = discover_runs(str(folder))
    ovs = [_run_overrides(r) for r in runs]
    keys = sorted({k for o in ovs for k in o if k != "seed"})
    varying = [k for k in keys if len({o.get(k) for o in ovs}) > 1]
    groups: Dict[Tuple[Tuple[str, Optional[str]], ...], List[Path]] = {}
    for r, o in zip(runs, ovs):
        groups.setdefault(tuple((k, o.get(k)) for k in varying), []).append(r)

    def job(p: Path) -> int:
        head = p.name.split("_", 1)[0]
        return int(head) if head.isdigit() else 0

    ordered = sorted(groups.items(), key=lambda kv: min(job(p) for p in kv[1]))
    return [(",".join(f"{k}={v}" for k, v in key) or str(folder), paths) for key, paths in ordered]


def _by_seed(runs: List[RunEval], label: str) -> Dict[int, RunEval]:
    out: Dict[int, RunEval] = {}
    for i, r in enumerate(runs):
        seed = r.seed if r.seed is not None else i
        if seed in out:
            raise DataError(
                f"method {label!r} has two runs with seed {seed}: {out[seed].path} and {r.path}; "
                "give one run per seed (e.g. a single sweep folder)"
            )
        out[seed] = r
    return out


def compare_methods(
    a: List[RunEval], b: List[RunEval], label_a: str = "A", label_b: str = "B", n_boot: int = 2000, seed: int = 0
) -> Dict[str, Any]:
    """Paired comparison of method B against method A.

    Runs are matched by seed, problems by index within each task shared by
    both methods; for every task the ``[seeds, problems]`` matrix of B - A
    differences goes to :func:`paired_bootstrap`, and the benchmark-balanced
    overall difference uses the stratified version over all shared tasks.

    Returns:
        ``{"a", "b", "seeds", "dropped_seeds", "tasks": {task: stats}, "overall": stats}``
        where each ``stats`` has ``mean_a``, ``mean_b``, ``diff`` (B - A), ``ci_low``,
        ``ci_high``, ``p_value``, ``significant``, ``n_seeds``, ``n_problems``.
    Raises:
        DataError: no shared seed, no shared task, or the same index holds
            different questions in the two methods (not the same problems).
    """
    sa, sb = _by_seed(a, label_a), _by_seed(b, label_b)
    seeds = sorted(set(sa) & set(sb))
    dropped = sorted(set(sa) ^ set(sb))
    if not seeds:
        raise DataError(
            f"{label_a!r} (seeds {sorted(sa)}) and {label_b!r} (seeds {sorted(sb)}) share no seed; "
            "a paired comparison needs runs with matched seeds"
        )
    tasks = sorted(set.intersection(*[set(sa[s].scores) & set(sb[s].scores) for s in seeds]))
    if not tasks:
        raise DataError(f"{label_a!r} and {label_b!r} share no evaluated task under the matched seeds {seeds}")
    out: Dict[str, Any] = {"a": label_a, "b": label_b, "seeds": seeds, "dropped_seeds": dropped, "tasks": {}}
    strata = []
    means_a, means_b = [], []
    for t in tasks:
        common = sorted(set.intersection(*[set(sa[s].scores[t]) & set(sb[s].scores[t]) for s in seeds]))
        if not common:
            raise DataError(f"task {t!r}: {label_a!r} and {label_b!r} evaluated no problem in common")
        for s in seeds:
            for i in common:
                qa, qb = sa[s].scores[t][i][0], sb[s].scores[t][i][0]
                if qa and qb and qa != qb:
                    raise DataError(
                        f"task {t!r} problem {i}: {sa[s].path} and {sb[s].path} evaluated different questions; "
                        "compare runs evaluated on the same data (same task.path / data_seed)"
                    )
        A = np.array([[sa[s].scores[t][i][1] for i in common] for s in seeds])
        B = np.array([[sb[s].scores[t][i][1] for i in common] for s in seeds])
        st = paired_bootstrap(B - A, n_boot=n_boot, seed=seed)
        out["tasks"][t] = {
            "mean_a": float(A.mean()), "mean_b": float(B.mean()), "diff": st["mean"],
            "ci_low": st["ci_low"], "ci_high": st["ci_high"], "p_value": st["p_value"],
            "significant": bool(st["significant"]), "n_seeds": len(seeds), "n_problems": len(common),
            "n_problems_a": max(len(sa[s].scores[t]) for s in seeds), "n_problems_b": max(len(sb[s].scores[t]) for s in seeds),
        }
        strata.append(B - A)
        means_a.append(A.mean())
        means_b.append(B.mean())
    st = paired_bootstrap(strata, n_boot=n_boot, seed=seed)
    out["overall"] = {
        "mean_a": float(np.mean(means_a)), "mean_b": float(np.mean(means_b)), "diff": st["mean"],
        "ci_low": st["ci_low"], "ci_high": st["ci_high"], "p_value": st["p_value"],
        "significant": bool(st["significant"]), "n_seeds": len(seeds),
        "n_problems": int(sum(s.shape[1] for s in strata)), "n_tasks": len(tasks),
    }
    return out


def verdict(st: Dict[str, Any], label_a: str, label_b: str) -> str:
    """One plain sentence on whether the difference is significant at 95%."""
    if not st["significant"]:
        return f"not significant: the 95% CI includes 0, so this data cannot tell {label_b} from {label_a}"
    better = label_b if st["diff"] > 0 else label_a
    return f"significant: the 95% CI excludes 0; {better} is better"


def format_report(cmp: Dict[str, Any], metric: str = "correct") -> str:
    """Human-readable report of :func:`compare_methods`."""
    a, b = cmp["a"], cmp["b"]
    name = "accuracy" if metric == "correct" else metric
    lines = [f"{b}  vs  {a}  ({name}, {len(cmp['seeds'])} matched seed(s): {cmp['seeds']})"]
    if cmp["dropped_seeds"]:
        lines.append(f"  seeds without a partner, left out: {cmp['dropped_seeds']}")
    if len(cmp["seeds"]) == 1:
        lines.append("  one seed only: the CI covers problem sampling, not seed-to-seed variance")
    rows = list(cmp["tasks"].items())
    if len(rows) > 1:
        rows.append(("overall (benchmark-balanced)", cmp["overall"]))
    for t, st in cmp["tasks"].items():
        if st["n_problems_a"] != st["n_problems"] or st["n_problems_b"] != st["n_problems"]:
            lines.append(
                f"  {t}: only the {st['n_problems']} problems evaluated by both are compared "
                f"({a}: {st['n_problems_a']}, {b}: {st['n_problems_b']})"
            )
    for t, st in rows:
        lines.append(
            f"  {t}: {a} {st['mean_a']:.3f}, {b} {st['mean_b']:.3f}, diff {st['diff']:+.3f} "
            f"[95% CI {st['ci_low']:+.3f}, {st['ci_high']:+.3f}], p={st['p_value']:.3f}, "
            f"n={st['n_problems']} problems -> {verdict(st, a, b)}"
        )
    return "\n".join(lines)


def compare(
    specs: Sequence[str], metric: str = "correct", n_boot: int = 2000, seed: int = 0
) -> Tuple[str, List[Dict[str, Any]]]:
    """What ``rlpost compare A B [C ...]`` (or ``rlpost compare SWEEP``) runs: every method against the first.

    Args:
        specs: method specs (see :func:`discover_runs`); the first is the
            baseline. One spec: a sweep folder, split into methods by
            :func:`split_sweep`.
        metric: record field compared (see :func:`load_run`).
    Returns:
        ``(report text, list of compare_methods results)``.
    Raises:
        DataError: fewer than two methods, or any loading/matching problem.
    """
    if len(specs) == 1:
        groups = split_sweep(specs[0])
        if len(groups) < 2:
            n = len(groups[0][1]) if groups else 0
            what = ("holds one run, so one method" if n == 1 else
                    f"holds one method: its {n} runs differ in seed only")
            raise DataError(f"{specs[0]!r} {what}, and rlpost compare needs at least two methods (it pairs two "
                            f"methods' runs of the same seed). For this method's curves"
                            f"{'' if n == 1 else ' and spread over seeds'}: rlpost report {specs[0]}. To compare "
                            f"methods, sweep two or more: rlpost train -m algo=grpo,dr_grpo seed=1,2, then "
                            f"rlpost compare multirun/<time>")
    elif not specs:
        raise DataError("rlpost compare needs a sweep folder or two methods: rlpost compare multirun/<time> | RUN_A RUN_B")
    else:
        groups = [(s, discover_runs(s)) for s in specs]
    labels = [g[0] for g in groups]
    methods = [[load_run(p, metric) for p in paths] for _, paths in groups]
    results = [compare_methods(methods[0], m, labels[0], lab, n_boot=n_boot, seed=seed)
               for lab, m in zip(labels[1:], methods[1:])]
    return "\n\n".join(format_report(r, metric) for r in results), results


def register_cli(app: Any) -> None:
    """Add the ``compare`` command to the Typer ``app`` of :mod:`rlpost.cli`."""
    import typer

    if any(getattr(c, "name", None) == "compare" for c in app.registered_commands):
        return

    @app.command("compare")
    def compare_cmd(
        runs: List[str] = typer.Argument(..., help="One sweep folder (multirun/<time>: its methods are compared), or "
                                         "methods as run dirs, folders or globs; the first is the baseline."),
        metric: str = typer.Option("correct", help="Record field: correct (greedy accuracy), pass@k, maj@k, mean@n."),
        n_boot: int = typer.Option(2000, "--n-boot", help="Bootstrap replicates."),
        seed: int = typer.Option(0, help="Seed of the bootstrap."),
        json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the figures to this JSON file."),
    ) -> None:
        """Paired comparison of methods over matched seeds and problems (paired bootstrap 95% CI).

        Examples:

          rlpost compare multirun/2026-01-01_00-00-00     (after rlpost train -m algo=grpo,dr_grpo seed=1,2)

          rlpost compare outputs/grpo-gsm8k outputs/dr_grpo-gsm8k

          rlpost compare 'outputs/uniform-*' 'outputs/vade-*' --metric pass@4
        """

        try:
            text, results = compare(runs, metric=metric, n_boot=n_boot, seed=seed)
        except RlpostError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(code=e.exit_code)
        typer.echo(text)
        if json_out is not None:
            json_out.write_text(json.dumps(results, indent=1))

