"""A*-PO (arXiv:2505.20686): V* from reference samples, the optimal advantage, the least-squares loss,
and the runner's once-per-prompt reference sampling."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_overrides  # noqa: E402

from rlpost.algos.advantages import AdvantageInput, compute_advantages  # noqa: E402
from rlpost.algos.aggregation import aggregate  # noqa: E402
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss  # noqa: E402
from rlpost.algos.value import optimal_value  # noqa: E402

VSTAR_10 = 0.5 * math.log((math.exp(2.0) + 1.0) / 2.0)  # rewards {1, 0}, beta1 = 0.5


def test_optimal_value_hand_values_and_limits():
    rr = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    assert torch.allclose(optimal_value(rr, 0.5), torch.tensor([VSTAR_10, 0.0, 1.0], dtype=torch.float64))
    assert torch.allclose(optimal_value(rr, 0.0), torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64))  # mean
    assert optimal_value(rr[:1], 1e-3).item() == pytest.approx(1.0, abs=1e-2)  # beta1 -> 0+: the max
    assert optimal_value(rr[:1], 1e3).item() == pytest.approx(0.5, abs=1e-3)  # beta1 -> inf: the mean
    assert optimal_value(torch.tensor([[500.0, 0.0]]), 0.5).item() == pytest.approx(500 - 0.5 * math.log(2))


def test_a_star_advantage_is_reward_minus_vstar():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    x = AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=mask, group_index=torch.tensor([0, 1]),
                       reference_rewards=torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    out = compute_advantages("a_star", x, num_value_samples=2)
    assert torch.allclose(out.advantages, torch.tensor([[1 - VSTAR_10, 1 - VSTAR_10], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="expected 8"):
        compute_advantages("a_star", x)  # the default asks for 8 samples per prompt


def test_a_star_po_loss_hand_values_and_gradient():
    # beta2 = 0.5; row 0: log-ratio to ref 0.1 + 0.3 = 0.4 -> 0.2, A = 1 - V*; row 1: one real token, -0.2 -> -0.1,
    # A = -0.25.  Loss = mean over sequences of (beta2 l - A)^2; d/d lp_t = 2 (beta2 l - A) beta2 / B.
    ref = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    lp = (ref + torch.tensor([[0.1, 0.3], [-0.2, 9.0]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    a0 = 1 - VSTAR_10
    adv = torch.tensor([[a0, a0], [-0.25, 0.0]])
    inp = PolicyLossInput(logprobs=lp, old_logprobs=lp.detach(), advantages=adv, response_mask=mask, extras={'ref_logprobs': ref})
    loss_mat, met = compute_policy_loss("a_star_po", inp, beta2=0.5)
    total = aggregate("seq-mean-token-sum", loss_mat, mask)
    e0, e1 = 0.2 - a0, -0.1 + 0.25
    assert total.item() == pytest.approx((e0 ** 2 + e1 ** 2) / 2, abs=1e-6)
    total.backward()
    want = torch.tensor([[e0 * 0.5, e0 * 0.5], [e1 * 0.5, 0.0]])  # 2 (.) beta2 / B with B = 2
    assert torch.allclose(lp.grad, want, atol=1e-6)
    assert met["seq_a_star_log_ratio"].item() == pytest.approx((0.4 - 0.2) / 2, abs=1e-6)


def test_runner_samples_the_reference_once_per_prompt(compose, tmp_path):
    from rlpost.run.runner import Run

    cfg = compose(tiny_overrides("algo=a_star_po", "algo.adv_params.num_value_samples=3", "steps=2",
                                 "selector.prompts_per_step=2", "rollout.max_new_tokens=4", "eval.at_end=false",
                                 "checkpoint.every=0", "task.train_size=3"))
    run = Run(cfg, tmp_path)
    assert run.trainer.ref is not None and cfg.algo.kl.coef == 0  # the loss's reference, no KL
    m1 = run.train_step()
    ref = run.methods.get("a_star_po")
    assert ref.engine.model is run.trainer.ref  # fp32: the engine runs the frozen reference itself
    seen = dict(ref.cache)
    assert len(seen) == 2 and all(len(v) == 3 for v in seen.values())
    calls = []
    gen = ref.engine.generate
    ref.engine.generate = lambda prompts, sp: (calls.append(len(prompts)), gen(prompts, sp))[1]
    m2 = run.train_step()
    new = set(ref.cache) - set(seen)
    assert calls == ([3 * len(new)] if new else [])  # only prompts not seen before are sampled
    assert all(ref.cache[i] == v for i, v in seen.items())  # cached values are kept
    assert math.isfinite(m1["loss/policy"]) and math.isfinite(m2["loss/policy"])
