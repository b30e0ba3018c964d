"""``launcher=ray`` on the console: a successful run prints no worker crash dump and no Ray start-up chatter."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, tiny_overrides

pytest.importorskip("ray")


def test_ray_logger_chatter_is_kept_off_the_console_but_not_errors():
    from rlpost.core.tracking import ConsoleFilter

    f = ConsoleFilter()

    def rec(name, level):
        return logging.LogRecord(name, level, __file__, 1, "m", None, None)

    assert not f.filter(rec("ray", logging.INFO)) and not f.filter(rec("ray._private.worker", logging.WARNING))
    assert f.filter(rec("ray.util", logging.ERROR))  # a real failure still shows
    assert f.filter(rec("rlpost", logging.INFO)) and f.filter(rec("raylike", logging.INFO))
    assert not f.filter(rec("rlpost.step", logging.INFO))


def test_a_successful_ray_run_prints_no_crash_and_its_workers_exit_by_themselves(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "rlpost.cli", "train", *tiny_overrides("steps=2", "launcher=ray"),
                        f"hydra.run.dir={run}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    console = p.stdout + p.stderr
    for bad in ("SIGABRT", "Fatal Python error", "Mutex corrupt", "Token authentication",
                "Started a local Ray instance", "(RolloutWorker pid="):
        assert bad not in console, (bad, console[-3000:])
    assert not re.search(r"\x1b\[[0-9;]*m", console)  # colour codes of streamed worker lines (tqdm moves the cursor only)
    assert "done: grpo-arithmetic, 2 steps" in p.stdout
    log = (run / "cli.log").read_text()
    assert "Started a local Ray instance" in log  # Ray's start-up notices are in the run's log instead
    logs = Path(re.search(r"Ray session logs \(the rollout workers' output\): (\S+)", log).group(1))
    # the cause of the crash dump: ray.kill + ray.shutdown at once quick-exited each worker from an I/O
    # thread while Ray stopped the node; now each actor exits by itself, with status 0, before the shutdown
    exits = [f.read_text() for f in logs.glob("python-core-worker-*.log")]
    assert sum("exit_actor() is called" in t for t in exits) == 2, [t[-800:] for t in exits]  # both workers
    assert not any("killed by `ray.kill`" in t for t in exits)
