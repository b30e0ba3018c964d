"""FP8-RL's rollout stack (arXiv:2601.18150): blockwise W8A8, the fp8 KV cache with per-step scale
recalibration, the vLLM settings, and one tiny-model step of each preset (rlpost/rollout/fp8_stack.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import tiny_overrides  # noqa: E402


# ---- (i) blockwise W8A8, hand-computed on small tensors ------------------------------------------

def test_blockwise_weight_quant_hand_computed():
    """A 2x3 weight in 2x2 blocks: block 1 (amax 2) and the partial block 2 (amax 0.0205) have their own scales.

    Block 1: s = 2/448; w/s = 224, 67.2, -448, 112; e4m3 (3 mantissa bits, step 8 in [64, 128)) keeps
    224, -448 and 112 and rounds 67.2 to 64, i.e. 0.3 -> 64 * 2/448 = 0.285714...
    Block 2: s = 0.0205/448; 0.01/s = 218.54 -> 224 (step 16 in [128, 256)) -> 224 * 0.0205/448 = 0.01025.
    """
    from rlpost.rollout.fp8_stack import fake_quant_fp8_blockwise

    w = torch.tensor([[1.0, 0.3, 0.01], [-2.0, 0.5, 0.0205]])
    q = fake_quant_fp8_blockwise(w, (2, 2))
    want = torch.tensor([[1.0, 64 * 2 / 448, 0.01025], [-2.0, 0.5, 0.0205]])
    torch.testing.assert_close(q, want, rtol=1e-6, atol=0)
    # one block over the whole matrix: a single scale (2/448) for all, so 0.01 -> 0.01/s = 2.24 -> 2.25
    q1 = fake_quant_fp8_blockwise(w, (128, 128))
    assert float(q1[0, 2]) == pytest.approx(2.25 * 2 / 448, rel=1e-6)


def test_blockwise_invariants():
    """Blocks of one row are the per-row fp8_sim; a zero block stays zero; the block max is exact; on the e4m3 grid."""
    from rlpost.rollout.fp8_stack import fake_quant_fp8_blockwise
    from rlpost.rollout.precision import fake_quant_fp8_e4m3

    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 10, generator=g) * torch.logspace(-2, 1, 6)[:, None]
    torch.testing.assert_close(fake_quant_fp8_blockwise(w, (1, 10)), fake_quant_fp8_e4m3(w), rtol=0, atol=0)
    w[:3, :4] = 0
    q = fake_quant_fp8_blockwise(w, (3, 4))
    assert torch.equal(q[:3, :4], torch.zeros(3, 4))
    blk = w[3:6, 4:8]
    scale = blk.abs().max() / 448
    assert float(q[3:6, 4:8].abs().max()) == pytest.approx(float(blk.abs().max()), rel=1e-6)
    x = q[3:6, 4:8] / scale
    torch.testing.assert_close(x.to(torch.float8_e4m3fn).float(), x, rtol=1e-6, atol=0)
    assert (q != w).float().mean() > 0.3  # it really rounds
    with pytest.raises(ValueError, match="2-D"):
        fake_quant_fp8_blockwise(torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match=">= 1"):
        fake_quant_fp8_blockwise(w, (0, 4))


def test_activation_token_group_quant_hand_computed():
    """Per token, groups of 2 inputs; a zero token stays zero.

    Group [1.0, 0.3]: s = 1/448, 0.3/s = 134.4 -> 128 (step 16 in [128, 256)) -> 128/448. Group [0.01, 0.0205]:
    as the weight case's second block, 0.01 -> 0.01025.
    """
    from rlpost.rollout.fp8_stack import fake_quant_fp8_token_groups

    x = torch.tensor([[[1.0, 0.3, 0.01, 0.0205], [0.0, 0.0, 0.0, 0.0]]])  # [batch 1, tokens 2, in 4]
    q = fake_quant_fp8_token_groups(x, 2)
    want = torch.tensor([[[1.0, 128 / 448, 0.01025, 0.0205], [0.0, 0.0, 0.0, 0.0]]])
    torch.testing.assert_close(q, want, rtol=1e-6, atol=0)
    # tokens are independent: scaling one token scales its quantised value exactly (power of two)
    y = x.clone()
    y[0, 1] = x[0, 0] * 4
    qy = fake_quant_fp8_token_groups(y, 2)
    torch.testing.assert_close(qy[0, 1], q[0, 0] * 4, rtol=0, atol=0)
    torch.testing.assert_close(qy[0, 0], q[0, 0], rtol=0, atol=0)
    # a ragged last group (in=3, group=2) and group=in being the per-row rounding
    from rlpost.rollout.precision import fake_quant_fp8_e4m3

    z = torch.randn(5, 3)
    torch.testing.assert_close(fake_quant_fp8_token_groups(z, 3), fake_quant_fp8_e4m3(z), rtol=0, atol=0)
    assert fake_quant_fp8_token_groups(z, 2).shape == (5, 3)
    with pytest.raises(ValueError, match=">= 1"):
        fake_quant_fp8_token_groups(z, 0)


def test_w8a8_converter_rounds_weights_and_inputs_of_decoder_linears_only():
    from rlpost.rollout.fp8_stack import Fp8BlockwiseParams, blockwise_w8a8_converter, fake_quant_fp8_blockwise, \
        fake_quant_fp8_token_groups

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3, bias=False)
            self.head = torch.nn.Linear(3, 2, bias=False)

        def get_output_embeddings(self):
            return self.head

        def forward(self, x):
            return self.head(self.lin(x))

    torch.manual_seed(0)
    m = M()
    w0, h0 = m.lin.weight.detach().clone(), m.head.weight.detach().clone()
    blockwise_w8a8_converter(Fp8BlockwiseParams(weight_block=[2, 2], act_group=2))(m)
    torch.testing.assert_close(m.lin.weight, fake_quant_fp8_blockwise(w0, (2, 2)), rtol=0, atol=0)
    assert torch.equal(m.head.weight, h0)  # the LM head is not quantised
    x = torch.randn(2, 4)
    want = fake_quant_fp8_token_groups(x, 2) @ m.lin.weight.T
    torch.testing.assert_close(m.lin(x), want, rtol=1e-6, atol=1e-7)


# ---- (ii) fp8 KV cache: scales, rounding, recalibration ------------------------------------------

def test_kv_sim_scales_and_rounding_hand_computed():
    """s_q = amax|Q|/200, s_k = amax|K|/200, s_v = amax|V|/100 (vLLM calculate_kv_scales); x -> e4m3(x/s)*s.

    Q: amax 2 -> s 0.01; 0.67/0.01 = 67 -> 64 (step 8 in [64, 128)) -> 0.64. K: amax 4 -> 0.02; 0.3/0.02 = 15
    (exact in [8, 16)). V: amax 1 -> 0.01; 0.337/0.01 = 33.7 -> 32 (step 4 in [32, 64)) -> 0.32. The amax itself
    maps to 200 (Q, K) or 100 (V), halfway between two e4m3 values: within 2^-4 of itself.
    """
    from rlpost.rollout.fp8_stack import Fp8KvCacheSim

    seen = {}

    def base(module, q, k, v, *a, **kw):
        seen.update(q=q, k=k, v=v)
        return "out"

    sim = Fp8KvCacheSim()
    mod = type("Attn", (), {"layer_idx": 0})()
    q = torch.tensor([0.67, -2.0]).view(1, 1, 2, 1)
    k = torch.tensor([0.3, 4.0]).view(1, 1, 2, 1)
    v = torch.tensor([0.337, 1.0]).view(1, 1, 2, 1)
    assert sim.attend(base, mod, q, k, v) == "out"
    assert sim.scales[0] == pytest.approx((0.01, 0.02, 0.01))
    assert float(seen["q"].flatten()[0]) == pytest.approx(0.64, rel=1e-6)
    assert float(seen["k"].flatten()[0]) == pytest.approx(0.3, rel=1e-6)
    assert float(seen["v"].flatten()[0]) == pytest.approx(0.32, rel=1e-6)
    for got, amax in ((seen["q"], 2.0), (seen["k"], 4.0), (seen["v"], 1.0)):
        assert abs(abs(float(got.flatten()[1])) - amax) <= amax * 2.0**-4 + 1e-6
    # later calls keep the calibration: a key 100x larger saturates at 448 * s_k = 8.96
    sim.attend(base, mod, q, k * 100, v)
    assert float(seen["k"].max()) == pytest.approx(448 * 0.02)
    # rounding the rounded cache again with the same scale is the identity (an fp8 cache read back)
    kk = seen["k"]
    torch.testing.assert_close(sim.quantize(kk, 0.02), kk, rtol=0, atol=0)
    assert sim.calibrations == 1
    sim.reset()
    sim.attend(base, mod, q, k * 2, v)
    assert sim.scales[0][1] == pytest.approx(0.04) and sim.calibrations == 2


def _tiny_engine(*extra):
    from rlpost.config.compose import compose_config
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine

    cfg = compose_config(tiny_overrides("precision=rollout_fp8_blockwise_sim", *extra))
    model, tok = load_policy(ModelConfig(source="tiny"), seed=11)
    return build_engine(EngineConfig.of(cfg), model, tok, torch.device("cpu")), model, tok


@pytest.mark.parametrize("mode", ["per_step", "once"])
def test_scales_recalibrate_after_the_weights_change(mode):
    """per_step: after a sync with layer 0's k_proj doubled, layer 0's key scale doubles (its input, the
    normed embeddings, is unchanged); once: the first calibration is kept."""
    from rlpost.rollout.base import SamplingParams

    eng, model, tok = _tiny_engine(f"+precision.kv_cache_params.recalibrate={mode}")
    sim = eng.convert.kv_sim
    prompts = [tok("What is 3+4?")["input_ids"]] * 2
    eng.generate(prompts, SamplingParams(max_new_tokens=3, seed=1))
    s0 = sim.scales[0]
    assert len(sim.scales) == model.config.num_hidden_layers and sim.calibrations == 1
    eng.generate(prompts, SamplingParams(max_new_tokens=3, seed=1))
    assert sim.scales[0] == s0 and sim.calibrations == 1  # no recalibration without a sync
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(2.0)
    eng.sync_weights(model)
    torch.testing.assert_close(eng.model.model.layers[0].self_attn.k_proj.weight,
                               2 * _requant(model.model.layers[0].self_attn.k_proj.weight / 2), rtol=0, atol=0)
    eng.generate(prompts, SamplingParams(max_new_tokens=3, seed=1))
    if mode == "per_step":
        assert sim.calibrations == 2
        assert sim.scales[0][1] == pytest.approx(2 * s0[1], rel=1e-5)
        assert sim.scales[0][0] == pytest.approx(s0[0], rel=1e-6)  # q_proj unchanged
    else:
        assert sim.calibrations == 1 and sim.scales[0] == s0


def _requant(w):
    from rlpost.rollout.fp8_stack import fake_quant_fp8_blockwise

    return fake_quant_fp8_blockwise(w, (128, 128))


def test_stack_rollouts_have_a_mismatch_and_leave_the_trainer_alone():
    """The simulated stack moves rollout log-probs off the fp32 trainer's; the kv cache adds to the W8A8 gap;
    the trainer's weights and attention implementation are untouched."""
    from rlpost.models.logprobs import response_logprobs
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.precision import mismatch_metrics

    gaps = {}
    for kv in ("fp8", "none"):
        eng, model, tok = _tiny_engine(f"precision.kv_cache={kv}")
        before = {k: v.clone() for k, v in model.state_dict().items()}
        impl = model.config._attn_implementation
        prompts = [tok(p)["input_ids"] for p in ["What is 3+4?", "Name a prime", "Hello there"]] * 2
        gen = eng.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0, seed=3))
        with torch.no_grad():
            lp, _ = response_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.response_ids,
                                      (gen.response_mask > 0).long(), temperature=gen.temperatures)
        gaps[kv] = mismatch_metrics(gen.rollout_logprobs, lp, gen.response_mask)["mismatch/logprob_abs_mean"]
        assert model.config._attn_implementation == impl
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k
    assert gaps["none"] > 1e-4 and gaps["fp8"] > 1e-4, gaps


