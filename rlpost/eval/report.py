"""``rlpost report``: training curves across seeds and a paired comparison, as PNG figures and one HTML page.

Given run directories, folders of runs or sweep folders (anything holding
``metrics.jsonl`` files), the report

1. groups the runs into methods: runs whose resolved ``config.yaml`` is the
   same apart from ``seed`` (and the ``logger`` settings, which do not change a
   run) form one method; its label names the overrides that differ between
   methods (``algo=dr_grpo``), from each run's ``.hydra/overrides.yaml``, or
   the differing config keys when runs have no overrides file;
2. plots reward, held-out accuracy, response length, entropy, clip fraction and
   KL against step and against wall time: per method the mean over seeds at
   each logged step with a 95% confidence band across seeds (Student t on the
   seed means, or +-1 standard deviation with ``band="sd"``), and each seed's
   own curve faintly;
3. tabulates each method's final figures and compares every method against the
   first (the baseline) with the paired bootstrap CI over matched seeds and
   problems of :func:`rlpost.eval.compare.compare_methods`;
4. writes ``curves_step.png``, ``curves_wall_time.png``, ``series.json`` (the
   exact numbers plotted), ``report.json``, and ``report.html`` (self-contained:
   the figures are inlined as base64 PNG), and logs the same figures and table
   to a W&B run when W&B is on.

Wall time at a logged step is the sum over the run's records up to that step of
``time/step_s`` (rollout, reward and update) and the evaluation ``time_s``
values; model loading and checkpoint writing are left out, so it is the time
the training loop took, comparable across methods on one machine.
"""

from __future__ import annotations

import base64
import html
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from rlpost.core.errors import ConfigError, DataError, RlpostError
from rlpost.core.tracking import resolve_wandb_mode
from rlpost.eval.compare import EVAL_FILE, compare_methods, load_run, verdict

METRICS_FILE = "metrics.jsonl"

#: The report's panels: (slug, title, metric keys; the first key a run logged is plotted).
PANELS: Tuple[Tuple[str, str, Tuple[str, ...]], ...] = (
    ("reward", "reward (mean over the batch)", ("reward/mean",)),
    ("accuracy", "held-out accuracy (greedy)", ("eval/accuracy",)),
    ("length", "response length (tokens)", ("response/length_mean",)),
    ("entropy", "entropy (nats / token)", ("actor/entropy",)),
    ("clip_frac", "clip fraction", ("actor/clip_frac",)),
    ("kl", "KL", ("actor/kl_ref", "actor/approx_kl")),
)
#: Names of the KL keys in panel titles.
KL_NAMES = {"actor/kl_ref": "KL to the reference policy (actor/kl_ref)",
            "actor/approx_kl": "KL(old || new), k3 (actor/approx_kl)"}
X_AXES = (("step", "step"), ("wall_time", "wall time (s)"))
BANDS = ("ci95", "sd")

# Student t quantiles t(0.975, df) for df = 1..30; beyond 30 the normal 1.96.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (1.96 beyond 30).

    Raises:
        ValueError: ``df < 1``.
    """
    if df < 1:
        raise ValueError(f"t975 needs df >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_band(values: Sequence[float], band: str = "ci95") -> Tuple[float, float, float]:
    """``(mean, low, high)`` of per-seed values.

    ``ci95``: mean -+ t(0.975, n-1) * sd / sqrt(n), the 95% confidence interval
    of the mean across seeds (seeds as independent draws); ``sd``: mean -+ one
    sample standard deviation (ddof=1). With one value the band is that value.

    Raises:
        ConfigError: unknown ``band``; ValueError: no values.
    """
    if band not in BANDS:
        raise ConfigError(f"band={band!r} is not a band; choose one of {', '.join(BANDS)}")
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        raise ValueError("mean_band needs at least one value")
    m = float(v.mean())
    if v.size == 1:
        return m, m, m
    sd = float(v.std(ddof=1))
    half = t975(v.size - 1) * sd / math.sqrt(v.size) if band == "ci95" else sd
    return m, m - half, m + half


@dataclass
class RunCurves:
    """One run's logged records, read from ``metrics.jsonl``, with its seed, config and overrides."""

    path: Path
    seed: Optional[int]
    config: Dict[str, Any]
    overrides: Dict[str, str]
    records: List[Dict[str, Any]] = field(default_factory=list)

    def series(self, key: str) -> Dict[str, List[float]]:
        """``{"step", "wall_time", "value"}`` of every record that logged ``key`` (see the module doc for wall time)."""
        out: Dict[str, List[float]] = {"step": [], "wall_time": [], "value": []}
        wall = 0.0
        for rec in self.records:
            wall += float(rec.get("time/step_s") or 0.0) + sum(
                float(v or 0.0) for k, v in rec.items() if k.startswith("eval/") and k.endswith("/time_s"))
            if rec.get(key) is not None:
                out["step"].append(float(rec["step"]))
                out["wall_time"].append(wall)
                out["value"].append(float(rec[key]))
        return out


