"""Objective-level methods (estimators and losses) on small hand-computed tensors.

Each test takes a small case from the paper's equations and checks the
advantages (or loss) against numbers worked out by hand in the comments.
"""

import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, bnpo_beta_params, compute_advantages
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss


def inp(rewards, groups, lengths=None):
    lengths = lengths or [2] * len(rewards)
    mask = torch.zeros(len(rewards), max(lengths))
    for i, L in enumerate(lengths):
        mask[i, :L] = 1.0
    return AdvantageInput(rewards=torch.tensor(rewards, dtype=torch.float32), response_mask=mask,
                          group_index=torch.tensor(groups))


def seq_adv(out, x):
    a = out.advantages
    assert torch.all(a[x.response_mask == 0] == 0)
    assert torch.allclose(a, a[:, :1] * x.response_mask, atol=1e-6)
    return a[:, 0]


def beta_pdf(p, a, b):
    return p ** (a - 1) * (1 - p) ** (b - 1) * math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b))


# --- BNPO (arXiv:2506.02864) ---------------------------------------------------------------------

def test_bnpo_beta_fit_and_advantages_by_hand():
    # two prompts, p = 0.25 and 0.5; a third group with no variance
    x = inp([1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1], [0] * 4 + [1] * 4 + [2] * 4)
    # prompt success rates 0.25, 0.5, 1.0: m = 7/12, unbiased v = ((1/3)^2 + (1/12)^2 + (5/12)^2) / 2
    m = 7 / 12
    v = ((0.25 - m) ** 2 + (0.5 - m) ** 2 + (1.0 - m) ** 2) / 2
    k = m * (1 - m) / v - 1
    alpha, beta = max(1 + k * m / 3, 1), max(1 + k * (1 - m) / 3, 1)
    assert bnpo_beta_params(torch.tensor([0.25, 0.5, 1.0])) == pytest.approx((alpha, beta))
    a = seq_adv(compute_advantages("bnpo", x), x)
    w0, w1 = 1 / beta_pdf(0.25, alpha, beta), 1 / beta_pdf(0.5, alpha, beta)
    want = [0.75 * w0, -0.25 * w0, -0.25 * w0, -0.25 * w0, 0.5 * w1, 0.5 * w1, -0.5 * w1, -0.5 * w1, 0, 0, 0, 0]
    assert torch.allclose(a, torch.tensor(want), atol=1e-5)
    assert torch.equal(a[8:], torch.zeros(4))  # p = 1: density 0, weight capped, advantage exactly 0


def test_bnpo_special_cases_reinforce_and_grpo():
    # one prompt: the release's m = 0, v = 1 gives alpha = beta = 1 -> A = r - p (REINFORCE with baseline)
    assert bnpo_beta_params(torch.tensor([0.3])) == (1.0, 1.0)
    x = inp([1, 0, 0, 0], [0] * 4)
    assert torch.allclose(seq_adv(compute_advantages("bnpo", x), x), torch.tensor([0.75, -0.25, -0.25, -0.25]))
    # equal prompts (v = 0): our guard, alpha = beta = 1, no division by zero
    assert bnpo_beta_params(torch.tensor([0.5, 0.5])) == (1.0, 1.0)
    # alpha = beta = 1.5 is GRPO: f = sqrt(p (1 - p)) / B(1.5, 1.5), B(1.5, 1.5) = pi / 8
    assert beta_pdf(0.25, 1.5, 1.5) == pytest.approx(math.sqrt(0.25 * 0.75) * 8 / math.pi)


def test_bnpo_maps_rewards_to_unit_range_and_rejects_outside():
    x = inp([2.0, -2.0], [0, 0])
    a = seq_adv(compute_advantages("bnpo", x, reward_min=-2.0, reward_max=2.0), x)
    assert torch.allclose(a, torch.tensor([0.5, -0.5]))  # s = 1, 0; p = 0.5; alpha = beta = 1
    with pytest.raises(ValueError, match="rewards must lie in"):
        compute_advantages("bnpo", x)


# --- MaxRL (arXiv:2602.02710) --------------------------------------------------------------------

def test_maxrl_divides_by_success_rate():
    x = inp([1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0], [0] * 4 + [1] * 4 + [2] * 4)
    a = seq_adv(compute_advantages("maxrl", x), x)
    # p = 1/4: success (1 - 1/4) / (1/4) = 3, failure -1; p = 3/4: 1/3 and -1; no success: 0
    assert torch.allclose(a, torch.tensor([3, -1, -1, -1, 1 / 3, 1 / 3, 1 / 3, -1, 0, 0, 0, 0.0]), atol=1e-6)
    # the group-mean of A_i * score_i equals (1/K) sum_success score - (1/N) sum_all score
    score = torch.tensor([0.7, -0.2, 0.4, 1.1])
    assert float((a[:4] * score).mean()) == pytest.approx(0.7 / 1 - float(score.mean()))