# ---- config checks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("over, match", [
    (["+precision.rollout_params.weight_blok=[64,64]"], "weight_blok"),
    (["+precision.rollout_params.weight_block=[0,128]"], "weight_block"),
    (["+precision.rollout_params.act_group=0"], "act_group"),
    (["precision=rollout_fp8_sim", "+precision.rollout_params.act_group=64"], "takes none"),
    (["precision.kv_cache=fp9"], "valid choices"),
    (["precision=rollout_fp8_sim", "+precision.kv_cache_params.quantize_q=false"], "kv_cache=none"),
    (["+precision.kv_cache_params.recalibrate=sometimes"], "recalibrate"),
    (["+precision.kv_cache_params.k_range=0"], "k_range"),
    (["precision=rollout_fp8_blockwise"], "rollout=vllm"),
    (["precision=rollout_fp8_blockwise", "rollout=vllm", "+precision.rollout_params.weight_block=[64,64]"],
     "fixed 128x128"),
])
def test_bad_settings_are_config_errors(compose, over, match):
    from rlpost.config.compose import validate_config
    from rlpost.core.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        validate_config(compose(tiny_overrides("precision=rollout_fp8_blockwise_sim", *over)))


def test_presets_validate_and_keep_the_paper_defaults(compose):
    from rlpost.config.compose import validate_config
    from rlpost.rollout.fp8_stack import rollout_settings

    cfg = compose(tiny_overrides("precision=rollout_fp8_blockwise_sim"))
    validate_config(cfg)
    p, kv, kvp = rollout_settings(cfg.precision)
    assert list(p.weight_block) == [128, 128] and p.act_group == 128 and kv == "fp8"
    assert (kvp.q_range, kvp.k_range, kvp.v_range, kvp.quantize_q) == (200.0, 200.0, 100.0, True)
    assert cfg.precision.correction == "tis" and cfg.precision.correction_params.cap == 2.0
    validate_config(compose(tiny_overrides("precision=rollout_fp8_blockwise", "rollout=vllm")))


