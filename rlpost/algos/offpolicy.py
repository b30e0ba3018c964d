"""Off-policy handling for stale (asynchronous) and partial rollouts: pure tensor functions.

Three policies meet in asynchronous RL:

* the **behaviour** policy ``pi_behav`` that sampled the tokens: the rollout
  engine's log-probs (``batch.rollout_logprobs``), possibly several versions
  old, and for partial rollouts stitched from several versions;
* the **proximal** policy ``pi_prox`` anchoring the trust region: the trainer's
  weights at the start of the step (``old_logprobs``);
* the **current** policy ``pi_theta`` being optimized.

Decoupled PPO ("Batch size-invariance for policy optimization", Hilton, Cobbe,
Schulman, arXiv:2110.00641; used for asynchronous LLM RL by AReaL,
arXiv:2505.24298) corrects with ``pi_prox / pi_behav`` and clips
``pi_theta / pi_prox``. A-3PO (arXiv:2512.06547) replaces the
forward pass that computes ``pi_prox`` by a version interpolation. VCPO
("Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs",
arXiv:2602.17616) damps the learning rate when the effective
sample size of the importance weights collapses and uses a minimum-variance
baseline. Cross-stage importance sampling for partial rollouts (CoPRIS,
arXiv:2511.05589; APRIL, arXiv:2509.18521) needs nothing more than the stitched behaviour
log-probs these functions already take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from rlpost.algos.losses import PolicyLossInput, ppo_clip_loss
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.utils import group_ids, masked_mean
from rlpost.core.registry import param


@dataclass(frozen=True)
class DecoupledPPOParams:
    """Decoupled PPO: PPO's clip range against the proximal policy plus AReaL's behaviour-weight cap."""

    eps_low: float = param(0.2, "lower clip of pi_theta / pi_prox (PPO: 0.2)")
    eps_high: float = param(0.2, "upper clip of pi_theta / pi_prox (PPO: 0.2)")
    dual_clip: Optional[float] = param(None, "dual-clip constant c > 1 for A < 0 tokens, or null (off)")
    behav_cap: Optional[float] = param(5.0, "cap of the behaviour weight pi_prox / pi_behav (AReaL caps it; paper: none), null = uncapped")


@POLICY_LOSSES.register(
    "decoupled_ppo",
    paper="Batch size-invariance for policy optimization (decoupled PPO, arXiv:2110.00641); "
    "AReaL: asynchronous RL for LLM reasoning (arXiv:2505.24298)",
    description="PPO clipped against the proximal policy, weighted by pi_prox / pi_behav (capped)",
    params=DecoupledPPOParams,
)
def decoupled_ppo_loss(
    inp: PolicyLossInput,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: Optional[float],
    behav_cap: Optional[float],
) -> Tuple[torch.Tensor, dict]:
    """Decoupled PPO loss per token ``[B, R]``.

    ``loss_t = w_t * ppo_clip(r_t, A_t)`` with ``r_t = pi_theta / pi_prox``
    (``inp.logprobs - inp.old_logprobs``) and the behaviour weight
    ``w_t = pi_prox / pi_behav`` (``inp.old_logprobs - inp.rollout_logprobs``),
    detached. ``behav_cap`` truncates ``w_t`` (the paper's weight is uncapped;
    AReaL caps it, and so do we by default: 5, set null for none). Tokens with
    no ``rollout_logprobs`` fall back to plain PPO (``w = 1``).

    Metrics: the PPO metrics plus ``behav_weight_mean``, ``behav_weight_max``,
    ``behav_capped_frac``.

    Raises:
        ValueError: ``behav_cap <= 0``.
    """
    loss, metrics = ppo_clip_loss(inp, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    if inp.rollout_logprobs is None:
        return loss, metrics
    if behav_cap is not None and behav_cap <= 0:
        raise ValueError(f"decoupled_ppo behav_cap must be > 0 or null, got {behav_cap}")
    m = inp.response_mask
    with torch.no_grad():
        raw = torch.exp((inp.old_logprobs.float() - inp.rollout_logprobs.float()).clamp(-20, 20))
        w = raw if behav_cap is None else raw.clamp(max=behav_cap)
        big = torch.where(m > 0, w, torch.zeros_like(w))
        metrics.update(
            behav_weight_mean=masked_mean(w, m),
            behav_weight_max=big.max() if big.numel() else torch.tensor(0.0),
            behav_capped_frac=masked_mean((raw > w).float(), m),
        )
    return loss * w.detach(), metrics


def a3po_proximal_logprobs(
    behav_logprobs: torch.Tensor,
    current_logprobs: torch.Tensor,
    behav_version: torch.Tensor,
    proximal_version: int,
    current_version: int,
) -> torch.Tensor:
    """A-3PO's interpolated proximal log-probs (arXiv:2512.06547).

    ``log pi_prox ~= log pi_behav + alpha (log pi_theta - log pi_behav)`` with the
    staleness-aware coefficient ``alpha = (v_prox - v_behav) / (v_theta - v_behav)``
    per sequence, clipped to [0, 1]; where ``v_theta == v_behav`` (fresh data,
    first update) ``alpha = 1`` and the proximal policy is the current one.
    This is the "log-linear" rule of AReaL's implementation. The paper leaves
    partial rollouts open; given per-token versions (``[B, R]``, as stitched
    partial rollouts carry them, CoPRIS cross-stage IS) ``alpha`` is taken per
    token from the version that sampled it, which is our extension; given
    ``[B]`` it is per sequence.

    Args:
        behav_logprobs: ``[B, R]`` rollout-engine log-probs (nats).
        current_logprobs: ``[B, R]`` log-probs of the current policy (detached
            here; no gradient flows into the proximal anchor).
        behav_version: ``[B]`` policy version that generated each sequence, or
            ``[B, R]`` the version of each token (padding values are unused).
        proximal_version: trainer version at the start of this step.
        current_version: trainer version now (>= proximal_version).
    Returns:
        ``[B, R]`` proximal log-probs (no grad).
    Raises:
        ValueError: ``current_version < proximal_version``.
    """
    if current_version < proximal_version:
        raise ValueError(f"current_version {current_version} < proximal_version {proximal_version}")
    vb = behav_version.to(behav_logprobs.device).float()
    if vb.dim() == 1:
        vb = vb[:, None]
    span = float(current_version) - vb
    alpha = torch.where(span > 0, (float(proximal_version) - vb) / span.clamp(min=1e-9), torch.ones_like(span))
    alpha = alpha.clamp(0.0, 1.0)
    b = behav_logprobs.detach().float()
    return (b + alpha * (current_logprobs.detach().float() - b)).detach()


def vcpo_lr_scale(ess_frac: float, power: float = 1.0, min_scale: float = 0.1) -> float:
    """VCPO's learning-rate multiplier from the effective sample size (arXiv:2602.17616).

    ``scale = clip(ess_frac ** power, min_scale, 1)`` where ``ess_frac`` in (0, 1]
    is the Kish ESS of the batch's importance weights divided by the token
    count. The paper scales the learning rate "with ESS"; the exact rule is not
    in the abstract, and this monotone power rule with a floor (defaults:
    linear, floor 0.1) is our choice. On-policy batches (all weights 1) give 1,
    so synchronous training is unchanged.

    Raises:
        ValueError: ``power <= 0`` or ``min_scale`` not in (0, 1].
    """
    if power <= 0 or not (0.0 < min_scale <= 1.0):
        raise ValueError(f"vcpo needs power > 0 and 0 < min_scale <= 1, got {power}, {min_scale}")
    e = min(1.0, max(0.0, float(ess_frac)))
    return float(min(1.0, max(min_scale, e**power)))


def sequence_log_weights(num_logprobs: torch.Tensor, den_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64 log sequence importance weights ``sum_t mask_t (log pi_num - log pi_den)``.

    For VCPO's off-policy baseline (arXiv:2602.17616) ``pi_num`` is the proximal
    (pre-update trainer) policy and ``pi_den`` the behaviour policy whose
    log-probs the rollout engine recorded (per token, so stitched partial
    rollouts give each token its own sampling policy; CoPRIS cross-stage IS).

    Args:
        num_logprobs, den_logprobs: ``[B, R]`` log-probs (nats) of the same tokens.
        mask: ``[B, R]`` 0/1 response mask; padding contributes nothing.

    Raises:
        ValueError: shape mismatch.
    """
    if num_logprobs.shape != den_logprobs.shape or num_logprobs.shape != mask.shape:
        raise ValueError(f"shapes differ: {tuple(num_logprobs.shape)}, {tuple(den_logprobs.shape)}, {tuple(mask.shape)}")
    return ((num_logprobs.double() - den_logprobs.double()) * mask.double()).sum(-1)