def test_maxrl_rejects_negative_mean():
    with pytest.raises(ValueError, match="non-negative rewards"):
        compute_advantages("maxrl", inp([-1.0, 0.0], [0, 0]))


# --- F-GRPO (arXiv:2602.06717) -------------------------------------------------------------------

def test_fgrpo_focal_weight_on_grpo_advantage():
    x = inp([1, 0, 0, 0, 1, 1, 1, 0], [0] * 4 + [1] * 4)
    a = seq_adv(compute_advantages("fgrpo", x, gamma=1.0), x)
    # group 0: p = 1/4, unbiased std 0.5, GRPO A = [1.5, -0.5, -0.5, -0.5], weight 3/4
    # group 1: p = 3/4, std 0.5, GRPO A = [0.5, 0.5, 0.5, -1.5], weight 1/4
    want = torch.tensor([1.5, -0.5, -0.5, -0.5]) * 0.75
    want = torch.cat([want, torch.tensor([0.5, 0.5, 0.5, -1.5]) * 0.25])
    assert torch.allclose(a, want, atol=1e-5)
    a2 = seq_adv(compute_advantages("fgrpo", x, gamma=2.0), x)
    assert a2[0] == pytest.approx(1.5 * 0.75 ** 2, abs=1e-5) and a2[7] == pytest.approx(-1.5 / 16, abs=1e-5)
    # gamma = 0 is GRPO exactly (up to float rounding)
    g = seq_adv(compute_advantages("grpo", x), x)
    assert torch.allclose(seq_adv(compute_advantages("fgrpo", x, gamma=0.0), x), g, atol=1e-6)


def test_difficulty_weighted_estimators_zero_variance_exact_zero():
    x = inp([1, 1, 0, 0], [0, 0, 1, 1])
    for name in ("bnpo", "maxrl", "fgrpo"):
        a = compute_advantages(name, x).advantages
        assert torch.equal(a, torch.zeros_like(a)), name


# --- REC / OPMD / AsymRE (arXiv:2509.24203) ------------------------------------------------------

def make(ratios, adv):
    """Old log-probs 0, current log-probs log(ratio) as a leaf with grad."""
    r = torch.tensor(ratios, dtype=torch.float32)
    lp = torch.log(r).clone().requires_grad_(True)
    A = torch.tensor(adv, dtype=torch.float32)
    return PolicyLossInput(logprobs=lp, old_logprobs=torch.zeros_like(r), advantages=A, response_mask=torch.ones_like(r))


def grad_of(name, x, **p):
    loss, met = compute_policy_loss(name, x, **p)
    loss.sum().backward()
    return loss.detach(), x.logprobs.grad.clone(), met


# tokens: r=1.5,A=+1 | r=1.5,A=-1 | r=0.5,A=-1 | r=0.5,A=+1 | r=1.0,A=+2 | r=3.5,A=-1
R = [[1.5, 1.5, 0.5, 0.5, 1.0, 3.5]]
ADV = [[1.0, -1.0, -1.0, 1.0, 2.0, -1.0]]


def test_rec_one_side_no_is_is_plain_reinforce_on_kept_tokens():
    loss, g, met = grad_of("rec", make(R, ADV))  # defaults: one_side, weight none
    # one_side drops token 0 (r > 1.2, A > 0) and token 2 (r < 0.8, A < 0); the rest get -A grad log pi
    assert torch.allclose(g, torch.tensor([[0.0, 1.0, 0.0, -1.0, -2.0, 1.0]]))
    assert torch.allclose(loss, torch.tensor([[0.0, 1.0, 0.0, -1.0, -2.0, 1.0]]))
    assert float(met["clip_frac"]) == pytest.approx(2 / 6)


def test_rec_one_side_with_is_equals_ppo_clip_gradient():
    x1, x2 = make(R, ADV), make(R, ADV)
    _, g_rec, _ = grad_of("rec", x1, weight="importance_sampling")
    _, g_ppo, _ = grad_of("ppo_clip", x2)
    assert torch.allclose(g_rec, g_ppo)  # the paper's reading of GRPO: one-side clipping + IS weight


def test_rec_two_side_and_ring():
    _, g2, _ = grad_of("rec", make(R, ADV), clip_mode="two_side")
    # two_side keeps only r in [0.8, 1.2]: token 4
    assert torch.allclose(g2, torch.tensor([[0.0, 0.0, 0.0, 0.0, -2.0, 0.0]]))
    _, gr, _ = grad_of("rec", make(R, ADV), clip_mode="ring")
    # ring adds A >= 0 with r <= 0.4 (none: token 3 has r = 0.5) and A <= 0 with r >= 3 (token 5)
    assert torch.allclose(gr, torch.tensor([[0.0, 0.0, 0.0, 0.0, -2.0, 1.0]]))


