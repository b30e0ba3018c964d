"""Importance-sampling corrections against rollout log-probs: bounds and values."""

import math

import pytest
import torch

from rlpost.algos.corrections import CORRECTIONS, cis_cap, compute_correction, ess


def lp_pair(ratios, q):
    """old/rollout log-probs with pi_rollout = q and pi_old / pi_rollout = ratio."""
    q = torch.tensor(q, dtype=torch.float32)
    r = torch.tensor(ratios, dtype=torch.float32)
    return torch.log(q * r), torch.log(q)


def test_tis_truncates_at_cap():
    old, roll = lp_pair([[0.5, 1.0, 3.0, 10.0]], [[0.1, 0.1, 0.1, 0.05]])
    w, m = compute_correction("tis", old, roll, torch.ones(1, 4), cap=2.0)
    assert torch.allclose(w, torch.tensor([[0.5, 1.0, 2.0, 2.0]]), atol=1e-5)
    assert torch.isclose(m["frac_modified"], torch.tensor(0.5))
    assert not w.requires_grad


def test_mis_masks_outside_band():
    old, roll = lp_pair([[0.3, 0.8, 1.5, 2.5]], [[0.2] * 4])
    w, m = compute_correction("mis", old, roll, torch.ones(1, 4), lo=0.5, hi=2.0)
    assert torch.allclose(w, torch.tensor([[0.0, 0.8, 1.5, 0.0]]), atol=1e-5)
    assert torch.isclose(m["frac_masked"], torch.tensor(0.5))


def test_cis_cap_tightens_with_confidence():
    d = math.log(2.0)
    caps = cis_cap(torch.log(torch.tensor([1e-6, 0.5, 0.9, 0.999999])), d)
    assert torch.isclose(caps[0], torch.tensor(2.0), atol=1e-4)
    assert torch.isclose(caps[1], torch.tensor(2 / 1.5))  # e^d / (1 - q + q e^d) = 2 / 1.5
    assert torch.all(caps[1:] < caps[:-1]) and torch.isclose(caps[3], torch.tensor(1.0), atol=1e-4)
    # a confident token (q = 0.9) is capped near 1, an unlikely one (q = 0.01) near 2; small weights untouched
    old, roll = lp_pair([[1.1, 1.9, 0.3]], [[0.9, 0.01, 0.5]])
    w, _ = compute_correction("cis", old, roll, torch.ones(1, 3), threshold=d)
    assert torch.isclose(w[0, 0], torch.tensor(2 / (0.1 + 1.8)), atol=1e-5)
    assert torch.isclose(w[0, 1], torch.tensor(1.9), atol=1e-5)
    assert torch.isclose(w[0, 2], torch.tensor(0.3), atol=1e-5)
    # the trainer probability implied by the capped weight never exceeds sigmoid(logit(q) + d)
    q = 0.9
    assert float(w[0, 0]) * q <= 1 / (1 + math.exp(-(math.log(q / (1 - q)) + d))) + 1e-6


def test_ais_interpolates_between_uncorrected_and_weighted():
    # no mismatch -> lambda = 0 -> weights exactly 1
    lp = torch.log(torch.full((2, 3), 0.3))
    w, m = compute_correction("ais", lp, lp, torch.ones(2, 3))
    assert torch.allclose(w, torch.ones(2, 3)) and float(m["ais_lambda"]) == 0.0
    # strong mismatch -> lambda in (0, 1], weights within [1 - lambda, 1 - lambda + lambda cap]
    torch.manual_seed(0)
    roll = torch.log(torch.rand(4, 8) * 0.5 + 0.25)
    old = roll + 0.5 * torch.randn(4, 8)
    w, m = compute_correction("ais", old, roll, torch.ones(4, 8), cap=2.0, kl_scale=0.01)
    lam = float(m["ais_lambda"])
    assert 0.0 < lam <= 1.0
    assert float(w.min()) >= 1 - lam - 1e-6 and float(w.max()) <= 1 - lam + 2 * lam + 1e-6
    tis, _ = compute_correction("tis", old, roll, torch.ones(4, 8), cap=2.0)
    assert torch.allclose(w, (1 - lam) + lam * tis, atol=1e-5)


@pytest.mark.parametrize("name", CORRECTIONS.names())
def test_weights_zero_outside_mask_and_bounded(name):
    torch.manual_seed(1)
    roll = torch.log(torch.rand(3, 5) * 0.9 + 0.05)
    old = roll + torch.randn(3, 5)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [0.0] * 5])
    w, m = compute_correction(name, old, roll, mask)
    assert torch.all(w[mask == 0] == 0) and torch.all(w >= 0) and torch.isfinite(w).all()
    assert float(w.max()) <= 2.0 + 1e-5  # every default cap is 2 (none: 1)
    assert 0.0 <= float(m["ess_frac"]) <= 1.0


def test_ess():
    e, f = ess(torch.ones(2, 2), torch.ones(2, 2))
    assert float(e) == 4.0 and float(f) == 1.0
    e, f = ess(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), torch.ones(1, 4))
    assert float(e) == 1.0 and float(f) == 0.25


def test_invalid_params_raise():
    lp = torch.zeros(1, 1)
    with pytest.raises(ValueError):
        compute_correction("mis", lp, lp, torch.ones(1, 1), lo=1.5, hi=2.0)
    with pytest.raises(ValueError):
        compute_correction("tis", lp, lp, torch.ones(1, 1), cap=0.0)
