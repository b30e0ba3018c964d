"""Importance-sampling corrections against the rollout engine's log-probs.

The rollout engine (vLLM, a quantized or bf16 copy, a stale policy) samples from
``pi_rollout``; the trainer's log-probs of the same tokens are ``pi_old`` (the
trainer's weights at rollout time). The per-token weight
``w_t = pi_old(y_t) / pi_rollout(y_t)`` corrects the policy gradient for the
mismatch; these functions bound or reshape it. The trainer multiplies the
per-token loss by the returned weights (no gradient flows through them).

Calling convention (registry :data:`CORRECTIONS`, config key
``precision.correction``, params ``precision.correction_params``)::

    fn(old_logprobs [B, R], rollout_logprobs [B, R], response_mask [B, R], *, <params>)
        -> (weights [B, R] detached, 0 outside the mask; metrics: dict of 0-d tensors)

Each correction's ``<params>`` are declared once, by the frozen dataclass
registered with it (``params=``, one doc line per field; :mod:`rlpost.core.registry`),
so ``precision.correction_params`` with a key the correction does not declare
is a config error.

Every correction reports ``is_ratio_mean``, ``is_ratio_max``, ``ess_frac``
(normalised effective sample size of the raw weights) and ``frac_modified``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from rlpost.algos.utils import masked_mean
from rlpost.core.registry import Registry, param

CORRECTIONS = Registry("importance-sampling correction", "precision.correction", typed_params=True)

Metrics = Dict[str, torch.Tensor]


def ess(weights: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Effective sample size of importance weights over masked tokens.

    ``ESS = (sum w)^2 / sum w^2`` (Kish), in ``[1, n]`` for ``n`` tokens with
    positive weights; ``ess_frac = ESS / n`` in ``(0, 1]`` is 1 when all weights
    are equal. Returns ``(ESS, ess_frac)`` as 0-d tensors (0, 0 for an empty
    mask or all-zero weights).
    """
    with torch.no_grad():
        w = weights.float() * mask
        n = mask.sum()
        s1 = w.sum()
        s2 = (w * w).sum()
        if n <= 0 or s2 <= 0:
            z = torch.zeros((), dtype=torch.float32)
            return z, z
        e = s1 * s1 / s2
        return e, e / n


def _work_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """The inputs' precision: their promoted dtype, at least float32 (fp64 log-probs stay fp64)."""
    return torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)


def _raw_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, clamp: float = 20.0) -> torch.Tensor:
    """``exp(clamp(old - rollout, -20, 20))`` per token in the inputs' precision (:func:`_work_dtype`;
    no float32 cast: fp64 inputs give fp64 weights, as verl's fp64-capable path)."""
    dt = _work_dtype(old_logprobs, rollout_logprobs)
    return torch.exp((old_logprobs.detach().to(dt) - rollout_logprobs.detach().to(dt)).clamp(-clamp, clamp))


def _base_metrics(ratio: torch.Tensor, w: torch.Tensor, mask: torch.Tensor) -> Metrics:
    with torch.no_grad():
        _, ef = ess(ratio, mask)
        big = torch.where(mask > 0, ratio, torch.zeros_like(ratio))
        return {
            "is_ratio_mean": masked_mean(ratio, mask),
            "is_ratio_max": big.max() if big.numel() else torch.tensor(0.0),
            "ess_frac": ef,
            "frac_modified": masked_mean(((w - ratio).abs() > 1e-6).float(), mask),
            "weight_mean": masked_mean(w, mask),
        }