def test_opmd_k2_and_asymre_forward_kl_regularisers():
    x = make([[2.0, 0.5]], [[1.0, -1.0]])
    loss, g, _ = grad_of("rec", x, clip_mode="none", regularizer="k2", regularizer_coef=0.1)
    l2 = math.log(2.0)
    # k2: +0.1 (log r)^2, gradient 0.2 log r; PG part -A
    assert torch.allclose(loss, torch.tensor([[-1.0 + 0.1 * l2 ** 2, 1.0 + 0.1 * l2 ** 2]]), atol=1e-6)
    assert torch.allclose(g, torch.tensor([[-1.0 + 0.2 * l2, 1.0 - 0.2 * l2]]), atol=1e-6)
    _, ga, _ = grad_of("rec", make([[2.0, 0.5]], [[1.0, -1.0]]), clip_mode="none", regularizer="forward_kl",
                       regularizer_coef=0.1)
    # AsymRE: -(A + tau) grad log pi, i.e. the baseline lowered by tau
    assert torch.allclose(ga, torch.tensor([[-1.1, 0.9]]), atol=1e-6)


def test_rec_weights_tis_and_advantage():
    _, g, _ = grad_of("rec", make([[3.0, 0.2]], [[1.0, 1.0]]), clip_mode="none",
                      weight="truncated_importance_sampling")
    assert torch.allclose(g, torch.tensor([[-3.0, -0.4]]))  # clip(r, 0.4, 3.0) * -A
    _, g, _ = grad_of("rec", make([[1.0, 1.0]], [[1.0, -1.0]]), clip_mode="none", weight="advantage", temp=2.0)
    assert torch.allclose(g, torch.tensor([[-math.exp(0.5), math.exp(-0.5)]]), atol=1e-6)


# --- max@k (arXiv:2510.23393) --------------------------------------------------------------------

def test_max_at_k_subset_credit_and_loo_baseline_by_hand():
    x = inp([0.0, 1.0, 0.0, 0.5], [0] * 4)
    # size-2 subsets and their max: {0,1}=1 {0,2}=0 {0,3}=.5 {1,2}=1 {1,3}=1 {2,3}=.5
    # A_i = k * mean max over the 3 subsets containing i: 2*(1.5/3), 2*(3/3), 2*(1.5/3), 2*(2/3)
    a = seq_adv(compute_advantages("max_at_k", x, k=2, baseline="none"), x)
    assert torch.allclose(a, torch.tensor([1.0, 2.0, 1.0, 4 / 3]), atol=1e-6)
    # loo baseline: k * max@2 of the other three: {1,0,.5} -> 2*(1+1+.5)/3, {0,0,.5} -> 2*(1/3), {0,1,0} -> 2*(2/3)
    a = seq_adv(compute_advantages("max_at_k", x, k=2), x)
    assert torch.allclose(a, torch.tensor([1 - 5 / 3, 2 - 2 / 3, 1 - 5 / 3, 0.0]), atol=1e-6)


def test_max_at_k_one_is_reinforce_and_unbiased_against_enumeration():
    x = inp([0.0, 1.0, 0.0, 1.0, 1.0], [0] * 5)
    assert torch.allclose(seq_adv(compute_advantages("max_at_k", x, k=1, baseline="none"), x), x.rewards)
    # binary rewards, k = 3: group mean of A_i / k is the unbiased pass@3 estimate 1 - C(2,3)/C(5,3) = 1
    a = seq_adv(compute_advantages("max_at_k", x, k=3, baseline="none"), x)
    assert float(a.mean()) / 3 == pytest.approx(1.0)
    with pytest.raises(ValueError, match="fewer than 6"):
        compute_advantages("max_at_k", x, k=5)


@pytest.mark.parametrize("params", [{}, {"regularizer": "k2", "regularizer_coef": 0.1, "clip_mode": "ring"}])
def test_rec_micro_batch_split_gives_the_whole_batch_loss_and_gradient(params):
    from rlpost.algos.aggregation import aggregate

    torch.manual_seed(1)
    lp0 = torch.randn(4, 5) * 0.3 - 1.0
    old = lp0 + torch.randn(4, 5) * 0.3
    A = torch.randn(4, 1).expand(4, 5).clone()
    m = torch.ones(4, 5)
    m[1, 3:] = 0
    m[3, 1:] = 0

    def run(rows, denom):
        lp = lp0.clone().requires_grad_(True)
        x = PolicyLossInput(logprobs=lp[rows], old_logprobs=old[rows], advantages=A[rows], response_mask=m[rows])
        loss_mat, _ = compute_policy_loss("rec", x, **params)
        loss = aggregate("token-mean", loss_mat, m[rows], denom=denom)
        loss.backward()
        return loss.detach(), lp.grad

    whole, g_whole = run(slice(0, 4), float(m.sum()))
    a, ga = run(slice(0, 2), float(m.sum()))
    b, gb = run(slice(2, 4), float(m.sum()))
    assert torch.isclose(whole, a + b)
    assert torch.allclose(g_whole, ga + gb)


