"""FIPO (future-KL token weights, arXiv:2603.19835) on hand-computed tensors: values, which tokens get
gradient, and the micro-batch invariance of the loss and its gradient. Moved unchanged from
tests/test_losses_fipo_holderpo_p3o_erc.py.
"""

import math

import pytest
import torch

from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from loss_split import grad_of, make, split_invariance  # noqa: E402  (tests/loss_split.py)




# --- FIPO (arXiv:2603.19835) ---------------------------------------------------------------------

def test_fipo_future_kl_discounted_sum_by_hand():
    from rlpost.algos.losses import future_kl

    d = torch.log(torch.tensor([[2.0, 0.5]]))
    # gamma = 0.5: F_0 = log 2 + 0.5 log 0.5 = 0.5 log 2 (weight sqrt 2), F_1 = log 0.5
    F = future_kl(d, torch.ones(1, 2), 0.5)
    assert torch.allclose(torch.exp(F), torch.tensor([[math.sqrt(2.0), 0.5]]), atol=1e-6)
    # a masked position neither contributes nor receives: F_0 = log 2 + 0.25 log 0.5
    d3 = torch.log(torch.tensor([[2.0, 7.0, 0.5]]))
    F3 = future_kl(d3, torch.tensor([[1.0, 0.0, 1.0]]), 0.5)
    assert torch.allclose(F3, torch.tensor([[0.75 * math.log(2.0), 0.0, math.log(0.5)]]), atol=1e-6)


def test_fipo_weights_scale_the_clipped_surrogate_by_hand():
    # r = [2, 0.5, 1.1], A = +1, gamma = 2^(-1/1) = 0.5, weights unclipped:
    # f_2 = 1.1, f_1 = 0.5 * 1.1^0.5, f_0 = 2 * 0.5^0.5 * 1.1^0.25
    f = [2 * 0.5 ** 0.5 * 1.1 ** 0.25, 0.5 * 1.1 ** 0.5, 1.1]
    x = make([[2.0, 0.5, 1.1]], [[1.0, 1.0, 1.0]])
    loss, g, met = grad_of("fipo", x, decay_rate=1.0, weight_clip=None, dual_clip=None, safety_threshold=None)
    # DAPO clip 0.2 / 0.28: token 0 (r = 2 > 1.28, A > 0) is clipped: value -1.28 f_0, no gradient
    assert torch.allclose(loss, torch.tensor([[-1.28 * f[0], -0.5 * f[1], -1.1 * f[2]]]), atol=1e-5)
    assert torch.allclose(g, torch.tensor([[0.0, -0.5 * f[1], -1.1 * f[2]]]), atol=1e-5)
    assert float(met["fipo_weight_mean"]) == pytest.approx(sum(f) / 3, abs=1e-5)
    # the script's two-sided weight clip [0.8, 1.2]; high-only [1, 1.2] lifts f_1 to 1
    _, g2, _ = grad_of("fipo", make([[2.0, 0.5, 1.1]], [[1.0] * 3]), decay_rate=1.0, dual_clip=None, safety_threshold=None)
    assert torch.allclose(g2, torch.tensor([[0.0, -0.5 * 0.8, -1.1 * 1.1]]), atol=1e-5)
    _, g3, _ = grad_of("fipo", make([[2.0, 0.5, 1.1]], [[1.0] * 3]), decay_rate=1.0, dual_clip=None,
                       safety_threshold=None, weight_clip_high_only=True)
    assert torch.allclose(g3, torch.tensor([[0.0, -0.5 * 1.0, -1.1 * 1.1]]), atol=1e-5)


def test_fipo_on_policy_is_dapo():
    x = make([[1.0, 1.0, 1.0]], [[1.0, -1.0, 0.5]])
    loss, g, met = grad_of("fipo", x)
    y = make([[1.0, 1.0, 1.0]], [[1.0, -1.0, 0.5]])
    loss_d, g_d, _ = grad_of("ppo_clip", y, eps_high=0.28)
    assert torch.allclose(loss, loss_d) and torch.allclose(g, g_d)
    assert float(met["fipo_weight_mean"]) == pytest.approx(1.0)


def test_fipo_dual_clip_filter_and_safety_rule_with_script_defaults():
    # A = -1, r = [4, 20]. Token 1 (r = 20 > delta = 10) leaves the future sum and is dual-clipped
    # (value 10, no gradient). F_0 = log 4 -> weight 4, clipped to 1.2, and since A < 0 and r = 4 > 3
    # the safety rule caps it to [0.8, 1] -> 1.0: gradient -A r f = 4.
    x = make([[4.0, 20.0]], [[-1.0, -1.0]])
    loss, g, met = grad_of("fipo", x)
    assert torch.allclose(loss, torch.tensor([[4.0, 10.0]]), atol=1e-5)
    assert torch.allclose(g, torch.tensor([[4.0, 0.0]]), atol=1e-5)
    assert float(met["fipo_safety_frac"]) == pytest.approx(1.0)
    assert float(met["fipo_future_kl"]) == pytest.approx(math.log(4.0) / 2, abs=1e-5)
    # without the safety rule the weight 1.2 amplifies the penalty
    _, g2, _ = grad_of("fipo", make([[4.0, 20.0]], [[-1.0, -1.0]]), safety_threshold=None)
    assert torch.allclose(g2, torch.tensor([[4.8, 0.0]]), atol=1e-5)


def test_fipo_rejects_bad_parameters():
    with pytest.raises(ValueError, match="decay_rate"):
        compute_policy_loss("fipo", make([[1.0]], [[1.0]]), decay_rate=0.0)
    with pytest.raises(ValueError, match="weight_clip"):
        compute_policy_loss("fipo", make([[1.0]], [[1.0]]), weight_clip=1.5)


# --- micro-batch invariance ----------------------------------------------------------------------

@pytest.mark.parametrize("name,agg,params", [
    ("fipo", "token-mean", {}),
    ("fipo", "seq-mean-token-mean", {"decay_rate": 2.0}),
])
def test_micro_batch_split_gives_the_whole_batch_loss_and_gradient(name, agg, params):
    split_invariance(name, agg, **params)
