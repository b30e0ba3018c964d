"""Sweeps on the joblib launcher with their summary file, the submitit config, and rlpost report.

One real 2 x 2 sweep (two methods, two seeds, model=tiny, 2 steps) on the joblib
launcher feeds the summary and report checks; the plotted numbers are read back
from the figure objects and series.json and compared with metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, tiny_overrides

METHODS = ("grpo", "dr_grpo")


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "rlpost.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("sweep") / "multirun"
    p = _cli("train", "-m", *tiny_overrides("steps=2", "eval.at_start=true", "eval.limit=6"),
             f"algo={','.join(METHODS)}", "seed=range(2)", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
             f"hydra.sweep.dir={d}", "hydra.sweep.subdir=${hydra.job.num}")  # the overrides make too long a name
    assert p.returncode == 0, p.stderr[-3000:]
    return d


def _algo(run: Path) -> str:
    return next(o.split("=")[1] for o in (run / ".hydra" / "overrides.yaml").read_text().split() if o.startswith("algo="))


def _metrics(run: Path):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_joblib_sweep_writes_one_summary_with_each_jobs_final_metrics(sweep):
    jobs = sorted(p for p in sweep.iterdir() if (p / ".hydra").is_dir())
    assert len(jobs) == 4
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["n_jobs"] == 4 and summary["status"] == {"done": 4, "failed": 0, "incomplete": 0}
    by_job = {r["job"]: r for r in summary["jobs"]}
    seeds = set()
    for job in jobs:
        row = by_job[job.name]
        recs = _metrics(job)
        last = [r for r in recs if "reward/mean" in r][-1]
        assert row["steps"] == 2 and row["final"]["reward/mean"] == pytest.approx(last["reward/mean"])
        assert row["final"]["actor/entropy"] == pytest.approx(last["actor/entropy"])
        ev = json.loads((job / "eval.json").read_text())
        assert row["eval"]["accuracy"] == pytest.approx(ev["accuracy"]) and row["eval"]["n"] == 6
        wall = sum(r.get("time/step_s", 0) + sum(v for k, v in r.items() if k.endswith("/time_s")) for r in recs)
        assert row["train_wall_s"] == pytest.approx(wall, abs=1e-3)
        seeds.add(next(o for o in row["overrides"] if o.startswith("seed=")))
    assert seeds == {"seed=0", "seed=1"}  # seed=range(2) expanded
    md = (sweep / "summary.md").read_text()
    assert md.count("| done |") == 4 and "algo=dr_grpo seed=1" in md


def test_report_figures_html_and_plotted_numbers_equal_the_metrics(sweep, tmp_path):
    out = tmp_path / "rep"
    p = _cli("report", str(sweep), "--out", str(out), "--wandb", "off", "--n-boot", "200")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "4 runs, 2 methods: algo=grpo, algo=dr_grpo" in p.stdout
    for f in ("curves_step.png", "curves_wall_time.png"):
        assert (out / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "report.html").read_text()
    assert page.count("src='data:image/png;base64,") == 2 and "algo=dr_grpo" in page and "<img alt" in page
    series = json.loads((out / "series.json").read_text())
    runs = {m: sorted(p for p in sweep.iterdir() if (p / ".hydra").is_dir() and _algo(p) == m) for m in METHODS}
    for slug, key in (("reward", "reward/mean"), ("accuracy", "eval/accuracy"), ("length", "response/length_mean"),
                      ("entropy", "actor/entropy"), ("clip_frac", "actor/clip_frac"), ("kl", "actor/approx_kl")):
        assert series[slug]["key"] == key
        for m in METHODS:
            agg = series[slug]["groups"][f"algo={m}"]
            per = [{r["step"]: r[key] for r in _metrics(run) if r.get(key) is not None} for run in runs[m]]
            steps = sorted(per[0])
            assert agg["step"] == steps and agg["n"] == [2] * len(steps)
            for i, s in enumerate(steps):
                vals = [d[s] for d in per]
                assert agg["mean"][i] == pytest.approx(np.mean(vals))
                half = 12.706 * np.std(vals, ddof=1) / math.sqrt(2)  # t(0.975, 1 df)
                assert agg["high"][i] - agg["mean"][i] == pytest.approx(half, abs=1e-9)
    assert series["accuracy"]["groups"]["algo=grpo"]["step"] == [0, 2]  # eval.at_start and at the end
    rep = json.loads((out / "report.json").read_text())
    (cmp,) = rep["comparisons"]
    assert cmp["a"] == "algo=grpo" and cmp["b"] == "algo=dr_grpo" and cmp["seeds"] == [0, 1]
    acc = {m: np.mean([json.loads((r / "eval.json").read_text())["accuracy"] for r in runs[m]]) for m in METHODS}
    assert cmp["overall"]["diff"] == pytest.approx(acc["dr_grpo"] - acc["grpo"])


def test_plotted_lines_are_the_series(sweep):
    """The figure's mean lines hold exactly the aggregated numbers (x = step or mean wall time)."""
    import matplotlib.pyplot as plt

    from rlpost.eval.report import build_series, discover, group_runs, load_run_curves, plot_curves

    series = build_series(group_runs([load_run_curves(p) for p in discover([sweep])]))
    for x_axis in ("step", "wall_time"):
        fig = plot_curves(series, x_axis)
        ax = fig.axes[0]  # reward
        lines = {ln.get_gid(): ln for ln in ax.get_lines()}
        for m in METHODS:
            agg = series["reward"]["groups"][f"algo={m}"]
            ln = lines[f"mean:algo={m}"]
            assert list(ln.get_xdata()) == pytest.approx(agg[x_axis]) and list(ln.get_ydata()) == pytest.approx(agg["mean"])
        assert sum(1 for g in lines if g.startswith("run:")) == 4  # each seed's own curve
        plt.close(fig)


