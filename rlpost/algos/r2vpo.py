"""R²VPO: the importance-weighted surrogate with a ratio-variance penalty whose multiplier follows dual ascent.

"Ratio-Variance Regularized Policy Optimization for Efficient LLM Fine-tuning"
(arXiv:2601.03320; extended as "Ratio-Variance Regularized Policy Optimization",
arXiv:2605.26784). PPO's hard clip cuts the gradient of every token whose ratio
leaves ``[1 - eps, 1 + eps]``, including rare high-advantage ones, and makes
slightly stale data useless. R²VPO instead constrains the variance (second
central moment) of the token importance ratios, ``Var(r) <= delta``, and solves
the constrained problem primal-dual: the policy minimises the Lagrangian
``-E[A r] + lambda Var(r)``; after each optimizer step ``lambda`` takes one
projected dual-ascent step ``lambda <- clip(lambda + dual_lr (Var(r) - delta),
0, lambda_max)``.

What we could read of the paper is its abstract; the surrogate's exact form and
the constants are our choices, stated in :class:`R2VPOParams` and
:func:`r2vpo_loss`. The multiplier lives in the trainer's ``loss_state``
(saved with a checkpoint) and is updated by :func:`r2vpo_dual_step`, which the
trainer calls after every successful optimizer step (registry tag ``after_step``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Tuple

import torch

from rlpost.algos.losses import Metrics, PolicyLossInput, _clip_metrics, _ratio, batch_view
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.utils import masked_mean
from rlpost.core.registry import param

_R2VPO_PAPER = ("Ratio-Variance Regularized Policy Optimization for Efficient LLM Fine-tuning (R²VPO, arXiv:2601.03320; "
                "Ratio-Variance Regularized Policy Optimization, arXiv:2605.26784)")

#: key of the Lagrange multiplier in the trainer's ``loss_state``
LAMBDA_KEY = "r2vpo_lambda"


@dataclass(frozen=True)
class R2VPOParams:
    """R²VPO's variance bound and dual ascent; the abstract gives no constants, so all four are our choices."""

    ratio_var_bound: float = param(0.01, "delta: bound on the token ratios' variance (our choice: ratio std 0.1, half "
                                   "PPO's clip width 0.2)")
    lambda_init: float = param(1.0, "the multiplier before the first dual step (our choice)")
    dual_lr: float = param(10.0, "dual ascent step on lambda per optimizer step: lambda += dual_lr (Var - delta) "
                           "(our choice: Var - delta is O(0.01), so lambda moves O(0.1) a step)")
    lambda_max: float = param(1000.0, "upper end of the projection of lambda (keeps the penalty finite; our choice)")


def ratio_mean_and_var(inp: PolicyLossInput) -> Tuple[float, float]:
    """``(mean, variance)`` of the token ratios ``pi / pi_old`` over the response tokens of the whole mini-batch.

    Taken from :func:`rlpost.algos.losses.batch_view` (the detached whole
    mini-batch when the trainer split it into micro-batches), in float64; the
    variance is the population second central moment ``mean((r - mean r)^2)``.
    An empty mask gives ``(1, 0)``.
    """
    full, _ = batch_view(inp)
    with torch.no_grad():
        m = full.response_mask.double()
        n = float(m.sum())
        if n <= 0:
            return 1.0, 0.0
        r = torch.exp((full.logprobs.double() - full.old_logprobs.double()).clamp(-20.0, 20.0))
        mean = float((r * m).sum() / n)
        return mean, float((((r - mean) ** 2) * m).sum() / n)


def r2vpo_dual_step(state: Dict[str, float], metrics: Mapping[str, torch.Tensor], *, ratio_var_bound: float,
                    lambda_init: float, dual_lr: float, lambda_max: float) -> None:
    """Projected dual ascent on the multiplier after one optimizer step (the registry's ``after_step`` hook).

    ``state[LAMBDA_KEY] <- clip(lambda + dual_lr (metrics['ratio_var'] - ratio_var_bound), 0, lambda_max)``,
    with ``lambda = state.get(LAMBDA_KEY, lambda_init)``; ``ratio_var`` is the
    variance the loss measured on the mini-batch of the step (before it).

    Raises:
        KeyError: ``metrics`` lacks ``ratio_var``.
    """
    lam = float(state.get(LAMBDA_KEY, lambda_init))
    v = float(metrics["ratio_var"])
    state[LAMBDA_KEY] = min(max(lam + dual_lr * (v - ratio_var_bound), 0.0), lambda_max)