# --- DGPO (arXiv:2601.20614) ---------------------------------------------------------------------

def test_dgpo_mad_normalisation_and_question_weights_by_hand():
    x = inp([1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0], [0] * 4 + [1] * 4 + [2] * 4)
    # DGAE: both groups have summed |r - mean| = 1.5, so A = 4 (r - mean) / (1.5 + 1e-4)
    c = 4 / (1.5 + 1e-4)
    dgae = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75]) * c
    a = seq_adv(compute_advantages("dgpo", x, dqw=False, rescale_valid=False), x)
    assert torch.allclose(a[:8], dgae, atol=1e-5) and torch.equal(a[8:], torch.zeros(4))
    assert float(a[:4].abs().sum()) == pytest.approx(float(a[4:8].abs().sum()))  # equal update per question
    # DQW: 2 * softmax(-[0.25, 0.75] / 2); the harder question (mean 0.25) weighs more
    l0 = 2 / (1 + math.exp(-0.25))
    l1 = 2 - l0
    a = seq_adv(compute_advantages("dgpo", x, rescale_valid=False), x)
    assert torch.allclose(a[:8], dgae * torch.tensor([l0] * 4 + [l1] * 4), atol=1e-5)
    # rescale: 24 tokens in all, 16 in the two groups with variance -> x 1.5
    a = seq_adv(compute_advantages("dgpo", x), x)
    assert torch.allclose(a[:8], 1.5 * dgae * torch.tensor([l0] * 4 + [l1] * 4), atol=1e-5)


# --- DPPO (arXiv:2602.04879) ---------------------------------------------------------------------

def dppo_input(pi, mu, adv):
    lp = torch.log(torch.tensor([pi])).requires_grad_(True)
    lmu = torch.log(torch.tensor([mu]))
    return PolicyLossInput(logprobs=lp, old_logprobs=lmu.clone(), advantages=torch.tensor([adv]),
                           response_mask=torch.ones(1, len(pi)), rollout_logprobs=lmu)


def test_dppo_binary_tv_masks_by_probability_shift_not_ratio():
    # tokens (pi, mu, A): (.7, .5, +1) rises by .2 > .15: masked | (.7, .5, -1) wrong side: kept, ratio 1.4
    # | (.1, .01, +1) ratio 10 but shift .09: kept (PPO would clip it) | (.7, .9, -1) falls by .2: masked
    x = dppo_input([0.7, 0.7, 0.1, 0.7], [0.5, 0.5, 0.01, 0.9], [1.0, -1.0, 1.0, -1.0])
    loss, g, met = grad_of("dppo", x)
    assert torch.allclose(g, torch.tensor([[0.0, 1.4, -10.0, 0.0]]), atol=1e-5)  # -A * (pi / mu) on kept tokens
    assert torch.allclose(loss, g, atol=1e-5)  # value -A w equals the gradient coefficient
    assert float(met["clip_frac"]) == pytest.approx(0.5)
    assert float(met["clip_frac_high"]) == pytest.approx(0.25) and float(met["clip_frac_low"]) == pytest.approx(0.25)


def test_dppo_binary_kl_threshold():
    # KL(Bern(.5) || Bern(.7)) = .5 ln(.5/.7) + .5 ln(.5/.3) = 0.0872 > 0.05: masked (A > 0, pi > mu)
    # KL(Bern(.01) || Bern(.1)) = .01 ln(.1) + .99 ln(.99/.9) = 0.0713 > 0.05: masked as well
    # KL(Bern(.5) || Bern(.55)) = 0.0050 < 0.05: kept, gradient -A * 1.1
    x = dppo_input([0.7, 0.1, 0.55], [0.5, 0.01, 0.5], [1.0, 1.0, 1.0])
    _, g, _ = grad_of("dppo", x, divergence="kl", eps_low=0.05, eps_high=0.05)
    assert torch.allclose(g, torch.tensor([[0.0, 0.0, -1.1]]), atol=1e-5)


def test_max_at_k_group_smaller_than_k_is_a_config_error():
    from typer.testing import CliRunner

    from rlpost.cli import app

    res = CliRunner().invoke(app, ["config", "model=tiny", "algo=max_at_k", "algo.n_samples_per_prompt=4"])
    assert res.exit_code == 2, res.output
    assert "algo.n_samples_per_prompt >= 5" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("kind,name,values", [
    ("adv", "bnpo", {"reward_min": 0.0, "reward_max": 1.0, "max_weight": 1e6}),  # authors' release
    ("adv", "dgpo", {"dqw": True, "dqw_temp": 2.0, "eps": 1e-4}),  # authors' release
    ("loss", "rec", {"clip_mode": "one_side", "weight": "none", "eps_low": 0.2, "eps_high": 0.2}),  # REC-OneSide-NoIS
    ("loss", "dppo", {"divergence": "tv", "eps_low": 0.15, "eps_high": 0.15, "anchor": "rollout"}),  # run script
])
def test_headline_defaults_are_the_sources_values(kind, name, values):
    from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
    from rlpost.core.registry import defaults_of

    reg = ADV_ESTIMATORS if kind == "adv" else POLICY_LOSSES
    d = defaults_of(reg.params_of(name))
    for k, v in values.items():
        assert getattr(d[k], "value", d[k]) == v, (name, k)


