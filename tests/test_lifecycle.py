"""A run's life: the executed run graph, checkpoints, Ctrl-C and resume, the closing summary, run directories."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, tiny_overrides

VOLATILE = ("time/", "throughput/", "memory/")


def _metrics(run_dir: Path):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stable(rec):
    return {k: v for k, v in rec.items() if not k.startswith(VOLATILE) and not k.endswith("time_s")}


# ------------------------------------------------------------------ the run graph is what runs
@pytest.mark.parametrize("extra", [
    ("algo=grpo",),
    ("algo=ppo", "algo.critic.warmup_steps=1"),  # critic: values + critic_update
    ("algo=reinforce_pp",),  # KL in the reward: old + reference log-probs
    ("algo=remax",),  # a greedy baseline rollout: algo_inputs
])
def test_executed_stages_are_the_printed_graph(compose, tmp_path, monkeypatch, extra):
    from rlpost.run import runner
    from rlpost.run.runner import build_graph, format_graph

    cfg = compose(tiny_overrides(*extra, "steps=2"))
    printed = [line.split()[1] for line in format_graph(cfg).splitlines() if not line.endswith("(skipped)")]
    assert printed == [s.name for s in build_graph(cfg) if s.enabled]
    runs = []
    real_close = runner.Run.close
    monkeypatch.setattr(runner.Run, "close", lambda self: (runs.append(self), real_close(self))[1])
    runner.train(cfg, tmp_path / "run")
    executed = runs[0].executed
    assert sorted(executed) == [1, 2]
    for step in (1, 2):
        names = executed[step]
        assert names == [n for n in printed if n in names], (step, names)  # each step runs in graph order, once each
    assert set(executed[1]) | set(executed[2]) == set(printed)  # every enabled stage ran, and nothing else
    assert "evaluate" not in executed[1] and "evaluate" in executed[2]  # eval.at_end only


def test_graph_skips_what_the_config_does_not_run(compose):
    from rlpost.run.runner import build_graph

    on = {s.name for s in build_graph(compose(tiny_overrides("algo=grpo"))) if s.enabled}
    assert {"values", "critic_update", "ref_logprobs", "old_logprobs", "algo_inputs"}.isdisjoint(on)
    on = {s.name for s in build_graph(compose(tiny_overrides("algo=ppo"))) if s.enabled}
    assert {"values", "critic_update"} <= on
    on = {s.name for s in build_graph(compose(tiny_overrides("algo=reinforce_pp"))) if s.enabled}
    assert {"old_logprobs", "ref_logprobs"} <= on


# ------------------------------------------------------------------ one checkpoint module
class _Counter:
    """A stateful component: the checkpoint protocol is state_dict / load_state_dict."""

    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def test_checkpoint_round_trips_every_component_of_the_map(tmp_path):
    from transformers import AutoTokenizer

    from rlpost.run.checkpoint import GeneratorState, collect_states, load_checkpoint, save_checkpoint
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy

    policy, tok = load_policy(ModelConfig(source="tiny"), torch.float32, seed=0)
    gen = torch.Generator().manual_seed(5)
    torch.rand(4, generator=gen)  # advance it past its seed
    comps = {"trainer": _Counter(7), "selector": _Counter(3), "update_rng": GeneratorState(gen), "partial": None}
    path = save_checkpoint(tmp_path, 4, policy, tok, collect_states(comps), keep_last=2)
    expect_next = torch.randint(0, 2**30, (3,), generator=gen)
    fresh_gen = torch.Generator().manual_seed(0)
    fresh = {"trainer": _Counter(), "selector": _Counter(), "update_rng": GeneratorState(fresh_gen), "partial": None,
             "added_later": _Counter(11)}  # absent from the checkpoint: keeps its fresh state
    policy2, _ = load_policy(ModelConfig(source="tiny"), torch.float32, seed=1)
    assert load_checkpoint(path, policy2, fresh) == 4
    assert fresh["trainer"].n == 7 and fresh["selector"].n == 3 and fresh["added_later"].n == 11
    assert torch.equal(torch.randint(0, 2**30, (3,), generator=fresh_gen), expect_next)
    for (k, a), b in zip(policy.state_dict().items(), policy2.state_dict().values()):
        assert torch.equal(a, b), k
    assert set(torch.load(path / "state.pt", weights_only=False)) == {"selector", "update_rng", "step", "rng"}
    for s in (6, 8):  # keep_last=2 prunes the oldest
        save_checkpoint(tmp_path, s, policy, tok, collect_states(comps), keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000006", "step_000008"]


def test_run_stateful_map_is_what_a_checkpoint_holds(compose, tmp_path):
    from rlpost.run.runner import train

    run_dir = tmp_path / "run"
    train(compose(tiny_overrides("steps=1")), run_dir)
    ck = run_dir / "checkpoints" / "step_000001"
    state = torch.load(ck / "state.pt", weights_only=False)
    assert set(state) == {"selector", "sampler", "algo_state", "update_rng", "step", "rng"}  # partial: not built
    assert state["step"] == 1 and (ck / "trainer.pt").exists() and (ck / "policy" / "config.json").exists()


# ------------------------------------------------------------------ Ctrl-C, resume, summary, cli.log
def _cli(*args: str, cwd: Path = REPO, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "rlpost.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


def _wait_for_step(p: subprocess.Popen, run: Path, step: int, timeout_s: float = 600) -> None:
    """Block until ``run``'s metrics.jsonl records ``step`` (the training process ``p`` must stay alive)."""
    deadline = time.time() + timeout_s
    while not ((run / "metrics.jsonl").exists() and f'"step": {step}' in (run / "metrics.jsonl").read_text()):
        assert p.poll() is None, p.stderr.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.1)


