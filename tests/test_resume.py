"""Resuming with the run's own config: the continue hint, refused resumes that write nothing, FAILED cleared."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO, tiny_overrides

OWN = ["model=tiny", "steps=50", "logger=jsonl", "seed=3"]


def _fake_run(d: Path, overrides=OWN) -> Path:
    """A run directory as Hydra and the runner leave it (config.yaml, .hydra/overrides.yaml, a checkpoint)."""
    from rlpost.config.compose import compose_config

    (d / ".hydra").mkdir(parents=True)
    (d / "config.yaml").write_text(OmegaConf.to_yaml(compose_config(overrides), resolve=True))
    (d / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    (d / "checkpoints" / "step_000002").mkdir(parents=True)
    (d / "checkpoints" / "step_000002" / "state.pt").write_bytes(b"not loaded by a refused resume")
    (d / "cli.log").write_text("[..] step 2/50\n")
    return d


def _tree(d: Path):
    """Every file under ``d`` with its bytes' digest and mtime: equal trees are byte for byte the same."""
    return {str(p.relative_to(d)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*")) if p.is_file()}


def test_continue_command_repeats_the_runs_overrides(tmp_path):
    from rlpost.run.resume import continue_command

    d = _fake_run(tmp_path / "x", OWN + ["resume=auto", "task.path=/data/a b.jsonl"])
    assert continue_command(d) == (f"rlpost train model=tiny steps=50 logger=jsonl seed=3 "
                                   f"'task.path=/data/a b.jsonl' resume=auto hydra.run.dir={d}")


def test_bare_resume_takes_the_saved_overrides_and_says_so(tmp_path):
    from rlpost.run.resume import plan_resume

    d = _fake_run(tmp_path / "x")
    plan = plan_resume(["resume=auto", f"hydra.run.dir={d}"])
    assert plan.overrides == OWN + ["resume=auto", f"hydra.run.dir={d}"]
    assert plan.run_dir == d
    assert plan.note == (f"resume=auto: using the run's own overrides from {d}/.hydra/overrides.yaml: "
                         "model=tiny steps=50 logger=jsonl seed=3")
    # repeating some of them is the same run: only the others are added
    plan = plan_resume(["steps=50", "resume=auto", f"hydra.run.dir={d}"])
    assert plan.overrides == ["model=tiny", "logger=jsonl", "seed=3", "steps=50", "resume=auto", f"hydra.run.dir={d}"]


def test_resume_that_changes_the_config_is_refused_naming_the_keys(tmp_path):
    from rlpost.core.errors import ConfigError
    from rlpost.run.resume import plan_resume

    d = _fake_run(tmp_path / "x")
    with pytest.raises(ConfigError) as e:
        plan_resume(["resume=auto", f"hydra.run.dir={d}", "steps=60", "trainer.lr=0.001"])
    msg = str(e.value)
    assert "trainer.lr (saved 2e-05, requested 0.001)" in msg
    assert "steps (saved" not in msg  # a resume may extend the run (CHANGEABLE)
    assert f"rlpost train model=tiny steps=50 logger=jsonl seed=3 resume=auto hydra.run.dir={d}" in msg
    assert "\n" not in msg


def test_a_resume_may_extend_the_run_and_says_what_it_changes(tmp_path):
    from rlpost.run.resume import plan_resume

    d = _fake_run(tmp_path / "x")
    plan = plan_resume(["resume=auto", f"hydra.run.dir={d}", "steps=80", "eval.limit=50"])
    assert plan.overrides[-2:] == ["steps=80", "eval.limit=50"]
    assert plan.note.splitlines()[1] == ("resume=auto: changed from the run's saved config: "
                                         "steps (saved 50, requested 80); eval.limit (saved 200, requested 50)")


def test_no_checkpoint_means_a_fresh_run_with_the_commands_overrides(tmp_path):
    from rlpost.run.resume import plan_resume

    ov = ["model=tiny", "resume=auto", f"hydra.run.dir={tmp_path / 'new'}"]
    plan = plan_resume(ov)
    assert plan.overrides == ov and plan.run_dir is None and plan.note is None


def _cli(*args: str, cwd: Path = REPO):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "rlpost.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=900)


def test_refused_resume_leaves_the_run_directory_byte_for_byte_unchanged(tmp_path):
    d = _fake_run(tmp_path / "x")
    before = _tree(d)
    p = _cli("train", "model=tiny", "seed=4", "resume=auto", f"hydra.run.dir={d}")
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: resume=auto: this command would change the config")
    assert "seed (saved 3, requested 4)" in lines[0]
    assert _tree(d) == before


def test_interrupt_hint_resumes_the_same_run_and_clears_failed(tmp_path):
    """A real run: its hint, pasted as printed, resumes it; the earlier FAILED file goes once it is done."""
    import shlex

    from rlpost.run.resume import continue_command

    d = tmp_path / "run"
    run = tiny_overrides("steps=2", "checkpoint.every=1", "checkpoint.keep_last=2")
    p = _cli("train", *run, f"hydra.run.dir={d}")
    assert p.returncode == 0, p.stderr[-3000:]
    (d / "DONE").unlink()  # as if it had stopped on an error after step 2
    (d / "FAILED").write_text("RuntimeError: an earlier failure\n")
    config = (d / "config.yaml").read_text()
    hint = shlex.split(continue_command(d))
    assert hint[:2] == ["rlpost", "train"] and hint[2:-2] == run
    p = _cli("train", "resume=auto", f"hydra.run.dir={d}")  # bare: the run's own overrides are added
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"using the run's own overrides from {d}/.hydra/overrides.yaml: {' '.join(run)}" in p.stdout
    assert f"resume=auto: resuming from {d}/checkpoints/step_000002 (step 2 of 2)" in p.stdout
    assert (d / "DONE").exists() and not (d / "FAILED").exists()
    assert (d / "config.yaml").read_text() == config.replace("resume: null", "resume: auto")
    assert list(OmegaConf.load(d / ".hydra" / "overrides.yaml")) == run + ["resume=auto"]