# --- TPO (arXiv:2604.06159) ----------------------------------------------------------------------

def tpo_input(lp, old, adv, groups, mask=None):
    lp = torch.tensor(lp).requires_grad_(True)
    old = torch.tensor(old)
    m = torch.ones_like(old) if mask is None else torch.tensor(mask)
    return PolicyLossInput(logprobs=lp, old_logprobs=old, advantages=torch.tensor(adv), response_mask=m,
                           group_index=torch.tensor(groups))


def test_tpo_gradient_is_p_minus_target_by_hand():
    # one group of two: l = [-2, -3] (on-policy), rewards [1, 0] -> population z-scores u = [1, -1]
    x0 = inp([1.0, 0.0], [0, 0])
    u = seq_adv(compute_advantages("grpo", x0, unbiased_std=False), x0)
    assert torch.allclose(u, torch.tensor([1.0, -1.0]), atol=1e-5)  # GRPO's Bessel std would give +-0.707
    lp = [[-1.0, -1.0], [-2.0, -1.0]]
    x = tpo_input(lp, lp, [[1.0, 1.0], [-1.0, -1.0]], [0, 0])
    loss, g, met = grad_of("tpo", x)
    p_a = 1 / (1 + math.exp(-1))  # softmax(-2, -3)
    q_a = 1 / (1 + math.exp(-1) * math.exp(-2))  # p_old * e^{u}: odds e^{1} * e^{2}
    c = 2 * (p_a - q_a)  # K (p - q) on every token of sequence A, the opposite on B
    assert c == pytest.approx(-0.4430, abs=1e-4)
    assert torch.allclose(g, torch.tensor([[c, c], [-c, -c]]), atol=1e-5)
    # value: K * (-q log p) per sequence, spread over its tokens
    ce = -2 * (q_a * math.log(p_a) + (1 - q_a) * math.log(1 - p_a))
    assert float(loss.sum()) == pytest.approx(ce, abs=1e-5)
    assert float(met["seq_tpo_target_gap"]) == pytest.approx(abs(p_a - q_a), abs=1e-5)


def test_tpo_matches_autograd_cross_entropy_and_zero_variance_groups_are_neutral():
    from rlpost.algos.aggregation import aggregate

    torch.manual_seed(0)
    lp0 = torch.randn(6, 4) * 0.5 - 1.5
    old = lp0 + 0.2 * torch.randn(6, 4)
    m = torch.ones(6, 4)
    m[1, 2:] = 0
    m[4, 1:] = 0
    u = torch.tensor([1.2, -0.3, -0.9, 0.0, 0.0, 0.0])  # group 0 informative, group 1 zero-variance
    gi = torch.tensor([0, 0, 0, 1, 1, 1])
    lp = lp0.clone().requires_grad_(True)
    x = PolicyLossInput(logprobs=lp, old_logprobs=old, advantages=u[:, None] * m, response_mask=m, group_index=gi)
    loss_mat, _ = compute_policy_loss("tpo", x)
    aggregate("seq-mean-token-sum", loss_mat, m).backward()
    # reference: mean over groups of -sum_i q_i log softmax(l)_i with q = softmax(l_old + u), q fixed
    lp2 = lp0.clone().requires_grad_(True)
    ell, ell_old = (lp2 * m).sum(-1), (old * m).sum(-1)
    ref = 0.0
    for g in (0, 1):
        idx = gi == g
        q = torch.softmax(torch.log_softmax(ell_old[idx], 0) + u[idx], 0).detach()
        ref = ref - (q * torch.log_softmax(ell[idx], 0)).sum() / 2
    ref.backward()
    assert torch.allclose(lp.grad, lp2.grad, atol=1e-5)
    # on the rollout snapshot (old = current) a zero-variance group gets exactly no gradient
    lp3 = lp0.clone().requires_grad_(True)
    x3 = PolicyLossInput(logprobs=lp3, old_logprobs=lp0.clone(), advantages=u[:, None] * m, response_mask=m, group_index=gi)
    compute_policy_loss("tpo", x3)[0].sum().backward()
    assert torch.allclose(lp3.grad[3:], torch.zeros(3, 4), atol=1e-7) and lp3.grad[:3].abs().sum() > 0


