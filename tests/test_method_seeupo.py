"""SeeUPO's turn-by-turn updates (rlpost/methods/turn_updates.py, arXiv:2602.06554), hand-computed.

The update is replaced by a recorder, and the log-prob pass by a function of a counter that
stands for the weights: each recorded call returns the mask, advantages and old log-probs the
update saw. No model is needed.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rlpost.core.errors import ConfigError
from rlpost.methods.turn_updates import (TurnUpdates, batch_normalised, sequence_ratio, turn_index_map,
                                         turn_settings)


def _cfg(**turn):
    spec = {"order": "reverse", "refresh_old_logprobs": True, "carry_ratio": True, "ratio_clip_low": 0.2,
            "ratio_clip_high": 0.2, "adv_norm": "batch", "adv_clamp": 3.0}
    spec.update(turn)
    return OmegaConf.create({"algo": {"turn_updates": spec, "update_gate": None},
                             "trainer": {"engine": "torch", "num_procs": 1}, "launcher": {"name": "none"}})


def _batch():
    # row 0: turn 0 = tokens 0-1, env tokens 2-3, turn 1 = tokens 4-5
    # row 1: turn 0 = tokens 0-2, env token 3, turn 1 = token 4, padding 5
    # row 2: a single turn, tokens 0-1
    mask = torch.tensor([[1, 1, 0, 0, 1, 1],
                         [1, 1, 1, 0, 1, 0],
                         [1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, 0.0, -1.0])[:, None] * mask  # a GRPO advantage per row
    return SimpleNamespace(response_mask=mask.clone(), extras={"advantages": adv.clone(),
                                                                "old_logprobs": torch.full((3, 6), -9.0)})


class _Run:
    """Log-probs ``-1 + 0.1 * version * w`` per token (w: a fixed per-row weight); an update bumps version."""

    def __init__(self, batch):
        self.batch, self.version, self.calls = batch, 0, []
        self.w = torch.tensor([1.0, 2.0, 0.0])[:, None].expand(3, 6)

    def logprobs(self, b):
        return (-1.0 + 0.1 * self.version * self.w).clone(), None

    def rows_pass(self, b, fn):
        return fn(b)

    def update(self):
        b = self.batch
        self.calls.append((b.response_mask.clone(), b.extras["advantages"].clone(), b.extras["old_logprobs"].clone()))
        self.version += 1
        return {"actor/loss": float(len(self.calls)), "actor/flag": "x"}


def test_turn_index_map():
    m = _batch().response_mask
    assert turn_index_map(m).tolist() == [[0, 0, -1, -1, 1, 1], [0, 0, 0, -1, 1, -1], [0, 0, -1, -1, -1, -1]]


def test_reverse_order_masks_advantages_and_carried_ratio_by_hand():
    batch = _batch()
    run = _Run(batch)
    meth = TurnUpdates(_cfg())
    meth.validate()
    out = meth.wrap_update(run.update, run, batch)
    assert len(run.calls) == 2 and out["turns/updates"] == 2.0
    (m1, a1, o1), (m0, a0, o0) = run.calls
    # first call: the LAST turn (index 1), rows 0 and 1 only
    assert m1.tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 0], [0] * 6]
    # batch norm over rows {0, 1}: a = (1, 0), centred (0.5, -0.5), std = sqrt(0.5) = 0.70711
    # -> (0.70711, -0.70711); carried ratio 1 at the first update
    r = 0.5 / math.sqrt(0.5)
    assert torch.allclose(a1, torch.tensor([[0, 0, 0, 0, r, r], [0, 0, 0, 0, -r, 0], [0.0] * 6]), atol=1e-6)
    assert torch.allclose(o1, torch.full((3, 6), -1.0))  # refreshed under version 0, not the recorded -9
    # the carried ratio after turn 1: row 0 mean log-ratio 0.1 * 1 = 0.1 -> exp 1.10517 (inside [0.8, 1.2]);
    # row 1: 0.1 * 2 = 0.2 -> exp 1.22140, clipped to 1.2; row 2 has no turn 1: stays 1
    rho = torch.tensor([math.exp(0.1), 1.2, 1.0])
    # second call: turn 0 on all three rows; batch norm over (1, 0, -1): centred, std 1 -> (1, 0, -1)
    assert m0.tolist() == [[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]]
    want = torch.tensor([1.0, 0.0, -1.0])[:, None] * rho[:, None] * m0
    assert torch.allclose(a0, want, atol=1e-6)
    # old log-probs refreshed under version 1 (after the turn-1 update): -1 + 0.1 * w
    assert torch.allclose(o0, -1.0 + 0.1 * run.w)
    # after turn 0: row 0 ratio exp(0.1) * exp(0.1) = 1.2214 -> clip 1.2; row 1 1.2 * 1.2 -> 1.2; row 2 exp(0) = 1
    assert out["turns/carried_ratio_mean"] == pytest.approx((1.2 + 1.2 + 1.0) / 3, abs=1e-6)
    assert out["actor/loss"] == pytest.approx(1.5) and out["actor/flag"] == "x"
    # everything restored
    assert torch.equal(batch.response_mask, _batch().response_mask)
    assert torch.equal(batch.extras["advantages"], _batch().extras["advantages"])
    assert torch.equal(batch.extras["old_logprobs"], torch.full((3, 6), -9.0))


def test_forward_order_and_no_correction_is_plain_masking():
    batch = _batch()
    run = _Run(batch)
    meth = TurnUpdates(_cfg(order="forward", carry_ratio=False, adv_norm="none", refresh_old_logprobs=False))
    meth.validate()
    meth.wrap_update(run.update, run, batch)
    (m0, a0, o0), (m1, a1, o1) = run.calls
    assert m0[:, :4].sum() == 7 and m1[:, 4:].sum() == 3
    # invariant: the turn masks partition the loss mask, and without correction the advantages are the originals
    assert torch.equal(m0 + m1, _batch().response_mask)
    assert torch.equal(a0 + a1, _batch().extras["advantages"])
    assert torch.equal(o0, torch.full((3, 6), -9.0))  # recorded ones kept


def test_single_turn_rows_get_one_update():
    b = SimpleNamespace(response_mask=torch.ones(2, 3), extras={"advantages": torch.tensor([[1.0] * 3, [-1.0] * 3])})
    run = _Run(b)
    run.w = torch.zeros(2, 3)
    meth = TurnUpdates(_cfg(adv_norm="none"))
    meth.validate()
    meth.wrap_update(run.update, run, b)
    assert len(run.calls) == 1 and torch.equal(run.calls[0][0], torch.ones(2, 3))
    assert "old_logprobs" not in b.extras  # it was absent before: removed again


def test_helpers_by_hand():
    tm = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    # mean log-ratios: (0.3 + 0.1) / 2 = 0.2 -> exp 1.2214 -> clip 1.2; -0.5 -> exp 0.6065 -> clip 0.8; no tokens -> 1
    s = sequence_ratio(torch.tensor([[0.3, 0.1], [-0.5, 9.0], [5.0, 5.0]]), torch.zeros(3, 2), tm, 0.2, 0.2)
    assert torch.allclose(s, torch.tensor([1.2, 0.8, 1.0]))
    # one row only: centred to 0, no std division
    assert torch.equal(batch_normalised(torch.full((3, 2), 5.0), torch.tensor([[1.0, 0], [0, 0], [0, 0]]), 3.0),
                       torch.zeros(3, 2))
    # clamp: values (10, 0, 0, 0) -> centred (7.5, -2.5, -2.5, -2.5), std 5 -> (1.5, -0.5, ...) ; clamp 1 -> 1.0
    a = torch.tensor([[10.0], [0.0], [0.0], [0.0]])
    out = batch_normalised(a, torch.ones(4, 1), 1.0)
    assert torch.allclose(out[:, 0], torch.tensor([1.0, -0.5, -0.5, -0.5]))


@pytest.mark.parametrize("bad, msg", [({"order": "sideways"}, "order"), ({"adv_norm": "group"}, "adv_norm"),
                                      ({"ratio_clip_low": 1.0}, "ratio_clip_low"), ({"adv_clamp": 0.0}, "adv_clamp"),
                                      ({"ordr": "reverse"}, "unknown parameter")])
def test_config_errors(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        turn_settings(_cfg(**bad))


def test_config_errors_setup():
    c = _cfg()
    c.trainer.num_procs = 2
    with pytest.raises(ConfigError, match="num_procs=1"):
        turn_settings(c)
    c = _cfg()
    c.algo.update_gate = {"name": "mipu"}
    with pytest.raises(ConfigError, match="update_gate"):
        turn_settings(c)


def test_preset_composes(compose):
    cfg = compose(["algo=seeupo"])
    p = turn_settings(cfg)
    assert p.order == "reverse" and p.carry_ratio and p.adv_norm == "batch"
    assert cfg.algo.loss == "gspo" and cfg.algo.adv_params.norm_by_std is False


def test_one_step_on_episodes_tiny(compose, tmp_path):
    """algo=seeupo trains one step on env=calculator episodes with the tiny model through the real trainer."""
    import json

    from tests.conftest import tiny_overrides
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("algo=seeupo", "env=calculator", "task=multiply", "steps=1", "eval.at_end=false",
                                 "eval.every=0", "sampler.params.max_total_tokens=40", "checkpoint.every=0"))
    train(cfg, tmp_path / "s")
    rows = [json.loads(x) for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    m = next(r for r in rows if "turns/updates" in r)
    assert m["turns/updates"] >= 1


def test_two_turn_episodes_through_the_real_trainer(compose, tmp_path):
    """Hand-built 2-turn episodes, the tiny model's real update: two optimizer steps (turn 1, then turn 0),
    the weights move between them (the carried ratio leaves 1), and the batch is restored."""
    from rlpost.core.batch import RolloutBatch
    from rlpost.run.runner import Run
    from tests.conftest import tiny_overrides

    run = Run(compose(tiny_overrides("algo=seeupo", "trainer.lr=1e-2")), tmp_path / "r")
    try:
        mask = torch.tensor([[1., 1, 0, 0, 1, 1], [1., 0, 0, 1, 1, 0], [1., 1, 1, 1, 0, 0]])
        batch = RolloutBatch(prompt_ids=torch.tensor([[0, 5, 6]] * 3), prompt_mask=torch.tensor([[0, 1, 1]] * 3),
                             response_ids=torch.tensor([[11, 12, 13, 14, 15, 16]] * 3), response_mask=mask.clone(),
                             rollout_logprobs=torch.zeros(3, 6), group_index=torch.tensor([0, 0, 0]),
                             prompt_index=torch.tensor([0, 0, 0]), answers=[1, 1, 1],
                             extras={"response_attn": torch.ones(3, 6),
                                     "advantages": torch.tensor([1.0, -1.0, 0.5])[:, None] * mask})
        batch.extras["old_logprobs"] = run.trainer.compute_logprobs(batch)[0]
        old0 = batch.extras["old_logprobs"].clone()
        w0 = [p.detach().clone() for p in run.trainer.policy.parameters()]
        m = TurnUpdates(run.cfg)
        m.validate()
        out = m.wrap_update(lambda: run.trainer.policy_update(batch, run.update_rng), run.services, batch)
        assert out["turns/updates"] == 2.0
        assert out["turns/carried_ratio_mean"] != 1.0 and 0.8 <= out["turns/carried_ratio_mean"] <= 1.2
        assert any(not torch.equal(a, p.detach()) for a, p in zip(w0, run.trainer.policy.parameters()))
        assert torch.equal(batch.response_mask, mask) and torch.equal(batch.extras["old_logprobs"], old0)
    finally:
        run.close()
