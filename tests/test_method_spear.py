"""SPEAR (arXiv:2509.22601): the tool-call bonus and replay-weight schedules, the estimator, the
recalibrated replay advantages and the buffer's rules by hand, the replay loss's scale, and the preset
on the tiny model: a replay update happens, and the buffer survives checkpoint / resume."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput
from rlpost.algos.losses import PolicyLossInput
from rlpost.algos.spear import (REPLAY_KEY, TOOL_BONUS_KEY, replay_advantages, replay_scale, spear_advantage,
                                spear_clip_cov_loss, tool_call_bonus)
from rlpost.core.batch import RolloutBatch
from rlpost.methods.spear import RETURN_KEY, ReplayBuffer, _median, _power_of_two_at_most

SP = dict(norm_by_std=False, eps=1e-6, tool_bonus_per_call=0.1, tool_bonus_cap=1.0, tool_bonus_steps=200,
          buffer_size=2048, tolerate_steps=5, baseline_buffer_size=10240, replay_coef=1.0, replay_ramp_steps=100)


def test_tool_call_bonus_by_hand():
    calls = torch.tensor([0.0, 3.0, 15.0])
    # step 50 of 200: (cos(pi / 4) + 1) / 2 = 0.853553...
    d = (math.cos(math.pi / 4) + 1) / 2
    assert tool_call_bonus(calls, 50, per_call=0.1, cap=1.0, steps=200).tolist() == pytest.approx([0.0, 0.3 * d, d])
    assert tool_call_bonus(calls, 100, per_call=0.1, cap=1.0, steps=200).tolist() == pytest.approx([0.0, 0.15, 0.5])
    assert tool_call_bonus(calls, 201, per_call=0.1, cap=1.0, steps=200).tolist() == [0.0, 0.0, 0.0]


def test_replay_scale_by_hand():
    assert replay_scale(25, coef=1.0, steps=100) == pytest.approx((1 - math.cos(math.pi / 4)) / 2)  # 0.146447
    assert replay_scale(50, coef=2.0, steps=100) == pytest.approx(1.0)
    assert replay_scale(150, coef=2.0, steps=100) == 2.0
    assert replay_scale(3, coef=0.5, steps=0) == 0.5


def test_advantage_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    inp = AdvantageInput(rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]), response_mask=mask,
                         group_index=torch.tensor([0, 0, 1, 1]),
                         extras={TOOL_BONUS_KEY: torch.tensor([0.2, 0.4, 0.0, 0.0])})
    a = spear_advantage(inp, **SP).advantages
    # group 0: 1.2, 0.4 -> mean 0.8 -> +0.4, -0.4; group 1: all equal -> 0
    assert a[0].tolist() == pytest.approx([0.4, 0.4, 0.0])
    assert a[1].tolist() == pytest.approx([-0.4, 0.0, 0.0])
    assert a[2:].abs().sum() == 0
    b = spear_advantage(inp, **{**SP, "norm_by_std": True}).advantages
    # unbiased std of (1.2, 0.4) = 0.565685
    assert float(b[0, 0]) == pytest.approx(0.4 / (0.8 / math.sqrt(2) + 1e-6), rel=1e-5)


def test_replay_advantages_and_helpers():
    r = torch.tensor([1.0, 0.5, 2.0])
    assert replay_advantages(r, 0.75, 0.5, False).tolist() == pytest.approx([0.25, -0.25, 1.25])
    assert replay_advantages(r, 0.75, 0.5, True).tolist() == pytest.approx([0.5, -0.5, 2.5], rel=1e-5)
    assert _median([3.0, 1.0, 2.0, 10.0]) == 2.5
    assert [_power_of_two_at_most(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [0, 0, 2, 2, 4, 8, 8]


def _rows(adv, rewards, group, step_lp=-1.0):
    B = len(adv)
    mask = torch.ones(B, 2)
    b = RolloutBatch(prompt_ids=torch.ones(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                     response_ids=torch.ones(B, 2, dtype=torch.long), response_mask=mask,
                     rollout_logprobs=torch.full((B, 2), step_lp), group_index=torch.tensor(group),
                     prompt_index=torch.tensor(group), rewards=torch.tensor(rewards))
    b.extras["advantages"] = torch.tensor(adv)[:, None] * mask
    b.extras["old_logprobs"] = torch.full((B, 2), step_lp)
    return b


def test_buffer_rules_by_hand():
    buf = ReplayBuffer(buffer_size=2, tolerate_steps=1, baseline_buffer_size=100, norm_by_std=False)
    # step 1: groups (1, 0) and (1, 1): means 0.5, 1; positive advantage only row 0
    b1 = _rows([0.5, -0.5, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1])
    assert buf.add(b1, b1.rewards, 1) == 1
    assert buf.baseline() == (0.75, 0.25)  # median of the means 0.5, 1; of the stds 0.5, 0
    # step 2: a group (2, 0): mean 1; row 0 stored
    b2 = _rows([1.0, -1.0], [2.0, 0.0], [5, 5], step_lp=-2.0)
    assert buf.add(b2, b2.rewards, 2) == 1
    assert buf.baseline()[0] == 1.0  # median of 0.5, 1, 1
    assert buf.ready_rows() == 1 and not buf.is_ready()  # only the return 2 exceeds 1; 1.5 x 2 = 3 needed
    # step 4: the rows of step 1 are 1 step older than the newest stored (2): kept at tolerate 1
    b4 = _rows([1.0, 1.0, -2.0], [3.0, 3.0, 0.0], [7, 7, 7])
    assert buf.add(b4, b4.rewards, 4) == 2
    assert [s for s, _ in buf.entries] == [1, 2, 4]
    assert buf.ready_rows() == 3  # returns 2, 3, 3 exceed median(0.5, 1, 1, 2) = 1; the 1 does not
    assert not buf.is_ready()
    buf.buffer_size = 1  # 3 > 1.5
    assert buf.is_ready()
    out = buf.take(torch.Generator().manual_seed(0))
    # recalibrated 1 - 1, 2 - 1, 3 - 1, 3 - 1 all >= 0 -> 4 rows -> power of 2: 4 -> capped at buffer_size 1
    assert len(out) == 1 and buf.entries == []
    assert float(out.extras["advantages"][0, 0]) in (0.0, 1.0, 2.0)
    assert "old_logprobs" in out.extras and RETURN_KEY in out.extras


def test_buffer_drops_old_steps():
    buf = ReplayBuffer(buffer_size=2, tolerate_steps=1, baseline_buffer_size=3, norm_by_std=False)
    for step in (1, 2, 4, 6):
        b = _rows([1.0, -1.0], [1.0, 0.0], [step, step])
        buf.add(b, b.rewards, step)
    # at step 6 the newest stored step is 4: steps 1 and 2 are more than 1 older
    assert [s for s, _ in buf.entries] == [4, 6]
    # baseline history, one mean per step: before a step joins, the oldest go while more than 3 values are kept
    assert [s for s, _ in buf.means] == [1, 2, 4, 6]
    b = _rows([1.0, -1.0], [1.0, 0.0], [7, 7])
    buf.add(b, b.rewards, 7)
    assert [s for s, _ in buf.means] == [2, 4, 6, 7]
    assert ReplayBuffer(1, 99, 1, False).tolerate == 10  # capped at 10 as the authors'


def test_buffer_state_round_trip():
    buf = ReplayBuffer(4, 5, 100, False)
    b = _rows([1.0, -1.0], [1.0, 0.0], [0, 0])
    buf.add(b, b.rewards, 3)
    sd = buf.state_dict()
    other = ReplayBuffer(4, 5, 100, False)
    other.load_state_dict(sd)
    assert other.means == buf.means and other.stds == buf.stds
    assert [s for s, _ in other.entries] == [3]
    assert torch.equal(other.entries[0][1].extras["old_logprobs"], buf.entries[0][1].extras["old_logprobs"])


def test_replay_loss_scale_and_settings():
    torch.manual_seed(0)
    lp = torch.randn(2, 4) * 0.1 - 1.0
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4])
    m = torch.ones(2, 4)
    kw = dict(clip_cov_ratio=2e-4, cov_lb=1.0, cov_ub=5.0, replay_clip_cov_ratio=0.02, replay_cov_lb=2.0,
              replay_cov_ub=60.0, eps_low=0.2, eps_high=0.28)
    inp = PolicyLossInput(logprobs=lp, old_logprobs=lp + 0.05, advantages=adv, response_mask=m)
    on, met = spear_clip_cov_loss(inp, **kw)
    # no token has covariance in (1, 5): plain PPO on every token; r = exp(-0.05) = 0.951 inside the clip
    r = math.exp(-0.05)
    assert on[0].tolist() == pytest.approx([-r] * 4, rel=1e-5) and on[1].tolist() == pytest.approx([r] * 4, rel=1e-5)
    assert float(met["replay_rows"]) == 0.0
    inp.extras = {REPLAY_KEY: torch.tensor([0.5, 0.5])}
    rep, met = spear_clip_cov_loss(inp, **kw)
    assert torch.allclose(rep, 0.5 * on) and float(met["replay_rows"]) == 1.0


def _metrics(d):
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]


SMALL = ("task.reward.format_weight=1.0", "task.reward.format_regex='^\\s'", "algo.adv_params.buffer_size=1",
         "algo.adv_params.replay_ramp_steps=0", "algo.n_samples_per_prompt=4",
         "task.train_size=8", "seed=3", "trainer.lr=1e-4", "eval.at_end=false")


def test_replay_update_runs_tiny(compose, tmp_path):
    """With a buffer of 1 row a replay update runs within a few steps (one more optimizer step); a
    format reward for responses that start with a space gives the tiny model's rewards a spread."""
    from tests.conftest import tiny_overrides
    from rlpost.run.runner import train

    train(compose(tiny_overrides("algo=spear", "steps=4", "checkpoint.every=0", *SMALL)), tmp_path / "s")
    rows = _metrics(tmp_path / "s")
    assert sum(r["spear/buffer_added"] for r in rows) > 0
    assert any(r["spear/replay_rows"] == 1.0 for r in rows)


