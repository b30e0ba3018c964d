"""Value-based and single-rollout methods, the predictive divergence mask on hand-computed tensors.

TBRM (trajectory Bellman residual, arXiv:2505.15311), SP3O's sparse critic supervision and the predictive
divergence direction for DPPO's trust region: values, which tokens receive gradient, round trips against
a full forward pass or a realised gradient step.
"""

import math

import pytest
import torch

from rlpost.algos.aggregation import aggregate
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss


# ----------------------------------------------------------------------------------------------- TBRM
def _tbrm_input():
    lp = torch.tensor([[-1.0, -1.0, -0.5], [-0.2, -0.4, -9.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.5, -0.5], [-0.2, -0.6, -1.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    r = torch.tensor([1.0, 0.0])
    logz = torch.tensor([2.0, 1.0], requires_grad=True)
    return PolicyLossInput(logprobs=lp, old_logprobs=lp.detach(), advantages=r[:, None] * m, response_mask=m, extras={'ref_logprobs': ref, 'first_log_normaliser': logz})


def test_tbrm_residual_loss_and_gradient_by_hand():
    # beta = 0.5. Row 0: sum log pi/pi_ref = 0.5 + 0.5 + 0 = 1, delta = 0.5 (2 + 1) - 1 = 0.5.
    # Row 1 (2 real tokens): 0 + 0.2 = 0.2, delta = 0.5 (1 + 0.2) - 0 = 0.6 (the padded -9 does not count).
    inp = _tbrm_input()
    loss_mat, met = compute_policy_loss("tbrm", inp, beta=0.5)
    assert float(met["seq_tbrm_residual"]) == pytest.approx((0.5 + 0.6) / 2)
    loss = aggregate("seq-mean-token-sum", loss_mat, inp.response_mask)
    assert float(loss) == pytest.approx((0.25 + 0.36) / 2)  # the mean squared residual over trajectories
    loss.backward()
    # d/d lp_t = 2 delta beta / 2 rows: row 0 -> 0.25 per token, row 1 -> 0.3 on its real tokens, 0 on padding
    assert inp.logprobs.grad.flatten().tolist() == pytest.approx([0.25, 0.25, 0.25, 0.3, 0.3, 0.0])
    # V(s_1) = beta logZ gets the same pull: the residual's baseline is learned through the logits
    assert inp.extras["first_log_normaliser"].grad.tolist() == pytest.approx([0.25, 0.3])


def test_tbrm_errors_name_the_missing_input():
    inp = _tbrm_input()
    inp.extras["first_log_normaliser"] = None
    with pytest.raises(ValueError, match="first_log_normaliser"):
        compute_policy_loss("tbrm", inp, beta=0.5)
    with pytest.raises(ValueError, match="beta must be > 0"):
        compute_policy_loss("tbrm", _tbrm_input(), beta=0.0)


def test_first_position_log_normaliser_matches_the_full_forward():
    from rlpost.algos.tbrm import first_position_log_normaliser
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy

    model = load_policy(ModelConfig(source="tiny"), seed=0)[0]
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        z = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
        got = first_position_log_normaliser(model, ids, mask, temperature=0.7)
    assert got.tolist() == pytest.approx(torch.logsumexp(z / 0.7, -1).tolist(), abs=1e-4)


# ----------------------------------------------------------------------------------------------- SP3O
def test_sp3o_even_states_first_last_and_between_counted_over_loss_tokens():
    from rlpost.algos.sp3o import sparse_state_mask

    m = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0],      # L = 7: positions 0, 3, 6
                      [1, 0, 1, 1, 0, 1, 1, 0],      # loss tokens at 0 2 3 5 6 (L = 5): their 0th, 2nd, 4th
                      [1, 1, 0, 0, 0, 0, 0, 0],      # L = 2 <= 3: both
                      [0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    got = sparse_state_mask(m, 3, "even")
    assert got.tolist() == [[1, 0, 0, 1, 0, 0, 1, 0], [1, 0, 0, 1, 0, 0, 1, 0],
                            [1, 1, 0, 0, 0, 0, 0, 0], [0] * 8]
    assert sparse_state_mask(m[:1], 1, "even").tolist() == [[1, 0, 0, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="state_spacing"):
        sparse_state_mask(m, 3, "random")


def test_sp3o_stratified_draws_one_state_per_stratum_reproducibly():
    from rlpost.algos.sp3o import sparse_state_mask

    m = torch.ones(64, 9)
    a = sparse_state_mask(m, 3, "stratified", torch.Generator().manual_seed(5))
    b = sparse_state_mask(m, 3, "stratified", torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    for lo in (0, 3, 6):  # strata [0, 3), [3, 6), [6, 9): exactly one state in each, every row
        assert a[:, lo:lo + 3].sum(-1).tolist() == [1.0] * 64
    assert len({tuple(r.nonzero().flatten().tolist()) for r in a}) > 1  # not the same positions every row


def test_sp3o_critic_gradient_comes_only_from_the_supervised_states(compose):
    import copy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import tiny_overrides
    from ds_worker import make_batch

    from rlpost.algos.sp3o import sparse_state_mask
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    policy = load_policy(ModelConfig(source="tiny"), seed=3)[0]
    cfg = compose(tiny_overrides("algo=sp3o", "trainer.grad_clip=0", "trainer.micro_batch_size=3"))
    grads = []

    def run(returns):
        t = TorchTrainer.from_config(copy.deepcopy(policy), cfg, "cpu")

        def capture(opt, params, clip):
            grads.append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]).clone())
            opt.zero_grad(set_to_none=True)
            return 0.0

        t._finite_step = capture
        b = make_batch(B=6, R=8)
        b.extras["returns"] = returns
        b.extras["values"] = torch.zeros(6, 8)
        t.critic_update(b)
        return b

    g = torch.Generator().manual_seed(0)
    ret = torch.randn(6, 8, generator=g)
    b = run(ret)
    keep = sparse_state_mask(b.response_mask, 3, "even")
    assert int(keep.sum()) == 18  # 3 states in each of the 6 rows (every row has >= 6 tokens)
    run(ret + 5.0 * (1 - keep))  # other targets: the same critic gradient
    assert torch.allclose(grads[0], grads[1])
    run(ret + 5.0 * keep)  # a supervised target moved: a different gradient
    assert not torch.allclose(grads[0], grads[2])


# -------------------------------------------------------------------------- predictive divergence mask
P3 = [0.2, 0.7, 0.1]  # current policy over a 3-token vocabulary, sampled token = slot 0
Q3 = [0.1, 0.3, 0.6]  # anchor


def test_predicted_change_by_hand_and_disagreeing_with_the_ratio_direction():
    from rlpost.algos.predictive_mask import divergence, predicted_change

    p, q = torch.tensor([P3], dtype=torch.float64), torch.tensor([Q3], dtype=torch.float64)
    # KL(q || p): g = p - q = [0.1, 0.4, -0.5], sum p g = 0.02 + 0.28 - 0.05 = 0.25, dD = A (0.1 - 0.25)
    assert float(predicted_change(p, q, torch.tensor([1.0]), "kl")) == pytest.approx(-0.15)
    assert float(divergence(p, q, "kl")) == pytest.approx(0.1 * math.log(0.5) + 0.3 * math.log(3 / 7) + 0.6 * math.log(6))
    # TV: s = [+, +, -], sum s p = 0.8, g = p (s - 0.8) / 2 = [0.02, 0.07, -0.09], sum p g = 0.044
    assert float(predicted_change(p, q, torch.tensor([1.0]), "tv")) == pytest.approx(0.02 - 0.044)
    assert float(divergence(p, q, "tv")) == pytest.approx(0.5)
    # pi_a > mu_a with A > 0: the ratio test calls this step "away", the divergence in fact falls (mass leaves
    # the over-weighted token 1); with A < 0 both agree that it rises
    assert float(predicted_change(p, q, torch.tensor([-1.0]), "kl")) == pytest.approx(0.15)


@pytest.mark.parametrize("kind", ["kl", "tv"])
def test_predicted_change_matches_a_realised_small_softmax_step(kind):
    from rlpost.algos.predictive_mask import divergence, predicted_change

    g = torch.Generator().manual_seed(0)
    z = torch.randn(200, 7, generator=g, dtype=torch.float64)
    q = torch.softmax(torch.randn(200, 7, generator=g, dtype=torch.float64), -1)
    A = torch.randn(200, generator=g, dtype=torch.float64)
    p = torch.softmax(z, -1)
    eta = 1e-5
    step = eta * A[:, None] * (torch.nn.functional.one_hot(torch.zeros(200, dtype=torch.long), 7) - p)
    realised = divergence(torch.softmax(z + step, -1), q, kind) - divergence(p, q, kind)
    pred = eta * predicted_change(p, q, A, kind)
    assert torch.allclose(realised, pred, rtol=1e-3, atol=1e-9)  # second-order terms are O(eta^2) = 1e-10
    big = pred.abs() > 1e-8
    assert int(big.sum()) > 150 and bool((torch.sign(realised[big]) == torch.sign(pred[big])).all())


def test_topk_estimators_tail_and_renorm_by_hand():
    from rlpost.algos.predictive_mask import support_distributions

    lp_pi, lp_mu = torch.log(torch.tensor([[0.2, 0.7]])), torch.log(torch.tensor([[0.1, 0.3]]))
    p, q = support_distributions(lp_pi, lp_mu, "tail")  # the rest of the mass is one more category
    assert p.flatten().tolist() == pytest.approx(P3) and q.flatten().tolist() == pytest.approx(Q3)
    p, q = support_distributions(lp_pi, lp_mu, "renorm")
    assert p.flatten().tolist() == pytest.approx([2 / 9, 7 / 9]) and q.flatten().tolist() == pytest.approx([0.25, 0.75])
    with pytest.raises(ValueError, match="topk_estimator"):
        support_distributions(lp_pi, lp_mu, "sample")


def test_anchor_support_puts_the_sampled_token_first_without_duplicates():
    from rlpost.algos.predictive_mask import anchor_support

    top_ids = torch.tensor([[[5, 3, 9], [5, 3, 9]]])
    top_lp = torch.tensor([[[-0.1, -1.0, -2.0], [-0.1, -1.0, -2.0]]])
    ids, lps = anchor_support(torch.tensor([[3, 7]]), top_ids, top_lp, torch.tensor([[-1.0, -6.0]]))
    assert ids.tolist() == [[[3, 5, 9], [7, 5, 3]]]  # 3 was in the top-3 (leaves it); 7 was not (9 leaves)
    assert lps.flatten().tolist() == pytest.approx([-1.0, -0.1, -2.0, -6.0, -0.1, -1.0])


def test_dppo_predictive_masks_only_tokens_whose_step_raises_the_divergence():
    # two tokens with the same support distributions (P3 current, Q3 anchor; TV 0.5 > 0.15), sampled token
    # pi = 0.2 > mu = 0.1. A > 0: the step lowers the TV (kept). A < 0: lowering pi_a moves mass onto the
    # over-weighted token 1, the TV rises (masked). The ratio test says the opposite for both.
    lp_pi = torch.log(torch.tensor([[[0.2, 0.7], [0.2, 0.7]]]))
    lp_mu = torch.log(torch.tensor([[[0.1, 0.3], [0.1, 0.3]]]))
    lp = torch.log(torch.tensor([[0.2, 0.2]])).requires_grad_(True)
    A = torch.tensor([[1.0, -1.0]])
    inp = PolicyLossInput(logprobs=lp, old_logprobs=torch.log(torch.tensor([[0.1, 0.1]])), advantages=A, response_mask=torch.ones(1, 2), extras={'region_support_logprobs': lp_pi, 'region_anchor_logprobs': lp_mu})
    loss, met = compute_policy_loss("dppo", inp, direction="predictive", anchor="old", divergence="tv")
    loss.sum().backward()
    # kept token: -A * sg(w / r) * r with w = pi / mu = 2: gradient -A w = -2; the masked token gets none
    assert lp.grad.flatten().tolist() == pytest.approx([-2.0, 0.0])
    assert float(met["clip_frac"]) == pytest.approx(0.5)
    assert float(met["direction_disagree"]) == pytest.approx(1.0)
    assert float(met["region_divergence"]) == pytest.approx(0.5)
    # DPPO's ratio direction on the binary TV |pi - mu| = 0.1 > 0.05 masks the A > 0 token and keeps the other
    lp.grad = None
    ratio_loss, _ = compute_policy_loss("dppo", inp, direction="ratio", anchor="old", divergence="tv",
                                        eps_low=0.05, eps_high=0.05)
    ratio_loss.sum().backward()
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, 2.0])
    inp.extras["region_support_logprobs"] = None
    with pytest.raises(ValueError, match="region_support_logprobs"):
        compute_policy_loss("dppo", inp, direction="predictive", anchor="old")


