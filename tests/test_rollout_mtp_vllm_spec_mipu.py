"""vLLM speculative-decoding wiring, Bebop's e2e TV loss and MTP draft heads, MIPU."""

import json

import pytest
import torch

from rlpost.core.errors import ConfigError
from rlpost.rollout.base import SamplingParams
from rlpost.rollout.hf import HFRolloutEngine
from test_rollout_self_spec_otr_hif4 import _exact_dist, _perturb, _tiny_llama, _Tok, response_chi2
from conftest import tiny_overrides


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- vLLM speculative_config
def test_vllm_spec_settings_and_config():
    from rlpost.rollout.vllm_spec import mtp_layers, vllm_spec_settings, vllm_speculative_config

    assert vllm_spec_settings(None) is None and vllm_spec_settings({"method": None}) is None
    with pytest.raises(ConfigError, match="rollout=hf"):
        vllm_spec_settings({"method": "mtp", "switch_batch": 2})
    with pytest.raises(ConfigError, match="unknown"):
        vllm_spec_settings({"method": "eagle9"})
    with pytest.raises(ConfigError, match=">= 1"):
        vllm_spec_settings({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match="needs rollout.speculative.model"):
        vllm_spec_settings({"method": "draft_model"})
    with pytest.raises(ConfigError, match="ngram only"):
        vllm_spec_settings({"method": "mtp", "prompt_lookup_max": 3})
    with pytest.raises(ConfigError, match="prompt_lookup_min <= prompt_lookup_max"):
        vllm_spec_settings({"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3})

    assert mtp_layers({"num_hidden_layers": 2}) == 0
    assert mtp_layers({"num_nextn_predict_layers": 1}) == 1
    assert mtp_layers({"text_config": {"mtp_num_hidden_layers": 2}}) == 2
    c = vllm_spec_settings({"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="multi-token-prediction heads"):
        vllm_speculative_config(c, {"num_hidden_layers": 2}, "/init", checkpoint="/ckpt")
    assert vllm_speculative_config(c, {"num_nextn_predict_layers": 1}, "/init", checkpoint="/ckpt") == {
        "method": "mtp", "num_speculative_tokens": 2, "model": "/ckpt"}  # MTP layers load from the checkpoint
    c = vllm_spec_settings({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    assert vllm_speculative_config(c, {}, "/init") == {"method": "ngram", "num_speculative_tokens": 4,
                                                       "prompt_lookup_max": 4}
    c = vllm_spec_settings({"method": "self", "num_speculative_tokens": 3, "quantization": "fp8"})
    assert vllm_speculative_config(c, {}, "/init") == {"method": "draft_model", "num_speculative_tokens": 3,
                                                       "model": "/init", "quantization": "fp8"}


def test_vllm_engine_kwargs_speculative(compose, tmp_path):
    """rollout=vllm_mtp on the tiny model (no MTP heads) stops with a ConfigError; with heads it is passed on."""
    from rlpost.rollout.fp8_stack import online_fp8_name, vllm_features
    from rlpost.rollout.self_spec import check_speculative
    from rlpost.rollout.vllm import engine_kwargs
    from rlpost.rollout.base import EngineConfig

    cfg = compose(tiny_overrides("rollout=vllm_mtp", "precision=bf16"))
    assert check_speculative(cfg) is None  # vLLM speculates inside its own engine: no hf wrapper
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match="method=mtp needs a model with multi-token-prediction heads"):
        engine_kwargs(EngineConfig.of(cfg), str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_nextn_predict_layers": 1}))
    cfg.model.path = "/ckpt/deepseek"
    kw = engine_kwargs(EngineConfig.of(cfg), str(tmp_path))
    assert kw["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2, "model": "/ckpt/deepseek"}
    cfg = compose(tiny_overrides("rollout=vllm_self_spec", "precision=bf16"))
    kw = engine_kwargs(EngineConfig.of(cfg), str(tmp_path))
    online = online_fp8_name(vllm_features()[0])  # the drafter is the bf16 checkpoint: vLLM's online fp8
    assert kw["speculative_config"] == {"method": "draft_model", "num_speculative_tokens": 3,
                                        "model": str(tmp_path), "quantization": online}
    assert "speculative_config" not in engine_kwargs(compose(tiny_overrides("rollout=vllm", "precision=bf16")),
                                                     str(tmp_path))
    bad = compose(tiny_overrides("rollout=hf_self_spec", "rollout.engine=vllm", "precision=bf16"))
    with pytest.raises(ConfigError, match="rollout=hf"):
        check_speculative(bad)


# --------------------------------------------------------------------------- Bebop e2e TV loss
def test_tv_acceptance_and_e2e_loss_hand_computed():
    from rlpost.rollout.mtp_draft import e2e_tv_loss, multi_step_acceptance, tv_acceptance

    p = torch.tensor([[[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[0.2, 0.3, 0.5], [0.5, 0.5, 0.0]]])
    # 1 - TV = sum min(p, q): 0.2 + 0.3 + 0.2 = 0.7 and 0.5
    torch.testing.assert_close(tv_acceptance(p, q), torch.tensor([[0.7, 0.5]]))
    torch.testing.assert_close(multi_step_acceptance(p, q), torch.tensor([[0.7, 0.35]]))
    torch.testing.assert_close(e2e_tv_loss(p, q), torch.tensor(1 - (0.7 + 0.35) / 2))
    assert float(e2e_tv_loss(p, p)) == pytest.approx(0.0, abs=1e-7)
    # a masked-out position does not count
    p2, q2 = torch.cat([p, p]), torch.cat([q, p])
    torch.testing.assert_close(e2e_tv_loss(p2, q2, torch.tensor([1.0, 0.0])), torch.tensor(0.475))
    with pytest.raises(ValueError, match=r"\[N, K, V\]"):
        e2e_tv_loss(p[0], q[0])


def test_multi_step_acceptance_matches_simulated_rejection_sampling():
    """The product of (1 - TV) terms is the chance that rejection sampling accepts both drafts."""
    from rlpost.rollout.mtp_draft import multi_step_acceptance

    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.3, 0.5], [0.4, 0.4, 0.2]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    N = 200_000
    both = torch.ones(N, dtype=torch.bool)
    for k in range(2):
        x = torch.multinomial(q[k], N, replacement=True, generator=g)
        u = torch.rand(N, generator=g, dtype=torch.float64)
        both &= u < (p[k, x] / q[k, x]).clamp(max=1.0)
    expect = float(multi_step_acceptance(p, q)[-1])  # (0.2+0.3+0.2) * (0.1+0.4+0.2) = 0.49
    assert expect == pytest.approx(0.49)
    assert float(both.double().mean()) == pytest.approx(expect, abs=0.005)


def test_tv_trained_mtp_head_raises_acceptance():
    from rlpost.rollout.mtp_draft import MTPDraftHead, acceptance_of_head, mtp_training_pairs, train_mtp_head

    model = _tiny_llama(3).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 5, (16, 10), generator=g)
    h, toks, p = mtp_training_pairs(model, ids, depth=2)
    assert h.shape == (16 * 7, 16) and toks.shape == (16 * 7, 2) and p.shape == (16 * 7, 2, 5)
    torch.manual_seed(0)
    head = MTPDraftHead(model)
    before = acceptance_of_head(head, h, toks, p)
    hist = train_mtp_head(head, h, toks, p, steps=150, lr=1e-2, loss="tv")
    after = acceptance_of_head(head, h, toks, p)
    assert hist[-1] < hist[0]
    assert after["expected_accepted"] > before["expected_accepted"] + 0.1, (before, after)
    # the loss reported is 1 - expected_accepted / K on the training pairs
    assert hist[-1] == pytest.approx(1 - after["expected_accepted"] / 2, abs=0.02)
    assert not any(q.grad is not None and q.grad.abs().sum() > 0 for q in model.parameters())  # policy frozen


def test_mtp_head_speculative_rollouts_are_exact_samples_of_the_policy():
    """Whole 3-token responses drafted by an MTP head: chi-square against the policy's exact distribution."""
    from rlpost.rollout.mtp_draft import MTPDraftHead, MTPSpeculativeEngine, mtp_training_pairs, train_mtp_head

    model = _tiny_llama(0).requires_grad_(False)
    torch.manual_seed(1)
    head = MTPDraftHead(model)
    ids = torch.randint(1, 5, (8, 8), generator=torch.Generator().manual_seed(1))
    train_mtp_head(head, *mtp_training_pairs(model, ids, depth=2), steps=40, lr=1e-2)
    target = HFRolloutEngine(model, _Tok(), batch_size=4096)
    N, T, prompt = 400, 3, [1, 2, 3]
    eng = MTPSpeculativeEngine(target, head, switch_batch=N, draft_len=2, max_draft_len=3)
    gen = eng.generate([prompt] * N, SamplingParams(max_new_tokens=T, seed=11))
    m = eng.pop_metrics()
    assert m["spec/spec_rows"] == N and m["spec/draft_tokens"] > 0
    assert 0.05 < m["spec/accept_rate"] < 1.0, m
    keys, p_exact = _exact_dist(model, prompt, T)
    stat, bound, against = response_chi2(gen, keys, p_exact)
    assert stat < bound, (stat, bound)
    # power: a perturbed policy's distribution is rejected by the same statistic
    import copy

    _, q_exact = _exact_dist(_perturb(0.3)(copy.deepcopy(model)), prompt, T)
    assert against(q_exact) > bound
    # reported log-probs are the policy's
    with torch.no_grad():
        lp0 = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double(), -1)
    assert torch.allclose(gen.rollout_logprobs[:, 0].double(), lp0[gen.response_ids[:, 0]], atol=1e-4)


# --------------------------------------------------------------------------- the FP8 GPU recipe
def test_fp8_gpu_recipe_names_vllm_fp8_and_fits_its_node(compose, tmp_path):
    """recipes/fp8_rollout_qwen3_8b: vLLM quantization=fp8 with the bf16 trainer; fits 8 x 80 GiB by rlpost's budget."""
    import sys
    from pathlib import Path

    from rlpost.run.memory import check, shape_from_config
    from rlpost.experiments.recipes import parse_card
    from rlpost.rollout.fp8_stack import online_fp8_name, vllm_features
    from rlpost.rollout.vllm import engine_kwargs
    from rlpost.rollout.base import EngineConfig

    cfg = compose(["+recipe=fp8_rollout_qwen3_8b", "trainer.num_procs=8", "logger=none"])
    assert (cfg.model.name, cfg.rollout.engine, cfg.precision.trainer_dtype, cfg.precision.rollout_dtype,
            cfg.precision.correction) == ("qwen3-8b", "vllm", "bf16", "fp8", "tis")
    (tmp_path / "config.json").write_text("{}")
    kw = engine_kwargs(EngineConfig.of(cfg), str(tmp_path))
    online = online_fp8_name(vllm_features()[0])
    assert online in ("fp8", "fp8_per_tensor") and kw["quantization"] == online and kw["dtype"] == "bfloat16"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from gpu_check import hf_config

    check(cfg, shape_from_config(hf_config("qwen3-8b").to_dict()), 80 * 1024**3, world_size=8)  # raises if not
    # the CPU recipe points at it, and gpu_check's fp8 arm composes it on the toy model
    import yaml

    card = parse_card(yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "fp8_rollout.yaml").read_text())["card"])
    assert card.gpu_recipe == "fp8_rollout_qwen3_8b"
    toy = compose(["model=tiny", "logger=none", "algo=grpo", "algo.kl.coef=0", "+recipe=fp8_rollout_qwen3_8b",
                   "model=tiny", "trainer=torch", "model.gradient_checkpointing=false", "precision=rollout_fp8",
                   "rollout=vllm"])
    assert toy.model.name == "tiny" and engine_kwargs(EngineConfig.of(toy), str(tmp_path))["quantization"] == online


# --------------------------------------------------------------------------- MIPU
def test_mipu_gap_proxy_hand_computed():
    import math

    from rlpost.algos.mipu import inference_gap_proxy

    old = torch.tensor([[-1.0, -2.0, -0.5]])
    new = old + torch.tensor([[math.log(2.0), math.log(0.5), 3.0]])
    adv = torch.tensor([[1.0, -1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding: ignored
    out = inference_gap_proxy(new, old, adv, mask)
    # r = 2 and 0.5: gain = mean((2-1)*1, (0.5-1)*(-1)) = 0.75; k3 = mean(2-1-ln2, 0.5-1+ln2) = 0.25
    assert out["gain"] == pytest.approx(0.75)
    assert out["kl"] == pytest.approx(0.25)
    assert out["ratio_mean"] == pytest.approx(1.25)
    with pytest.raises(ValueError, match="no token"):
        inference_gap_proxy(new, old, adv, torch.zeros(1, 3))


def test_mipu_settings_errors(compose):
    from rlpost.algos.mipu import check_update_gate, gate_settings

    assert gate_settings(None) is None
    assert gate_settings({"name": "mipu"}) == {"name": "mipu", "min_gain": 0.0, "max_kl": None}
    with pytest.raises(ConfigError, match="unknown key"):
        gate_settings({"name": "mipu", "min_gian": 0.1})
    with pytest.raises(ConfigError, match="max_kl"):
        gate_settings({"name": "mipu", "max_kl": 0})
    cfg = compose(tiny_overrides("algo=mipu", "precision=rollout_fp8_sim"))
    assert check_update_gate(cfg)["min_gain"] == 0.0
    with pytest.raises(ConfigError, match="trainer=torch"):
        check_update_gate(compose(tiny_overrides("algo=mipu", "trainer=deepspeed")))
    with pytest.raises(ConfigError, match="rollout=hf"):
        check_update_gate(compose(tiny_overrides("algo=mipu", "rollout=vllm", "precision=bf16")))


def _mipu_setup(compose, min_gain):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_worker import make_batch

    from rlpost.methods.mipu import UpdateGate
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides("algo=mipu", "precision=rollout_fp8_sim", "trainer.lr=1e-2",
                                 f"algo.update_gate.min_gain={min_gain}"))
    model, tok = load_policy(ModelConfig(source="tiny"), seed=3)
    trainer = TorchTrainer.from_config(model, cfg, "cpu")
    eng = build_engine(EngineConfig.of(cfg), trainer.policy, tok, torch.device("cpu"))
    gate = UpdateGate(cfg)
    gate.validate()
    return cfg, trainer, eng, gate.gate, make_batch()


def _gate_update(gate, trainer, eng, batch, rng):
    return gate.update(lambda: trainer.policy_update(batch, rng), eng, batch, trainer.policy, trainer.snapshot,
                       trainer.restore)


def _opt_tensors(opt):
    return [(k, v.clone()) for s in opt.state_dict()["state"].values() for k, v in sorted(s.items())
            if torch.is_tensor(v)]


def test_mipu_rejected_candidate_restores_weights_and_optimizer_exactly(compose):
    from rlpost.algos.mipu import inference_logprobs

    _, trainer, eng, gate, batch = _mipu_setup(compose, 1e9)  # no candidate can reach this gain: always rejected
    # one accepted plain step first, so the optimizer already has moments to restore
    trainer.policy_update(batch, torch.Generator().manual_seed(0))
    eng.sync_weights(trainer.policy)
    w0 = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    o0 = _opt_tensors(trainer.opt)
    s0 = trainer.sched.state_dict()["last_epoch"]
    lp_inf0 = inference_logprobs(eng, batch)
    m = _gate_update(gate, trainer, eng, batch, torch.Generator().manual_seed(1))
    assert m["mipu/accepted"] == 0.0 and m["mipu/accept_rate"] == 0.0
    assert m["loss/policy"] != 0.0 and m["mipu/kl"] > 0  # a real candidate was built and scored, then undone
    for k, v in trainer.policy.state_dict().items():
        assert torch.equal(v, w0[k]), k
    o1 = _opt_tensors(trainer.opt)
    assert len(o1) == len(o0) > 0 and all(torch.equal(a[1], b[1]) for a, b in zip(o0, o1))
    assert trainer.sched.state_dict()["last_epoch"] == s0
    assert torch.equal(inference_logprobs(eng, batch), lp_inf0)  # the inference copy is back too


def test_mipu_accepted_candidate_equals_the_plain_update(compose):
    _, t_gate, eng, gate, batch = _mipu_setup(compose, -1e9)  # every candidate accepted
    _, t_plain, _, _, _ = _mipu_setup(compose, -1e9)
    m = _gate_update(gate, t_gate, eng, batch, torch.Generator().manual_seed(1))
    t_plain.policy_update(batch, torch.Generator().manual_seed(1))
    assert m["mipu/accepted"] == 1.0 and m["mipu/accept_rate"] == 1.0
    for (k, a), b in zip(t_gate.policy.state_dict().items(), t_plain.policy.state_dict().values()):
        assert torch.equal(a, b), k
    # the engine's inference copy was synced to the accepted weights (fp8-rounded copy of them)
    from rlpost.algos.mipu import inference_logprobs

    lp = inference_logprobs(eng, batch)
    assert float(((lp - batch.rollout_logprobs).abs() * batch.response_mask).sum()) > 0


def test_mipu_runs_two_steps_through_the_runner(tmp_path):
    import json

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["model=tiny", "logger=jsonl", "rollout.max_new_tokens=6", "selector.prompts_per_step=2",
                          "algo.n_samples_per_prompt=4", "eval.at_end=false", "checkpoint.every=0", "algo=mipu",
                          "precision=rollout_fp8_sim", "steps=2"])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    acc = [r["mipu/accepted"] for r in rows if "mipu/accepted" in r]
    assert len(acc) == 2 and all(a in (0.0, 1.0) for a in acc)
    assert all(r["mipu/accept_rate"] == pytest.approx(sum(acc[: i + 1]) / (i + 1))
               for i, r in enumerate(x for x in rows if "mipu/accepted" in x))
