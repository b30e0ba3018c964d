"""RAPID, off-policy group-relative policy gradient, by hand. Moved unchanged from
tests/test_methods_r2vpo_xrpo_rapid_cscr.py.
"""

import pytest
import torch

from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from loss_split import grad_of, make as _make  # noqa: E402  (tests/loss_split.py)


def make(ratios, adv, mask=None, **kw):
    """:func:`loss_split.make` in float64."""
    return _make(ratios, adv, mask, dtype=torch.float64, **kw)



# --- RAPID, off-policy group-relative policy gradient (arXiv:2510.03515) ------------------------

def rapid_input(token_ratios, adv, group, **kw):
    x = make(token_ratios, [[a] * len(token_ratios[0]) for a in adv], **kw)
    x.group_index = torch.tensor(group)
    return x


def test_rapid_weights_and_reweighted_baseline_by_hand():
    # one group; A = r - mean = (0.5, 0, -0.5); sequence ratios 2 x 1 = 2, 1, 0.5 x 1 = 0.5 -> w = (2, 1, 0.5)
    # delta = (2 * 0.5 + 0 - 0.5 * 0.5) / 3.5 - 0 = 0.75 / 3.5 ; A' = A - delta ; value and gradient -A' w per token
    x = rapid_input([[2.0, 1.0], [1.0, 1.0], [0.5, 1.0]], [0.5, 0.0, -0.5], [0, 0, 0])
    loss, g, met = grad_of("rapid", x)
    d = 0.75 / 3.5
    want = torch.tensor([-(0.5 - d) * 2, -(0.0 - d) * 1, -(-0.5 - d) * 0.5], dtype=torch.float64)[:, None].expand(3, 2)
    assert torch.allclose(loss, want) and torch.allclose(g, want)
    assert float(met["rapid_baseline_shift"]) == pytest.approx(d)
    assert float(met["clip_frac"]) == pytest.approx(1 / 3)  # response 0 sits at the cap c = 2
    # a tighter cap: w0 = 1.5, delta = (0.75 - 0.25) / 3
    x = rapid_input([[2.0, 1.0], [1.0, 1.0], [0.5, 1.0]], [0.5, 0.0, -0.5], [0, 0, 0])
    _, g, _ = grad_of("rapid", x, weight_clip=1.5)
    assert float(g[0, 0]) == pytest.approx(-(0.5 - 0.5 / 3) * 1.5)


def test_rapid_on_policy_is_the_group_relative_policy_gradient():
    # every ratio 1: no baseline shift even for a split group (rows 0, 1 of group 0 and row 2 of group 1)
    x = rapid_input([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], [0.7, 0.1, -0.3], [0, 0, 1])
    loss, g, met = grad_of("rapid", x)
    assert torch.allclose(g, -x.advantages)
    assert float(met["rapid_baseline_shift"]) == 0.0 and float(met["clip_frac"]) == 0.0
    with pytest.raises(ValueError, match="weight_clip"):
        compute_policy_loss("rapid", x, weight_clip=0.0)
