"""Simulated W4A4 fp4 rollouts and their QUADS / Rollout-ResQ compensations."""

import pytest
import torch

from rlpost.rollout.precision import RESQ_GROUP, fake_quant_fp4_e2m1, rollout_converter, w4a4_activation


def test_w4a4_activation_compensations():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    x[:, 7] *= 20  # an outlier channel stretches its block's range
    q = w4a4_activation(x, "none")
    assert torch.equal(q, fake_quant_fp4_e2m1(x))
    e_none = (x - q).abs()
    quads = w4a4_activation(x, "quads")
    # ceil(64/32) = 2 channels restored exactly: the two with the largest mean error
    exact = ((x - quads).abs() < 1e-7).all(0)
    top2 = e_none.mean(0).topk(2).indices
    assert bool(exact[top2].all())
    assert float((x - quads).abs().sum()) < float(e_none.sum())
    resq = w4a4_activation(x, "resq")
    d = (x - resq).abs().reshape(5, -1, RESQ_GROUP)
    # per token and group of 16, the largest-error entry is restored; the rest keep Q(x)'s error
    en = e_none.reshape(5, -1, RESQ_GROUP)
    assert bool((d.gather(-1, en.argmax(-1, keepdim=True)) < 1e-7).all())
    assert torch.allclose(d.sum(-1), en.sum(-1) - en.max(-1).values, atol=1e-5)
    with pytest.raises(ValueError, match="compensation"):
        w4a4_activation(x, "other")


def test_w4a4_converters_order_the_mismatch():
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4)).eval()
    with torch.no_grad():  # activation outliers, as in trained LLMs
        m.model.embed_tokens.weight[:, 3] *= 30
    ids = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = torch.log_softmax(m(input_ids=ids).logits, -1)
    gap = {}
    for name in ("fp4_sim", "fp4_w4a4_sim", "fp4_w4a4_quads_sim", "fp4_w4a4_resq_sim"):
        c = rollout_converter(name)(copy.deepcopy(m))
        with torch.no_grad():
            lp = torch.log_softmax(c(input_ids=ids).logits, -1)
        gap[name] = float((lp.exp() * (lp - ref)).sum(-1).mean())  # KL(rollout || trainer)
    assert gap["fp4_w4a4_sim"] > gap["fp4_sim"] > 0, gap  # activations add to the weight error
    assert gap["fp4_w4a4_quads_sim"] < gap["fp4_w4a4_sim"], gap
    assert gap["fp4_w4a4_resq_sim"] < gap["fp4_w4a4_sim"], gap
