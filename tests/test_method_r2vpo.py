"""R²VPO on hand-computed tensors: values from the paper's equations, which tokens receive gradient, and the
end-to-end plumbing on ``model=tiny``. Moved unchanged from tests/test_methods_r2vpo_xrpo_rapid_cscr.py.
"""

import json

import pytest
import torch

from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from loss_split import grad_of, make as _make  # noqa: E402  (tests/loss_split.py)


def make(ratios, adv, mask=None, **kw):
    """:func:`loss_split.make` in float64."""
    return _make(ratios, adv, mask, dtype=torch.float64, **kw)



from conftest import train_rows  # noqa: E402  (tests/conftest.py)


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