def _flatten(d: Any, prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = json.dumps(d, sort_keys=True) if isinstance(d, list) else d
    return out


def load_run_curves(run_dir: str | Path) -> RunCurves:
    """Read a run directory's ``metrics.jsonl``, ``config.yaml`` and ``.hydra/overrides.yaml``.

    Raises:
        DataError: no ``metrics.jsonl``, or it holds no record with a ``step``.
    """
    from omegaconf import OmegaConf

    d = Path(run_dir)
    f = d / METRICS_FILE
    if not f.is_file():
        raise DataError(f"{d} has no {METRICS_FILE}; give run directories written by `rlpost train`")
    recs = []
    for line in f.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if isinstance(r, dict) and r.get("step") is not None:
            recs.append(r)
    if not recs:
        failed = d / "FAILED"
        why = failed.read_text().strip().splitlines()[:1] if failed.is_file() else []
        raise DataError(f"{f} holds no logged step" + (f" (FAILED: {why[0]})" if why else ""))
    cfg: Dict[str, Any] = {}
    if (d / "config.yaml").is_file():
        cfg = _flatten(OmegaConf.to_container(OmegaConf.load(d / "config.yaml"), resolve=False))
    ovs: Dict[str, str] = {}
    if (d / ".hydra" / "overrides.yaml").is_file():
        for o in OmegaConf.load(d / ".hydra" / "overrides.yaml") or []:
            k, _, v = str(o).partition("=")
            k = k.lstrip("+~")
            if not k.startswith("hydra"):
                ovs[k] = v
    seed = cfg.get("seed")
    return RunCurves(path=d, seed=int(seed) if seed is not None else None, config=cfg, overrides=ovs, records=recs)


def discover(specs: Sequence[str | Path]) -> List[Path]:
    """Run directories under ``specs`` (each a run directory or a folder searched for ``metrics.jsonl``).

    Runs are ordered by folder, then sweep job number. Raises DataError when a
    spec holds no run.
    """
    runs: List[Path] = []
    for spec in specs:
        p = Path(spec)
        if (p / METRICS_FILE).is_file():
            found = [p]
        elif p.is_dir():
            found = [f.parent for f in p.rglob(METRICS_FILE)]
        else:
            raise DataError(f"{spec}: no such directory; give run directories or sweep folders")
        if not found:
            raise DataError(f"{spec}: holds no {METRICS_FILE}; give run directories or sweep folders of `rlpost train`")

        def order(r: Path) -> Tuple[str, int, str]:
            head = r.name.split("_", 1)[0]
            return (str(r.parent), int(head) if head.isdigit() else -1, r.name)

        runs.extend(r for r in sorted(found, key=order) if r not in runs)
    return runs


#: Config keys that do not tell methods apart: the seed (what a band is over), where a run logs, and
#: ``resume`` (a resumed run is the same run continued).
IGNORED_PREFIXES = ("seed", "logger.", "name", "resume")


def _ignored(key: str) -> bool:
    """Whether config key ``key`` is one of :data:`IGNORED_PREFIXES` (it does not tell methods apart)."""
    return any(key == p or key.startswith(p) for p in IGNORED_PREFIXES)


def group_runs(runs: List[RunCurves]) -> List[Tuple[str, List[RunCurves]]]:
    """Group runs into methods (same config apart from :data:`IGNORED_PREFIXES`), in first-seen order.

    Returns ``[(label, runs)]``; the label lists the overrides (or, without
    overrides files, the config keys) whose values differ between methods.
    """
    def ident(r: RunCurves) -> Tuple[Tuple[str, str], ...]:
        return tuple(sorted((k, str(v)) for k, v in r.config.items() if not _ignored(k)))

    groups: Dict[Tuple[Tuple[str, str], ...], List[RunCurves]] = {}
    for r in runs:
        groups.setdefault(ident(r), []).append(r)
    members = list(groups.values())
    if len(members) == 1:
        ovs = members[0][0].overrides
        label = ",".join(f"{k}={v}" for k, v in ovs.items() if not _ignored(k)) or str(members[0][0].config.get("name", "runs"))
        return [(label if len(label) <= 80 else label[:77] + "...", members[0])]

    def labels_from(dicts: List[Dict[str, Any]]) -> List[str]:
        keys = sorted({k for d in dicts for k in d if not _ignored(k)})
        varying = [k for k in keys if len({str(d.get(k)) for d in dicts}) > 1]
        return [",".join(f"{k}={d.get(k)}" for k in varying) for d in dicts]

    labs = labels_from([g[0].overrides for g in members])
    if len(set(labs)) < len(labs) or not all(labs):
        labs = labels_from([g[0].config for g in members])
        labs = [lab if len(lab) <= 80 else lab[:77] + "..." for lab in labs]
        if len(set(labs)) < len(labs):
            labs = [f"{lab} #{i + 1}" for i, lab in enumerate(labs)]
    return list(zip(labs, members))


def panel_key(runs: List[RunCurves], keys: Sequence[str]) -> Optional[str]:
    """The first of ``keys`` that any run logged (None when none did)."""
    for k in keys:
        if any(rec.get(k) is not None for r in runs for rec in r.records):
            return k
    return None


def aggregate(runs: List[RunCurves], key: str, band: str = "ci95") -> Dict[str, Any]:
    """Mean and band over seeds of ``key`` at each logged step.

    Returns ``{"step", "wall_time", "mean", "low", "high", "n", "runs"}``: at each
    step any run logged, ``wall_time`` is the mean over the runs that logged it,
    ``mean`` / ``low`` / ``high`` come from :func:`mean_band` over those runs,
    ``n`` counts them; ``runs`` maps each run directory to its own series.
    """
    per = {str(r.path): r.series(key) for r in runs}
    steps = sorted({s for sr in per.values() for s in sr["step"]})
    out: Dict[str, Any] = {"step": [], "wall_time": [], "mean": [], "low": [], "high": [], "n": [], "runs": per}
    for s in steps:
        vals, walls = [], []
        for sr in per.values():
            if s in sr["step"]:
                i = sr["step"].index(s)
                vals.append(sr["value"][i])
                walls.append(sr["wall_time"][i])
        m, lo, hi = mean_band(vals, band)
        out["step"].append(s)
        out["wall_time"].append(float(np.mean(walls)))
        out["mean"].append(m)
        out["low"].append(lo)
        out["high"].append(hi)
        out["n"].append(len(vals))
    return out


def build_series(groups: List[Tuple[str, List[RunCurves]]], band: str = "ci95") -> Dict[str, Any]:
    """Every panel's aggregated series: ``{slug: {"key", "title", "groups": {label: aggregate}}}``.

    A panel no run logged has ``key`` None and no groups.
    """
    all_runs = [r for _, rs in groups for r in rs]
    out: Dict[str, Any] = {}
    for slug, title, keys in PANELS:
        key = panel_key(all_runs, keys)
        if slug == "kl" and key is not None:
            title = KL_NAMES.get(key, title)
        out[slug] = {"key": key, "title": title, "groups": {}}
        if key is None:
            continue
        for label, rs in groups:
            agg = aggregate(rs, key, band)
            if agg["step"]:
                out[slug]["groups"][label] = agg
    return out


#: a curve of at most this many points is drawn as points, not joined by lines (two evaluations, at
#: step 0 and at the end, joined by a straight line look like a measured trend), its band as error bars
FEW_POINTS = 5


def plural(n: int, word: str) -> str:
    """``1 run``, ``2 runs``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def seeds_per_method(series: Dict[str, Any]) -> int:
    """The largest number of runs any method has in any panel of ``series`` (1: no mean over seeds anywhere)."""
    return max((len(agg["runs"]) for p in series.values() for agg in p["groups"].values()), default=0)


def plot_curves(series: Dict[str, Any], x_axis: str, band: str = "ci95", title: str = "") -> Any:
    """A 2 x 3 matplotlib figure of the panels against ``x_axis`` (``step`` or ``wall_time``).

    Per method: the mean line (with markers where a panel has few points; points only,
    not joined, at :data:`FEW_POINTS` or fewer), the band as a shaded area (error bars
    for points), each seed's own curve thin and faint. Step axes get integer ticks. With
    one run per method the title says so instead of "mean over seeds". The y range
    covers the curves (means and seeds) with a margin; a wider band is cut
    there (with two seeds the 95% t band is +-8.98 sd). Uses the Agg
    backend (no display needed). Returns the Figure; the caller closes it.

    Raises:
        ConfigError: unknown ``x_axis``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    axes_names = dict(X_AXES)
    if x_axis not in axes_names:
        raise ConfigError(f"x_axis={x_axis!r}: choose one of {', '.join(axes_names)}")
    labels = list(dict.fromkeys(lab for p in series.values() for lab in p["groups"]))
    colors = {lab: plt.get_cmap("tab10")(i % 10) for i, lab in enumerate(labels)}
    fig, axs = plt.subplots(2, 3, figsize=(15, 8.4), dpi=100)
    band_name = "95% CI across seeds" if band == "ci95" else "+-1 sd across seeds"
    for ax, (slug, _, _) in zip(axs.flat, PANELS):
        p = series[slug]
        ax.set_title(p["title"], fontsize=10)
        ax.set_xlabel(axes_names[x_axis], fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        ax.ticklabel_format(axis="y", useOffset=False)
        if x_axis == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not p["groups"]:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes,
                    color="gray", fontsize=9)
            continue
        seen: List[float] = []  # the y range: the curves, not the bands (a 2-seed t band is +-8.98 sd)
        for lab, agg in p["groups"].items():
            c = colors[lab]
            seen.extend(agg["mean"])
            points = len(agg["step"]) <= FEW_POINTS
            for rpath, sr in agg["runs"].items():
                if len(agg["runs"]) > 1 and sr["value"]:
                    ax.plot(sr[x_axis], sr["value"], color=c, alpha=0.45, lw=0 if points else 0.7,
                            marker="." if points else None, ms=4, gid=f"run:{rpath}")
                    seen.extend(sr["value"])
            few = len(agg["step"]) <= 12
            ax.plot(agg[x_axis], agg["mean"], color=c, lw=0 if points else 1.8, marker="o" if few else None,
                    ms=5 if points else 3.5, label=lab, gid=f"mean:{lab}")
            if max(agg["n"]) > 1 and points:
                err = [[m - lo_ for m, lo_ in zip(agg["mean"], agg["low"])],
                       [hi_ - m for m, hi_ in zip(agg["mean"], agg["high"])]]
                eb = ax.errorbar(agg[x_axis], agg["mean"], yerr=err, fmt="none", ecolor=c, alpha=0.5, capsize=3)
                for cap in eb.lines[1]:
                    cap.set_gid(f"band:{lab}")
            elif max(agg["n"]) > 1:
                ax.fill_between(agg[x_axis], agg["low"], agg["high"], color=c, alpha=0.18, lw=0)
        lo, hi = min(seen), max(seen)
        pad = 0.12 * (hi - lo) if hi > lo else max(abs(hi) * 0.1, 0.05)
        ax.set_ylim(lo - pad, hi + pad)
    handles, labs = [], []
    for ax in axs.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labs:
                handles.append(h)
                labs.append(lab)
    fig.legend(handles, labs, loc="upper center", ncol=min(4, max(1, len(labs))), fontsize=9, frameon=False,
               bbox_to_anchor=(0.5, 0.995))
    if seeds_per_method(series) > 1:
        how = f"mean over seeds, shaded or bars: {band_name} (cut at the plotted range), thin: each seed"
    else:
        how = "one run per method: each curve is that run's own values, without a band"
    sup = (title + "  |  " if title else "") + how
    fig.suptitle(sup, fontsize=10, y=0.955)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return fig


def final_table(groups: List[Tuple[str, List[RunCurves]]], band: str = "ci95") -> List[Dict[str, Any]]:
    """Per method: seeds, each run's last logged step, mean [band] over seeds of the last logged
    reward and of the final held-out accuracy (``eval.json``), and the loop's wall time (see the
    module doc) as mean with min and max (a t band of durations can go below 0)."""
    rows = []
    for label, rs in groups:
        row: Dict[str, Any] = {"method": label, "seeds": [r.seed for r in rs], "runs": [str(r.path) for r in rs]}
        rew_series = [r.series("reward/mean") for r in rs]
        rew = [sr["value"][-1] for sr in rew_series if sr["value"]]
        row["last_steps"] = [int(sr["step"][-1]) if sr["step"] else 0 for sr in rew_series]
        walls = [r.series("step")["wall_time"][-1] if r.series("step")["wall_time"] else None for r in rs]
        accs = []
        for r in rs:
            f = r.path / "eval.json"
            if f.is_file():
                try:
                    a = json.loads(f.read_text()).get("accuracy")
                except (json.JSONDecodeError, AttributeError):
                    a = None
                if a is not None:
                    accs.append(float(a))
        for name, vals in (("final_reward", rew), ("final_accuracy", accs)):
            row[name] = dict(zip(("mean", "low", "high"), mean_band(vals, band))) if vals else None
            if vals:
                row[name]["n"] = len(vals)
        w = [x for x in walls if x is not None]
        row["wall_time_s"] = {"mean": float(np.mean(w)), "min": float(min(w)), "max": float(max(w)), "n": len(w)} if w else None
        rows.append(row)
    return rows


def comparisons(groups: List[Tuple[str, List[RunCurves]]], n_boot: int = 2000) -> List[Dict[str, Any]]:
    """Every method against the first with :func:`rlpost.eval.compare.compare_methods` (paired bootstrap
    over matched seeds and problems of the final ``eval.json``). A pair that cannot be compared
    (no eval.json, no shared seed) gets ``{"a", "b", "error"}`` instead of the figures."""

    out = []
    if len(groups) < 2:
        return out
    base_label, base_runs = groups[0]
    for label, rs in groups[1:]:
        try:
            missing = [str(r.path) for r in base_runs + rs if not (r.path / EVAL_FILE).is_file()]
            if missing:
                raise DataError(f"no {EVAL_FILE} in {', '.join(missing)} (the run did not finish)")
            cmp = compare_methods([load_run(r.path) for r in base_runs], [load_run(r.path) for r in rs],
                                  base_label, label, n_boot=n_boot)
            cmp["verdict"] = verdict(cmp["overall"], base_label, label)
            out.append(cmp)
        except DataError as e:
            out.append({"a": base_label, "b": label, "error": str(e)})
    return out


def _fmt_band(d: Optional[Dict[str, float]], fmt: str = "{:.3f}") -> str:
    if not d:
        return "-"
    s = fmt.format(d["mean"])
    if d.get("n", 1) > 1:
        s += f" [{fmt.format(d['low'])}, {fmt.format(d['high'])}]"
    return s


def _fmt_range(d: Optional[Dict[str, float]]) -> str:
    if not d:
        return "-"
    return f"{d['mean']:.1f}" + (f" ({d['min']:.1f}-{d['max']:.1f})" if d.get("n", 1) > 1 else "")


def render_html(report: Dict[str, Any], images: Dict[str, Path]) -> str:
    """The self-contained HTML page: figures inlined as base64 PNG, the tables, the runs."""
    e = html.escape
    multi = any(len(rs) > 1 for rs in report["groups"].values())
    band = "95% CI across seeds (Student t)" if report["band"] == "ci95" else "+-1 standard deviation across seeds"
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>rlpost report</title><style>",
        "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1180px;"
        "color:#222;padding:0 12px}h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}"
        "table{border-collapse:collapse;font-size:13px;margin:8px 0}td,th{border:1px solid #ccc;padding:4px 8px;"
        "text-align:left;vertical-align:top}th{background:#f3f3f3}img{width:100%;border:1px solid #eee}"
        ".sig{color:#0a6b0a;font-weight:600}.ns{color:#777}.err{color:#a00}code{font-size:12px}"
        ".note{color:#555;font-size:13px}.nw{white-space:nowrap}</style></head><body>",
        f"<h1>rlpost report</h1><p class='note'>{plural(len(report['runs']), 'run')} in "
        f"{plural(len(report['groups']), 'method')}, made {e(report['created'])}. "
        + (f"Lines: mean over seeds; shaded: {e(band)}; thin lines: each seed. " if multi else
           "One run per method: each curve is that run's own values, without a band. ")
        + f"Curves of {FEW_POINTS} points or fewer are drawn as points. Wall time: the training loop's own time "
        "(steps and evaluations; no model loading or checkpoint writing).</p>",
    ]
    for x_axis, name in X_AXES:
        parts.append(f"<h2>Against {e(name)}</h2>")
        b64 = base64.b64encode(images[x_axis].read_bytes()).decode("ascii")
        parts.append(f"<img alt='curves against {e(name)}' src='data:image/png;base64,{b64}'>")
    parts.append("<h2>Final figures per method</h2><p class='note'>"
                 + ("Mean over seeds [the band]; wall time: mean (min-max)." if multi else "Each run's own figures.")
                 + "</p><table><tr><th>method</th><th>seeds</th><th>last step</th>"
                 "<th>final reward/mean</th><th>held-out accuracy (eval.json)</th><th>wall time (s)</th></tr>")
    uneven = []
    for row in report["final"]:
        steps = row["last_steps"]
        if len(set(steps)) > 1:
            uneven.append(row["method"])
        parts.append(f"<tr><td>{e(row['method'])}</td><td>{e(', '.join(str(s) for s in row['seeds']))}</td>"
                     f"<td>{e(', '.join(str(s) for s in steps))}</td>"
                     f"<td>{_fmt_band(row['final_reward'])}</td><td>{_fmt_band(row['final_accuracy'])}</td>"
                     f"<td>{_fmt_range(row['wall_time_s'])}</td></tr>")
    parts.append("</table>")
    if uneven:
        parts.append(f"<p class='err'>The runs of {e(', '.join(uneven))} end at different steps (unfinished or "
                     "interrupted runs): their final figures mix steps, and the held-out accuracy covers only the "
                     "runs that finished.</p>")
    if report["comparisons"]:
        parts.append("<h2>Paired comparison against the first method</h2><p class='note'>Held-out accuracy "
                     "difference B - A over matched seeds and problems, paired bootstrap 95% CI "
                     "(seeds and problems resampled).</p><table><tr><th>B</th><th>A (baseline)</th><th>task</th>"
                     "<th>A</th><th>B</th><th>B - A [95% CI]</th><th>p</th><th>seeds</th><th>problems</th>"
                     "<th>verdict</th></tr>")
        for c in report["comparisons"]:
            if "error" in c:
                parts.append(f"<tr><td>{e(c['b'])}</td><td>{e(c['a'])}</td><td colspan='8' class='err'>"
                             f"not compared: {e(c['error'])}</td></tr>")
                continue
            rows = list(c["tasks"].items()) + ([("overall", c["overall"])] if len(c["tasks"]) > 1 else [])
            for t, st in rows:
                cls = "sig" if st["significant"] else "ns"
                # the full sentence on the row the decision is made on (overall, or the only task)
                say = c["verdict"] if t == "overall" or len(c["tasks"]) == 1 else (
                    "significant" if st["significant"] else "not significant")
                parts.append(
                    f"<tr><td>{e(c['b'])}</td><td>{e(c['a'])}</td><td>{e(t)}</td><td>{st['mean_a']:.3f}</td>"
                    f"<td>{st['mean_b']:.3f}</td><td class='nw'>{st['diff']:+.3f} [{st['ci_low']:+.3f}, {st['ci_high']:+.3f}]</td>"
                    f"<td>{st['p_value']:.3f}</td><td>{st['n_seeds']}</td><td>{st['n_problems']}</td>"
                    f"<td class='{cls}'>{e(say)}</td></tr>")
        parts.append("</table>")
    parts.append("<h2>Runs</h2><table><tr><th>method</th><th>seed</th><th>run directory</th><th>steps logged</th></tr>")
    for label, rs in report["groups"].items():
        for r in rs:
            parts.append(f"<tr><td>{e(label)}</td><td>{r['seed']}</td><td><code>{e(r['path'])}</code></td>"
                         f"<td>{r['steps']}</td></tr>")
    parts.append("</table><p class='note'>Numbers plotted: series.json beside this page.</p></body></html>")
    return "\n".join(parts)