def test_submitit_slurm_launcher_composes():
    from rlpost.config.compose import compose_config

    cfg = compose_config(tiny_overrides("hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu",
                                        "hydra.launcher.timeout_min=30"), return_hydra_config=True)
    lc = cfg.hydra.launcher
    assert lc._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert lc.partition == "gpu" and lc.timeout_min == 30
    assert cfg.hydra.callbacks.sweep_summary._target_ == "rlpost.experiments.sweep.SweepSummary"


def test_misspelt_launcher_names_the_installed_launchers():
    r = _cli("train", "-m", "model=tiny", "hydra/launcher=jobib", "seed=0,1")
    assert r.returncode == 2
    assert "Valid choices for hydra/launcher: basic, joblib, submitit_local, submitit_slurm." in r.stderr


def test_mean_band_and_grouping_by_config_minus_seed(tmp_path):
    from rlpost.core.errors import ConfigError, DataError
    from rlpost.eval.report import discover, group_runs, load_run_curves, mean_band

    m, lo, hi = mean_band([1.0, 2.0, 3.0])
    assert (m, hi - m) == pytest.approx((2.0, 4.303 * 1.0 / math.sqrt(3)))  # sd 1, t(0.975, 2) = 4.303
    assert mean_band([1.0, 3.0], "sd") == pytest.approx((2.0, 2.0 - math.sqrt(2), 2.0 + math.sqrt(2)))
    assert mean_band([5.0]) == (5.0, 5.0, 5.0)
    with pytest.raises(ConfigError, match="band='iqr'"):
        mean_band([1.0], "iqr")
    # three plain run dirs (no overrides files): two share a config apart from seed and logger
    for name, lr, seed, backend in (("a", "1e-5", 0, "jsonl"), ("b", "1e-5", 1, "wandb"), ("c", "3e-5", 0, "jsonl")):
        d = tmp_path / name
        d.mkdir()
        (d / "config.yaml").write_text(f"seed: {seed}\nlogger: {{backend: {backend}}}\ntrainer: {{lr: {lr}}}\n")
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": s * 0.1 + seed,
                                                              "time/step_s": 2.0}) + "\n" for s in (1, 2, 3)))
    groups = group_runs([load_run_curves(p) for p in discover([tmp_path])])
    assert [(lab, [r.path.name for r in rs]) for lab, rs in groups] == [
        ("trainer.lr=1e-05", ["a", "b"]), ("trainer.lr=3e-05", ["c"])]
    sr = groups[0][1][0].series("reward/mean")
    assert sr["wall_time"] == [2.0, 4.0, 6.0] and sr["value"] == pytest.approx([0.1, 0.2, 0.3])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no metrics.jsonl"):
        discover([tmp_path / "empty"])
    with pytest.raises(DataError, match="no such directory"):
        discover([tmp_path / "missing"])


def test_report_logs_figures_to_an_offline_wandb_run(tmp_path):
    from rlpost.eval.report import make_report

    d = tmp_path / "run"
    d.mkdir()
    (d / "config.yaml").write_text("seed: 0\nlogger: {backend: wandb, project: rlpost-test, mode: offline}\n")
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5 * s, "actor/entropy": 1.0,
                                                         "time/step_s": 1.0}) + "\n" for s in (1, 2)))
    rep = make_report([d], tmp_path / "out")
    assert rep["wandb"]["mode"] == "offline"
    media = list(Path(rep["wandb"]["dir"]).rglob("*.png"))
    assert len(media) == 2  # both figures, as wandb.Image files of the offline run
    assert rep["final"][0]["final_reward"]["mean"] == pytest.approx(1.0) and rep["comparisons"] == []


def test_summary_marks_failed_and_incomplete_jobs(tmp_path):
    from rlpost.experiments.sweep import write_summary

    for num, marker in ((0, "DONE"), (1, "FAILED"), (2, None)):
        d = tmp_path / f"{num}_seed={num}"
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- seed={num}\n")
        if marker:
            (d / marker).write_text("DataError: task.path='x' does not exist\ntrace\n" if marker == "FAILED" else "3\n")
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.25 * num, "time/step_s": 1.5}) + "\n")
    (tmp_path / ".submitit").mkdir()  # launcher folders are not jobs
    s = json.loads(write_summary(tmp_path).read_text())
    assert s["status"] == {"done": 1, "failed": 1, "incomplete": 1} and s["n_jobs"] == 3
    assert [r["status"] for r in s["jobs"]] == ["done", "failed", "incomplete"]
    assert s["jobs"][1]["error"] == "DataError: task.path='x' does not exist"
    assert s["jobs"][2]["final"]["reward/mean"] == 0.5 and s["jobs"][2]["train_wall_s"] == 1.5
    assert write_summary(tmp_path / ".submitit") is None