@POLICY_LOSSES.register("r2vpo", paper=_R2VPO_PAPER, params=R2VPOParams, batch_statistics=True,
                        after_step=r2vpo_dual_step, extras=("loss_state",))
def r2vpo_loss(inp: PolicyLossInput, *, ratio_var_bound: float, lambda_init: float, dual_lr: float,
               lambda_max: float) -> Tuple[torch.Tensor, Metrics]:
    """R²VPO's Lagrangian per token: ``-A_t r_t + lambda (r_t - sg(mean r))^2``, no clip.

    ``r_t = pi(y_t) / pi_old(y_t)``; ``mean r`` is the mean ratio over the
    response tokens of the whole mini-batch (:func:`ratio_mean_and_var`),
    detached. Under ``token-mean`` aggregation the penalty's value is
    ``lambda Var(r)`` and its gradient is exactly that of the mini-batch
    variance (the mean's own gradient term sums to zero), so the split into
    micro-batches changes nothing; other aggregations weight each token's
    squared deviation by their own weights (our choice: one per-token form for
    every aggregation). The policy-gradient term is the plain importance-weighted
    surrogate ``-A r`` (the paper replaces the clip, it does not add one), so a
    token far from ``pi_old`` keeps its gradient ``-A r``, pulled back by
    ``2 lambda r (r - mean r)`` in proportion to how far its ratio sits from the batch's.

    ``lambda`` is ``inp.extras["loss_state"][LAMBDA_KEY]`` (the trainer's running
    multiplier) or ``lambda_init`` before the first dual step. On-policy
    (every ``r = 1``) the penalty and its gradient are 0 and the loss is
    REINFORCE's ``-A``; the constraint acts once the batch is reused
    (``algo.mini_batches > 1`` or ``algo.ppo_epochs > 1``) or stale.

    Shapes: every tensor of ``inp`` ``[B, R]``; returns ``[B, R]``. Metrics:
    ``ratio_var`` (0-d, the whole mini-batch's, read by :func:`r2vpo_dual_step`),
    ``r2vpo_lambda``, ``r2vpo_penalty`` (mean ``lambda (r - mean r)^2``); the
    clip fractions are 0 (nothing is clipped).

    Raises:
        ValueError: ``ratio_var_bound < 0``, ``lambda_init < 0``, ``dual_lr < 0``
            or ``lambda_max < lambda_init``.
    """
    if ratio_var_bound < 0 or lambda_init < 0 or dual_lr < 0:
        raise ValueError(f"r2vpo: ratio_var_bound, lambda_init and dual_lr must be >= 0, got "
                         f"{ratio_var_bound}, {lambda_init}, {dual_lr}")
    if lambda_max < lambda_init:
        raise ValueError(f"r2vpo: lambda_max ({lambda_max}) must be >= lambda_init ({lambda_init})")
    lam = float((inp.extras.get("loss_state") or {}).get(LAMBDA_KEY, lambda_init))
    r_mean, r_var = ratio_mean_and_var(inp)
    m = inp.response_mask
    ratio, log_ratio = _ratio(inp)
    pen = (ratio - r_mean) ** 2
    loss = -inp.advantages * ratio + lam * pen
    zero = torch.zeros_like(m)
    metrics = _clip_metrics(ratio, log_ratio, zero, zero, m)
    metrics["ratio_var"] = torch.tensor(r_var)
    metrics["r2vpo_lambda"] = torch.tensor(lam)
    metrics["r2vpo_penalty"] = masked_mean(lam * pen.detach(), m)
    return loss, metrics
