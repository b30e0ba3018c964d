"""reasoning-gym partial credit and the binarize switch that removes it."""

from __future__ import annotations

import pytest


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


def test_reference_solution_of_the_default_task_is_the_requested_calculation(compose):
    # SEELE hints are prefixes of this text: it must be the format the system prompt asks
    # for and score 1 as a whole answer
    from rlpost.tasks import build_task

    task = build_task(compose(["task.train_size=16", "task.eval_size=8"]).task)
    ex = task.train_examples()[0]
    sol = task.reference_solution(ex)
    assert sol == f"{ex.meta['entry']['metadata']['expression']} = {ex.answer}"
    assert " + " in sol and task.score(sol, ex) == 1.0


def test_composite_task_labels_domains_for_domain_mixture(compose):
    from rlpost.core.errors import ConfigError
    from rlpost.selectors import SELECTORS
    from rlpost.tasks import build_task

    task = build_task(compose(["task=arithmetic_mix", "task.train_size=60", "task.eval_size=10"]).task)
    ex = task.train_examples()
    domains = {e.meta["domain"] for e in ex}
    assert domains == {"basic_arithmetic", "chain_sum"}
    for e in ex[:10]:  # each item is scored by its own dataset's scorer
        assert task.score(task.reference_solution(e), e) == 1.0
        assert task.score("1 + 1 = 99999", e) == 0.0
    sel = SELECTORS.get("domain_mixture")(len(ex), 8, seed=0)
    sel.attach(examples=ex)
    assert sel.quotas() == {"basic_arithmetic": 4, "chain_sum": 4}
    assert set(sel.eff) == {"basic_arithmetic", "chain_sum"}  # no placeholder domain left from before attach
    picked = sel.select(0)
    assert sorted(ex[i].meta["domain"] for i in picked) == ["basic_arithmetic"] * 4 + ["chain_sum"] * 4
    with pytest.raises(ConfigError, match="task.params.datasets"):
        build_task(compose(["task=arithmetic_mix", "task.params.datasets=[]"]).task)


def test_composite_errors_name_the_datasets(compose):
    from rlpost.core.errors import ConfigError
    from rlpost.tasks import build_task

    with pytest.raises(ConfigError, match="task.params.datasets of the composite task.*chain_sum \\(weight 0.0"):
        build_task(compose(["task=arithmetic_mix", "task.params.datasets=[{name:chain_sum,weight:0}]"]).task)
