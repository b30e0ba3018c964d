"""MoE routing replay end to end: the hf engine records routes, the trainer's forwards replay them.

A tiny random Qwen3-MoE (``model=tiny_moe``, transformers' Qwen3-MoE with the real
tokenizer) generates a batch through the real engine wrapper; between the rollout
and the trainer's pass the policy moves (a large off-policy optimizer step, or a
router perturbation), so the trainer's own routers disagree with the rollout's
and replay has something to undo.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_overrides  # noqa: E402

PROMPTS = [[504, 2, 7, 9], [16, 33], [504, 2, 7, 9], [900, 11, 12], [7, 7, 7, 7, 7], [16, 33]]


def _setup(compose, mode: str, *extra: str):
    from rlpost.core.batch import RolloutBatch
    from rlpost.models.loader import load_policy
    from rlpost.models.moe_replay import attach_routing
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.rollout.base import SamplingParams
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides("model=tiny_moe", f"model.routing_replay={mode}", "algo.kl.coef=0",
                                 "algo.entropy_coef=0", "trainer.grad_clip=0", *extra))
    policy, tok = load_policy(cfg.model, seed=0)
    t = TorchTrainer.from_config(policy, cfg, "cpu")
    eng = attach_routing(cfg.model, t, build_engine(EngineConfig.of(cfg), t.policy, tok, torch.device("cpu")))
    gen = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=5))
    B, R = gen.response_ids.shape
    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch(
        prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, response_ids=gen.response_ids,
        response_mask=gen.response_mask, rollout_logprobs=gen.rollout_logprobs, group_index=torch.arange(B) // 2,
        prompt_index=torch.arange(B) // 2, policy_version=torch.zeros(B, dtype=torch.long),
        extras={"advantages": torch.randn(B, 1, generator=g).expand(B, R) * gen.response_mask},
    )
    return cfg, t, eng, gen, batch


def _perturb_routers(t, scale=0.5):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for r in t.routing.rr.routers:
            r.weight.add_(scale * torch.randn(r.weight.shape, generator=g))


def _trainer_routes(t, batch):
    """Routes the trainer's log-prob pass used ``[B, P + R, L, k]`` and the rollout's, from the store."""
    rr = t.routing.rr
    with rr.record():
        t.compute_logprobs(batch)
    B, T = batch.prompt_ids.shape[0], batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    used = torch.stack([torch.cat(rr.calls[layer]).view(B, T, rr.k) for layer in range(rr.n_layers)], dim=2)
    rec, found = t.routing.store.batch_routes(batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                              batch.response_mask, rr.n_layers, rr.k)
    assert found == B
    return used, rec


def test_replay_makes_trainer_routes_the_rollouts(compose):
    from rlpost.models.moe_replay import routes_mismatch

    _, t, eng, gen, batch = _setup(compose, "replay")
    assert len(eng.store) == 6  # one entry per distinct rollout
    used, rec = _trainer_routes(t, batch)
    assert routes_mismatch(rec, used) == 0.0  # same weights: the trainer routes as the rollout did anyway
    t.routing.metrics()
    _perturb_routers(t)  # the policy moved since the rollout (an off-policy mini-batch)
    used, rec = _trainer_routes(t, batch)
    ok = (rec >= 0).all(-1)
    # recorded: every real prompt token and every response token but the last (never fed back), each layer
    n_resp = batch.response_mask.sum(-1)
    assert int(ok.sum()) == int(sum(batch.prompt_mask.sum(-1) + n_resp - 1)) * t.routing.rr.n_layers
    assert torch.equal(used[ok], rec[ok])  # every recorded token-layer: the rollout's experts exactly
    m = t.routing.metrics()
    assert m["moe/replay_coverage"] == 1.0
    assert m["moe/route_mismatch"] > 0.1  # ... where the trainer's own router now disagrees


def test_without_replay_routes_differ_measurably(compose):
    from rlpost.models.moe_replay import routes_mismatch

    _, t, _, _, batch = _setup(compose, "record")
    _perturb_routers(t)
    used, rec = _trainer_routes(t, batch)
    mism = routes_mismatch(rec, used)
    assert mism > 0.1
    assert t.routing.metrics()["moe/route_mismatch"] == pytest.approx(mism, abs=0.15)  # per layer vs per position


@pytest.mark.parametrize("mode", ["record", "replay"])
def test_policy_update_reports_drift_between_mini_batches(compose, mode):
    """Two mini-batches with a large learning rate: the second one is off-policy, and its forward's
    own routes disagree with the rollout's; replay uses the rollout's routes in both."""
    _, t, _, _, batch = _setup(compose, mode, "algo.mini_batches=2", "trainer.lr=0.05")
    from rlpost.models.moe_replay import routes_mismatch
    from rlpost.trainer.torch_engine import trim_batch

    rr = t.routing.rr
    with rr.record():
        m = t.policy_update(batch)  # no rng: mini-batches are rows [0, 2, 4] then [1, 3, 5]
    assert m["moe/replay_coverage"] == 1.0
    assert m["moe/route_mismatch"] > 0.1  # the first mini-batch's step moved the routers (0.44 here)
    last = [rr.calls[layer][-1] for layer in range(rr.n_layers)]  # the second mini-batch's update forward
    sub = batch.select([1, 3, 5])
    T = last[0].shape[0] // 3
    if T != sub.prompt_ids.shape[1] + sub.response_ids.shape[1]:
        sub = trim_batch(sub)
    used = torch.stack([c.view(3, T, rr.k) for c in last], dim=2)
    rec, _ = t.routing.store.batch_routes(sub.prompt_ids, sub.prompt_mask, sub.response_ids, sub.response_mask,
                                          rr.n_layers, rr.k)
    mism = routes_mismatch(rec, used)
    if mode == "replay":
        assert mism == 0.0
    else:
        assert mism > 0.0


def test_config_errors(compose):
    from rlpost.core.errors import ConfigError
    from rlpost.models.moe_replay import attach_routing

    cfg = compose(tiny_overrides("model.routing_replay=replay"))
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    policy, tok = load_policy(cfg.model, seed=0)
    t = TorchTrainer.from_config(policy, cfg, "cpu")
    with pytest.raises(ConfigError, match="no top-k MoE routers"):
        attach_routing(cfg.model, t, object())
    # the engine choices routing replay needs are config checks, run before anything is built
    from rlpost.models.moe_replay import check_routing_config

    check_routing_config(cfg)
    cfg.trainer.engine = "deepspeed"
    with pytest.raises(ConfigError, match="needs trainer=torch"):
        check_routing_config(cfg)
    cfg.trainer.engine = "torch"
    cfg.rollout.engine = "vllm"
    with pytest.raises(ConfigError, match="hf engine only"):
        check_routing_config(cfg)
    cfg.model.gradient_checkpointing = True
    cfg.rollout.engine = "hf"
    with pytest.raises(ConfigError, match="checkpointed"):
        check_routing_config(cfg)
    cfg.model.routing_replay = "always"
    with pytest.raises(ConfigError, match="not one of off, record, replay"):
        check_routing_config(cfg)
    with pytest.raises(ConfigError, match="not one of off, record, replay"):
        attach_routing(cfg.model, t, object())
    with pytest.raises(ConfigError, match="needs trainer=torch"):  # a trainer object without the forward hook
        attach_routing(OmegaConf.create({"routing_replay": "replay"}), object(), object())
    cfg.model.routing_replay = "off"
    eng = object()
    assert attach_routing(cfg.model, t, eng) is eng and t.routing is None  # off: nothing wrapped, nothing patched
