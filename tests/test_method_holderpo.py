"""HölderPO (power-mean sequence ratio, arXiv:2605.12058) on hand-computed tensors: values, which tokens get
gradient, and the micro-batch invariance of the loss and its gradient. Moved unchanged from
tests/test_losses_fipo_holderpo_p3o_erc.py.
"""

import math

import pytest
import torch

from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from loss_split import grad_of, make, split_invariance  # noqa: E402  (tests/loss_split.py)




# --- HölderPO (arXiv:2605.12058) -----------------------------------------------------------------

@pytest.mark.parametrize("p,rho,drho", [
    # rho = (mean r^p)^(1/p); d rho / d log r_t = rho^(1-p) r_t^p / L, for r = [2, 0.5], L = 2
    (1.0, 1.25, [1.0, 0.25]),
    (2.0, math.sqrt(2.125), [4 / (2 * math.sqrt(2.125)), 0.25 / (2 * math.sqrt(2.125))]),
    (-2.0, 2.125 ** -0.5, [2.125 ** -1.5 * 0.25 / 2, 2.125 ** -1.5 * 4 / 2]),
    (0.0, 1.0, [0.5, 0.5]),  # geometric mean
])
def test_holderpo_power_mean_ratio_and_gradient_share_by_hand(p, rho, drho):
    x = make([[2.0, 0.5]], [[1.0, 1.0]])
    loss, g, met = grad_of("holderpo", x, schedule="constant", p=p, eps_low=0.9, eps_high=10.0)
    assert float(met["seq_ratio_mean"]) == pytest.approx(rho, rel=1e-5)
    assert torch.allclose(loss, torch.full((1, 2), -rho), atol=1e-5)  # the sequence loss on each token
    # both tokens carry the sequence loss, so the summed gradient is twice d(-rho)
    assert torch.allclose(g, -2 * torch.tensor([drho]), atol=1e-5)


def test_holderpo_sequence_clip_cuts_the_whole_sequence():
    # p = 2: rho = 1.458 > 1.2 with A > 0 -> loss -1.2, no gradient on any token
    loss, g, met = grad_of("holderpo", make([[2.0, 0.5]], [[1.0, 1.0]]), schedule="constant", p=2.0)
    assert torch.allclose(loss, torch.full((1, 2), -1.2)) and torch.equal(g, torch.zeros(1, 2))
    assert float(met["clip_frac_high"]) == pytest.approx(1.0)
    # p = -2: rho = 0.686 < 0.8 with A < 0 -> loss 0.8, no gradient; with A > 0 it is not clipped
    loss, g, _ = grad_of("holderpo", make([[2.0, 0.5]], [[-1.0, -1.0]]), schedule="constant", p=-2.0)
    assert torch.allclose(loss, torch.full((1, 2), 0.8)) and torch.equal(g, torch.zeros(1, 2))
    _, g, _ = grad_of("holderpo", make([[2.0, 0.5]], [[1.0, 1.0]]), schedule="constant", p=-2.0)
    assert bool((g < 0).all())


def test_holderpo_geometric_limit_equals_gspo_sequence_ratio():
    torch.manual_seed(0)
    r = torch.exp(torch.randn(3, 5) * 0.2)
    mask = [[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0]]
    _, _, m_h = grad_of("holderpo", make(r.tolist(), [[1.0] * 5] * 3, mask), schedule="constant", p=0.0)
    _, _, m_g = grad_of("gspo", make(r.tolist(), [[1.0] * 5] * 3, mask))
    assert float(m_h["seq_ratio_mean"]) == pytest.approx(float(m_g["seq_ratio_mean"]), rel=1e-6)


def test_holderpo_schedule_follows_the_training_step():
    from rlpost.algos.losses import holder_p

    kw = dict(p=1.0, p_min=-2.0, p_max=2.0, schedule_steps=500, power=2.0)
    assert [holder_p(s, "linear_dec", **kw) for s in (0, 125, 250, 500, 900)] == [2.0, 1.0, 0.0, -2.0, -2.0]
    assert holder_p(250, "cos", **kw) == pytest.approx(0.0, abs=1e-12)
    assert holder_p(125, "cubic", **kw) == pytest.approx(-0.25)  # mid + amp (2 * 0.25 - 1)^3 = 2 * -0.125
    assert holder_p(250, "poly", **kw) == pytest.approx(-1.0)  # -2 + 4 * 0.5^2
    assert holder_p(10, "constant", **kw) == 1.0
    # the loss reads PolicyLossInput.step: at step 250 of 500 the preset's schedule gives p = 0 (geometric)
    _, _, met = grad_of("holderpo", make([[2.0, 0.5]], [[1.0, 1.0]], step=250))
    assert float(met["holder_p"]) == pytest.approx(0.0) and float(met["seq_ratio_mean"]) == pytest.approx(1.0)
    _, _, met = grad_of("holderpo", make([[2.0, 0.5]], [[1.0, 1.0]]))  # no step: step 0, p = p_max
    assert float(met["holder_p"]) == pytest.approx(2.0)


# --- micro-batch invariance ----------------------------------------------------------------------

@pytest.mark.parametrize("name,agg,params", [
    ("holderpo", "seq-mean-token-mean", {}),
    ("holderpo", "token-mean", {"schedule": "constant", "p": -1.5}),
])
def test_micro_batch_split_gives_the_whole_batch_loss_and_gradient(name, agg, params):
    split_invariance(name, agg, **params)
