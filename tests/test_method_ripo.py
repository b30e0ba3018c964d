"""RIPO: the isometric clip bounds by hand and the loss that clips likely tokens tighter than rare ones.
Moved unchanged from tests/test_methods_pope_hdl_seed_ripo.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos.losses import PolicyLossInput, compute_policy_loss


# ------------------------------------------------------------------------------------------ RIPO
def test_ripo_isometric_bounds_hand_values():
    from rlpost.algos.ripo import isometric_clip_bounds

    old = torch.log(torch.tensor([[0.05, 0.8, 1e-4]]))
    lo, hi = isometric_clip_bounds(old, 0.05, 0.05, 0.5, 10.0)
    # sqrt(0.05 / 0.05) = 1 -> floor 1 - 0.5; sqrt(0.05 / 0.8) = 0.25; sqrt(0.05 / 1e-4) = 22.4 -> caps 0.5 / 9
    assert torch.allclose(lo, torch.tensor([[0.5, 0.25, 0.5]]), atol=1e-5)
    assert torch.allclose(hi, torch.tensor([[1.0, 0.25, 9.0]]), atol=1e-5)
    lo, hi = isometric_clip_bounds(old, 0.05, 0.05, None, None)
    assert torch.allclose(old.exp() * hi ** 2, torch.full((1, 3), 0.05), rtol=1e-4)  # isometric: p eps^2 = delta
    for bad in (dict(delta_low=0.0), dict(ratio_min=1.0), dict(ratio_max=1.0)):
        kw = dict(delta_low=0.05, delta_high=0.05, ratio_min=0.5, ratio_max=10.0) | bad
        with pytest.raises(ValueError, match="ripo"):
            isometric_clip_bounds(old, **kw)


def test_ripo_loss_clips_likely_tokens_tighter_than_rare_ones():
    # two tokens, both ratio 1.5 with A = 1: the likely token (p_old 0.8, eps 0.25) is clipped (no gradient),
    # the rare one (p_old 0.05, eps 1) is not; PPO's single eps 0.2 clips both
    old = torch.log(torch.tensor([[0.8, 0.05]]))
    lp = (old + math.log(1.5)).clone().requires_grad_(True)
    x = PolicyLossInput(logprobs=lp, old_logprobs=old, advantages=torch.ones(1, 2), response_mask=torch.ones(1, 2))
    loss, m = compute_policy_loss("ripo", x)
    assert torch.allclose(loss.detach(), torch.tensor([[-1.25, -1.5]]), atol=1e-5)  # -A * min(r, 1 + eps)
    loss.sum().backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -1.5]]), atol=1e-5)  # d(-r)/dlogp = -r on the unclipped one
    assert float(m["clip_frac_high"]) == 0.5 and float(m["ripo/eps_high_mean"]) == pytest.approx(0.625, abs=1e-5)
    ppo, pm = compute_policy_loss("ppo_clip", x)
    assert float(pm["clip_frac_high"]) == 1.0
