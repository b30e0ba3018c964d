"""``launcher=ray`` (rlpost/ray_pool): Ray rollout workers give the single-process run, and survive a killed worker.

One local Ray cluster of CPU processes for the whole module (Ray's start-up and each actor's
imports are the slow part: the cases marked slow start more actors).
Each run is two RL steps of REINFORCE++ on the tiny model (batch whitening, KL in the reward,
two mini-batches; 5 prompts, so 2 workers get 3 + 2 groups), compared with the same config
run in this process (``launcher=none``): same prompts, tokens and rewards, weights to tolerance.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from dp_worker import OVERRIDES  # noqa: E402  (the data-parallel test's config)
from conftest import start_local_ray, tiny_overrides  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    start_local_ray()
    yield
    ray.shutdown()


def _run(tmp_path, name, *extra, hook=None, steps=2):
    """``steps`` steps through the configured executor; returns per-step batch tensors and metrics,
    the final weights and the pool's counters."""
    from rlpost.config.compose import compose_config
    from rlpost.run.executor import build_executor
    from rlpost.run.runner import Run

    cfg = compose_config(tiny_overrides(*OVERRIDES, "trainer=torch", f"steps={steps}", *extra))
    r = Run(cfg, tmp_path / name)
    out = []
    learn = r.learn

    def recording_learn(c, sync_engine=True):
        m = learn(c, sync_engine)
        b = c.batch
        out.append({"prompt_index": b.prompt_index.clone(), "response_ids": b.response_ids.clone(),
                    "response_mask": b.response_mask.clone(), "rewards": b.rewards.clone(),
                    "advantages": b.extras["advantages"].clone(), "metrics": m})
        return m

    r.learn = recording_learn
    ex = None
    try:
        if hook is not None:
            r.engine.after_submit = hook
        ex = build_executor(cfg, r)
        for _ in range(steps):
            ex.step()
        return {"steps": out, "weights": {k: v.detach().clone() for k, v in r.trainer.policy.state_dict().items()},
                "rows": list(getattr(r.engine, "rows_generated", [])), "placed": getattr(r.engine, "placed", None)}
    finally:
        if ex is not None:
            ex.close()
        r.close()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), "single")


def _assert_same(one, two):
    for s1, s2 in zip(one["steps"], two["steps"], strict=True):
        for k in ("prompt_index", "response_ids", "response_mask", "rewards"):
            assert torch.equal(s1[k], s2[k]), k
        assert len(set(s1["rewards"].tolist())) > 2  # a real learning signal, not all-equal rewards
        torch.testing.assert_close(s1["advantages"], s2["advantages"], atol=1e-5, rtol=1e-5)
        assert s1["metrics"]["loss/policy"] == pytest.approx(s2["metrics"]["loss/policy"], abs=1e-5)
    w1, w2 = one["weights"], two["weights"]
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 2e-5
    # the second step's rollouts came from updated weights, so equality needed the push after step 1
    assert one["steps"][1]["metrics"]["rollout/policy_version"] > 0


@pytest.mark.parametrize("placement,sync", [("colocated", "object_store"),
                                            pytest.param("disaggregated", "collective", marks=pytest.mark.slow)])
def test_ray_workers_equal_the_single_process_run(cluster, single, tmp_path, placement, sync):
    two = _run(tmp_path, placement, "launcher=ray", "launcher.num_rollout_workers=2",
               f"launcher.placement={placement}", f"launcher.weight_sync={sync}", "launcher.cpus_per_worker=1")
    _assert_same(single, two)
    assert two["rows"] == [24, 16]  # 3 + 2 groups of 4 per step, 2 steps: no group split across workers
    assert len({pid for pid, _ in two["placed"]}) == 2 and os.getpid() not in {pid for pid, _ in two["placed"]}
    m = two["steps"][1]["metrics"]
    assert m["ray/workers"] == 2.0 and m["ray/worker_failures"] == 0.0
    assert m["ray/worker_cpu_s"] > 0 and m["ray/weight_push_s"] > 0


