"""Issue 29: objectives against the authors' released code, on random fp64 tensors with padding,
both clip sides binding and zero-variance groups. Each reference is a port of the formula (no code
copied), citing the file and lines it follows."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algos.corrections import compute_correction
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from rlpost.algos.regularizers import kl_k3

D = torch.float64


def _batch(seed=0, B=6, R=9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, R, generator=g, dtype=D) * 3.0
    lp = old + torch.randn(B, R, generator=g, dtype=D) * 0.4  # ratios well outside [0.8, 1.2] on both sides
    A = (torch.randn(B, 1, generator=g, dtype=D) * 2.0).expand(B, R).clone()
    A[0] = 0.0  # a zero-variance group: advantage 0 on its row
    mask = torch.ones(B, R, dtype=D)
    for i in range(B):
        mask[i, R - (i % 4):] = 0.0  # ragged padding
    r = torch.exp(lp - old)
    assert bool(((r > 1.2) & (A > 0) & (mask > 0)).any()) and bool(((r < 0.8) & (A < 0) & (mask > 0)).any())
    return old, lp, A, mask


def _mmean(x, m):
    return (x * m).sum() / m.sum()


def _grad(name, old, lp, A, mask, **p):
    x = PolicyLossInput(logprobs=lp.clone().requires_grad_(True), old_logprobs=old, advantages=A, response_mask=mask, seed=0)
    loss, met = compute_policy_loss(name, x, **p)
    (loss * mask).sum().backward()
    return loss.detach(), x.logprobs.grad, met


def _port_clip_cov(old, lp, A, mask, eps, clip_ratio, lb, ub):
    """PRIME-RL/Entropy-Mechanism-of-RL @8850579, verl/trainer/ppo/core_algos.py lines 469-518
    (compute_policy_loss_clip_cov), with every candidate selected (clip_num >= candidates)."""
    lp = lp.clone().requires_grad_(True)
    ratio = torch.exp(lp - old)
    l1, l2 = -A * ratio, -A * ratio.clamp(1 - eps, 1 + eps)
    clip_by_origin = (l2 > l1) & (mask > 0)  # line 495
    cov = (A - _mmean(A, mask)) * (lp.detach() - _mmean(lp.detach(), mask))
    cov = cov.masked_fill(mask == 0, -math.inf).masked_fill(clip_by_origin, -math.inf)  # line 499
    n_sel = max(int(clip_ratio * mask.sum().item()), 1)  # line 501
    cand = (cov < ub) & (cov > lb) & (mask > 0)  # line 502: strict bounds
    assert n_sel >= int(cand.sum())
    corr = torch.where(cand, torch.zeros_like(A), torch.ones_like(A))
    loss = torch.maximum(l1, l2) * corr  # line 515: selected tokens' loss is 0
    (loss * mask).sum().backward()
    return loss.detach(), lp.grad, cand


def test_clip_cov_matches_the_authors_release():
    old, lp, A, mask = _batch()
    ref_loss, ref_g, cand = _port_clip_cov(old, lp, A, mask, 0.2, 0.5, 0.05, 5.0)
    assert 0 < int(cand.sum()) < int(mask.sum())  # some tokens selected, some PPO-clipped, some plain
    loss, g, met = _grad("clip_cov", old, lp, A, mask, clip_cov_ratio=0.5, cov_lb=0.05, cov_ub=5.0, eps_low=0.2, eps_high=0.2)
    assert torch.allclose(loss * mask, ref_loss * mask, atol=1e-12, rtol=0)
    assert torch.allclose(g, ref_g, atol=1e-12, rtol=0)
    assert float(met["clip_frac"]) == pytest.approx(float(cand.sum() / mask.sum()))


def _port_kl_cov(old, lp, A, mask, k_percent, coef):
    """PRIME-RL/Entropy-Mechanism-of-RL @8850579, verl/trainer/ppo/core_algos.py lines 426-466
    (compute_policy_loss_kl_cov): k_percent is a percentage; int() at line 458."""
    lp = lp.clone().requires_grad_(True)
    nk = lp - old
    ratio = torch.exp(nk)
    base = -A * ratio
    pen = -A * ratio + coef * nk.abs()
    valid = mask > 0
    a, l = A[valid].detach(), lp[valid].detach()
    cov = (a - a.mean()) * (l - l.mean())  # line 457
    k = max(1, int(len(cov) * k_percent / 100))  # line 458
    idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0][torch.topk(cov, k).indices]
    sel = torch.zeros(A.numel(), dtype=torch.bool)
    sel[idx] = True
    loss = torch.where(sel.view_as(A), pen, base)
    (loss * mask).sum().backward()
    return loss.detach(), lp.grad, k


def test_kl_cov_counts_with_int_as_the_release():
    old, lp, A, mask = _batch(1)
    n = int(mask.sum())  # 45 tokens; ratio * N = 3.7 -> int 3 (round gave 4)
    ratio = 3.7 / n
    ref_loss, ref_g, k = _port_kl_cov(old, lp, A, mask, ratio * 100, 1.0)
    assert k == 3
    loss, g, met = _grad("kl_cov", old, lp, A, mask, kl_cov_ratio=ratio, kl_coef=1.0)
    assert torch.allclose(loss * mask, ref_loss * mask, atol=1e-12, rtol=0)
    assert torch.allclose(g, ref_g, atol=1e-12, rtol=0)
    assert round(float(met["clip_frac"]) * n) == 3


@pytest.mark.parametrize("name,params", [("tis", {"cap": 2.0}), ("mis", {"lo": 0.5, "hi": 2.0})])
def test_tis_and_mis_weights_are_computed_in_the_inputs_precision(name, params):
    old, lp, _, mask = _batch(2)
    rollout = old - (lp - old) * 0.5
    w, _ = compute_correction(name, old, rollout, mask, **params)
    assert w.dtype == D
    ratio = torch.exp(old - rollout)  # the formula in fp64
    if name == "tis":
        ref = ratio.clamp(max=2.0) * mask
    else:
        ref = torch.where((ratio >= 0.5) & (ratio <= 2.0), ratio, torch.zeros_like(ratio)) * mask
    assert torch.allclose(w, ref, atol=1e-15, rtol=1e-15)  # was a float32 cast: 2.6e-7 relative


def _port_rollout_is(old, rollout, mask, level, hi, lo, mode):
    """verl rollout correction (verl/trainer/ppo/mismatch_helper.py, compute_rollout_importance_weights):
    log-ratio summed (sequence) or averaged (geometric) over the row's tokens, clamped to +-20
    (SAFETY_BOUND), exponentiated, broadcast; then truncated at the threshold or masked outside [lo, hi]."""
    lr = (old - rollout) * mask
    s = lr.sum(-1, keepdim=True)
    if level == "geometric":
        s = s / mask.sum(-1, keepdim=True).clamp(min=1)
    w = torch.exp(s.clamp(-20, 20)).expand_as(old)
    w = w.clamp(max=hi) if mode == "truncate" else torch.where((w >= lo) & (w <= hi), w, torch.zeros_like(w))
    return w * mask


@pytest.mark.parametrize("name,level", [("seq_is", "sequence"), ("geo_is", "geometric")])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_sequence_and_geometric_is_match_verls_rollout_is(name, level, mode):
    old, lp, _, mask = _batch(3)
    s = 1.2 if level == "geometric" else 0.15  # per-token offset: row weights on both sides of the band
    rollout = old - torch.linspace(-s, s, old.shape[0], dtype=D)[:, None] - (lp - old) * 0.01
    w, m = compute_correction(name, old, rollout, mask, mode=mode, hi=2.0, lo=0.5)
    ref = _port_rollout_is(old, rollout, mask, level, 2.0, 0.5, mode)
    assert w.dtype == D and torch.allclose(w, ref, atol=1e-15, rtol=1e-13)
    rows = w.clone()
    rows[mask == 0] = float("nan")
    for i in range(w.shape[0]):  # one weight per row
        vals = rows[i][mask[i] > 0]
        assert bool((vals == vals[0]).all())
    assert 0.0 < float(m["frac_modified_seqs"]) < 1.0  # some rows truncated / masked, some kept
    with pytest.raises(ValueError, match="valid modes"):
        compute_correction(name, old, rollout, mask, mode="clip", hi=2.0, lo=0.5)


def test_a_misspelt_sequence_is_parameter_is_an_error():
    from rlpost.core.errors import ConfigError

    old, lp, _, mask = _batch(3)
    with pytest.raises(ConfigError, match="hi"):
        compute_correction("seq_is", old, old, mask, high=2.0)


def test_k3_unclamped_by_default_and_verls_clamp_as_an_option():
    lp = torch.tensor([[0.0, -15.0]], dtype=D)
    ref = torch.tensor([[-15.0, 0.0]], dtype=D)  # log r = -15 and +15
    k = kl_k3(lp, ref)
    assert torch.allclose(k, torch.tensor([[math.exp(-15) - 1 + 15, math.exp(15) - 1 - 15]], dtype=D))
    assert torch.allclose(kl_k3(lp, ref, value_clamp=10.0), torch.tensor([[10.0, 10.0]], dtype=D))
    with pytest.raises(ValueError, match="value_clamp"):
        kl_k3(lp, ref, value_clamp=0.0)
