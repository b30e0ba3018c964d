"""Trust-region and token-weighting methods on hand-computed tensors.

FIPO (future-KL token weights, arXiv:2603.19835) and HölderPO (power-mean
sequence ratio, arXiv:2605.12058): values, which tokens get gradient, and the
micro-batch invariance of the loss and its gradient.
"""

import math

import pytest
import torch

from rlpost.algos.aggregation import aggregate
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss


def make(ratios, adv, mask=None, step=None):
    """Old log-probs 0, current log-probs log(ratio) as a leaf with grad."""
    r = torch.tensor(ratios, dtype=torch.float32)
    lp = torch.log(r).clone().requires_grad_(True)
    A = torch.tensor(adv, dtype=torch.float32)
    m = torch.ones_like(r) if mask is None else torch.tensor(mask, dtype=torch.float32)
    return PolicyLossInput(logprobs=lp, old_logprobs=torch.zeros_like(r), advantages=A, response_mask=m, step=step)


def grad_of(name, x, **p):
    loss, met = compute_policy_loss(name, x, **p)
    (loss * x.response_mask).sum().backward()
    return loss.detach(), x.logprobs.grad.clone(), met


def split_invariance(name, agg, **params):
    """Loss and gradient of a 4-row batch equal the sums over two 2-row micro-batches (same denominator)."""
    from rlpost.algos.aggregation import agg_count

    torch.manual_seed(3)
    lp0 = torch.randn(4, 6) * 0.3 - 1.0
    old = lp0 + torch.randn(4, 6) * 0.3
    A = torch.tensor([1.0, -1.0, 0.5, -2.0])[:, None].expand(4, 6).clone()
    m = torch.ones(4, 6)
    m[1, 4:] = 0
    m[3, 2:] = 0
    denom = agg_count(agg, m)

    # the detached whole mini-batch, which the trainer passes with every micro-batch (losses with batch statistics)
    full = PolicyLossInput(logprobs=lp0, old_logprobs=old, advantages=A, response_mask=m)

    def run(rows):
        lp = lp0.clone().requires_grad_(True)
        x = PolicyLossInput(logprobs=lp[rows], old_logprobs=old[rows], advantages=A[rows], response_mask=m[rows], step=7,
                            batch=full, rows=torch.arange(4)[rows])
        loss_mat, _ = compute_policy_loss(name, x, **params)
        loss = aggregate(agg, loss_mat, m[rows], denom=denom)
        loss.backward()
        return loss.detach(), lp.grad

    whole, g = run(slice(0, 4))
    a, ga = run(slice(0, 2))
    b, gb = run(slice(2, 4))
    assert g.abs().sum() > 0
    assert torch.isclose(whole, a + b, atol=1e-6)
    assert torch.allclose(g, ga + gb, atol=1e-6)


# --- FIPO (arXiv:2603.19835) ---------------------------------------------------------------------

def test_fipo_future_kl_discounted_sum_by_hand():
    from rlpost.algos.losses import future_kl

    d = torch.log(torch.tensor([[2.0, 0.5]]))
    # gamma = 0.5: F_0 = log 2 + 0.5 log 0.5 = 0.5 log 2 (weight sqrt 2), F_1 = log 0.5
    F = future_kl(d, torch.ones(1, 2), 0.5)
    assert torch.allclose(torch.exp(F), torch.tensor([[math.sqrt(2.0), 0.5]]), atol=1e-6)
    # a masked position neither contributes nor receives: F_0 = log 2 + 0.25 log 0.5
    d3 = torch.log(torch.tensor([[2.0, 7.0, 0.5]]))
    F3 = future_kl(d3, torch.tensor([[1.0, 0.0, 1.0]]), 0.5)
    assert torch.allclose(F3, torch.tensor([[0.75 * math.log(2.0), 0.0, math.log(0.5)]]), atol=1e-6)