# ---- (iii) vLLM settings --------------------------------------------------------------------------

def test_vllm_kwargs_mapping():
    from omegaconf import OmegaConf

    from rlpost.core.errors import RlpostError
    from rlpost.rollout.fp8_stack import online_fp8_name, vllm_fp8_kwargs

    def prec(rd, kv="none"):
        return OmegaConf.create({"rollout_dtype": rd, "kv_cache": kv, "rollout_params": {}, "kv_cache_params": {}})

    new = (["fp8", "fp8_per_tensor", "fp8_per_block"], ["cache_dtype"], ["auto", "fp8", "fp8_per_token_head"])
    old = (["fp8", "fp8_per_block"], ["cache_dtype", "calculate_kv_scales"], ["auto", "fp8"])
    assert vllm_fp8_kwargs(prec("bf16"), "cuda", *new) == {}
    assert vllm_fp8_kwargs(prec("fp8"), "cpu", *new) == {}  # the per-tensor fp8 path is engine_kwargs' own
    assert vllm_fp8_kwargs(prec("fp8_blockwise", "fp8"), "cuda", *old) == {
        "quantization": "fp8_per_block", "kv_cache_dtype": "fp8", "calculate_kv_scales": True}
    assert vllm_fp8_kwargs(prec("fp8_blockwise", "fp8"), "cuda", *new) == {
        "quantization": "fp8_per_block", "kv_cache_dtype": "fp8_per_token_head"}
    assert vllm_fp8_kwargs(prec("fp8", "fp8"), "cuda", *old) == {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}
    assert vllm_fp8_kwargs(prec("fp8_blockwise"), "cuda", *new) == {"quantization": "fp8_per_block"}
    # per-tensor fp8 quantised online from the bf16 checkpoint: vLLM 0.32's shorthand, else the old name
    assert online_fp8_name(new[0]) == "fp8_per_tensor" and online_fp8_name(old[0]) == "fp8"
    assert online_fp8_name([]) == "fp8"
    with pytest.raises(RlpostError, match="CUDA GPU"):
        vllm_fp8_kwargs(prec("bf16", "fp8"), "cpu", *old)
    with pytest.raises(RlpostError, match="fp8_per_block"):
        vllm_fp8_kwargs(prec("fp8_blockwise"), "cuda", ["fp8"], [], [])
    with pytest.raises(RlpostError, match="neither"):
        vllm_fp8_kwargs(prec("bf16", "fp8"), "cuda", ["fp8"], ["cache_dtype"], ["auto", "fp8"])


