"""RTMC (arXiv:2604.11037): rollout-tree Monte Carlo advantages, worked by hand on 4 episodes."""

from __future__ import annotations

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages

# One prompt, four episodes; 90 91 = tool reply X, 95 96 = tool reply Y (mask 0), pad 0.
#   A: call -> X -> right answer   reward 1
#   B: call (other wording) -> X -> wrong answer   reward 0
#   C: call -> Y -> answer         reward 0
#   D: answers at once             reward 0
IDS = [[10, 11, 90, 91, 20], [12, 11, 90, 91, 21], [13, 11, 95, 96, 22], [14, 15, 0, 0, 0]]
MASK = [[1, 1, 0, 0, 1], [1, 1, 0, 0, 1], [1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]


def _inp(rewards=(1.0, 0.0, 0.0, 0.0), groups=(0, 0, 0, 0), ids=IDS, mask=MASK):
    return AdvantageInput(rewards=torch.tensor(rewards), response_mask=torch.tensor(mask, dtype=torch.float32),
                          group_index=torch.tensor(groups), response_ids=torch.tensor(ids))


def test_rtmc_hand_computed():
    # gamma = 1, prior m = 1, min support 2. Episode returns 1, 0, 0, 0: mean 0.25, std 0.5 (the scale).
    # Root (prompt): 4 visits, V = 0.25. Actions = what came back: X (A, B: returns 1, 0), Y (C: 0), D's own answer (0).
    #   Q~(X) = (1 + 0 + 0.25) / (2 + 1) = 0.416667 -> A0 = B0 = 0.166667 / 0.5 = 0.333333
    #   Q~(Y) = (0 + 0.25) / 2 = 0.125 -> C0 = -0.125 / 0.5 = -0.25; D0 likewise -0.25.
    # Node (prompt, X): A1, B1, V = 0.5; their answers differ: Q~ = (1 + 0.5)/2 = 0.75 -> A1 = 0.25/0.5 = 0.5,
    #   Q~ = (0 + 0.5)/2 = 0.25 -> B1 = -0.5.
    # Node (prompt, Y): 1 visit < 2 -> fallback GRPO: (0 - 0.25)/0.5 = -0.5.
    adv = compute_advantages("rtmc", _inp()).advantages
    exp = [(1 / 3, 0.5), (1 / 3, -0.5), (-0.25, -0.5)]
    for row, (t0, t1) in enumerate(exp):
        assert adv[row, :2].tolist() == pytest.approx([t0] * 2, abs=1e-5)
        assert float(adv[row, 4]) == pytest.approx(t1, abs=1e-5)
    assert adv[3, :2].tolist() == pytest.approx([-0.25] * 2, abs=1e-5)
    assert torch.all(adv[:, 2:4] == 0) and torch.all(adv[3, 2:] == 0)


def test_rtmc_prior_and_fallback():
    # prior 0: plain means. A0 = (0.5 - 0.25)/0.5 = 0.5, C0 = (0 - 0.25)/0.5 = -0.5, A1 = (1 - 0.5)/0.5 = 1.
    a = compute_advantages("rtmc", _inp(), prior_strength=0.0).advantages
    assert [float(a[0, 0]), float(a[2, 0]), float(a[0, 4])] == pytest.approx([0.5, -0.5, 1.0], abs=1e-5)
    z = compute_advantages("rtmc", _inp(), fallback="zero").advantages
    assert float(z[2, 4]) == 0.0
    # min support 5: no state has 5 visits -> every turn gets the GRPO fallback
    g = compute_advantages("rtmc", _inp(), min_state_support=5).advantages
    assert torch.allclose(g, compute_advantages("grpo", _inp()).advantages, atol=1e-5)


def test_rtmc_invariants():
    # with_actions and no prior: texts all differ, so each turn's Q is its own return and deeper states are
    # seen once (fallback): exactly GRPO's advantage on every token
    a = compute_advantages("rtmc", _inp(), with_actions=True, prior_strength=0.0).advantages
    assert torch.allclose(a, compute_advantages("grpo", _inp()).advantages, atol=1e-6)
    both = compute_advantages("rtmc", _inp(rewards=(1.0, 0, 0, 0) * 2, groups=(0,) * 4 + (1,) * 4,
                                           ids=IDS * 2, mask=MASK * 2)).advantages
    alone = compute_advantages("rtmc", _inp()).advantages
    assert torch.allclose(both[:4], alone, atol=1e-6) and torch.allclose(both[4:], alone, atol=1e-6)
    assert torch.all(compute_advantages("rtmc", _inp(rewards=(1.0, 1, 1, 1))).advantages == 0)


def test_rtmc_config(compose):
    from rlpost.config.compose import validate_config
    from rlpost.core.errors import ConfigError

    with pytest.raises(ConfigError, match="sampler=episode"):
        validate_config(compose(["model=tiny", "algo=rtmc"]))
    with pytest.raises(ConfigError, match="fallback"):
        validate_config(compose(["model=tiny", "algo=rtmc", "env=calculator", "+algo.adv_params.fallback=critic"]))
    validate_config(compose(["model=tiny", "algo=rtmc", "env=calculator"]))
