"""Properties every registered advantage estimator, policy loss and aggregation mode keeps, each checked once
per component on one small shared batch, plus a fixed-seed sample of estimator x loss x aggregation combinations.

Generic: this file names no method. A component whose inputs the shared batch lacks declares them at its
registration (``example_inputs=``, read through ``Registry.example``); an estimator whose zero-variance group
is not 0 says why (``zero_variance=``); see docs/ARCHITECTURE.md, "What a component declares for the generic
tests". Hand-computed values live in the by-hand files (tests/test_algos_advantages.py,
tests/test_algos_losses.py) and the per-method files.

Properties (each can fail; the report of the change that introduced them says which fault each was seen to catch):

* estimators: finite float32 advantages that are exactly 0 on masked positions; a group of equal rewards gets
  exactly 0 while a group with variance still learns (unless the estimator declares ``zero_variance``), with
  the mean and the minimum-variance baseline; a batch of equal rewards whose every baseline signal agrees
  (critic, greedy baseline, teacher = student, reference rewards) gets exactly 0 unless the estimator has no
  baseline at all (tag ``no_baseline``).
* losses: on-policy (old log-probs = current) the importance ratio is exactly 1, the loss and gradients are
  finite, a ratio clip reports no clipped token (tag ``clip_frac_counts`` for losses whose clip_frac counts
  other tokens), masked positions get exactly zero gradient; a loss driven by the advantage alone (no second
  policy among its extras, no reference responses) gives zero gradient for zero advantages and never moves a
  token's log-prob against its advantage; off-policy, the micro-batch losses with the mini-batch denominator
  sum to the whole batch's loss and gradient.
* aggregations: the same micro-batch sum for each mode, on ragged rows and an empty row.
"""

from __future__ import annotations

import random
from typing import Dict, List, Tuple

import pytest
import torch
from omegaconf import OmegaConf

from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.algos.aggregation import agg_count, aggregate
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from rlpost.algos.registries import ADV_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES
from rlpost.algos.validate import loss_overrides, validate_algo
from rlpost.config.schema import AlgoConfig
from rlpost.core.errors import ConfigError

#: extras that hold a second policy's view (reference, teacher) or rewards of other tokens: a loss that reads
#: one optimises more than the advantage-weighted log-likelihood (EXTRA_INPUTS in rlpost/algos/losses.py)
SECOND_POLICY_EXTRAS = {"ref_logprobs", "teacher_logprobs", "teacher_support_logprobs", "support_rewards"}

# ------------------------------------------------------------------------------------------------ estimators
#: group 0: eight equal rewards 0.9 of ragged lengths (a token-level baseline gave -0.1065 per token there once);
#: group 1: variance
LENGTHS = [15, 24, 6, 32, 2, 6, 7, 13, 3, 5, 7, 9]
R_ADV = 32


def _adv_input(rewards: List[float], lengths: List[int], groups: List[int], seed: int = 0,
               agree: bool = False) -> Tuple[AdvantageInput, torch.Tensor]:
    """Every AdvantageInput field filled at random (rows of ``lengths`` real tokens of ``R_ADV``); with
    ``agree`` every baseline signal equals the reward: critic values, greedy-rollout and reference rewards, the
    teacher's log-probs = the student's. Returns ``(input, rollout log-probs)``."""
    B = len(rewards)
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, R_ADV)
    for i, L in enumerate(lengths):
        mask[i, :L] = 1.0
    lp = -torch.rand(B, R_ADV, generator=g) - 0.05
    r = torch.tensor(rewards, dtype=torch.float32)
    x = AdvantageInput(
        rewards=r, response_mask=mask, group_index=torch.tensor(groups),
        values=r[:, None].expand(B, R_ADV).clone() if agree else torch.rand(B, R_ADV, generator=g),
        entropy=torch.rand(B, R_ADV, generator=g) + 0.1,
        baseline_rewards=r.clone() if agree else torch.rand(B, generator=g),
        answer_ids=torch.arange(B) % 3,
        teacher_logprobs=lp.clone() if agree else lp + 0.3 * torch.randn(B, R_ADV, generator=g),
        rollout_logprobs=lp, old_logprobs=lp.clone(),
        reference_rewards=r[:, None].expand(B, 8).clone() if agree else torch.rand(B, 8, generator=g),
        privileged_shifts=0.1 * torch.randn(B, R_ADV, 2, generator=g),
        response_ids=torch.randint(0, 50, (B, R_ADV), generator=g),
    )
    return x, lp