def test_tpo_micro_batches_split_a_group_and_give_the_whole_gradient():
    from rlpost.algos.aggregation import aggregate

    torch.manual_seed(2)
    lp0 = torch.randn(4, 3) - 1.0
    old = lp0 + 0.1 * torch.randn(4, 3)
    m = torch.ones(4, 3)
    A = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]).expand(4, 3).clone()
    gi = torch.tensor([0, 0, 0, 1])
    whole = PolicyLossInput(logprobs=lp0.clone(), old_logprobs=old, advantages=A, response_mask=m, group_index=gi)

    def run(rows):
        lp = lp0.clone().requires_grad_(True)
        x = PolicyLossInput(logprobs=lp[rows], old_logprobs=old[rows], advantages=A[rows], response_mask=m[rows],
                            group_index=gi[rows], batch=whole, rows=torch.tensor(rows))
        aggregate("seq-mean-token-sum", compute_policy_loss("tpo", x)[0], m[rows], denom=4.0).backward()
        return lp.grad

    lp = lp0.clone().requires_grad_(True)
    aggregate("seq-mean-token-sum", compute_policy_loss("tpo", PolicyLossInput(
        logprobs=lp, old_logprobs=old, advantages=A, response_mask=m, group_index=gi))[0], m).backward()
    assert torch.allclose(run([0, 1]) + run([2, 3]), lp.grad, atol=1e-6)  # group 0 is split 2 + 1


def test_tpo_needs_group_index_and_refuses_seq_mean_token_mean():
    from omegaconf import OmegaConf

    from rlpost.algos.validate import validate_algo
    from rlpost.core.errors import ConfigError

    x = make([[1.0, 1.0]], [[1.0, 1.0]])
    with pytest.raises(ValueError, match="group_index"):
        compute_policy_loss("tpo", x)
    with pytest.raises(ConfigError, match="seq-mean-token-mean"):
        validate_algo(OmegaConf.create({"adv_estimator": "grpo", "loss": "tpo", "loss_agg": "seq-mean-token-mean",
                                        "n_samples_per_prompt": 4, "kl": {"coef": 0.0}}))


# --- CPGD (arXiv:2505.12504) ---------------------------------------------------------------------

def test_cpgd_clipped_log_ratio_gradient_and_drift_by_hand():
    # (r, A): (1.5, +1) log r above log 1.2: PG cut | (1.1, +1) inside | (0.5, -1) below log 0.8: cut | (0.9, -1) inside
    x = make([[1.5, 1.1, 0.5, 0.9]], [[1.0, 1.0, -1.0, -1.0]])
    loss, g, met = grad_of("cpgd", x)
    # gradient: -A on kept tokens (no ratio factor) + 0.01 (r - 1) from the drift KL(pi_old || pi)
    assert torch.allclose(g, torch.tensor([[0.005, -1.0 + 0.001, -0.005, 1.0 - 0.001]]), atol=1e-6)
    drift = [r - 1 - math.log(r) for r in (1.5, 1.1, 0.5, 0.9)]
    clipped = [math.log(1.2), math.log(1.1), math.log(0.8), math.log(0.9)]
    want = [-a * c + 0.01 * d for a, c, d in zip((1, 1, -1, -1), clipped, drift)]
    assert torch.allclose(loss, torch.tensor([want]), atol=1e-6)
    assert float(met["clip_frac"]) == pytest.approx(0.5)
    assert float(met["policy_drift"]) == pytest.approx(sum(drift) / 4, abs=1e-6)


# --- CFPO (arXiv:2601.22801) ---------------------------------------------------------------------

def test_cfpo_quadratic_penalty_peaks_at_the_clip_boundary():
    # loss = -(r A - |A| (r - 1)^2 / (2 eps)); d loss / d log pi = -(A - |A| (r - 1) / eps) r
    x = make([[1.5, 1.1, 1.2, 1.0, 0.7]], [[1.0, 1.0, 1.0, -2.0, -1.0]])
    loss, g, met = grad_of("cfpo", x)
    assert torch.allclose(loss[0, :2], torch.tensor([-(1.5 - 0.25 / 0.4), -(1.1 - 0.01 / 0.4)]), atol=1e-6)
    # r = 1.5 beyond 1 + eps: the gradient pushes back (PPO's would be 0); r = 1.2: stationary; r = 0.7, A < 0: back up
    want = [-(1 - 0.5 / 0.2) * 1.5, -(1 - 0.1 / 0.2) * 1.1, 0.0, 2.0, -(-1 + 0.3 / 0.2) * 0.7]
    assert torch.allclose(g, torch.tensor([want]), atol=1e-5)
    assert float(met["clip_frac"]) == pytest.approx(2 / 5)  # tokens 0 and 4 are past the boundary


# --- KPO (arXiv:2602.10609) ----------------------------------------------------------------------

