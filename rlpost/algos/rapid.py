"""RAPID's off-policy group-relative policy gradient: clipped sequence importance weights, reweighted group baseline.

"RAPID: An Efficient Reinforcement Learning Algorithm for Small Language Models"
(arXiv:2510.03515). RAPID generates one large batch of rollouts, then makes
several policy-gradient updates on it in mini-batches; every update after the
first is off-policy. Its estimator is the group-relative policy gradient
(REINFORCE with the group's mean reward as baseline) with importance weights
``pi / pi_old`` of each response, clipped to reduce variance, and a group
baseline that is itself importance-weighted. The scheduling part is existing
configuration (``selector.prompts_per_step`` for the large batch,
``algo.mini_batches`` for the updates); this module adds the estimator as the
``rapid`` loss. Only the abstract and summaries were readable here: the weight's
level (sequence), its clip and the baseline's self-normalised form are our
reading, stated in :func:`rapid_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from rlpost.algos.losses import (Metrics, PolicyLossInput, _clip_metrics, _is_weighted_pg, _nonempty_mean, _ratio,
                                 batch_view)
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.utils import group_ids, masked_mean
from rlpost.core.registry import param

_RAPID_PAPER = "RAPID: An Efficient Reinforcement Learning Algorithm for Small Language Models (arXiv:2510.03515)"


@dataclass(frozen=True)
class RAPIDParams:
    """RAPID's importance-weight clip; the value is our choice (the abstract gives none)."""

    weight_clip: float = param(2.0, "cap c on each response's importance weight pi / pi_old (our choice: 2)")


def sequence_weights(inp: PolicyLossInput, weight_clip: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(w [N], nonempty [N])`` over the whole mini-batch: ``w_i = min(prod_t r_it, c)`` of each response, detached.

    Computed in log space (``min(sum_t log r_it, log c)``, float64) on
    :func:`rlpost.algos.losses.batch_view`; ``nonempty`` marks rows with at
    least one response token (an empty row has weight 1 and leaves every baseline).
    """
    full, _ = batch_view(inp)
    with torch.no_grad():
        m = full.response_mask.double()
        slr = ((full.logprobs.double() - full.old_logprobs.double()) * m).sum(-1)
        w = torch.exp(slr.clamp(-50.0, float(torch.log(torch.tensor(weight_clip, dtype=torch.float64)))))
        return w, m.sum(-1) > 0


@POLICY_LOSSES.register("rapid", paper=_RAPID_PAPER, params=RAPIDParams, batch_statistics=True, needs_group=True)
def rapid_loss(inp: PolicyLossInput, *, weight_clip: float) -> Tuple[torch.Tensor, Metrics]:
    """RAPID: ``-sg(w_i) (A_i - delta_g) log pi(y_it)`` with a clipped sequence weight and a reweighted baseline.

    ``w_i = min(pi(y_i) / pi_old(y_i), c)`` (:func:`sequence_weights`, the
    whole response's ratio: the reward is a sequence's, so is the weight;
    ``c = weight_clip``). ``A_i`` is the estimator's group-relative advantage
    (``r_i - mean_g r`` in the preset); under ``pi`` the group's expected reward
    is estimated by the self-normalised importance-weighted mean, which moves the
    baseline by ``delta_g = sum_j w_j A_j / sum_j w_j - (1/|S|) sum_j A_j`` over the
    group's members ``S`` in this mini-batch (its unweighted part removes what the
    estimator already subtracted; with random mini-batches a group is split and
    ``S`` is the part present). On-policy every ``w = 1``, ``delta = 0``, and the
    loss is REINFORCE with the group baseline, GRPG. Written ``-A' sg(w / r_t) r_t``
    so that its value is ``-A' w_i`` and its gradient ``-A' w_i grad log pi``
    (:func:`rlpost.algos.losses._is_weighted_pg`).

    Statistics (weights, ``delta_g``) are over the whole mini-batch of the
    optimizer step (tag ``batch_statistics``), so the gradient does not depend
    on ``trainer.micro_batch_size``. Shapes: ``inp`` tensors ``[B, R]``, the
    advantage constant over a row (a token-varying one is averaged per group
    through its row mean). Metrics: ``seq_weight_mean``, ``clip_frac`` (share of
    responses whose weight hit ``c``, per token), ``rapid_baseline_shift`` (mean
    ``|delta_g|``).

    Raises:
        ValueError: ``weight_clip <= 0`` or ``inp.group_index`` missing.
    """
    if weight_clip <= 0:
        raise ValueError(f"rapid: weight_clip must be > 0, got {weight_clip}")
    full, rows = batch_view(inp)
    if full.group_index is None:
        raise ValueError("rapid needs PolicyLossInput.group_index (the trainer passes it)")
    w, ne = sequence_weights(inp, weight_clip)
    with torch.no_grad():
        fm = full.response_mask.double()
        A_row = (full.advantages.double() * fm).sum(-1) / fm.sum(-1).clamp(min=1.0)
        inv, G = group_ids(full.group_index)
        wn, nn = w * ne, ne.double()
        sw = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, wn)
        swa = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, wn * A_row)
        cnt = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, nn)
        sa = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, nn * A_row)
        delta = torch.where(cnt > 0, swa / sw.clamp(min=1e-300) - sa / cnt.clamp(min=1.0), torch.zeros_like(cnt))
        d_rows = delta[inv][rows].to(inp.advantages.dtype)
        w_rows = w[rows].to(inp.logprobs.dtype)
    m = inp.response_mask
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages - d_rows[:, None]
    loss = _is_weighted_pg(ratio, w_rows[:, None].expand_as(ratio), A)
    with torch.no_grad():
        capped = (w_rows >= weight_clip * (1 - 1e-9)).to(m.dtype)[:, None].expand_as(m)
        metrics = _clip_metrics(ratio, log_ratio, capped * (A < 0).to(m.dtype), capped * (A > 0).to(m.dtype), m)
        metrics["clip_frac"] = masked_mean(capped, m)
        metrics["seq_weight_mean"] = _nonempty_mean(w_rows, m)
        metrics["rapid_baseline_shift"] = masked_mean(d_rows.abs()[:, None].expand_as(m), m)
    return loss, metrics