# the fast case needs no new actor (the remaining worker takes the rows); a replacement's start-up is slow
@pytest.mark.parametrize("restarts,executor", [(0, "async"), pytest.param(1, "sync", marks=pytest.mark.slow)])
def test_a_worker_killed_mid_step_is_recovered_and_the_run_is_unchanged(cluster, single, tmp_path, restarts, executor):
    """Killed in step 2 while its slice is in flight; under ``executor=async`` (staleness 0) the producer
    thread drives the workers, the learner then sees exactly the synchronous run's batches."""
    calls = []

    def kill_second_worker_in_step_two(pool, futures):
        calls.append(len(futures))
        if len(calls) == 2:  # the second generate call: step 2's rollouts are in flight
            ray.kill(pool.workers[1])

    two = _run(tmp_path, f"kill{restarts}", "launcher=ray", "launcher.num_rollout_workers=2",
               f"launcher.max_restarts={restarts}", "launcher.cpus_per_worker=0.5", f"executor={executor}",
               "executor.max_staleness=0", hook=kill_second_worker_in_step_two)
    _assert_same(single, two)
    m1, m2 = two["steps"][0]["metrics"], two["steps"][1]["metrics"]
    assert m1["ray/worker_failures"] == 0.0
    assert m2["ray/worker_failures"] == 1.0 and m2["ray/worker_restarts"] == float(restarts)
    # 2 groups were regenerated: on the replacement (slot 1) or on the remaining worker (slot 0)
    assert two["rows"] == ([24, 16] if restarts else [32, 8])


@pytest.mark.slow
def test_async_workers_generate_ahead_within_the_staleness_bound_with_partial_rollouts(cluster, tmp_path):
    """``executor=async max_staleness=1`` with partial rollouts: the producer thread keeps the Ray workers one
    step ahead of the learner; every row is within the bound at the step its rounds ran under."""
    run = _run(tmp_path, "async1", "launcher=ray", "launcher.cpus_per_worker=0.5", "executor=async",
               "executor.max_staleness=1", "executor.partial_rollout=true", "executor.over_provision=1.5",
               "executor.partial_chunk_tokens=4", "algo=grpo", "algo.mini_batches=1", steps=3)
    ms = [s["metrics"] for s in run["steps"]]
    assert [m["step"] for m in ms] == [1, 2, 3]
    assert all(m["async/staleness_hist_0"] + m["async/staleness_hist_1"] + m.get("async/staleness_hist_over_k", 0)
               == pytest.approx(1.0) for m in ms)
    assert max(m["async/staleness_max"] for m in ms) >= 1  # the workers did generate ahead of the learner
    assert sum(m["ray/worker_cpu_s"] for m in ms) > 0 and all(m["ray/worker_failures"] == 0 for m in ms)


def test_bad_launcher_settings_are_one_line_config_errors(compose, monkeypatch):
    import importlib.util

    from rlpost.config.compose import validate_config
    from rlpost.core.errors import ConfigError

    for extra, words in ((["launcher.num_rollout_workers=0"], "num_rollout_workers=0 must be >= 1"),
                         (["launcher.placement=colocate"], "Fix: launcher.placement=colocated"),
                         (["launcher.weight_sync=nccl"], "launcher.weight_sync='nccl' is unknown"),
                         (["launcher.weight_sync=collective", "launcher.gpus_per_worker=0.5"], "one GPU per rank"),
                         (["trainer=deepspeed", "trainer.num_procs=2"], "trainer.num_procs=1"),
                         (["sampler=adaptive_temperature"], "launcher=none")):
        with pytest.raises(ConfigError, match=words) as e:
            validate_config(compose(tiny_overrides("launcher=ray", *extra)))
        assert "\n" not in str(e.value)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "ray" else real(n, *a))
    with pytest.raises(ConfigError, match=r"pip install"):
        validate_config(compose(tiny_overrides("launcher=ray")))
    validate_config(compose(tiny_overrides("launcher=none")))  # Ray is not needed without it
    with pytest.raises(Exception, match="launcher.bogus|bogus"):  # a misspelt key is refused by the schema
        compose(tiny_overrides("launcher=ray", "launcher.bogus=1"))


def test_state_arrays_round_trip_keeps_dtypes_and_values():
    from rlpost.ray_pool.ray_workers import arrays_state, state_arrays

    s = {"a": torch.randn(3, 2), "b": torch.randn(4).to(torch.bfloat16), "c": torch.arange(5)}
    back = arrays_state(state_arrays(s))
    for k in s:
        assert back[k].dtype == s[k].dtype and torch.equal(back[k], s[k])