def test_fipo_weights_scale_the_clipped_surrogate_by_hand():
    # r = [2, 0.5, 1.1], A = +1, gamma = 2^(-1/1) = 0.5, weights unclipped:
    # f_2 = 1.1, f_1 = 0.5 * 1.1^0.5, f_0 = 2 * 0.5^0.5 * 1.1^0.25
    f = [2 * 0.5 ** 0.5 * 1.1 ** 0.25, 0.5 * 1.1 ** 0.5, 1.1]
    x = make([[2.0, 0.5, 1.1]], [[1.0, 1.0, 1.0]])
    loss, g, met = grad_of("fipo", x, decay_rate=1.0, weight_clip=None, dual_clip=None, safety_threshold=None)
    # DAPO clip 0.2 / 0.28: token 0 (r = 2 > 1.28, A > 0) is clipped: value -1.28 f_0, no gradient
    assert torch.allclose(loss, torch.tensor([[-1.28 * f[0], -0.5 * f[1], -1.1 * f[2]]]), atol=1e-5)
    assert torch.allclose(g, torch.tensor([[0.0, -0.5 * f[1], -1.1 * f[2]]]), atol=1e-5)
    assert float(met["fipo_weight_mean"]) == pytest.approx(sum(f) / 3, abs=1e-5)
    # the script's two-sided weight clip [0.8, 1.2]; high-only [1, 1.2] lifts f_1 to 1
    _, g2, _ = grad_of("fipo", make([[2.0, 0.5, 1.1]], [[1.0] * 3]), decay_rate=1.0, dual_clip=None, safety_threshold=None)
    assert torch.allclose(g2, torch.tensor([[0.0, -0.5 * 0.8, -1.1 * 1.1]]), atol=1e-5)
    _, g3, _ = grad_of("fipo", make([[2.0, 0.5, 1.1]], [[1.0] * 3]), decay_rate=1.0, dual_clip=None,
                       safety_threshold=None, weight_clip_high_only=True)
    assert torch.allclose(g3, torch.tensor([[0.0, -0.5 * 1.0, -1.1 * 1.1]]), atol=1e-5)


def test_fipo_on_policy_is_dapo():
    x = make([[1.0, 1.0, 1.0]], [[1.0, -1.0, 0.5]])
    loss, g, met = grad_of("fipo", x)
    y = make([[1.0, 1.0, 1.0]], [[1.0, -1.0, 0.5]])
    loss_d, g_d, _ = grad_of("ppo_clip", y, eps_high=0.28)
    assert torch.allclose(loss, loss_d) and torch.allclose(g, g_d)
    assert float(met["fipo_weight_mean"]) == pytest.approx(1.0)


def test_fipo_dual_clip_filter_and_safety_rule_with_script_defaults():
    # A = -1, r = [4, 20]. Token 1 (r = 20 > delta = 10) leaves the future sum and is dual-clipped
    # (value 10, no gradient). F_0 = log 4 -> weight 4, clipped to 1.2, and since A < 0 and r = 4 > 3
    # the safety rule caps it to [0.8, 1] -> 1.0: gradient -A r f = 4.
    x = make([[4.0, 20.0]], [[-1.0, -1.0]])
    loss, g, met = grad_of("fipo", x)
    assert torch.allclose(loss, torch.tensor([[4.0, 10.0]]), atol=1e-5)
    assert torch.allclose(g, torch.tensor([[4.0, 0.0]]), atol=1e-5)
    assert float(met["fipo_safety_frac"]) == pytest.approx(1.0)
    assert float(met["fipo_future_kl"]) == pytest.approx(math.log(4.0) / 2, abs=1e-5)
    # without the safety rule the weight 1.2 amplifies the penalty
    _, g2, _ = grad_of("fipo", make([[4.0, 20.0]], [[-1.0, -1.0]]), safety_threshold=None)
    assert torch.allclose(g2, torch.tensor([[4.8, 0.0]]), atol=1e-5)


def test_fipo_rejects_bad_parameters():
    with pytest.raises(ValueError, match="decay_rate"):
        compute_policy_loss("fipo", make([[1.0]], [[1.0]]), decay_rate=0.0)
    with pytest.raises(ValueError, match="weight_clip"):
        compute_policy_loss("fipo", make([[1.0]], [[1.0]]), weight_clip=1.5)


