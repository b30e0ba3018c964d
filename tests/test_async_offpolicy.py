"""Off-policy pieces for stale rollouts: decoupled PPO, A-3PO interpolation, VCPO lr scale and baseline."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos.losses import PolicyLossInput, compute_policy_loss


def _inp(lp, old, behav, adv):
    t = lambda x: torch.tensor([x], dtype=torch.float32)  # noqa: E731
    lp = t(lp).requires_grad_(True)
    return PolicyLossInput(logprobs=lp, old_logprobs=t(old), advantages=t(adv), response_mask=torch.ones(1, len(adv)),
                           rollout_logprobs=t(behav))


def test_decoupled_ppo_weights_the_clipped_loss_by_prox_over_behav():
    # token 0: r = pi/prox = 1, w = prox/behav = e^0.5; token 1: r = e^0.5 > 1.2 with A>0 (clipped), w = e^-1
    inp = _inp([0.0, 0.5], [0.0, 0.0], [-0.5, 1.0], [1.0, 2.0])
    loss, m = compute_policy_loss("decoupled_ppo", inp, eps_low=0.2, eps_high=0.2, behav_cap=None)
    w0, w1 = math.exp(0.5), math.exp(-1.0)
    assert loss[0, 0].item() == pytest.approx(-1.0 * 1.0 * w0)
    assert loss[0, 1].item() == pytest.approx(-2.0 * 1.2 * w1)
    loss.sum().backward()
    g = inp.logprobs.grad[0]
    assert g[0].item() == pytest.approx(-w0)  # d(-w r A)/d lp = -w A r
    assert g[1].item() == 0.0  # clipped token: no gradient
    assert m["behav_weight_max"].item() == pytest.approx(w0)


def test_decoupled_ppo_caps_the_behaviour_weight():
    inp = _inp([0.0], [0.0], [-3.0], [1.0])  # w = e^3 = 20
    loss, m = compute_policy_loss("decoupled_ppo", inp, behav_cap=5.0)
    assert loss.item() == pytest.approx(-5.0)
    assert m["behav_capped_frac"].item() == 1.0
    with pytest.raises(ValueError, match="behav_cap"):
        compute_policy_loss("decoupled_ppo", inp, behav_cap=0.0)


def test_decoupled_ppo_on_fresh_data_is_ppo():
    inp = _inp([0.1, -0.2], [0.0, 0.0], [0.0, 0.0], [1.0, -1.0])
    a, _ = compute_policy_loss("decoupled_ppo", inp)
    b, _ = compute_policy_loss("ppo_clip", inp)
    torch.testing.assert_close(a, b)


def test_a3po_interpolates_by_version():
    from rlpost.algos.offpolicy import a3po_proximal_logprobs

    behav = torch.tensor([[-2.0, -1.0], [-2.0, -1.0], [-2.0, -1.0]])
    cur = torch.tensor([[-1.0, -0.5], [-1.0, -0.5], [-1.0, -0.5]])
    v = torch.tensor([3, 5, 6])  # behaviour versions; proximal 6, current 8
    prox = a3po_proximal_logprobs(behav, cur, v, proximal_version=6, current_version=8)
    # alpha = (6-3)/(8-3) = 0.6 ; (6-5)/(8-5) = 1/3 ; (6-6)/(8-6) = 0 (behaviour is the proximal policy)
    torch.testing.assert_close(prox[0], behav[0] + 0.6 * (cur[0] - behav[0]))
    torch.testing.assert_close(prox[1], behav[1] + (cur[1] - behav[1]) / 3)
    torch.testing.assert_close(prox[2], behav[2])
    # fresh data at the first update: the proximal policy is the current one
    same = a3po_proximal_logprobs(behav, cur, torch.tensor([8, 8, 8]), 8, 8)
    torch.testing.assert_close(same, cur)
    assert not prox.requires_grad
    with pytest.raises(ValueError):
        a3po_proximal_logprobs(behav, cur, v, 6, 5)


def test_a3po_takes_per_token_versions_of_partial_rollouts():
    from rlpost.algos.offpolicy import a3po_proximal_logprobs

    behav = torch.tensor([[-2.0, -1.0, -3.0]])
    cur = torch.tensor([[-1.0, -0.5, -1.0]])
    tv = torch.tensor([[3, 5, 6]])  # a stitched response: tokens sampled by versions 3, 5, 6
    prox = a3po_proximal_logprobs(behav, cur, tv, proximal_version=6, current_version=8)
    # alpha per token: (6-3)/(8-3) = 0.6, (6-5)/(8-5) = 1/3, (6-6)/(8-6) = 0
    torch.testing.assert_close(prox, torch.tensor([[-2.0 + 0.6 * 1.0, -1.0 + 0.5 / 3, -3.0]]))
    # a [B] version is the same as that version on every token
    seq = a3po_proximal_logprobs(behav, cur, torch.tensor([3]), 6, 8)
    torch.testing.assert_close(seq, a3po_proximal_logprobs(behav, cur, torch.tensor([[3, 3, 3]]), 6, 8))


def test_vcpo_lr_scale_follows_ess_with_a_floor():
    from rlpost.algos.offpolicy import vcpo_lr_scale

    assert vcpo_lr_scale(1.0) == 1.0
    assert vcpo_lr_scale(0.5) == pytest.approx(0.5)
    assert vcpo_lr_scale(0.25, power=0.5) == pytest.approx(0.5)
    assert vcpo_lr_scale(0.01, min_scale=0.1) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        vcpo_lr_scale(0.5, power=0.0)


def test_min_variance_baseline_weights_by_squared_importance():
    from rlpost.algos.offpolicy import min_variance_baseline

    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5])
    w = torch.tensor([2.0, 1.0, 1.0, 1.0, 3.0])
    g = torch.tensor([0, 0, 1, 1, 2])
    b = min_variance_baseline(r, w, g)
    assert b[0].item() == pytest.approx(4.0 / 5.0) and b[1].item() == pytest.approx(0.8)
    assert b[2].item() == pytest.approx(0.5)  # equal weights: the group mean
    assert b[4].item() == pytest.approx(0.5)


def test_vcpo_lr_scaling_shrinks_the_step_on_stale_batches(compose):
    """Trainer wiring: with vcpo_lr on, a low-ESS batch moves the weights less than with it off."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import tiny_overrides
    from ds_worker import make_batch

    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    moved = {}
    for on in (False, True):
        cfg = compose(tiny_overrides("trainer.lr=1e-3", "trainer.grad_clip=0", "algo.loss=ppo_clip",
                                     f"+algo.offpolicy.vcpo_lr={str(on).lower()}"))
        model, _ = load_policy(ModelConfig(source="tiny"), seed=3)
        w0 = {k: v.clone() for k, v in model.state_dict().items()}
        t = TorchTrainer.from_config(model, cfg, "cpu")
        b = make_batch()
        lp, _ = t.compute_logprobs(b)
        g = torch.Generator().manual_seed(0)
        b.rollout_logprobs = lp - 2.0 * torch.rand(lp.shape, generator=g) * b.response_mask  # heavy-tailed weights
        m = t.policy_update(b)
        moved[on] = sum((v - w0[k]).abs().sum().item() for k, v in t.policy.state_dict().items())
        if on:
            assert 0.1 <= m["offpolicy/vcpo_lr_scale"] < 0.9
            assert m["offpolicy/vcpo_lr_scale"] == pytest.approx(max(0.1, m["offpolicy/ess_frac"]))
    assert moved[True] < 0.95 * moved[False]


