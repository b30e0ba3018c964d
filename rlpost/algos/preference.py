"""Sequence-level alignment objectives that regress the policy's log-ratio to a second policy.

* EXO (``exo``): the reverse KL between the group's softmax of ``beta_pi * log pi/pi_ref``
  and of ``reward / beta_r``; the reference policy is the run's reference model
  (tag ``needs_ref``: the runner computes ``ref_logprobs`` even with ``algo.kl.coef = 0``).
* SPPO (``sppo``): the square of ``log pi/pi_t - eta (P(y > pi_t) - 1/2)``; ``pi_t``, the
  policy of the current self-play iteration, is the rollout-time policy (``old_logprobs``),
  one RL step being one iteration; ``P`` comes from the ``win_rate`` estimator.

Both read a per-sequence score from ``PolicyLossInput.advantages`` (the mean over the
sequence's tokens), so the reward side stays the estimator's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, _broadcast
from rlpost.algos.losses import PolicyLossInput, _group_log_softmax, _nonempty_mean, batch_view, ratio_metrics
from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
from rlpost.algos.utils import group_ids, masked_mean
from rlpost.core.registry import param

Metrics = Dict[str, torch.Tensor]

_EXO_PAPER = ("Towards Efficient Exact Optimization of Language Model Alignment (EXO, arXiv:2402.00856); "
              "authors' code https://github.com/haozheji/exact-optimization")
_SPPO_PAPER = ("Self-Play Preference Optimization for Language Model Alignment (SPPO, arXiv:2405.00675); "
               "authors' code https://github.com/uclaml/SPPO")


def _seq_score(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64 mean of ``x`` over each row's masked tokens (0 for an empty row)."""
    md = m.double()
    return (x.double() * md).sum(-1) / md.sum(-1).clamp(min=1.0)


def _no_clip_metrics(inp: PolicyLossInput) -> Metrics:
    """Ratio metrics against ``old_logprobs`` and ``clip_frac`` 0 (these losses do not clip)."""
    with torch.no_grad():
        lr = (inp.logprobs - inp.old_logprobs).clamp(-20.0, 20.0)
        return {**ratio_metrics(lr.exp(), lr, inp.response_mask), "clip_frac": torch.zeros((), device=lr.device)}


@dataclass(frozen=True)
class EXOParams:
    """EXO's two temperatures (authors' train_exo.sh: beta_r = beta_pi = 0.5)."""

    beta_pi: float = param(0.5, "scale of the policy's log-ratio log pi/pi_ref in its group softmax (authors: 0.5)")
    beta_r: float = param(0.5, "temperature of the reward softmax, exp(r / beta_r) (authors: 0.5)")


def _exo_example(logprobs: torch.Tensor, generator: torch.Generator) -> dict:
    """The reference policy's log-probs near the current ones (the ref_logprobs stage's output in a run)."""
    ref = logprobs + 0.2 * torch.randn(logprobs.shape, generator=generator)
    return {"extras": {"ref_logprobs": ref}, "batch_extras": {"ref_logprobs": ref}}


@POLICY_LOSSES.register("exo", paper=_EXO_PAPER, params=EXOParams, batch_statistics=True, needs_group=True,
                        sequence_sum=True, needs_ref=True, extras=("ref_logprobs",), example_inputs=_exo_example)
def exo_loss(inp: PolicyLossInput, *, beta_pi: float, beta_r: float) -> Tuple[torch.Tensor, Metrics]:
    """EXO with rewards (``exo-rw``): reverse KL from the policy's group distribution to the reward's.

    For each group of K samples of one prompt, with ``f_i = beta_pi * sum_t (log pi - log pi_ref)``
    over sequence i's tokens and ``u_i`` its score (the advantage's mean over its tokens),

        p_f = softmax_group(f),  p_r = softmax_group(u / beta_r),
        L_g = sum_i p_f(i) (log p_f(i) - log p_r(i)),

    and the loss is the mean of ``L_g`` over groups (the authors' ``exact_loss``). ``p_r``
    is the softmax of the rewards: the preset's Dr. GRPO advantage ``r - mean_g(r)``
    gives it exactly (a softmax ignores a per-group shift); a std-normalised advantage
    would change its temperature. The gradient on ``f_i`` is
    ``p_f(i) (log p_f(i) - log p_r(i) - L_g)``.

    Written per token like ``tpo``: ``loss_t = K c_i beta_pi (log pi_t - sg log pi_t) + v_i / L_i``
    with ``c_i`` that gradient and ``v_i = K p_f(i) (log p_f(i) - log p_r(i))``, so that
    ``seq-mean-token-sum`` gives the mean over groups and the gradient does not depend
    on the micro-batch split (``p_f`` from the detached whole mini-batch,
    :func:`rlpost.algos.losses.batch_view`).

    Where the paper leaves it open: the samples are the current policy's (online),
    where the paper samples its SFT policy once; a group split across mini-batches is
    fitted on the members present (as ``tpo``).

    Args:
        inp: needs ``ref_logprobs`` ``[B, R]`` and ``group_index`` ``[B]``.
    Returns:
        ``(loss_mat [B, R], metrics)``; ``seq_exo_kl`` is the per-sequence mean of ``v_i / K``.
    Raises:
        ValueError: no ``ref_logprobs`` or ``group_index``, or a temperature <= 0.
    """
    if beta_pi <= 0 or beta_r <= 0:
        raise ValueError(f"exo: beta_pi and beta_r must be > 0, got {beta_pi}, {beta_r}")
    if inp.group_index is None or inp.extras.get("ref_logprobs") is None:
        raise ValueError("exo needs PolicyLossInput.group_index and ref_logprobs (the runner computes the reference "
                         "log-probs for losses tagged needs_ref)")
    full, rows = batch_view(inp)
    ref_full = full.extras.get("ref_logprobs") if full.extras.get("ref_logprobs") is not None else inp.extras.get("ref_logprobs")
    gi = full.group_index if full.group_index is not None else inp.group_index
    inv, G = group_ids(gi.to(full.response_mask.device))
    fm = full.response_mask.double()
    f = beta_pi * ((full.logprobs.detach().double() - ref_full.double()) * fm).sum(-1)
    u = _seq_score(full.advantages, full.response_mask)
    log_pf = _group_log_softmax(f, inv, G)
    log_pr = _group_log_softmax(u / beta_r, inv, G)
    pf = log_pf.exp()
    term = pf * (log_pf - log_pr)
    Lg = torch.zeros(G, dtype=torch.float64, device=fm.device).index_add_(0, inv, term)[inv]
    K = torch.zeros(G, dtype=torch.float64, device=fm.device).index_add_(0, inv, torch.ones_like(f))[inv]
    coef = (K * pf * (log_pf - log_pr - Lg) * beta_pi)[rows].to(inp.logprobs.dtype)
    value = (K * term)[rows]
    m = inp.response_mask
    Lr = m.sum(-1).clamp(min=1.0)
    loss = (coef[:, None] * (inp.logprobs - inp.logprobs.detach()) + (value / Lr.double()).to(m.dtype)[:, None]) * m
    metrics = _no_clip_metrics(inp)
    with torch.no_grad():
        metrics["seq_exo_kl"] = _nonempty_mean((value / K[rows]).float(), m)
    return loss, metrics


