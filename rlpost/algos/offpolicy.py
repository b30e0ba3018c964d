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
``pi_theta / pi_prox``. A-3PO (arXiv:2512.06547, seed entry 175) replaces the
forward pass that computes ``pi_prox`` by a version interpolation. VCPO
("Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs",
arXiv:2602.17616, seed entry 170) damps the learning rate when the effective
sample size of the importance weights collapses and uses a minimum-variance
baseline. Cross-stage importance sampling for partial rollouts (CoPRIS, seed
entry 14; APRIL, seed entry 94) needs nothing more than the stitched behaviour
log-probs these functions already take.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from rlpost.algos.losses import PolicyLossInput, ppo_clip_loss
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.utils import masked_mean


@POLICY_LOSSES.register(
    "decoupled_ppo",
    paper="Batch size-invariance for policy optimization (decoupled PPO, arXiv:2110.00641); "
    "AReaL: asynchronous RL for LLM reasoning (arXiv:2505.24298)",
    description="PPO clipped against the proximal policy, weighted by pi_prox / pi_behav (capped)",
)
def decoupled_ppo_loss(
    inp: PolicyLossInput,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: Optional[float] = None,
    behav_cap: Optional[float] = 5.0,
    **_: object,
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
    """A-3PO's interpolated proximal log-probs (arXiv:2512.06547, seed entry 175).

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
    """VCPO's learning-rate multiplier from the effective sample size (arXiv:2602.17616, seed entry 170).

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


def min_variance_baseline(rewards: torch.Tensor, seq_weights: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Per-group minimum-variance baseline of the importance-weighted policy gradient.

    For ``g = w (R - b) grad log pi`` the variance-minimising constant baseline is
    ``b* = E[w^2 |grad|^2 R] / E[w^2 |grad|^2]``; taking the score norms as equal
    (they are not computed, to keep it free) gives ``b = sum w_i^2 R_i / sum w_i^2``
    over each group. With equal weights it is the group mean (GRPO's baseline).
    VCPO (arXiv:2602.17616) derives a closed form of this kind; the equal-norm
    simplification is ours.

    Args:
        rewards: ``[B]`` sequence rewards.
        seq_weights: ``[B]`` sequence importance weights ``pi_theta / pi_behav``
            (>= 0), e.g. the exp of summed token log-ratios.
        group_index: ``[B]`` long group id.
    Returns:
        ``[B]`` baseline of each sequence's group.
    """
    w2 = seq_weights.float().pow(2)
    G = int(group_index.max()) + 1 if group_index.numel() else 0
    num = torch.zeros(G).index_add_(0, group_index, w2 * rewards.float())
    den = torch.zeros(G).index_add_(0, group_index, w2)
    cnt = torch.zeros(G).index_add_(0, group_index, torch.ones_like(w2))
    mean = torch.zeros(G).index_add_(0, group_index, rewards.float()) / cnt.clamp(min=1)
    b = torch.where(den > 0, num / den.clamp(min=1e-30), mean)
    return b[group_index]
