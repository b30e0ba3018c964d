"""Policy losses, aggregation and KL on hand-computed tensors: values and gradients."""

import math

import pytest
import torch

from rlpost.algos.aggregation import aggregate
from rlpost.algos.hapo import adaptive_clip_range, entropy_hhat, make_temperature_hook, redistribute_advantage
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from rlpost.algos.regularizers import kl_penalty, kl_reward_penalty


def make(ratios, adv, mask=None, entropy=None):
    """Input with old log-probs 0 and current log-probs log(ratio) (leaf with grad)."""
    r = torch.tensor(ratios, dtype=torch.float32)
    lp = torch.log(r).clone().requires_grad_(True)
    A = torch.tensor(adv, dtype=torch.float32)
    if A.dim() == 1:
        A = A[:, None].expand_as(r).clone()
    m = torch.ones_like(r) if mask is None else torch.tensor(mask, dtype=torch.float32)
    ent = None if entropy is None else torch.tensor(entropy, dtype=torch.float32)
    return PolicyLossInput(logprobs=lp, old_logprobs=torch.zeros_like(r), advantages=A, response_mask=m, entropy=ent)


def grad_of(name, x, **p):
    loss, met = compute_policy_loss(name, x, **p)
    (loss * x.response_mask).sum().backward()
    return loss.detach(), x.logprobs.grad.clone(), met


def test_ppo_clip_binding_side_gets_zero_gradient():
    # tokens: r=1.5,A=+1 (clipped high, binds) | r=1.5,A=-1 (not binding) | r=0.5,A=-1 (clipped low, binds)
    # | r=0.5,A=+1 (not binding)
    x = make([[1.5, 1.5, 0.5, 0.5]], [[1.0, -1.0, -1.0, 1.0]])
    loss, g, met = grad_of("ppo_clip", x, eps_low=0.2, eps_high=0.2)
    assert torch.allclose(loss, torch.tensor([[-1.2, 1.5, 0.8, -0.5]]))
    # d(-A r)/d log pi = -A r
    assert torch.allclose(g, torch.tensor([[0.0, 1.5, 0.0, -0.5]]))
    assert torch.isclose(met["clip_frac"], torch.tensor(0.5))
    assert torch.isclose(met["clip_frac_high"], torch.tensor(0.25))
    assert torch.isclose(met["clip_frac_low"], torch.tensor(0.25))


