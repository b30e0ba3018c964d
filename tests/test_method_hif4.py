"""HiF4 low-precision rollouts: rounding and levels by hand, against block-32 FP4, and the rollout converters.
Moved unchanged from tests/test_rollout_self_spec_otr_hif4.py.
"""

import pytest
import torch
from spec_helpers import _tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- HiF4
def test_e6m2_round_up_hand_computed():
    from rlpost.rollout.hif4 import e6m2_round_up, hif4_bits_per_value

    got = e6m2_round_up(torch.tensor([1.0, 1.1, 1.76, 3.9, 0.0, 0.3]))
    # 1.1 -> 1.25; 1.76 -> 2; 3.9 -> 4; 0.3 = 2^-2 * 1.2 -> 2^-2 * 1.25
    assert got.tolist() == [1.0, 1.25, 2.0, 4.0, 0.0, 0.3125]
    assert hif4_bits_per_value() == 4.5


def test_hif4_three_levels_hand_computed():
    from rlpost.rollout.hif4 import fake_quant_hif4

    x = torch.zeros(1, 64)
    x[0, 0] = 1.75            # unit amax 1.75 -> base scale S = 1 (exact in E6M2)
    x[0, 1] = 0.6             # same 8-group as the max (e8 = 0), same 4-group (e16 = 0): step 0.25 -> 0.5
    x[0, 8] = 0.8             # 8-group amax 0.8 <= 0.875 -> e8 = 1 (scale 1/2); 4-group amax 0.8 > 0.4375 -> e16 = 0
    x[0, 9] = 0.3             # scale 0.5: 0.3 / 0.5 = 0.6 -> 0.5 -> 0.25
    x[0, 12] = 0.1            # 4-group {12..15} amax 0.1 <= 0.4375 -> e16 = 1, scale 1/4: 0.1 / 0.25 = 0.4 -> 0.5 -> 0.125
    x[0, 16] = -0.05          # 8-group amax 0.05 -> e8 = 1, e16 = 1, scale 1/4: -0.2 -> -0.25 -> -0.0625
    q = fake_quant_hif4(x)
    want = torch.zeros(1, 64)
    want[0, 0], want[0, 1], want[0, 8], want[0, 9], want[0, 12], want[0, 16] = 1.75, 0.5, 0.75, 0.25, 0.125, -0.0625
    assert torch.allclose(q, want), (q[0, :20], want[0, :20])
    # idempotent (a HiF4 tensor is on its own grid) and shape-preserving with padding
    assert torch.equal(fake_quant_hif4(q), q)
    y = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    assert fake_quant_hif4(y).shape == y.shape
    with pytest.raises(ValueError, match="multiple of 8"):
        fake_quant_hif4(y, group=12)


def test_hif4_beats_block32_fp4_on_gaussian_weights():
    """The micro-exponents buy resolution: lower relative MSE than e2m1 with a fp32 scale per 32 (19% here)."""
    from rlpost.rollout.hif4 import fake_quant_hif4
    from rlpost.rollout.precision import fake_quant_fp4_e2m1

    x = torch.randn(128, 1024, generator=torch.Generator().manual_seed(0))
    mse = lambda f: float(((f(x) - x) ** 2).mean() / (x ** 2).mean())  # noqa: E731
    assert mse(fake_quant_hif4) < 0.9 * mse(fake_quant_fp4_e2m1)


def test_hif4_rollout_converters():
    from rlpost.rollout.hif4 import fake_quant_hif4
    from rlpost.rollout.precision import rollout_converter, w4a4_activation

    m = _tiny_llama(3, sharpen=1.0)
    w = m.model.layers[0].mlp.up_proj.weight.detach().clone()
    c = rollout_converter("hif4_sim")(__import__("copy").deepcopy(m))
    assert torch.equal(c.model.layers[0].mlp.up_proj.weight, fake_quant_hif4(w))
    assert torch.equal(c.lm_head.weight, m.lm_head.weight)  # the LM head stays full precision
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(w4a4_activation(x, "none", quant=fake_quant_hif4), fake_quant_hif4(x))
    # ResQ's sparse residual on top of HiF4 activations lowers their error
    e0 = (x - w4a4_activation(x, "none", quant=fake_quant_hif4)).abs().sum()
    e1 = (x - w4a4_activation(x, "resq", quant=fake_quant_hif4)).abs().sum()
    assert float(e1) < float(e0)
    for name in ("hif4_w4a4_sim", "hif4_w4a4_resq_sim"):
        out = rollout_converter(name)(__import__("copy").deepcopy(m))(input_ids=torch.tensor([[1, 2, 3]])).logits
        assert torch.isfinite(out).all()