RUN = tiny_overrides("steps=4", "checkpoint.every=100", "eval.at_start=true", "seed=7")


def test_sigint_checkpoints_and_resume_auto_reaches_the_same_result(tmp_path):
    straight = tmp_path / "straight"
    p = _cli("train", *RUN, "logger=wandb", "resume=auto", f"hydra.run.dir={straight}")
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    assert f"resume=auto: no checkpoint in {straight}" in out and "starting fresh from step 0" in out

    # --- the closing summary: every figure matches the files it comes from
    recs = _metrics(straight)
    base = json.loads((straight / "eval_start.json").read_text())
    final = json.loads((straight / "eval.json").read_text())
    steps = [r for r in recs if r["step"] > 0]
    r0 = sum(r["reward/mean"] for r in steps[:2]) / 2
    r1 = sum(r["reward/mean"] for r in steps[2:]) / 2
    l0 = sum(r["response/length_mean"] for r in steps[:2]) / 2
    l1 = sum(r["response/length_mean"] for r in steps[2:]) / 2
    lines = out.splitlines()
    i = lines.index("done: grpo-arithmetic, 4 steps")
    summary = lines[i:]
    assert summary[1] == (f"  held-out accuracy (arithmetic, n=8, 95% CI): base {base['accuracy']:.3f} "
                          f"[{base['ci_low']:.3f}, {base['ci_high']:.3f}] -> final {final['accuracy']:.3f} "
                          f"[{final['ci_low']:.3f}, {final['ci_high']:.3f}]")
    assert summary[2] == f"  reward/mean: {r0:.3f} (steps 1-2) -> {r1:.3f} (steps 3-4)"
    assert summary[3] == f"  response length: {l0:.1f} -> {l1:.1f} tokens"
    assert summary[4].startswith("  wall time ") and "GiB resident" in summary[4]
    assert summary[5] == f"  run directory: {straight}"
    assert summary[6] == f"  eval.json: {straight / 'eval.json'}"
    offline = summary[7].split(": ", 1)[1]
    assert summary[7].startswith("  W&B (offline): ") and Path(offline).is_dir()
    assert summary[8] == f"  upload with: wandb sync {offline}"
    # cli.log holds the run's log: the resume decision, one line per step, the summary
    log = (straight / "cli.log").read_text()
    assert "starting fresh from step 0" in log
    for s in range(1, 5):
        assert f"step {s}/4  reward " in log
    assert "step 1/4" not in out  # per-step lines stay off the console (the progress bar is there)
    for line in summary:
        assert line in log

    # --- SIGINT (to the whole process group, as a terminal's Ctrl-C) after step 1
    run = tmp_path / "interrupted"
    p = _cli("train", *RUN, "logger=jsonl", f"hydra.run.dir={run}", start_new_session=True)
    _wait_for_step(p, run, 1)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "ForkPoolWorker" not in err
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    assert len(ckpts) == 1 and not (run / "DONE").exists() and not (run / "FAILED").exists()
    k = int(ckpts[0].name.split("_")[1])
    assert 1 <= k < 4
    assert (f"interrupted (SIGINT) after step {k} of 4: saved {ckpts[0]} (policy weights, optimizer/trainer state, "
            f"selector, sampler, algo_state, update_rng, RNG states;") in err
    assert f"resume=auto hydra.run.dir={run}" in err

    p = _cli("train", *RUN, "logger=jsonl", "resume=auto", f"hydra.run.dir={run}")
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    assert f"resume=auto: resuming from {ckpts[0]} (step {k} of 4)" in out
    a = [_stable(r) for r in recs]
    b = [_stable(r) for r in _metrics(run)]
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for key in ra:
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)
    assert json.loads((run / "eval.json").read_text())["accuracy"] == final["accuracy"]


