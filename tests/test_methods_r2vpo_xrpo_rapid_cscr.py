"""R²VPO, XRPO, RAPID and CSCR on hand-computed tensors.

Each method: values from the paper's (or our stated) equations on a small case,
which tokens receive gradient, and the end-to-end plumbing on ``model=tiny``.
"""

import json
import math

import pytest
import torch

from rlpost.algos.losses import PolicyLossInput, compute_policy_loss


def make(ratios, adv, mask=None, **kw):
    """Old log-probs 0, current log-probs log(ratio) as a leaf with grad."""
    r = torch.tensor(ratios, dtype=torch.float64)
    lp = torch.log(r).clone().requires_grad_(True)
    A = torch.tensor(adv, dtype=torch.float64)
    m = torch.ones_like(r) if mask is None else torch.tensor(mask, dtype=torch.float64)
    return PolicyLossInput(logprobs=lp, old_logprobs=torch.zeros_like(r), advantages=A, response_mask=m, **kw)


def grad_of(name, x, **p):
    loss, met = compute_policy_loss(name, x, **p)
    (loss * x.response_mask).sum().backward()
    return loss.detach(), x.logprobs.grad.clone(), met


def train_rows(tmp_path, overrides):
    """Train on model=tiny and return the logged step rows."""
    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["model=tiny", "logger=jsonl", "rollout.max_new_tokens=6", "selector.prompts_per_step=2",
                          "algo.n_samples_per_prompt=4", "eval.at_end=false", "checkpoint.every=0", *overrides])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "reward/mean" in r]


# --- R²VPO, ratio-variance Lagrangian with dual ascent (arXiv:2601.03320) -----------------------

def test_r2vpo_loss_and_gradient_by_hand():
    # r = (1.5, 0.5), A = (1, 1), lambda = 2: mean r = 1, Var = 0.25
    # loss_t = -A r + lambda (r - 1)^2 = (-1.5 + 0.5, -0.5 + 0.5) = (-1, 0)
    # d/dlogp = r (-A + 2 lambda (r - mean)) = 1.5 (-1 + 2) = 1.5 ; 0.5 (-1 - 2) = -1.5
    x = make([[1.5, 0.5]], [[1.0, 1.0]])
    loss, g, met = grad_of("r2vpo", x, lambda_init=2.0)
    assert torch.allclose(loss, torch.tensor([[-1.0, 0.0]], dtype=torch.float64))
    assert torch.allclose(g, torch.tensor([[1.5, -1.5]], dtype=torch.float64))
    assert float(met["ratio_var"]) == pytest.approx(0.25)
    assert float(met["clip_frac"]) == 0.0  # nothing is clipped: a ratio of 1.5 keeps its gradient
    # the trainer's running multiplier wins over lambda_init
    x2 = make([[1.5, 0.5]], [[1.0, 1.0]], extras={"loss_state": {"r2vpo_lambda": 0.0}})
    loss2, g2, _ = grad_of("r2vpo", x2, lambda_init=2.0)
    assert torch.allclose(g2, torch.tensor([[-1.5, -0.5]], dtype=torch.float64))  # plain -A r


def test_r2vpo_penalty_is_over_the_whole_mini_batch():
    # whole batch ratios (1.5, 0.5 | 1.0, 1.0): mean 1, Var = (0.25 + 0.25) / 4 = 0.125; micro-batch = row 0
    full = make([[1.5, 0.5], [1.0, 1.0]], [[1.0, 1.0], [0.0, 0.0]])
    part = make([[1.5, 0.5]], [[1.0, 1.0]], batch=PolicyLossInput(
        logprobs=full.logprobs.detach(), old_logprobs=full.old_logprobs, advantages=full.advantages,
        response_mask=full.response_mask), rows=torch.tensor([0]))
    _, g, met = grad_of("r2vpo", part, lambda_init=2.0)
    assert float(met["ratio_var"]) == pytest.approx(0.125)  # alone, row 0 has variance 0.25
    assert torch.allclose(g, torch.tensor([[1.5, -1.5]], dtype=torch.float64))  # the mean is 1 either way


