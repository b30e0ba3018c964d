"""ADORA (arXiv:2602.10019): the Length-Advantage group labels and the reweighted GRPO advantage, by hand."""

import math

import pytest
import torch

from rlpost.algos.adora import adora_group_labels
from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.core.errors import ConfigError


def _inp(rewards, lengths, groups):
    R = max(lengths)
    mask = torch.zeros(len(lengths), R)
    for i, L in enumerate(lengths):
        mask[i, :L] = 1.0
    return AdvantageInput(rewards=torch.tensor(rewards, dtype=torch.float32), response_mask=mask,
                          group_index=torch.tensor(groups))


def test_adora_hand_computed():
    # group 0: rewards 1 0 1 0, lengths 10 6 4 8. Longest correct 10 > mean incorrect (6 + 8) / 2 = 7: TAS, w = 1.
    #   GRPO: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735, A = +-0.5 / 0.57735 = +-0.866025.
    # group 1: rewards 1 0 0 0, lengths 3 5 9 2. Longest correct 3 < mean incorrect 16 / 3 = 5.33: TDS, w = 0.1.
    #   GRPO: mean 0.25, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5, A = 1.5, -0.5 -> x 0.1 = 0.15, -0.05.
    x = _inp([1, 0, 1, 0, 1, 0, 0, 0], [10, 6, 4, 8, 3, 5, 9, 2], [0, 0, 0, 0, 1, 1, 1, 1])
    out = compute_advantages("adora", x)
    a = out.advantages[:, 0]
    s = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    t = 0.5 + 1e-6  # group 1's std plus eps
    want = torch.tensor([s, -s, s, -s, 0.1 * 0.75 / t, -0.1 * 0.25 / t, -0.1 * 0.25 / t, -0.1 * 0.25 / t])
    assert torch.allclose(a, want.float(), atol=1e-5)
    assert torch.all(out.advantages[x.response_mask == 0] == 0)
    assert out.returns is None


def test_adora_labels_edge_cases_and_threshold():
    r = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    lens = torch.tensor([5, 7, 4, 6, 2, 3, 100])
    g = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    # group 0: no correct response -> TDS; group 1: no incorrect one -> TAS;
    # group 2: longest correct 2 < mean incorrect (3 + 100) / 2 -> TDS, but with the 100-token response left out
    # (max_length_threshold 50) the mean incorrect is 3 and 2 < 3 is still TDS; threshold 3 drops both -> TAS.
    assert adora_group_labels(r, lens, g, 0.5).tolist() == [False, False, True, True, False, False, False]
    assert adora_group_labels(r, lens, g, 0.5, 50).tolist() == [False, False, True, True, False, False, False]
    assert adora_group_labels(r, lens, g, 0.5, 3).tolist() == [False, False, True, True, True, True, True]


def test_adora_invariants():
    # with both weights 1 ADORA is GRPO exactly; the weights only scale, never flip signs
    x = _inp([1, 0, 0, 1, 0, 0], [3, 8, 2, 9, 1, 4], [0, 0, 0, 1, 1, 1])
    grpo = compute_advantages("grpo", x).advantages
    assert torch.equal(compute_advantages("adora", x, tds_weight=1.0).advantages, grpo)
    a = compute_advantages("adora", x, tds_weight=0.1, tas_weight=2.0).advantages
    assert torch.all(torch.sign(a) == torch.sign(grpo))


def test_adora_bad_params():
    x = _inp([1, 0], [3, 4], [0, 0])
    with pytest.raises(ValueError, match="weights must be >= 0"):
        compute_advantages("adora", x, tds_weight=-1.0)
    with pytest.raises(ConfigError):
        compute_advantages("adora", x, tds_wieght=0.2)
