"""EXO (arXiv:2402.00856) and SPPO (arXiv:2405.00675): hand-computed losses, gradients and win rates."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.algos.aggregation import aggregate
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_exo_hand_values_two_groups():
    # group 0: f = beta_pi (lp - ref) = 0.5 * [2, 0] = [1, 0]; rewards [1, 0] -> Dr. GRPO advantages [0.5, -0.5],
    # u / beta_r = [1, -1].  group 1: equal log-ratios and equal rewards -> both softmaxes uniform, L = 0.
    lp = torch.tensor([[-1.0], [-2.0], [-1.5], [-0.5]], requires_grad=True)
    ref = torch.tensor([[-3.0], [-2.0], [-2.5], [-1.5]])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    gi = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 1)
    adv = compute_advantages("grpo", AdvantageInput(rewards=rewards, response_mask=mask, group_index=gi),
                             norm_by_std=False).advantages
    inp = PolicyLossInput(logprobs=lp, old_logprobs=lp.detach(), advantages=adv, response_mask=mask, group_index=gi, extras={'ref_logprobs': ref})
    loss_mat, met = compute_policy_loss("exo", inp)
    total = aggregate("seq-mean-token-sum", loss_mat, mask)
    pf, pr = (_sig(1), _sig(-1)), (_sig(2), _sig(-2))
    L0 = sum(p * (math.log(p) - math.log(q)) for p, q in zip(pf, pr))
    assert total.item() == pytest.approx(L0 / 2, abs=1e-6)  # mean over the two groups
    total.backward()
    # d L0 / d lp_i = beta_pi p_f(i) (log p_f(i) - log p_r(i) - L0), halved by the mean over groups
    for i in (0, 1):
        want = 0.5 * pf[i] * (math.log(pf[i]) - math.log(pr[i]) - L0) / 2
        assert lp.grad[i, 0].item() == pytest.approx(want, abs=1e-6)
    assert torch.allclose(lp.grad[2:], torch.zeros(2, 1), atol=1e-7)
    assert lp.grad[0, 0] < 0 < lp.grad[1, 0]  # the rewarded sample is pushed up, the other down


def test_exo_masks_padding_and_spreads_over_a_sequence():
    lp = torch.tensor([[-1.0, -1.0, -9.0], [-2.0, 0.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -2.0, 0.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]])
    inp = PolicyLossInput(logprobs=lp, old_logprobs=lp.detach(), advantages=adv, response_mask=mask, group_index=torch.tensor([0, 0]), extras={'ref_logprobs': ref})
    loss_mat, _ = compute_policy_loss("exo", inp)
    aggregate("seq-mean-token-sum", loss_mat, mask).backward()
    # f = 0.5 * [2, 0]: the same group as above, L0 with p_f = (s(1), s(-1)); no gradient on padding
    assert lp.grad[0, 2] == 0 and torch.all(lp.grad[1, 1:] == 0)
    assert lp.grad[0, 0] == lp.grad[0, 1]  # every token of a sequence carries its sequence's gradient
    pf, pr = (_sig(1), _sig(-1)), (_sig(2), _sig(-2))
    L0 = sum(p * (math.log(p) - math.log(q)) for p, q in zip(pf, pr))
    assert lp.grad[0, 0].item() == pytest.approx(0.5 * pf[0] * (math.log(pf[0]) - math.log(pr[0]) - L0), abs=1e-6)
    assert loss_mat.sum().item() / 2 == pytest.approx(L0, abs=1e-6)


def test_win_rate_hand_values():
    # group 0 rewards [1, 0, 1]: a 1 beats the 0 and ties the other 1 -> P = (1 + 1/2) / 2 = 3/4;
    # the 0 loses both -> P = 0.  Group 1 has one sample: no opponent, 0.
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    out = compute_advantages("win_rate", AdvantageInput(rewards=torch.tensor([1.0, 0.0, 1.0, 0.3]),
                                                       response_mask=mask, group_index=torch.tensor([0, 0, 0, 1])))
    want = torch.tensor([0.25, -0.5, 0.25, 0.0])[:, None] * mask
    assert torch.allclose(out.advantages, want)


def test_sppo_hand_values_and_gradient():
    # eta = 2; row 0: log-ratio sum 0.1 + 0.2 = 0.3, a = 0.25 -> (0.3 - 0.5)^2 = 0.04;
    # row 1: -0.1 (one real token), a = -0.5 -> (-0.1 + 1)^2 = 0.81. Mean over sequences: 0.425.
    old = torch.tensor([[-1.0, -2.0], [-1.0, -3.0]])
    lp = (old + torch.tensor([[0.1, 0.2], [-0.1, 5.0]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([[0.25, 0.25], [-0.5, 0.0]])
    inp = PolicyLossInput(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask)
    loss_mat, met = compute_policy_loss("sppo", inp, eta=2.0)
    total = aggregate("seq-mean-token-sum", loss_mat, mask)
    assert total.item() == pytest.approx((0.04 + 0.81) / 2, abs=1e-6)
    total.backward()
    # d/d lp_t = 2 (ell_i - eta a_i) / B on each real token of row i
    assert torch.allclose(lp.grad, torch.tensor([[-0.2, -0.2], [0.9, 0.0]]), atol=1e-6)
    assert met["seq_sppo_log_ratio"].item() == pytest.approx(0.1, abs=1e-6)


def test_sppo_on_policy_gradient_is_a_win_rate_policy_gradient():
    """At log pi = log pi_t the gradient is -2 eta a_i per token: REINFORCE with the centred win rate."""
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    inp = PolicyLossInput(logprobs=lp, old_logprobs=lp.detach(), advantages=torch.tensor([[0.25, 0.25]]),
                          response_mask=torch.ones(1, 2))
    loss_mat, _ = compute_policy_loss("sppo", inp)  # eta = 1000
    aggregate("seq-mean-token-sum", loss_mat, torch.ones(1, 2)).backward()
    assert torch.allclose(lp.grad, torch.full((1, 2), -2 * 1000 * 0.25))


def test_exo_loads_a_reference_model_without_kl(compose):
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.run.runner import build_graph
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(["algo=exo", "model=tiny", "precision=fp32"])
    assert cfg.algo.kl.coef == 0
    stage = {s.name: s for s in build_graph(cfg)}["ref_logprobs"]
    assert stage.enabled and "loss=exo" in stage.description
    t = TorchTrainer.from_config(load_policy(ModelConfig(source="tiny"), seed=3)[0], cfg, "cpu")
    assert t.has_ref and t.ref is not None and not any(p.requires_grad for p in t.ref.parameters())
    cfg = compose(["algo=sppo", "model=tiny"])
    assert not {s.name: s for s in build_graph(cfg)}["ref_logprobs"].enabled  # SPPO's pi_t is old_logprobs