def test_dppo_predictive_runs_through_the_trainer_with_a_recorded_support(compose):
    import copy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import tiny_overrides
    from ds_worker import make_batch

    from rlpost.methods.dppo import anchor_topk_record
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    policy = load_policy(ModelConfig(source="tiny"), seed=3)[0]
    cfg = compose(tiny_overrides("algo=dppo_predictive", "algo.mini_batches=1", "trainer.micro_batch_size=3"))
    t = TorchTrainer.from_config(copy.deepcopy(policy), cfg, "cpu")
    b = make_batch(B=6, R=6)
    rec = anchor_topk_record(t.forward_pass(), b, 8)
    assert rec["old_topk_ids"].shape == (6, 6, 8)
    assert torch.equal(rec["old_topk_ids"][..., 0][b.response_mask > 0], b.response_ids[b.response_mask > 0])
    lp, _ = t.compute_logprobs(b)
    b.extras.update(rec)
    b.extras["old_logprobs"] = lp
    m = t.policy_update(b)
    assert m["actor/region_divergence"] == pytest.approx(0.0, abs=1e-5)  # anchor = current weights
    assert m["actor/clip_frac"] == 0.0
    # an anchor far from the policy: tokens leave the region and those whose step would widen it are masked
    b.extras["old_topk_logprobs"] = torch.log_softmax(torch.randn(6, 6, 8, generator=torch.Generator().manual_seed(1)) * 3, -1)
    m = t.policy_update(b)
    assert m["actor/region_divergence"] > 0.15 and 0.0 < m["actor/clip_frac"] < 1.0