# --- HölderPO (arXiv:2605.12058) -----------------------------------------------------------------

@pytest.mark.parametrize("p,rho,drho", [
    # rho = (mean r^p)^(1/p); d rho / d log r_t = rho^(1-p) r_t^p / L, for r = [2, 0.5], L = 2
    (1.0, 1.25, [1.0, 0.25]),
    (2.0, math.sqrt(2.125), [4 / (2 * math.sqrt(2.125)), 0.25 / (2 * math.sqrt(2.125))]),
    (-2.0, 2.125 ** -0.5, [2.125 ** -1.5 * 0.25 / 2, 2.125 ** -1.5 * 4 / 2]),
    (0.0, 1.0, [0.5, 0.5]),  # geometric mean
])
def test_holderpo_power_mean_ratio_and_gradient_share_by_hand(p, rho, drho):
    x = make([[2.0, 0.5]], [[1.0, 1.0]])
    loss, g, met = grad_of("holderpo", x, schedule="constant", p=p, eps_low=0.9, eps_high=10.0)
    assert float(met["seq_ratio_mean"]) == pytest.approx(rho, rel=1e-5)
    assert torch.allclose(loss, torch.full((1, 2), -rho), atol=1e-5)  # the sequence loss on each token
    # both tokens carry the sequence loss, so the summed gradient is twice d(-rho)
    assert torch.allclose(g, -2 * torch.tensor([drho]), atol=1e-5)


def test_holderpo_sequence_clip_cuts_the_whole_sequence():
    # p = 2: rho = 1.458 > 1.2 with A > 0 -> loss -1.2, no gradient on any token
    loss, g, met = grad_of("holderpo", make([[2.0, 0.5]], [[1.0, 1.0]]), schedule="constant", p=2.0)
    assert torch.allclose(loss, torch.full((1, 2), -1.2)) and torch.equal(g, torch.zeros(1, 2))
    assert float(met["clip_frac_high"]) == pytest.approx(1.0)
    # p = -2: rho = 0.686 < 0.8 with A < 0 -> loss 0.8, no gradient; with A > 0 it is not clipped
    loss, g, _ = grad_of("holderpo", make([[2.0, 0.5]], [[-1.0, -1.0]]), schedule="constant", p=-2.0)
    assert torch.allclose(loss, torch.full((1, 2), 0.8)) and torch.equal(g, torch.zeros(1, 2))
    _, g, _ = grad_of("holderpo", make([[2.0, 0.5]], [[1.0, 1.0]]), schedule="constant", p=-2.0)
    assert bool((g < 0).all())


def test_holderpo_geometric_limit_equals_gspo_sequence_ratio():
    torch.manual_seed(0)
    r = torch.exp(torch.randn(3, 5) * 0.2)
    mask = [[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0]]
    _, _, m_h = grad_of("holderpo", make(r.tolist(), [[1.0] * 5] * 3, mask), schedule="constant", p=0.0)
    _, _, m_g = grad_of("gspo", make(r.tolist(), [[1.0] * 5] * 3, mask))
    assert float(m_h["seq_ratio_mean"]) == pytest.approx(float(m_g["seq_ratio_mean"]), rel=1e-6)


def test_holderpo_schedule_follows_the_training_step():
    from rlpost.algos.losses import holder_p

    kw = dict(p=1.0, p_min=-2.0, p_max=2.0, schedule_steps=500, power=2.0)
    assert [holder_p(s, "linear_dec", **kw) for s in (0, 125, 250, 500, 900)] == [2.0, 1.0, 0.0, -2.0, -2.0]
    assert holder_p(250, "cos", **kw) == pytest.approx(0.0, abs=1e-12)
    assert holder_p(125, "cubic", **kw) == pytest.approx(-0.25)  # mid + amp (2 * 0.25 - 1)^3 = 2 * -0.125
    assert holder_p(250, "poly", **kw) == pytest.approx(-1.0)  # -2 + 4 * 0.5^2
    assert holder_p(10, "constant", **kw) == 1.0
    # the loss reads PolicyLossInput.step: at step 250 of 500 the preset's schedule gives p = 0 (geometric)
    _, _, met = grad_of("holderpo", make([[2.0, 0.5]], [[1.0, 1.0]], step=250))
    assert float(met["holder_p"]) == pytest.approx(0.0) and float(met["seq_ratio_mean"]) == pytest.approx(1.0)
    _, _, met = grad_of("holderpo", make([[2.0, 0.5]], [[1.0, 1.0]]))  # no step: step 0, p = p_max
    assert float(met["holder_p"]) == pytest.approx(2.0)


