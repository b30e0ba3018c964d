"""T-PPO's Extended GAE and window rollouts (arXiv:2506.15050), and its preset two steps on the tiny model.
Moved unchanged from tests/test_algos_tppo_poise.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages

from rlpost.core.partial import PartialRolloutProducer
from rlpost.rollout.base import SamplingParams
from test_partial import EOS, ScriptEngine


# ----------------------------------------------------------------------------------------- T-PPO
def _egae_input(**kw):
    # row 0 finished (reward 1), three tokens; row 1 cut by the window after two tokens (its
    # scored reward 1 is not an outcome yet and must be ignored)
    base = dict(rewards=torch.tensor([1.0, 1.0]), response_mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
                group_index=torch.tensor([0, 1]), values=torch.tensor([[0.2, 0.4, 0.6], [0.5, 0.3, 0.0]]),
                truncated=torch.tensor([False, True]))
    base.update(kw)
    return AdvantageInput(**base)


def test_egae_hand_values_finished_and_truncated_rows():
    """gamma 1, lam 0.5, no whitening. Finished row: delta = (0.2, 0.2, 1 - 0.6 = 0.4), A_2 = 0.4,
    A_1 = 0.2 + 0.5 * 0.4 = 0.4, A_0 = 0.2 + 0.5 * 0.4 = 0.4, returns A + V = (0.6, 0.8, 1.0).
    Cut row: V(s_2) := V(s_1) = 0.3, no reward: delta_1 = 0.3 - 0.3 = 0, delta_0 = 0.3 - 0.5 = -0.2,
    A = (-0.2, 0). The critic regresses only on the finished row."""
    out = compute_advantages("egae", _egae_input(), gamma=1.0, lam=0.5, whiten=False)
    assert out.advantages.flatten().tolist() == pytest.approx([0.4, 0.4, 0.4, -0.2, 0.0, 0.0], abs=1e-6)
    assert out.returns[0].tolist() == pytest.approx([0.6, 0.8, 1.0], abs=1e-6)
    assert out.value_mask.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert out.loss_mask is None


def test_egae_truncated_row_uses_the_value_at_the_cut():
    """lam = 1, gamma = 1: a cut row's A_t = V(s_cut) - V(s_t) (a Monte-Carlo return bootstrapped at the
    cut); moving only V at the last generated token moves A_0 by exactly as much, and the row's scored
    reward does not enter. With gamma = 0.9 the last delta is (0.9 - 1) V_cut = -0.03."""
    kw = dict(gamma=1.0, lam=1.0, whiten=False)
    a = compute_advantages("egae", _egae_input(), **kw).advantages
    assert a[1, :2].tolist() == pytest.approx([0.3 - 0.5, 0.0], abs=1e-6)
    v2 = torch.tensor([[0.2, 0.4, 0.6], [0.5, 0.7, 0.0]])
    b = compute_advantages("egae", _egae_input(values=v2), **kw).advantages
    assert float(b[1, 0] - a[1, 0]) == pytest.approx(0.4, abs=1e-6)
    c = compute_advantages("egae", _egae_input(rewards=torch.tensor([1.0, -5.0])), **kw).advantages
    assert torch.equal(c, a)
    g = compute_advantages("egae", _egae_input(), gamma=0.9, lam=1.0, whiten=False).advantages
    assert float(g[1, 1]) == pytest.approx(0.9 * 0.3 - 0.3, abs=1e-6)
    assert float(g[1, 0]) == pytest.approx(0.9 * 0.3 - 0.5 + 0.9 * (0.9 * 0.3 - 0.3), abs=1e-6)


def test_egae_without_cut_rows_is_gae_and_the_window_masks_only_the_policy():
    inp = _egae_input(truncated=torch.tensor([False, False]))
    e = compute_advantages("egae", inp, gamma=1.0, lam=0.95, whiten=True)
    g = compute_advantages("gae", inp, gamma=1.0, lam=0.95, whiten=True)
    assert torch.allclose(e.advantages, g.advantages, atol=1e-6) and torch.allclose(e.returns, g.returns, atol=1e-6)
    wm = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w = compute_advantages("egae", _egae_input(window_mask=wm), gamma=1.0, lam=0.5, whiten=True)
    assert w.loss_mask.tolist() == wm.tolist()
    sel = w.advantages[wm > 0].double()  # whitened over the policy's (window) tokens only
    assert float(sel.mean()) == pytest.approx(0.0, abs=1e-6)
    assert w.value_mask[0].tolist() == [1.0, 1.0, 1.0]  # the critic keeps the finished row's first window
    with pytest.raises(ValueError, match="critic values"):
        compute_advantages("egae", _egae_input(values=None), gamma=1.0, lam=0.5, whiten=False)


def test_window_producer_trains_each_token_once_and_continues_cut_responses():
    """Window 3, max 8 tokens, groups of 1, 2 in flight. Prompt L answers with L - 1 tokens then EOS.
    Step 1: L=5 and L=9 are cut after 3 tokens (both trained, both stay). Step 2: L=5 finishes
    (tokens 3..4 are its window), L=9 is cut again at 6 (window 3..5). Step 3: L=9 reaches 8 tokens
    (done, window 6..7) and a new prompt takes L=5's place."""
    eng = ScriptEngine()
    queue = [[5, 9], [4], [3]]

    def select():
        return queue.pop(0)

    prod = PartialRolloutProducer(max_new_tokens=8, group_size=1, chunk_tokens=3, train_unfinished=True)
    s1 = prod.produce(2, select, lambda i: [i, 0], eng, SamplingParams(seed=1), version=0, weights_step=0)
    assert s1.rounds == 1 and s1.prompt_index == [5, 9]
    assert s1.extras["window_truncated"].tolist() == [True, True]
    assert s1.extras["window_mask"].tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    assert len(prod.buffer) == 2  # cut rows stay to be continued
    s2 = prod.produce(2, select, lambda i: [i, 0], eng, SamplingParams(seed=2), version=1, weights_step=1)
    assert s2.prompt_index == [5, 9] and s2.new_groups == 0
    assert s2.batch.response_ids[0, :5].tolist() == [10, 11, 12, 13, EOS]
    assert s2.extras["window_truncated"].tolist() == [False, True]
    assert s2.extras["window_mask"].tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert s2.batch.token_version[1, :6].tolist() == [0, 0, 0, 1, 1, 1]
    s3 = prod.produce(2, select, lambda i: [i, 0], eng, SamplingParams(seed=3), version=2, weights_step=2)
    assert s3.new_groups == 1 and sorted(s3.prompt_index) == [4, 9]
    row9 = s3.prompt_index.index(9)
    assert s3.extras["window_mask"][row9].tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert not bool(s3.extras["window_truncated"][row9])  # max_new_tokens reached: complete (no more tokens)
    trained = (s1.extras["window_mask"][1].sum() + s2.extras["window_mask"][1].sum()
               + s3.extras["window_mask"][row9].sum())
    assert int(trained) == 8  # every token of the L=9 response trained exactly once


