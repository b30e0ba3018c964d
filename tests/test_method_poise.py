"""POISE's probe and cross-rollout baseline (arXiv:2605.07579), and its preset two steps on the tiny model.
Moved unchanged from tests/test_algos_tppo_poise.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.algos.poise import PoiseProbe, cross_rollout_baseline, other_rollout_targets


# ----------------------------------------------------------------------------------------- POISE
def test_poise_cross_rollout_baseline_hand_values():
    """Groups {0, 1} and {2, 3, 4}: b_0 = v_1 = 0.6, b_1 = v_0 = 0.2, b_2 = (0.5 + 0.9) / 2 = 0.7,
    b_3 = (0.1 + 0.9) / 2 = 0.5, b_4 = (0.1 + 0.5) / 2 = 0.3; A = r - b."""
    inp = AdvantageInput(rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]), response_mask=torch.ones(5, 2),
                         group_index=torch.tensor([0, 0, 1, 1, 1]),
                         probe_values=torch.tensor([0.2, 0.6, 0.1, 0.5, 0.9]))
    out = compute_advantages("poise", inp)
    assert out.advantages[:, 0].tolist() == pytest.approx([0.4, -0.2, 0.3, -0.5, 0.7], abs=1e-6)
    assert out.returns is None


def test_poise_baseline_of_a_rollout_ignores_its_own_features_and_reward():
    """Invariant: b_i = r_i - A_i does not change when rollout i's own probe value and reward change
    (probe path and RLOO bootstrap path); it does when a sibling's changes."""
    g = torch.tensor([0, 0, 0, 1, 1])
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    v = torch.tensor([0.3, 0.7, 0.4, 0.5, 0.2])

    def base(rr, vv):
        inp = AdvantageInput(rewards=rr, response_mask=torch.ones(5, 1), group_index=g, probe_values=vv)
        return rr - compute_advantages("poise", inp).advantages[:, 0]

    b = base(r, v)
    for i in range(5):
        r2, v2 = r.clone(), v.clone()
        r2[i], v2[i] = 7.0, 0.99
        assert base(r2, v2)[i] == pytest.approx(float(b[i]), abs=1e-6)
        assert base(r2, None)[i] == pytest.approx(float(base(r, None)[i]), abs=1e-6)
    v3 = v.clone()
    v3[1] = 0.0
    assert base(r, v3)[0] != pytest.approx(float(b[0]))
    nan = torch.full((5,), float("nan"))  # probe not fitted yet: RLOO, b_0 = (0 + 1) / 2
    assert float(base(r, nan)[0]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least 2 rollouts"):
        cross_rollout_baseline(torch.tensor([0.1, 0.2]), torch.tensor([0, 1]))


def test_poise_targets_are_the_other_rollouts_mean_reward():
    t = other_rollout_targets(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert t.tolist() == [0.0, 1.0, 1.0, 1.0]


def _probe(**kw):
    p = dict(layer_frac=0.5, pool_tokens=2, prompt_pca_dim=0, response_pca_dim=0, ridge_alpha=4.0,
             buffer_rows=64, bootstrap_steps=1)
    p.update(kw)
    return PoiseProbe(p)


def test_poise_probe_ridge_hand_values_and_checkpoint_round_trip():
    """One scalar feature x = 0..3, y = 0.1 + 0.2 x. Standardised x_s = (x - 1.5) / sqrt(1.25) has
    sum x_s^2 = 4 and sum x_s (y - 0.4) = 0.2 sqrt(1.25) * 4, so with alpha = 4 the ridge weight is
    half the least-squares one: predictions 0.4 + (y - 0.4) / 2 = (0.25, 0.35, 0.45, 0.55); alpha 0:
    y exactly. Predictions are clipped to [0, 1]; the state round-trips."""
    x = torch.arange(4.0)[:, None]
    y = 0.1 + 0.2 * x[:, 0]
    h = torch.zeros(4, 3)
    pr = _probe(bootstrap_steps=2)
    assert torch.isnan(pr.predict(h, h, x)).all()
    m = pr.update(h, h, x, y)
    assert m["poise/fitted"] == 0.0 and torch.isnan(pr.predict(h, h, x)).all()  # still bootstrapping
    pr = _probe()
    pr.update(h, h, x, y)
    assert pr.predict(h, h, x).tolist() == pytest.approx([0.25, 0.35, 0.45, 0.55], abs=1e-6)
    exact = _probe(ridge_alpha=0.0)
    exact.update(h, h, x, y)
    assert exact.predict(h, h, x).tolist() == pytest.approx(y.tolist(), abs=1e-6)
    assert exact.predict(h[:1], h[:1], torch.tensor([[10.0]])).tolist() == [1.0]
    clone = _probe()
    clone.load_state_dict(pr.state_dict())
    assert torch.equal(clone.predict(h, h, x), pr.predict(h, h, x))


def test_poise_probe_pca_uses_hidden_states_and_buffer_keeps_recent_rows():
    """A reward that is a linear function of one hidden direction is recovered through the PCA."""
    gen = torch.Generator().manual_seed(0)
    hp = torch.randn(40, 6, generator=gen)
    hr = torch.randn(40, 6, generator=gen)
    y = (0.5 + 0.1 * hr[:, 2]).clamp(0, 1)
    pr = _probe(prompt_pca_dim=3, response_pca_dim=6, ridge_alpha=0.0, buffer_rows=32)
    pr.update(hp, hr, torch.zeros(40, 1), y)
    assert pr.rows["target"].shape[0] == 32  # the oldest 8 rows were dropped
    assert pr.predict(hp[8:], hr[8:], torch.zeros(32, 1)).tolist() == pytest.approx(y[8:].tolist(), abs=1e-5)


# ------------------------------------------------------------------------------- 2-step runs
def _run(tmp_path, *overrides):
    from conftest import tiny_overrides
    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(tiny_overrides("steps=2", "eval.at_end=false", "checkpoint.every=0",
                                        "selector.prompts_per_step=2", *overrides))
    train(cfg, tmp_path)
    return [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_poise_preset_runs_two_steps_on_the_tiny_model(tmp_path):
    rows = [r for r in _run(tmp_path, "algo=poise", "algo.n_samples_per_prompt=2",
                            "algo.adv_params.bootstrap_steps=1") if "reward/mean" in r]
    assert len(rows) == 2
    assert rows[0]["poise/fitted"] == 1.0 and "poise/pred_mean" not in rows[0]  # step 1: RLOO bootstrap
    assert 0.0 <= rows[1]["poise/pred_mean"] <= 1.0  # step 2: the probe fitted after step 1
    assert rows[1]["poise/buffer_rows"] == 8.0  # 2 prompts x 2 rollouts per step
    assert all(math.isfinite(r["adv/mean"]) for r in rows)
