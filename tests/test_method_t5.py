"""T^5 (arXiv:2609.32791, "T^5: Twin-Critic Training for Token-Level Thoughts in Reinforcement Mid-Training"):
per-critic GAE, the mixed advantage, one saddle-point step of both players, the signal-retention penalty, the
warm-up / qualification gate, checkpoint state, config errors, N-head critic micro-batch invariance, and a 2-step
run on the tiny model. The formulas are our reading of the abstract (rlpost/algos/t5.py)."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_overrides  # noqa: E402

from rlpost.algos.advantages import AdvantageInput, compute_advantages  # noqa: E402
from rlpost.algos.t5 import (TwinMixer, explained_variance, mixed_advantages, mixer_features,  # noqa: E402
                             prefix_features, saddle_objective, saddle_step)
from rlpost.core.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _linear_mixer() -> TwinMixer:
    return TwinMixer(2, hidden=0, seed=0)


def test_per_critic_gae_returns_and_fallback_by_hand():
    """Row 0: reward 1, V^1 = .5 everywhere, V^2 = [.2, .4, .6]; lams [1, .5]. Row 1: reward 0, 2 tokens, V = 0.
    Critic 1 (lam 1): A = 1 - .5 = .5, G = 1. Critic 2: deltas [.2, .2, .4] -> A = [.4, .4, .4], G = A + V.
    Fallback: return-to-go minus its mean over the 5 tokens (3/5)."""
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    vals = torch.zeros(2, 3, 2)
    vals[0, :, 0] = 0.5
    vals[0, :, 1] = torch.tensor([0.2, 0.4, 0.6])
    x = AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=mask, group_index=torch.arange(2), values=vals)
    out = compute_advantages("t5", x, lams=[1.0, 0.5])
    ha = out.extras["t5_head_advantages"]
    assert ha[0, :, 0].tolist() == pytest.approx([0.5, 0.5, 0.5])
    assert ha[0, :, 1].tolist() == pytest.approx([0.4, 0.4, 0.4])
    assert out.returns[0, :, 0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert out.returns[0, :, 1].tolist() == pytest.approx([0.6, 0.8, 1.0])
    assert out.advantages.flatten().tolist() == pytest.approx([0.4, 0.4, 0.4, -0.6, -0.6, 0.0])
    with pytest.raises(ValueError, match="num_heads=3"):
        compute_advantages("t5", x, lams=[1.0, 0.5, 0.9])


def test_mixed_advantage_with_action_dependent_weights_by_hand():
    """A linear mixer whose critic-1 logit is the token's old log-prob: w_1 = sigmoid(lp).
    Token 0: lp 0 -> w = (.5, .5): .5 * 1 + .5 * 3 = 2. Token 1: lp -ln 3 -> w = (.25, .75): .25 * -2 + .75 * 2 = 1."""
    mix = _linear_mixer()
    with torch.no_grad():
        mix.mixer[0].weight[0, 4] = 1.0  # feature 4 = log pi_old(a_t | s_t)
    head_adv = torch.tensor([[[1.0, 3.0], [-2.0, 2.0]]])
    mask = torch.ones(1, 2)
    lp = torch.tensor([[0.0, -math.log(3)]])
    x = mixer_features(head_adv, torch.zeros(1, 2, 2), lp, mask)
    assert x.shape == (1, 2, 6)
    adv, w = mixed_advantages(mix, x, head_adv, mask)
    assert w[0, :, 0].tolist() == pytest.approx([0.5, 0.25])
    assert adv[0].tolist() == pytest.approx([2.0, 1.0])


def test_one_saddle_step_of_both_players_by_hand():
    """A^1 = [1, -1], A^2 = [3, 1], V = 0, lp = 0, t/L = [0, .5]; mixer uniform (A_w = [2, 0]), f = .5; lr .1, no penalty.
    Test function ascends: dL/db = mean(A_w - f) = .5, dL/dW_pos = mean((A_w - f) t/L) = -.125.
    Mixer descends: dL/dl_j = f w_j (A^j - A_w) / 2 -> dL/dc = [-.25, .25]; dL/dW_0 = [0, -.5, 0, 0, 0, -.0625]."""
    mix = _linear_mixer()
    with torch.no_grad():
        mix.test_fn[0].bias.fill_(0.5)
    head_adv = torch.tensor([[[1.0, 3.0], [-1.0, 1.0]]])
    mask = torch.ones(1, 2)
    vals = torch.zeros(1, 2, 2)
    x = mixer_features(head_adv, vals, torch.zeros(1, 2), mask)
    z = prefix_features(vals, mask, 2)
    assert z[0, :, 2].tolist() == pytest.approx([0.0, 0.5])
    met = saddle_step(mix, x, z, head_adv, mask, lr=0.1, retention_target=0.5, coef=0.0)
    assert met["moment"] == pytest.approx(0.375)  # mean(.5 * 2 - .125, 0 - .125)
    assert float(mix.test_fn[0].bias.detach()) == pytest.approx(0.55)
    assert mix.test_fn[0].weight[0].tolist() == pytest.approx([0.0, 0.0, -0.0125])
    assert mix.mixer[0].bias.tolist() == pytest.approx([0.025, -0.025])
    assert mix.mixer[0].weight[0].tolist() == pytest.approx([0.0, 0.05, 0.0, 0.0, 0.0, 0.00625])
    assert mix.mixer[0].weight[1].tolist() == pytest.approx([0.0, -0.05, 0.0, 0.0, 0.0, -0.00625])


def test_signal_retention_penalty_active_and_inactive_by_hand():
    """A^1 = [1, -1], A^2 = [3, 1]: A_ref = [2, 0], <A_ref, A_ref> = 4; f = 0, kappa .8, c 2.
    Uniform weights: A_w = A_ref, S = 1 >= .8: inactive, L = 0, no gradient.
    All weight on critic 1: A_w = [1, -1], S = 2 / 4 = .5 < .8: L = 2 * .3^2 = .18,
    dL/dw = -2c(kappa - S) A^j A_ref / 4 = [[-.6, -1.8], [0, 0]]."""
    head_adv = torch.tensor([[[1.0, 3.0], [-1.0, 1.0]]])
    mask = torch.ones(1, 2)
    f = torch.zeros(1, 2)
    w = torch.full((1, 2, 2), 0.5, requires_grad=True)
    loss, met = saddle_objective(w, f, head_adv, mask, retention_target=0.8, coef=2.0)
    assert met["retention_active"] == 0.0 and met["signal_retention"] == pytest.approx(1.0)
    assert float(loss) == pytest.approx(0.0)
    loss.backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    w1 = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]], requires_grad=True)
    loss, met = saddle_objective(w1, f, head_adv, mask, retention_target=0.8, coef=2.0)
    assert met["retention_active"] == 1.0 and met["signal_retention"] == pytest.approx(0.5)
    assert float(loss) == pytest.approx(0.18)
    loss.backward()
    assert w1.grad.flatten().tolist() == pytest.approx([-0.6, -1.8, 0.0, 0.0])


def test_explained_variance_by_hand():
    """G = [1, 1, 0, 0]: Var 0.25. V = [.5, 1, 0, .5]: G - V = [.5, 0, 0, -.5], Var .125 -> EV .5; G constant: NaN."""
    m = torch.ones(1, 4)
    assert explained_variance(torch.tensor([[1.0, 1, 0, 0]]), torch.tensor([[0.5, 1, 0, 0.5]]), m) == pytest.approx(0.5)
    assert math.isnan(explained_variance(torch.ones(1, 4), torch.zeros(1, 4), m))


def _method(compose, *extra):
    from rlpost.methods.base import MethodSet

    cfg = compose(tiny_overrides("algo=t5", *extra))
    return MethodSet.for_config(cfg).get("t5")


def _gate_batch(values: torch.Tensor):
    """Two rows, 3 tokens, returns-to-go [1, 1, 1] and [0, 0, 0]; critic 2's advantages twice critic 1's."""
    mask = torch.ones(2, 3)
    mc = torch.tensor([[1.0, 1, 1], [0, 0, 0]])
    ha = torch.stack([mc - 0.5, 2 * (mc - 0.5)], -1)
    fallback = (mc - 0.5) * mask
    return SimpleNamespace(response_mask=mask, extras={
        "t5_head_advantages": ha, "t5_mc_returns": mc, "values": values, "old_logprobs": -torch.ones(2, 3),
        "advantages": fallback.clone()}), fallback


def test_warmup_and_qualification_gate(compose):
    """Warm-up (step <= 2): nothing mixed. Then critics with EV 0 < .5 stay unqualified (fallback kept); critics that
    predict the held-out returns (EV 1) qualify, the mix replaces the advantages; the gate then stays open."""
    meth = _method(compose, "algo.critic.warmup_steps=2", "algo.adv_params.qualification_threshold=0.5")
    zeros = torch.zeros(2, 3, 2)
    b, fb = _gate_batch(zeros)
    assert meth.mix_batch(b, 2) == {"t5/phase": 0.0}
    assert torch.equal(b.extras["advantages"], fb) and not meth.qualified
    met = meth.mix_batch(b, 3)
    assert met["t5/phase"] == 1.0 and met["t5/qualified"] == 0.0
    assert met["t5/explained_var_critic0"] == pytest.approx(0.0)
    assert torch.equal(b.extras["advantages"], fb)
    good = torch.stack([b.extras["t5_mc_returns"]] * 2, -1)
    half = good.clone()
    half[..., 1] = 0.0  # one critic still explains nothing: every critic must qualify
    b, _ = _gate_batch(half)
    assert meth.mix_batch(b, 4)["t5/qualified"] == 0.0
    b, fb = _gate_batch(good)
    met = meth.mix_batch(b, 5)
    assert met["t5/phase"] == 2.0 and meth.qualified and meth.qualified_at == 5
    x = mixer_features(b.extras["t5_head_advantages"], good, b.extras["old_logprobs"], b.response_mask)
    want, _ = mixed_advantages(meth.mix, x, b.extras["t5_head_advantages"], b.response_mask)
    assert torch.allclose(b.extras["advantages"], want) and not torch.equal(want, fb)
    b, _ = _gate_batch(zeros)  # latched: a later batch with poor critics is still mixed
    assert meth.mix_batch(b, 6)["t5/phase"] == 2.0


def test_state_of_both_critics_and_the_mixer_survives_a_checkpoint(compose, tmp_path):
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides("algo=t5"))
    pol = load_policy(ModelConfig(source="tiny"), seed=3)[0]
    t = TorchTrainer.from_config(copy.deepcopy(pol), cfg, "cpu")
    assert t.critic.num_heads == 2 and t.critic.head.weight.shape[0] == 2
    with torch.no_grad():
        t.critic.head.weight.normal_()
        t.critic.head.bias.copy_(torch.tensor([0.3, -0.7]))
    torch.save(t.state_dict(), tmp_path / "trainer.pt")
    t2 = TorchTrainer.from_config(copy.deepcopy(pol), cfg, "cpu")
    assert not torch.equal(t2.critic.head.weight, t.critic.head.weight)
    t2.load_state_dict(torch.load(tmp_path / "trainer.pt", weights_only=False))
    for k, v in t.critic.state_dict().items():
        assert torch.equal(v, t2.critic.state_dict()[k]), k

    meth = _method(compose, "algo.critic.warmup_steps=0", "algo.adv_params.qualification_threshold=-1")
    b, _ = _gate_batch(torch.stack([torch.tensor([[1.0, 1, 1], [0, 0, 0]])] * 2, -1))
    meth.mix_batch(b, 1)
    torch.save(meth.state_dict(), tmp_path / "state.pt")
    fresh = _method(compose, "algo.critic.warmup_steps=0", "algo.adv_params.qualification_threshold=-1")
    assert not fresh.qualified
    assert any(not torch.equal(v, fresh.mix.state_dict()[k]) for k, v in meth.mix.state_dict().items())
    fresh.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    assert fresh.qualified and fresh.qualified_at == 1
    for k, v in meth.mix.state_dict().items():
        assert torch.equal(v, fresh.mix.state_dict()[k]), k


@pytest.mark.parametrize("extra, match", [
    (["algo.critic.num_heads=3"], "num_heads=2"),
    (["algo.adv_params.lams=[1.0]", "algo.critic.num_heads=1"], "at least two critics"),
    (["algo.adv_params.mixer_lrr=0.1"], "mixer_lrr"),
    (["algo.adv_params.signal_retention_coef=-1"], "signal_retention_coef"),
    (["algo.critic.enabled=false"], "needs a critic"),
])
def test_config_errors_name_the_fix(compose, extra, match):
    from rlpost.config.compose import validate_config

    with pytest.raises(ConfigError, match=match):
        validate_config(compose(tiny_overrides("algo=t5", *extra)))


def test_several_value_heads_need_an_estimator_that_reads_them(compose):
    from rlpost.config.compose import validate_config

    with pytest.raises(ConfigError, match="num_heads=2 gives"):
        validate_config(compose(tiny_overrides("algo=ppo", "algo.critic.num_heads=2")))


def test_two_head_critic_update_does_not_depend_on_micro_batch_size(compose):
    """Both heads regressed on their own returns: the same critic step with micro-batches of 1 and 8 rows."""
    from ds_worker import make_batch

    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    pol = load_policy(ModelConfig(source="tiny"), seed=3)[0]
    heads = []
    for mb in (1, 8):
        cfg = compose(tiny_overrides("algo=t5", f"trainer.micro_batch_size={mb}", "algo.critic.lr=1e-2"))
        t = TorchTrainer.from_config(copy.deepcopy(pol), cfg, "cpu")
        b = make_batch(B=8)
        b.response_mask[5] = 0
        v = t.compute_values(b)
        assert v.shape == (8, b.response_ids.shape[1], 2)
        g = torch.Generator().manual_seed(2)
        b.extras["values"] = v
        b.extras["returns"] = torch.randn(v.shape, generator=g) * b.response_mask.unsqueeze(-1)
        met = t.critic_update(b)
        assert math.isfinite(met["critic/value_loss"])
        assert (t.critic.head.bias.detach().abs() > 0).all()  # each head was regressed (zero-initialised)
        heads.append(torch.cat([p.detach().flatten() for p in t.critic.parameters()]))
    start = torch.cat([p.detach().flatten() for p in TorchTrainer.from_config(
        copy.deepcopy(pol), compose(tiny_overrides("algo=t5")), "cpu").critic.parameters()])
    step = heads[1] - start
    assert step.norm() > 0
    assert float((heads[0] - heads[1]).norm() / step.norm()) < 1e-4


def test_t5_runs_two_steps_on_the_tiny_model(compose, tmp_path):
    """Step 1: critic warm-up (policy frozen, phase 0). Step 2: the (pre-opened) gate mixes the twin critics."""
    from rlpost.run.runner import Run

    cfg = compose(tiny_overrides("algo=t5", "steps=2", "eval.at_end=false", "eval.every=0", "checkpoint.every=0",
                                 "algo.critic.warmup_steps=1", "algo.n_samples_per_prompt=1"))
    run = Run(cfg, tmp_path / "t5")
    run.methods.get("t5").qualified = True  # the tiny random model's rewards may all be 0 (no variance to explain)
    rows = [run.train_step() for _ in range(2)]
    run.close()
    assert rows[0]["t5/phase"] == 0.0 and rows[0]["actor/frozen_for_critic_warmup"] == 1.0
    assert rows[1]["t5/phase"] == 2.0 and "actor/frozen_for_critic_warmup" not in rows[1]
    for r in rows:
        assert math.isfinite(r["critic/value_loss"])
    assert math.isfinite(rows[1]["t5/moment"]) and 0.0 <= rows[1]["t5/weight_critic0_mean"] <= 1.0
    json.dumps({k: v for k, v in rows[1].items() if isinstance(v, float)})
