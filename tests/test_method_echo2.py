"""ECHO-2's provisioning (arXiv:2602.02192): the overlap capacity model, the rule, the broadcast latency, activation.

Numbers are worked by hand in the comments from the formulas in
rlpost/ray_pool/provisioning.py (our reading of the paper's Section 3, see its module doc).
No model is loaded and no Ray cluster is started: the pool's wiring is checked with the
pool class replaced.
"""

from __future__ import annotations

import math

import pytest

from rlpost.core.errors import ConfigError
from rlpost.ray_pool import provisioning as P
from rlpost.ray_pool.provisioning import WorkerKind

# --------------------------------------------------------------------------- capacity model and rule


def test_publish_period_defaults_to_s_minus_1_and_checks_its_range():
    assert P.publish_period(3) == 2
    assert P.publish_period(7) == 6
    assert P.publish_period(1, publish_every=1) == 1
    with pytest.raises(ConfigError, match="S >= 2"):
        P.publish_period(1)
    with pytest.raises(ConfigError, match="1..S"):
        P.publish_period(3, publish_every=4)
    with pytest.raises(ConfigError, match="1..S"):
        P.publish_period(3, publish_every=0)


def test_required_throughput_hand_computed():
    # kappa R / (kappa T_train - T_bcast) = 2*64 / (2*10 - 5) = 128/15
    assert P.required_throughput(64, 10.0, 5.0, 2) == pytest.approx(128 / 15)
    # no dissemination: one batch per learner step, R / T_train, whatever kappa
    assert P.required_throughput(64, 10.0, 0.0, 3) == pytest.approx(6.4)
    # a longer period amortises the same broadcast: kappa=4 -> 256 / 35
    assert P.required_throughput(64, 10.0, 5.0, 4) == pytest.approx(256 / 35)


def test_rule_is_exactly_the_overlap_boundary():
    req = P.required_throughput(64, 10.0, 5.0, 2)
    learn, roll = P.cycle_s(64, 10.0, 5.0, 2, req)
    assert learn == pytest.approx(20.0) and roll == pytest.approx(20.0)  # 5 + 128 / (128/15) = 20
    assert P.learner_utilization(64, 10.0, 5.0, 2, req) == pytest.approx(1.0)
    assert P.learner_utilization(64, 10.0, 5.0, 2, 2 * req) == pytest.approx(1.0)  # more workers: still 1
    # half the throughput: rollout side 5 + 128 / (64/15) = 35 s against 20 s of training
    assert P.learner_utilization(64, 10.0, 5.0, 2, req / 2) == pytest.approx(20 / 35)


def test_dissemination_that_fills_the_period_is_an_error():
    with pytest.raises(ConfigError, match="no number of workers"):
        P.required_throughput(64, 10.0, 20.0, 2)  # 2*10 - 20 = 0
    with pytest.raises(ConfigError, match="> 0"):
        P.required_throughput(0, 10.0, 0.0, 1)


def test_workers_needed_rounds_up_but_not_on_an_exact_ratio():
    assert P.workers_needed(128 / 15, 2.0) == 5  # 4.27 -> 5
    assert P.workers_needed(6.4, 0.8) == 8  # 6.4/0.8 = 8.000000000000002 in floats
    assert P.workers_needed(0.1, 5.0) == 1
    with pytest.raises(ConfigError, match="worker_rollouts_per_s"):
        P.workers_needed(1.0, 0.0)


# --------------------------------------------------------------------------- dissemination


def test_pipelined_broadcast_hand_computed():
    # M = 8 GB, B = 1 GB/s, N = 4 workers, C = 8 chunks: (8 + 3) chunk-hops of 1 s
    assert P.pipelined_broadcast_s(8e9, 1e9, 4, 8) == pytest.approx(11.0)
    # one chunk is store-and-forward along the chain: N M / B, the same as one-to-many uploads
    assert P.pipelined_broadcast_s(8e9, 1e9, 4, 1) == pytest.approx(32.0)
    assert P.one_to_many_broadcast_s(8e9, 1e9, 4) == pytest.approx(32.0)
    # per-hop latency 0.5 s per chunk-hop: 11 * 1.5
    assert P.pipelined_broadcast_s(8e9, 1e9, 4, 8, hop_latency_s=0.5) == pytest.approx(16.5)
    # many chunks approach one transfer M / B = 8 s however many workers: 1003 * 0.008
    assert P.pipelined_broadcast_s(8e9, 1e9, 4, 1000) == pytest.approx(8.024)
    with pytest.raises(ConfigError):
        P.pipelined_broadcast_s(8e9, 1e9, 0, 8)