def _run_estimator(name: str, x: AdvantageInput, lp: torch.Tensor, zero_float_extras: bool = False, **params):
    """``compute_advantages`` with the estimator's declared example inputs (float extras zeroed on request:
    step signals that agree with equal rewards)."""
    ex = ADV_ESTIMATORS.example(name, lp, torch.Generator().manual_seed(1))
    extras = dict(ex["extras"])
    if zero_float_extras:
        extras = {k: torch.zeros_like(v) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in extras.items()}
    x.extras = extras
    return compute_advantages(name, x, **{**ex["params"], **params})


def _takes_min_variance(name: str) -> bool:
    try:
        ADV_ESTIMATORS.resolve(name, {"baseline": "min_variance"})
        return True
    except ConfigError:
        return False


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_estimator_zero_variance_group_masks_and_finiteness(name):
    """Group 0 (all 0.9) gets exactly 0 unless declared, group 1 learns; finite float32; 0 off the mask."""
    entry = ADV_ESTIMATORS.entry(name)
    assert entry.tags.get("needs_group") or entry.zero_variance, (
        f"{name}: a single-rollout estimator declares zero_variance= (why a group of equal rewards is not 0)")
    for extra in ({}, {"baseline": "min_variance"}) if _takes_min_variance(name) else ({},):
        x, lp = _adv_input([0.9] * 8 + [1.0, 0.0, 0.5, 0.25], LENGTHS, [0] * 8 + [1] * 4)
        a = _run_estimator(name, x, lp, **extra).advantages
        assert a.dtype == torch.float32 and a.shape == x.response_mask.shape, (name, a.dtype, a.shape)
        assert torch.isfinite(a).all(), (name, extra)
        assert torch.equal(a[x.response_mask == 0], torch.zeros_like(a[x.response_mask == 0])), (name, extra)
        assert a[8:].abs().sum() > 0, (name, extra)  # the group with variance still learns
        if not entry.zero_variance:
            assert torch.equal(a[:8], torch.zeros_like(a[:8])), (name, extra, a[:8].abs().max())


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_estimator_batch_of_equal_rewards_with_agreeing_baselines_gets_zero(name):
    """All rewards 0.9 and every baseline signal equal to them: exactly 0, unless there is no baseline at all."""
    x, lp = _adv_input([0.9] * 8, LENGTHS[:8], [0] * 8, agree=True)
    a = _run_estimator(name, x, lp, zero_float_extras=True).advantages
    assert torch.isfinite(a).all(), name
    if not ADV_ESTIMATORS.tag(name, "no_baseline", False):
        assert torch.equal(a, torch.zeros_like(a)), (name, a.abs().max())


# ---------------------------------------------------------------------------------------------------- losses
B, R = 6, 5
#: ragged rows, one with a hole (an environment token between two turns), groups of 3
MASK = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0],
                     [1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.float32)
GROUPS = torch.arange(B) // 3
#: the same rows without the hole (single-turn rows: estimators that read turns from holes need episode records)
MASK_ONE_TURN = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0],
                              [1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.float32)


