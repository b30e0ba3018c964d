"""reasoning-gym partial credit and the binarize switch that removes it."""

from __future__ import annotations


def test_binarize_removes_substring_partial_credit(compose):
    from rlpost.tasks import build_task

    hackable = build_task(compose(["task.reward.binarize=false", "task.train_size=16", "task.eval_size=8"]).task)
    strict = build_task(compose(["task.reward.binarize=true", "task.train_size=16", "task.eval_size=8"]).task)
    ex = next(e for e in strict.eval_examples() if e.answer == "-1" or len(e.answer) == 1)
    wrong = ex.answer + "0"  # contains the gold string, numerically wrong
    assert 0.0 < hackable.score(wrong, ex) < 1.0  # reasoning-gym: len(gold) / len(answer)
    assert hackable.score(wrong, ex) == len(ex.answer) / len(wrong)
    assert strict.score(wrong, ex) == 0.0
    assert strict.score(f"so the result is {ex.answer}", ex) == 1.0
    assert strict.score("no number here", ex) == 0.0