def test_format_summary_hand_computed(tmp_path):
    from types import SimpleNamespace

    from rlpost.core.tracking import format_summary

    recs = [{"step": 0, "eval/accuracy": 0.25}] + [
        {"step": s, "reward/mean": r, "response/length_mean": ln}
        for s, r, ln in [(1, 0.1, 30), (2, 0.2, 28), (3, 0.3, 26), (4, 0.5, 20), (5, 0.6, 18), (6, 0.7, 16)]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "eval_start.json").write_text(json.dumps({"accuracy": 0.25, "ci_low": 0.1, "ci_high": 0.4, "n": 20}))
    (tmp_path / "eval.json").write_text(json.dumps({"accuracy": 0.5, "ci_low": 0.3, "ci_high": 0.7, "n": 20}))
    cfg = SimpleNamespace(name="grpo-arithmetic", task=SimpleNamespace(name="arithmetic"))
    text = format_summary(tmp_path, cfg, wall_s=125.4, peak_mb={"rss": 1536.0, "cuda": 512.0},
                          wandb={"mode": "online", "dir": "x", "url": "https://wandb.ai/u/p/runs/abc"})
    assert text.splitlines() == [
        "done: grpo-arithmetic, 6 steps",
        "  held-out accuracy (arithmetic, n=20, 95% CI): base 0.250 [0.100, 0.400] -> final 0.500 [0.300, 0.700]",
        "  reward/mean: 0.200 (steps 1-3) -> 0.600 (steps 4-6)",  # k = min(5, 6 // 2) = 3
        "  response length: 28.0 -> 18.0 tokens",
        "  wall time 2 min 5 s, peak memory 1.50 GiB resident, 0.50 GiB GPU",
        f"  run directory: {tmp_path}",
        f"  eval.json: {tmp_path / 'eval.json'}",
        "  W&B: https://wandb.ai/u/p/runs/abc",
    ]


# ------------------------------------------------------------------ where runs land
def test_eval_lands_in_an_eval_named_directory_and_failed_runs_are_marked(tmp_path):
    p = _cli("eval", "model=tiny", "logger=jsonl", "eval.limit=4", "eval.max_new_tokens=8", "task.eval_size=8",
             cwd=tmp_path)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    runs = list((tmp_path / "outputs" / "eval-arithmetic").iterdir())
    assert len(runs) == 1 and (runs[0] / "eval.json").exists()
    assert not (tmp_path / "outputs" / "grpo-arithmetic").exists()
    res = json.loads((runs[0] / "eval.json").read_text())
    assert (f"evaluation of the base model: arithmetic accuracy {res['accuracy']:.3f} 95% CI [{res['ci_low']:.3f}, "
            f"{res['ci_high']:.3f}] (n=4) in ") in (runs[0] / "cli.log").read_text()
    assert "evaluating arithmetic: 100%" in err  # the console's progress bar

    bad = tmp_path / "bad"
    p = _cli("train", *tiny_overrides("task=jsonl", "task.path=/nonexistent/train.jsonl"), f"hydra.run.dir={bad}")
    out, err = p.communicate(timeout=600)
    assert p.returncode != 0 and "Traceback" not in err
    assert "/nonexistent/train.jsonl" in (bad / "FAILED").read_text()


def test_version_and_recipe_hint():
    from typer.testing import CliRunner

    from rlpost import __version__
    from rlpost.cli import app

    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"rlpost {__version__}"
    r = CliRunner().invoke(app, ["config", "recipe=cpu_arithmetic_grpo"])
    assert r.exit_code == 2 and "+recipe=cpu_arithmetic_grpo" in r.output