# --------------------------------------------------------------------------- cost-aware activation


KINDS = [WorkerKind("a", 10.0, 3.0, 2), WorkerKind("b", 4.0, 1.0, 5), WorkerKind("c", 7.0, 2.5, 3)]


def test_cheapest_activation_hand_computed():
    # need 12/s: b x3 = 12/s for 3/h; a+b = 14/s for 4, c x2 = 14/s for 5, a x2 = 20/s for 6
    act = P.cheapest_activation(KINDS, 12.0)
    assert act.counts == {"b": 3} and act.cost_per_hour == pytest.approx(3.0) and act.throughput == pytest.approx(12.0)
    # need 21/s: a x2 = 20 and b x5 = 20 are short; a + b x3 = 22/s for 6/h; b x4 + c = 23/s for 6.5,
    # a x2 + b = 24/s for 7, c x3 = 21/s for 7.5
    act = P.cheapest_activation(KINDS, 21.0)
    assert act.counts == {"a": 1, "b": 3} and act.cost_per_hour == pytest.approx(6.0)


def test_exact_optimum_beats_greedy_by_cost_per_rollout():
    # greedy (lowest cost per rollout first) takes "big" (0.5 per rollout/s) for 5/h; one "small" (0.67) costs 2/h
    kinds = [WorkerKind("big", 10.0, 5.0, 1), WorkerKind("small", 3.0, 2.0, 5)]
    act = P.cheapest_activation(kinds, 3.0)
    assert act.counts == {"small": 1} and act.cost_per_hour == pytest.approx(2.0)


def test_ties_in_cost_go_to_fewer_workers():
    kinds = [WorkerKind("x", 2.0, 1.0, 4), WorkerKind("y", 4.0, 2.0, 2)]
    assert P.cheapest_activation(kinds, 4.0).counts == {"y": 1}  # x x2 costs the same with two workers


def test_activation_brute_force_agrees_on_a_grid():
    import itertools

    for need in (0.5, 3.0, 9.9, 17.0, 23.0, 40.0, 61.0):
        best = min((sum(n * k.cost_per_hour for n, k in zip(ns, KINDS)), ns)
                   for ns in itertools.product(*(range(k.count + 1) for k in KINDS))
                   if sum(n * k.rollouts_per_s for n, k in zip(ns, KINDS)) >= need)
        assert P.cheapest_activation(KINDS, need).cost_per_hour == pytest.approx(best[0]), need


def test_activation_errors():
    with pytest.raises(ConfigError, match="gives 61 rollouts/s"):
        P.cheapest_activation(KINDS, 62.0)  # 20 + 20 + 21
    with pytest.raises(ConfigError, match="empty"):
        P.cheapest_activation([], 1.0)
    with pytest.raises(ConfigError, match="cost_per_hr"):
        P.parse_kinds([{"name": "a", "rollouts_per_s": 1, "cost_per_hr": 1, "count": 1}])
    with pytest.raises(ConfigError, match="duplicate"):
        P.parse_kinds([{"name": "a", "rollouts_per_s": 1, "cost_per_hour": 1, "count": 1}] * 2)


# --------------------------------------------------------------------------- a config's plan


def _settings(**kw):
    return P.check_provisioning({"train_s": 40.0, **kw})


def test_plan_iterates_the_broadcast_to_its_own_pool_size():
    # M/B = 12.8 s, 64 chunks of 0.2 s: at 1 worker T_bcast = 12.8, req = 128/67.2 = 1.905 -> 4 workers of 0.5/s;
    # at 4 workers T_bcast = 67 * 0.2 = 13.4, req = 128/66.6 = 1.922 -> still 4
    p = P.plan(_settings(worker_rollouts_per_s=0.5, model_bytes=16e9, link_bytes_per_s=1.25e9, chunks=64), 64, 3)
    assert (p.kappa, p.n_workers) == (2, 4)
    assert p.bcast_s == pytest.approx(13.4) and p.required == pytest.approx(128 / 66.6)
    assert p.utilization == pytest.approx(1.0)


