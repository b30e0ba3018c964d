"""G2PO (arXiv:2606.22995): TD-edge advantages on a group's state graph, worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages

# One prompt, four episodes; 90 91 = tool reply X, 95 96 = tool reply Y (mask 0), pad 0.
#   A: call -> X -> right answer   reward 1
#   B: call -> X -> wrong answer   reward 0
#   C: call -> Y -> answer         reward 0
#   D: answers at once             reward 0   (one turn)
IDS = [[10, 11, 90, 91, 20], [12, 11, 90, 91, 21], [13, 11, 95, 96, 22], [14, 15, 0, 0, 0]]
MASK = [[1, 1, 0, 0, 1], [1, 1, 0, 0, 1], [1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]


def _inp(rewards=(1.0, 0.0, 0.0, 0.0), groups=(0, 0, 0, 0), ids=IDS, mask=MASK, token_rewards=None):
    return AdvantageInput(rewards=torch.tensor(rewards), response_mask=torch.tensor(mask, dtype=torch.float32),
                          group_index=torch.tensor(groups), response_ids=torch.tensor(ids), token_rewards=token_rewards)


def test_g2po_hand_computed():
    # gamma = 1. Nodes: prompt (visited by A0 B0 C0 D0 with returns 1,0,0,0) V = 0.25;
    # X (A1, B1: returns 1, 0) V = 0.5; Y (C1: 0) V = 0; terminal V = 0.
    # TD errors: A0 = 0 + V(X) - V(prompt) = 0.25, B0 = 0.25, C0 = V(Y) - 0.25 = -0.25, D0 = 0 + 0 - 0.25 = -0.25,
    #            A1 = 1 + 0 - V(X) = 0.5, B1 = 0 - 0.5 = -0.5, C1 = 0 - 0 = 0.
    # Over the 7 edges: mean 0, unbiased std sqrt(0.75 / 6) = 0.353553 -> A = delta / 0.353553:
    #   A0 = B0 = 0.707107, C0 = D0 = -0.707107, A1 = 1.414214, B1 = -1.414214, C1 = 0.
    adv = compute_advantages("g2po", _inp(), gamma=1.0).advantages
    s = math.sqrt(0.75 / 6)
    for row, (t0, t1) in enumerate([(0.25, 0.5), (0.25, -0.5), (-0.25, 0.0)]):
        assert adv[row, :2].tolist() == pytest.approx([t0 / s] * 2, abs=1e-5)
        assert float(adv[row, 4]) == pytest.approx(t1 / s, abs=1e-5)
    assert adv[3, :2].tolist() == pytest.approx([-0.25 / s] * 2, abs=1e-5)
    assert float(adv[0, 4]) == pytest.approx(1.414214, abs=1e-5)
    assert torch.all(adv[:, 2:4] == 0) and torch.all(adv[3, 2:] == 0)


def test_g2po_discount_and_turn_rewards():
    # gamma = 0.5 and a per-turn reward 0.5 on C's first turn (its last token, position 1).
    # Returns: A0 = 0 + 0.5*1 = 0.5, A1 = 1, B0 = B1 = 0, C0 = 0.5 + 0.5*0 = 0.5, C1 = 0, D0 = 0.
    # V(prompt) = (0.5 + 0 + 0.5 + 0)/4 = 0.25, V(X) = 0.5, V(Y) = 0.
    # deltas: A0 = 0 + 0.5*0.5 - 0.25 = 0, B0 = 0, C0 = 0.5 + 0 - 0.25 = 0.25, D0 = -0.25,
    #         A1 = 1 - 0.5 = 0.5, B1 = -0.5, C1 = 0. mean 0; sum of squares 0.625, std sqrt(0.625/6).
    tr = torch.zeros(4, 5)
    tr[2, 1] = 0.5
    adv = compute_advantages("g2po", _inp(token_rewards=tr), gamma=0.5, norm_by_std=False).advantages
    exp = {(0, 0): 0.0, (1, 0): 0.0, (2, 0): 0.25, (3, 0): -0.25, (0, 4): 0.5, (1, 4): -0.5, (2, 4): 0.0}
    for (r, t), v in exp.items():
        assert float(adv[r, t]) == pytest.approx(v, abs=1e-6)
    z = compute_advantages("g2po", _inp(token_rewards=tr), gamma=0.5).advantages
    assert float(z[2, 0]) == pytest.approx(0.25 / math.sqrt(0.625 / 6), abs=1e-5)


def test_g2po_invariants():
    base = compute_advantages("g2po", _inp(), gamma=1.0).advantages
    # rewards scaled by 3: values and TD errors scale, the standardised advantage does not
    assert torch.allclose(compute_advantages("g2po", _inp(rewards=(3.0, 0, 0, 0)), gamma=1.0).advantages, base, atol=1e-5)
    # two groups with the same tokens: separate graphs, same advantages as alone (norm_scope=group)
    both = compute_advantages("g2po", _inp(rewards=(1.0, 0, 0, 0) * 2, groups=(0,) * 4 + (1,) * 4,
                                           ids=IDS * 2, mask=MASK * 2), gamma=1.0).advantages
    assert torch.allclose(both[:4], base, atol=1e-6) and torch.allclose(both[4:], base, atol=1e-6)
    assert torch.all(compute_advantages("g2po", _inp(rewards=(0.0, 0, 0, 0))).advantages == 0)
    with pytest.raises(ValueError, match="norm_scope|NormScope|not a valid"):
        compute_advantages("g2po", _inp(), norm_scope="graph")


def test_g2po_config(compose):
    from rlpost.config.compose import validate_config
    from rlpost.core.errors import ConfigError

    with pytest.raises(ConfigError, match="sampler=episode"):
        validate_config(compose(["model=tiny", "algo=g2po"]))
    validate_config(compose(["model=tiny", "algo=g2po", "env=calculator"]))