def test_buffer_survives_resume(compose, tmp_path, monkeypatch):
    """Stop after the step-2 checkpoint, resume=auto: the buffer comes back and the metrics are those of the
    uninterrupted run (as tests/test_runner.py test_algo_state_survives_resume)."""
    from tests.test_runner import _Stopped, _assert_same_metrics, _stop_after_checkpoint, _train

    over = ("algo=spear", "steps=4", "checkpoint.every=2", *SMALL)
    straight = _train(compose, tmp_path, *over, name="straight")
    _stop_after_checkpoint(monkeypatch, 2)
    with pytest.raises(_Stopped):
        _train(compose, tmp_path, *over, name="stopped")
    monkeypatch.undo()
    st = torch.load(tmp_path / "stopped" / "checkpoints" / "step_000002" / "state.pt", weights_only=False)
    buf = st["algo_state"]["spear"]["buffer"]
    assert [s for s, _ in buf["means"]] == [1, 2]
    _train(compose, tmp_path, *over, "resume=auto", name="stopped")
    _assert_same_metrics(straight, tmp_path / "stopped", 4)
    assert any(r["spear/replay_rows"] > 0 for r in _metrics(straight)[2:])  # steps 3-4 replayed restored rows


def test_one_step_on_episodes_tiny(compose, tmp_path):
    """The preset trains on env=calculator episodes (tool-call bonus from the episodes' calls)."""
    from tests.conftest import tiny_overrides
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("algo=spear", "env=calculator", "task=multiply", "steps=1", "eval.at_end=false",
                                 "eval.every=0", "sampler.params.max_total_tokens=40", "checkpoint.every=0"))
    train(cfg, tmp_path / "sp")
    rows = _metrics(tmp_path / "sp")
    assert rows[-1]["step"] == 1 and rows[-1]["spear/tool_bonus_mean"] >= 0.0