def test_plan_with_kinds_and_declared_bcast():
    # S=3 -> kappa=2; T_train=4, T_bcast=2: req = 2*42 / (8 - 2) = 14/s -> a + b (14/s, 4/h)
    p = P.plan(P.check_provisioning({"train_s": 4.0, "bcast_s": 2.0, "worker_kinds": [
        {"name": k.name, "rollouts_per_s": k.rollouts_per_s, "cost_per_hour": k.cost_per_hour, "count": k.count}
        for k in KINDS]}), 42, 3)
    assert p.required == pytest.approx(14.0)
    assert p.activation.counts == {"a": 1, "b": 1} and p.n_workers == 2
    assert any("a x1, b x1" in line for line in p.lines())


def test_plan_errors():
    with pytest.raises(ConfigError, match="unknown key"):
        P.check_provisioning({"trian_s": 4})
    with pytest.raises(ConfigError, match="train_s"):
        P.plan(P.check_provisioning({"worker_rollouts_per_s": 1}), 8, 3)
    with pytest.raises(ConfigError, match="exactly one"):
        P.plan(_settings(), 8, 3)
    with pytest.raises(ConfigError, match="link_bytes_per_s"):
        P.plan(_settings(worker_rollouts_per_s=1, model_bytes=1e9), 8, 3)


# --------------------------------------------------------------------------- wiring into launcher=ray

AUTO = ["launcher=ray", "launcher.num_rollout_workers=auto", "executor=async", "executor.max_staleness=3",
        "launcher.provisioning.train_s=10", "launcher.provisioning.worker_rollouts_per_s=2"]


def test_auto_resolves_through_the_config(compose):
    from rlpost.config.compose import validate_config
    from rlpost.ray_pool import resolve_num_workers
    from rlpost.run.runner import format_graph

    cfg = compose(AUTO)
    validate_config(cfg)
    # R = 8 prompts x 8 samples = 64, kappa = 2, no broadcast: 64/10 = 6.4/s -> 4 workers of 2/s
    assert resolve_num_workers(cfg) == 4
    assert "in 4 Ray workers" in format_graph(cfg) and ">= 6.4 rollouts/s" in format_graph(cfg)
    assert resolve_num_workers(compose(["launcher=ray"])) == 2  # a number stays itself


def test_build_rollout_backend_hands_the_pool_a_number(compose, monkeypatch):
    import rlpost.ray_pool as RP

    seen = {}
    monkeypatch.setattr(RP, "RayRolloutPool", lambda lc, ec, local, policy: seen.setdefault("n", lc.num_rollout_workers))
    cfg = compose(AUTO)
    RP.build_rollout_backend(cfg.launcher, None, None, None, cfg=cfg)
    assert seen["n"] == 4


@pytest.mark.parametrize("extra, match", [
    (["launcher.num_rollout_workers=many"], "neither a number nor auto"),
    (["launcher.num_rollout_workers=auto"], "train_s"),
    (["+launcher.provisioning.trian_s=3"], "unknown key"),
    (["launcher.num_rollout_workers=auto", "launcher.provisioning.train_s=1",
      "launcher.provisioning.worker_rollouts_per_s=1"], "S >= 2"),  # executor=sync: S = 0
])
def test_config_errors(compose, extra, match):
    from rlpost.config.compose import validate_config

    with pytest.raises(ConfigError, match=match):
        validate_config(compose(["launcher=ray", *extra]))


def test_a_plan_above_max_workers_names_the_units(compose):
    """A worker rate given per hour instead of per second plans 7,200x the pool: refused, naming both units."""
    from rlpost.config.compose import validate_config

    slow = [a for a in AUTO if "worker_rollouts_per_s" not in a] + ["launcher.provisioning.worker_rollouts_per_s=0.001"]
    with pytest.raises(ConfigError, match=r"needs 6400 workers .*provisioning.max_workers=1024.*rollouts per\s+second"):
        validate_config(compose(slow))
    # 6.4/s at 0.01/s = 640 workers: under the cap; a lower cap refuses the same plan
    ok = [a for a in AUTO if "worker_rollouts_per_s" not in a] + ["launcher.provisioning.worker_rollouts_per_s=0.01"]
    from rlpost.ray_pool import resolve_num_workers

    assert resolve_num_workers(compose(ok)) == 640
    with pytest.raises(ConfigError, match="max_workers=100"):
        validate_config(compose(ok + ["launcher.provisioning.max_workers=100"]))
    assert resolve_num_workers(compose(slow + ["launcher.provisioning.max_workers=null"])) == 6400  # null: no cap


def test_auto_without_ray_is_refused(compose):
    from rlpost.config.compose import validate_config

    with pytest.raises(ConfigError, match="launcher=none has none of"):
        validate_config(compose(["launcher.num_rollout_workers=auto"]))