def _wandb_on(runs: List[RunCurves], wandb: str) -> bool:
    if wandb not in ("auto", "on", "off"):
        raise ConfigError(f"--wandb {wandb!r}: choose auto (on when the runs logged to W&B), on or off")
    if wandb == "auto":
        return any(r.config.get("logger.backend") == "wandb" for r in runs)
    return wandb == "on"


def log_to_wandb(out_dir: Path, images: Dict[str, Path], report: Dict[str, Any], project: str,
                 entity: Optional[str], mode: str) -> Dict[str, str]:
    """Log the figures (``wandb.Image``) and the final-figures table to a new W&B run of ``job_type="report"``.

    The run is written under ``out_dir/wandb``; ``mode`` as the runs' ``logger.mode``
    (``auto``: online with credentials, else offline). Returns ``{"mode", "dir", "url"}``.
    """
    import wandb

    mode = resolve_wandb_mode(mode)
    run = wandb.init(project=project, entity=entity, name=f"report-{time.strftime('%Y-%m-%d_%H-%M-%S')}",
                     job_type="report", dir=str(out_dir), mode=mode, config={"band": report["band"],
                     "runs": [r["path"] for rs in report["groups"].values() for r in rs]},
                     settings=wandb.Settings(silent=True, console="off"))
    table = wandb.Table(columns=["method", "seeds", "final_reward", "final_accuracy", "wall_time_s"])
    for row in report["final"]:
        table.add_data(row["method"], ", ".join(str(s) for s in row["seeds"]), _fmt_band(row["final_reward"]),
                       _fmt_band(row["final_accuracy"]), _fmt_range(row["wall_time_s"]))
    run.log({**{f"report/curves_{x}": wandb.Image(str(p)) for x, p in images.items()}, "report/final": table})
    info = {"mode": mode, "dir": str(Path(run.dir).parent), "url": (getattr(run, "url", "") or "") if mode == "online" else ""}
    run.finish()
    return info