def test_r2vpo_dual_ascent_step_by_hand():
    from rlpost.algos.r2vpo import r2vpo_dual_step

    kw = dict(ratio_var_bound=0.01, lambda_init=2.0, dual_lr=10.0, lambda_max=1000.0)
    st = {}
    r2vpo_dual_step(st, {"ratio_var": torch.tensor(0.25)}, **kw)
    assert st["r2vpo_lambda"] == pytest.approx(2.0 + 10.0 * 0.24)  # 4.4: constraint violated, lambda rises
    r2vpo_dual_step(st, {"ratio_var": torch.tensor(0.0)}, **kw)
    assert st["r2vpo_lambda"] == pytest.approx(4.3)  # satisfied: it falls by dual_lr * delta
    st = {"r2vpo_lambda": 0.05}
    r2vpo_dual_step(st, {"ratio_var": torch.tensor(0.0)}, **kw)
    assert st["r2vpo_lambda"] == 0.0  # projected onto lambda >= 0
    st = {}
    r2vpo_dual_step(st, {"ratio_var": torch.tensor(1.0)}, **{**kw, "lambda_max": 3.0})
    assert st["r2vpo_lambda"] == 3.0
    with pytest.raises(ValueError, match="lambda_max"):
        compute_policy_loss("r2vpo", make([[1.0]], [[1.0]]), lambda_max=0.5)


def test_r2vpo_trainer_runs_dual_ascent_between_mini_batches(tmp_path):
    """model=tiny, two mini-batches: the first uses lambda_0 = 1 on fresh data (Var = 0), so the dual step
    leaves 1 - 10 * 0.01 = 0.9 for the second; the logged multiplier is their mean 0.95."""
    r = train_rows(tmp_path, ["algo=r2vpo", "steps=1", "algo.mini_batches=2", "trainer.lr=1e-2",
                              "algo.entropy_coef=0.5"])[0]
    assert r["actor/r2vpo_lambda"] == pytest.approx(0.95, abs=1e-6)
    assert r["actor/ratio_var"] > 0  # the second mini-batch saw the moved policy



def test_r2vpo_multiplier_survives_a_checkpoint(compose):
    from conftest import tiny_overrides

    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides("algo=r2vpo"))
    t = TorchTrainer.from_config(load_policy(ModelConfig(source="tiny"), seed=3)[0], cfg, "cpu")
    t.loss_state["r2vpo_lambda"] = 3.25
    t2 = TorchTrainer.from_config(load_policy(ModelConfig(source="tiny"), seed=3)[0], cfg, "cpu")
    assert t2.loss_state == {}
    t2.load_state_dict(t.state_dict())
    assert t2.loss_state == {"r2vpo_lambda": 3.25}

# --- XRPO, novelty-aware advantage sharpening and the rollout allocator (arXiv:2510.06672) ------

def xrpo_input(rewards, seq_logliks, group=None):
    from rlpost.algos.advantages import AdvantageInput

    B = len(rewards)
    lp = torch.tensor(seq_logliks, dtype=torch.float32)[:, None].expand(B, 2).clone()  # 2 tokens, mean = s_i
    return AdvantageInput(rewards=torch.tensor(rewards), response_mask=torch.ones(B, 2),
                          group_index=torch.zeros(B, dtype=torch.long) if group is None else torch.tensor(group),
                          rollout_logprobs=lp)


def test_xrpo_sharpens_only_correct_unlikely_responses_by_hand():
    from rlpost.algos.advantages import compute_advantages

    # rewards (1, 1, 0, 0): GRPO A = +-0.5 / sqrt(1/3) = +-0.8660; s = (-1, -2, -1.5, -1.5), s_bar = -1.5
    # eta = (e^0.5, e^-0.5, 1, 1): response 0 (likely, correct) no bonus; response 1 (unlikely, correct)
    # bonus min(1 - e^-0.5, 0.866) = 0.3935; incorrect ones keep -0.866 even though eta = 1
    out = compute_advantages("xrpo", xrpo_input([1.0, 1.0, 0.0, 0.0], [-1.0, -2.0, -1.5, -1.5]))
    a = out.advantages[:, 0]
    z = 0.5 / (1 / 3) ** 0.5
    assert torch.allclose(a, torch.tensor([z, z + 1 - math.exp(-0.5), -z, -z]),
                          atol=1e-5)
    assert torch.equal(out.advantages[:, 0], out.advantages[:, 1])  # broadcast to every token
    # kappa caps the bonus at kappa * A: 0.25 * 0.866 = 0.2165
    a2 = compute_advantages("xrpo", xrpo_input([1.0, 1.0, 0.0, 0.0], [-1.0, -2.0, -1.5, -1.5]),
                            novelty_clip=0.25).advantages[:, 0]
    assert float(a2[1]) == pytest.approx(1.25 * z, abs=1e-5)
    # a group of equal rewards stays 0 whatever the likelihoods; groups are separate
    a3 = compute_advantages("xrpo", xrpo_input([1.0, 1.0, 1.0, 0.0], [-1.0, -3.0, -1.0, -1.0],
                                               group=[0, 0, 1, 1])).advantages[:, 0]
    assert a3[0] == 0 and a3[1] == 0
    assert float(a3[2]) == pytest.approx(0.5 / 0.5 ** 0.5, abs=1e-5)  # eta = 1 within group 1: plain GRPO
    with pytest.raises(ValueError, match="log-probs"):
        from rlpost.algos.advantages import AdvantageInput
        compute_advantages("xrpo", AdvantageInput(rewards=torch.ones(2), response_mask=torch.ones(2, 1),
                                                  group_index=torch.zeros(2, dtype=torch.long)))


