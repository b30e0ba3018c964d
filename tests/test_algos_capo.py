"""CAPO (arXiv:2510.00819): hand-computed last-layer predictions, the token mask, the shadow Adam
state, micro-batch invariance through the trainer, and a two-step run of ``algo=capo`` on model=tiny."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_overrides, update_with_gradient  # noqa: E402
from ds_worker import make_batch  # noqa: E402

from rlpost.algos import capo  # noqa: E402
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss  # noqa: E402

LR = 0.01


def _three_tokens():
    """3 tokens, a 4-token vocabulary (the support is the whole vocabulary), hidden size 2.

    token 1: pi = (1/2, 1/4, 1/8, 1/8), sampled id 0, A = 1,  h = (1, 1)
    token 2: pi uniform,               sampled token outside the support, A = -2, h = (0.5, 0)
    token 3: pi = (0.7, 0.1, 0.1, 0.1), sampled id 2, A = 0,  h = (3, -1)
    """
    feat = torch.tensor([[1.0, 1.0], [0.5, 0.0], [3.0, -1.0]])
    ids = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]])
    pi = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    onehot = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1.0, 0]])
    adv = torch.tensor([1.0, -2.0, 0.0])
    return feat, ids, pi, onehot, adv


def test_predicted_change_and_fisher_kl_by_hand_first_step():
    # With an empty shadow state the step direction is the gradient itself (d = g = A v h^T, v = e_a - pi),
    # so u_k = A v_k |h|^2, <g, d> = A^2 |h|^2 sum v^2, s = v.u = A |h|^2 sum v^2,
    # u^T F u = A^2 |h|^4 (sum pi v^2 - (sum pi v)^2).
    # token 1: |h|^2 = 2, v = (.5, -.25, -.125, -.125), sum v^2 = 0.34375 -> <g,d> = 0.6875, s = 0.6875;
    #   sum pi v = 0.15625, sum pi v^2 = 0.14453125 -> u^T F u = 4 * 0.1201171875 = 0.48046875;
    #   m_H = 0.01 * 0.6875 + 0.5e-4 * (0.47265625 - 0.48046875) = 0.006874609375; m_F = 0.5e-4 * 0.47265625.
    # token 2: |h|^2 = 0.25, v = -pi, sum v^2 = 0.25 -> <g,d> = 4 * 0.25 * 0.25 = 0.25, s = -0.125,
    #   sum pi v^2 = (sum pi v)^2 = 0.0625 -> u^T F u = 0; m_H = 0.0025 + 0.5e-4 * (-2) * 0.015625; m_F = 0.5e-4 * 0.015625.
    # token 3: A = 0 -> both 0.
    m_h, m_f, g = capo.capo_terms(*_three_tokens(), state=None, lr=LR, beta1=0.9, beta2=0.999)
    assert m_h.tolist() == pytest.approx([0.006874609375, 0.0024984375, 0.0], rel=1e-6, abs=1e-12)
    assert m_f.tolist() == pytest.approx([2.36328125e-5, 7.8125e-7, 0.0], rel=1e-6, abs=1e-15)
    assert g.shape == (3, 4, 2)
    assert g[0, 0].tolist() == pytest.approx([0.5, 0.5]) and g[1, 2].tolist() == pytest.approx([0.25, 0.0])  # (-2)(-1/4)(0.5, 0)


def test_which_tokens_are_masked_by_hand():
    m_h, m_f, _ = capo.capo_terms(*_three_tokens(), state=None, lr=LR, beta1=0.9, beta2=0.999)
    # tau_update 1e-2 keeps all three on m_H; tau_kl 1e-5 drops token 1 (m_F = 2.36e-5)
    assert capo.capo_keep(m_h, m_f, 1e-2, 1e-5, True).tolist() == [0.0, 1.0, 1.0]
    # tau_update 5e-3 drops token 1 on m_H too, keeps token 2 (m_H = 0.0025); no KL test (tau 0)
    assert capo.capo_keep(m_h, m_f, 5e-3, 0.0, True).tolist() == [0.0, 1.0, 1.0]
    # tau_update 2e-3 drops tokens 1 and 2
    assert capo.capo_keep(m_h, m_f, 2e-3, 1.0, True).tolist() == [0.0, 0.0, 1.0]
    # symmetric: -tau < m_H < tau; one-sided: 0 <= m_H < tau (a predicted decrease is masked)
    mh = torch.tensor([-1e-4, -1e-3, 0.0, 9e-4, 1e-3])
    zero = torch.zeros(5)
    assert capo.capo_keep(mh, zero, 1e-3, 0.0, True).tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert capo.capo_keep(mh, zero, 1e-3, 0.0, False).tolist() == [0.0, 0.0, 1.0, 1.0, 0.0]


def test_adam_direction_and_shadow_update_by_hand():
    b1, b2 = 0.9, 0.999
    state = {"ids": torch.tensor([7]), "m": torch.tensor([[0.2]]), "v": torch.tensor([[0.04]]), "t": 1}
    g = torch.tensor([[0.5], [0.5]])
    d = capo.adam_direction(g, torch.tensor([7, 3]), state, b1, b2)
    # row 7: m' = 0.9*0.2 + 0.1*0.5 = 0.23, v' = 0.999*0.04 + 0.001*0.25 = 0.04021, bias correction at t = 2
    d7 = (0.23 / (1 - 0.9 ** 2)) / (math.sqrt(0.04021 / (1 - 0.999 ** 2)) + 1e-8)
    # row 3 (never updated): m' = 0.05, v' = 0.00025
    d3 = (0.05 / (1 - 0.9 ** 2)) / (math.sqrt(0.00025 / (1 - 0.999 ** 2)) + 1e-8)
    assert d.flatten().tolist() == pytest.approx([d7, d3], rel=1e-5)
    # first step (t = 0): plain gradient
    assert torch.equal(capo.adam_direction(g, torch.tensor([7, 3]), None, b1, b2), g)
    # the step's update: row 3 seen by two kept tokens with gradients 1 and 3 (mean 2), row 9 by a dropped token
    pending = {}
    capo.accumulate_rows(pending, torch.tensor([[3], [3], [9]]), torch.tensor([[[1.0]], [[3.0]], [[5.0]]]),
                         torch.tensor([1.0, 1.0, 0.0]))
    new = capo.shadow_update(state, pending, b1, b2, hidden=1)
    assert new["t"] == 2 and new["ids"].tolist() == [3, 7]
    assert new["m"].flatten().tolist() == pytest.approx([0.1 * 2.0, 0.2])  # row 7 untouched (sparse update)
    assert new["v"].flatten().tolist() == pytest.approx([0.001 * 4.0, 0.04])


def test_masked_token_gets_no_gradient():
    lp = torch.log(torch.tensor([[0.5, 0.4, 0.3]])).requires_grad_(True)
    old = torch.log(torch.tensor([[0.45, 0.4, 0.35]]))
    inp = PolicyLossInput(logprobs=lp, old_logprobs=old, advantages=torch.tensor([[1.0, -1.0, 2.0]]), response_mask=torch.ones(1, 3), extras={'predicted_change': torch.tensor([[0.006874609375, 0.0025, 0.0]]), 'predicted_kl': torch.tensor([[2.36e-05, 7.8e-07, 0.0]])})
    loss, m = compute_policy_loss("capo", inp, tau_update=1e-2, tau_kl=1e-5)
    loss.sum().backward()
    assert loss[0, 0].item() == 0.0 and lp.grad[0, 0].item() == 0.0
    # the kept tokens get PPO's gradient -A r (ratio 1 and 6/7, both inside the clip range)
    assert lp.grad[0, 1].item() == pytest.approx(1.0) and lp.grad[0, 2].item() == pytest.approx(-2.0 * 0.3 / 0.35)
    assert m["capo/mask_frac"].item() == pytest.approx(1 / 3)
    assert m["capo/kl_mask_frac"].item() == pytest.approx(1 / 3) and m["capo/update_mask_frac"].item() == 0.0
    with pytest.raises(ValueError, match="capo_forward"):
        compute_policy_loss("capo", PolicyLossInput(logprobs=lp, old_logprobs=old, advantages=old, response_mask=old))


_CACHE: dict = {}


def _trainer(compose, mb: int, policy, *extra):
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides("algo=capo", f"trainer.micro_batch_size={mb}", "trainer.lr=1e-3", "trainer.grad_clip=0",
                                 "algo.kl.coef=0", "algo.entropy_coef=0", *extra))
    return TorchTrainer.from_config(copy.deepcopy(policy), cfg, "cpu")


def test_mask_gradient_and_shadow_state_do_not_depend_on_micro_batch_size(compose):
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy

    policy = load_policy(ModelConfig(source="tiny"), seed=3)[0]
    warm = _trainer(compose, 8, policy)
    warm.policy_update(make_batch(seed=1))  # one step fills the shadow Adam state (t = 1)
    state = warm.loss_state[capo.STATE_KEY]
    assert state["t"] == 1 and state["ids"].numel() > 0
    runs = {}
    # thresholds inside the spread of m_H / m_F on this batch (lr 1e-3), so both tests mask some tokens
    for mb in (1, 3, 8):
        t = _trainer(compose, mb, warm.policy, "algo.loss_params.tau_update=0.05", "algo.loss_params.tau_kl=7e-4")
        t.loss_state = copy.deepcopy(warm.loss_state)
        b = make_batch(seed=2)
        b.response_mask[5] = 0  # an empty response
        lp, _ = t.compute_logprobs(b)
        b.extras["old_logprobs"] = (lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))) * b.response_mask
        metrics, g = update_with_gradient(t, b)
        runs[mb] = (metrics, g, t.loss_state[capo.STATE_KEY])
    m8, g8, s8 = runs[8]
    assert 0.05 < m8["capo/mask_frac"] < 0.95, m8["capo/mask_frac"]
    assert m8["capo/update_mask_frac"] > 0 and m8["capo/kl_mask_frac"] > 0
    assert s8["t"] == 2 and s8["ids"].numel() >= state["ids"].numel()
    for mb in (1, 3):
        m, g, s = runs[mb]
        assert torch.allclose(g, g8, rtol=1e-4, atol=1e-7 * max(1.0, float(g8.abs().max()))), (mb, (g - g8).abs().max())
        for k in ("capo/mask_frac", "capo/update_mask_frac", "capo/kl_mask_frac", "loss/policy"):
            assert m[k] == pytest.approx(m8[k], rel=1e-4, abs=1e-7), (mb, k)
        assert torch.equal(s["ids"], s8["ids"]) and s["t"] == 2
        assert torch.allclose(s["m"], s8["m"], rtol=1e-4, atol=1e-9) and torch.allclose(s["v"], s8["v"], rtol=1e-4, atol=1e-12)
    # the shadow state survives the trainer's checkpoint round trip (tensors, not floats)
    t2 = _trainer(compose, 8, warm.policy)
    t2.load_state_dict(warm.state_dict())
    assert torch.equal(t2.loss_state[capo.STATE_KEY]["m"], state["m"]) and t2.loss_state[capo.STATE_KEY]["t"] == 1


def test_capo_two_steps_on_tiny(tmp_path):
    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["algo=capo", "model=tiny", "steps=2", "logger=jsonl", "rollout.max_new_tokens=6",
                          "selector.prompts_per_step=1", "eval.at_end=false", "checkpoint.every=1", "trainer.lr=1e-4"])
    train(cfg, tmp_path)
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines() if l.strip()]
    rows = [r for r in rows if "reward/mean" in r]
    assert len(rows) == 2
    for r in rows:
        for k in ("loss/policy", "actor/grad_norm", "capo/mask_frac", "capo/kl_mean"):
            assert math.isfinite(r[k]), (k, r)
        assert 0.0 <= r["capo/mask_frac"] <= 1.0
    # the shadow Adam state took one update per optimizer step and is saved with the checkpoint
    ckpts = sorted(tmp_path.rglob("trainer.pt"))
    assert ckpts
    sd = torch.load(ckpts[-1], weights_only=False)
    state = sd["loss_state"][capo.STATE_KEY]
    assert state["t"] == 2 and state["ids"].numel() > 0 and capo.PENDING_KEY not in sd["loss_state"]


def test_capo_refuses_a_multi_process_engine():
    from rlpost.core.errors import ConfigError

    class Lockstep:  # a DeepSpeed-like engine's forward pass: processes step together, each with its own shadow state
        multi_process = True

    with pytest.raises(ConfigError, match="trainer.engine=torch"):
        capo.capo_forward(Lockstep(), None, False, False, {}, 0)