def test_ppo_dual_clip_caps_negative_advantage_loss():
    x = make([[5.0, 2.0]], [[-1.0, -1.0]])
    loss, g, met = grad_of("ppo_clip", x, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    # r=5: max(5, 1.2) = 5 capped at 3 (no grad); r=2: 2 < 3 keeps gradient 2
    assert torch.allclose(loss, torch.tensor([[3.0, 2.0]]))
    assert torch.allclose(g, torch.tensor([[0.0, 2.0]]))
    assert torch.isclose(met["clip_frac_dual"], torch.tensor(0.5))


def test_decoupled_clip_higher():
    # r = 1.25 with A > 0: inside DAPO's [0.8, 1.28] (gradient -A r), clipped by symmetric 0.2
    loss, g, _ = grad_of("ppo_clip", make([[1.25]], [[1.0]]), eps_low=0.2, eps_high=0.28)
    assert torch.allclose(loss, torch.tensor([[-1.25]])) and torch.allclose(g, torch.tensor([[-1.25]]))
    loss, g, _ = grad_of("ppo_clip", make([[1.25]], [[1.0]]), eps_low=0.2, eps_high=0.2)
    assert torch.allclose(loss, torch.tensor([[-1.2]])) and g[0, 0] == 0


def test_strict_double_clip_binds_both_sides():
    x = make([[1.5, 0.5, 1.1]], [[-1.0, 1.0, 1.0]])
    _, g, met = grad_of("strict_double_clip", x)
    assert torch.allclose(g, torch.tensor([[0.0, 0.0, -1.1]]))
    assert torch.isclose(met["clip_frac"], torch.tensor(2 / 3))


def test_cispo_keeps_gradient_of_clipped_tokens():
    x = make([[3.0, 0.5]], [[1.0, 1.0]])
    loss, g, met = grad_of("cispo", x, eps_low=0.2, eps_high=0.5)
    # weights clip(3) = 1.5, clip(0.5) = 0.8; gradient -A * w (nonzero although clipped)
    assert torch.allclose(loss, torch.tensor([[-1.5, -0.8]]))
    assert torch.allclose(g, torch.tensor([[-1.5, -0.8]]))
    assert torch.isclose(met["clip_frac"], torch.tensor(1.0))


def test_dispo_four_regimes():
    x = make([[3.0, 0.2, 3.0, 0.2]], [[1.0, 1.0, -1.0, -1.0]])
    _, g, met = grad_of("dispo", x, pos_low=0.5, pos_high=1.0, neg_low=0.1, neg_high=0.2)
    # pos: clip to [0.5, 2] -> w = 2, 0.5; neg: clip to [0.9, 1.2] -> w = 1.2, 0.9; grad = -A w
    assert torch.allclose(g, torch.tensor([[-2.0, -0.5, 1.2, 0.9]]))
    assert torch.isclose(met["clip_frac_pos"], torch.tensor(0.5))


def test_gspo_clamps_the_log_sequence_ratio_at_10_like_verl():
    # A = -1: the unclipped branch -A s binds. Row 0: log s = 12 -> clamped to e^10, no gradient;
    # row 1: log s = 1 -> loss e, gradient -A s = e per token (token mean of the sequence ratio, 1 token)
    lr = torch.tensor([[12.0], [1.0]])
    x = PolicyLossInput(logprobs=lr.clone().requires_grad_(True), old_logprobs=torch.zeros(2, 1),
                        advantages=-torch.ones(2, 1), response_mask=torch.ones(2, 1))
    loss, g, _ = grad_of("gspo", x, eps_low=3e-4, eps_high=4e-4)
    assert torch.allclose(loss, torch.tensor([[math.exp(10.0)], [math.e]]), rtol=1e-6)
    assert torch.allclose(g, torch.tensor([[0.0], [math.e]]), rtol=1e-6)


def test_gspo_sequence_ratio_clips_whole_sequence():
    # seq 0: token ratios e^0.1, e^-0.1 -> s = 1 (inside); seq 1: e^0.2, e^0.2 -> s = e^0.2 > 1 + eps, A > 0 -> clipped
    lr = torch.tensor([[0.1, -0.1], [0.2, 0.2]])
    x = PolicyLossInput(logprobs=lr.clone().requires_grad_(True), old_logprobs=torch.zeros(2, 2),
                        advantages=torch.ones(2, 2), response_mask=torch.ones(2, 2))
    loss, g, met = grad_of("gspo", x, eps_low=3e-4, eps_high=4e-4)
    assert torch.allclose(loss[0], torch.tensor([-1.0, -1.0]), atol=1e-6)
    assert torch.allclose(loss[1], torch.full((2,), -(1 + 4e-4)), atol=1e-6)
    assert torch.allclose(g[0], torch.tensor([-1.0, -1.0]), atol=1e-6)  # s_i * (-A) per token
    assert torch.equal(g[1], torch.zeros(2))
    assert torch.isclose(met["clip_frac"], torch.tensor(0.5))


def test_gmpo_geometric_mean_and_log_space_clip():
    lr = torch.tensor([[0.2, -0.2, 0.6]])
    x = PolicyLossInput(logprobs=lr.clone().requires_grad_(True), old_logprobs=torch.zeros(1, 3),
                        advantages=torch.full((1, 3), 2.0), response_mask=torch.ones(1, 3))
    loss, g, _ = grad_of("gmpo", x, eps_low=0.4, eps_high=0.4)
    # A > 0: token 3 clipped at 0.4 -> mean log ratio (0.2 - 0.2 + 0.4) / 3
    J = 2.0 * math.exp(0.4 / 3)
    assert torch.allclose(loss, torch.full((1, 3), -J), atol=1e-5)
    # loss placed on all 3 tokens: d(sum)/d lr_t = 3 * (-J / 3) for unclipped tokens, 0 for the clipped one
    assert torch.allclose(g, torch.tensor([[-J, -J, 0.0]]), atol=1e-5)


def test_sapo_gate_is_policy_gradient_on_policy_and_fades():
    x = make([[1.0, 3.0]], [[1.0, 1.0]])
    loss, g, _ = grad_of("sapo", x, tau_pos=1.0, tau_neg=1.05)
    s = 1 / (1 + math.exp(-2.0))
    assert torch.allclose(loss[0, 0], torch.tensor(-2.0))  # (4/1) * 0.5 * 1
    assert torch.allclose(g, torch.tensor([[-1.0, -4 * s * (1 - s) * 3.0]]), atol=1e-6)
    # the unclipped surrogate -A r would give -3 here: the gate has faded it to 0.42 of that
    assert g[0, 1].abs() < 0.5 * 3.0


def test_gpg_and_sft():
    x = make([[0.5, 0.25]], [[2.0, -1.0]])
    loss, g, _ = grad_of("gpg", x)
    assert torch.allclose(loss, torch.tensor([[-2 * math.log(0.5), math.log(0.25)]]), atol=1e-6)
    assert torch.allclose(g, torch.tensor([[-2.0, 1.0]]))
    x = make([[0.5, 0.25]], [[2.0, -1.0]])
    loss, g, met = grad_of("sft", x)
    assert torch.allclose(g, -torch.ones(1, 2)) and torch.isclose(met["nll"], torch.tensor(-(math.log(0.5) + math.log(0.25)) / 2))


def test_clip_cov_detaches_a_high_covariance_token():
    torch.manual_seed(0)
    # token 0: high log-prob and high advantage -> covariance ~ 1.5 (inside [1, 5])
    lp = torch.tensor([[0.0, -3.0, -3.0, -3.0]])
    A = torch.tensor([[2.0, -1.0, 0.0, -1.0]])
    x = PolicyLossInput(logprobs=lp.clone().requires_grad_(True), old_logprobs=lp.clone(), advantages=A,
                        response_mask=torch.ones(1, 4))
    loss, g, met = grad_of("clip_cov", x, clip_cov_ratio=0.25, cov_lb=1.0, cov_ub=5.0, eps_low=0.2, eps_high=0.2)
    assert g[0, 0] == 0 and torch.allclose(g[0, 1:], -A[0, 1:])
    assert loss[0, 0] == 0 and torch.allclose(loss[0, 1:], -A[0, 1:])  # the selected token's loss is 0 (release)
    assert torch.isclose(met["clip_frac"], torch.tensor(0.25))


def test_kl_cov_penalises_top_covariance_token():
    lp0 = torch.tensor([[0.0, -3.0, -3.0, -3.0]])
    A = torch.tensor([[2.0, -1.0, 0.0, -1.0]])
    lp = lp0 + torch.tensor([[0.1, 0.0, 0.0, 0.0]])
    x = PolicyLossInput(logprobs=lp.clone().requires_grad_(True), old_logprobs=lp0, advantages=A,
                        response_mask=torch.ones(1, 4))
    loss, g, _ = grad_of("kl_cov", x, kl_cov_ratio=0.25, kl_coef=1.0)
    r0 = math.exp(0.1)
    assert torch.isclose(loss[0, 0], torch.tensor(-2 * r0 + 0.1), atol=1e-6)
    assert torch.isclose(g[0, 0], torch.tensor(-2 * r0 + 1.0), atol=1e-6)


def test_aepo_keeps_gradient_of_high_entropy_clipped_tokens_only():
    # both tokens clipped high with A > 0; token 0 high entropy, token 1 low entropy
    x = make([[1.5, 1.5]], [[1.0, 1.0]], entropy=[[2.0, 0.1]])
    loss, g, met = grad_of("aepo", x, eps_low=0.2, eps_high=0.28, entropy_adv_alpha=0.0)
    assert torch.allclose(loss, torch.full((1, 2), -1.28))
    assert torch.isclose(g[0, 0], torch.tensor(-1.28)) and g[0, 1] == 0
    assert torch.isclose(met["clip_frac_high_kept"], torch.tensor(0.5))


def test_gapo_clip_range_grows_with_advantage():
    # seq 0: A = 3 -> eps_high = min(1.0, 0.2 * 3) = 0.6: r = 1.5 is inside; seq 1: A = 0.5 -> eps 0.2: clipped
    x = make([[1.5], [1.5]], [3.0, 0.5])
    _, g, met = grad_of("gapo", x, eps_low=0.2, eps_high=0.2)
    assert torch.allclose(g, torch.tensor([[-4.5], [0.0]]))
    assert torch.isclose(met["eps_high_mean"], torch.tensor(0.4))


def test_hapo_entropy_normalisation_and_parts():
    H = torch.tensor([[math.e ** 2, 1.0, math.e ** -1]])
    m = torch.ones(1, 3)
    h_hat, st = entropy_hhat(H, m)
    # log H = [2, 0, -1], median 0, rms sqrt(5/3); extremes map to +1 / -1
    assert torch.allclose(h_hat, torch.tensor([[1.0, 0.0, -1.0]]))
    assert abs(st.pivot) < 1e-6 and abs(st.rms - math.sqrt(5 / 3)) < 1e-5
    lo, hi = adaptive_clip_range(h_hat, 0.2, 0.28, 1.0)
    assert torch.allclose(lo, torch.tensor([[0.2, 0.2, 0.4]])) and torch.allclose(hi, torch.tensor([[0.56, 0.28, 0.28]]))
    A = torch.ones(1, 3)
    ratio = torch.tensor([[1.5, 1.0, 1.0]])
    a2 = redistribute_advantage(A, h_hat, ratio, lo, hi, 1.0)
    # high-entropy token outside the neutral zone -> A (1 + 1) ; low-entropy inside -> A (1 - 1)
    assert torch.allclose(a2, torch.tensor([[2.0, 1.0, 0.0]]))


def test_hapo_loss_requires_entropy_and_runs():
    x = make([[1.0, 1.0]], [[1.0, -1.0]])
    with pytest.raises(ValueError, match="entropy"):
        compute_policy_loss("hapo", x)
    x = make([[1.0, 1.0]], [[1.0, -1.0]], entropy=[[1.0, 2.0]])
    loss, met = compute_policy_loss("hapo", x)
    assert torch.isfinite(loss).all() and "eps_high_mean" in met


def test_temperature_hook_range_and_first_step():
    hook = make_temperature_hook(0.8, None, tau=0.05)
    assert torch.allclose(hook(torch.randn(3, 11), 0), torch.full((3,), 0.8))
    _, st = entropy_hhat(torch.tensor([[0.1, 1.0, 3.0]]), torch.ones(1, 3))
    hook = make_temperature_hook(1.0, st, tau=0.05)
    flat = torch.zeros(1, 50)  # max entropy -> hottest
    peaked = torch.tensor([[50.0] + [0.0] * 49])  # ~0 entropy -> coolest
    t = hook(torch.cat([flat, peaked]), 3)
    assert torch.allclose(t, torch.tensor([1.05, 0.95]), atol=1e-5)


def test_aggregation_modes_differ_on_unequal_lengths():
    L = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]])
    assert torch.isclose(aggregate("token-mean", L, m), torch.tensor(7 / 5))
    assert torch.isclose(aggregate("seq-mean-token-mean", L, m), torch.tensor((1 + 3) / 2))
    assert torch.isclose(aggregate("seq-mean-token-sum", L, m), torch.tensor((4 + 3) / 2))
    assert torch.isclose(aggregate("seq-mean-token-sum-norm", L, m, norm_const=8), torch.tensor((4 + 3) / 8 / 2))
    # gradient accumulation: two micro-batches with the mini-batch denominator add up to the whole
    whole = aggregate("token-mean", L, m)
    parts = aggregate("token-mean", L[:1], m[:1], denom=5) + aggregate("token-mean", L[1:], m[1:], denom=5)
    assert torch.isclose(whole, parts)