def test_compare_takes_one_sweep_folder_and_compares_its_methods(tmp_path):
    import numpy as np

    from rlpost.core.errors import DataError
    from rlpost.eval.compare import compare, split_sweep

    sweep = tmp_path / "multirun" / "2026-01-01_00-00-00"
    a = {1: [1, 0, 0, 1, 0, 0], 2: [0, 0, 1, 0, 0, 1]}
    b = {1: [1, 1, 0, 1, 1, 0], 2: [1, 0, 1, 1, 0, 1]}
    job = 0
    for algo, acc in (("grpo", a), ("dr_grpo", b)):
        for seed in (1, 2):
            d = sweep / f"{job}_algo={algo},seed={seed}"
            (d / ".hydra").mkdir(parents=True)
            (d / ".hydra" / "overrides.yaml").write_text(f"- algo={algo}\n- seed={seed}\n- model=tiny\n")
            recs = [{"index": i, "question": f"q{i}", "correct": float(c)} for i, c in enumerate(acc[seed])]
            (d / "eval.json").write_text(json.dumps({"task": "arithmetic", "seed": seed, "records": recs}))
            job += 1
    groups = split_sweep(sweep)
    assert [(lab, [p.name for p in ps]) for lab, ps in groups] == [
        ("algo=grpo", ["0_algo=grpo,seed=1", "1_algo=grpo,seed=2"]),
        ("algo=dr_grpo", ["2_algo=dr_grpo,seed=1", "3_algo=dr_grpo,seed=2"])]
    text, res = compare([str(sweep)], n_boot=200)
    st = res[0]["tasks"]["arithmetic"]
    assert res[0]["a"] == "algo=grpo" and res[0]["b"] == "algo=dr_grpo" and res[0]["seeds"] == [1, 2]
    assert st["mean_a"] == pytest.approx(np.mean(a[1] + a[2])) and st["mean_b"] == pytest.approx(np.mean(b[1] + b[2]))
    assert st["diff"] == pytest.approx(4 / 12)  # 4 more correct of 12 paired problems
    assert text.startswith("algo=dr_grpo  vs  algo=grpo")
    seeds_only = tmp_path / "seeds"
    for seed in (1, 2):
        d = seeds_only / f"{seed - 1}_seed={seed}"
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- seed={seed}\n")
        (d / "eval.json").write_text(json.dumps({"task": "t", "seed": seed, "records": [{"index": 0, "correct": 1.0}]}))
    with pytest.raises(DataError, match="holds one method") as e:
        compare([str(seeds_only)])
    assert "its 2 runs differ in seed only" in str(e.value) and f"rlpost report {seeds_only}." in str(e.value)
    assert "RUN_A RUN_B" not in str(e.value)  # the suggestion that failed with "share no seed" on such a sweep


def test_list_descriptions_end_at_a_sentence_end():
    """`rlpost list` joins a description's continuation lines: no preset's is cut mid-sentence."""
    from rlpost.cli import _preset_description
    from rlpost.config.compose import conf_dir

    for f in sorted(conf_dir().glob("*/*.yaml")):
        d = _preset_description(f)
        block = []
        for line in f.read_text().splitlines():
            if not line.strip().startswith("#"):
                break
            if not line.startswith("# @package"):
                block.append(line.lstrip("#").strip())
        assert d.endswith((".", "!", "?", ")")) or d == " ".join(block), (f, d)
    async_desc = _preset_description(conf_dir() / "executor" / "async.yaml")
    assert async_desc.startswith("Rollouts from a background worker") and async_desc.endswith(".")


