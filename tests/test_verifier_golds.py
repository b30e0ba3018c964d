"""Answer verification faults found on competition sets, and every gold of every shipped task
verified against itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlpost.tasks import build_task
from rlpost.tasks.verifiers import answer_text, math_verify_answer, normalize_math_answer, verify

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


@pytest.mark.parametrize(
    "pred,gold,want",
    [
        (r"3.2 \times 10^{-5}", "3.2e-5", 1.0),  # was 0: 3.2e-5 read as 3.2*e - 5
        ("0.000032", "3.2e-5", 1.0),
        ("6e3", "3e6", 0.0),  # was 1: mantissa/exponent swap
        ("3000000", "3e6", 1.0),
        ("3, x=5", r"x = $3$ or $x=5$", 1.0),  # several $...$ fragments: all kept, as a set
        ("3", r"x = $3$ or $x=5$", 0.0),
        (r"\frac{1}{2}, \sqrt{2}", [r"\frac{1}{2}", r"\sqrt{2}"], 1.0),  # a list answer field, not its repr
        ("27", 27.0, 1.0),
        ("28", 27.0, 0.0),
    ],
)
def test_math_verify_fault_cases(pred, gold, want):
    assert math_verify_answer(pred, gold) == want


def test_normalisation_is_the_same_on_both_sides():
    assert normalize_math_answer("3.2e-5") == r"3.2\times10^{-5}"
    assert normalize_math_answer("$1$ and $2$") == "1, 2"
    assert answer_text([r"\frac{1}{2}", 3.0]) == r"\frac{1}{2}, 3"
    assert "\\\\" not in answer_text([r"\sqrt{2}"])  # no doubled backslashes of a Python repr


def test_one_time_budget_per_sample():
    """A slow input returns 0 within the verifier's own budget (it used to retry three parses, each with the
    whole 5 s budget, so the reward worker was killed first).

    Timed in a fresh process's main thread, as a reward worker calls it: in a test worker that had run other
    files first, the same call once took 37 s (2026-12-07, full suite), not reproduced alone."""
    code = (
        "import time\n"
        "from rlpost.tasks.verifiers import math_verify_answer\n"
        "assert math_verify_answer('1', '1') == 1.0\n"  # imports math-verify/sympy outside the timed call
        "hostile = '(' * 3000 + '1' + ')' * 3000 + '^' * 500\n"
        "t0 = time.monotonic()\n"
        "score = math_verify_answer(hostile, r'x^{2^{2^{2^{2^{2^{2}}}}}}', timeout=1.0)\n"
        "print(score, time.monotonic() - t0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    score, seconds = map(float, out.stdout.split())
    assert score == 0.0
    assert seconds < 2.0


def _shipped_math_tasks():
    return sorted(p.stem for p in (REPO / "conf" / "task").glob("*.yaml")
                  if "kind: math" in p.read_text() and p.stem != "math")


@pytest.mark.parametrize("name", _shipped_math_tasks())
def test_every_gold_of_every_shipped_task_verifies_against_itself(compose, name):
    """Each gold answer, as a prediction and inside \\boxed{} in a response, scores 1 against itself.

    The file is the task preset's ``task.path`` when it sets one, else the benchmark copy the
    tests use (``../shared/data/<name>/test.jsonl``).
    """
    cfg = compose([f"task={name}"]).task
    path = cfg.path or str(SHARED / name / "test.jsonl")
    if not Path(path).is_file():
        pytest.skip(f"no data file for task={name} at {path}")
    from omegaconf import OmegaConf

    OmegaConf.set_struct(cfg, False)
    cfg.path, cfg.train_path, cfg.eval_size, cfg.train_size = path, None, 0, 0
    task = build_task(cfg)
    examples = task.eval_examples()
    assert len(examples) >= 30
    bad = [ex.answer for ex in examples if verify(task.verifier, answer_text(ex.answer), ex.answer, task.verifier_params) != 1.0]
    assert not bad, f"{len(bad)} of {len(examples)} golds do not verify against themselves: {bad[:5]}"
    bad = [ex.answer for ex in examples if task.score(f"The answer is \\boxed{{{answer_text(ex.answer)}}}.", ex) != 1.0]
    assert not bad, f"{len(bad)} of {len(examples)} boxed golds score 0: {bad[:5]}"


_WRAP = {"tags": "<answer>{}</answer>", "last_number": "So the result is {}", "boxed": "\\boxed{{{}}}",
         "hashes": "#### {}", "auto": "\\boxed{{{}}}"}


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "conf" / "task").glob("*.yaml")
                                        if "kind: reasoning_gym" in p.read_text()))
def test_every_gold_of_every_generated_task_scores_one(compose, name):
    """Reasoning-gym presets: each held-out gold, written in the task's answer format, scores 1."""
    cfg = compose([f"task={name}", "task.eval_size=24", "task.train_size=8"]).task
    task = build_task(cfg)
    examples = task.eval_examples()
    assert len(examples) == 24
    wrap = _WRAP[cfg.answer_format]
    bad = [ex.answer for ex in examples if task.score(wrap.format(answer_text(ex.answer)), ex) != 1.0]
    assert not bad, f"{len(bad)} of {len(examples)} golds score below 1: {bad[:5]}"
