"""SEED: the loss ``PPO-clip + lambda * sigmoid(beta * Delta) * (l_skill - l_theta)``, its gradient, and the
skill context. Moved unchanged from tests/test_methods_pope_hdl_seed_ripo.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlpost.algos.losses import PolicyLossInput, compute_policy_loss

from rlpost.samplers.hdl import context_logprobs


from hindsight_model import LN20, LN40_78, V, HindsightModel  # noqa: E402,F401  (tests/hindsight_model.py)


# ------------------------------------------------------------------------------------------ SEED
def _seed_inp(lp, skill, adv, mask):
    lp = torch.tensor(lp, requires_grad=True)
    return lp, PolicyLossInput(logprobs=lp, old_logprobs=lp.detach().clone(), advantages=torch.tensor(adv), response_mask=torch.tensor(mask), extras={'teacher_logprobs': torch.tensor(skill)})


def test_seed_loss_is_ppo_clip_plus_gated_distillation_hand_values():
    # on-policy (ratio 1): PPO clip's value is -A; the OPD term is lambda * g * Delta, g = sigmoid(beta * Delta)
    lp, x = _seed_inp([[-1.0, -2.0, -0.5]], [[-0.8, -2.4, -9.0]], [[0.5, 0.5, 0.5]], [[1.0, 1.0, 0.0]])
    loss, m = compute_policy_loss("seed", x, opd_coef=0.1, gate_beta=5.0)
    g = [1 / (1 + math.exp(-5 * 0.2)), 1 / (1 + math.exp(-5 * -0.4))]  # Delta = +0.2, -0.4
    # (padding keeps PPO's unmasked -A, as ppo_clip's own matrix does; the OPD term is 0 there; aggregation masks it)
    want = torch.tensor([[-0.5 + 0.1 * g[0] * 0.2, -0.5 + 0.1 * g[1] * -0.4, -0.5]])
    assert torch.allclose(loss.detach(), want, atol=1e-6)
    assert float(m["seed/gate_mean"]) == pytest.approx((g[0] + g[1]) / 2, abs=1e-6)
    assert float(m["seed/skill_shift_mean"]) == pytest.approx(-0.1, abs=1e-6)
    # gradient per token: -A (PPO, ratio 1) - lambda * g (the gated NLL); nothing on padding
    (loss * x.response_mask).sum().backward()
    assert torch.allclose(lp.grad, torch.tensor([[-0.5 - 0.1 * g[0], -0.5 - 0.1 * g[1], 0.0]]), atol=1e-6)


def test_seed_loss_with_opd_coef_zero_is_ppo_clip_and_equal_contexts_give_gate_one_half():
    lp, x = _seed_inp([[-1.0, -2.0]], [[-1.0, -2.0]], [[1.0, -1.0]], [[1.0, 1.0]])
    a, _ = compute_policy_loss("seed", x, opd_coef=0.0)
    b, _ = compute_policy_loss("ppo_clip", x)
    assert torch.equal(a, b)
    _, m = compute_policy_loss("seed", x)
    assert float(m["seed/gate_mean"]) == 0.5 and float(m["seed/opd_term"]) == 0.0
    with pytest.raises(ValueError, match="skill"):
        compute_policy_loss("seed", dataclasses.replace(x, extras={}))


class MarkerTok:
    """Tokenizer stub: any non-empty text is the single marker token 30."""

    def encode(self, text, add_special_tokens=False):
        return [30] if text else []


def test_skill_contexts_put_the_skill_in_front_and_leave_empty_skills_out():
    from rlpost.algos.seed import skill_contexts

    assert skill_contexts(MarkerTok(), [[1, 9], [2]], ["use the rule", ""]) == [[30, 1, 9], [2]]
    # scored by the same kernel, an empty skill changes nothing and a marker gives the hand-computed shift
    m = HindsightModel()
    ctx = skill_contexts(MarkerTok(), [[1, 9], [2]], ["rule", ""])
    lp1 = context_logprobs(m, ctx, [[7, 6, 5], [7, 5]])
    lp0 = context_logprobs(m, [[1, 9], [2]], [[7, 6, 5], [7, 5]])
    assert torch.allclose(lp1[0] - lp0[0], torch.tensor([0.0, LN20, 0.0]), atol=1e-6)
    assert torch.equal(lp1[1], lp0[1])
    with pytest.raises(ValueError, match="skills"):
        skill_contexts(MarkerTok(), [[1]], [])


def test_seed_stage_writes_the_skill_logprobs_as_the_self_teacher(compose, monkeypatch):
    import types

    import rlpost.methods.seed as seed_method
    from rlpost.methods.base import MethodSet

    cfg = compose(["model=tiny", "algo.loss=seed", "algo.loss_params.skill_tokens=12"])
    ms = MethodSet.for_config(cfg)
    assert ms.names == ["seed"] and seed_method.skill_tokens(cfg.algo) == 12
    assert seed_method.skill_tokens(compose(["model=tiny"]).algo) == 0

    class B:
        response_mask = torch.tensor([[1.0, 1.0, 0.0]])
        prompt_index = torch.tensor([0])
        extras: dict = {}

    asked = []

    def fake(batch, qs, engine, logprobs, tok, sp, n):
        asked.append((qs, n))
        return torch.tensor([[-0.5, -1.5, 0.0]]), ["ab", ""]

    monkeypatch.setattr(seed_method, "batch_skill_logprobs", fake)
    run = types.SimpleNamespace(task=types.SimpleNamespace(user_message=lambda e: f"q{e}"), examples=[7], engine=None,
                                logprobs=None, tokenizer=None, sampling_params=lambda step: None, step=1)
    b = B()
    m = ms.prepare(b, run)
    assert asked == [(["q7"], 12)] and torch.equal(b.extras["teacher_logprobs"], torch.tensor([[-0.5, -1.5, 0.0]]))
    assert m["seed/skill_chars_mean"] == 1.0 and m["seed/skill_empty_frac"] == 0.5