def group_normalized_weights(log_weights: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64 ``exp(log_w_i - max_{j in g(i)} log_w_j)``: weights in (0, 1], 1 for each group's largest.

    Every group-wise ratio of weights (all the minimum-variance baseline reads)
    is kept, and products of many token ratios cannot overflow. Equal log
    weights (on-policy: all 0) give exactly 1. VCPO (arXiv:2602.17616) helper.

    Args:
        log_weights: ``[B]`` log importance weights (nats).
        group_index: ``[B]`` long group ids (any integers).
    Raises nothing.
    """
    inv, G = group_ids(group_index)
    lw = log_weights.double()
    top = torch.full((G,), -torch.inf, dtype=torch.float64).scatter_reduce_(0, inv, lw, reduce="amax")
    return torch.exp(lw - top[inv])


def min_variance_baseline(
    rewards: torch.Tensor,
    seq_weights: torch.Tensor,
    group_index: torch.Tensor,
    score_sq: Optional[torch.Tensor] = None,
    leave_one_out: bool = False,
) -> torch.Tensor:
    """Per-group minimum-variance baseline of the importance-weighted policy gradient (VCPO, arXiv:2602.17616).

    For the off-policy gradient ``g = w (R - b) grad log pi`` the constant
    baseline that minimises its variance is
    ``b* = E[w^2 |grad log pi|^2 R] / E[w^2 |grad log pi|^2]``. VCPO applies a
    closed form of this kind; its exact estimator of the score norms is not in
    the abstract, so ours is documented here: ``|grad log pi|^2`` is taken
    equal across a group (``score_sq=None``, no extra backward pass), or
    proportional to ``score_sq`` (e.g. the response length, OPO's proxy,
    arXiv:2505.23585), giving over each group

        ``b = sum_i c_i R_i / sum_i c_i``,  ``c_i = w_i^2 * score_sq_i``.

    With equal weights and equal norms it is exactly the group mean (GRPO's
    baseline; computed in float64 like :func:`rlpost.algos.utils.group_stats`,
    so the two agree bit for bit). ``leave_one_out`` excludes sample ``i`` from
    its own baseline (RLOO's form): ``b_i = sum_{j != i} c_j R_j / sum_{j != i} c_j``.
    Where the denominator is 0 (all ``c`` zero, or a group of one under
    leave-one-out) the plain (leave-one-out) mean is used, and a lone sample's
    leave-one-out baseline is its own reward.

    Args:
        rewards: ``[B]`` sequence rewards.
        seq_weights: ``[B]`` sequence importance weights ``pi / pi_behav`` (>= 0);
            only ratios within a group matter (see :func:`group_normalized_weights`).
        group_index: ``[B]`` long group id (any integers).
        score_sq: ``[B]`` >= 0 proxy of each sample's squared score norm, or None (equal).
        leave_one_out: baseline of the other members only.
    Returns:
        ``[B]`` baseline of each sequence, in ``rewards.dtype``.
    Raises nothing.
    """
    inv, G = group_ids(group_index)
    r = rewards.double()
    c = seq_weights.double().pow(2)
    if score_sq is not None:
        c = c * score_sq.double()
    cnt = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, torch.ones_like(r))
    tot = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, r)
    num = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, c * r)
    den = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, c)
    if not leave_one_out:
        b = torch.where(den[inv] > 0, num[inv] / den[inv].clamp(min=1e-300), (tot / cnt)[inv])
        return b.to(rewards.dtype)
    n_i, d_i = num[inv] - c * r, den[inv] - c
    loo_mean = torch.where(cnt[inv] > 1, (tot[inv] - r) / (cnt[inv] - 1).clamp(min=1), r)
    ok = (d_i > 1e-12 * den[inv]) & (cnt[inv] > 1)
    return torch.where(ok, n_i / d_i.clamp(min=1e-300), loo_mean).to(rewards.dtype)