@ADV_ESTIMATORS.register("win_rate", paper=_SPPO_PAPER, needs_group=True)
def win_rate_advantage(inp: AdvantageInput) -> AdvantageOutput:
    """SPPO's centred win rate ``P(y_i > pi_t | x) - 1/2`` against the group's other samples.

    ``P(y_i > y_j) = 1`` if ``r_i > r_j``, ``1/2`` on a tie, ``0`` otherwise: the verifier's
    reward stands in for the paper's preference model (PairRM), our choice for
    verifiable tasks. ``P(y_i > pi_t)`` is the mean over the ``K - 1`` other samples of
    the group (the paper estimates it against the K samples of ``pi_t``). Shapes:
    rewards ``[B]`` -> advantages ``[B, R]`` in ``[-1/2, 1/2]``; a group of one gets 0.
    """
    r = inp.rewards.double()
    inv, G = group_ids(inp.group_index)
    same = inv[:, None] == inv[None, :]
    win = (r[:, None] > r[None, :]).double() + 0.5 * (r[:, None] == r[None, :]).double()
    off = same & ~torch.eye(len(r), dtype=torch.bool)
    n = off.sum(-1).double()
    p = torch.where(n > 0, (win * off).sum(-1) / n.clamp(min=1.0), torch.full_like(r, 0.5))
    return AdvantageOutput(advantages=_broadcast(p - 0.5, inp.response_mask))


@dataclass(frozen=True)
class SPPOParams:
    """SPPO's step size eta (authors' scripts/pipeline.sh: beta = 0.001, i.e. eta = 1/beta = 1000)."""

    eta: float = param(1000.0, "eta: target log-ratio per unit of centred win rate (authors: 1000, their beta = 0.001)")


@POLICY_LOSSES.register("sppo", paper=_SPPO_PAPER, params=SPPOParams, sequence_sum=True)
def sppo_loss(inp: PolicyLossInput, *, eta: float) -> Tuple[torch.Tensor, Metrics]:
    """SPPO: regress the sequence log-ratio to ``pi_t`` onto ``eta`` times the centred win rate.

    Per sequence i, ``v_i = (sum_t (log pi - log pi_t) - eta a_i)^2`` with ``a_i`` its
    advantage (``win_rate``: ``P(y_i > pi_t) - 1/2``) and ``pi_t`` the policy of this
    self-play iteration: ``inp.old_logprobs``, the weights the step's rollouts came
    from, so one RL step is one SPPO iteration (the paper regenerates data from
    ``pi_t`` each iteration and fits it over several epochs: ``algo.ppo_epochs``).
    Written per token as ``v_i / L_i`` on each of its ``L_i`` tokens, so
    ``seq-mean-token-sum`` gives the mean over sequences; rows are whole in every
    micro-batch, so the split does not change it.

    Where the paper leaves it open: all K samples are regressed (the authors' code
    keeps the best and the worst of 5); the verifier's reward replaces the
    preference model (see ``win_rate``).

    Returns:
        ``(loss_mat [B, R], metrics)``; ``seq_sppo_log_ratio`` is the mean sequence log-ratio.
    Raises:
        ValueError: ``eta <= 0``.
    """
    if eta <= 0:
        raise ValueError(f"sppo: eta must be > 0, got {eta}")
    m = inp.response_mask
    ell = ((inp.logprobs - inp.old_logprobs) * m).sum(-1)
    a = _seq_score(inp.advantages, m).to(ell.dtype)
    v = (ell - eta * a) ** 2
    loss = (v / m.sum(-1).clamp(min=1.0))[:, None] * m
    metrics = _no_clip_metrics(inp)
    with torch.no_grad():
        metrics["seq_sppo_log_ratio"] = _nonempty_mean(ell.detach(), m)
        metrics["sppo/target_abs_mean"] = masked_mean((eta * a).abs()[:, None].expand_as(m), m)
    return loss, metrics