def test_kpo_kalman_gains_by_hand_and_gradient_reaches_earlier_tokens():
    from rlpost.algos.losses import kalman_filter_log_ratio

    Q, R0, P0 = 0.01, 0.1, 1.0
    k1 = (P0 + Q) / (P0 + Q + R0)  # 0.90991
    p1 = (1 - k1) * (P0 + Q)
    k2 = (p1 + Q) / (p1 + Q + R0)  # 0.50246
    z = torch.tensor([[0.3, 0.0, 0.2]])
    m = torch.tensor([[1.0, 0.0, 1.0]])  # a hole: x and P carry over it
    x = kalman_filter_log_ratio(z, m, Q, R0, P0)
    assert k1 == pytest.approx(0.90991, abs=1e-5) and k2 == pytest.approx(0.50246, abs=1e-5)
    assert torch.allclose(x, torch.tensor([[k1 * 0.3, 0.0, k1 * 0.3 + k2 * (0.2 - k1 * 0.3)]]), atol=1e-6)
    # on-policy, A = 1, two tokens: rho = 1, d loss_2 / d log pi_1 = -k1 (1 - k2), so token 1 gets -(k1 + k1 (1 - k2))
    xin = make([[1.0, 1.0]], [[1.0, 1.0]])
    loss, g, met = grad_of("kpo", xin)
    assert torch.allclose(g, torch.tensor([[-(k1 + k1 * (1 - k2)), -k2]]), atol=1e-5)
    assert float(met["kpo_ratio_mean"]) == pytest.approx(1.0)


# --- EGSW (arXiv:2503.22456) and SEED-GRPO (arXiv:2505.12346) --------------------------------------

def test_egsw_group_softmax_of_advantage_plus_entropy_by_hand():
    x = inp([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1])
    x.entropy = torch.tensor([[0.5, 0.5], [1.0, 1.0], [2.0, 2.0], [0.0, 0.0]])
    a = seq_adv(compute_advantages("egsw", x, alpha=0.1, temperature=1.0), x)
    A = 0.5 / (math.sqrt(0.5) + 1e-6)  # GRPO with the unbiased std of (1, 0)
    s0, s1 = A + 0.05, -A + 0.1
    w0 = 2 * math.exp(s0) / (math.exp(s0) + math.exp(s1))
    assert torch.allclose(a, torch.tensor([w0 * A, -(2 - w0) * A, 0.0, 0.0]), atol=1e-5)
    # alpha = 0 and a huge temperature: equal weights, GRPO exactly
    g = seq_adv(compute_advantages("grpo", x), x)
    assert torch.allclose(seq_adv(compute_advantages("egsw", x, alpha=0.0, temperature=1e9), x), g, atol=1e-6)


def test_seed_grpo_semantic_entropy_scaling_by_hand():
    x = inp([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], [0] * 4 + [1] * 4)
    x.answer_ids = torch.tensor([0, 0, 1, 2, 5, 6, 6, 6])
    a = seq_adv(compute_advantages("seed_grpo", x), x)
    se0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))  # clusters 2/4, 1/4, 1/4: 1.0397
    se1 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))  # 0.5623
    f0, f1 = 1 - 0.5 * se0 / math.log(4), 1 - 0.5 * se1 / math.log(4)
    g = seq_adv(compute_advantages("grpo", x), x)
    assert f0 == pytest.approx(0.625, abs=1e-3)
    assert torch.allclose(a, g * torch.tensor([f0] * 4 + [f1] * 4), atol=1e-5)
    x.answer_ids = torch.tensor([3, 3, 3, 3, 4, 4, 4, 4])  # one answer per group: confident, GRPO unchanged
    assert torch.allclose(seq_adv(compute_advantages("seed_grpo", x), x), g, atol=1e-6)
    x.answer_ids = None
    with pytest.raises(ValueError, match="answer_ids"):
        compute_advantages("seed_grpo", x)


def test_answer_cluster_ids_normalise_numbers_and_isolate_unparseable():
    from rlpost.methods.seed_grpo import answer_cluster_ids

    ids = answer_cluster_ids(["<answer>12</answer>", "so <answer>12.0</answer>", "no answer here",
                              "<answer> 7 </answer>", "<answer>1,000</answer>", "<answer>1000</answer>"], "tags")
    assert ids.tolist() == [0, 0, -3, 1, 2, 2]


# --- SSPO (arXiv:2511.04256) ---------------------------------------------------------------------

