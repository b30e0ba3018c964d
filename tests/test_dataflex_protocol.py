"""DataFlex-RL's evaluation protocol (rlpost.eval.protocol) on hand-made finished runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlpost.core.errors import DataError
from rlpost.eval.protocol import budget_steps, protocol_report, run_spend


def _run(root: Path, name: str, seed: int, correct, rollouts_per_step, start=None, tokens_per_s=10.0):
    d = root / name / f"seed{seed}"
    d.mkdir(parents=True)
    recs = [{"index": i, "question": f"q{i}", "correct": float(c)} for i, c in enumerate(correct)]
    (d / "eval.json").write_text(json.dumps({"task": "arithmetic", "seed": seed, "n": len(correct),
                                             "accuracy": sum(correct) / len(correct), "records": recs}))
    rows = [{"step": i + 1, "reward/mean": 0.5, "rollout/spent": r, "time/rollout_s": 2.0,
             "throughput/rollout_tokens_per_s": tokens_per_s} for i, r in enumerate(rollouts_per_step)]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    if start is not None:
        (d / "eval_start.json").write_text(json.dumps({"task": "arithmetic", "accuracy": start, "records": []}))
    return d


def test_budget_steps():
    assert budget_steps(320, 4, 4) == 20
    assert budget_steps(321, 4, 4) == 21  # a partial step still runs whole
    with pytest.raises(ValueError, match="must all be >= 1"):
        budget_steps(0, 4, 4)


def test_report_by_hand(tmp_path):
    base = [_run(tmp_path, "uniform", 0, [1, 0, 0, 1], [16, 16], start=0.25),
            _run(tmp_path, "uniform", 1, [1, 1, 0, 0], [16, 16], start=0.25)]
    # the method: +1 correct problem under each seed, and a refilling filter's extra rollouts
    meth = [_run(tmp_path, "filter", 0, [1, 1, 0, 1], [24, 16]), _run(tmp_path, "filter", 1, [1, 1, 1, 0], [16, 20])]
    same = [_run(tmp_path, "same", 0, [1, 0, 0, 1], [16, 16]), _run(tmp_path, "same", 1, [1, 1, 0, 0], [16, 16])]
    assert run_spend(base[0]) == {"rollouts": 32.0, "rollout_tokens": 40.0, "rollout_s": 4.0}
    text, rows = protocol_report({"filter": meth, "selector=uniform": base, "same": same}, n_boot=500)
    b, f, s = rows  # the baseline comes first whatever the order given
    assert b["method"] == "selector=uniform" and b["acc"] == 0.5 and b["rollouts"] == 32.0
    assert f["acc"] == 0.75 and f["diff"] == pytest.approx(0.25)
    assert f["ci_low"] <= 0.25 <= f["ci_high"] and f["seeds"] == 2
    assert f["rollouts"] == 38.0 and f["over_budget"]  # 38 > 1.1 x 32
    assert s["diff"] == 0.0 and not s["excludes_zero"] and not s["over_budget"]
    assert "uniform gain over the untrained checkpoint: +25.0 pts (25.0% -> 50.0%, 2 seed(s))" in text
    assert "spent 1.19x the baseline's rollouts" in text


def test_report_needs_the_uniform_arm_and_matched_seeds(tmp_path):
    m = [_run(tmp_path, "m", 0, [1, 0], [4])]
    with pytest.raises(DataError, match="selector=uniform"):
        protocol_report({"m": m})
    u = [_run(tmp_path, "u", 1, [1, 0], [4])]  # seed 1 against seed 0: nothing to pair
    with pytest.raises(DataError, match="share no seed"):
        protocol_report({"selector=uniform": u, "m": m})
    with pytest.raises(DataError, match="no finished run"):
        protocol_report({"selector=uniform": u, "m": []})


def test_report_names_another_baseline(tmp_path):
    # e.g. turn-level methods against turn_grpo: the text names the baseline given, not "uniform"
    base = [_run(tmp_path, "turn_grpo", 0, [1, 0, 0, 1], [16], start=0.5)]
    meth = [_run(tmp_path, "hgpo", 0, [1, 1, 0, 1], [16])]
    text, rows = protocol_report({"turn_grpo": base, "hgpo": meth}, baseline="turn_grpo", n_boot=200)
    assert "diff vs turn_grpo [95% CI]" in text and "uniform" not in text
    assert "turn_grpo gain over the untrained checkpoint: +0.0 pts (50.0% -> 50.0%, 1 seed(s))" in text
    assert rows[1]["diff"] == pytest.approx(0.25)