def test_window_mode_needs_partial_rollouts(compose):
    from rlpost.core.errors import ConfigError
    from rlpost.run.executor import check_partial

    cfg = compose(["model=tiny", "executor.partial_train_unfinished=true"])
    with pytest.raises(ConfigError, match="partial_rollout=true"):
        check_partial(cfg)
    t = compose(["model=tiny", "algo=t_ppo"])
    assert t.executor.partial_rollout and t.executor.partial_train_unfinished  # algo=t_ppo composes them
    off = compose(["model=tiny", "algo=t_ppo", "executor.partial_train_unfinished=false"])
    assert not off.executor.partial_train_unfinished  # a value the user gives is kept


# ------------------------------------------------------------------------------- 2-step runs
def _run(tmp_path, *overrides):
    from conftest import tiny_overrides
    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(tiny_overrides("steps=2", "eval.at_end=false", "checkpoint.every=0",
                                        "selector.prompts_per_step=2", *overrides))
    train(cfg, tmp_path)
    return [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_t_ppo_preset_runs_two_steps_on_the_tiny_model(tmp_path):
    rows = [r for r in _run(tmp_path, "algo=t_ppo", "executor.partial_chunk_tokens=5") if "reward/mean" in r]
    assert len(rows) == 2
    assert rows[0]["partial/window_truncated_frac"] > 0  # 12-token responses are cut by the 5-token window
    assert rows[1]["partial/carried_in_groups"] > 0  # and continued in step 2
    for r in rows:
        assert r["partial/window_tokens"] <= 5 * 8  # 2 prompts x 4 rollouts, at most one window each
        for k in ("actor/pg_loss", "critic/value_loss", "actor/grad_norm"):
            if k in r:
                assert math.isfinite(r[k]), k