def test_sspo_subsentence_ratio_and_entropy_scaled_clip_by_hand():
    lr = torch.tensor([[0.2, 0.4, -0.1, 0.1]])
    x = PolicyLossInput(logprobs=lr.clone().requires_grad_(True), old_logprobs=torch.zeros(1, 4), advantages=torch.ones(1, 4), response_mask=torch.ones(1, 4), entropy=torch.tensor([[1.0, 1.0, 3.0, 3.0]]), extras={'segment_ids': torch.tensor([[0, 0, 1, 1]])})
    loss, g, met = grad_of("sspo", x)
    # subsentence ratios e^0.3 and e^0.0; entropy scales 1/2 and 3/2 of the batch mean 2 -> eps 0.1 and 0.3
    # first: 1.35 > 1.1 with A > 0 -> clipped, no gradient; second: ratio 1 -> gradient -A * 1 on each token
    assert torch.allclose(g, torch.tensor([[0.0, 0.0, -1.0, -1.0]]), atol=1e-6)
    assert torch.allclose(loss, torch.tensor([[-1.1, -1.1, -1.0, -1.0]]), atol=1e-6)
    assert float(met["eps_high_mean"]) == pytest.approx(0.2)
    # GRPO's token ratios would clip tokens 0 and 1 too, but keep -r on tokens 2 and 3 (0.905, 1.105)
    _, g_tok, _ = grad_of("ppo_clip", PolicyLossInput(logprobs=lr.clone().requires_grad_(True),
                          old_logprobs=torch.zeros(1, 4), advantages=torch.ones(1, 4), response_mask=torch.ones(1, 4)))
    assert torch.allclose(g_tok[0, 2:], -torch.exp(lr[0, 2:]), atol=1e-6)


def test_subsentence_ids_cut_after_punctuation():
    from rlpost.algos.inputs import subsentence_ids

    class Tok:
        def decode(self, ids):
            return {1: "Yes", 2: ",", 3: " so", 4: " 3.", 5: "\n", 6: "x"}[ids[0]]

    ids = torch.tensor([[1, 2, 3, 4, 6, 5, 6, 0]])
    m = torch.tensor([[1.0, 1, 1, 1, 1, 1, 1, 0]])
    assert subsentence_ids(ids, m, Tok()).tolist() == [[0, 0, 1, 1, 2, 2, 3, 3]]


# --- PNPO (prefix-normalised ratio) --------------------------------------------------------------

def test_pnpo_prefix_geometric_mean_weight_by_hand():
    from rlpost.algos.losses import prefix_mean_log_ratio

    lr = torch.tensor([[0.3, -0.1, 0.4, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    assert torch.allclose(prefix_mean_log_ratio(lr, m), torch.tensor([[0.3, 0.1, 0.0, 0.2 / 3]]), atol=1e-6)
    # two tokens, A = +1: rho_1 = e^0.3 > 1.2 clipped (no gradient); rho_2 = e^{(0.3 - 0.1) / 2} = 1.105 inside:
    # d(-rho_2) / d log pi_s = -rho_2 / 2 for both prefix tokens
    x = make([[math.exp(0.3), math.exp(-0.1)]], [[1.0, 1.0]])
    loss, g, met = grad_of("pnpo", x)
    r2 = math.exp(0.1)
    assert torch.allclose(g, torch.tensor([[-r2 / 2, -r2 / 2]]), atol=1e-5)
    assert torch.allclose(loss, torch.tensor([[-1.2, -r2]]), atol=1e-5)
    assert float(met["clip_frac"]) == pytest.approx(0.5)


# --- NAT (Horvitz-Thompson partial-token gradient) ------------------------------------------------

def test_nat_rpc_inclusion_probabilities_and_unbiased_gradient():
    from rlpost.algos.losses import nat_inclusion

    m = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    _, pi = nat_inclusion(m, "rpc", 0.5, torch.Generator().manual_seed(0))
    assert torch.allclose(pi[0], torch.tensor([1.0, 0.75, 0.5, 0.25]))  # cut uniform in 1..4
    assert torch.allclose(pi[1, :2], torch.tensor([1.0, 0.5]))
    keep, _ = nat_inclusion(m, "rpc", 0.5, torch.Generator().manual_seed(3))
    assert bool(keep[:, 0].all())  # a prefix always keeps the first token
    # the mean gradient over many draws approaches the full-token PPO gradient (Horvitz-Thompson)
    full = grad_of("ppo_clip", make([[1.1, 0.9, 1.3, 1.0]], [[1.0, -1.0, 1.0, 2.0]]))[1]
    for sel in ("urs", "rpc"):
        acc = torch.zeros(1, 4)
        for s in range(400):
            x = make([[1.1, 0.9, 1.3, 1.0]], [[1.0, -1.0, 1.0, 2.0]])
            x.seed = s
            acc += grad_of("nat", x, selector=sel)[1]
        assert torch.allclose(acc / 400, full, atol=0.15), (sel, acc / 400, full)
    x = make([[1.1, 0.9, 1.3, 1.0]], [[1.0, -1.0, 1.0, 2.0]])
    x.seed = 0
    assert torch.allclose(grad_of("nat", x, keep_prob=1.0)[1], full)  # keep everything: PPO exactly