def test_rearm_kv_scales_sets_the_flag_on_attention_layers():
    from rlpost.rollout.vllm import rearm_kv_scales

    m = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    m[1].calculate_kv_scales = False
    assert rearm_kv_scales(m) == 1 and m[1].calculate_kv_scales is True and not hasattr(m[0], "calculate_kv_scales")


def test_vllm_engine_passes_the_stack_and_rearms_scales_after_a_push(compose, monkeypatch, tmp_path):
    """With a fake vLLM: fp8_per_block + fp8 KV cache with calculate_kv_scales at construction, pushes go
    through the worker reload, and each push re-arms the scale calibration."""
    import rlpost.rollout.fp8_stack as fs
    import rlpost.rollout.vllm as rv
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine
    from test_vllm import _fake_vllm, _kinds

    calls = []
    _fake_vllm(monkeypatch, calls)
    monkeypatch.setattr(fs, "vllm_features", lambda: (["fp8", "fp8_per_block"], ["calculate_kv_scales"], ["fp8"]))
    monkeypatch.setattr(rv, "rearm_kv_scales", lambda model: calls.append(("rearm",)))
    cfg = compose(tiny_overrides("rollout=vllm", "precision=rollout_fp8_blockwise", f"model.cache_dir={tmp_path}"))
    model, tok = load_policy(ModelConfig(source="tiny"), seed=0)
    eng = build_engine(EngineConfig.of(cfg), model, tok, torch.device("cpu"))
    init = calls[0][1]
    assert init["quantization"] == "fp8_per_block" and init["kv_cache_dtype"] == "fp8"
    assert init["calculate_kv_scales"] is True and init["dtype"] == "bfloat16"
    assert eng.push_method == "reload_weights"
    calls.clear()
    eng.sync_weights(model)
    assert _kinds(calls) == ["rpc('reload_weights',)", "rearm", "reset_prefix_cache"]


# ---- one step of the preset on the tiny model -----------------------------------------------------

def test_one_step_tiny_with_the_preset(compose, tmp_path):
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("precision=rollout_fp8_blockwise_sim", "steps=1", "eval.at_end=false",
                                 "eval.every=0", "checkpoint.every=0"))
    train(cfg, tmp_path / "f")
    rows = [json.loads(x) for x in (tmp_path / "f" / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["step"] == 1
    assert rows[-1]["mismatch/logprob_abs_mean"] > 0