# --- micro-batch invariance ----------------------------------------------------------------------

@pytest.mark.parametrize("name,agg,params", [
    ("fipo", "token-mean", {}),
    ("fipo", "seq-mean-token-mean", {"decay_rate": 2.0}),
    ("holderpo", "seq-mean-token-mean", {}),
    ("holderpo", "token-mean", {"schedule": "constant", "p": -1.5}),
    ("p3o", "token-mean", {}),
])
def test_micro_batch_split_gives_the_whole_batch_loss_and_gradient(name, agg, params):
    split_invariance(name, agg, **params)


# --- the batch-adaptive ESS objective, P3O (arXiv:2605.12380) -------------------------------------

def test_p3o_ess_caps_the_weight_and_sets_the_kl_strength_by_hand():
    # w = [1, 2, 0.5, 1]: (sum w)^2 / (n sum w^2) = 4.5^2 / (4 * 6.25) = 0.81
    x = make([[1.0, 2.0], [0.5, 1.0]], [[1.0, 1.0], [-1.0, -1.0]])
    loss, g, met = grad_of("p3o", x)
    ess = 0.81
    assert float(met["ess"]) == pytest.approx(ess, abs=1e-6)
    # PG: -A min(r, ESS); KL: (1 - ESS)(1 - 1/r) on d/d log pi of log r + 1/r - 1
    pg = [[-ess, -ess], [0.5, ess]]
    kl = [[0.0, 0.5], [-1.0, 0.0]]
    want = torch.tensor(pg) + (1 - ess) * torch.tensor(kl)
    assert torch.allclose(g, want, atol=1e-5)
    kl_val = [[0.0, math.log(2) + 0.5 - 1], [math.log(0.5) + 2 - 1, 0.0]]
    assert torch.allclose(loss, torch.tensor(pg) + (1 - ess) * torch.tensor(kl_val), atol=1e-5)
    assert float(met["clip_frac"]) == pytest.approx(0.75)  # r = 1, 2, 1 exceed ESS = 0.81; r = 0.5 does not


def test_p3o_on_policy_is_plain_reinforce():
    x = make([[1.0, 1.0, 1.0]], [[1.0, -2.0, 0.5]])
    _, g, met = grad_of("p3o", x)
    assert float(met["ess"]) == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(g, torch.tensor([[-1.0, 2.0, -0.5]]), atol=1e-6)
    assert float(met["clip_frac"]) == 0.0


def test_p3o_ess_is_over_the_whole_mini_batch_not_the_micro_batch():
    from rlpost.algos.losses import batch_view  # noqa: F401  (the loss reads PolicyLossInput.batch)

    whole = make([[1.0, 2.0], [0.5, 1.0]], [[1.0, 1.0], [-1.0, -1.0]])
    part = make([[1.0, 2.0]], [[1.0, 1.0]])
    part.batch = PolicyLossInput(logprobs=whole.logprobs.detach(), old_logprobs=whole.old_logprobs,
                                 advantages=whole.advantages, response_mask=whole.response_mask)
    part.rows = torch.tensor([0])
    _, g, met = grad_of("p3o", part)
    assert float(met["ess"]) == pytest.approx(0.81, abs=1e-6)  # alone, row 0 would give 9 / 10 = 0.9
    assert torch.allclose(g, torch.tensor([[-0.81, -0.81 + 0.19 * 0.5]]), atol=1e-5)


# --- ERC, entropy ratio clipping (arXiv:2512.05591) ---------------------------------------------

