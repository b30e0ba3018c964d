"""LoRA through PEFT (``model.lora.rank > 0``) on the tiny model: what trains, the KL reference,
rollout weights, checkpoints and the merged export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from ds_worker import make_batch

HERE = Path(__file__).resolve().parent
LORA = ("model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj,up_proj]")


def _trainer(compose, *extra, lora=True, engine="torch"):
    from rlpost.models.loader import load_policy

    cfg = compose(tiny_overrides(f"trainer={engine}", "trainer.lr=1e-2", "trainer.micro_batch_size=4", "algo.mini_batches=2",
                                 "algo.kl.coef=0.1", *(LORA if lora else ()), *extra))
    policy, _ = load_policy(cfg.model, seed=3)
    if engine == "deepspeed":
        from rlpost.trainer.deepspeed_engine import DeepSpeedTrainer

        return DeepSpeedTrainer.from_config(policy, cfg, "cpu")
    from rlpost.trainer.torch_engine import TorchTrainer

    return TorchTrainer.from_config(policy, cfg, "cpu")


def _update(t, seed=0):
    b = make_batch(seed)
    b.extras["ref_logprobs"], _ = t.compute_logprobs(b, "ref")
    return b, t.policy_update(b, torch.Generator().manual_seed(0))


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_lora_updates_only_adapter_weights(compose):
    t = _trainer(compose)
    before = {k: v.clone() for k, v in t.policy.state_dict().items()}
    lora_keys = [k for k in before if ".lora_" in k]
    # 2 layers x (q_proj, v_proj, up_proj) x (A, B)
    assert len(lora_keys) == 12
    opt_params = [p for g in t.opt.param_groups for p in g["params"]]
    named = {id(p): n for n, p in t.policy.named_parameters()}
    assert sorted(named[id(p)] for p in opt_params) == sorted(n for n, _ in t.policy.named_parameters() if ".lora_" in n)
    assert t.ref is None  # the reference is the base under the adapters, not a copy
    _, m = _update(t)
    assert m["actor/grad_norm"] > 0
    after = t.policy.state_dict()
    for k, v in before.items():
        if ".lora_B" in k:  # B starts at zero (the base model) and must move
            assert v.abs().max() == 0 and after[k].abs().max() > 0, k
        elif ".lora_A" in k:
            assert not torch.equal(v, after[k]), k  # moves from the second optimizer step (B != 0)
        else:
            assert torch.equal(v, after[k]), k


def test_lora_kl_reference_equals_base_model_logprobs(compose):
    t = _trainer(compose)
    base = _trainer(compose, lora=False)  # the same seed: the same base weights, no adapters
    b, _ = _update(t)
    b2, _ = _update(t, seed=1)  # two updates: the adapters are far from zero
    ref_lp, _ = t.compute_logprobs(b2, "ref")
    base_lp, _ = base.compute_logprobs(b2, "policy")
    pol_lp, _ = t.compute_logprobs(b2, "policy")
    m = b2.response_mask > 0
    assert torch.allclose(ref_lp[m], base_lp[m], atol=1e-6)
    assert (pol_lp[m] - base_lp[m]).abs().max() > 1e-3  # the policy itself moved
    # the ref pass restores the adapters and their trainability
    assert all(p.requires_grad for n, p in t.policy.named_parameters() if ".lora_" in n)
    assert torch.allclose(t.compute_logprobs(b2, "policy")[0][m], pol_lp[m])


def test_merged_export_loads_with_transformers_and_gives_the_same_logits(compose, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlpost.run.checkpoint import export_final
    from rlpost.models.loader import load_tokenizer

    t = _trainer(compose)
    _update(t)
    model_cfg = compose(tiny_overrides(*LORA)).model
    tok = load_tokenizer(model_cfg)
    export_final(t.policy, tok, tmp_path / "final", model_cfg)
    ids = make_batch(2).prompt_ids
    want = _logits(t.policy, ids)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(_logits(merged, ids), want, atol=1e-5)
    # the adapter beside it applies to the base model through PEFT itself
    base = _trainer(compose, lora=False).policy
    peft_model = PeftModel.from_pretrained(base, tmp_path / "final" / "adapter")
    assert torch.allclose(_logits(peft_model, ids), want, atol=1e-5)
    cfg = json.loads((tmp_path / "final" / "adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == (4, 8.0, ["q_proj", "up_proj", "v_proj"])


def test_hf_engine_copy_holds_merged_weights_and_follows_each_push(compose):
    from rlpost.models.loader import load_tokenizer
    from rlpost.rollout.hf import HFRolloutEngine

    t = _trainer(compose)
    eng = HFRolloutEngine(t.policy, load_tokenizer(compose(tiny_overrides(*LORA)).model), share_weights=False)
    assert not any("lora" in n for n, _ in eng.model.named_parameters())  # a plain merged model
    ids = make_batch(2).prompt_ids
    _update(t)
    assert not torch.allclose(_logits(eng.model, ids), _logits(t.policy, ids), atol=1e-4)  # stale until the push
    eng.sync_weights(t.policy)
    assert torch.allclose(_logits(eng.model, ids), _logits(t.policy, ids), atol=1e-5)


def test_lora_config_errors_name_the_fix(compose, tmp_path):
    from rlpost.config.compose import validate_config
    from rlpost.core.errors import ConfigError
    from rlpost.models.loader import load_policy

    with pytest.raises(ConfigError, match="model.lora.rank=-1 is negative"):
        validate_config(compose(tiny_overrides("model.lora.rank=-1")))
    with pytest.raises(ConfigError, match=r"model.lora.dropout=1.5 must be in \[0, 1\)"):
        validate_config(compose(tiny_overrides("model.lora.rank=4", "model.lora.dropout=1.5")))
    cfg = compose(tiny_overrides("model.lora.rank=4", "model.lora.target_modules=[qkv]"))
    with pytest.raises(ConfigError, match="matches no layer of this model.*q_proj"):
        load_policy(cfg.model)
    off = compose(tiny_overrides("model.lora.rank=0"))
    from rlpost.models.lora import is_lora

    assert not is_lora(load_policy(off.model)[0])


def test_lora_checkpoint_resumes_to_the_same_metrics(compose, tmp_path, monkeypatch):
    from test_runner import _Stopped, _assert_same_metrics, _stop_after_checkpoint, _train

    from rlpost.core.errors import RlpostError

    # an entropy bonus and a KL term move the adapters even where every reward is 0 on the random model
    over = (*LORA, "steps=3", "checkpoint.every=1", "eval.at_end=false", "selector.prompts_per_step=2",
            "algo.n_samples_per_prompt=2", "rollout.max_new_tokens=6", "algo.entropy_coef=0.01",
            "algo.kl.coef=0.1", "trainer.lr=1e-2", "seed=5")
    straight = _train(compose, tmp_path, *over, name="straight")
    _stop_after_checkpoint(monkeypatch, 2)
    with pytest.raises(_Stopped):
        _train(compose, tmp_path, *over, name="stopped")
    monkeypatch.undo()
    held = sorted(p.name for p in (tmp_path / "stopped" / "checkpoints" / "step_000002" / "policy").iterdir())
    assert "adapter_model.safetensors" in held and not any(n.startswith("model") for n in held)  # the adapter only
    _train(compose, tmp_path, *over, "resume=auto", name="stopped")
    _assert_same_metrics(straight, tmp_path / "stopped", 3)
    last = json.loads((straight / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["actor/kl_ref"] > 0  # the run really moved away from the base model
    with pytest.raises(RlpostError, match="holds a LoRA adapter but this run has model.lora.rank=0"):
        _train(compose, tmp_path, *[o for o in over if not o.startswith("model.lora")], "resume=auto",
               name="stopped")


def _ds_main(out: str) -> None:
    """Subprocess body: one LoRA update under DeepSpeed ZeRO-2 (a world of one) -> adapter weights to ``out``."""
    from rlpost.config.compose import compose_config

    t = _trainer(compose_config, engine="deepspeed")
    _, m = _update(t)
    torch.save({"w": {k: v.clone() for k, v in t.policy.state_dict().items() if ".lora_" in k}, "m": m}, out)


def test_lora_under_deepspeed_equals_torch(compose, tmp_path):
    out = tmp_path / "ds.pt"
    code = f"import sys; sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent)!r}]; import test_lora; test_lora._ds_main({str(out)!r})"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    ds = torch.load(out)
    t = _trainer(compose)
    _, m = _update(t)
    want = {k: v for k, v in t.policy.state_dict().items() if ".lora_" in k}
    assert ds["w"].keys() == want.keys()
    for k in want:
        assert torch.allclose(ds["w"][k], want[k], atol=1e-6), k
    assert ds["m"]["loss/policy"] == pytest.approx(m["loss/policy"], rel=1e-5)


def test_vllm_engine_runs_the_adapter_through_lora_requests(compose, monkeypatch, tmp_path):
    """vLLM's LoRA path, driven through a recording fake of its API (the real one needs a GPU):
    base weights at start, enable_lora with a rank vLLM accepts, one new LoRARequest per push."""
    import types
    from dataclasses import dataclass

    from safetensors.torch import load_file
    from test_vllm import _fake_vllm

    from rlpost.models.lora import PEFT_FILE_PREFIX, adapter_state_dict
    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.rollout.base import SamplingParams

    calls = []
    _fake_vllm(monkeypatch, calls)
    vllm = sys.modules["vllm"]
    base_generate = vllm.LLM.generate

    def generate(self, inputs, sps, use_tqdm=False, lora_request=None):
        calls.append(("lora", lora_request))
        return base_generate(self, inputs, sps, use_tqdm)

    vllm.LLM.generate = generate
    vllm.LLM.llm_engine = property(lambda self: types.SimpleNamespace(remove_lora=lambda i: calls.append(("rm", i))))

    @dataclass
    class LoRARequest:  # vllm/lora/request.py
        lora_name: str
        lora_int_id: int
        lora_path: str

    req_mod = types.ModuleType("vllm.lora.request")
    req_mod.LoRARequest = LoRARequest
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", req_mod)

    cfg = compose(tiny_overrides("rollout=vllm", "precision=bf16", f"model.cache_dir={tmp_path}", *LORA))
    model, tok = load_policy(cfg.model, seed=0)
    eng = build_engine(EngineConfig.of(cfg), model, tok, torch.device("cpu"))
    init = calls[0][1]
    assert (init["enable_lora"], init["max_lora_rank"], init["max_loras"]) == (True, 8, 1)  # rank 4 -> vLLM's 8
    saved = load_file(str(eng.llm_dir / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" in saved and not any("lora" in k for k in saved)
    eng.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert [c for c in calls if c[0] == "lora"] == [("lora", None)]  # before any push: the base model (B = 0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.5)
    eng.sync_weights(model)
    eng.sync_weights(model)
    eng.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    req = [c[1] for c in calls if c[0] == "lora"][-1]
    assert (req.lora_name, req.lora_int_id) == ("rlpost-2", 2) and ("rm", 1) in calls
    assert not any(c[0] == "load" for c in calls)  # the base weights are never pushed
    on_disk = load_file(str(Path(req.lora_path) / "adapter_model.safetensors"))
    want = adapter_state_dict(model)
    assert on_disk.keys() == {PEFT_FILE_PREFIX + k for k in want}
    assert all(torch.equal(on_disk[PEFT_FILE_PREFIX + k], v) for k, v in want.items())
    root = Path(req.lora_path).parent
    assert sorted(p.name for p in root.iterdir()) == ["v000002"]  # the replaced adapter is gone from disk
    eng.close()
    assert not root.exists()


def test_lora_with_gradient_checkpointing_gives_the_same_update(compose):
    """Frozen embeddings give recomputed blocks an input without grad; the loader turns input grads on."""
    plain = _trainer(compose)
    ckpt = _trainer(compose, "model.gradient_checkpointing=true")
    _, m0 = _update(plain)
    _, m1 = _update(ckpt)
    assert m1["actor/grad_norm"] > 0
    assert m1["actor/grad_norm"] == pytest.approx(m0["actor/grad_norm"], rel=1e-5)
    w0, w1 = plain.policy.state_dict(), ckpt.policy.state_dict()
    assert all(torch.allclose(w0[k], w1[k], atol=1e-6) for k in w0 if ".lora_" in k)


# ------------------------------------------------------------------ issue 29: dropout, rsLoRA, modules_to_save
def test_adapter_dropout_keeps_the_on_policy_ratio_exactly_one(compose):
    """model.lora.dropout=0.1 used to give ratio_max 1.0456 and approx_kl 3.8e-4 on on-policy data (the update's
    forward ran with dropout, the old log-probs without). Adapter dropout is now never applied."""
    t = _trainer(compose, "model.lora.dropout=0.1", "trainer.lr=0.0", "algo.kl.coef=0.0")
    b = make_batch(0)
    with torch.no_grad():  # B = 0 at init would hide dropout: give the adapters a non-zero update
        for n, p in t.policy.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    old, _ = t.compute_logprobs(b, "policy")
    t.policy.train()
    ids = torch.cat([b.prompt_ids, b.response_ids], 1)
    train_logits = t.policy(input_ids=ids).logits.detach()
    assert torch.equal(train_logits, _logits(t.policy, ids))  # train mode == eval mode: no dropout mask
    b.extras["old_logprobs"] = old
    m = t.policy_update(b, torch.Generator().manual_seed(0))
    ratio_keys = [k for k in m if "ratio" in k and ("max" in k or "mean" in k)]
    assert ratio_keys
    for k in ratio_keys:
        assert m[k] == pytest.approx(1.0, abs=1e-6), (k, m[k])
    for k in (k for k in m if "approx_kl" in k):
        assert abs(m[k]) < 1e-7, (k, m[k])
    assert t.policy.peft_config["default"].lora_dropout == 0.1  # recorded for the exported adapter


def test_rslora_scales_by_alpha_over_sqrt_rank_and_merges_that_delta(compose):
    from rlpost.models.lora import merged_state_dict

    t = _trainer(compose, "model.lora.use_rslora=true")
    layer = next(m for n, m in t.policy.named_modules() if n.endswith("q_proj") and hasattr(m, "scaling"))
    assert layer.scaling["default"] == pytest.approx(8 / 4 ** 0.5)  # alpha 8, rank 4: 4.0 (plain LoRA: 2.0)
    with torch.no_grad():
        layer.lora_B["default"].weight.fill_(0.01)
    name = next(n for n, m in t.policy.named_modules() if m is layer)
    w = merged_state_dict(t.policy)[f"{name}.weight"]
    want = layer.base_layer.weight + 4.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    assert torch.allclose(w, want, atol=1e-6)


def test_modules_to_save_is_refused_with_the_fix(compose):
    from rlpost.config.compose import validate_config
    from rlpost.core.errors import ConfigError
    from rlpost.models.lora import check_lora_config

    cfg = compose(tiny_overrides(*LORA, "model.lora.modules_to_save=[lm_head]"))
    with pytest.raises(ConfigError, match=r"modules_to_save=\['lm_head'\] is not supported.*Fix: model.lora.modules_to_save=\[\]"):
        check_lora_config(cfg.model)
    with pytest.raises(ConfigError, match="modules_to_save"):
        validate_config(cfg)
