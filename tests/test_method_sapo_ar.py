"""Single-rollout autoregressive credit (sapo_ar): turn-level GAE and SARSA targets by hand and the shared
backbone critic step. Moved unchanged from tests/test_methods_tbrm_sp3o_dppo_sapo.py.
"""

import math

import pytest
import torch


# -------------------------------------------------------------------- single-rollout autoregressive (sapo_ar)
def _sapo_ar_input():
    from rlpost.algos.advantages import AdvantageInput

    m = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)  # row 0: two turns, an env gap
    values = torch.tensor([[0.2, 9.0, 9.0, 0.6, 9.0, 9.0], [0.3, 9.0, 9.0, 9.0, 9.0, 9.0]])  # only turn starts read
    tok = torch.zeros(2, 6)
    tok[0, 1] = 0.5  # a per-turn reward on turn 0's last token
    return AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=m, group_index=torch.arange(2),
                          values=values, token_rewards=tok)


def test_sapo_ar_turn_level_gae_and_sarsa_targets_by_hand():
    from rlpost.algos.advantages import compute_advantages

    # row 0 (gamma 1, lam 0.5): r = (0.5, 1), V = (0.2, 0.6, 0): delta_1 = 1 - 0.6 = 0.4, A_1 = 0.4;
    # delta_0 = 0.5 + 0.6 - 0.2 = 0.9, A_0 = 0.9 + 0.5 * 0.4 = 1.1; SARSA targets 0.5 + 0.6 = 1.1 and 1.0.
    # row 1: one turn, A = 0 - 0.3 = -0.3, target 0
    out = compute_advantages("sapo_ar", _sapo_ar_input(), gamma=1.0, lam=0.5, adv_norm=False)
    assert out.advantages.flatten().tolist() == pytest.approx([1.1, 1.1, 0, 0.4, 0.4, 0, -0.3, -0.3, -0.3, 0, 0, 0])
    assert out.value_mask.tolist() == [[1, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0]]
    assert (out.returns * out.value_mask).flatten().tolist() == pytest.approx([1.1, 0, 0, 1.0, 0, 0] + [0] * 6)
    # batch normalisation over the three turns (1.1, 0.4, -0.3): mean 0.4, population std 0.7 sqrt(2/3)
    z = 0.7 / (0.7 * math.sqrt(2 / 3))
    out = compute_advantages("sapo_ar", _sapo_ar_input(), gamma=1.0, lam=0.5, adv_norm=True)
    assert out.advantages[0, 0] == pytest.approx(z, rel=1e-5) and out.advantages[0, 3] == pytest.approx(0.0, abs=1e-6)
    assert out.advantages[1, 0] == pytest.approx(-z, rel=1e-5) and float(out.advantages[0, 2]) == 0.0


def test_sapo_ar_shared_backbone_critic_step_moves_the_policy(compose):
    import copy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import tiny_overrides
    from ds_worker import make_batch

    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import backbone_and_head
    from rlpost.trainer.torch_engine import TorchTrainer

    policy = load_policy(ModelConfig(source="tiny"), seed=3)[0]
    cfg = compose(tiny_overrides("algo=sapo_ar", "trainer.grad_clip=0", "algo.critic.lr=1e-2"))
    t = TorchTrainer.from_config(copy.deepcopy(policy), cfg, "cpu")
    assert t.critic.backbone is backbone_and_head(t.policy)[0]  # one backbone, not a copy
    b = make_batch(B=4, R=6)
    vmask = torch.zeros(4, 6)
    vmask[:, 0] = 1.0
    b.extras.update(returns=torch.ones(4, 6), values=torch.zeros(4, 6), value_mask=vmask)
    before, _ = t.compute_logprobs(b)
    t.critic_update(b)  # the zero-initialised head: this step moves only the head
    after1, _ = t.compute_logprobs(b)
    assert torch.allclose(before, after1)
    t.critic_update(b)  # now the value loss reaches the shared backbone
    after, _ = t.compute_logprobs(b)
    assert not torch.allclose(before, after, atol=1e-5)  # the value step moved the policy
    from rlpost.core.errors import ConfigError
    from rlpost.algos.validate import validate_algo

    with pytest.raises(ConfigError, match="warmup_steps"):
        validate_algo(compose(["model=tiny", "algo=sapo_ar", "algo.critic.warmup_steps=2"]).algo)
