"""Real vLLM engines (vLLM's CPU backend) that each test builds itself: LoRA, the run loop, Ray workers.

vLLM keeps one set of parallel groups per process, and an engine's teardown destroys them, so two live
engines cannot share a process: tests/test_vllm_engine.py shares one engine for its module, and every
test here builds its own after that module's engine is gone, and closes it. Marker ``vllm``; skipped
without vLLM except under CI.
"""

from __future__ import annotations

import pytest
import torch

from test_vllm_engine import TOL, _batch, _engine_scores, _overrides, _prompts, _trainer  # (skips this module without vLLM)

pytestmark = pytest.mark.vllm

from conftest import start_local_ray, tiny_overrides  # noqa: E402


@pytest.fixture(scope="module")
def cfg():
    from rlpost.config.compose import compose_config

    return compose_config(_overrides())


@pytest.fixture(scope="module")
def policy(cfg):
    from rlpost.models.loader import load_policy

    return load_policy(cfg.model)


def test_lora_adapters_are_served_through_lora_requests_and_never_stale(cfg):
    """model.lora.rank > 0: the engine runs the base weights with vLLM's LoRA support; after each push its
    log-probs equal the trainer's PEFT forward, the first push changes them from the base model's, and the
    second push (other adapter weights) is served, not the first adapter cached under an old id."""
    from omegaconf import OmegaConf

    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.rollout.base import SamplingParams

    c = OmegaConf.merge(cfg, OmegaConf.from_dotlist(["model.lora.rank=8", "model.lora.alpha=16",
                                                      "model.lora.target_modules=[q_proj,v_proj,up_proj]"]))
    model, tok = load_policy(c.model, seed=1)
    eng = build_engine(EngineConfig.of(c), model, tok, torch.device("cpu"))
    try:
        assert eng.lora and eng.lora_request is None
        gen = eng.generate(_prompts(tok, 3), SamplingParams(max_new_tokens=10, seed=2))
        m = gen.response_mask > 0
        t = _trainer(c, model)
        base, _ = t.compute_logprobs(_batch(gen))  # lora_B = 0 at start: the base model
        assert (base - gen.rollout_logprobs)[m].abs().max().item() < TOL
        seen = []
        for k in range(2):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(10 + k)))
            eng.sync_weights(model)
            assert eng.lora_request.lora_int_id == k + 1
            got = _engine_scores(eng, gen)
            want, _ = t.compute_logprobs(_batch(gen))
            assert (got - want)[m].abs().max().item() < 5 * TOL, k
            seen.append(got)
        assert (seen[0] - base)[m].abs().max().item() > 1e-2  # the adapter changed the log-probs
        assert (seen[1] - seen[0])[m].abs().max().item() > 1e-2  # the second push is what is served
    finally:
        eng.close()


def test_speculative_decoding_on_cpu_is_refused_with_the_reason(policy):
    from rlpost.config.compose import compose_config
    from rlpost.core.errors import RlpostError
    from rlpost.rollout import EngineConfig, build_engine
    model, tok = policy
    c = compose_config([o for o in _overrides() if o != "rollout=vllm"] + ["rollout=vllm_ngram"])
    with pytest.raises(RlpostError, match="speculated tokens are wrong.*rollout=hf_self_spec"):
        build_engine(EngineConfig.of(c), model, tok, torch.device("cpu"))


def test_rlpost_train_with_rollout_vllm_trains_and_logs_a_small_logprob_gap(tmp_path):
    """The run loop with the real engine: 2 steps of GRPO on a tiny random Llama whose head size vLLM's CPU
    kernels support; rewards, rollout/logprob_gap and held-out accuracy are logged, the gap is fp32 noise."""
    import json

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(tiny_overrides("rollout=vllm", "model.tiny.hidden_size=128", "model.tiny.num_attention_heads=2",
                                        "model.tiny.num_key_value_heads=1", "rollout.cpu_kv_cache_gib=0.25", "steps=2",
                                        "eval.at_end=true", f"model.cache_dir={tmp_path / 'cache'}"))
    train(cfg, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert abs(r["rollout/logprob_gap"]) < 1e-3, r["rollout/logprob_gap"]
    assert any("eval/accuracy" in r for r in rows)


VLLM_TINY = ("rollout=vllm", "model.tiny.hidden_size=128", "model.tiny.num_attention_heads=2",
             "model.tiny.num_key_value_heads=1", "rollout.cpu_kv_cache_gib=0.25")


def _two_steps(tmp_path, name, *extra):
    """Two RL steps through the configured executor; the batches' tokens and rewards, and the final weights."""
    from rlpost.config.compose import compose_config
    from rlpost.run.executor import build_executor
    from rlpost.run.runner import Run

    cfg = compose_config(tiny_overrides(*VLLM_TINY, "steps=2", f"model.cache_dir={tmp_path / 'cache'}", *extra))
    r = Run(cfg, tmp_path / name)
    out = []
    learn = r.learn

    def recording_learn(c, sync_engine=True):
        m = learn(c, sync_engine)
        out.append((c.batch.response_ids.clone(), c.batch.rollout_logprobs.clone(), m))
        return m

    r.learn = recording_learn
    ex = build_executor(cfg, r)
    try:
        for _ in range(2):
            ex.step()
        return out, {k: v.detach().clone() for k, v in r.trainer.policy.state_dict().items()}
    finally:
        ex.close()
        r.close()


def test_ray_rollout_workers_with_vllm_give_the_single_process_run(tmp_path):
    """launcher=ray with one vLLM rollout worker (a Ray actor with its own in-process engine, weights through the
    object store): the same tokens, rollout log-probs and final weights as rollout=vllm in this process."""
    import ray

    start_local_ray()
    try:
        single, w1 = _two_steps(tmp_path, "single")
        pooled, w2 = _two_steps(tmp_path, "ray", "launcher=ray", "launcher.num_rollout_workers=1")
    finally:
        ray.shutdown()
    for (ids1, lp1, m1), (ids2, lp2, m2) in zip(single, pooled, strict=True):
        assert torch.equal(ids1, ids2)
        assert (lp1 - lp2).abs().max().item() < TOL
    assert pooled[1][2]["rollout/policy_version"] > 0  # step 2 sampled from the pushed weights
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5