def test_dppo_predictive_needs_the_old_anchor(compose):
    from rlpost.core.errors import ConfigError

    from rlpost.config.compose import validate_config

    validate_config(compose(["model=tiny", "algo=dppo_predictive"]))
    with pytest.raises(ConfigError, match="anchor=old"):
        validate_config(compose(["model=tiny", "algo=dppo_predictive", "algo.loss_params.anchor=rollout"]))


# -------------------------------------------------------------------- single-rollout autoregressive (sapo_ar)
def _sapo_ar_input():
    from rlpost.algos.advantages import AdvantageInput

    m = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)  # row 0: two turns, an env gap
    values = torch.tensor([[0.2, 9.0, 9.0, 0.6, 9.0, 9.0], [0.3, 9.0, 9.0, 9.0, 9.0, 9.0]])  # only turn starts read
    tok = torch.zeros(2, 6)
    tok[0, 1] = 0.5  # a per-turn reward on turn 0's last token
    return AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=m, group_index=torch.arange(2),
                          values=values, token_rewards=tok)


def test_sapo_ar_turn_level_gae_and_sarsa_targets_by_hand():
    from rlpost.algos.advantages import compute_advantages

    # row 0 (gamma 1, lam 0.5): r = (0.5, 1), V = (0.2, 0.6, 0): delta_1 = 1 - 0.6 = 0.4, A_1 = 0.4;
    # delta_0 = 0.5 + 0.6 - 0.2 = 0.9, A_0 = 0.9 + 0.5 * 0.4 = 1.1; SARSA targets 0.5 + 0.6 = 1.1 and 1.0.
    # row 1: one turn, A = 0 - 0.3 = -0.3, target 0
    out = compute_advantages("sapo_ar", _sapo_ar_input(), gamma=1.0, lam=0.5, adv_norm=False)
    assert out.advantages.flatten().tolist() == pytest.approx([1.1, 1.1, 0, 0.4, 0.4, 0, -0.3, -0.3, -0.3, 0, 0, 0])
    assert out.value_mask.tolist() == [[1, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0]]
    assert (out.returns * out.value_mask).flatten().tolist() == pytest.approx([1.1, 0, 0, 1.0, 0, 0] + [0] * 6)
    # batch normalisation over the three turns (1.1, 0.4, -0.3): mean 0.4, population std 0.7 sqrt(2/3)
    z = 0.7 / (0.7 * math.sqrt(2 / 3))
    out = compute_advantages("sapo_ar", _sapo_ar_input(), gamma=1.0, lam=0.5, adv_norm=True)
    assert out.advantages[0, 0] == pytest.approx(z, rel=1e-5) and out.advantages[0, 3] == pytest.approx(0.0, abs=1e-6)
    assert out.advantages[1, 0] == pytest.approx(-z, rel=1e-5) and float(out.advantages[0, 2]) == 0.0