def _loss_input(name: str, lp: torch.Tensor, adv: torch.Tensor, old: torch.Tensor, seed: int = 0):
    """``(PolicyLossInput, params)`` on the shared batch with the loss's declared example inputs."""
    g = torch.Generator().manual_seed(seed)
    ex = POLICY_LOSSES.example(name, lp.detach(), g)
    extras = {"segment_ids": (torch.arange(R) // 2).expand(B, R).clone(), **ex["extras"]}
    x = PolicyLossInput(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=MASK,
                        entropy=torch.rand(B, R, generator=g) + 0.05, group_index=GROUPS, seed=0, step=3,
                        extras=extras)
    return x, ex["params"]


def _leaves(x: PolicyLossInput) -> List[torch.Tensor]:
    """The tensors the loss's gradient flows to: the log-probs and any extras leaf (a support's log-probs)."""
    return [x.logprobs] + [v for v in x.extras.values() if torch.is_tensor(v) and v.requires_grad]


def _grads(x: PolicyLossInput) -> List[torch.Tensor]:
    return [torch.zeros_like(t) if t.grad is None else t.grad for t in _leaves(x)]


def _advantage_driven(name: str) -> bool:
    """The loss optimises the advantage-weighted likelihood only (no second policy, no reference responses)."""
    extras = set(POLICY_LOSSES.tag(name, "extras", ()) or ())
    return not (extras & SECOND_POLICY_EXTRAS) and not POLICY_LOSSES.tag(name, "needs_reference_responses", False)


def _base(seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(B, R, generator=g) * 0.5 - 1.5
    adv = torch.randn(B, 1, generator=g).expand(B, R) * MASK
    return lp, adv


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_loss_on_policy_ratio_one_masks_and_advantage_direction(name):
    lp0, adv = _base(0)
    lp = lp0.clone().requires_grad_(True)
    x, params = _loss_input(name, lp, adv, lp0.clone())
    loss, met = compute_policy_loss(name, x, **params)
    assert torch.isfinite(loss).all(), name
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in met.values()), name
    assert float(met["ratio_mean"]) == pytest.approx(1.0, abs=1e-6) and float(met["ratio_max"]) == pytest.approx(1.0, abs=1e-6)
    if not POLICY_LOSSES.tag(name, "clip_frac_counts", None):
        assert all(float(v) == 0 for k, v in met.items() if k.startswith("clip_frac")), (name, met)
    aggregate("token-mean", loss, MASK).backward()
    grads = _grads(x)
    assert all(torch.isfinite(g).all() for g in grads), name
    assert sum(float(g.abs().sum()) for g in grads) > 0, name  # it learns something
    assert torch.equal(grads[0][MASK == 0], torch.zeros(int((MASK == 0).sum()))), (name, grads[0] * (1 - MASK))
    for g in grads[1:]:  # a support's log-probs [B, R, K]: masked positions get nothing either
        if g.dim() >= 2:
            assert torch.equal(g[MASK == 0], torch.zeros_like(g[MASK == 0])), name
    if not _advantage_driven(name):
        return
    # a policy-gradient step never lowers the log-prob of a token with a positive advantage (nor raises a
    # negative one); a loss that fits a distribution over the group's sequences (tags needs_group and
    # sequence_sum) moves every row of the group together, so only the total is signed
    assert float(-(grads[0] * adv).sum()) > 0, name
    if not (POLICY_LOSSES.tag(name, "needs_group", False) and POLICY_LOSSES.tag(name, "sequence_sum", False)):
        assert float((grads[0] * adv).max()) <= 1e-7, (name, grads[0] * adv)
    # zero advantages: nothing to learn
    lp2 = lp0.clone().requires_grad_(True)
    x2, params2 = _loss_input(name, lp2, torch.zeros(B, R), lp0.clone())
    loss2, _ = compute_policy_loss(name, x2, **params2)
    aggregate("token-mean", loss2, MASK).backward()
    for g in _grads(x2):
        assert torch.equal(g, torch.zeros_like(g)), (name, g.abs().max())


def _rows(v, rows: slice):
    """Rows ``rows`` of a per-row extras entry (first dimension B); anything else unchanged."""
    return v[rows] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == B else v


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_loss_micro_batches_with_the_mini_batch_denominator_sum_to_the_whole_batch(name):
    """Off-policy (old log-probs 0.3 nats away): rows [0, 2) + [2, 6) with the whole batch passed as
    ``batch`` (what the trainer does) give the whole batch's loss and gradient, under token-mean."""
    lp0, adv = _base(1)
    old = lp0 + 0.3 * torch.randn(B, R, generator=torch.Generator().manual_seed(2))
    denom = agg_count("token-mean", MASK)
    _, params = _loss_input(name, lp0.clone(), adv, old)
    full, _ = _loss_input(name, lp0.clone(), adv, old)
    full.extras = {k: (v.detach() if torch.is_tensor(v) else v) for k, v in full.extras.items()}

    def run(rows: slice):
        lp = lp0.clone().requires_grad_(True)
        x, _ = _loss_input(name, lp, adv, old)  # same seed: the same example inputs as `full`
        leaves = {k: v for k, v in x.extras.items() if torch.is_tensor(v) and v.requires_grad}
        part = PolicyLossInput(
            logprobs=lp[rows], old_logprobs=old[rows], advantages=adv[rows], response_mask=MASK[rows],
            entropy=x.entropy[rows], group_index=GROUPS[rows], seed=0, step=3, batch=full,
            rows=torch.arange(B)[rows], extras={k: _rows(v, rows) for k, v in x.extras.items()})
        loss_mat, _ = compute_policy_loss(name, part, **params)
        loss = aggregate("token-mean", loss_mat, MASK[rows], denom=denom)
        loss.backward()
        return loss.detach(), [lp.grad if lp.grad is not None else torch.zeros_like(lp)] + [
            v.grad if v.grad is not None else torch.zeros_like(v) for v in leaves.values()]

    whole, g = run(slice(0, B))
    a, ga = run(slice(0, 2))
    b, gb = run(slice(2, B))
    assert sum(float(t.abs().sum()) for t in g) > 0, name
    assert float(whole) == pytest.approx(float(a + b), rel=1e-5, abs=1e-6), (name, whole, a + b)
    for t, ta, tb in zip(g, ga, gb):
        assert torch.allclose(t, ta + tb, rtol=1e-5, atol=1e-6), (name, (t - ta - tb).abs().max())


# ---------------------------------------------------------------------------------------------- aggregations
@pytest.mark.parametrize("agg", LOSS_AGGS.names())
def test_aggregation_micro_batches_sum_to_the_whole_batch(agg):
    """A ragged batch with an empty row: parts with the whole batch's count add up to the whole (value and
    gradient), and the empty row contributes nothing."""
    torch.manual_seed(0)
    mask = torch.cat([MASK, torch.zeros(1, R)])
    lm = torch.randn(B + 1, R).requires_grad_(True)
    whole = aggregate(agg, lm, mask, norm_const=R)
    (gw,) = torch.autograd.grad(whole, lm)
    denom = agg_count(agg, mask)
    parts = [aggregate(agg, lm[s], mask[s], denom=denom, norm_const=R) for s in (slice(0, 1), slice(1, 4), slice(4, B + 1))]
    (gp,) = torch.autograd.grad(sum(parts), lm)
    assert torch.isclose(whole, sum(parts), atol=1e-6), (agg, whole, sum(parts))
    assert torch.allclose(gw, gp, atol=1e-7) and torch.equal(gw[mask == 0], torch.zeros(int((mask == 0).sum())))
    assert torch.isfinite(whole)


# -------------------------------------------------------------------------------- a sample of combinations
def _combinations(n: int = 40, seed: int = 46) -> List[Tuple[str, str, str]]:
    """A fixed-seed sample of estimator x loss x aggregation: every estimator and every loss at least once
    (the first 53 + 46 draws walk both lists in a shuffled order), ``n`` in all."""
    rng = random.Random(seed)
    ests, losses, aggs = ADV_ESTIMATORS.names(), POLICY_LOSSES.names(), LOSS_AGGS.names()
    rng.shuffle(ests)
    rng.shuffle(losses)
    k = max(len(ests), len(losses), n)
    return [(ests[i % len(ests)], losses[i % len(losses)], aggs[rng.randrange(len(aggs))]) for i in range(k)]


@pytest.mark.parametrize("adv,loss,agg", _combinations())
def test_sampled_combination_validates_and_runs(adv, loss, agg):
    """Config validation accepts the combination (with what the estimator needs) and the pure pipeline gives
    finite advantages, losses, gradients and metrics."""
    n = 3
    cfg = OmegaConf.structured(AlgoConfig)
    OmegaConf.update(cfg, "adv_estimator", adv)
    OmegaConf.update(cfg, "loss", loss)
    OmegaConf.update(cfg, "n_samples_per_prompt", n)
    OmegaConf.update(cfg, "critic.enabled", bool(ADV_ESTIMATORS.tag(adv, "needs_critic")))
    lp0, _ = _base(3)
    ex = ADV_ESTIMATORS.example(adv, lp0, torch.Generator().manual_seed(1))
    if ex["params"]:
        OmegaConf.update(cfg, "adv_params", ex["params"], merge=True)
    validate_algo(cfg)
    g = torch.Generator().manual_seed(4)
    x = AdvantageInput(
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0]), response_mask=MASK_ONE_TURN, group_index=GROUPS,
        values=torch.rand(B, R, generator=g), entropy=torch.rand(B, R, generator=g),
        baseline_rewards=torch.full((B,), 0.5), answer_ids=torch.arange(B) % 2,
        teacher_logprobs=lp0 + 0.2 * torch.randn(B, R, generator=g), rollout_logprobs=lp0, old_logprobs=lp0.clone(),
        reference_rewards=torch.rand(B, 8, generator=g), privileged_shifts=torch.randn(B, R, 2, generator=g),
        response_ids=torch.zeros(B, R, dtype=torch.long), extras=dict(ex["extras"]))
    out = compute_advantages(adv, x, **dict(cfg.adv_params))
    assert torch.isfinite(out.advantages).all(), adv
    lm = MASK_ONE_TURN if out.loss_mask is None else out.loss_mask
    lp = lp0.clone().requires_grad_(True)
    inp, params = _loss_input(loss, lp, out.advantages, lp0 + 0.05 * torch.randn(B, R, generator=g))
    inp.response_mask = lm
    loss_mat, met = compute_policy_loss(loss, inp, **{**loss_overrides(cfg), **params})
    total = aggregate(agg, loss_mat, lm, norm_const=R)
    total.backward()
    assert torch.isfinite(total) and all(torch.isfinite(t).all() for t in _grads(inp)), (adv, loss, agg)
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in met.values()), (adv, loss, agg)


def test_sample_covers_every_estimator_and_loss():
    combos = _combinations()
    assert {c[0] for c in combos} == set(ADV_ESTIMATORS.names())
    assert {c[1] for c in combos} == set(POLICY_LOSSES.names())
    assert len({c[2] for c in combos}) == len(LOSS_AGGS.names())
