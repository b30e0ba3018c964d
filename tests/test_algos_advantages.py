"""Advantage estimators on small hand-computed tensors."""

import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.algos.shaping import BetaBaselineTracker
from rlpost.rewards import RewardFunction, overlong_penalty
from rlpost.core.errors import ConfigError


def inp(rewards, lengths, groups, R=None, **kw):
    R = R or max(lengths)
    mask = torch.zeros(len(lengths), R)
    for i, L in enumerate(lengths):
        mask[i, :L] = 1.0
    kw.setdefault("answer_ids", torch.arange(len(lengths)) % 3)  # answer clusters for seed_grpo
    # opd_token (model.teacher): a teacher that agrees with the student's rollout log-probs gives 0
    kw.setdefault("teacher_logprobs", torch.zeros(len(lengths), R))
    kw.setdefault("rollout_logprobs", torch.zeros(len(lengths), R))
    kw.setdefault("reference_rewards", torch.zeros(len(lengths), 8))  # a_star: 8 reference samples, reward 0
    kw.setdefault("privileged_shifts", torch.zeros(len(lengths), R, 2))  # cscr: no sensitivity (GRPO's credit)
    kw.setdefault("response_ids", torch.zeros(len(lengths), R, dtype=torch.long))  # hgpo/rtmc/g2po match turns by ids
    return AdvantageInput(
        rewards=torch.tensor(rewards, dtype=torch.float32), response_mask=mask,
        group_index=torch.tensor(groups), **kw,
    )


def seq_adv(out, x):
    """Advantage of each sequence (its first token) and a check that it is constant on the mask."""
    a = out.advantages
    assert torch.all(a[x.response_mask == 0] == 0)
    first = a[:, 0]
    assert torch.allclose(a, first[:, None] * x.response_mask, atol=1e-6)
    return first


def test_grpo_values_and_zero_mean_per_group():
    x = inp([1, 0, 0, 1, 1, 1], [2, 3, 1, 2, 2, 2], [0, 0, 0, 0, 1, 1])
    a = seq_adv(compute_advantages("grpo", x), x)
    # group 0: mean 0.5, unbiased std sqrt(1/3)
    s = math.sqrt(1 / 3)
    assert torch.allclose(a[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (s + 1e-6), atol=1e-5)
    assert abs(float(a[:4].sum())) < 1e-5
    # zero-variance group -> exactly 0, never NaN
    assert torch.equal(a[4:], torch.zeros(2))


def test_dr_grpo_no_std():
    x = inp([2, 0, 1], [1, 1, 1], [0, 0, 0])
    a = seq_adv(compute_advantages("grpo", x, norm_by_std=False), x)
    assert torch.allclose(a, torch.tensor([1.0, -1.0, 0.0]))


def test_rloo_leave_one_out():
    x = inp([1, 0, 0, 1, 5], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1])
    a = seq_adv(compute_advantages("rloo", x), x)
    # sample 0: 1 - mean(0,0,1) = 2/3; sample 1: 0 - mean(1,0,1) = -2/3
    assert torch.allclose(a, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0]), atol=1e-6)


def test_opo_length_weighted_baseline():
    x = inp([1, 0], [3, 1], [0, 0])
    a = seq_adv(compute_advantages("opo", x), x)
    b = (3 * 1 + 1 * 0) / 4
    assert torch.allclose(a, torch.tensor([1 - b, -b]))


