"""SPEAR (arXiv:2509.22601): the tool-call bonus and replay-weight schedules, the estimator (with the
invalid-action penalty), the recalibrated replay advantages and the buffer's rules by hand, the replay
loss's scale, Dr.BoT's response filters and the std rollout filter by hand, and the preset on the tiny
model: a replay update happens, the filters act, and the buffer survives checkpoint / resume."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput
from rlpost.algos.losses import PolicyLossInput
from rlpost.algos.spear import (INVALID_FRAC_KEY, INVALID_KEY, REPLAY_KEY, TOOL_BONUS_KEY, has_repeated_ngrams,
                                is_incomplete, is_unreadable, replay_advantages, replay_scale, spear_advantage,
                                spear_clip_cov_loss, std_rollout_filter, tool_call_bonus)
from rlpost.core.errors import ConfigError
from rlpost.core.batch import RolloutBatch
from rlpost.methods.spear import RETURN_KEY, ReplayBuffer, _median, _power_of_two_at_most

SP = dict(norm_by_std=False, eps=1e-6, tool_bonus_per_call=0.1, tool_bonus_cap=1.0, tool_bonus_steps=200,
          buffer_size=2048, tolerate_steps=5, baseline_buffer_size=10240, replay_coef=1.0, replay_ramp_steps=100,
          filter_overlong=True, filter_incomplete=True, filter_repetitive=True, filter_unreadable=True,
          repetition_ngram=20, repetition_count=10, rollout_filter_ratio=0.75, invalid_action_penalty=0.1)


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


def test_invalid_action_penalty_by_hand():
    """Single-turn rows: (R + b - 0.1 inv) - group mean, the authors' apply_invalid_action_penalty then GRPO.
    A two-turn row: turn k's score R + b - 0.1 inv_k, the row's baseline value R + b - 0.1 (invalid share)."""
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.float32)
    inv = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.float32)
    inp = AdvantageInput(rewards=torch.tensor([1.0, 1.0, 0.0]), response_mask=mask, group_index=torch.tensor([0, 0, 0]),
                         extras={TOOL_BONUS_KEY: torch.tensor([0.0, 0.0, 0.3]), INVALID_KEY: inv,
                                 INVALID_FRAC_KEY: torch.tensor([1.0, 0.5, 0.0])})
    a = spear_advantage(inp, **SP).advantages
    mean = (0.9 + 0.95 + 0.3) / 3
    assert a[0].tolist() == pytest.approx([0.9 - mean] * 3 + [0.0, 0.0])
    # row 1: turn 0 (invalid) scores 0.9, turn 1 scores 1.0
    assert a[1].tolist() == pytest.approx([0.9 - mean, 0.9 - mean, 0.0, 1.0 - mean, 0.0])
    assert a[2].tolist() == pytest.approx([0.3 - mean, 0.0, 0.0, 0.0, 0.0])
    off = spear_advantage(inp, **{**SP, "invalid_action_penalty": 0.0}).advantages
    assert off[0, 0] == pytest.approx(1.0 - 2.3 / 3)


def test_response_filter_tests_by_hand():
    """The authors' has_repeated_ngrams (n 20, 10 times), unreadable strings, and our incomplete test."""
    pattern = list(range(100, 120))
    assert has_repeated_ngrams(pattern * 10)  # the 20-gram at 0 occurs 10 times
    assert not has_repeated_ngrams(pattern * 9 + [7] * 19)
    assert has_repeated_ngrams([1, 2, 1, 2, 1], n=2, threshold=2) and not has_repeated_ngrams([1, 2, 3], n=2, threshold=2)
    assert is_unreadable("ok \ufffd") and is_unreadable("x\u0120\xef\xbf\xbd") and not is_unreadable("plain text")
    ans = lambda t: "5" if "answer is 5" in t else None  # noqa: E731
    assert is_incomplete("no action here", ans)
    assert not is_incomplete('<tool_call>{"name": "calculator"', ans)  # an (even malformed) call is an action
    assert not is_incomplete("the answer is 5", ans)


