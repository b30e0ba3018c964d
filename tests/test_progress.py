"""What the console and cli.log say while a run works: evaluation bars and lines, one s/step figure."""

from __future__ import annotations

import io
import json
import logging
import re

from conftest import tiny_overrides


def test_progress_bar_and_cli_log_print_the_same_seconds_per_step():
    from rlpost.run.runner import _progress
    from rlpost.core.tracking import step_line

    buf = io.StringIO()
    bar = _progress(total=2, start=0, file=buf)
    m = {"step": 1, "reward/mean": 0.5, "time/step_s": 11.84, "throughput/rollout_tokens_per_s": 100.0}
    bar.update(m)
    bar.close()
    shown = buf.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert re.findall(r"[\d.]+ ?s/step|[\d.]+ ?step/s|[\d.]+ ?s/it", shown) == ["11.8 s/step"], shown
    assert step_line(m, 2).endswith("  11.8 s/step")


def test_evaluations_show_a_bar_and_log_their_result_and_time(compose, tmp_path, caplog, capsys):
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("steps=1", "eval.at_start=true", "eval.batch_size=4"))
    with caplog.at_level(logging.INFO, logger="rlpost.step"):
        train(cfg, tmp_path / "run")
    lines = [r.getMessage() for r in caplog.records if r.name == "rlpost.step" and r.getMessage().startswith("evaluation")]
    start = json.loads((tmp_path / "run" / "eval_start.json").read_text())
    end = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert len(lines) == 2, lines
    for line, when, res in ((lines[0], "at step 0 (base model)", start), (lines[1], "at step 1", end)):
        assert line.startswith(f"evaluation {when}: arithmetic accuracy {res['accuracy']:.3f} 95% CI "
                               f"[{res['ci_low']:.3f}, {res['ci_high']:.3f}] (n=8) in "), line
        assert re.search(r" in \d+ s$", line), line
    err = capsys.readouterr().err
    assert "evaluating the base model (step 0):   0%|" in err  # drawn before the first chunk is generated
    assert re.search(r"evaluating the base model \(step 0\): 100%\|\S+\| 8/8 .*accuracy=0\.\d{3}", err), err
    assert "evaluating at step 1:   0%|" in err
