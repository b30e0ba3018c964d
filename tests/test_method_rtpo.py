"""RTPO's readable half, the reverse-turn update order (rlpost/methods/turn_updates.py without SeeUPO's
corrections). RTPO has no preset: its reverse-tree sampler is unreadable from the abstract and no arXiv id
was found (docs/ALGORITHMS.md, "Seed methods left out"); its update order is this setting on any preset."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rlpost.methods.turn_updates import TurnUpdates, turn_settings


#: RTPO's order from the seeupo preset with SeeUPO's own parts switched off (docs/ALGORITHMS.md)
RTPO_ORDER = ["algo=seeupo", "algo.turn_updates.carry_ratio=false", "algo.turn_updates.adv_norm=none",
              "algo.loss=ppo_clip", "algo.adv_params.norm_by_std=true"]


def test_setting_is_reverse_order_without_seeupo_corrections(compose):
    cfg = compose(RTPO_ORDER)
    p = turn_settings(cfg)
    assert (p.order, p.carry_ratio, p.adv_norm, p.refresh_old_logprobs) == ("reverse", False, "none", True)
    assert cfg.algo.loss == "ppo_clip" and cfg.algo.adv_estimator == "grpo"


def test_reverse_turn_updates_by_hand(compose):
    cfg = compose(RTPO_ORDER)
    # one 3-turn episode (turns at 0-1, 3, 5-6) and one 1-turn episode; GRPO advantages +0.7 / -0.7
    mask = torch.tensor([[1, 1, 0, 1, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([0.7, -0.7])[:, None] * mask
    batch = SimpleNamespace(response_mask=mask.clone(), extras={"advantages": adv.clone()})
    seen, version = [], [0]

    def update():
        seen.append((batch.response_mask.clone(), batch.extras["advantages"].clone(),
                     batch.extras["old_logprobs"].clone()))
        version[0] += 1
        return {"actor/loss": 0.0}

    run = SimpleNamespace(rows_pass=lambda b, fn: fn(b),
                          logprobs=lambda b: (torch.full((2, 7), float(-version[0])), None))
    m = TurnUpdates(cfg)
    m.validate()
    out = m.wrap_update(update, run, batch)
    # turn 2 (row 0 only), then turn 1 (row 0 only), then turn 0 (both rows)
    assert [s[0].tolist() for s in seen] == [
        [[0, 0, 0, 0, 0, 1, 1], [0] * 7],
        [[0, 0, 0, 1, 0, 0, 0], [0] * 7],
        [[1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0]],
    ]
    # no re-normalisation and no carried ratio: each turn keeps its GRPO advantage
    for msk, a, _ in seen:
        assert torch.equal(a, adv * msk)
    # each update's old log-probs are the weights left by the update before it (versions 0, 1, 2)
    assert [float(s[2][0, 0]) for s in seen] == [0.0, -1.0, -2.0]
    assert out["turns/updates"] == 3.0 and out["turns/carried_ratio_mean"] == 1.0
    assert torch.equal(batch.response_mask, mask)