def test_t_quantile_matches_the_table():
    from rlpost.selectors.xrpo_allocator import t_quantile

    for df, want in [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (5, 2.5706), (6, 2.4469), (7, 2.3646),
                     (10, 2.2281), (30, 2.0423)]:
        assert t_quantile(0.975, df) == pytest.approx(want, abs=1e-4), df


def test_xrpo_allocator_gives_rollouts_where_uncertainty_shrinks_most_by_hand():
    from rlpost.selectors import build_selector
    from types import SimpleNamespace

    sel = build_selector(SimpleNamespace(name="xrpo", prompts_per_step=2, params={"explore_coef": 0.0}),
                         num_prompts=4, seed=0, n_samples=3)
    # prompt 0: rewards (0, 1, 0, 1), std 0.577; prompt 1: always solved, std 0
    sel.update([0, 1], [[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert sel.rollout_counts([0, 1]) == [4, 2]  # both extra rollouts to the varied prompt
    # prompt 2 never seen (prior std 0.5): h(n) per unit std = t_{.975,n-1} / sqrt n = 8.985, 2.484, 1.591
    # first extra: prompt 0 (6.50 x 0.577 = 3.75 > 6.50 x 0.5 = 3.25); second: prompt 2 (3.25 > 0.893 x 0.577)
    assert sel.rollout_counts([0, 2]) == [3, 3]
    sd = sel.state_dict()
    again = build_selector(SimpleNamespace(name="xrpo", prompts_per_step=2, params={"explore_coef": 0.0}),
                           num_prompts=4, seed=5, n_samples=3)
    again.load_state_dict(sd)
    assert again.rollout_counts([0, 2]) == [3, 3] and again.reward_std(1) == 0.0


def test_xrpo_recipe_trains_on_tiny(tmp_path):
    rows = train_rows(tmp_path, ["algo=xrpo", "selector=xrpo", "steps=1"])
    assert rows and "selector/rollouts_max" in rows[0]


# --- RAPID, off-policy group-relative policy gradient (arXiv:2510.03515) ------------------------

def rapid_input(token_ratios, adv, group, **kw):
    x = make(token_ratios, [[a] * len(token_ratios[0]) for a in adv], **kw)
    x.group_index = torch.tensor(group)
    return x


def test_rapid_weights_and_reweighted_baseline_by_hand():
    # one group; A = r - mean = (0.5, 0, -0.5); sequence ratios 2 x 1 = 2, 1, 0.5 x 1 = 0.5 -> w = (2, 1, 0.5)
    # delta = (2 * 0.5 + 0 - 0.5 * 0.5) / 3.5 - 0 = 0.75 / 3.5 ; A' = A - delta ; value and gradient -A' w per token
    x = rapid_input([[2.0, 1.0], [1.0, 1.0], [0.5, 1.0]], [0.5, 0.0, -0.5], [0, 0, 0])
    loss, g, met = grad_of("rapid", x)
    d = 0.75 / 3.5
    want = torch.tensor([-(0.5 - d) * 2, -(0.0 - d) * 1, -(-0.5 - d) * 0.5], dtype=torch.float64)[:, None].expand(3, 2)
    assert torch.allclose(loss, want) and torch.allclose(g, want)
    assert float(met["rapid_baseline_shift"]) == pytest.approx(d)
    assert float(met["clip_frac"]) == pytest.approx(1 / 3)  # response 0 sits at the cap c = 2
    # a tighter cap: w0 = 1.5, delta = (0.75 - 0.25) / 3
    x = rapid_input([[2.0, 1.0], [1.0, 1.0], [0.5, 1.0]], [0.5, 0.0, -0.5], [0, 0, 0])
    _, g, _ = grad_of("rapid", x, weight_clip=1.5)
    assert float(g[0, 0]) == pytest.approx(-(0.5 - 0.5 / 3) * 1.5)


def test_rapid_on_policy_is_the_group_relative_policy_gradient():
    # every ratio 1: no baseline shift even for a split group (rows 0, 1 of group 0 and row 2 of group 1)
    x = rapid_input([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], [0.7, 0.1, -0.3], [0, 0, 1])
    loss, g, met = grad_of("rapid", x)
    assert torch.allclose(g, -x.advantages)
    assert float(met["rapid_baseline_shift"]) == 0.0 and float(met["clip_frac"]) == 0.0
    with pytest.raises(ValueError, match="weight_clip"):
        compute_policy_loss("rapid", x, weight_clip=0.0)


# --- CSCR, counterfactual sensitivity credit reallocation --------------------------------------

def test_cscr_reallocates_credit_but_keeps_each_responses_total_and_sign_by_hand():
    from rlpost.algos.advantages import AdvantageInput, compute_advantages

    # rewards (1, 0): A = +-0.5 / sqrt(0.5) = +-0.7071. Row 0 shifts (|d+|, |d-|) per token: (0.2, 0.2),
    # (0.0, 0.0), (0.4, 0.0) -> s = (0.2, 0, 0.2), mean 0.4 / 3; beta = 0.5: s / mean = (1.5, 0, 1.5)
    # u before renorm = (1 / 1.75, 1, 1 / 1.75) sum 2.142857 -> x 3 / 2.142857 = (0.8, 1.4, 0.8)
    shifts = torch.tensor([[[0.2, -0.2], [0.0, 0.0], [0.4, 0.0]], [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
    inp = AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=torch.ones(2, 3),
                         group_index=torch.zeros(2, dtype=torch.long), privileged_shifts=shifts)
    A = compute_advantages("cscr", inp).advantages
    z = 0.5 / 0.5 ** 0.5
    assert torch.allclose(A[0], torch.tensor([0.8, 1.4, 0.8]) * z, atol=1e-5)
    assert torch.allclose(A[1], torch.full((3,), -z), atol=1e-5)  # no sensitivity: GRPO's credit
    assert float(A[0].sum()) == pytest.approx(3 * z, abs=1e-5)  # the credit budget is kept
    g = compute_advantages("cscr", inp, downweight_strength=0.0).advantages
    assert torch.allclose(g, torch.tensor([[z] * 3, [-z] * 3]), atol=1e-5)  # strength 0: GRPO
    with pytest.raises(ValueError, match="privileged_shifts"):
        compute_advantages("cscr", AdvantageInput(rewards=torch.ones(2), response_mask=torch.ones(2, 1),
                                                  group_index=torch.zeros(2, dtype=torch.long)))


def test_cscr_privileged_batch_prepends_the_context_before_the_real_prompt():
    from rlpost.algos.cscr import privileged_batch
    from rlpost.core.batch import RolloutBatch

    b = RolloutBatch(prompt_ids=torch.tensor([[0, 5, 6], [7, 8, 9]]), prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
                     response_ids=torch.tensor([[1, 2], [3, 4]]), response_mask=torch.ones(2, 2),
                     rollout_logprobs=torch.zeros(2, 2), group_index=torch.zeros(2, dtype=torch.long),
                     prompt_index=torch.zeros(2, dtype=torch.long))
    p = privileged_batch(b, torch.tensor([42, 43]))
    assert p.prompt_ids[0, -4:].tolist() == [42, 43, 5, 6] and p.prompt_mask[0].tolist() == [0, 1, 1, 1, 1]
    assert p.prompt_ids[1].tolist() == [42, 43, 7, 8, 9] and torch.equal(p.response_ids, b.response_ids)


def test_cscr_runner_supplies_the_privileged_shifts(tmp_path):
    r = train_rows(tmp_path, ["algo.adv_estimator=cscr", "steps=1"])[0]
    assert r["adv/privileged_shift_abs_mean"] > 0  # a context sentence moves a random model's log-probs