@CORRECTIONS.register(
    "none",
    paper="",
    description="no correction: every weight is 1",
)
def no_correction(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> Tuple[torch.Tensor, Metrics]:
    """Weights 1 on the mask (and 0 outside); metrics still describe the mismatch."""
    ratio = _raw_ratio(old_logprobs, rollout_logprobs)
    w = response_mask.float().clone()
    m = _base_metrics(ratio, w, response_mask)
    m["frac_modified"] = torch.zeros(())
    return w, m


@dataclass(frozen=True)
class TISParams:
    """Truncated IS cap (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training": C = 2)."""

    cap: float = param(2.0, "weight cap C > 0: w = min(pi_old / pi_rollout, C) (the authors' setting: 2)")


@CORRECTIONS.register(
    "tis",
    paper="Your Efficient RL Framework Secretly Brings You Off-Policy RL Training (truncated IS, Yao et al. 2025, fengyao.notion.site/off-policy-rl); "
    "FP8-RL: A Practical and Stable Low-Precision Stack for LLM Reinforcement Learning (arXiv:2601.18150)",
    params=TISParams,
)
def tis(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cap: float,
) -> Tuple[torch.Tensor, Metrics]:
    """Token-level truncated importance sampling: ``w_t = min(pi_old / pi_rollout, C)``.

    Bounded in ``[0, C]``; biased for tokens above the cap, but with bounded
    variance. ``C = 2`` is the usual setting.

    Raises:
        ValueError: ``cap <= 0``.
    """
    if cap <= 0:
        raise ValueError(f"tis cap must be > 0, got {cap}")
    ratio = _raw_ratio(old_logprobs, rollout_logprobs)
    w = ratio.clamp(max=cap) * response_mask
    return w.detach(), _base_metrics(ratio, w, response_mask)


@dataclass(frozen=True)
class MISParams:
    """Masked IS band: tokens whose ratio leaves [lo, hi] are dropped."""

    lo: float = param(0.5, "lowest kept ratio, 0 <= lo < 1 (our choice: 0.5)")
    hi: float = param(2.0, "highest kept ratio, > 1 (TIS's usual cap: 2)")


@CORRECTIONS.register(
    "mis",
    paper="When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch (token-level MIS; Liu, Li et al., 2025, yingru.notion.site); FP8-RL (arXiv:2601.18150)",
    params=MISParams,
)
def mis(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    lo: float,
    hi: float,
) -> Tuple[torch.Tensor, Metrics]:
    """Masked importance sampling: keep ``w_t = pi_old / pi_rollout`` inside ``[lo, hi]``, drop the token otherwise.

    Weights are in ``{0} U [lo, hi]``: a token whose ratio is outside the band
    is excluded from the gradient rather than truncated. Metric
    ``frac_masked``.

    Raises:
        ValueError: not ``0 <= lo < 1 < hi``.
    """
    if not (0.0 <= lo < 1.0 < hi):
        raise ValueError(f"mis needs 0 <= lo < 1 < hi, got lo={lo}, hi={hi}")
    ratio = _raw_ratio(old_logprobs, rollout_logprobs)
    inside = (ratio >= lo) & (ratio <= hi)
    w = torch.where(inside, ratio, torch.zeros_like(ratio)) * response_mask
    m = _base_metrics(ratio, w, response_mask)
    m["frac_masked"] = masked_mean((~inside).float(), response_mask)
    return w.detach(), m


@dataclass(frozen=True)
class SequenceISParams:
    """Sequence-level IS weights (verl's ``rollout_is`` levels ``sequence`` / ``geometric``: threshold 2, lower 1/2)."""

    mode: str = param("truncate", "truncate: w = min(w_seq, hi); mask: w = w_seq inside [lo, hi], else 0 (verl's rollout_is_mode)")
    hi: float = param(2.0, "upper threshold > 1 (verl's rollout_is_threshold: 2)")
    lo: float = param(0.5, "lower threshold in [0, 1) for mode=mask (verl default: the reciprocal of hi)")


def _sequence_weights(log_w: torch.Tensor, response_mask: torch.Tensor, ratio: torch.Tensor, mode: str, hi: float,
                      lo: float, name: str) -> Tuple[torch.Tensor, Metrics]:
    if mode not in ("truncate", "mask"):
        raise ValueError(f"{name} mode={mode!r}: valid modes are truncate, mask")
    if not (0.0 <= lo < 1.0 < hi):
        raise ValueError(f"{name} needs 0 <= lo < 1 < hi, got lo={lo}, hi={hi}")
    seq = torch.exp(log_w.clamp(-20.0, 20.0))  # [B, 1]
    if mode == "truncate":
        ws = seq.clamp(max=hi)
    else:
        ws = torch.where((seq >= lo) & (seq <= hi), seq, torch.zeros_like(seq))
    w = ws.expand_as(ratio) * response_mask
    m = _base_metrics(ratio, w, response_mask)
    rows = response_mask.sum(-1) > 0
    m["seq_weight_mean"] = seq[rows].mean() if bool(rows.any()) else torch.zeros((), dtype=seq.dtype)
    m["frac_modified_seqs"] = ((ws != seq)[rows].to(seq.dtype).mean() if bool(rows.any())
                               else torch.zeros((), dtype=seq.dtype))
    return w.detach(), m


@CORRECTIONS.register(
    "seq_is",
    paper="verl rollout correction, rollout_is=sequence (Policy Optimization for LLMs under train-inference mismatch; "
    "Liu, Li et al. 2025, yingru.notion.site); sequence-level IS as in GSPO (arXiv:2507.18071)",
    params=SequenceISParams,
)
def seq_is(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    mode: str,
    hi: float,
    lo: float,
) -> Tuple[torch.Tensor, Metrics]:
    """Sequence-level IS: one weight per row, ``w = prod_t pi_old / pi_rollout = exp(sum_t log ratio)``
    (the log clamped to ``[-20, 20]`` as verl), truncated at ``hi`` or masked outside ``[lo, hi]``,
    broadcast to the row's tokens. Shapes: ``[B, R]`` in, ``[B, R]`` weights (0 outside the mask).
    In the inputs' precision.

    Raises:
        ValueError: unknown ``mode``, or not ``0 <= lo < 1 < hi``.
    """
    dt = _work_dtype(old_logprobs, rollout_logprobs)
    mask = response_mask.to(dt)
    lr = (old_logprobs.detach().to(dt) - rollout_logprobs.detach().to(dt)) * mask
    return _sequence_weights(lr.sum(-1, keepdim=True), response_mask, _raw_ratio(old_logprobs, rollout_logprobs),
                             mode, hi, lo, "seq_is")


@CORRECTIONS.register(
    "geo_is",
    paper="verl rollout correction, rollout_is=geometric (geometric-mean IS; Liu, Li et al. 2025, yingru.notion.site); "
    "GMPO (arXiv:2507.20673)",
    params=SequenceISParams,
)
def geo_is(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    mode: str,
    hi: float,
    lo: float,
) -> Tuple[torch.Tensor, Metrics]:
    """Geometric-mean IS: one weight per row, ``w = exp(mean_t log(pi_old / pi_rollout))`` over the
    row's response tokens (a row without tokens gets log-weight 0), then as :func:`seq_is`. Shapes:
    ``[B, R]`` in and out. In the inputs' precision.

    Raises:
        ValueError: unknown ``mode``, or not ``0 <= lo < 1 < hi``.
    """
    dt = _work_dtype(old_logprobs, rollout_logprobs)
    mask = response_mask.to(dt)
    lr = (old_logprobs.detach().to(dt) - rollout_logprobs.detach().to(dt)) * mask
    mean = lr.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return _sequence_weights(mean, response_mask, _raw_ratio(old_logprobs, rollout_logprobs), mode, hi, lo, "geo_is")


def cis_cap(rollout_logprobs: torch.Tensor, threshold: float) -> torch.Tensor:
    """CIS's confidence-dependent ratio cap ``C(q) = e^delta / (1 - q + q e^delta)``.

    With ``q = pi_rollout(y_t)`` and log-odds displacement
    ``eps_t = logit(pi_old) - logit(q)`` truncated at ``delta``, the largest
    admissible trainer probability is ``sigmoid(logit(q) + delta)``; divided by
    ``q`` this is ``C(q)``. It tends to ``e^delta`` for unlikely tokens
    (``q -> 0``) and to 1 for confident ones (``q -> 1``): the cap tightens as
    confidence rises. Shape as ``rollout_logprobs``.
    """
    q = torch.exp(rollout_logprobs.detach().float()).clamp(0.0, 1.0)
    e = math.exp(threshold)
    return e / (1.0 - q + q * e)


@dataclass(frozen=True)
class CISParams:
    """CIS's log-odds truncation threshold; the abstract gives no value: log 2 (our choice)."""

    threshold: float = param(math.log(2.0), "log-odds displacement cap delta > 0; unlikely tokens capped at e^delta (our choice: log 2)")


@CORRECTIONS.register(
    "cis",
    paper="Rethinking Training-Inference Mismatch in LLM Reinforcement Learning: Where It Arises and How to Correct It (CIS, arXiv:2609.32444)",
    params=CISParams,
)
def cis(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    threshold: float,
) -> Tuple[torch.Tensor, Metrics]:
    """Calibrated IS: truncate large positive log-odds displacements at one threshold.

    ``w_t = min(pi_old / pi_rollout, C(pi_rollout))`` with the cap of
    :func:`cis_cap`: bounded by ``e^threshold`` and by 1 as the rollout
    probability approaches 1. Small weights are never raised (the paper finds
    upward clipping hurts). ``threshold = log 2`` (so unlikely tokens are capped
    at 2, like TIS's usual cap) is our choice; the abstract gives no value.

    Raises:
        ValueError: ``threshold <= 0``.
    """
    if threshold <= 0:
        raise ValueError(f"cis threshold must be > 0, got {threshold}")
    ratio = _raw_ratio(old_logprobs, rollout_logprobs)
    cap = cis_cap(rollout_logprobs, threshold)
    w = torch.minimum(ratio, cap) * response_mask
    m = _base_metrics(ratio, w, response_mask)
    m["cap_mean"] = masked_mean(cap, response_mask)
    return w.detach(), m


@dataclass(frozen=True)
class AISParams:
    """AIS's mixing of uncorrected and weighted gradients; the abstract names the diagnostics only: our defaults."""

    cap: float = param(2.0, "truncation of the weights before mixing (TIS's usual 2)")
    kl_scale: float = param(0.01, "KL at which severity s = 1 - 1/e (our choice)")
    lam_min: float = param(0.0, "lower bound of the mixing weight lambda")
    lam_max: float = param(1.0, "upper bound of the mixing weight lambda")


@CORRECTIONS.register(
    "ais",
    paper="AIS: Adaptive Importance Sampling for Quantized RL (arXiv:2605.13907)",
    params=AISParams,
)
def ais(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cap: float,
    kl_scale: float,
    lam_min: float,
    lam_max: float,
) -> Tuple[torch.Tensor, Metrics]:
    """Adaptive IS: per batch, mix the uncorrected and the importance-weighted gradient.

    ``w_t = (1 - lambda) + lambda * min(r_t, cap)`` with one ``lambda`` per call
    built from three diagnostics of the raw ratios ``r_t`` over the mask:

    * divergence severity ``s = 1 - exp(-KL / kl_scale)`` with
      ``KL = mean(r - 1 - log r)`` (k3 estimate of KL(rollout || trainer)): small
      mismatch -> little correction (it acts as exploration noise);
    * weight reliability ``rho = ESS / n`` of the truncated weights: weights
      dominated by a few tokens are trusted less;
    * variance amplification ``v = Var(min(r, cap))``: ``lambda`` is divided by
      ``1 + v``.

    ``lambda = clip(s * rho / (1 + v), lam_min, lam_max)``. The abstract names
    the three diagnostics but not how they combine; this combination and the
    defaults are our choice. Weights lie in ``[1 - lambda, 1 - lambda + lambda cap]``
    within ``[0, cap]``. Metrics add ``ais_lambda``, ``ais_severity``,
    ``ais_reliability``, ``ais_variance``.

    Raises:
        ValueError: ``cap <= 0``, ``kl_scale <= 0`` or not ``0 <= lam_min <= lam_max <= 1``.
    """
    if cap <= 0 or kl_scale <= 0 or not (0.0 <= lam_min <= lam_max <= 1.0):
        raise ValueError(
            f"ais needs cap > 0, kl_scale > 0, 0 <= lam_min <= lam_max <= 1; got {cap}, {kl_scale}, {lam_min}, {lam_max}"
        )
    mask = response_mask.float()
    ratio = _raw_ratio(old_logprobs, rollout_logprobs)
    with torch.no_grad():
        logr = torch.log(ratio.clamp(min=1e-30))
        kl = masked_mean(ratio - 1.0 - logr, mask).clamp(min=0.0)
        sev = 1.0 - torch.exp(-kl / kl_scale)
        wt = ratio.clamp(max=cap)
        _, rel = ess(wt, mask)
        mu = masked_mean(wt, mask)
        var = masked_mean((wt - mu) ** 2, mask)
        lam = (sev * rel / (1.0 + var)).clamp(lam_min, lam_max)
        w = ((1.0 - lam) + lam * wt) * mask
    m = _base_metrics(ratio, w, response_mask)
    m.update(ais_lambda=lam, ais_severity=sev, ais_reliability=rel, ais_variance=var)
    return w.detach(), m


def compute_correction(
    name: str,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    **params: object,
) -> Tuple[torch.Tensor, Metrics]:
    """Run the registered correction ``name``; see the module docstring.

    Raises:
        ConfigError: unknown correction name, or a parameter it does not declare.
        ValueError: invalid parameters of the chosen correction.
    """
    kw = CORRECTIONS.kwargs(name, params, "precision.correction_params")
    return CORRECTIONS.get(name)(old_logprobs, rollout_logprobs, response_mask, **kw)
