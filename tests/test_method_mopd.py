"""Open-MOPD (arXiv:2608.19098): oracle routing to several teachers, the domain budget weights, the reward refresh."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_overrides  # noqa: E402

from rlpost.algos.mopd import domain_budget_weights, mopd_advantage, mopd_loss, refreshed_advantage  # noqa: E402
from rlpost.core.errors import ConfigError  # noqa: E402

TWO = ("task=arithmetic_mix", "model.teachers.basic_arithmetic=tiny", "model.teachers.chain_sum=tiny")


# ------------------------------------------------------------------ routing
class _ConstTeacher:
    """A stand-in teacher whose log-prob of every token is ``value`` (records the rows it scored)."""

    def __init__(self, value: float) -> None:
        self.value, self.name, self.seen = value, f"c{value}", []

    def score(self, batch, trainer, top_k=0):
        self.seen.append(batch.prompt_index.tolist())
        return {"teacher_logprobs": torch.full(batch.response_mask.shape, self.value) * batch.response_mask}


def _batch(prompt_index, R=3):
    from rlpost.core.batch import RolloutBatch

    B = len(prompt_index)
    return RolloutBatch(prompt_ids=torch.ones(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2),
                        response_ids=torch.ones(B, R, dtype=torch.long), response_mask=torch.ones(B, R),
                        rollout_logprobs=torch.zeros(B, R), group_index=torch.arange(B),
                        prompt_index=torch.tensor(prompt_index))


def test_each_row_is_scored_by_its_domains_teacher_only():
    from rlpost.models.teacher import RoutedTeacher

    a, b = _ConstTeacher(-1.0), _ConstTeacher(-2.0)
    routed = RoutedTeacher({"add": a, "sub": b}, ["add", "sub", "sub", "add"])  # domains of prompts 0..3
    out = routed.score(_batch([3, 1, 0, 2, 1]), trainer=None)["teacher_logprobs"]
    assert out[:, 0].tolist() == [-1.0, -2.0, -1.0, -2.0, -2.0]
    assert a.seen == [[3, 0]] and b.seen == [[1, 2, 1]]  # each teacher saw only its own domain's rows


def test_a_row_without_a_teacher_is_a_config_error():
    from rlpost.models.teacher import RoutedTeacher

    routed = RoutedTeacher({"add": _ConstTeacher(-1.0)}, ["add", "mul"])
    with pytest.raises(ConfigError, match="model.teachers.mul"):
        routed.score(_batch([0, 1]), trainer=None)


# ------------------------------------------------------------------ budget weights by hand
def test_budget_weights_by_hand():
    """Two domains: rows 0,1 (domain 0) have 3 and 1 tokens, row 2 (domain 1) has 1 token; |r| = 1 / 2 per token.

    s = (4/5, 1/5); token share: base = (0.5/0.8, 0.5/0.2) = (0.625, 2.5); m = (1, 2);
    m_ref = (0.625*1 + 2.5*2) / 3.125 = 1.8; gap factors (1/1.8, 2/1.8); w~ = (0.347222, 2.777778);
    normalised by sum_j w~_j n_j / N = (0.347222*4 + 2.777778*1) / 5 = 0.833333 -> w = (0.416667, 3.333333).
    """
    dom = torch.tensor([0, 0, 1])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 0, 0]])
    r = torch.tensor([[1.0, -1, 1], [-1, 9, 9], [2, 9, 9]]) * mask
    w, met = domain_budget_weights(dom, torch.ones(3), mask, r)
    assert torch.allclose(w, torch.tensor([5 / 12, 5 / 12, 10 / 3]), atol=1e-6)
    assert float((w[:, None] * mask).sum()) == pytest.approx(5.0)  # the token-mean scale is kept
    assert met["mopd/d0/token_share"] == pytest.approx(0.8) and met["mopd/d1/gap"] == pytest.approx(2.0)
    # token share alone: base (0.625, 2.5) / ((0.625*4 + 2.5) / 5 = 1) -> each domain gets half the budget
    w1, _ = domain_budget_weights(dom, torch.ones(3), mask, r, gap_alpha=0.0)
    assert torch.allclose(w1, torch.tensor([0.625, 0.625, 2.5]))
    assert float((w1 * mask.sum(-1))[:2].sum()) == pytest.approx(float((w1 * mask.sum(-1))[2]))
    # neither: naive M-OPD (every weight 1); the clamp bounds the gap factor
    w0, _ = domain_budget_weights(dom, torch.ones(3), mask, r, token_share=False, gap_alpha=0.0)
    assert torch.equal(w0, torch.ones(3))
    wc, _ = domain_budget_weights(dom, torch.ones(3), mask, r, token_share=False, gap_alpha=1.0,
                                  gap_clamp_low=0.9, gap_clamp_high=1.05)
    assert float(wc[2] / wc[0]) == pytest.approx(1.05 / 0.9)  # m = (1, 2), m_ref = 1.2: factors 0.833 -> 0.9, 1.667 -> 1.05
    # target shares 3:1 -> domain 0 holds three quarters of the token budget
    wt, _ = domain_budget_weights(dom, torch.tensor([3.0, 3.0, 1.0]), mask, r, gap_alpha=0.0)
    assert float((wt * mask.sum(-1))[:2].sum()) / 5 == pytest.approx(0.75)


def test_estimator_weights_the_sampled_token_gap_and_returns_the_weights():
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 0, 0]])
    old = torch.tensor([[-1.0, -1, -1], [-1, -1, -1], [-1, -1, -1]])
    t = old + torch.tensor([[1.0, -1, 1], [-1, 0, 0], [2, 0, 0]])
    inp = SimpleNamespace(teacher_logprobs=t, old_logprobs=old, rollout_logprobs=None, response_mask=mask,
                          extras={"domain_id": torch.tensor([0, 0, 1]), "domain_target": torch.ones(3)})
    out = mopd_advantage(inp, target_shares=None, token_share=True, gap_alpha=1.0, gap_clamp_low=0.05,
                         gap_clamp_high=20.0)
    w = torch.tensor([5 / 12, 5 / 12, 10 / 3])
    assert torch.allclose(out.extras["mopd_weight"], w, atol=1e-6)
    assert torch.allclose(out.advantages, w[:, None] * (t - old) * mask, atol=1e-6)
    inp.extras = {}  # no domain labels: one domain, weights 1 (sampled-token OPD)
    out = mopd_advantage(inp, target_shares=None, token_share=True, gap_alpha=1.0, gap_clamp_low=0.05,
                         gap_clamp_high=20.0)
    assert torch.allclose(out.advantages, (t - old) * mask) and torch.allclose(out.extras["mopd_weight"], torch.ones(3))
    inp.teacher_logprobs = None
    with pytest.raises(ValueError, match="model.teachers"):
        mopd_advantage(inp, target_shares=None, token_share=True, gap_alpha=1.0, gap_clamp_low=0.05,
                       gap_clamp_high=20.0)


# ------------------------------------------------------------------ refresh schedule
def _loss_input(lp, old, adv, t, w, mask):
    from rlpost.algos.losses import PolicyLossInput

    return PolicyLossInput(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask,
                           extras={"teacher_logprobs": t, "mopd_weight": w})


def test_refresh_follows_the_current_student_from_the_second_inner_update():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    old, t, w = torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-0.5, -3.0, 0.0]]), torch.tensor([2.0])
    stored = w[:, None] * (t - old) * mask  # the estimator's rollout-time advantage: [1, -2]
    kw = dict(eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    # inner update 1: the student has not moved -> the refreshed advantage is the stored one
    lp = old.clone().requires_grad_(True)
    loss, met = mopd_loss(_loss_input(lp, old, stored, t, w, mask), refresh=True, **kw)
    assert float(met["mopd/refresh_shift"]) == 0.0
    loss.sum().backward()
    assert torch.allclose(lp.grad, -stored * mask)  # d(-r A)/d lp at r = 1
    # inner update 2: the student moved (+0.1, -0.1) -> A = w (t - lp_now), no gradient through the reward
    now = old + torch.tensor([[0.1, -0.1, 0.0]])
    assert torch.allclose(refreshed_advantage(now, t, w, mask), torch.tensor([[0.8, -1.8, 0.0]]))
    lp2 = now.clone().requires_grad_(True)
    _, met2 = mopd_loss(_loss_input(lp2, old, stored, t, w, mask), refresh=True, **kw)
    assert float(met2["mopd/refresh_shift"]) == pytest.approx(0.2)
    loss2, _ = mopd_loss(_loss_input(lp2, old, stored, t, w, mask), refresh=True, **kw)
    loss2.sum().backward()
    ratio = torch.exp(now - old)
    assert torch.allclose(lp2.grad, -(ratio * torch.tensor([[0.8, -1.8, 0.0]])) * mask, atol=1e-6)
    # without refresh the stored advantage stays
    lp3 = now.clone().requires_grad_(True)
    loss3, met3 = mopd_loss(_loss_input(lp3, old, stored, t, w, mask), refresh=False, **kw)
    assert "mopd/refresh_shift" not in met3
    loss3.sum().backward()
    assert torch.allclose(lp3.grad, -(ratio * stored) * mask, atol=1e-6)


# ------------------------------------------------------------------ config errors
def test_config_errors_name_the_fix(compose):
    from rlpost.config.compose import validate_config

    validate_config(compose(tiny_overrides("algo=mopd", *TWO)))
    with pytest.raises(ConfigError, match="model.teachers.chain_sum="):  # a domain without its teacher
        validate_config(compose(tiny_overrides("algo=mopd", *TWO[:2])))
    with pytest.raises(ConfigError, match="does not have"):  # a key that is no domain of the task
        validate_config(compose(tiny_overrides("algo=mopd", *TWO, "model.teachers.chainsum=tiny")))
    with pytest.raises(ConfigError, match="model.teachers"):  # no teacher at all
        validate_config(compose(tiny_overrides("algo=mopd", "task=arithmetic_mix")))
    with pytest.raises(ConfigError, match="gap_alpha"):  # a misspelt parameter
        validate_config(compose(tiny_overrides("algo=mopd", *TWO, "algo.adv_params.gap_alfa=1")))
    with pytest.raises(ConfigError, match="refresh"):
        validate_config(compose(tiny_overrides("algo=mopd", *TWO, "algo.loss_params.refrsh=false")))
    with pytest.raises(ConfigError, match="target_shares"):
        validate_config(compose(tiny_overrides("algo=mopd", *TWO, "algo.adv_params.target_shares.chain_sum=1")))
    with pytest.raises(ConfigError, match="both set"):
        validate_config(compose(tiny_overrides("algo=mopd", *TWO, "model.teacher=tiny")))
    with pytest.raises(ConfigError, match="uses no teacher"):
        validate_config(compose(tiny_overrides("algo=grpo", *TWO)))
    with pytest.raises(ConfigError, match="model.teachers.chain_sum"):  # a spec that names nothing
        validate_config(compose(tiny_overrides("algo=mopd", *TWO[:2], "model.teachers.chain_sum=no-such-model")))


# ------------------------------------------------------------------ a short run
def test_two_teachers_two_steps_on_the_tiny_model(compose, tmp_path):
    """algo=mopd on task=arithmetic_mix with a tiny teacher per domain: routed teacher stage, domain weights,
    four refreshed inner updates per step; the tiny teachers equal the student at step 1 (same seed)."""
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("algo=mopd", *TWO, "steps=2", "selector.prompts_per_step=4",
                                 "algo.n_samples_per_prompt=2", "rollout.max_new_tokens=6", "eval.at_end=false",
                                 "checkpoint.every=0"))
    train(cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss/policy" in r]
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["loss/policy"]) and math.isfinite(r["actor/grad_norm"])
        shares = [v for k, v in r.items() if k.startswith("mopd/") and k.endswith("/token_share")]
        assert len(shares) == 2 and sum(shares) == pytest.approx(1.0)
    assert abs(rows[0]["teacher/logprob_gap"]) < 1e-4 and abs(rows[0]["adv/mean"]) < 1e-4