def test_erc_cuts_the_gradient_of_tokens_whose_entropy_ratio_leaves_the_band_by_hand():
    # (r, A, H, H_old): (1.5, +1, 1, 1) PPO-clipped | (1.1, +1, 1, 1.1) ratio 0.909 < 0.95: cut
    # | (0.9, -1, 1, 0.96) ratio 1.042: kept | (1.0, +1, 0.5, 0.5) kept
    x = make([[1.5, 1.1, 0.9, 1.0]], [[1.0, 1.0, -1.0, 1.0]])
    x.entropy = torch.tensor([[1.0, 1.0, 1.0, 0.5]])
    x.extras["old_entropy"] = torch.tensor([[1.0, 1.1, 0.96, 0.5]])
    loss, g, met = grad_of("erc", x)
    assert torch.allclose(loss, torch.tensor([[-1.28, -1.1, 0.9, -1.0]]), atol=1e-6)  # values stay in the loss
    assert torch.allclose(g, torch.tensor([[0.0, 0.0, 0.9, -1.0]]), atol=1e-6)
    assert float(met["erc_masked_frac"]) == pytest.approx(0.25)
    # a wider band keeps token 1: gradient -A r = -1.1
    x2 = make([[1.5, 1.1, 0.9, 1.0]], [[1.0, 1.0, -1.0, 1.0]])
    x2.entropy, x2.extras["old_entropy"] = x.entropy, x.extras["old_entropy"]
    _, g2, _ = grad_of("erc", x2, entropy_ratio_low=0.9)
    assert torch.allclose(g2, torch.tensor([[0.0, -1.1, 0.9, -1.0]]), atol=1e-6)


def test_erc_without_old_entropy_is_dapo_with_dual_clip():
    x = make([[1.5, 0.5, 20.0]], [[1.0, -1.0, -1.0]])
    x.entropy = torch.tensor([[0.3, 2.0, 1.0]])
    loss, g, met = grad_of("erc", x)
    y = make([[1.5, 0.5, 20.0]], [[1.0, -1.0, -1.0]])
    loss_d, g_d, _ = grad_of("ppo_clip", y, eps_high=0.28, dual_clip=10.0)
    assert torch.allclose(loss, loss_d) and torch.allclose(g, g_d)
    assert float(met["erc_masked_frac"]) == 0.0
    with pytest.raises(ValueError, match="needs PolicyLossInput.entropy"):
        compute_policy_loss("erc", make([[1.0]], [[1.0]]))
    with pytest.raises(ValueError, match="entropy_ratio_low < 1"):
        compute_policy_loss("erc", x, entropy_ratio_low=1.2)


def test_erc_runner_supplies_the_old_policy_entropy(tmp_path):
    """End to end on model=tiny with two mini-batches: the runner computes pi_old's entropy with the old
    log-probs, so on the second mini-batch the entropy ratio differs from 1 (the first update moved the policy)."""
    import json

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["algo=erc", "model=tiny", "steps=1", "logger=jsonl", "rollout.max_new_tokens=6",
                          "selector.prompts_per_step=2", "algo.n_samples_per_prompt=4", "algo.mini_batches=2",
                          "eval.at_end=false", "checkpoint.every=0", "trainer.lr=1e-2",
                          "algo.entropy_coef=0.5"])  # rewards are 0 on a random model: the bonus moves it
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r = [r for r in rows if "reward/mean" in r][0]
    keys = [k for k in r if k.endswith("entropy_ratio_mean")]
    assert keys, sorted(r)
    assert r[keys[0]] != pytest.approx(1.0, abs=1e-7)  # mean over both mini-batches; the second moved


def test_erc_with_a3po_proximal_is_a_config_error():
    from typer.testing import CliRunner

    from rlpost.cli import app

    res = CliRunner().invoke(app, ["config", "model=tiny", "algo=erc", "+algo.loss_params.proximal=a3po"])
    assert res.exit_code == 2, res.output
    assert "proximal=recompute" in res.output and "Traceback" not in res.output