def make_report(specs: Sequence[str | Path], out_dir: Optional[str | Path] = None, band: str = "ci95",
                wandb: str = "auto", n_boot: int = 2000) -> Dict[str, Any]:
    """What ``rlpost report`` runs: read the runs, write the figures, series, tables and HTML page.

    Args:
        specs: run directories, folders of runs, sweep folders.
        out_dir: where to write; default ``<spec>/report`` for one spec, else
            ``outputs/report-<time>``.
        band: ``ci95`` or ``sd`` (see :func:`mean_band`).
        wandb: ``auto`` (log when the runs used ``logger=wandb``), ``on`` or ``off``.
        n_boot: bootstrap replicates of the paired comparison.
    Returns:
        the report dict (also written as ``report.json``) with ``files``: the paths written.
    Runs with no logged step (a run that failed or was stopped before its first
    step) are left out and listed under ``skipped``, so one failed run in a folder
    does not stop the report of the others.

    Raises:
        DataError: a spec holds no run, or no run logged a step; ConfigError: bad ``band`` / ``wandb``.
    """
    if band not in BANDS:
        raise ConfigError(f"--band {band!r}: choose one of {', '.join(BANDS)}")
    if not specs:
        raise DataError("rlpost report needs run directories or sweep folders: rlpost report multirun/<time>")
    runs: List[RunCurves] = []
    skipped: List[str] = []  # runs that stopped before their first step (a FAILED run, a config error)
    for p in discover(specs):
        try:
            runs.append(load_run_curves(p))
        except DataError as e:
            skipped.append(str(e))
    if not runs:
        raise DataError(skipped[0] if len(skipped) == 1 else f"none of the {len(skipped)} runs logged a step "
                        f"(first: {skipped[0]})")
    use_wandb = _wandb_on(runs, wandb)
    groups = group_runs(runs)
    out = Path(out_dir) if out_dir else (Path(specs[0]) / "report" if len(specs) == 1
                                         else Path("outputs") / f"report-{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    out.mkdir(parents=True, exist_ok=True)
    series = build_series(groups, band)
    import matplotlib.pyplot as plt

    images: Dict[str, Path] = {}
    for x_axis, _ in X_AXES:
        fig = plot_curves(series, x_axis, band)
        images[x_axis] = out / f"curves_{x_axis}.png"
        fig.savefig(images[x_axis])
        plt.close(fig)
    report: Dict[str, Any] = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "band": band,
        "runs": [str(r.path) for r in runs],
        "skipped": skipped,
        "groups": {lab: [{"path": str(r.path), "seed": r.seed,
                          "steps": max((int(x["step"]) for x in r.records), default=0)} for r in rs]
                   for lab, rs in groups},
        "panels": {slug: p["key"] for slug, p in series.items()},
        "final": final_table(groups, band),
        "comparisons": comparisons(groups, n_boot=n_boot),
    }
    (out / "series.json").write_text(json.dumps(series, indent=1))
    (out / "report.html").write_text(render_html(report, images))
    files = [str(images[x]) for x, _ in X_AXES] + [str(out / "series.json"), str(out / "report.html"),
                                                    str(out / "report.json")]
    if use_wandb:
        cfg0 = runs[0].config
        report["wandb"] = log_to_wandb(out, images, report, str(cfg0.get("logger.project") or "rlpost"),
                                       cfg0.get("logger.entity"), str(cfg0.get("logger.mode") or "auto"))
    report["files"] = files
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def register_cli(app: Any) -> None:
    """Add the ``report`` command to the Typer ``app`` of :mod:`rlpost.cli`."""
    import typer

    if any(getattr(c, "name", None) == "report" for c in app.registered_commands):
        return

    @app.command("report")
    def report_cmd(
        runs: List[str] = typer.Argument(..., help="Run directories, folders of runs or sweep folders (multirun/<time>)."),
        out: Optional[Path] = typer.Option(None, "--out", help="Output folder (default: <the one folder>/report)."),
        band: str = typer.Option("ci95", "--band", help="Band across seeds: ci95 (Student t 95% CI) or sd."),
        wandb: str = typer.Option("auto", "--wandb", help="auto (when the runs used logger=wandb), on or off."),
        n_boot: int = typer.Option(2000, "--n-boot", help="Bootstrap replicates of the paired comparison."),
    ) -> None:
        """Curves across seeds (PNG), a paired comparison and one self-contained HTML page.

        Reward, held-out accuracy, response length, entropy, clip fraction and KL
        against step and wall time; runs that differ only in seed form a method
        (mean and 95% CI band); every method is compared with the first.

        Examples:

          rlpost train -m algo=grpo,dr_grpo 'seed=range(3)' && rlpost report multirun/<time>

          rlpost report outputs/grpo-arithmetic outputs/dr_grpo-arithmetic --out report/
        """

        try:
            rep = make_report(runs, out, band=band, wandb=wandb, n_boot=n_boot)
        except RlpostError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(code=e.exit_code)
        for why in rep.get("skipped", []):
            typer.echo(f"skipped: {why}")
        typer.echo(f"{plural(len(rep['runs']), 'run')}, {plural(len(rep['groups']), 'method')}: "
                   f"{', '.join(rep['groups'])}")
        for c in rep["comparisons"]:
            if "error" in c:
                typer.echo(f"  {c['b']} vs {c['a']}: not compared: {c['error']}")
            else:
                st = c["overall"]
                typer.echo(f"  {c['b']} vs {c['a']}: accuracy diff {st['diff']:+.3f} "
                           f"[95% CI {st['ci_low']:+.3f}, {st['ci_high']:+.3f}] -> {c['verdict']}")
        if rep.get("wandb"):
            w = rep["wandb"]
            typer.echo(f"W&B ({w['mode']}): {w['url'] or w['dir']}")
        typer.echo(f"wrote {rep['files'][-2].rsplit('/', 1)[0]}/: report.html, curves_step.png, "
                   f"curves_wall_time.png, series.json, report.json")
