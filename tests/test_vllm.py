"""rollout=vllm pieces that need no GPU: request building, log-prob extraction, weight names, clear errors."""

from __future__ import annotations

import math
import sys
import types
from types import SimpleNamespace as NS

import pytest
import torch

from conftest import tiny_overrides


def test_build_requests_maps_sampling_params():
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.vllm import build_requests

    inputs, kws = build_requests([[1, 2, 3], [1, 2, 3], [7]],
                                 SamplingParams(max_new_tokens=9, temperature=0.7, top_k=0, top_p=0.9, seed=100,
                                                stop=["</answer>"]))
    assert inputs == [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [7]}]
    assert [k["seed"] for k in kws] == [100, 101, 102]  # identical prompts draw different, reproducible samples
    k = kws[0]
    assert (k["max_tokens"], k["temperature"], k["top_p"], k["top_k"], k["logprobs"]) == (9, 0.7, 0.9, -1, 0)
    assert k["stop"] == ["</answer>"] and k["include_stop_str_in_output"]
    _, g = build_requests([[1]], SamplingParams(greedy=True, temperature=0.5, top_k=5))
    assert g[0]["temperature"] == 0.0 and g[0]["top_k"] == -1
    with pytest.raises(ValueError, match="temperature hooks"):
        build_requests([[1]], SamplingParams(temperature_hook=lambda logits, t: None))
    with pytest.raises(ValueError, match="empty"):
        build_requests([[]], SamplingParams())


def _out(tokens, lps, reason, text="x", as_objects=True):
    entries = [{t: (NS(logprob=lp, rank=1) if as_objects else lp), 99: NS(logprob=-9.0, rank=2)}
               for t, lp in zip(tokens, lps)]
    return NS(outputs=[NS(token_ids=tokens, logprobs=entries, text=text, finish_reason=reason)])


def test_extract_result_pads_masks_and_reads_sampled_logprobs():
    from rlpost.rollout.vllm import extract_result

    outs = [_out([5, 6, 2], [-0.1, -0.2, -0.3], "stop"), _out([8], [-1.5], "length", as_objects=False)]
    r = extract_result(outs, [[1, 2], [3]], pad_id=0, temperature=0.8)
    assert r.response_ids.tolist() == [[5, 6, 2], [8, 0, 0]]
    assert r.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    torch.testing.assert_close(r.rollout_logprobs, torch.tensor([[-0.1, -0.2, -0.3], [-1.5, 0.0, 0.0]]))
    assert r.finished.tolist() == [True, False]
    assert r.prompt_ids.tolist() == [[1, 2], [0, 3]] and r.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert r.temperatures[0].tolist() == pytest.approx([0.8] * 3) and r.temperatures[1, 1] == 0
    assert r.num_tokens == 4


def test_extract_result_errors_on_missing_logprobs():
    from rlpost.errors import RlpostError
    from rlpost.rollout.vllm import extract_result

    bad = NS(outputs=[NS(token_ids=[5], logprobs=None, text="", finish_reason="stop")])
    with pytest.raises(RlpostError, match="logprobs=0"):
        extract_result([bad], [[1]], 0, 1.0)
    with pytest.raises(RlpostError, match="outputs"):
        extract_result([], [[1]], 0, 1.0)


def test_weight_names_for_load_weights():
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout.vllm import vllm_weight_items

    model, _ = load_policy(ModelConfig(source="tiny"), seed=0)
    sd = {"module." + k: v for k, v in model.state_dict().items()}
    sd["module.model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    tie = bool(model.config.tie_word_embeddings)
    items = dict(vllm_weight_items(sd, tie))
    assert "model.layers.0.self_attn.q_proj.weight" in items  # HF names: vLLM fuses q/k/v itself
    assert not any(k.startswith("module.") or "rotary_emb" in k for k in items)
    assert ("lm_head.weight" in items) == (not tie)
    assert items["model.embed_tokens.weight"].data_ptr() == model.state_dict()["model.embed_tokens.weight"].data_ptr()
    assert dict(vllm_weight_items([("_orig_mod.module.x", torch.zeros(1))])).keys() == {"x"}


def test_missing_vllm_or_gpu_is_a_clear_error(compose, monkeypatch):
    from rlpost.errors import RlpostError
    from rlpost.rollout import build_engine

    cfg = compose(tiny_overrides("rollout=vllm"))
    monkeypatch.setitem(sys.modules, "vllm", None)  # "not installed"
    with pytest.raises(RlpostError, match="pip install vllm"):
        build_engine(cfg, torch.nn.Linear(1, 1), NS(pad_token_id=0, eos_token_id=0), torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # installed, but no GPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RlpostError, match="CUDA GPU"):
        build_engine(cfg, torch.nn.Linear(1, 1), NS(pad_token_id=0, eos_token_id=0), torch.device("cpu"))
    cfg = compose(tiny_overrides("rollout=vllm", "precision=rollout_fp8_sim"))
    with pytest.raises(RlpostError, match="rollout=hf"):
        build_engine(cfg, torch.nn.Linear(1, 1), NS(pad_token_id=0, eos_token_id=0), torch.device("cpu"))


def test_engine_drives_vllm_api_with_fakes(compose, monkeypatch, tmp_path):
    """Against a fake ``vllm`` module: construction args, generate, in-memory sync, sleep/wake order."""
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout import build_engine
    from rlpost.rollout.base import SamplingParams

    calls = []

    class FakeLLM:
        def __init__(self, **kw):
            calls.append(("init", kw))
            self.model = NS(load_weights=lambda it: calls.append(("load", [n for n, _ in it])))

        def generate(self, inputs, sps, use_tqdm=False):
            calls.append(("generate", len(inputs)))
            return [_out([4, 2], [-0.5, -0.25], "stop") for _ in inputs]

        def apply_model(self, fn):
            return [fn(self.model)]

        def sleep(self, level=1):
            calls.append(("sleep", level))

        def wake_up(self, tags=None):
            calls.append(("wake", tuple(tags or ())))

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = FakeLLM, lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = compose(tiny_overrides("rollout=vllm", "precision=bf16", f"model.cache_dir={tmp_path}"))
    model, tok = load_policy(ModelConfig(source="tiny"), seed=0)
    eng = build_engine(cfg, model, tok, torch.device("cpu"))
    init = calls[0][1]
    assert init["dtype"] == "bfloat16" and init["enable_sleep_mode"] and "quantization" not in init
    assert (tmp_path / "vllm_init" / "tiny" / "config.json").exists()
    g = eng.generate([[1, 2], [3]], SamplingParams(max_new_tokens=4, seed=1))
    assert g.rollout_logprobs[0].tolist() == [-0.5, -0.25]
    eng.sync_weights(model)
    eng.generate([[1]], SamplingParams(max_new_tokens=4))
    kinds = [c[0] if c[0] != "wake" else f"wake{c[1]}" for c in calls[1:]]
    assert kinds == ["generate", "sleep", "wake('weights',)", "load", "wake('kv_cache',)", "generate", "sleep"]
    loaded = calls[4][1]
    assert "model.layers.1.mlp.down_proj.weight" in loaded
