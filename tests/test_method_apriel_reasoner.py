"""Apriel-Reasoner's difficulty-aware length penalty (arXiv:2604.02007), by hand, and its length-cap flag."""

import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.algos.apriel import difficulty_aware_scale
from rlpost.methods.length_cap import length_capped


def _inp(correct, overlong, lengths, groups, capped):
    R = max(lengths)
    mask = torch.zeros(len(lengths), R)
    for i, L in enumerate(lengths):
        mask[i, :L] = 1.0
    c, o = torch.tensor(correct), torch.tensor(overlong)
    return AdvantageInput(rewards=c + o, response_mask=mask, group_index=torch.tensor(groups),
                          extras={"reward_correct": c, "reward_overlong": o, "length_capped": torch.tensor(capped)})


def test_scale_by_hand():
    # group 0: 1 of 4 correct, p = 0.25; correct row s = 0.25 ** 0.5 = 0.5, failed rows 0.5, the capped one 1.
    # group 1: 4 of 4 correct, p = 1: s = 1 (an easy prompt keeps the full penalty).
    s = difficulty_aware_scale(torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1]), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
                               torch.tensor([False, False, True, False, False, False, False, False]),
                               gamma=0.5, failure_scale=0.5, success_threshold=0.5)
    assert torch.allclose(s, torch.tensor([0.5, 0.5, 1.0, 0.5, 1, 1, 1, 1], dtype=torch.float64))
    # gamma = 2 on p = 0.75: 0.5625
    s2 = difficulty_aware_scale(torch.tensor([1.0, 1, 1, 0]), torch.tensor([0, 0, 0, 0]), torch.zeros(4, dtype=torch.bool),
                                gamma=2.0, failure_scale=1.0, success_threshold=0.5)
    assert torch.allclose(s2, torch.tensor([0.5625, 0.5625, 0.5625, 1.0], dtype=torch.float64))


def test_advantage_by_hand():
    # one group of 4: correct 1 1 0 0, overlong penalties -0.5 0 -0.8 -1 (the last one at the limit).
    # p = 0.5, s = sqrt(0.5) = 0.70711 for the correct rows, 0.5 for the failed one, 1 for the capped one.
    # shaped: 1 - 0.5 * 0.70711 = 0.64645, 1, -0.4, -1; mean 0.061612;
    # deviations 0.58483, 0.93839, -0.46161, -1.06161; squares 0.34203 + 0.88058 + 0.21308 + 1.12703 = 2.56272;
    # unbiased std sqrt(2.56272 / 3) = 0.92425; A = 0.63277, 1.01530, -0.49945, -1.14862.
    x = _inp([1.0, 1.0, 0.0, 0.0], [-0.5, 0.0, -0.8, -1.0], [9, 5, 10, 12], [0, 0, 0, 0], [False, False, False, True])
    a = compute_advantages("apriel", x).advantages[:, 0]
    r = torch.tensor([1 - 0.5 * math.sqrt(0.5), 1.0, -0.4, -1.0], dtype=torch.float64)
    want = (r - r.mean()) / (r.std() + 1e-6)
    assert torch.allclose(a.double(), want, atol=1e-5)
    assert torch.allclose(a, torch.tensor([0.63277, 1.01530, -0.49945, -1.14862]), atol=1e-4)
    # invariant: a batch without any overlong penalty is GRPO exactly
    y = _inp([1.0, 0.0, 1.0, 0.0], [0.0] * 4, [3, 4, 5, 6], [0, 0, 0, 0], [False] * 4)
    assert torch.equal(compute_advantages("apriel", y).advantages, compute_advantages("grpo", y).advantages)
    # invariant: gamma = 0 and failure_scale = 1 leave DAPO's penalty as it is (plain GRPO on r)
    assert torch.allclose(compute_advantages("apriel", x, gamma=0.0, failure_scale=1.0).advantages,
                          compute_advantages("grpo", x).advantages, atol=1e-6)


def test_errors_and_cap_flag():
    x = _inp([1.0, 0.0], [0.0, -0.1], [3, 4], [0, 0], [False, False])
    with pytest.raises(ValueError, match="failure_scale"):
        compute_advantages("apriel", x, failure_scale=1.5)
    assert length_capped(torch.tensor([3, 8, 9]), 8).tolist() == [False, True, True]


def test_preset_turns_the_method_on(compose):
    from tests.conftest import tiny_overrides
    from rlpost.methods.base import MethodSet

    cfg = compose(tiny_overrides("algo=apriel_reasoner"))
    assert "length_cap" in MethodSet.for_config(cfg).names


def test_no_overlong_window_is_a_config_error(compose):
    from tests.conftest import tiny_overrides
    from rlpost.core.errors import ConfigError
    from rlpost.methods.length_cap import LengthCap

    cfg = compose(tiny_overrides("algo=apriel_reasoner", "task.reward.overlong_buffer=0"))
    with pytest.raises(ConfigError, match="task.reward.overlong_buffer=0.2"):
        LengthCap(cfg).validate()
    LengthCap(compose(tiny_overrides("algo=apriel_reasoner"))).validate()
