"""task=frozenlake: random boards for env=frozenlake, each reaching the environment; two tiny training steps."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("gymnasium")

from tests.conftest import tiny_overrides  # noqa: E402


def test_boards_are_distinct_held_out_and_reach_the_environment(compose):
    from rlpost.envs import make_env
    from rlpost.tasks import build_task
    from rlpost.tasks.base import Example

    cfg = compose(["env=frozenlake", "task.train_size=20", "task.eval_size=10"])
    assert cfg.task.name == "frozenlake"  # env=frozenlake brings its task
    task = build_task(cfg.task)
    tr = {tuple(e.meta["board"]) for e in task.train_examples()}
    ev = {tuple(e.meta["board"]) for e in task.eval_examples()}
    assert len(tr) == 20 and len(ev) == 10 and not (tr & ev)
    env = make_env(cfg.sampler.params.env, dict(cfg.sampler.params.env_params))
    board = ["SFFF", "HHHF", "FFFF", "FFFG"]  # the only path: right x3, then down x3
    obs = env.reset(Example(0, "", "G", {"env_kwargs": {"desc": board}}))
    assert obs.splitlines()[1] == "HHHF"
    steps = [env.step(f"<action>{a}</action>") for a in (2, 2, 2, 1, 1, 1)]
    assert [s.done for s in steps] == [False] * 5 + [True] and steps[-1].reward == 1.0
    obs = env.reset(Example(0, "", "G", {"env_kwargs": {"desc": board}}))
    hole = env.step("<action>1</action>")  # down from S falls into H
    assert hole.done and hole.reward == 0.0
    assert task.score("<action>1</action>", task.eval_examples()[0]) == 0.0  # the game's reward is the signal
    assert task.extract_answer("go <action>2</action> then <action>1</action>") == "1"


def test_train_env_frozenlake_runs_two_steps(compose, tmp_path):
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("env=frozenlake", "steps=2", "eval.limit=2", "eval.at_start=false", "checkpoint.every=0",
                                 "rollout.max_new_tokens=8", "sampler.params.max_turns=3", "sampler.params.max_total_tokens=200"))
    assert cfg.task.name == "frozenlake"
    train(cfg, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "episode/turns_mean" in r]
    assert len(steps) == 2 and all("reward/mean" in r for r in steps)
    assert any("eval/accuracy" in r for r in rows)
