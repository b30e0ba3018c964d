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
    from rlpost.rollout.base import EngineConfig

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
    from rlpost.rollout.base import EngineConfig

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
    from rlpost.core.errors import RlpostError
    from rlpost.rollout.vllm import extract_result
    from rlpost.rollout.base import EngineConfig

    bad = NS(outputs=[NS(token_ids=[5], logprobs=None, text="", finish_reason="stop")])
    with pytest.raises(RlpostError, match="logprobs=0"):
        extract_result([bad], [[1]], 0, 1.0)
    with pytest.raises(RlpostError, match="outputs"):
        extract_result([], [[1]], 0, 1.0)


def test_weight_names_for_load_weights():
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout.vllm import vllm_weight_items
    from rlpost.rollout.base import EngineConfig

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
    from rlpost.core.errors import RlpostError
    from rlpost.rollout import EngineConfig, build_engine
    cfg = compose(tiny_overrides("rollout=vllm"))
    monkeypatch.setitem(sys.modules, "vllm", None)  # "not installed"
    with pytest.raises(RlpostError, match=r"scripts/setup.sh` installs vLLM's CPU backend.*pip install 'rlpost\[vllm\]'"):
        build_engine(EngineConfig.of(cfg), torch.nn.Linear(1, 1), NS(pad_token_id=0, eos_token_id=0), torch.device("cpu"))
    _fake_vllm(monkeypatch, [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # vLLM's CUDA build, but no GPU here
    with pytest.raises(RlpostError, match="CUDA build and no CUDA GPU"):
        build_engine(EngineConfig.of(cfg), torch.nn.Linear(1, 1), NS(pad_token_id=0, eos_token_id=0), torch.device("cpu"))
    _fake_vllm(monkeypatch, [], device="")  # a vLLM that found no platform at all
    with pytest.raises(RlpostError, match="found no platform"):
        build_engine(EngineConfig.of(cfg), torch.nn.Linear(1, 1), NS(pad_token_id=0, eos_token_id=0), torch.device("cpu"))
    cfg = compose(tiny_overrides("rollout=vllm", "precision=rollout_fp8_sim"))
    with pytest.raises(RlpostError, match="rollout=hf"):
        build_engine(EngineConfig.of(cfg), torch.nn.Linear(1, 1), NS(pad_token_id=0, eos_token_id=0), torch.device("cpu"))


def _fake_vllm(monkeypatch, calls, version="0.33.0", reload_api=True, device="cuda"):
    """A fake ``vllm`` module recording every engine call; ``reload_api``: GPUModelRunner.reload_weights exists;
    ``device``: the platform it reports (``vllm.platforms.current_platform.device_type``)."""

    class FakeLLM:
        def __init__(self, **kw):
            calls.append(("init", kw))
            self.model = NS(load_weights=lambda it: calls.append(("load", [n for n, _ in it])))

        def generate(self, inputs, sps, use_tqdm=False):
            calls.append(("generate", len(inputs)))
            return [_out([4, 2], [-0.5, -0.25], "stop") for _ in inputs]

        def apply_model(self, fn):
            return [fn(self.model)]

        def collective_rpc(self, method, args=(), kwargs=None):
            kw = dict(kwargs or {})
            calls.append(("rpc", method, [n for n, _ in kw.pop("weights_iterator")], kw))

        def reset_prefix_cache(self):
            calls.append(("reset_prefix_cache",))

        def sleep(self, level=1):
            calls.append(("sleep", level))

        def wake_up(self, tags=None):
            calls.append(("wake", tuple(tags or ())))

    fake = types.ModuleType("vllm")
    fake.__version__ = version
    fake.LLM, fake.SamplingParams = FakeLLM, lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", fake)
    runner_mod = types.ModuleType("vllm.v1.worker.gpu_model_runner")

    class GPUModelRunner:
        if reload_api:
            def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
                pass

    runner_mod.GPUModelRunner = GPUModelRunner
    for name in ("vllm.v1", "vllm.v1.worker"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", runner_mod)
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = NS(device_type=device)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    attn = types.ModuleType("vllm.v1.attention.backends.cpu_attn")  # vLLM 0.32's CPU attention head sizes
    attn.CPUAttentionBackend = NS(get_supported_head_sizes=lambda: [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512])
    for name in ("vllm.v1.attention", "vllm.v1.attention.backends"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.cpu_attn", attn)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _kinds(calls):
    return [c[0] if c[0] not in ("wake", "rpc") else f"{c[0]}({c[1]!r},)" if c[0] == "rpc" else f"wake{c[1]}"
            for c in calls]


def test_engine_drives_vllm_api_with_fakes(compose, monkeypatch, tmp_path):
    """bf16: construction args, generate, in-memory push through load_weights after waking only the weights."""
    import os

    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.rollout.base import SamplingParams

    calls = []
    _fake_vllm(monkeypatch, calls)
    cfg = compose(tiny_overrides("rollout=vllm", "precision=bf16", f"model.cache_dir={tmp_path}"))
    model, tok = load_policy(ModelConfig(source="tiny"), seed=0)
    eng = build_engine(EngineConfig.of(cfg), model, tok, torch.device("cpu"))
    init = calls[0][1]
    assert init["dtype"] == "bfloat16" and init["enable_sleep_mode"] and "quantization" not in init
    assert init["max_model_len"] == 2048 and init["logprobs_mode"]  # rollout.max_model_len 4096, capped at the model's context == "processed_logprobs"
    assert "distributed_executor_backend" not in init  # one process: vLLM's default executor
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert [p.name for p in (tmp_path / "vllm_init").iterdir()] == [eng.llm_dir.name]
    assert eng.llm_dir.name.startswith("tiny-") and (eng.llm_dir / "config.json").exists()
    g = eng.generate([[1, 2], [3]], SamplingParams(max_new_tokens=4, seed=1))
    assert g.rollout_logprobs[0].tolist() == [-0.5, -0.25]
    eng.sync_weights(model)
    eng.generate([[1]], SamplingParams(max_new_tokens=4))
    assert eng.push_method == "load_weights"
    assert _kinds(calls[1:]) == ["generate", "sleep", "wake('weights',)", "load", "reset_prefix_cache",
                                 "wake('kv_cache',)", "generate", "sleep"]
    loaded = calls[4][1]
    assert "model.layers.1.mlp.down_proj.weight" in loaded


def test_fp8_push_goes_through_worker_reload(compose, monkeypatch, tmp_path):
    """fp8: vLLM's online fp8 (fp8_per_tensor, or fp8 on older vLLMs) and every push is collective_rpc('reload_weights', is_checkpoint_format=True),
    never model.load_weights on the processed fp8 model; a vLLM without that API is refused up front."""
    from rlpost.config.schema import ModelConfig
    from rlpost.core.errors import RlpostError
    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.rollout.base import SamplingParams

    calls = []
    _fake_vllm(monkeypatch, calls)
    cfg = compose(tiny_overrides("rollout=vllm", "precision=rollout_fp8", f"model.cache_dir={tmp_path}"))
    model, tok = load_policy(ModelConfig(source="tiny"), seed=0)
    eng = build_engine(EngineConfig.of(cfg), model, tok, torch.device("cpu"))
    from rlpost.rollout.fp8_stack import online_fp8_name, vllm_features

    assert calls[0][1]["quantization"] == online_fp8_name(vllm_features()[0]) and calls[0][1]["dtype"] == "bfloat16"
    eng.generate([[1]], SamplingParams(max_new_tokens=2))
    eng.sync_weights(model)
    assert eng.push_method == "reload_weights"
    assert _kinds(calls[1:]) == ["generate", "sleep", "wake('weights',)", "rpc('reload_weights',)",
                                 "reset_prefix_cache"]
    rpc = calls[4]
    assert rpc[3] == {"is_checkpoint_format": True} and "model.layers.0.self_attn.q_proj.weight" in rpc[2]
    assert not any(c[0] == "load" for c in calls)
    calls.clear()
    _fake_vllm(monkeypatch, calls, reload_api=False)
    with pytest.raises(RlpostError, match="in-place reload"):
        build_engine(EngineConfig.of(cfg), model, tok, torch.device("cpu"))


def test_torchrun_ranks_use_external_launcher_and_multiprocessing_is_refused(compose, monkeypatch, tmp_path):
    from rlpost.config.schema import ModelConfig
    from rlpost.core.errors import RlpostError
    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine
    calls = []
    _fake_vllm(monkeypatch, calls, version="0.9.2")
    cfg = compose(tiny_overrides("rollout=vllm", "precision=bf16", f"model.cache_dir={tmp_path}"))
    model, tok = load_policy(ModelConfig(source="tiny"), seed=0)
    with pytest.raises(RlpostError, match=r"vLLM >= 0\.10\.2"):  # too old: refused, no second engine
        build_engine(EngineConfig.of(cfg), model, tok, torch.device("cpu"))
    assert not calls
    _fake_vllm(monkeypatch, calls)
    monkeypatch.setenv("WORLD_SIZE", "2")
    build_engine(EngineConfig.of(cfg), model, tok, torch.device("cpu"))
    assert calls[0][1]["distributed_executor_backend"] == "external_launcher"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(RlpostError, match="VLLM_ENABLE_V1_MULTIPROCESSING=1"):
        build_engine(EngineConfig.of(cfg), model, tok, torch.device("cpu"))


def test_temperature_is_recorded_as_vllm_samples_it():
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.vllm import build_requests, extract_result, vllm_temperature
    from rlpost.rollout.base import EngineConfig

    assert vllm_temperature(0.005) == 0.01  # vLLM's SamplingParams raises (0, 0.01) to 0.01
    assert vllm_temperature(0.7) == 0.7 and vllm_temperature(0.3, greedy=True) == 0.0
    with pytest.raises(ValueError, match="above 2"):
        vllm_temperature(2.5)
    _, kws = build_requests([[1]], SamplingParams(temperature=0.001))
    assert kws[0]["temperature"] == 0.01
    r = extract_result([_out([5], [-0.1], "stop")], [[1]], pad_id=0, temperature=0.001)
    assert r.temperatures[0, 0].item() == pytest.approx(0.01)  # the trainer recomputes at 0.01, not 0.001


def test_local_rank_sets_the_current_cuda_device(monkeypatch):
    """Under torchrun, rank k places models on cuda:k and makes it current before any engine is built."""
    from rlpost.core.errors import ConfigError
    from rlpost.trainer.torchrun import local_device

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(d))
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_device("auto") == torch.device("cuda", 3) and seen == [torch.device("cuda", 3)]
    assert local_device("cpu") == torch.device("cpu") and len(seen) == 1
    monkeypatch.setenv("LOCAL_RANK", "9")
    with pytest.raises(ConfigError, match="LOCAL_RANK=9"):
        local_device("cuda")


def test_multi_turn_episode_through_vllm_keeps_the_engine_awake_and_sends_exact_token_prompts(compose, monkeypatch, tmp_path):
    """Episodes call generate once per turn with token-id prompts (prompt + everything so far); inside the
    sampler's session the engine sleeps once at the end, so vLLM's prefix cache (enabled) survives between turns."""
    import rlpost.samplers.episode
    from rlpost.config.schema import ModelConfig
    from rlpost.envs.base import EnvStep
    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.rollout.base import SamplingParams
    from rlpost.samplers.base import SamplerContext
    from rlpost.samplers.episode import EpisodeSampler, render_insert

    class Echo:
        instructions = ""

        def reset(self, example):
            return None

        def step(self, text):
            return EnvStep([{"role": "tool", "content": "ok"}], 0.0, False, {"tool_calls": 1})

    monkeypatch.setattr(rlpost.samplers.episode, "make_env", lambda name, params=None: Echo())
    calls = []
    _fake_vllm(monkeypatch, calls)
    cfg = compose(tiny_overrides("rollout=vllm", "precision=bf16", f"model.cache_dir={tmp_path}"))
    model, tok = load_policy(ModelConfig(source="tiny"), seed=0)
    eng = build_engine(EngineConfig.of(cfg), model, tok, torch.device("cpu"))
    assert calls[0][1]["enable_prefix_caching"] is True
    sent = []
    orig = eng.llm.generate
    eng.llm.generate = lambda inputs, sps, use_tqdm=False: (sent.append([i["prompt_token_ids"] for i in inputs]),
                                                           orig(inputs, sps, use_tqdm))[1]
    res = EpisodeSampler(1, max_turns=3, max_total_tokens=200).sample(
        eng, [[7, 8, 9]], SamplingParams(max_new_tokens=4, seed=1), SamplerContext(step=1))
    assert _kinds(calls[1:]) == ["generate", "generate", "generate", "sleep"]
    assert tok.eos_token_id == 2  # each fake turn ends with the end-of-turn token: it is not inserted again
    ins = render_insert(tok, [{"role": "tool", "content": "ok"}], after_eos=True)
    assert sent == [[[7, 8, 9]], [[7, 8, 9, 4, 2] + ins], [[7, 8, 9, 4, 2] + ins + [4, 2] + ins]]
    g = res.generation
    assert g.response_ids[0].tolist() == [4, 2] + ins + [4, 2] + ins + [4, 2]
    assert g.response_mask[0].tolist() == [1, 1] + [0] * len(ins) + [1, 1] + [0] * len(ins) + [1, 1]
    eng.generate([[1]], SamplingParams(max_new_tokens=2))  # outside a session: asleep again after the call
    assert _kinds(calls[-4:]) == ["wake('weights',)", "wake('kv_cache',)", "generate", "sleep"]


def test_init_dir_is_renamed_into_place_and_a_lost_race_keeps_the_winner(compose, tmp_path):
    """Ranks sharing a cache: the vLLM start directory appears whole or not at all."""
    import shutil

    from rlpost.config.schema import ModelConfig, TinyConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout.vllm import VLLMRolloutEngine
    from rlpost.rollout.base import EngineConfig

    cfg = compose(tiny_overrides(f"model.cache_dir={tmp_path}"))
    model, tok = load_policy(ModelConfig(source="tiny"), seed=0)
    name = VLLMRolloutEngine._init_dir(cfg, model, tok)[0].name
    shutil.rmtree(tmp_path / "vllm_init")
    half = tmp_path / "vllm_init" / name
    half.mkdir(parents=True)
    (half / "model.safetensors").write_text("killed mid-write")  # no config.json: not a finished directory
    path, fresh = VLLMRolloutEngine._init_dir(cfg, model, tok)
    assert path == half and fresh and (path / "config.json").exists()
    assert (path / "model.safetensors").stat().st_size > 1000
    assert [p.name for p in path.parent.iterdir()] == [name]  # no temporary directory left
    stamp = (path / "config.json").stat().st_mtime_ns
    assert VLLMRolloutEngine._init_dir(cfg, model, tok) == (path, False)  # written once; reused, not fresh
    assert (path / "config.json").stat().st_mtime_ns == stamp
    # another shape under the same model name gets its own directory (vLLM must build that architecture)
    wide, _ = load_policy(ModelConfig(source="tiny", tiny=TinyConfig(hidden_size=128, num_attention_heads=2)), seed=0)
    other, fresh = VLLMRolloutEngine._init_dir(cfg, wide, tok)
    assert fresh and other != path and other.name.startswith("tiny-")


def test_cpu_platform_plan_and_engine_arguments(compose, tmp_path):
    """vLLM's CPU platform: no sleep mode, pushes through the in-place reload, KV cache from rollout.cpu_kv_cache_gib,
    eager by default; fp8, several torchrun ranks and speculative decoding are refused with the fix."""
    from rlpost.core.errors import RlpostError
    from rlpost.rollout.vllm import engine_kwargs, platform_plan, reload_items
    from rlpost.rollout.base import EngineConfig

    assert platform_plan("cpu", "fp32") == platform_plan("cpu", "bf16")
    p = platform_plan("cpu", "fp32")
    assert (p.sleep_mode, p.push_method) == (False, "reload_weights")
    assert platform_plan("cuda", "bf16").push_method == "load_weights" and platform_plan("cuda", "fp8").push_method == "reload_weights"
    for args, msg in [(("cpu", "fp8"), "needs a CUDA GPU"), (("cpu", "fp32", 2), "WORLD_SIZE=2"),
                      (("cpu", "fp32", 1, "ngram"), "speculated tokens are wrong"), (("xpu", "fp32"), "'xpu'")]:
        with pytest.raises(RlpostError, match=msg):
            platform_plan(*args)
    cfg = compose(tiny_overrides("rollout=vllm", "rollout.cpu_kv_cache_gib=0.5"))
    cpu, gpu = engine_kwargs(EngineConfig.of(cfg), str(tmp_path), device="cpu"), engine_kwargs(EngineConfig.of(cfg), str(tmp_path), device="cuda")
    assert "enable_sleep_mode" not in cpu and "gpu_memory_utilization" not in cpu
    assert cpu["kv_cache_memory_bytes"] == 2**29 and cpu["enforce_eager"] is True
    assert gpu["enable_sleep_mode"] is True and gpu["gpu_memory_utilization"] == 0.4 and gpu["enforce_eager"] is False
    assert engine_kwargs(compose(tiny_overrides("rollout=vllm", "rollout.enforce_eager=false")), str(tmp_path),
                         device="cpu")["enforce_eager"] is False  # an explicit setting wins
    # the tied head travels with every reload; a gather without it gets the embedding tensor under its name
    emb = torch.ones(3, 2)
    names = [n for n, _ in reload_items({"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(2)}, True)]
    assert names == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert [n for n, _ in reload_items({"model.embed_tokens.weight": emb}, False)] == ["model.embed_tokens.weight"]


def test_engine_on_the_cpu_platform_drives_the_calls_the_real_cpu_engine_needs(compose, monkeypatch, tmp_path):
    """The fake follows vLLM's CPU backend (tests/test_vllm_engine.py runs the real one): no sleep mode and no
    sleep/wake calls, every push through the worker's reload with the tied head included, threads kept, and a
    head size the CPU kernels lack refused before any engine is built."""
    from rlpost.core.errors import RlpostError
    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.rollout.base import SamplingParams

    calls = []
    _fake_vllm(monkeypatch, calls, device="cpu")
    narrow = compose(tiny_overrides("rollout=vllm", f"model.cache_dir={tmp_path}"))  # head size 16
    model, tok = load_policy(narrow.model, seed=0)
    with pytest.raises(RlpostError, match="no kernel for head size 16"):
        build_engine(EngineConfig.of(narrow), model, tok, torch.device("cpu"))
    assert not calls
    cfg = compose(tiny_overrides("rollout=vllm", "model.tiny.hidden_size=128", "model.tiny.num_attention_heads=2",
                                 "model.tiny.num_key_value_heads=1", f"model.cache_dir={tmp_path}"))
    model, tok = load_policy(cfg.model, seed=0)
    threads = torch.get_num_threads()
    eng = build_engine(EngineConfig.of(cfg), model, tok, torch.device("cpu"))
    assert torch.get_num_threads() == threads == eng.threads
    init = calls[0][1]
    assert "enable_sleep_mode" not in init and init["kv_cache_memory_bytes"] == 2**30 and init["enforce_eager"] is True
    eng.generate([[1, 2]], SamplingParams(max_new_tokens=2, seed=0))
    eng.sync_weights(model)
    assert _kinds(calls[1:]) == ["generate", "rpc('reload_weights',)", "reset_prefix_cache"]
    assert "lm_head.weight" in calls[2][2] and "model.embed_tokens.weight" in calls[2][2]