def test_package_sets_passive_openmp_wait_policy_unless_set():
    code = "import os, rlpost; print(os.environ['OMP_WAIT_POLICY'] or 'empty')"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    run = lambda e: subprocess.run([sys.executable, "-c", code], env={**e, "PYTHONPATH": str(REPO)},  # noqa: E731
                                   capture_output=True, text=True, check=True).stdout.strip()
    assert run(env) == "PASSIVE"
    assert run({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"


SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.mark.parametrize("task,n_eval", [("gsm8k", 1319), ("aime24", 30), ("amc23", 40)])
def test_task_presets_read_a_local_file_and_name_the_fix_without_one(compose, task, n_eval, monkeypatch):
    """Benchmark presets: ``task.path=FILE`` reads a local copy; with no file and no hub the error names the fix."""
    from rlpost.core.errors import DataError
    from rlpost.tasks import build_task

    # no hub: HF_HUB_OFFLINE=1 set here would not reach a `datasets` imported earlier in this process (it reads
    # the variable at import), which then retried the network for ~24 s a case
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr("rlpost.tasks.file_task.hub_reachable", lambda *a, **k: False)
    with pytest.raises(DataError, match="task.path"):
        build_task(compose([f"task={task}"]).task).eval_examples()
    f = SHARED_DATA / task / "test.jsonl"
    if not f.exists():
        pytest.skip(f"{f} not present")
    t = build_task(compose([f"task={task}", f"task.path={f}"]).task)
    ev = t.eval_examples()
    assert len(ev) == n_eval and all(e.answer is not None and str(e.answer).strip() for e in ev)


def test_second_sigint_exits_at_once_without_a_new_checkpoint(tmp_path):
    run = tmp_path / "run"
    p = _cli("train", *tiny_overrides("steps=50", "checkpoint.every=100"), f"hydra.run.dir={run}",
             start_new_session=True)
    _wait_for_step(p, run, 1)
    os.killpg(p.pid, signal.SIGINT)
    time.sleep(0.05)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130
    assert "second interrupt: exiting now without a new checkpoint" in err
    assert "Traceback" not in err and "ForkPoolWorker" not in err
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").glob("step_*"))
    assert not (run / "DONE").exists()


def test_sigterm_to_the_process_group_checkpoints_and_exits(tmp_path):
    """A scheduler's SIGTERM reaches every process of the job (``kill -TERM -PGID``, SLURM,
    ``timeout``): the run finishes its step, saves, exits 130 and leaves no process behind.

    With ``multiprocessing.Pool`` as the verifier worker this hung after the checkpoint: the
    idle worker died inside the pool's queue lock and ``Pool.terminate`` waited for it forever.
    """
    run = tmp_path / "term"
    p = _cli("train", *tiny_overrides("steps=50", "checkpoint.every=100", "seed=3"), "logger=jsonl",
             f"hydra.run.dir={run}", start_new_session=True)
    _wait_for_step(p, run, 2)
    os.killpg(p.pid, signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    assert len(ckpts) == 1 and (ckpts[0] / "state.pt").exists()
    k = int(ckpts[0].name.split("_")[1])
    assert f"interrupted (SIGTERM) after step {k} of 50" in err
    # the finished step was scored by a live verifier: its reward row exists and is a number
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["step"] > 0][-1] == k
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):  # nothing of the job's process group is left running
        os.killpg(p.pid, 0)


def test_resumed_offline_wandb_run_names_every_segment_to_upload(tmp_path):
    """A resumed run writes a second offline-run folder with the same id; the summary's upload command used to
    name only the last, so `wandb sync` as printed uploaded the steps after the resume and dropped the rest."""
    from types import SimpleNamespace

    from rlpost.core.tracking import RunLogger, format_summary

    infos = []
    for resume_step, steps in ((None, (1, 2)), (2, (3,))):
        lg = RunLogger(tmp_path, backend="wandb", name="seg", project="rlpost-test", mode="offline",
                       resume_step=resume_step)
        for s in steps:
            lg.log({"step": s, "reward/mean": 0.1 * s, "response/length_mean": 10.0})
        lg.close()
        infos.append(lg.wandb_info)
        time.sleep(1.1)  # offline-run folders are named to the second
    segs = sorted(str(p) for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(segs) == 2 and infos[0]["segments"] == segs[:1] and infos[1]["segments"] == segs
    assert infos[1]["dir"] == segs[1]
    cfg = SimpleNamespace(name="grpo-arithmetic", task=SimpleNamespace(name="arithmetic"))
    lines = format_summary(tmp_path, cfg, wall_s=3.0, peak_mb={"rss": 100.0}, wandb=infos[1]).splitlines()
    assert lines[-2] == f"  W&B (offline): {segs[1]} (and 1 earlier segment: the run was resumed)"
    assert lines[-1] == f"  upload with: wandb sync {segs[0]} {segs[1]}"
    one = format_summary(tmp_path, cfg, wall_s=3.0, peak_mb={"rss": 100.0}, wandb=infos[0]).splitlines()
    assert one[-2:] == [f"  W&B (offline): {segs[0]}", f"  upload with: wandb sync {segs[0]}"]


def test_summary_windows_do_not_overlap_on_an_odd_number_of_steps(tmp_path):
    """3 steps used to print 'reward/mean: ... (steps 1-2) -> ... (steps 2-3)', step 2 in both means."""
    from types import SimpleNamespace

    from rlpost.core.tracking import format_summary

    recs = [{"step": s, "reward/mean": r, "response/length_mean": ln} for s, r, ln in [(1, 0.1, 30), (2, 0.4, 20), (3, 0.7, 10)]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = SimpleNamespace(name="grpo-arithmetic", task=SimpleNamespace(name="arithmetic"))
    lines = format_summary(tmp_path, cfg, wall_s=3.0, peak_mb={"rss": 100.0}).splitlines()
    assert lines[2] == "  reward/mean: 0.100 (step 1) -> 0.700 (step 3)"
    assert lines[3] == "  response length: 30.0 -> 10.0 tokens"
