"""QUADS (trainer side): the straight-through weight's value and gradient, and trainer and rollout multiplying
identical weights. Moved unchanged from tests/test_rollout_self_spec_otr_hif4.py.
"""

import pytest
import torch

from rlpost.core.errors import ConfigError
from spec_helpers import _tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- QUADS (trainer side)
def test_ste_weight_value_and_gradient():
    from rlpost.rollout.precision import fake_quant_fp4_e2m1
    from rlpost.rollout.quads import ste_weight

    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    q = ste_weight(w, fake_quant_fp4_e2m1)
    assert torch.equal(q.detach(), fake_quant_fp4_e2m1(w.detach()))
    (q * torch.arange(32.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(32.0).expand(4, 32))  # straight through


def test_quads_trainer_and_rollout_multiply_identical_weights():
    """With the shared quantiser, a weights-only fp4 rollout copy and the QUADS trainer agree exactly."""
    import copy

    from omegaconf import OmegaConf

    from rlpost.rollout.precision import rollout_converter
    from rlpost.rollout.quads import apply_trainer_weight_quant, attach_weight_fake_quant

    model = _tiny_llama(4, sharpen=1.0)
    x = torch.tensor([[1, 2, 3, 4, 2]])
    rollout = rollout_converter("fp4_sim")(copy.deepcopy(model))
    lr = torch.log_softmax(rollout(input_ids=x).logits, -1)
    gap_plain = float((torch.log_softmax(model(input_ids=x).logits, -1) - lr).abs().max())
    trainer = copy.deepcopy(model)
    assert attach_weight_fake_quant(trainer, "fp4") == 14  # 2 layers x (q, k, v, o, gate, up, down)
    lt = torch.log_softmax(trainer(input_ids=x).logits, -1)
    assert gap_plain > 1e-3 and float((lt - lr).abs().max()) < 1e-5
    # master weights stay full precision, gradients reach them
    assert torch.equal(trainer.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    lt[0, -1, 1].backward()
    assert trainer.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
    # a rollout copy built from the patched trainer still holds Q(w) (idempotent quantiser)
    again = rollout_converter("fp4_w4a4_quads_sim")(copy.deepcopy(trainer))
    w = again.model.layers[1].self_attn.q_proj.weight
    from rlpost.rollout.precision import fake_quant_fp4_e2m1

    assert torch.equal(w, fake_quant_fp4_e2m1(model.model.layers[1].self_attn.q_proj.weight))
    cfg = OmegaConf.create({"precision": {"trainer_weight_quant": "fp4", "rollout_dtype": "hif4_w4a4_resq_sim"}})
    with pytest.raises(ConfigError, match="shares its weight quantiser"):
        apply_trainer_weight_quant(cfg, copy.deepcopy(model))
    with pytest.raises(ConfigError, match="trainer_weight_quant"):
        attach_weight_fake_quant(copy.deepcopy(model), "fp3")
