"""ROLL (arXiv:2506.06122): the per-stage device mapping and the Ray reward workers.

The mapping's checks and resolution are pure (rlpost/ray_pool/device_mapping.py): every
expected placement below is worked by hand from the rules in its module doc (worker ``i``
on ``rollout[i % len(rollout)]``, id -> ``cuda:<id>``, the driver's ``CUDA_VISIBLE_DEVICES``
entry as the worker's physical device). One test starts a local Ray cluster: the reward
workers' scores equal the in-process scores, a crashing worker is replaced and its rows
rescored, a hung one is killed at its deadline, and a one-step run uses both features.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import pytest

from rlpost.core.errors import ConfigError
from rlpost.ray_pool import device_mapping as D
from rlpost.ray_pool.reward_workers import split_rows

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from conftest import start_local_ray, tiny_overrides  # noqa: E402


def plan(mapping, n_visible=4, workers=2, env=None, **kw):
    return D.resolve(mapping, n_visible=n_visible, num_rollout_workers=workers, env=env or {}, **kw)


# --------------------------------------------------------------------------- resolution by hand


def test_disaggregated_rollout_and_colocated_reward_resolve_by_hand():
    p = plan({"actor": [0], "rollout": [1, 2], "reward": [0]}, workers=4, has_model_rewards=True)
    assert p.cuda
    assert p.stages["actor"].devices == ("cuda:0",)
    # worker i on rollout[i % 2]: 1, 2, 1, 2; two workers per device
    assert p.stages["rollout"].worker_ids == (1, 2, 1, 2)
    assert p.stages["rollout"].worker_visible == ("1", "2", "1", "2")
    assert p.workers_per_device == {1: 2, 2: 2}
    assert not p.rollout_exclusive()  # shared by two workers each: no NCCL broadcast
    # reference and critic follow the actor
    assert p.stages["reference"].ids == (0,) and p.stages["critic"].devices == ("cuda:0",)
    assert p.sharing == {("actor", "rollout"): "disaggregated", ("actor", "reward"): "colocated",
                         ("rollout", "reward"): "disaggregated"}
    assert p.device("reward") == "cuda:0" and p.device("actor") == "cuda:0"
    assert "disaggregated from actor" in p.describe("rollout")
    assert "time-shares its devices with actor" in p.describe("reward")


def test_one_worker_per_free_device_is_exclusive_and_partial_overlap_is_named():
    p = plan({"actor": [0], "rollout": [1, 2]}, workers=2)
    assert p.stages["rollout"].worker_ids == (1, 2) and p.rollout_exclusive()
    q = plan({"actor": [0], "rollout": [0, 1]}, workers=2)
    assert q.sharing[("actor", "rollout")] == "partly shared" and not q.rollout_exclusive()
    c = plan({"actor": [1], "rollout": [1]}, workers=3)  # ROLL's colocated layout: time-sharing one device
    assert c.sharing[("actor", "rollout")] == "colocated" and c.stages["rollout"].worker_ids == (1, 1, 1)


def test_ids_map_through_the_drivers_cuda_visible_devices():
    # the driver sees physical GPUs 4..7 as ids 0..3: worker on id 2 must be started with CUDA_VISIBLE_DEVICES=6
    p = plan({"actor": [0], "rollout": [2, 3]}, env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert p.stages["rollout"].worker_visible == ("6", "7")
    assert D.worker_runtime_env("6") == {"env_vars": {"CUDA_VISIBLE_DEVICES": "6",
                                                      "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}


def test_cpu_plan_maps_every_id_to_cpu_and_skips_the_count():
    p = plan({"actor": [0], "rollout": [5, 9]}, n_visible=None, workers=2)
    assert not p.cuda
    assert set(p.stages["rollout"].devices) == {"cpu"} and p.stages["rollout"].worker_visible == ()
    assert p.describe("actor").startswith("on cpu (device ids [0])")
    assert D.resolve(None, n_visible=4, num_rollout_workers=2) is None


@pytest.mark.parametrize("mapping,kw,match", [
    ({"actor": [0], "rolout": [1]}, {}, "did you mean rollout"),
    ({"actor": [0]}, {}, "has no rollout"),
    ({"rollout": [1]}, {}, "has no actor"),
    ({"actor": [0], "rollout": "1"}, {}, "not a list of device ids"),
    ({"actor": [0], "rollout": [-1]}, {}, "integers >= 0"),
    ({"actor": [0], "rollout": [1.5]}, {}, "integers >= 0"),
    ({"actor": [0], "rollout": []}, {}, "is empty"),
    ({"actor": [0], "rollout": [1, 1]}, {}, r"names device\(s\) \[1\] twice"),
    ({"actor": [0], "rollout": [1, 4]}, {}, r"\[4\], but 4 device\(s\) are visible"),
    ({"actor": [0, 1], "rollout": [2]}, {"workers": 1}, r"trainer runs 1 process"),
    ({"actor": [0], "rollout": [1], "reference": [2]}, {}, "separate reference devices are not built"),
    ({"actor": [0], "rollout": [1], "critic": [1]}, {}, "separate critic devices are not built"),
    ({"actor": [0], "rollout": [1, 2, 3]}, {"workers": 2}, r"device\(s\) \[3\] would get no worker"),
    ({"actor": [0], "rollout": [1], "reward": [2]}, {}, "this config has none"),
    ({"actor": [0], "rollout": [1], "reward": [2, 3]}, {"has_model_rewards": True}, "on one device"),
    ([0, 1], {}, "not a mapping"),
])
def test_mapping_errors(mapping, kw, match):
    kw = dict(kw)
    workers = kw.pop("workers", 2)
    with pytest.raises(ConfigError, match=match):
        plan(mapping, workers=workers, **kw)


def test_reference_and_critic_equal_to_actor_are_accepted():
    p = plan({"actor": [0], "rollout": [1], "reference": [0], "critic": [0]}, workers=1)
    assert p.stages["reference"].devices == ("cuda:0",)


# --------------------------------------------------------------------------- the config path


def _cfg(*extra):
    from rlpost.config.compose import compose_config

    return compose_config(tiny_overrides("launcher=ray", "device=cpu", *extra))


def test_config_errors_and_the_graph():
    pytest.importorskip("ray")
    from rlpost.config.compose import compose_config, validate_config
    from rlpost.run.runner import format_graph

    for extra, match in [
        (["launcher.device_mapping={actor:[0],rollout:[1]}", "launcher.gpus_per_worker=1"], "assign devices twice"),
        (["launcher.device_mapping={actor:[0],rollout:[1]}", "launcher.placement=disaggregated"], "other nodes"),
        (["launcher.reward_workers=-1"], "reward_workers=-1"),
        (["launcher.reward_workers=1", "launcher.cpus_per_reward_worker=0"], "must be > 0"),
        (["launcher.reward_max_restarts=-1"], "reward_max_restarts"),
    ]:
        with pytest.raises(ConfigError, match=match):
            validate_config(_cfg(*extra))
    with pytest.raises(ConfigError, match="launcher=none has none of"):
        validate_config(compose_config(tiny_overrides("launcher.reward_workers=2")))
    cfg = _cfg("launcher.device_mapping={actor:[0],rollout:[1,2]}", "launcher.reward_workers=2")
    validate_config(cfg)
    g = format_graph(cfg)
    assert "in 2 Ray workers (pinned by launcher.device_mapping); on cpu (device ids [1, 2])" in g
    assert "the verifier in 2 Ray reward workers" in g
    assert "policy_update" in g and "on cpu (device ids [0]) (disaggregated from rollout)" in g
    # a CUDA plan from the same config, with 2 devices visible: device 2 does not exist
    with pytest.raises(ConfigError, match=r"\[2\], but 2 device\(s\) are visible"):
        D.plan_from_config(cfg, n_visible=2, cuda=True)
    p = D.plan_from_config(cfg, n_visible=3, cuda=True)
    assert p.stages["rollout"].devices == ("cuda:1", "cuda:2")


def test_split_rows_by_hand():
    assert split_rows(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_rows(2, 4) == [(0, 1), (1, 2)]
    assert split_rows(0, 2) == []
    with pytest.raises(ValueError):
        split_rows(3, 0)


# --------------------------------------------------------------------------- Ray reward workers


class TrickyTask:
    """A verifier that scores ``response == answer``, raises on ``RAISE``, returns NaN on ``NAN``,
    kills its process on ``CRASH`` and hangs on ``HANG`` (pickled by value to the Ray workers)."""

    def score(self, response, example):
        if response == "CRASH":
            os._exit(3)
        if response == "HANG":
            time.sleep(60)
        if response == "RAISE":
            raise ValueError("bad verifier")
        if response == "NAN":
            return math.nan
        return 1.0 if response == example.answer else 0.0

    def format_ok(self, response):
        return response.isdigit()


class Ex:
    def __init__(self, answer, index=0):
        self.answer, self.index, self.question = answer, index, f"q{index}"


def test_ray_reward_workers_equal_in_process_scores_and_survive_crashes(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    import torch
    from ray import cloudpickle

    from rlpost.ray_pool import reward_workers as RW
    from rlpost.rewards.scoring import RewardFunction

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    start_local_ray()
    local = RewardFunction(TrickyTask(), timeout_s=1.0, format_weight=0.5)
    remote = RewardFunction(TrickyTask(), timeout_s=1.0, format_weight=0.5)
    pool = None
    try:
        pool = RW.RayRewardPool(TrickyTask(), 2, cpus=0.5, timeout_s=1.0, max_restarts=1)
        remote.backend = pool
        exs = [Ex(str(i)) for i in range(6)]
        resp = ["0", "x", "RAISE", "3", "NAN", "5"]
        lens = torch.ones(6)
        a, b = local.score(resp, exs, lens), remote.score(resp, exs, lens)
        # 0 and 3 and 5 right (1 + 0.5 format), x wrong, RAISE and NAN errors
        assert b.total.tolist() == a.total.tolist() == [1.5, 0.0, 0.0, 1.5, 0.0, 1.5]
        assert b.metrics["reward/verifier_errors"] == a.metrics["reward/verifier_errors"] == 2
        assert b.metrics["reward/worker_failures"] == 0 and b.metrics["reward/workers"] == 2
        pids = {pid for pid, _ in pool.placed}
        assert os.getpid() not in pids and len(pids) == 2

        # worker 1 (rows 3-5) dies on CRASH: replaced, and its rows rescored in the driver's verifier process
        resp = ["0", "1", "x", "CRASH", "4", "y"]
        a, b = local.score(resp, exs, lens), remote.score(resp, exs, lens)
        assert b.total.tolist() == a.total.tolist() == [1.5, 1.5, 0.0, 0.0, 1.5, 0.0]
        assert b.metrics["reward/verifier_errors"] == a.metrics["reward/verifier_errors"] == 1
        assert b.metrics["reward/worker_failures"] == 1 and b.metrics["reward/worker_restarts"] == 1
        assert b.metrics["reward/worker_rescored"] == 3
        # the replacement scores the next batch itself
        resp = ["0", "1", "2", "3", "4", "5"]
        b = remote.score(resp, exs, lens)
        assert b.total.tolist() == [1.5] * 6 and b.metrics["reward/worker_rescored"] == 0
        assert b.metrics["reward/workers"] == 2

        # a hung worker is killed at its deadline (timeout 1 s x 3 rows + grace); no replacement is left,
        # so the pool runs on one worker and the hung rows score 0 as verifier timeouts
        monkeypatch.setattr(RW, "GRACE_S", 1.0)
        resp = ["0", "1", "2", "HANG", "4", "5"]
        t0 = time.monotonic()
        b = remote.score(resp, exs, lens)
        assert time.monotonic() - t0 < 20
        assert b.total.tolist() == [1.5, 1.5, 1.5, 0.0, 1.5, 1.5]
        assert b.metrics["reward/worker_timeouts"] == 1 and b.metrics["reward/verifier_timeouts"] == 1
        assert b.metrics["reward/worker_restarts"] == 0 and b.metrics["reward/workers"] == 1
        remote.close()  # frees the workers' CPUs for the run below

        # one RL step of the tiny model with both features on CPU: the mapping resolves to cpu, one rollout worker,
        # one reward worker; the run's reward function scores through the pool
        m = _one_step(tmp_path)
        assert m["reward/worker_failures"] == 0.0 and m["reward/worker_rescored"] == 0.0  # present: the pool scored
        assert m["ray/workers"] == 1.0 and m["reward/verifier_calls"] == 16.0
    finally:
        local.close()
        remote.close()
        ray.shutdown()


def _one_step(tmp_path):
    from rlpost.config.compose import compose_config
    from rlpost.run.executor import build_executor
    from rlpost.run.runner import Run

    cfg = compose_config(tiny_overrides(
        "trainer=torch", "steps=1", "device=cpu", "launcher=ray", "launcher.num_rollout_workers=1",
        "launcher.cpus_per_worker=0.5", "launcher.reward_workers=1", "launcher.cpus_per_reward_worker=0.5",
        "launcher.device_mapping={actor:[0],rollout:[1]}"))
    r = Run(cfg, tmp_path / "run")
    ex = None
    try:
        assert r.devices.stages["rollout"].worker_ids == (1,) and str(r.device) == "cpu"
        assert r.reward_fn.backend is not None and len(r.reward_fn.backend.live()) == 1
        out = []
        learn = r.learn
        r.learn = lambda c, sync_engine=True: out.append(learn(c, sync_engine)) or out[-1]
        ex = build_executor(cfg, r)
        ex.step()
        return out[0]
    finally:
        if ex is not None:
            ex.close()
        r.close()
