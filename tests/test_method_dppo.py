"""The predictive divergence direction of DPPO's trust region: predicted change by hand and against a
realised softmax step, the top-K supports, and the trainer with a recorded anchor support. Moved unchanged from
tests/test_methods_tbrm_sp3o_dppo_sapo.py.
"""

import math

import pytest
import torch

from rlpost.algos.losses import PolicyLossInput, compute_policy_loss


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
