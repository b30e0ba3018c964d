"""PR2 predictive routing replay (``model.routing_replay=pr2``; "PR2: Predictive Routing Replay for
MoE-Based LLM Reinforcement Learning", arXiv:2606.00395): the router-evolution predictor by hand, the
predicted routes equal the drifted router's own routes under a constant drift, the trainer replays them,
and a 2-step run with its checkpointed predictor state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_overrides  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[504, 2, 7, 9], [16, 33], [504, 2, 7, 9], [900, 11, 12], [7, 7, 7, 7, 7], [16, 33]]


def _router(w):
    w = torch.tensor(w)
    r = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        r.weight.copy_(w)
    return r


def test_predictor_velocity_and_predicted_route_by_hand():
    from rlpost.models.moe_replay import RouterEvolutionPredictor

    r = _router([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])  # E=3 experts, H=2
    p = RouterEvolutionPredictor(horizon=2.0, ema=0.25)  # not 0.5: the weights of old and new must differ
    h = torch.tensor([[1.0, 0.2]])
    logits = r(h).detach()  # [1.0, 0.2, 0.6]
    assert p.route(0, h, logits, torch.topk(logits, 1).indices).tolist() == [[0]]  # no velocity yet: the router's own
    p.begin_update([r])
    with torch.no_grad():
        r.weight += torch.tensor([[-0.2, 0.0], [0.0, 0.0], [0.1, 0.0]])  # expert 0 falls, expert 2 rises
    p.end_update([r])
    assert torch.allclose(p.velocity[0], torch.tensor([[-0.2, 0.0], [0.0, 0.0], [0.1, 0.0]]))  # first fit: the change
    p.begin_update([r])
    with torch.no_grad():
        r.weight += torch.tensor([[-0.4, 0.0], [0.0, 0.0], [0.3, 0.0]])
    p.end_update([r])
    v = torch.tensor([[-0.35, 0.0], [0.0, 0.0], [0.25, 0.0]])  # 0.25 * first + 0.75 * second
    assert torch.allclose(p.velocity[0], v)
    # now W = [[0.4, 0], [0, 1], [0.9, 0.5]]: logits [0.4, 0.2, 1.0]; predicted 2 updates ahead:
    # [0.4 - 0.7, 0.2, 1.0 + 0.5] = [-0.3, 0.2, 1.5] -> top-2 {2, 1}, while the own top-2 is {2, 0}
    logits = r(h).detach()
    assert torch.allclose(logits, torch.tensor([[0.4, 0.2, 1.0]]))
    own = torch.topk(logits, 2).indices
    assert sorted(own[0].tolist()) == [0, 2]
    assert sorted(p.route(0, h, logits, own)[0].tolist()) == [1, 2]
    assert p.stats == [1, 1]
    sd = p.state_dict()
    q = RouterEvolutionPredictor(horizon=2.0, ema=0.25)
    q.load_state_dict(sd)
    assert q.updates == 2 and torch.equal(q.velocity[0], p.velocity[0])
    with pytest.raises(ValueError, match="horizon"):
        RouterEvolutionPredictor(horizon=-1.0)
    with pytest.raises(ValueError, match="ema"):
        RouterEvolutionPredictor(ema=1.0)


def _built(compose, mode):
    from rlpost.models.loader import load_policy
    from rlpost.models.moe_replay import attach_routing
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides("model=tiny_moe", f"model.routing_replay={mode}"))
    policy, tok = load_policy(cfg.model, seed=0)
    t = TorchTrainer.from_config(policy, cfg, "cpu")
    return t, attach_routing(cfg.model, t, build_engine(EngineConfig.of(cfg), t.policy, tok, torch.device("cpu")))


def _drift(t, seed=3, scale=1.0):
    """A random change of every router weight, ``scale`` times the weight's own spread."""
    g = torch.Generator().manual_seed(seed)
    return [scale * float(r.weight.detach().std()) * torch.randn(r.weight.shape, generator=g) for r in t.routing.rr.routers]


def _apply(t, d):
    with torch.no_grad():
        for r, x in zip(t.routing.rr.routers, d):
            r.weight.add_(x)


