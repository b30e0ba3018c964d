"""Rollout precision: fake-quantization grids, a real fp8-sim mismatch that TIS/MIS/CIS bound, bf16 vs fp32 trainer."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_overrides


def test_fp8_e4m3_fake_quant_is_on_grid_and_within_half_ulp():
    from rlpost.rollout.precision import fake_quant_fp8_e4m3

    w = torch.randn(16, 64) * torch.logspace(-2, 1, 16)[:, None]
    q = fake_quant_fp8_e4m3(w)
    scale = w.abs().amax(1, keepdim=True) / 448.0
    # every value is exactly representable in e4m3 after scaling
    x = q / scale
    torch.testing.assert_close(x.to(torch.float8_e4m3fn).float(), x, rtol=1e-6, atol=0)
    # relative error of normal numbers <= 2^-4 (3 mantissa bits, round to nearest)
    normal = (w / scale).abs() >= 2.0**-6
    rel = ((q - w).abs() / w.abs())[normal]
    assert rel.max() <= 2.0**-4 + 1e-6
    assert (q != w).float().mean() > 0.5  # it really rounds
    torch.testing.assert_close(q.abs().amax(1), w.abs().amax(1), rtol=1e-6, atol=0)  # row max -> 448


def test_fp4_e2m1_fake_quant_uses_eight_magnitudes_per_block():
    from rlpost.rollout.precision import fake_quant_fp4_e2m1

    w = torch.randn(4, 70)  # 70 = 2 full blocks of 32 + a ragged one
    q = fake_quant_fp4_e2m1(w)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    for r in range(4):
        for s in range(0, 70, 32):
            blk, qb = w[r, s:s + 32], q[r, s:s + 32]
            scale = blk.abs().max() / 6.0
            mags = (qb.abs() / scale)
            assert torch.all((mags[:, None] - grid).abs().min(1).values < 1e-5)
            # nearest grid point: error at most half the widest gap (1.0) times the scale
            assert ((qb - blk).abs() <= 1.0 * scale + 1e-6).all()
    assert len(torch.unique(q[0, :32].abs())) <= 8


def test_mismatch_metrics_hand_computed():
    from rlpost.rollout.precision import mismatch_metrics

    r = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]])
    t = torch.tensor([[math.log(0.25), math.log(0.25), 5.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    out = mismatch_metrics(r, t, m)
    assert out["mismatch/logprob_abs_mean"] == pytest.approx(math.log(2) / 2)
    assert out["mismatch/logprob_abs_max"] == pytest.approx(math.log(2))
    # weights 0.5 and 1: ESS = 1.5^2 / 1.25 = 1.8 of 2 tokens
    assert out["mismatch/is_ess_frac"] == pytest.approx(0.9)
    assert out["mismatch/is_weight_max"] == pytest.approx(1.0)
    same = mismatch_metrics(r, r, m)
    assert same["mismatch/logprob_abs_max"] == 0.0 and same["mismatch/is_ess_frac"] == pytest.approx(1.0)
    assert same["mismatch/prob_corr"] == pytest.approx(1.0)


@pytest.fixture(scope="module")
def fp8_rollouts():
    """Rollouts from an fp8-sim copy of the tiny model and the fp32 trainer's log-probs of the same tokens."""
    from rlpost.config.compose import compose_config
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import response_logprobs
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.rollout.base import SamplingParams

    cfg = compose_config(tiny_overrides("precision=rollout_fp8_sim"))
    model, tok = load_policy(ModelConfig(source="tiny"), seed=11)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eng = build_engine(EngineConfig.of(cfg), model, tok, torch.device("cpu"))
    prompts = [tok(p)["input_ids"] for p in ["What is 3+4?", "Name a prime", "Hello there", "Count to five"]] * 4
    gen = eng.generate(prompts, SamplingParams(max_new_tokens=16, temperature=1.0, seed=3))
    with torch.no_grad():
        lp, _ = response_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.response_ids,
                                  (gen.response_mask > 0).long(), temperature=gen.temperatures)
    for k, v in model.state_dict().items():  # the trainer's weights were not touched
        assert torch.equal(v, before[k]), k
    return gen, lp


def test_fp8_sim_rollouts_have_a_real_mismatch(fp8_rollouts):
    from rlpost.rollout.precision import mismatch_metrics

    gen, lp = fp8_rollouts
    mm = mismatch_metrics(gen.rollout_logprobs, lp, gen.response_mask)
    assert mm["mismatch/logprob_abs_mean"] > 1e-3  # fp32 vs fp32 is ~1e-7 (tests/test_runner.py)
    assert mm["mismatch/prob_corr"] < 1.0 and mm["mismatch/is_ess_frac"] < 1.0


