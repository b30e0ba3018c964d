"""The trainer's policy gradient equals autograd's gradient of the objective written out by hand.

The hand objective is built from a plain forward of the tiny model: logits at positions
``P - 1 .. P + R - 2`` divided by the sampling temperature, log-softmax, the sampled token's
entry; then the token-mean (or Dr. GRPO's seq-mean-token-sum-norm) over the real response tokens
of the whole mini-batch. On-policy (no recorded old log-probs) PPO-clip's ratio is exactly 1, so
its per-token loss has the gradient of ``-A_t log pi(y_t)``. This pins down, in one number each,
the temperature the trainer's log-probs use, which position scores which token, the aggregation's
denominator (response tokens or sequences of the whole mini-batch, the fixed normalising constant),
each micro-batch's share of the mini-batch loss, and the sign of the KL penalty.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_overrides, update_with_gradient  # noqa: E402
from ds_worker import make_batch  # noqa: E402

TEMPERATURE = 0.7
MAX_NEW = 12  # TINY's rollout.max_new_tokens: Dr. GRPO's normalising constant
_MODEL: dict = {}


def _trainer(compose, *extra):
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides("algo.loss=ppo_clip", "trainer.grad_clip=0", "algo.entropy_coef=0",
                                 f"rollout.temperature={TEMPERATURE}", "rollout.top_k=0", "rollout.top_p=1.0",
                                 f"rollout.max_new_tokens={MAX_NEW}", *extra))
    if "m" not in _MODEL:
        _MODEL["m"] = load_policy(ModelConfig(source="tiny"), seed=3)[0]
    return TorchTrainer.from_config(copy.deepcopy(_MODEL["m"]), cfg, "cpu")


def _batch():
    b = make_batch(B=8)  # rows end with 0, 1 or 2 padding positions
    b.response_mask[5] = 0  # an empty response: it counts in no denominator
    b.extras["advantages"] = b.extras["advantages"] * b.response_mask
    return b


def _hand_logprobs(model, b) -> torch.Tensor:
    """``[B, R]`` log pi(y_t | prompt, y_<t) at TEMPERATURE from one plain forward (prompts have no padding)."""
    P, R = b.prompt_ids.shape[1], b.response_ids.shape[1]
    ids = torch.cat([b.prompt_ids, b.response_ids], dim=1)
    logits = model(input_ids=ids).logits[:, P - 1: P + R - 1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, b.response_ids[..., None]).squeeze(-1)


def _hand_gradient(trainer, objective) -> torch.Tensor:
    """Autograd's gradient of ``objective(logprobs)`` w.r.t. the parameters the trainer steps on, flat."""
    model = trainer.train_module
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    objective(_hand_logprobs(model, _batch())).backward()
    g = torch.cat([p.grad.flatten() for p in params if p.grad is not None]).clone()
    model.zero_grad(set_to_none=True)
    return g


def _close(g, h):
    assert g.shape == h.shape
    assert float((g - h).norm()) <= 1e-4 * float(h.norm()) + 1e-7, (float((g - h).norm()), float(h.norm()))


@pytest.mark.parametrize("micro", [8, 3])
def test_token_mean_gradient_is_the_mean_over_real_response_tokens(compose, micro):
    t = _trainer(compose, "algo.loss_agg=token-mean", f"trainer.micro_batch_size={micro}", "algo.kl.coef=0")
    b = _batch()
    A, m = b.extras["advantages"], b.response_mask
    assert float(m.sum()) == 37.0  # rows of 6, 5, 4, 6, 5, 0 (empty), 6 and 5 response tokens
    h = _hand_gradient(t, lambda lp: -(A * lp * m).sum() / m.sum())
    _, g = update_with_gradient(t, _batch())
    _close(g, h)


@pytest.mark.parametrize("micro", [8, 3])
def test_dr_grpo_gradient_divides_by_max_new_tokens_and_non_empty_rows(compose, micro):
    t = _trainer(compose, "algo.loss_agg=seq-mean-token-sum-norm", f"trainer.micro_batch_size={micro}",
                 "algo.kl.coef=0")
    b = _batch()
    A, m = b.extras["advantages"], b.response_mask
    n_rows = float((m.sum(-1) > 0).sum())
    assert n_rows == 7.0
    h = _hand_gradient(t, lambda lp: -((A * lp * m).sum(-1) / MAX_NEW).sum() / n_rows)
    _, g = update_with_gradient(t, _batch())
    _close(g, h)


def test_k1_kl_penalty_pulls_the_policy_towards_the_reference(compose):
    """Zero advantages: the whole gradient is ``coef * grad token-mean(log pi - log pi_ref)``."""
    coef = 0.5
    t = _trainer(compose, "algo.loss_agg=token-mean", "trainer.micro_batch_size=8", f"algo.kl.coef={coef}",
                 "algo.kl.estimator=k1", "algo.kl.in_reward=false")
    b = _batch()
    m = b.response_mask
    ref = (b.rollout_logprobs - 0.3) * m  # any fixed reference log-probs (no gradient)
    h = _hand_gradient(t, lambda lp: coef * ((lp - ref) * m).sum() / m.sum())
    b.extras["advantages"] = torch.zeros_like(m)
    b.extras["ref_logprobs"] = ref
    _, g = update_with_gradient(t, b)
    _close(g, h)