def test_gpg_rectification_alpha():
    # two groups; the second has zero variance: M = 2 of B = 4 -> alpha = 2
    x = inp([1, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1])
    a = seq_adv(compute_advantages("gpg", x, norm_by_std=False), x)
    assert torch.allclose(a, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_mc_grpo_median_and_pivot_excluded():
    x = inp([3, 1, 2, 0, 5], [1, 2, 1, 1, 1], [0, 0, 0, 0, 0])
    out = compute_advantages("mc_grpo", x, norm_by_std=False)
    a = seq_adv(out, x)
    assert torch.allclose(a, torch.tensor([1.0, -1.0, 0.0, -2.0, 3.0]))
    # the median rollout (reward 2, index 2) is the pivot, removed from the loss mask
    assert torch.equal(out.loss_mask.sum(-1), torch.tensor([1.0, 2.0, 0.0, 1.0, 1.0]))


def test_reinforce_pp_global_whitening_and_kl_in_reward():
    x = inp([1, 0], [2, 1], [0, 1], token_rewards=torch.tensor([[-0.1, -0.1], [-0.2, 0.0]]))
    out = compute_advantages("reinforce_pp", x)
    # returns: seq0 tokens: [1 - 0.2, 1 - 0.1] = [0.8, 0.9]; seq1: [-0.2]
    assert torch.allclose(out.returns, torch.tensor([[0.8, 0.9], [-0.2, 0.0]]), atol=1e-6)
    m = x.response_mask
    v = out.advantages[m > 0]
    assert abs(float(v.mean())) < 1e-5 and abs(float(v.std()) - 1.0) < 1e-3


def test_reinforce_pp_baseline_subtracts_group_mean():
    # one group: rewards 1, 0 -> shifted 0.5, -0.5; equal lengths -> whitened +-1/std
    x = inp([1, 0], [1, 1], [0, 0])
    out = compute_advantages("reinforce_pp_baseline", x)
    a = out.advantages[:, 0]
    assert a[0] > 0 > a[1] and abs(float(a.sum())) < 1e-5


def test_remax_greedy_baseline_and_missing_raises():
    x = inp([1, 0], [2, 1], [0, 1], baseline_rewards=torch.tensor([0.25, 0.5]))
    a = seq_adv(compute_advantages("remax", x), x)
    assert torch.allclose(a, torch.tensor([0.75, -0.5]))
    with pytest.raises(ValueError, match="baseline"):
        compute_advantages("remax", inp([1.0], [1], [0]))


def test_gae_zero_values_returns_outcome_and_raises_without_critic():
    x = inp([1.0], [3], [0], values=torch.zeros(1, 3))
    out = compute_advantages("gae", x, gamma=1.0, lam=1.0, whiten=False)
    assert torch.allclose(out.advantages, torch.ones(1, 3))
    x2 = inp([1.0], [2], [0], values=torch.tensor([[0.5, 0.25]]))
    out2 = compute_advantages("sao", x2)
    # lam=1, gamma=1: A_t = R - V(s_t)
    assert torch.allclose(out2.advantages, torch.tensor([[0.5, 0.75]]))
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("gae", inp([1.0], [2], [0]))


def test_hapo_token_level_group_average():
    # group: r = [1, 0], lengths [3, 1]: token mean mu = 3/4, population var = (3*(1/4)^2 + 1*(3/4)^2)/4 = 3/16
    x = inp([1, 0], [3, 1], [0, 0])
    a = seq_adv(compute_advantages("hapo", x, eps=0.0), x)
    sd = math.sqrt(3 / 16)
    assert torch.allclose(a, torch.tensor([0.25 / sd, -0.75 / sd]), atol=1e-5)
    # token-weighted mean of the advantage is 0 (unbiased at the token level)
    assert abs(float((a * torch.tensor([3.0, 1.0])).sum())) < 1e-5


def test_hapo_falls_back_to_grpo_for_extreme_groups():
    # 1 one-token correct answer among 9 wrong ones of 40 tokens: the token-level advantage of the
    # correct one is (1 - 1/361) / sqrt(1/361 * 360/361) ~ 19 >= 5 -> the group uses GRPO's advantage
    x = inp([1] + [0] * 9, [1] + [40] * 9, [0] * 10)
    a = seq_adv(compute_advantages("hapo", x), x)
    g = seq_adv(compute_advantages("grpo", x), x)
    assert torch.allclose(a, g, atol=1e-5)


def test_mssr_entropy_shaping_is_bounded_and_keeps_sign():
    H = torch.tensor([[0.1, 10.0], [10.0, 0.0]])
    x = inp([1, 0], [2, 2], [0, 1], entropy=H, baseline_rewards=torch.tensor([0.5, 0.5]))
    out = compute_advantages("mssr", x, batch_norm=False, entropy_alpha=0.4, entropy_kappa=2.0)
    # A = [0.5, -0.5]; bonus = min(0.4 H, |A| / 2)
    expect = torch.tensor([[0.5 + 0.04, 0.75], [-0.5 + 0.25, -0.5]])
    assert torch.allclose(out.advantages, expect, atol=1e-6)
    assert torch.all(torch.sign(out.advantages) == torch.sign(torch.tensor([[1.0, 1], [-1, -1]])))
    with pytest.raises(ValueError, match="entropy"):
        compute_advantages("mssr", inp([1.0], [1], [0]))


def test_dapo_overlong_shaping_via_adv_params_is_applied_once_by_the_reward_function():
    # max_len 10, buffer 4: L<=6 -> 0, L=8 -> -(8-6)/4 = -0.5, L=10 -> -1
    assert torch.allclose(overlong_penalty(torch.tensor([5, 8, 10, 11]), 10, 4), torch.tensor([0.0, -0.5, -1.0, -1.0]))
    # the old spelling's share 0.4 of max_len 10 is a 4-token window, applied by the reward function ...
    rf = RewardFunction.from_config(None, None, max_len=10, old_spelling={"overlong_buffer": 0.4, "overlong_penalty": 1.0})
    assert rf.overlong_buffer == 4
    shaped = torch.tensor([1.0, 1.0]) + overlong_penalty(torch.tensor([5, 8]), 10, rf.overlong_buffer)
    x = inp(shaped.tolist(), [5, 8], [0, 0], R=10)
    a = seq_adv(compute_advantages("grpo", x, norm_by_std=False), x)
    assert torch.allclose(a, torch.tensor([0.25, -0.25]))
    # ... and never again by the estimator: it refuses the shaping keys instead of applying them twice
    with pytest.raises(ConfigError, match="overlong_buffer"):
        compute_advantages("grpo", x, norm_by_std=False, overlong_buffer=0.4)
    from rlpost.algos.validate import adv_overrides

    assert adv_overrides({"adv_params": {"norm_by_std": False, "overlong_buffer": 0.4}}) == {"norm_by_std": False}


def test_beta_tracker_posterior_mean():
    t = BetaBaselineTracker(rho=1.0)
    assert torch.allclose(t.baseline([7]), torch.tensor([0.5]))
    t.update([7, 7], [1.0, 1.0])
    assert torch.allclose(t.baseline([7, 8]), torch.tensor([3 / 4, 0.5]))
    t2 = BetaBaselineTracker()
    t2.load_state_dict(t.state_dict())
    assert torch.allclose(t2.baseline([7]), torch.tensor([0.75]))


def test_reinforce_no_baseline():
    x = inp([2.0, -1.0], [2, 1], [0, 0])
    assert torch.allclose(seq_adv(compute_advantages("reinforce", x), x), torch.tensor([2.0, -1.0]))


def test_stage_requirements_and_reference_answers(compose):
    from omegaconf import OmegaConf

    from rlpost.algos.inputs import reference_response
    from rlpost.config.schema import AlgoConfig
    from rlpost.core.errors import ConfigError
    from rlpost.methods.base import MethodSet
    from rlpost.methods.hapo import check_sampler

    def methods(*over):
        return MethodSet.for_config(compose(["model=tiny", *over]))

    assert methods("algo.adv_estimator=mssr", "algo.n_samples_per_prompt=1").names == ["mssr", "rollout_entropy"]
    assert methods("algo=remax").names == ["remax"]
    sft = methods("algo.loss=sft")
    assert sft.names == ["reference_responses"] and sft.needs().untruncated
    assert methods().names == [] and not methods().needs().untruncated
    assert MethodSet().state_dict() == {}
    # per-token temperature has one owner, the sampler: HAPO needs sampler=adaptive_temperature,
    # and the algorithm may not set a temperature range of its own
    check_sampler(OmegaConf.structured(AlgoConfig(loss="hapo")), "adaptive_temperature")
    check_sampler(OmegaConf.structured(AlgoConfig()), "group")
    with pytest.raises(ConfigError, match="sampler=adaptive_temperature"):
        check_sampler(OmegaConf.structured(AlgoConfig(loss="hapo")), "group")
    with pytest.raises(ConfigError, match="sampler.params.tau=0.05"):
        check_sampler(OmegaConf.structured(AlgoConfig(loss="hapo", loss_params={"temperature_tau": 0.05})),
                      "adaptive_temperature")
    assert reference_response(42, "tags") == "<answer>42</answer>"
    assert reference_response("x", "boxed") == "\\boxed{x}"


# ------------------------------------------------ VCPO minimum-variance baseline (arXiv:2602.17616)
def _offpolicy_inp(rewards, lengths, groups, log_w, pad_junk=True):
    """``inp`` with old/rollout log-probs whose masked differences sum to ``log_w[i]`` per row.

    The difference is spread over the row's tokens; padding positions get a large
    old/rollout gap that must be ignored.
    """
    x = inp(rewards, lengths, groups)
    B, R = x.response_mask.shape
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(B, R, generator=g) * 2
    diff = torch.zeros(B, R)
    for i, L in enumerate(lengths):
        diff[i, :L] = log_w[i] / L
        if pad_junk:
            diff[i, L:] = 7.0
    x.rollout_logprobs, x.old_logprobs = rollout, rollout + diff
    return x


GROUP_BASELINE_ESTIMATORS = ["grpo", "rloo", "gpg", "opo", "reinforce_pp_baseline"]


@pytest.mark.parametrize("name", GROUP_BASELINE_ESTIMATORS)
def test_min_variance_baseline_on_policy_is_the_estimators_own_baseline(name):
    g = torch.Generator().manual_seed(1)
    r = (torch.rand(12, generator=g) > 0.5).float().tolist()
    x = inp(r, [3, 1, 4, 2, 2, 4, 1, 3, 2, 4, 4, 1], [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    x.rollout_logprobs = -torch.rand(x.response_mask.shape, generator=g)
    x.old_logprobs = x.rollout_logprobs.clone()  # on-policy: every importance weight is exactly 1
    assert all(len(set(r[4 * k: 4 * k + 4])) > 1 for k in range(3)), r  # every group has a non-zero advantage
    params = [{}] if name != "grpo" else [{"norm_by_std": True}, {"norm_by_std": False}]
    for p in params:
        mean = compute_advantages(name, x, **p).advantages
        mv = compute_advantages(name, x, baseline="min_variance", **p).advantages
        if name in ("grpo", "gpg", "reinforce_pp_baseline"):
            assert torch.equal(mean, mv), name  # the group mean itself, bit for bit
        else:  # rloo (leave-one-out) and opo (length-weighted): same value, float64 vs float32 arithmetic
            torch.testing.assert_close(mean, mv, atol=1e-6, rtol=1e-6)


def test_min_variance_baseline_off_policy_hand_computed_grpo():
    # group 0: r = [1, 0, 0], w = [2, 1, 1]  -> b = (4*1) / (4+1+1) = 2/3
    # group 1: r = [1, 0, 1], log w = 800 + [0, ln 3, 0] (w^2 would overflow) -> w ~ [1, 3, 1], b = 2/11
    # group 2: r = [1, 1, 1] (zero variance) with wild weights -> advantage 0
    lw = [math.log(2), 0.0, 0.0, 800.0, 800.0 + math.log(3), 800.0, 5.0, -5.0, 0.0]
    x = _offpolicy_inp([1, 0, 0, 1, 0, 1, 1, 1, 1], [2, 1, 3, 2, 2, 1, 1, 2, 3], [0, 0, 0, 1, 1, 1, 2, 2, 2], lw)
    a = seq_adv(compute_advantages("grpo", x, norm_by_std=False, baseline="min_variance"), x)
    expect = [1 / 3, -2 / 3, -2 / 3, 9 / 11, -2 / 11, 9 / 11, 0.0, 0.0, 0.0]
    assert a[:3].tolist() == pytest.approx(expect[:3], abs=1e-6)
    # group 1's float32 log-probs near 400 carry ~3e-5 rounding: the baseline is finite and 2/11 to that
    assert a[3:6].tolist() == pytest.approx(expect[3:6], abs=1e-4)
    assert a[6:].tolist() == [0.0, 0.0, 0.0]
    # with the std: group 0 std = sqrt(1/3), group 1 std = sqrt(1/3)
    s = math.sqrt(1 / 3) + 1e-6
    a = seq_adv(compute_advantages("grpo", x, baseline="min_variance"), x)
    assert a.tolist() == pytest.approx([v / s for v in expect[:6]] + [0.0] * 3, abs=2e-4)
    # the plain mean would give 1/3 and 2/3 baselines: the weighting matters
    plain = seq_adv(compute_advantages("grpo", x, norm_by_std=False), x)
    assert plain[:3].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3], abs=1e-6)


def test_min_variance_baseline_off_policy_rloo_and_opo():
    x = _offpolicy_inp([1, 0, 0], [2, 1, 1], [0, 0, 0], [math.log(2), 0.0, 0.0])
    # RLOO: b_0 = (1*0 + 1*0) / 2 = 0; b_1 = b_2 = (4*1 + 1*0) / (4 + 1) = 0.8
    a = seq_adv(compute_advantages("rloo", x, baseline="min_variance"), x)
    assert a.tolist() == pytest.approx([1.0, -0.8, -0.8], abs=1e-6)
    # OPO: c = w^2 L = [8, 1, 1] -> b = 8/10
    a = seq_adv(compute_advantages("opo", x, baseline="min_variance"), x)
    assert a.tolist() == pytest.approx([0.2, -0.8, -0.8], abs=1e-6)


def test_min_variance_baseline_errors():
    x = inp([1, 0], [1, 1], [0, 0])
    with pytest.raises(ValueError, match="old_logprobs"):
        compute_advantages("grpo", x, baseline="min_variance")
    with pytest.raises(ValueError, match="mean, min_variance"):
        compute_advantages("grpo", x, baseline="median")


# ---- zero-variance groups and float64 baselines (fault class: floating-point residue) ----

LENGTHS8 = [15, 24, 6, 32, 2, 6, 7, 13]


def test_hapo_zero_variance_reported_case():
    x = inp([0.9] * 8, LENGTHS8, [0] * 8)
    a = compute_advantages("hapo", x).advantages
    assert torch.equal(a, torch.zeros_like(a))


def _f64(rewards):
    return torch.tensor(rewards, dtype=torch.float32).double()


def test_grpo_low_variance_group_baseline_is_float64():
    """Rewards [0.5, 0.5005, 0.5, 0.5005]: 0.8630359 (float64 baseline), not 0.8631387 (fp32 cast)."""
    x = inp([0.5, 0.5005, 0.5, 0.5005], [1, 1, 1, 1], [0] * 4)
    a = seq_adv(compute_advantages("grpo", x), x)
    r = _f64([0.5, 0.5005, 0.5, 0.5005])
    want = ((r - r.mean()) / (r.std() + 1e-6)).float()
    assert abs(float(want[1]) - 0.8630359) < 1e-6
    assert torch.allclose(a, want, rtol=1e-6, atol=0)


def test_low_variance_baselines_match_float64_references():
    rewards, lengths = [0.5, 0.5005, 0.5, 0.5005], [3, 1, 2, 5]
    x = inp(rewards, lengths, [0] * 4)
    r, L = _f64(rewards), torch.tensor(lengths, dtype=torch.float64)
    want = {
        "rloo": torch.stack([r[i] - (r.sum() - r[i]) / 3 for i in range(4)]),
        "opo": r - (L * r).sum() / L.sum(),
        "gpg": r - r.mean(),  # the authors' recipe: F_norm = 1 (no std scaling), alpha = 1 (no degenerate group)
        "grpo": (r - r.mean()) / (r.std() + 1e-6),
    }
    for name, w in want.items():
        a = seq_adv(compute_advantages(name, x), x)
        assert torch.allclose(a.double(), w, rtol=2e-7, atol=0), (name, a, w)
    # HAPO: token-level group mean and population std over the tokens
    mu = (L * r).sum() / L.sum()
    sd = ((L * (r - mu) ** 2).sum() / L.sum()).sqrt()
    a = seq_adv(compute_advantages("hapo", x, max_abs=1e9), x)
    assert torch.allclose(a.double(), (r - mu) / (sd + 1e-6), rtol=2e-7, atol=0)


def test_grpo_batch_std_scope_divides_by_the_std_of_all_rewards_by_hand():
    """TRL's scale_rewards='batch': the group mean is subtracted, the std is the whole batch's."""
    from rlpost.algos.advantages import AdvantageInput, compute_advantages

    inp = AdvantageInput(rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]), response_mask=torch.ones(4, 2),
                         group_index=torch.tensor([0, 0, 1, 1]))
    # group means 0.5, 0.5, 1, 1; batch mean 0.75, Bessel variance (3 * 0.0625 + 0.5625) / 3 = 0.25 -> std 0.5
    batch = compute_advantages("grpo", inp, std_scope="batch", eps=0.0).advantages[:, 0]
    assert batch.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])
    # per group: group 0's Bessel std is sqrt(0.5) -> +-0.7071; the flat group 1 stays exactly 0
    group = compute_advantages("grpo", inp, eps=0.0).advantages[:, 0]
    assert group.tolist() == pytest.approx([2 ** -0.5, -(2 ** -0.5), 0.0, 0.0])
    pop = compute_advantages("grpo", inp, std_scope="batch", unbiased_std=False, eps=0.0).advantages[:, 0]
    assert pop.tolist() == pytest.approx([0.5 / 0.1875 ** 0.5, -0.5 / 0.1875 ** 0.5, 0.0, 0.0])  # population var 0.1875
    from rlpost.core.errors import ConfigError

    with pytest.raises(ConfigError, match="std_scope"):
        from rlpost.algos.registries import ADV_ESTIMATORS

        ADV_ESTIMATORS.resolve("grpo", {"std_scope": "batchh"}, "algo.adv_params")
