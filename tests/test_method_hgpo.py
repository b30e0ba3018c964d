"""HGPO (arXiv:2602.22817): hierarchy-of-groups advantages on a hand-worked group of 4 episodes."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages

# Four calculator-like episodes of one prompt; ids 90, 91 are the tool's reply X (mask 0), pad 0.
#   A: call "10 11" -> X -> answer 20   reward 1
#   B: call "10 11" -> X -> answer 21   reward 0   (same call text as A)
#   C: call "12 11" -> X -> answer 22   reward 1   (other call text, same reply)
#   D: answer "13 14" directly           reward 0   (one turn)
IDS = [[10, 11, 90, 91, 20], [10, 11, 90, 91, 21], [12, 11, 90, 91, 22], [13, 14, 0, 0, 0]]
MASK = [[1, 1, 0, 0, 1], [1, 1, 0, 0, 1], [1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]


def _inp(rewards=(1.0, 0.0, 1.0, 0.0), groups=(0, 0, 0, 0), ids=IDS, mask=MASK):
    return AdvantageInput(rewards=torch.tensor(rewards), response_mask=torch.tensor(mask, dtype=torch.float32),
                          group_index=torch.tensor(groups), response_ids=torch.tensor(ids))


def test_hgpo_hand_computed():
    # gamma = 1: step returns A0=A1=1, B0=B1=0, C0=C1=1, D0=0.
    # Turn 0 (no history, level 0 only): group {A0,B0,C0,D0}, G = 1,0,1,0: mean .5, std sqrt(1/3) -> +-0.866025.
    # Turn 1, level 0 (same reply X): {A1,B1,C1}, G = 1,0,1: mean 2/3, std sqrt(1/3):
    #   A1, C1: (1/3)/0.57735 = 0.577350; B1: (-2/3)/0.57735 = -1.154701.
    # Turn 1, level 1 (X and the same previous call text): {A1,B1}: +-0.707107; C1 alone (left out).
    # Weights (j+1)^1: level 0 -> 1, level 1 -> 2.
    #   A^H(A1) = (0.577350 + 2 * 0.707107) / 3 = 0.663855; A^H(B1) = (-1.154701 - 1.414214) / 3 = -0.856305;
    #   A^H(C1) = 0.577350 (level 0 only).
    # Episode term A^E (GRPO on 1,0,1,0) = +-0.866025, added with omega = 1:
    #   A0 = C0 = 1.732051, B0 = D0 = -1.732051; A1 = 1.529880, B1 = -1.722330, C1 = 1.443376.
    adv = compute_advantages("hgpo", _inp(), gamma=1.0).advantages
    s3, s2 = math.sqrt(1 / 3), math.sqrt(2) / 2
    e = (1 - 0.5) / s3
    exp_a1 = e + ((1 / 3) / s3 + 2 * s2) / 3
    exp_b1 = -e + ((-2 / 3) / s3 - 2 * s2) / 3
    exp_c1 = e + (1 / 3) / s3
    assert adv[0, :2].tolist() == pytest.approx([2 * e] * 2, abs=1e-5)
    assert adv[1, :2].tolist() == pytest.approx([-2 * e] * 2, abs=1e-5)
    assert adv[2, :2].tolist() == pytest.approx([2 * e] * 2, abs=1e-5)
    assert adv[3, :2].tolist() == pytest.approx([-2 * e] * 2, abs=1e-5)
    assert float(adv[0, 4]) == pytest.approx(exp_a1, abs=1e-5) and exp_a1 == pytest.approx(1.529880, abs=1e-5)
    assert float(adv[1, 4]) == pytest.approx(exp_b1, abs=1e-5) and exp_b1 == pytest.approx(-1.722330, abs=1e-5)
    assert float(adv[2, 4]) == pytest.approx(exp_c1, abs=1e-5) and exp_c1 == pytest.approx(1.443376, abs=1e-5)
    assert torch.all(adv[:, 2:4] == 0) and torch.all(adv[3, 2:] == 0)  # environment tokens and padding


def test_hgpo_levels_and_weights():
    # levels=0: A1's step term is level 0 alone (0.577350); alpha=0: levels weighted equally.
    s3, s2 = math.sqrt(1 / 3), math.sqrt(2) / 2
    e = 0.5 / s3
    a0 = compute_advantages("hgpo", _inp(), gamma=1.0, levels=0).advantages
    assert float(a0[0, 4]) == pytest.approx(e + (1 / 3) / s3, abs=1e-5)
    a_eq = compute_advantages("hgpo", _inp(), gamma=1.0, alpha=0.0).advantages
    assert float(a_eq[0, 4]) == pytest.approx(e + ((1 / 3) / s3 + s2) / 2, abs=1e-5)


def test_hgpo_invariants():
    # single-turn rows, no episode term: every row is a turn at the prompt -> GRPO exactly
    one = _inp(ids=[[1, 2, 0], [3, 4, 0], [5, 0, 0], [6, 7, 8]], mask=[[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    h = compute_advantages("hgpo", one, episode_coef=0.0).advantages
    g = compute_advantages("grpo", one).advantages
    assert torch.allclose(h, g, atol=1e-6)
    # two groups with identical tokens are never pooled: each is its own hierarchy
    inp2 = _inp(rewards=(1.0, 0.0, 1.0, 0.0) * 2, groups=(0,) * 4 + (1,) * 4, ids=IDS * 2, mask=MASK * 2)
    both = compute_advantages("hgpo", inp2, gamma=1.0).advantages
    alone = compute_advantages("hgpo", _inp(), gamma=1.0).advantages
    assert torch.allclose(both[:4], alone, atol=1e-6) and torch.allclose(both[4:], alone, atol=1e-6)
    # a group whose returns are all equal gets exactly 0 (gamma = 1: with gamma < 1 the one-turn episode D's
    # return is undiscounted, so a shorter success counts more, as GiGPO's discounted step return does)
    flat = compute_advantages("hgpo", _inp(rewards=(1.0, 1.0, 1.0, 1.0)), gamma=1.0).advantages
    assert torch.all(flat == 0)


def test_hgpo_errors(compose):
    from rlpost.algos.validate import validate_algo
    from rlpost.config.compose import validate_config
    from rlpost.core.errors import ConfigError

    with pytest.raises(ValueError, match="response_ids"):
        compute_advantages("hgpo", AdvantageInput(rewards=torch.ones(2), response_mask=torch.ones(2, 3),
                                                  group_index=torch.zeros(2, dtype=torch.long)))
    with pytest.raises(ConfigError, match="levelz"):
        validate_algo(compose(["model=tiny", "algo=hgpo", "+algo.adv_params.levelz=3"]).algo)
    with pytest.raises(ConfigError, match="env=calculator"):
        validate_config(compose(["model=tiny", "algo=hgpo"]))
    validate_config(compose(["model=tiny", "algo=hgpo", "env=calculator"]))