def test_kl_estimators_values_and_in_reward():
    lp, ref = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])
    assert torch.isclose(kl_penalty("k1", lp, ref), torch.tensor([[1.0]]))
    assert torch.isclose(kl_penalty("k2", lp, ref), torch.tensor([[0.5]]))
    assert torch.isclose(kl_penalty("k3", lp, ref), torch.tensor([[math.exp(-1) - 1 + 1]]))
    assert torch.all(kl_penalty("k3", torch.randn(50, 1), torch.randn(50, 1)) >= 0)
    tr = kl_reward_penalty(lp, ref, torch.ones(1, 1), 0.1, "k1")
    assert torch.isclose(tr, torch.tensor([[-0.1]]))


def test_k3_clamped_is_verls_low_var_kl_and_plain_k3_is_not_clamped(compose):
    from rlpost.algos.regularizers import kl_penalty

    lp = torch.tensor([[0.0, -1.0, 0.0]])
    ref = torch.tensor([[12.0, -1.0, -1.0]])  # log_r = 12 (k3 = e^12 - 13, about 162742), 0 (k3 0), -1 (e^-1)
    plain = kl_penalty("k3", lp, ref)
    assert float(plain[0, 0]) == pytest.approx(math.exp(12) - 13, rel=1e-6) and float(plain[0, 1]) == 0.0
    clamped = kl_penalty("k3_clamped", lp, ref)
    assert clamped[0].tolist() == pytest.approx([10.0, 0.0, math.exp(-1)])  # only the large estimate is cut
    assert str(compose(["model=tiny", "algo.kl.estimator=k3_clamped", "algo.kl.coef=0.01"]).algo.kl.estimator) == "k3_clamped"