def test_std_rollout_filter_by_hand():
    """int(0.75 * 4) = 3 groups by population std (ties: earlier group), then 4 = 2^2 of their 6 rows at random."""
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 3.0, 3.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    keep = std_rollout_filter(scores, g, 0.75, torch.Generator().manual_seed(0))
    assert len(keep) == 4 and set(keep.tolist()) <= {0, 1, 2, 3, 4, 5} and keep.tolist() == sorted(keep.tolist())
    seen = set()
    for s in range(20):
        seen |= set(std_rollout_filter(scores, g, 0.75, torch.Generator().manual_seed(s)).tolist())
    assert seen == {0, 1, 2, 3, 4, 5}  # group 0 (std 0) beats group 3 (std 0) by order; group 3 never kept
    # 0.5: groups 2 (std 1) and 1 (std 0.5): all 4 rows (a power of 2)
    assert std_rollout_filter(scores, g, 0.5, torch.Generator()).tolist() == [2, 3, 4, 5]
    assert std_rollout_filter(scores, g, 1.0, torch.Generator()).tolist() == list(range(8))
    # a tie at std 0 keeps the earlier group, whose single row is kept (the authors' [:-1] would keep none)
    assert std_rollout_filter(torch.tensor([1.0, 3.0, 3.0]), torch.tensor([0, 1, 1]), 0.5,
                              torch.Generator()).tolist() == [0]
    # int(0.2 * 4) = 0: one group is still kept (the authors' code asserts), group 2's 2 rows
    assert std_rollout_filter(scores, g, 0.2, torch.Generator()).tolist() == [4, 5]
    with pytest.raises(ValueError):
        std_rollout_filter(scores, g, 1.5, torch.Generator())


class _Tok:
    """Token i decodes to VOCAB[i]; special tokens (id 9) only with skip_special_tokens=False."""

    VOCAB = {1: "a ", 2: "<tool_call>", 3: "\ufffd", 4: "answer is 5 ", 9: "<|im_end|>"}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.VOCAB[i] for i in ids if not (skip_special_tokens and i == 9))


class _Task:
    def extract_answer(self, text):
        return "5" if "answer is 5" in text else None


def test_prepare_filters_turns_and_flags_invalid_ones_by_hand(compose):
    """Row 0: a valid turn; row 1: one overlong turn without an answer (filtered twice, invalid); row 2: a tool-call
    turn the environment called void (invalid, kept) and an unreadable answer turn (filtered, valid)."""
    from types import SimpleNamespace

    from rlpost.methods.spear import SelfImitation

    m = SelfImitation(compose(["algo=spear", "rollout.max_new_tokens=4", "algo.adv_params.rollout_filter_ratio=1"]))
    ids = torch.tensor([[4, 1, 9, 0, 0, 0], [1, 1, 1, 1, 0, 0], [2, 1, 7, 3, 4, 0]])
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 0]], dtype=torch.float32)
    void = torch.zeros(3, 6)
    void[2, 1] = 1.0  # on the void turn's last model token, as the episode sampler writes it
    b = RolloutBatch(torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.long), ids, mask.clone(),
                     torch.zeros(3, 6), torch.tensor([0, 0, 0]), torch.tensor([0, 0, 0]), rewards=torch.tensor([1.0, 0.0, 1.0]),
                     extras={"turn_void": void})
    out = m.prepare(b, SimpleNamespace(tokenizer=_Tok(), task=_Task(), step=1))
    assert b.response_mask.tolist() == [[1, 1, 1, 0, 0, 0], [0] * 6, [1, 1, 0, 0, 0, 0]]
    assert b.extras[INVALID_KEY].tolist() == [[0] * 6, [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    assert b.extras[INVALID_FRAC_KEY].tolist() == [0.0, 1.0, 0.5]
    assert (out["spear/filtered_overlong"], out["spear/filtered_incomplete"], out["spear/filtered_unreadable"],
            out["spear/filtered_repetitive"]) == (1.0, 1.0, 1.0, 0.0)
    assert out["spear/invalid_turn_frac"] == 0.5
    m2 = SelfImitation(compose(["algo=spear", "rollout.max_new_tokens=4", "algo.adv_params.rollout_filter_ratio=1",
                                "algo.adv_params.filter_overlong=false", "algo.adv_params.filter_incomplete=false",
                                "algo.adv_params.filter_unreadable=false"]))
    b2 = RolloutBatch(b.prompt_ids, b.prompt_mask, ids, mask.clone(), torch.zeros(3, 6), b.group_index, b.prompt_index,
                      rewards=b.rewards, extras={"turn_void": void})
    m2.prepare(b2, SimpleNamespace(tokenizer=_Tok(), task=_Task(), step=1))
    assert torch.equal(b2.response_mask, mask)  # filters off: every loss token stays; the flags do not change
    assert b2.extras[INVALID_FRAC_KEY].tolist() == [0.0, 1.0, 0.5]
    # a batch whose every turn is filtered keeps its loss tokens this step (and says so)
    b3 = RolloutBatch(b.prompt_ids[1:2], b.prompt_mask[1:2], ids[1:2], mask[1:2].clone(), torch.zeros(1, 6),
                      torch.tensor([0]), torch.tensor([0]), rewards=torch.tensor([0.0]))
    out3 = m.prepare(b3, SimpleNamespace(tokenizer=_Tok(), task=_Task(), step=1))
    assert out3["spear/filters_skipped"] == 1.0 and torch.equal(b3.response_mask, mask[1:2])
    assert out["spear/filters_skipped"] == 0.0


def test_rollout_filter_shrinks_the_batch_in_place(compose):
    from rlpost.methods.spear import SelfImitation

    m = SelfImitation(compose(["algo=spear"]))
    B = 8
    b = RolloutBatch(torch.ones(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.long), torch.ones(B, 2, dtype=torch.long),
                     torch.ones(B, 2), torch.zeros(B, 2), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), torch.arange(B),
                     rewards=torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 3.0, 3.0]),
                     extras={TOOL_BONUS_KEY: torch.zeros(B), "x": torch.arange(B)})
    same = b
    out = m.filter_rollouts(b, 1)
    assert same is b and len(b) == 4 and out["spear/rollout_rows_kept_frac"] == 0.5
    assert set(b.prompt_index.tolist()) <= {0, 1, 2, 3, 4, 5} and torch.equal(b.extras["x"], b.prompt_index)


