"""The one-way step pipeline: every rollout scored exactly once, selectors learn the trained rewards,
and a step's prompts are distinct."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_overrides


def _one_step(compose, tmp_path, *extra):
    """One real model=tiny step with the real reward function; returns (metrics, verifier calls, run, collected)."""
    from rlpost.run.runner import Run

    cfg = compose(tiny_overrides("steps=1", "eval.at_end=false", *extra))
    run = Run(cfg, tmp_path / "run")
    log = tmp_path / "verifier_calls.txt"
    score = type(run.task).score

    def counting(self, response, example):  # runs in the forked verifier worker: count through a file
        with open(log, "a") as f:
            f.write("1\n")
        return score(self, response, example)

    run.task.score = counting.__get__(run.task)
    seen = []
    update = run.selector.update
    run.selector.update = lambda idx, rewards: (seen.append((list(idx), [list(r) for r in rewards])), update(idx, rewards))[1]
    try:
        c = run.collect(1, run.trainer.version, 0)
        m = run.learn(c)
    finally:
        run.close()
    n = len(log.read_text().splitlines()) if log.exists() else 0
    return m, n, c, seen


def _samplers():
    import rlpost.samplers  # noqa: F401
    from rlpost.samplers import SAMPLERS

    return SAMPLERS.names()


@pytest.mark.parametrize("sampler", _samplers())
def test_each_rollout_is_scored_exactly_once_for_every_sampler(compose, tmp_path, sampler):
    extra = [f"sampler={sampler}"]
    if sampler == "scope":  # SCOPE needs a PRM: a random tiny one (repairs are scored too, once each)
        from test_reward_models import _tiny_classifier

        extra += [f"sampler.params.prm_model_path={_tiny_classifier(tmp_path, token=True)}",
                  "sampler.params.segment=sentence"]
    if sampler == "s2l":  # S2L-PO needs its explorer model: a frozen tiny one
        extra += ["sampler.params.explorer_model=tiny"]
    m, calls, c, _ = _one_step(compose, tmp_path, *extra)
    # tree's pruned branches and arrol's rows cut at prune_at are never scored
    generated = int(m["rollout/spent"]) - int(m.get("sampler/branches_pruned", 0)) - int(m.get("sampler/pruned_unscored", 0))
    assert calls == generated > 0
    assert m["reward/verifier_calls"] == calls
    assert c.batch.rewards.shape[0] == int(m["rollout/batch_rows"])


@pytest.mark.parametrize("extra", [("executor.partial_rollout=true",), ("executor=async",),
                                   ("executor=async", "executor.partial_rollout=true")])
def test_each_rollout_is_scored_exactly_once_with_partial_rollouts_and_async(compose, tmp_path, extra):
    m, calls, _, _ = _one_step(compose, tmp_path, *extra)
    assert calls == int(m["rollout/batch_rows"]) == 16  # 4 prompts x 4 samples; nothing carried over yet
    assert m["reward/verifier_calls"] == calls


def test_async_executor_scores_each_rollout_once(compose, tmp_path):
    # the async executor's producer thread runs Run.collect: count through a whole two-step run
    from rlpost.run.runner import Run, train

    calls = []
    orig = Run.collect

    def collect(self, *a, **k):
        c = orig(self, *a, **k)
        calls.append((c.reward_metrics["reward/verifier_calls"], c.batch.rewards.shape[0]))
        return c

    Run.collect = collect
    try:
        train(compose(tiny_overrides("executor=async", "executor.max_staleness=1", "steps=2", "eval.at_end=false")),
              tmp_path / "async")
    finally:
        Run.collect = orig
    assert len(calls) >= 2 and all(n == rows == 16 for n, rows in calls)


def test_selector_learns_exactly_the_rewards_training_uses_with_length_shaping(compose, tmp_path):
    # a length penalty makes every reward depend on the response length; the selector's rewards and
    # the batch's must agree bit for bit (they used to differ: re-tokenised text vs generated tokens)
    m, calls, c, seen = _one_step(compose, tmp_path, "task.reward.length_penalty=0.01", "task.reward.format_weight=0.5")
    (idx, observed), = seen
    b = c.batch
    lengths = b.response_mask.sum(-1)
    assert calls == b.rewards.shape[0]
    for g, (i, r) in enumerate(zip(idx, observed)):
        rows = (b.group_index == g).nonzero().flatten()
        assert int(b.prompt_index[rows[0]]) == i
        assert r == b.rewards[rows].tolist()
    # the length term is -0.01 per generated token of each row, and the parts sum to the reward
    assert torch.allclose(b.extras["reward_length"], -0.01 * lengths.float())
    parts = sum(b.extras[f"reward_{k}"] for k in ("correct", "format", "overlong", "length"))
    assert torch.equal(parts, b.rewards)
    assert m["reward/correct_mean"] == pytest.approx(float(b.extras["reward_correct"].mean()))


def test_dapo_preset_gets_the_papers_overlong_window_in_the_reward(compose, tmp_path):
    # DAPO (arXiv:2503.14476): punish the last 4096 of 20480 tokens = 20% of the budget; 12 tokens -> 2
    from rlpost.algos.validate import old_shaping_spelling
    from rlpost.core.errors import ConfigError
    from rlpost.rewards import RewardFunction, overlong_penalty

    cfg = compose(tiny_overrides("algo=dapo"))
    assert cfg.task.reward.overlong_buffer == 0.2 and "overlong_buffer" not in cfg.algo.adv_params  # the reward owns it
    rf = RewardFunction.from_config(None, cfg.task.reward, cfg.rollout.max_new_tokens)
    assert (rf.overlong_buffer, rf.overlong_pen, rf.max_len) == (2, 1.0, 12)
    assert overlong_penalty(torch.tensor([9, 10, 11, 12]), 12, rf.overlong_buffer).tolist() == [0.0, 0.0, -0.5, -1.0]
    # the user's word wins over the preset's: another window, or none
    assert compose(tiny_overrides("algo=dapo", "task.reward.overlong_buffer=4")).task.reward.overlong_buffer == 4
    assert compose(tiny_overrides("algo=dapo", "task.reward.overlong_buffer=0")).task.reward.overlong_buffer == 0
    # on another task (composed before the algo) the preset's window still holds; other presets have none
    assert compose(tiny_overrides("algo=dapo", "task=multiply")).task.reward.overlong_buffer == 0.2
    assert compose(tiny_overrides()).task.reward.overlong_buffer == 0  # the default preset has none
    # the old spelling works too, and a window in both places would count twice
    old = compose(tiny_overrides("+algo.adv_params.overlong_buffer=0.2"))
    rf = RewardFunction.from_config(None, old.task.reward, 12, old_spelling=old_shaping_spelling(old.algo))
    assert rf.overlong_buffer == 2
    both = compose(tiny_overrides("+algo.adv_params.overlong_buffer=0.2", "task.reward.overlong_buffer=4"))
    with pytest.raises(ConfigError, match="count twice"):
        RewardFunction.from_config(None, both.task.reward, 12, old_spelling=old_shaping_spelling(both.algo))


def _distinct_selectors():
    import rlpost.selectors  # noqa: F401
    from rlpost.selectors import SELECTORS

    return SELECTORS.names()


@pytest.mark.parametrize("name", _distinct_selectors())
def test_a_steps_prompts_are_distinct_for_every_selector(name):
    # 10 prompts, 4 per step, 400 steps: uniform repeated a prompt in 32 of them (steps crossing a pass)
    from rlpost.selectors import SELECTORS
    from rlpost.selectors.base import Role
    from rlpost.tasks import Example

    sel = SELECTORS.get(name)(10, 4, seed=0)
    sel.attach(examples=[Example(index=i, question=f"q{i}", answer="1", meta={"domain": "ab"[i % 2]}) for i in range(10)],
               prompt_entropy=lambda idx: [1.0 + 0.1 * i for i in idx])
    rng = np.random.default_rng(0)
    for step in range(400):
        idx = list(sel.select(step))
        if sel.plays(Role.FILTER):
            idx += list(sel.refill(2))
        assert len(idx) == len(set(idx)), (name, step, idx)
        sel.update(idx, [(rng.random(4) < 0.5).astype(float).tolist() for _ in idx])


def test_uniform_still_covers_every_prompt_once_per_pass():
    from rlpost.selectors import SELECTORS

    sel = SELECTORS.get("uniform")(10, 4, seed=0)
    seen = [i for step in range(50) for i in sel.select(step)]  # 200 draws = 20 passes
    counts = np.bincount(seen, minlength=10)
    assert counts.tolist() == [20] * 10