def test_vcpo_preset_feeds_importance_weights_to_the_baseline_on_stale_batches(compose, tmp_path, monkeypatch):
    """algo=vcpo under executor=async: the estimator gets pi_old and the (stale) rollout log-probs."""
    import json
    import time

    import rlpost.run.runner as runner
    from conftest import tiny_overrides
    from rlpost.algos.advantages import AdvantageInput, min_variance_group_baseline

    from rlpost.methods.base import MethodSet

    vcpo = compose(tiny_overrides("algo=vcpo"))
    assert runner.needs_old_logprobs(vcpo.algo, MethodSet.for_config(vcpo))  # the VCPO method asks for the pass
    real_adv = runner.compute_advantages
    seen = []

    def spy(name, inp: AdvantageInput, **params):
        seen.append((name, inp, params))
        return real_adv(name, inp, **params)

    real_learn = runner.Run.learn

    def slow_learn(self, c, sync_engine=True):
        time.sleep(0.5)  # let the producer run one step ahead: stale batches
        return real_learn(self, c, sync_engine)

    monkeypatch.setattr(runner, "compute_advantages", spy)
    monkeypatch.setattr(runner.Run, "learn", slow_learn)
    cfg = compose(tiny_overrides("algo=vcpo", "algo.n_samples_per_prompt=4", "executor=async", "executor.max_staleness=1",
                                 "steps=3", "eval.at_end=false", "checkpoint.every=0", "trainer.lr=1e-3",
                                 "algo.entropy_coef=0.1"))  # rewards are ~0 on tiny: entropy moves the weights
    runner.train(cfg, tmp_path / "vcpo")
    recs = [json.loads(line) for line in (tmp_path / "vcpo" / "metrics.jsonl").read_text().splitlines()]
    assert len(seen) == 3 and all(p.get("baseline") == "min_variance" for _, _, p in seen)
    gaps = []
    for _, inp, _ in seen:
        assert inp.old_logprobs is not None and inp.rollout_logprobs is not None
        lw = ((inp.old_logprobs - inp.rollout_logprobs) * inp.response_mask).sum(-1)
        gaps.append(float(lw.abs().max()))
        b = min_variance_group_baseline(inp)
        assert b.shape == inp.rewards.shape and bool(torch.isfinite(b).all())
    assert gaps[0] < 1e-3  # step 1 is on-policy: every weight ~1
    assert max(gaps[1:]) > 1e-2, gaps  # a stale batch: pi_old / pi_behav moved away from 1
    assert max(r["async/staleness_max"] for r in recs) >= 1
    assert all(0.1 <= r["offpolicy/vcpo_lr_scale"] <= 1.0 for r in recs)