def test_sapo_ar_shared_backbone_critic_step_moves_the_policy(compose):
    import copy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import tiny_overrides
    from ds_worker import make_batch

    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import backbone_and_head
    from rlpost.trainer.torch_engine import TorchTrainer

    policy = load_policy(ModelConfig(source="tiny"), seed=3)[0]
    cfg = compose(tiny_overrides("algo=sapo_ar", "trainer.grad_clip=0", "algo.critic.lr=1e-2"))
    t = TorchTrainer.from_config(copy.deepcopy(policy), cfg, "cpu")
    assert t.critic.backbone is backbone_and_head(t.policy)[0]  # one backbone, not a copy
    b = make_batch(B=4, R=6)
    vmask = torch.zeros(4, 6)
    vmask[:, 0] = 1.0
    b.extras.update(returns=torch.ones(4, 6), values=torch.zeros(4, 6), value_mask=vmask)
    before, _ = t.compute_logprobs(b)
    t.critic_update(b)  # the zero-initialised head: this step moves only the head
    after1, _ = t.compute_logprobs(b)
    assert torch.allclose(before, after1)
    t.critic_update(b)  # now the value loss reaches the shared backbone
    after, _ = t.compute_logprobs(b)
    assert not torch.allclose(before, after, atol=1e-5)  # the value step moved the policy
    from rlpost.core.errors import ConfigError
    from rlpost.algos.validate import validate_algo

    with pytest.raises(ConfigError, match="warmup_steps"):
        validate_algo(compose(["model=tiny", "algo=sapo_ar", "algo.critic.warmup_steps=2"]).algo)