def test_report_leaves_out_a_run_that_failed_before_its_first_step(tmp_path):
    """A folder of runs with one that stopped before step 1 (empty metrics.jsonl, FAILED): the report covers
    the others and names the skipped one; before, the whole report stopped with exit 4."""
    from rlpost.core.errors import DataError
    from rlpost.eval.report import make_report

    good = tmp_path / "runs" / "2026-01-01_10-00-00"
    bad = tmp_path / "runs" / "2026-01-01_11-00-00"
    for d in (good, bad):
        d.mkdir(parents=True)
        (d / "config.yaml").write_text("seed: 0\nlogger: {backend: jsonl}\n")
    (good / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.25 * s, "time/step_s": 1.0})
                                                + "\n" for s in (1, 2)))
    (bad / "metrics.jsonl").write_text("")
    (bad / "FAILED").write_text("DataError: task 'arithmetic' has no evaluation examples\n")
    rep = make_report([tmp_path / "runs"], tmp_path / "out", wandb="off")
    assert rep["runs"] == [str(good)]
    assert rep["skipped"] == [f"{bad / 'metrics.jsonl'} holds no logged step "
                              "(FAILED: DataError: task 'arithmetic' has no evaluation examples)"]
    assert rep["final"][0]["final_reward"]["mean"] == pytest.approx(0.5)
    with pytest.raises(DataError, match="holds no logged step"):  # nothing left to report: still an error
        make_report([bad], tmp_path / "out2", wandb="off")
    p = _cli("report", str(tmp_path / "runs"), "--out", str(tmp_path / "out3"), "--wandb", "off", timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == f"skipped: {rep['skipped'][0]}"


def test_a_resumed_run_is_the_same_method_as_a_fresh_one(tmp_path):
    """``resume=auto`` continues a run; it used to split two seeds of one method into two "methods"."""
    from rlpost.eval.report import discover, group_runs, load_run_curves

    for name, seed, resume, ovs in (("a", 0, "null", "- seed=0\n"), ("b", 1, "auto", "- seed=1\n- resume=auto\n")):
        d = tmp_path / name
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(ovs)
        (d / "config.yaml").write_text(f"seed: {seed}\nresume: {resume}\ntrainer: {{lr: 2.0e-05}}\n")
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5, "time/step_s": 1.0}) + "\n")
    groups = group_runs([load_run_curves(p) for p in discover([tmp_path])])
    assert len(groups) == 1 and [r.path.name for r in groups[0][1]] == ["a", "b"]
    assert "resume" not in groups[0][0]


def test_one_run_with_two_evaluations_is_drawn_as_points_with_integer_step_ticks(tmp_path):
    """Two evaluations (step 0 and the end) are two points, not a line that looks like a measured trend;
    steps are whole numbers on the axis; one run is "1 run", with no "mean over seeds"."""
    import matplotlib.pyplot as plt

    from rlpost.eval.report import FEW_POINTS, make_report, plot_curves, plural

    d = tmp_path / "runs" / "only"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("seed: 0\nlogger: {backend: jsonl}\n")
    recs = [{"step": 0, "eval/accuracy": 0.2}] + [{"step": s, "reward/mean": 0.1 * s, "time/step_s": 1.0}
                                                  for s in range(1, 7)] + [{"step": 6, "eval/accuracy": 0.7}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    rep = make_report([d], tmp_path / "out", wandb="off")
    series = json.loads((tmp_path / "out" / "series.json").read_text())
    fig = plot_curves(series, "step")
    reward_ax, acc_ax = fig.axes[0], fig.axes[1]
    (acc,) = [ln for ln in acc_ax.get_lines() if ln.get_gid().startswith("mean:")]
    assert list(acc.get_xdata()) == [0, 6] and acc.get_linewidth() == 0 and acc.get_marker() == "o"
    (rew,) = [ln for ln in reward_ax.get_lines() if ln.get_gid().startswith("mean:")]
    assert len(rew.get_xdata()) == 6 > FEW_POINTS and rew.get_linewidth() > 0  # enough points: a line
    fig.canvas.draw()
    for ax in (reward_ax, acc_ax):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    title = fig._suptitle.get_text()
    assert "one run per method" in title and "mean over seeds" not in title
    plt.close(fig)
    page = (tmp_path / "out" / "report.html").read_text()
    assert "1 run in 1 method," in page and "mean over seeds" not in page.lower()
    assert rep["runs"] == [str(d)] and plural(1, "run") == "1 run" and plural(2, "run") == "2 runs"