def test_tis_mis_cis_bound_the_fp8_mismatch_weights(fp8_rollouts):
    from rlpost.algos.corrections import cis, cis_cap, mis, tis

    gen, lp = fp8_rollouts
    m = gen.response_mask
    raw = torch.exp(lp - gen.rollout_logprobs)[m > 0]
    # caps just inside the observed spread, so each correction visibly acts
    hi = float(raw.max())
    cap = 1.0 + (hi - 1.0) / 2
    assert hi > cap > 1.0
    w, _ = tis(lp, gen.rollout_logprobs, m, cap=cap)
    assert float(w[m > 0].max()) <= cap + 1e-6 and float((w[m > 0] == cap).float().sum()) >= 1
    lo = min(0.999, float(raw.min()) + (1.0 - float(raw.min())) / 2)
    w, met = mis(lp, gen.rollout_logprobs, m, lo=lo, hi=cap)
    kept = w[m > 0]
    assert torch.all((kept == 0) | ((kept >= lo - 1e-6) & (kept <= cap + 1e-6)))
    assert float(met["frac_masked"]) > 0
    thr = math.log(cap)
    w, _ = cis(lp, gen.rollout_logprobs, m, threshold=thr)
    bound = cis_cap(gen.rollout_logprobs, thr)
    assert torch.all(w[m > 0] <= bound[m > 0] + 1e-6)
    assert torch.all(w[m > 0] <= cap + 1e-6)  # and never above e^threshold


def test_int8_and_fp4_rollout_engines_generate_with_a_mismatch():
    from rlpost.config.compose import compose_config
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import response_logprobs
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.precision import mismatch_metrics

    model, tok = load_policy(ModelConfig(source="tiny"), seed=5)
    prompts = [tok("What is 2+2?")["input_ids"], tok("Hi")["input_ids"]] * 2
    gaps = {}
    for preset in ("rollout_int8_sim", "rollout_fp4_sim"):
        eng = build_engine(EngineConfig.of(compose_config(tiny_overrides(f"precision={preset}"))), model, tok, torch.device("cpu"))
        gen = eng.generate(prompts, SamplingParams(max_new_tokens=8, seed=1))
        with torch.no_grad():
            lp, _ = response_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.response_ids,
                                      (gen.response_mask > 0).long(), temperature=gen.temperatures)
        gaps[preset] = mismatch_metrics(gen.rollout_logprobs, lp, gen.response_mask)["mismatch/logprob_abs_mean"]
    assert gaps["rollout_int8_sim"] > 1e-4 and gaps["rollout_fp4_sim"] > 1e-3, gaps


def test_unknown_or_gpu_only_rollout_dtype_is_a_clear_error():
    from rlpost.core.errors import ConfigError
    from rlpost.rollout.precision import rollout_converter

    with pytest.raises(ConfigError, match="rollout=vllm"):
        rollout_converter("fp8")
    with pytest.raises(ConfigError, match="Valid choices"):
        rollout_converter("fp3")


def test_bf16_trainer_loss_and_update_within_tolerance_of_fp32(compose):
    """Same batch, same weights: bf16 autocast (fp32 master weights) tracks fp32."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_worker import make_batch

    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    out = {}
    old = None
    for prec in ("fp32", "bf16"):
        cfg = compose(tiny_overrides(f"precision={prec}", "trainer.lr=1e-3", "algo.loss_agg=token-mean"))
        model, _ = load_policy(ModelConfig(source="tiny"), seed=3)
        t = TorchTrainer.from_config(model, cfg, "cpu")
        b = make_batch()
        if old is None:  # fp32 old log-probs, shifted so ratios != 1 (a real loss); shared by both runs
            old = t.compute_logprobs(b)[0] + 0.05 * b.response_mask
        b.extras["old_logprobs"] = old
        m = t.policy_update(b)
        assert next(t.policy.parameters()).dtype == torch.float32  # master weights stay fp32
        out[prec] = (m, {k: v.clone() for k, v in t.policy.state_dict().items()})
    (m32, w32), (m16, w16) = out["fp32"], out["bf16"]
    assert m32["loss/policy"] != 0.0
    assert m16["loss/policy"] == pytest.approx(m32["loss/policy"], rel=2e-2, abs=1e-3)
    assert m16["actor/grad_norm"] == pytest.approx(m32["actor/grad_norm"], rel=5e-2)
    assert m16["loss/policy"] != m32["loss/policy"]  # bf16 really ran
