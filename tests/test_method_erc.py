"""ERC, entropy ratio clipping (arXiv:2512.05591): which tokens lose their gradient, its fallback, and the
runner's old-policy entropy. Moved unchanged from tests/test_losses_fipo_holderpo_p3o_erc.py.
"""

import pytest
import torch

from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from loss_split import grad_of, make  # noqa: E402  (tests/loss_split.py)




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