def _layer0_mismatch_after_drift(compose, mode):
    """Rollout after one observed drift; then the routers drift once more by the same amount.
    Returns the share of layer-0 token positions whose recorded route differs from the drifted
    router's own choice, and the trainer routing's replay stats under its own mode."""
    from rlpost.core.batch import RolloutBatch
    from rlpost.models.moe_replay import routes_mismatch
    from rlpost.rollout.base import SamplingParams

    t, eng = _built(compose, mode)
    d = _drift(t)
    t.routing.begin_update()
    _apply(t, d)
    t.routing.end_update()  # pr2: velocity = d exactly; replay: nothing
    gen = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=5))
    _apply(t, d)  # the next update moves the routers by the same amount
    B = gen.response_ids.shape[0]
    batch = RolloutBatch(prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, response_ids=gen.response_ids,
                         response_mask=gen.response_mask, rollout_logprobs=gen.rollout_logprobs,
                         group_index=torch.arange(B) // 2, prompt_index=torch.arange(B) // 2,
                         policy_version=torch.zeros(B, dtype=torch.long), extras={})
    rr = t.routing.rr
    T = batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    rec, found = t.routing.store.batch_routes(batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                              batch.response_mask, rr.n_layers, rr.k)
    assert found == B
    mode_was = t.routing.mode
    t.routing.mode = "record"  # the drifted routers' own choices
    with rr.record():
        t.compute_logprobs(batch)
    own0 = torch.cat(rr.calls[0]).view(B, T, rr.k)
    t.routing.mode = mode_was
    rr.reset_stats()
    with rr.record():
        t.compute_logprobs(batch)  # the trainer's pass in the run's own mode (replay / pr2 enforce the route)
    used = torch.stack([torch.cat(rr.calls[layer]).view(B, T, rr.k) for layer in range(rr.n_layers)], dim=2)
    return routes_mismatch(rec[:, :, 0], own0), routes_mismatch(rec, used), rr.stats[0] / rr.stats[1]


def test_pr2_predicts_a_constant_drift_exactly_where_replay_goes_stale(compose):
    """Layer 0's router input does not depend on any routing, so under a constant drift the routes
    PR2 recorded at rollout are exactly the drifted router's own; plain replay's are stale. Both
    replay their recorded route in the trainer (used == recorded), and PR2's trainer-vs-own
    disagreement over all layers is the smaller."""
    pr2_l0, pr2_used, pr2_stale = _layer0_mismatch_after_drift(compose, "pr2")
    rep_l0, rep_used, rep_stale = _layer0_mismatch_after_drift(compose, "replay")
    assert pr2_l0 == 0.0
    assert rep_l0 > 0.1  # 0.27 here; over all layers the trainer's own routers disagree 0.008 (pr2) vs 0.29
    assert pr2_used == 0.0 and rep_used == 0.0
    assert pr2_stale < rep_stale


def test_greedy_calls_route_by_the_current_router(compose):
    """Evaluation (greedy) measures the policy itself: PR2's prediction applies to sampled rollouts only."""
    from rlpost.rollout.base import SamplingParams

    t, eng = _built(compose, "pr2")
    t.routing.begin_update()
    _apply(t, _drift(t))
    t.routing.end_update()
    sp = SamplingParams(max_new_tokens=6, greedy=True)
    t.routing.predictor.stats = [0, 0]
    eng.generate(PROMPTS, sp)
    assert t.routing.predictor.stats == [0, 0]  # the predictor was not asked
    eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=1))
    assert t.routing.predictor.stats[1] > 0 and t.routing.predictor.stats[0] > 0  # sampled: predicted routes, some flipped


def test_pr2_config_errors(compose):
    from rlpost.core.errors import ConfigError
    from rlpost.models.loader import load_policy
    from rlpost.models.moe_replay import attach_routing
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides("model=tiny_moe", "model.routing_replay=pr2", "model.pr2.horizon=-1"))
    policy, _ = load_policy(cfg.model, seed=0)
    t = TorchTrainer.from_config(policy, cfg, "cpu")
    with pytest.raises(ConfigError, match="model.pr2: PR2 horizon must be >= 0"):
        attach_routing(cfg.model, t, object())
    with pytest.raises(Exception, match="hozizon"):
        compose(tiny_overrides("model=tiny_moe", "model.pr2.hozizon=2"))


def test_pr2_two_steps_fit_the_predictor_and_checkpoint_it(compose, tmp_path):
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("model=tiny_moe", "model.routing_replay=pr2", "algo.mini_batches=2", "trainer.lr=0.02",
                                 "algo.entropy_coef=0.05",  # a random model scores 0: the entropy bonus moves the routers
                                 "steps=2", "checkpoint.every=2", f"hydra.run.dir={tmp_path}"))
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "moe/replay_coverage" in r]
    assert len(steps) == 2
    assert all(r["moe/replay_coverage"] == 1.0 for r in steps)
    assert "moe/pr2_predicted_flip" not in steps[0]  # no velocity before the first update
    assert steps[0]["moe/pr2_velocity_norm"] > 0.0
    assert 0.0 <= steps[1]["moe/pr2_predicted_flip"] <= 1.0
    ck = sorted(tmp_path.glob("**/trainer.pt"))
    assert ck, "no checkpoint written"
    pr2 = torch.load(ck[-1], weights_only=False)["routing"]["pr2"]
    assert pr2["updates"] == 2 and len(pr2["velocity"]) == 2  # 2 MoE layers