def test_filter_config_errors(compose):
    from rlpost.methods.spear import SelfImitation

    with pytest.raises(ConfigError, match="rollout_filter_ratio"):
        SelfImitation(compose(["algo=spear", "algo.adv_params.rollout_filter_ratio=0"])).validate()
    with pytest.raises(ConfigError, match="repetition_ngram"):
        SelfImitation(compose(["algo=spear", "algo.adv_params.repetition_ngram=0"])).validate()
    with pytest.raises(ConfigError, match="invalid_action_penalty"):
        SelfImitation(compose(["algo=spear", "algo.adv_params.invalid_action_penalty=-1"])).validate()
    with pytest.raises(ConfigError, match="filter_overlongg"):
        SelfImitation(compose(["algo=spear", "algo.adv_params.filter_overlongg=false"]))  # a misspelt parameter


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


# the buffer tests turn the filters off: the tiny model's responses are all incomplete (no answer), which would
# leave no loss token and no positive advantage to store
SMALL = ("algo.adv_params.filter_incomplete=false", "algo.adv_params.filter_overlong=false",
         "algo.adv_params.rollout_filter_ratio=1", "algo.adv_params.invalid_action_penalty=0",
         "task.reward.format_weight=1.0", "task.reward.format_regex='^\\s'", "algo.adv_params.buffer_size=1",
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
    # paper defaults: 3 of 4 groups kept, 8 (a power of 2) of their 12 rows; per-turn filters counted
    assert rows[-1]["spear/rollout_rows_kept_frac"] == 0.5 and "spear/filtered_incomplete" in rows[-1]


def test_episode_sampler_marks_void_turns():
    """The episode sampler's turn_void: 1 on the last model token of a turn whose tool call the environment rejects."""
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_tokenizer
    from rlpost.samplers.base import SamplerContext, SamplingParams
    from rlpost.samplers.episode import EpisodeSampler
    from tests.conftest import tiny_overrides
    from tests.test_agents import ScriptedEngine

    tok = load_tokenizer(compose_config(tiny_overrides()).model)
    ids = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    good = ids('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>')
    bad = ids("<tool_call>{oops</tool_call>")
    s = EpisodeSampler(1, max_turns=3, max_total_tokens=2000)
    res = s.sample(ScriptedEngine(tok, [good, bad, ids("done") + [tok.eos_token_id]]), [[1, 2, 3]],
                   SamplingParams(max_new_tokens=64), SamplerContext(step=1))
    m, v = res.generation.response_mask[0], res.extras["turn_void"][0]
    from rlpost.algos.turns import turn_spans

    spans = turn_spans(m)
    assert len(spans) == 3 and v.sum() == 1.0 and float(v[spans[1][1] - 1]) == 1.0


def test_buffer_stores_the_penalised_return(compose):
    """The authors' buffer reads the token scores after apply_invalid_action_penalty: R + b - 0.1 f."""
    from types import SimpleNamespace

    from rlpost.methods.spear import SelfImitation

    m = SelfImitation(compose(["algo=spear"]))
    b = RolloutBatch(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), torch.ones(2, 2, dtype=torch.long),
                     torch.ones(2, 2), torch.zeros(2, 2), torch.tensor([0, 0]), torch.tensor([0, 1]),
                     rewards=torch.tensor([1.0, 0.0]),
                     extras={TOOL_BONUS_KEY: torch.tensor([0.2, 0.0]), INVALID_FRAC_KEY: torch.tensor([0.5, 0.0]),
                             "advantages": torch.tensor([[0.5, 0.5], [-0.5, -0.5]]), "old_logprobs": torch.zeros(2, 2)})
    m.wrap_update(lambda: {}, SimpleNamespace(step=1, tokenizer=None), b)
    (step, rows), = m.buffer.entries
    assert step == 1 and rows.extras[RETURN_KEY].tolist() == pytest.approx([1.0 + 0.2 - 0.05])
    assert m.buffer.means == [(1, [pytest.approx((1.15 + 0.0) / 2)])]
