"""Policy losses: per-token surrogate objectives.

Calling convention: ``fn(inp: PolicyLossInput, *, <params>) -> (loss_mat, metrics)``
where ``loss_mat`` is ``[B, R]`` (to be minimised; the caller aggregates it with a
:mod:`rlpost.algos.aggregation` mode) and ``metrics`` maps names to 0-d tensors:
masked means over response tokens, except names starting ``seq_``, which are
means over the sequences with at least one response token (the trainer weights
each micro-batch's value by its token or sequence count, so the logged value
is the mean over the whole mini-batch).

Losses that take statistics over "the batch" (``hapo``, ``aepo``: entropy
normalisation; ``clip_cov``, ``kl_cov``: token covariance and the tokens it
selects) are tagged ``batch_statistics`` and take them over the whole
mini-batch of the optimizer step: the trainer hands each micro-batch the
detached whole mini-batch in :attr:`PolicyLossInput.batch` and the micro-batch's
rows in it, so their gradient does not depend on ``trainer.micro_batch_size``.
Called on one batch (no ``batch``), the batch is ``inp`` itself.

Standard metric names: ``clip_frac`` (share of tokens whose gradient is cut by the
clip), ``clip_frac_low`` / ``clip_frac_high`` (per side), ``ratio_mean``,
``ratio_max``, ``approx_kl`` (k3 estimate of KL(old || new)).

Parameters: each loss's ``<params>`` are declared once, by the frozen dataclass
registered with it (``params=``, defaults = the paper's setting, one doc line per
field; see :mod:`rlpost.core.registry`). The function lists the same names as
keyword-only arguments without defaults. A clip range (``eps_low`` /
``eps_high`` / ``dual_clip``) is a parameter of exactly the losses that declare
one; ``algo.clip.*`` writes into those (:func:`rlpost.algos.validate.loss_kwargs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from rlpost.algos.hapo import adaptive_clip_range, entropy_hhat, redistribute_advantage
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.utils import group_ids, masked_mean, masked_quantile
from rlpost.core.registry import Choice, param

Metrics = Dict[str, torch.Tensor]


@dataclass(slots=True)  # slots: setting a field it does not have is an error, not a silent new attribute
class PolicyLossInput:
    """What a policy loss reads. Tensors ``[B, R]`` unless said.

    Attributes:
        logprobs: log pi_theta(a_t|s_t) of the current policy, with grad, nats.
        old_logprobs: log-probs of the policy that the update's trust region is
            anchored to (the trainer's weights at rollout time), no grad.
        advantages: per-token advantages, no grad.
        response_mask: 0/1 float mask.
        rollout_logprobs: log-probs reported by the rollout engine (behaviour
            policy), or None.
        entropy: per-token policy entropy (nats), detached, or None.
        group_index: ``[B]`` long, equal ids = rollouts of the same prompt, or
            None. Losses that couple a group (``tpo``: a softmax over the
            group's sequence log-probs) need it; with ``batch`` it must be set
            on both (the trainer passes the rows' ids).
        step: index of the training step this update belongs to (0 for the
            first batch; the trainer passes its count of earlier policy
            updates, saved with a checkpoint), or None. Losses with a schedule
            over training (``holderpo``'s exponent) read it; None means step 0.
        seed: seed of the random draws a loss makes over the whole batch
            (``clip_cov``), the same for every micro-batch of a mini-batch and every
            process (the trainer derives it from the run seed and the step); None
            uses torch's global RNG.
        batch: the whole mini-batch this input is a micro-batch of (detached
            ``logprobs``, ``old_logprobs``, ``advantages``, ``response_mask``,
            ``entropy``, ``group_index`` and the declared extras; ``[N, R]``), or
            None when ``inp`` is the whole batch. Losses tagged
            ``batch_statistics`` take their statistics from it.
        rows: ``[B]`` long, the rows of ``batch`` that this input holds (with ``batch``).
        extras: the inputs only some losses read, by key. A loss declares the keys
            it reads when it registers (``extras=(...)``); the trainer fills exactly
            those (:data:`EXTRA_INPUTS` says what each key holds) and config
            validation checks that something in the run provides each.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    group_index: Optional[torch.Tensor] = None
    step: Optional[int] = None
    seed: Optional[int] = None
    batch: Optional["PolicyLossInput"] = None
    rows: Optional[torch.Tensor] = None
    extras: Dict[str, Any] = field(default_factory=dict)


#: every key a loss may declare in ``extras=``, with what it holds and who provides it
EXTRA_INPUTS: Dict[str, str] = {
    "ref_logprobs": "[B, R] the reference (initial) policy's log-probs, no grad (the ref_logprobs stage; "
                    "a loss that declares it gets the stage even with algo.kl.coef=0)",
    "teacher_logprobs": "[B, R] a teacher's log-probs of the sampled tokens, no grad (model.teacher's stage, or "
                        "a method writing a self-teacher)",
    "support_logprobs": "[B, R, K] the current policy's log-probs (with grad) on a per-position token support",
    "teacher_support_logprobs": "[B, R, K] the teacher's log-probs on that support, no grad",
    "support_rewards": "[B, R, K] a reward per support token",
    "segment_ids": "[B, R] long, the subsentence index of each response token",
    "old_entropy": "[B, R] the pre-update policy's per-token entropy (nats), no grad; absent on a single "
                   "on-policy pass (then the current entropy is the old one)",
    "first_log_normaliser": "[B] logsumexp of the current policy's logits at the first response position, with grad",
    "region_support_logprobs": "[B, R, K] the current policy's log-probs on the anchor's top-K support (slot 0: "
                               "the sampled token)",
    "region_anchor_logprobs": "[B, R, K] the trust-region anchor's log-probs on that support",
    "predicted_change": "[B, R] predicted change of the objective if the coming step were driven by the token alone",
    "predicted_kl": "[B, R] the predicted Fisher KL of that step",
    "mopd_weight": "[B] each row's Open-MOPD domain budget weight (the mopd estimator's AdvantageOutput.extras)",
    "loss_state": "the trainer's running state of losses that carry some across optimizer steps (a dict, "
                  "read-only in the loss; a loss tagged after_step=fn updates it after each step)",
    "token_weights": "[B, R] the per-token weights a loss tagged token_draw=fn drew for its mini-batch before the "
                     "update's forward (0 = the loss does not need the position; the trainer provides it)",
}


def loss_token_draw(loss: str):
    """The ``token_draw`` tag of ``algo.loss=loss``, or None.

    A loss that uses only a random subset of response positions may declare
    the draw as ``token_draw=fn`` with ``fn(mask [N, R] 0/1 float, gen:
    torch.Generator, **loss_params) -> weights [N, R] float`` (0 = the loss
    does not read that position). The trainer draws once per mini-batch,
    before the update's forward pass, and passes the weights as
    ``extras['token_weights']``; its update forward then computes each
    micro-batch only up to the last column with a non-zero weight and skips
    rows with none (``trainer.drawn_forward``): a causal LM's log-probs at
    those positions do not depend on later tokens.
    """
    return POLICY_LOSSES.tag(loss, "token_draw", None)


def loss_extras(loss: str) -> Tuple[str, ...]:
    """The extra input keys ``algo.loss=loss`` declares (its ``extras=`` tag; empty for most losses)."""
    return tuple(POLICY_LOSSES.tag(loss, "extras", ()) or ())


def batch_view(inp: PolicyLossInput) -> Tuple[PolicyLossInput, torch.Tensor]:
    """``(whole batch, rows of inp in it)`` for losses with batch statistics.

    ``inp.batch`` and ``inp.rows`` when the trainer split a mini-batch into
    micro-batches, else ``inp`` itself with rows ``0..B-1``. Per-token
    statistics computed on the whole batch ``[N, R]`` are taken back to ``inp``
    with ``x[rows]``.

    Raises:
        ValueError: ``batch`` without ``rows``, or widths that differ.
    """
    if inp.batch is None:
        return inp, torch.arange(inp.response_mask.shape[0], device=inp.response_mask.device)
    if inp.rows is None or inp.batch.response_mask.shape[-1] != inp.response_mask.shape[-1]:
        raise ValueError("PolicyLossInput.batch needs rows and the same padded width as the micro-batch")
    return inp.batch, inp.rows.to(inp.response_mask.device)


def _ratio(inp: PolicyLossInput, max_log_ratio: float = 20.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token importance ratio ``r = pi / pi_old`` and its log, both ``[B, R]`` (the shared first step).

    The log-ratio is clamped to ``[-max_log_ratio, max_log_ratio]`` so ``r``
    stays finite; ``r`` carries the gradient of ``inp.logprobs``.
    """
    log_ratio = (inp.logprobs - inp.old_logprobs).clamp(-max_log_ratio, max_log_ratio)
    return torch.exp(log_ratio), log_ratio


def ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """``ratio_mean``, ``ratio_max`` and ``approx_kl`` (k3 of KL(old||new)) over masked tokens."""
    with torch.no_grad():
        big = torch.where(mask > 0, ratio, torch.zeros_like(ratio))
        return {
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": big.max() if big.numel() else torch.tensor(0.0),
            "approx_kl": masked_mean(ratio - 1 - log_ratio, mask),
        }


def _clip_metrics(ratio, log_ratio, low, high, m) -> Metrics:
    """The standard metrics (the shared last step): clip fractions from the ``[B, R]`` 0/1 masks
    ``low`` / ``high`` of clipped tokens, plus :func:`ratio_metrics`; no grad."""
    with torch.no_grad():
        return dict(
            clip_frac=masked_mean(torch.clamp(low + high, max=1.0), m),
            clip_frac_low=masked_mean(low, m),
            clip_frac_high=masked_mean(high, m),
            **ratio_metrics(ratio, log_ratio, m),
        )


def _ppo_core(ratio, A, lo, hi, dual_clip, m):
    """The PPO clipped surrogate (arXiv:1707.06347) with optional dual clip (arXiv:1912.09729), shared by the PPO-family losses.

    Args:
        ratio, A, m: ``[B, R]`` ratio (with grad), advantages, response mask.
        lo, hi: ``eps_low`` / ``eps_high`` as floats or ``[B, R]`` tensors (per token).
        dual_clip: the dual-clip constant (> 1) or None.
    Returns:
        ``(loss [B, R], low, high, extra)``: ``low`` / ``high`` 0/1 masks of tokens whose
        gradient the clip cuts (dual-clipped ones count as low), ``extra`` holds
        ``clip_frac_dual`` when dual clip is on.
    Raises:
        ValueError: ``dual_clip`` not > 1.
    """
    surr1 = -A * ratio
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        clipped = torch.minimum(torch.maximum(ratio, 1.0 - lo), 1.0 + hi)
    else:
        clipped = torch.clamp(ratio, 1.0 - lo, 1.0 + hi)
    surr2 = -A * clipped
    loss = torch.maximum(surr1, surr2)
    with torch.no_grad():
        low = ((ratio < 1.0 - lo) & (A < 0)).float()
        high = ((ratio > 1.0 + hi) & (A > 0)).float()
    extra: Metrics = {}
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        surr3 = -A * dual_clip
        with torch.no_grad():
            dual = ((A < 0) & (surr3 < loss)).float()
        loss = torch.where(A < 0, torch.minimum(loss, surr3), loss)
        extra["clip_frac_dual"] = masked_mean(dual, m)
        low = torch.clamp(low + dual, max=1.0)
    return loss, low, high, extra


@dataclass(frozen=True)
class PPOClipParams:
    """PPO's clip range (arXiv:1707.06347: epsilon = 0.2), optional dual clip (arXiv:1912.09729)."""

    eps_low: float = param(0.2, "lower clip: ratio floor 1 - eps_low for A < 0 (PPO paper: 0.2)")
    eps_high: float = param(0.2, "upper clip: ratio cap 1 + eps_high for A > 0 (PPO: 0.2; DAPO clip-higher: 0.28)")
    dual_clip: Optional[float] = param(None, "dual-clip constant c > 1 capping the loss of A < 0 tokens at -c A, or null (off)")


@POLICY_LOSSES.register(
    "ppo_clip",
    paper="Proximal Policy Optimization Algorithms (arXiv:1707.06347); decoupled eps_low/eps_high "
    "from DAPO (arXiv:2503.14476); dual-clip from Mastering Complex Control in MOBA Games (arXiv:1912.09729)",
    params=PPOClipParams,
)
def ppo_clip_loss(
    inp: PolicyLossInput,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: Optional[float],
) -> Tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` per token.

    A token whose ratio is outside the clip range on the side that binds for the
    sign of its advantage (``r > 1+eps_high`` with ``A > 0``, ``r < 1-eps_low``
    with ``A < 0``) gets zero gradient. With ``dual_clip = c > 1``, tokens with
    ``A < 0`` have their loss capped at ``-c A`` (no gradient there), which bounds
    the update from very large ratios on negative samples.

    Args:
        inp: see :class:`PolicyLossInput`.
        eps_low, eps_high: clip range (DAPO's clip-higher uses eps_high > eps_low).
        dual_clip: the dual-clip constant c (> 1), or None.
    Returns:
        ``(loss_mat [B, R], metrics)``.
    Raises:
        ValueError: ``dual_clip`` not > 1.
    """
    ratio, log_ratio = _ratio(inp)
    m = inp.response_mask
    loss, low, high, extra = _ppo_core(ratio, inp.advantages, eps_low, eps_high, dual_clip, m)
    metrics = _clip_metrics(ratio, log_ratio, low, high, m)
    metrics.update(extra)
    return loss, metrics


@dataclass(frozen=True)
class StrictDoubleClipParams:
    """SAO's clip range; the SAO abstract gives none, so PPO's 0.2 (our choice)."""

    eps_low: float = param(0.2, "any token with ratio < 1 - eps_low gets no gradient (our choice: PPO's 0.2)")
    eps_high: float = param(0.2, "any token with ratio > 1 + eps_high gets no gradient (our choice: PPO's 0.2)")


@POLICY_LOSSES.register(
    "strict_double_clip",
    paper="Single-Rollout Asynchronous Optimization for Agentic Reinforcement Learning (SAO, arXiv:2607.07508)",
    params=StrictDoubleClipParams,
)
def strict_double_clip_loss(
    inp: PolicyLossInput, *, eps_low: float, eps_high: float
) -> Tuple[torch.Tensor, Metrics]:
    """SAO's strict double-sided token-level clipping.

    Unlike PPO, where only the side matching the advantage's sign binds, both
    bounds bind for every token: any token whose ratio leaves
    ``[1-eps_low, 1+eps_high]`` contributes no gradient, whatever the sign of its
    advantage. (PPO keeps the gradient of e.g. a token with ``r > 1+eps`` and
    ``A < 0``, which in off-policy asynchronous training lets stale samples push
    the policy far.) Loss per token: ``-A * r`` inside the range, and the constant
    ``-A * clip(r)`` (no gradient) outside. The abstract gives no eps; defaults
    are PPO's 0.2 (our choice).

    Returns:
        ``(loss_mat [B, R], metrics)`` with ``clip_frac`` = share of tokens outside
        the range on either side.
    """
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    # Inside: gradient of r; outside: clamp's gradient is exactly 0.
    loss = -A * torch.clamp(ratio, lo, hi)
    with torch.no_grad():
        low = (ratio < lo).float()
        high = (ratio > hi).float()
    return loss, _clip_metrics(ratio, log_ratio, low, high, inp.response_mask)


def _nonempty_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Mean of the per-sequence values ``x`` ``[B]`` over sequences with a response token (1 when none)."""
    keep = m.sum(-1) > 0
    return x[keep].mean() if bool(keep.any()) else torch.tensor(1.0, device=x.device)


def _seq_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``[B]`` masked mean over each sequence's tokens."""
    return masked_mean(x, m, dim=-1)


@dataclass(frozen=True)
class GSPOParams:
    """GSPO's clip range on the length-normalised sequence ratio (arXiv:2507.18071: 3e-4 / 4e-4)."""

    eps_low: float = param(3e-4, "sequence ratio floor 1 - eps_low (GSPO paper: 3e-4)")
    eps_high: float = param(4e-4, "sequence ratio cap 1 + eps_high (GSPO paper: 4e-4)")


@POLICY_LOSSES.register(
    "gspo",
    paper="Group Sequence Policy Optimization (GSPO, arXiv:2507.18071)",
    params=GSPOParams,
    sequence_level=True,
)
def gspo_loss(
    inp: PolicyLossInput, *, eps_low: float, eps_high: float
) -> Tuple[torch.Tensor, Metrics]:
    """GSPO: clip the length-normalised *sequence* importance ratio.

    ``s_i = exp(mean_t (log pi - log pi_old))`` (the geometric mean of the token
    ratios). Written in the paper's GSPO-token form so that token-level
    advantages also work: every token uses
    ``s_it = sg(s_i) * pi(y_t) / sg(pi(y_t))`` (value ``s_i``, gradient
    ``s_i * grad log pi(y_t)``) in the PPO surrogate
    ``-min(s_it A_t, clip(s_it, 1-eps_low, 1+eps_high) A_t)``. With one advantage
    per sequence and ``seq-mean-token-mean`` aggregation this is exactly GSPO's
    objective; a whole sequence is clipped together. The paper's ranges are
    tiny because the ratio is per sequence: ``eps_low=3e-4, eps_high=4e-4``.
    ``log s_it`` is clamped at 10 before ``exp`` (as verl's ``compute_policy_loss_gspo``
    does): a row that far off-policy gets no gradient instead of an overflow.

    Returns:
        ``(loss_mat [B, R], metrics)``; clip fractions count tokens of clipped
        sequences; ``seq_ratio_mean`` is the mean of ``s_i``.
    """
    m = inp.response_mask
    ratio, log_ratio = _ratio(inp)
    log_s = _seq_mean(log_ratio, m)
    log_st = log_s.detach()[:, None] + inp.logprobs - inp.logprobs.detach()
    s_t = torch.exp(log_st.clamp(max=10.0))  # verl's GSPO clamps the log sequence ratio at 10 for stability
    A = inp.advantages
    loss = torch.maximum(-A * s_t, -A * torch.clamp(s_t, 1.0 - eps_low, 1.0 + eps_high))
    with torch.no_grad():
        low = ((s_t < 1.0 - eps_low) & (A < 0)).float()
        high = ((s_t > 1.0 + eps_high) & (A > 0)).float()
        metrics = _clip_metrics(ratio, log_ratio, low, high, m)
        metrics["seq_ratio_mean"] = _nonempty_mean(torch.exp(log_s), m)
    return loss, metrics


@dataclass(frozen=True)
class GMPOParams:
    """GMPO's log-space clip range (arXiv:2507.20673: (-0.4, 0.4), ratios in (e^-0.4, e^0.4))."""

    eps_low: float = param(0.4, "token log-ratio floor -eps_low (GMPO paper: 0.4)")
    eps_high: float = param(0.4, "token log-ratio cap eps_high (GMPO paper: 0.4)")


@POLICY_LOSSES.register(
    "gmpo",
    paper="GMPO: Geometric-Mean Policy Optimization (arXiv:2507.20673)",
    params=GMPOParams,
    sequence_level=True,
)
def gmpo_loss(
    inp: PolicyLossInput, *, eps_low: float, eps_high: float
) -> Tuple[torch.Tensor, Metrics]:
    """GMPO: maximise the geometric mean of the clipped token-level objectives.

    Per sequence ``J_i = A_i * exp(mean_t l_t)`` where ``l_t`` is the token log
    ratio clipped *in log space* to ``[-eps_low, eps_high]`` on the side that
    binds for the sign of ``A_i``: ``l_t = min(lr_t, clip(lr_t))`` for ``A > 0``
    and ``max(lr_t, clip(lr_t))`` for ``A < 0`` (the paper's
    ``sgn(A) * min(sgn(A) lr, sgn(A) clip(lr))``). A clipped token contributes a
    constant, hence zero gradient. ``eps = 0.4`` (ratio range ``(e^-0.4, e^0.4)``)
    is the paper's default. ``A_i`` is the sequence mean of the token
    advantages. The sequence loss ``-J_i`` is placed on each of its tokens
    (use ``seq-mean-token-mean`` to weight sequences equally, as the paper does).

    Returns:
        ``(loss_mat [B, R], metrics)``.
    """
    m = inp.response_mask
    ratio, lr = _ratio(inp)
    A_seq = _seq_mean(inp.advantages, m)
    sgn = torch.sign(A_seq)[:, None]
    lr_c = lr.clamp(-eps_low, eps_high)
    l = sgn * torch.minimum(sgn * lr, sgn * lr_c)
    seq_ratio = torch.exp(_seq_mean(l, m).clamp(max=20.0))
    loss = (-(A_seq * seq_ratio))[:, None] * torch.ones_like(lr)
    with torch.no_grad():
        low = ((lr < -eps_low) & (sgn < 0)).float()
        high = ((lr > eps_high) & (sgn > 0)).float()
        metrics = _clip_metrics(ratio, lr, low, high, m)
        metrics["seq_ratio_mean"] = _nonempty_mean(seq_ratio.detach(), m)
    return loss, metrics


def _is_weighted_pg(ratio: torch.Tensor, w: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """``-A * sg(w / r) * r``: value ``-A w``, gradient ``-A w grad log pi`` (w detached)."""
    return -A * (w / ratio).detach() * ratio


@dataclass(frozen=True)
class CISPOParams:
    """CISPO's IS-weight clip (arXiv:2506.13585): no lower bound; the paper tunes the upper one without reporting it."""

    eps_low: float = param(1.0, "weight floor 1 - eps_low; 1 = no lower bound, as the paper (weights down to 0)")
    eps_high: float = param(4.0, "weight cap 1 + eps_high; tuned but not reported in the paper: 4 is our choice (loose)")


@POLICY_LOSSES.register(
    "cispo",
    paper="MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention (CISPO, arXiv:2506.13585)",
    params=CISPOParams,
)
def cispo_loss(
    inp: PolicyLossInput, *, eps_low: float, eps_high: float
) -> Tuple[torch.Tensor, Metrics]:
    """CISPO: REINFORCE with clipped, stop-gradient importance-sampling weights.

    ``loss_t = -sg(clip(r_t, 1-eps_low, 1+eps_high)) * A_t * log pi(y_t)`` (in
    gradient; we write it as ``-A sg(w/r) r`` so its *value* is ``-A w``). Unlike
    PPO, a token whose ratio is clipped keeps its gradient, scaled by the
    clipped weight. The paper imposes no lower bound (here ``eps_low = 1``:
    weights down to 0) and tunes only the upper one without reporting it;
    ``eps_high = 4`` is our choice (the trust region is then loose, as CISPO
    intends). ``clip_frac*`` count tokens whose weight was clipped.
    """
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages
    w = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high).detach()
    loss = _is_weighted_pg(ratio, w, A)
    with torch.no_grad():
        low = (ratio < 1.0 - eps_low).float()
        high = (ratio > 1.0 + eps_high).float()
    return loss, _clip_metrics(ratio, log_ratio, low, high, inp.response_mask)


@dataclass(frozen=True)
class DISPOParams:
    """DISPO's four clip bounds (arXiv:2602.00983); the tuned values are not in the abstract: our choices."""

    pos_low: float = param(0.5, "weight floor 1 - pos_low for A > 0 tokens (our choice)")
    pos_high: float = param(1.0, "weight cap 1 + pos_high for A > 0 tokens (our choice)")
    neg_low: float = param(1.0, "weight floor 1 - neg_low for A < 0 tokens (our choice: no floor)")
    neg_high: float = param(4.0, "weight cap 1 + neg_high for A < 0 tokens (our choice: loose, tight collapses)")


@POLICY_LOSSES.register(
    "dispo",
    paper="DISPO: Enhancing Training Efficiency and Stability in Reinforcement Learning for Large Language Model "
    "Mathematical Reasoning (arXiv:2602.00983)",
    params=DISPOParams,
)
def dispo_loss(
    inp: PolicyLossInput,
    *,
    pos_low: float,
    pos_high: float,
    neg_low: float,
    neg_high: float,
) -> Tuple[torch.Tensor, Metrics]:
    """DISPO: CISPO-style weights with four independent clip regimes.

    Tokens of *correct* responses (``A > 0``) use weights
    ``clip(r, 1-pos_low, 1+pos_high)``, tokens of *incorrect* ones (``A < 0``)
    ``clip(r, 1-neg_low, 1+neg_high)``; the weight is stop-gradient and
    multiplies ``A * grad log pi`` as in :func:`cispo_loss`. The sign of the
    advantage stands for correctness (with group-relative advantages the two
    coincide whenever the group carries signal). The paper finds that tight
    clipping on incorrect responses causes collapse, so our defaults leave the
    negative side loose (``[0, 5]``) and bound the positive side moderately
    (``[0.5, 2]``); the paper's tuned values are not in its abstract.
    Metrics add ``clip_frac_pos`` / ``clip_frac_neg``.
    """
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages
    pos = A > 0
    lo = torch.where(pos, torch.full_like(A, 1.0 - pos_low), torch.full_like(A, 1.0 - neg_low))
    hi = torch.where(pos, torch.full_like(A, 1.0 + pos_high), torch.full_like(A, 1.0 + neg_high))
    w = torch.minimum(torch.maximum(ratio, lo), hi).detach()
    loss = _is_weighted_pg(ratio, w, A)
    m = inp.response_mask
    with torch.no_grad():
        low = (ratio < lo).float()
        high = (ratio > hi).float()
        metrics = _clip_metrics(ratio, log_ratio, low, high, m)
        clipped = torch.clamp(low + high, max=1.0)
        metrics["clip_frac_pos"] = masked_mean(clipped * pos.float(), m)
        metrics["clip_frac_neg"] = masked_mean(clipped * (A < 0).float(), m)
    return loss, metrics


@dataclass(frozen=True)
class SAPOParams:
    """SAPO's gate temperatures (arXiv:2511.20347: tau_pos = 1.0, tau_neg = 1.05)."""

    tau_pos: float = param(1.0, "gate temperature for A > 0 tokens (SAPO paper: 1.0)")
    tau_neg: float = param(1.05, "gate temperature for A < 0 tokens, > tau_pos damps them faster (SAPO paper: 1.05)")


@POLICY_LOSSES.register(
    "sapo",
    paper="Soft Adaptive Policy Optimization (SAPO, arXiv:2511.20347)",
    params=SAPOParams,
)
def sapo_loss(
    inp: PolicyLossInput, *, tau_pos: float, tau_neg: float
) -> Tuple[torch.Tensor, Metrics]:
    """SAPO: a smooth sigmoid gate on the ratio instead of a hard clip.

    ``loss_t = -f(r_t) A_t`` with ``f(r) = (4 / tau) * sigmoid(tau (r - 1))``,
    ``tau = tau_pos`` for ``A > 0`` and ``tau_neg`` for ``A < 0`` (negative
    tokens are damped a little faster: ``tau_neg > tau_pos``). The gradient is
    ``4 s (1 - s) r * A * grad log pi`` with ``s = sigmoid(tau (r - 1))``: exactly
    the plain policy gradient at ``r = 1``, fading smoothly as the token drifts
    off-policy, so a few off-policy tokens are down-weighted without dropping
    the whole sequence. ``clip_frac`` here is the share of tokens whose gate
    weight ``4 s (1 - s)`` is below 1/2 (soft-clipped, our metric).
    """
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages
    tau = torch.where(A > 0, torch.full_like(A, tau_pos), torch.full_like(A, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * gate * A
    with torch.no_grad():
        wgt = 4.0 * gate * (1.0 - gate)
        soft = (wgt < 0.5).float()
        low = soft * (ratio < 1.0).float()
        high = soft * (ratio > 1.0).float()
        metrics = _clip_metrics(ratio, log_ratio, low, high, inp.response_mask)
        metrics["gate_weight_mean"] = masked_mean(wgt, inp.response_mask)
    return loss, metrics


def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token centred covariance ``(log pi_t - mean log pi) (A_t - mean A)`` over masked tokens.

    From "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models" (arXiv:2505.22617): tokens with a large positive covariance are the
    ones that drive entropy down. No grad. Shapes ``[B, R]`` -> ``[B, R]``.
    """
    with torch.no_grad():
        lp = logprobs.detach().float()
        A = advantages.float()
        return (lp - masked_mean(lp, mask)) * (A - masked_mean(A, mask)) * mask


def _batch_covariance(inp: PolicyLossInput) -> Tuple[PolicyLossInput, torch.Tensor, torch.Tensor]:
    """``(batch, rows, cov [N, R])``: :func:`token_covariance` over the whole batch (see :func:`batch_view`)."""
    full, rows = batch_view(inp)
    return full, rows, token_covariance(full.logprobs, full.advantages, full.response_mask)


def _n_select(ratio: float, n_tokens: int) -> int:
    """``max(1, int(ratio * n_tokens))`` (truncation, as the authors' release: Entropy-Mechanism-of-RL
    ``verl/trainer/ppo/core_algos.py`` lines 458 and 501); 0 without tokens."""
    return max(1, int(ratio * n_tokens)) if n_tokens > 0 else 0


def _cov_metrics(ratio, log_ratio, sel, A, cov, m) -> Metrics:
    """Metrics of the covariance losses: the ``[B, R]`` bool ``sel`` tokens count as clipped
    (low when ``A < 0``, else high), plus ``cov_mean``; no grad."""
    with torch.no_grad():
        f = sel.float()
        metrics = _clip_metrics(ratio, log_ratio, f * (A < 0).float(), f * (A >= 0).float(), m)
        metrics["cov_mean"] = masked_mean(cov, m)
    return metrics


@dataclass(frozen=True)
class ClipCovParams:
    """Clip-Cov's token selection (arXiv:2505.22617: ratio 2e-4, covariance bounds 1 and 5)."""

    clip_cov_ratio: float = param(2e-4, "share of response tokens whose loss is zeroed (paper: 2e-4)")
    cov_lb: float = param(1.0, "lower covariance bound of the candidates, strict (paper: 1)")
    cov_ub: float = param(5.0, "upper covariance bound of the candidates, strict (paper: 5)")
    eps_low: float = param(0.2, "PPO clip kept on the other tokens: ratio floor 1 - eps_low (authors' release: 0.2)")
    eps_high: float = param(0.2, "PPO clip: ratio ceiling 1 + eps_high (authors' release: 0.2)")


@POLICY_LOSSES.register(
    "clip_cov",
    paper="The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models (Clip-Cov, arXiv:2505.22617)",
    params=ClipCovParams,
    batch_statistics=True,
    clip_frac_counts="the covariance-selected tokens whose gradient is cut, besides the ratio clip",
)
def clip_cov_loss(
    inp: PolicyLossInput,
    *,
    clip_cov_ratio: float,
    cov_lb: float,
    cov_ub: float,
    eps_low: float,
    eps_high: float,
) -> Tuple[torch.Tensor, Metrics]:
    """Clip-Cov: the PPO clipped surrogate, with the loss of a few high-covariance tokens set to 0.

    Follows the authors' release (PRIME-RL/Entropy-Mechanism-of-RL,
    ``verl/trainer/ppo/core_algos.py``, ``compute_policy_loss_clip_cov``, lines 469-518; verl's
    ``clip_cov`` is the same): every token gets PPO's ``max(-A r, -A clip(r, 1-eps_low, 1+eps_high))``
    (eps 0.2 both sides); tokens PPO clips are not candidates; among the rest, tokens whose
    covariance (:func:`token_covariance`) lies strictly inside ``(cov_lb, cov_ub)`` are candidates,
    and ``max(1, int(clip_cov_ratio * N))`` of them (``N`` = response tokens of the whole
    mini-batch, :func:`batch_view`) are drawn at random (with ``inp.seed``, else torch's global
    RNG) and get loss 0 (no value, no gradient). The paper's Eq. describes only the selection (no
    PPO clip); the release is what its results were trained with. Defaults: ratio 2e-4, bounds 1
    and 5, eps 0.2. ``clip_frac`` reports the zeroed share. Shapes: ``[B, R]`` in and out.
    """
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages
    m = inp.response_mask
    full, rows, cov_all = _batch_covariance(inp)
    fm = full.response_mask
    with torch.no_grad():
        fr = torch.exp(full.logprobs.detach() - full.old_logprobs.detach())
        fa = full.advantages
        clipped_all = (-fa * fr.clamp(1.0 - eps_low, 1.0 + eps_high) > -fa * fr) & (fm > 0)
    cand_mask = (cov_all > cov_lb) & (cov_all < cov_ub) & (fm > 0) & ~clipped_all
    cand = torch.nonzero(cand_mask.flatten(), as_tuple=False).flatten()
    sel_all = torch.zeros(fm.numel(), dtype=torch.bool, device=fm.device)
    k = min(_n_select(clip_cov_ratio, int(fm.sum())), cand.numel())
    if k > 0:
        gen = None if inp.seed is None else torch.Generator(device="cpu").manual_seed(int(inp.seed))
        perm = torch.randperm(cand.numel(), generator=gen).to(cand.device)
        sel_all[cand[perm[:k]]] = True
    sel = sel_all.view_as(fm)[rows]
    cov = cov_all[rows]
    ppo = torch.maximum(-A * ratio, -A * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    loss = torch.where(sel, torch.zeros_like(ppo), ppo)
    return loss, _cov_metrics(ratio, log_ratio, sel, A, cov, m)


@dataclass(frozen=True)
class KLCovParams:
    """KL-Cov's token selection and penalty (arXiv:2505.22617: k = 2e-3 for 7B-class models, coefficient 1)."""

    kl_cov_ratio: float = param(2e-3, "share of response tokens (top covariance) that get the KL penalty (paper, 7B: 2e-3)")
    kl_coef: float = param(1.0, "coefficient of the |log pi - log pi_old| penalty (paper: 1)")


@POLICY_LOSSES.register(
    "kl_cov",
    paper="The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models (KL-Cov, arXiv:2505.22617)",
    params=KLCovParams,
    batch_statistics=True,
    clip_frac_counts="the top-covariance tokens that get the KL penalty (no ratio clip)",
)
def kl_cov_loss(
    inp: PolicyLossInput, *, kl_cov_ratio: float, kl_coef: float
) -> Tuple[torch.Tensor, Metrics]:
    """KL-Cov: a KL penalty on the top-covariance tokens only.

    The ``max(1, int(kl_cov_ratio * N))`` response tokens (truncated, as the authors' release:
    Entropy-Mechanism-of-RL ``verl/trainer/ppo/core_algos.py`` line 458) with the largest
    covariance (:func:`token_covariance`) get
    ``loss = -A r + kl_coef * |log pi - log pi_old|``; all others ``-A r``
    (no PPO clip). ``kl_cov_ratio = 2e-3`` is the paper's setting for 7B-class
    models, ``kl_coef = 1``. ``N`` and the top tokens are those of the whole
    mini-batch (:func:`batch_view`). ``clip_frac`` reports the share of
    penalised tokens.
    """
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages
    m = inp.response_mask
    full, rows, cov_all = _batch_covariance(inp)
    fm = full.response_mask
    n = int(fm.sum())
    k = min(_n_select(kl_cov_ratio, n), n)
    sel_all = torch.zeros(fm.numel(), dtype=torch.bool, device=fm.device)
    if k > 0:
        masked = torch.where(fm > 0, cov_all, torch.full_like(cov_all, float("-inf"))).flatten()
        sel_all[torch.topk(masked, k).indices] = True
    sel = sel_all.view_as(fm)[rows]
    cov = cov_all[rows]
    loss = -A * ratio + kl_coef * sel.float() * (inp.logprobs - inp.old_logprobs).abs()
    return loss, _cov_metrics(ratio, log_ratio, sel, A, cov, m)


@POLICY_LOSSES.register(
    "gpg",
    paper="GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning (arXiv:2504.02546)",
)
def gpg_loss(inp: PolicyLossInput) -> Tuple[torch.Tensor, Metrics]:
    """GPG / plain REINFORCE: ``loss_t = -A_t * log pi(y_t)``, no ratio, no clip.

    Valid for on-policy updates (one optimizer step per batch); there is no
    trust region. Ratio metrics are still reported.
    """
    ratio, log_ratio = _ratio(inp)
    loss = -inp.advantages * inp.logprobs
    z = torch.zeros_like(ratio)
    return loss, _clip_metrics(ratio, log_ratio, z, z, inp.response_mask)


@POLICY_LOSSES.register(
    "sft",
    paper="Supervised fine-tuning (maximum likelihood), for hybrid SFT/RL schedules",
    needs_reference_responses=True,
)
def sft_loss(inp: PolicyLossInput) -> Tuple[torch.Tensor, Metrics]:
    """Negative log-likelihood ``-log pi(y_t)`` of the response tokens; advantages are ignored.

    Meant for batches whose responses are reference answers (the trainer swaps
    them in when the loss is tagged ``needs_reference_responses``). Metric
    ``nll`` is the masked mean NLL.
    """
    ratio, log_ratio = _ratio(inp)
    loss = -inp.logprobs
    z = torch.zeros_like(ratio)
    metrics = _clip_metrics(ratio, log_ratio, z, z, inp.response_mask)
    metrics["nll"] = masked_mean(loss.detach(), inp.response_mask)
    return loss, metrics


@dataclass(frozen=True)
class HAPOParams:
    """HAPO's token-aware clipping and redistribution (arXiv:2509.16591; the authors' released values)."""

    eps_low: float = param(0.2, "base lower clip before entropy adaptation (DAPO's 0.2, HAPO's base)")
    eps_high: float = param(0.28, "base upper clip before entropy adaptation (DAPO clip-higher 0.28, HAPO's base)")
    dual_clip: Optional[float] = param(3.0, "dual-clip constant c > 1 for A < 0 tokens, or null (authors' release: 3)")
    clip_alpha: float = param(1.0, "strength of Asymmetric Adaptive Clipping (authors: 1)")
    adv_beta: float = param(1.0, "strength of Differential Advantage Redistribution (authors: 1)")
    entropy_pivot: float = param(0.5, "entropy quantile that maps to h_hat = 0 (authors: 0.5)")
    adaptive_clip: bool = param(True, "turn Asymmetric Adaptive Clipping on")
    adaptive_advantage: bool = param(True, "turn Differential Advantage Redistribution on")


@POLICY_LOSSES.register(
    "hapo",
    paper="From Uniform to Heterogeneous: Tailoring Policy Optimization to Every Token's Nature "
    "(HAPO, arXiv:2509.16591): Asymmetric Adaptive Clipping + Differential Advantage Redistribution",
    params=HAPOParams,
    needs_entropy=True,
    batch_statistics=True,
)
def hapo_loss(
    inp: PolicyLossInput,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: Optional[float],
    clip_alpha: float,
    adv_beta: float,
    entropy_pivot: float,
    adaptive_clip: bool,
    adaptive_advantage: bool,
) -> Tuple[torch.Tensor, Metrics]:
    """HAPO's token-aware PPO surrogate.

    From the detached token entropies, ``h_hat`` in [-1, 1]
    (:func:`rlpost.algos.hapo.entropy_hhat`, statistics over the response
    tokens of the whole mini-batch, :func:`batch_view`) sets per token:

    * Asymmetric Adaptive Clipping (:func:`rlpost.algos.hapo.adaptive_clip_range`):
      low-entropy tokens get a wider lower bound, high-entropy ones a wider
      upper bound, scaled by ``clip_alpha``;
    * Differential Advantage Redistribution
      (:func:`rlpost.algos.hapo.redistribute_advantage`): ``A (1 + adv_beta h_hat)``
      applied outside (high-entropy) or inside (low-entropy) the neutral zone.

    Then the PPO clipped surrogate with those per-token ranges and dual-clip
    ``c = 3`` (as the authors' release). ``clip_alpha = adv_beta = 1`` are the
    authors' settings; base ``eps`` are DAPO's clip-higher 0.2 / 0.28.
    HAPO's Adaptive Temperature Sampling is not part of the loss: it belongs to
    ``sampler=adaptive_temperature`` (its ``tau``), and a config that sets
    ``algo.loss_params.temperature_tau`` is refused
    (:func:`rlpost.methods.hapo.check_sampler`).

    Raises:
        ValueError: ``inp.entropy`` is None (HAPO needs the token entropies).
    """

    if inp.entropy is None:
        raise ValueError("hapo loss needs per-token entropy (PolicyLossInput.entropy)")
    m = inp.response_mask
    ratio, log_ratio = _ratio(inp)
    full, rows = batch_view(inp)
    h_hat = entropy_hhat(full.entropy, full.response_mask, entropy_pivot)[0][rows]
    if adaptive_clip:
        lo, hi = adaptive_clip_range(h_hat, eps_low, eps_high, clip_alpha)
    else:
        lo, hi = torch.full_like(h_hat, eps_low), torch.full_like(h_hat, eps_high)
    A = inp.advantages
    if adaptive_advantage:
        with torch.no_grad():
            A = redistribute_advantage(A, h_hat, ratio.detach(), lo, hi, adv_beta)
    loss, low, high, extra = _ppo_core(ratio, A, lo, hi, dual_clip, m)
    metrics = _clip_metrics(ratio, log_ratio, low, high, m)
    metrics.update(extra)
    with torch.no_grad():
        metrics["eps_low_mean"] = masked_mean(lo, m)
        metrics["eps_high_mean"] = masked_mean(hi, m)
    return loss, metrics


@dataclass(frozen=True)
class AEPOParams:
    """AEPO's entropy-balanced update (arXiv:2510.14545) on a clip-higher base."""

    eps_low: float = param(0.2, "lower clip (DAPO's 0.2, AEPO's base)")
    eps_high: float = param(0.28, "upper clip; clipped-high, high-entropy tokens keep a gradient rescaled to it (0.28)")
    entropy_adv_alpha: float = param(0.3, "entropy-aware advantage A (1 + alpha z_H) (our reading of the paper: 0.3)")
    entropy_quantile: float = param(0.5, "entropy quantile above which a clipped-high token keeps its gradient")


@POLICY_LOSSES.register(
    "aepo",
    paper="Agentic Entropy-Balanced Policy Optimization (AEPO, arXiv:2510.14545): entropy-balanced update",
    params=AEPOParams,
    needs_entropy=True,
    batch_statistics=True,
)
def aepo_loss(
    inp: PolicyLossInput,
    *,
    eps_low: float,
    eps_high: float,
    entropy_adv_alpha: float,
    entropy_quantile: float,
) -> Tuple[torch.Tensor, Metrics]:
    """AEPO's Entropy-Balanced Policy Optimization (the update side).

    1. Entropy-aware advantage: ``A' = A * (1 + alpha * z)`` with ``z`` the token
       entropy standardised over the response tokens of the whole mini-batch
       (:func:`batch_view`) and clipped to
       [-1, 1], so uncertain tokens weigh more (``alpha = 0.3``; our reading of
       the paper's entropy-advantage term, whose tool-call structure a
       single-turn task does not have).
    2. Stop-gradient in the high-entropy clipping term: for a token with
       ``A' > 0``, ``r > 1 + eps_high`` and entropy above the mini-batch's
       ``entropy_quantile``, the clipped constant ``(1 + eps_high) A'`` is
       rewritten as ``sg((1 + eps_high) / r) * r * A'``: the same value, but the
       gradient ``(1 + eps_high) A' grad log pi`` survives (rescaled to the clip
       boundary) instead of being zeroed. Every other token follows the PPO
       clipped surrogate; low-entropy tokens clipped high keep zero gradient.

    Metrics add ``clip_frac_high_kept`` (clipped-high tokens whose gradient is
    kept).

    Raises:
        ValueError: ``inp.entropy`` is None.
    """
    if inp.entropy is None:
        raise ValueError("aepo loss needs per-token entropy (PolicyLossInput.entropy)")
    m = inp.response_mask
    ratio, log_ratio = _ratio(inp)
    full, _rows = batch_view(inp)
    with torch.no_grad():
        H = inp.entropy.float()
        H_all, m_all = full.entropy.float(), full.response_mask
        mu = masked_mean(H_all, m_all)
        sd = masked_mean((H_all - mu) ** 2, m_all).sqrt()
        z = torch.where(sd > 0, ((H - mu) / sd.clamp(min=1e-8)).clamp(-1.0, 1.0), torch.zeros_like(H))
        A = inp.advantages * (1.0 + entropy_adv_alpha * z)
        thr = masked_quantile(H_all, m_all, entropy_quantile)
        high_ent = H > thr
    loss, low, high, _extra = _ppo_core(ratio, A, torch.full_like(A, eps_low), torch.full_like(A, eps_high), None, m)
    keep = (high > 0) & high_ent
    preserved = -A * ((1.0 + eps_high) / ratio).detach() * ratio
    loss = torch.where(keep, preserved, loss)
    metrics = _clip_metrics(ratio, log_ratio, low, high, m)
    metrics["clip_frac_high_kept"] = masked_mean(keep.float(), m)
    return loss, metrics


class AdvScale(Choice):
    """How GAPO's clip range grows with ``|A|``."""

    linear = "linear"
    sqrt = "sqrt"


class RatioLevel(Choice):
    """Which importance ratio a surrogate clips: per token (PPO) or per sequence (GSPO)."""

    token = "token"
    sequence = "sequence"


@dataclass(frozen=True)
class GAPOParams:
    """GAPO's advantage-scaled clip range; the abstract gives no form or caps: ours."""

    eps_low: float = param(0.2, "base lower clip, scaled by g(|A_i|) (PPO's 0.2)")
    eps_high: float = param(0.2, "base upper clip, scaled by g(|A_i|) (PPO's 0.2)")
    adv_scale: AdvScale = param(AdvScale.linear, "g(a) = max(1, a) (linear) or max(1, sqrt(a)) (sqrt) (our choice)")
    eps_low_max: float = param(0.5, "cap of the scaled lower clip (our choice)")
    eps_high_max: float = param(1.0, "cap of the scaled upper clip (our choice)")
    ratio_level: RatioLevel = param(RatioLevel.token, "token: PPO's ratio; sequence: GSPO's length-normalised ratio")


@POLICY_LOSSES.register(
    "gapo",
    paper="GAPO: Group Adaptive Clipping Policy Optimization (arXiv:2609.00444)",
    params=GAPOParams,
)
def gapo_loss(
    inp: PolicyLossInput,
    *,
    eps_low: float,
    eps_high: float,
    adv_scale: str,
    eps_low_max: float,
    eps_high_max: float,
    ratio_level: str,
) -> Tuple[torch.Tensor, Metrics]:
    """GAPO: each rollout's clip range grows with its advantage.

    Per sequence ``i`` with advantage ``A_i`` (the sequence mean of the token
    advantages): ``eps_i = eps * g(|A_i|)`` with ``g(a) = max(1, a)``
    (``adv_scale='linear'``) or ``max(1, sqrt(a))`` (``'sqrt'``), capped at
    ``eps_low_max`` / ``eps_high_max``. A reverse-KL trust region gives the
    optimal ratio ``exp(A / beta)``, so the admissible log-ratio move scales with
    the advantage: rare correct rollouts on hard prompts (large ``A``) get more
    headroom, ordinary ones keep the base range. The surrogate is otherwise
    PPO's (``ratio_level='token'``) or GSPO's sequence ratio
    (``ratio_level='sequence'``). The functional form ``g`` and the caps are our
    choice; the abstract gives neither. Metric ``eps_high_mean``.

    Raises:
        ValueError: unknown ``adv_scale`` or ``ratio_level``.
    """
    if adv_scale not in ("linear", "sqrt"):
        raise ValueError(f"adv_scale must be 'linear' or 'sqrt', got {adv_scale!r}")
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"ratio_level must be 'token' or 'sequence', got {ratio_level!r}")
    m = inp.response_mask
    token_ratio, log_ratio = _ratio(inp)
    if ratio_level == "sequence":
        log_s = _seq_mean(log_ratio, m)
        ratio = torch.exp(log_s.detach()[:, None] + inp.logprobs - inp.logprobs.detach())
    else:
        ratio = token_ratio
    with torch.no_grad():
        a = _seq_mean(inp.advantages, m).abs()
        g = torch.clamp(a, min=1.0) if adv_scale == "linear" else torch.clamp(a.sqrt(), min=1.0)
        lo = (eps_low * g).clamp(max=eps_low_max)[:, None].expand_as(log_ratio)
        hi = (eps_high * g).clamp(max=eps_high_max)[:, None].expand_as(log_ratio)
    loss, low, high, _ = _ppo_core(ratio, inp.advantages, lo, hi, None, m)
    metrics = _clip_metrics(token_ratio, log_ratio, low, high, m)
    metrics["eps_high_mean"] = masked_mean(hi, m)
    return loss, metrics


class RECClip(Choice):
    """Which tokens REC keeps (the rest get no gradient), by ratio ``r`` and advantage sign."""

    none = "none"
    one_side = "one_side"
    two_side = "two_side"
    ring = "ring"


class RECWeight(Choice):
    """The stop-gradient weight REC puts on ``A * grad log pi``."""

    none = "none"
    importance_sampling = "importance_sampling"
    truncated_importance_sampling = "truncated_importance_sampling"
    advantage = "advantage"


class RECRegularizer(Choice):
    """REC's additive regulariser: OPMD's squared log-ratio (k2) or AsymRE's ``-log pi`` (forward_kl)."""

    none = "none"
    k2 = "k2"
    forward_kl = "forward_kl"


_REC_PAPER = ("Group-Relative REINFORCE Is Secretly an Off-Policy Algorithm: Demystifying Some Myths About "
              "GRPO and Its Friends (arXiv:2509.24203)")


@dataclass(frozen=True)
class RECParams:
    """Group-relative REINFORCE family of arXiv:2509.24203 (authors' release, Trinity-RFT examples/rec_gsm8k)."""

    clip_mode: RECClip = param(RECClip.one_side, "none | one_side (PPO's side) | two_side | ring; default REC-OneSide")
    weight: RECWeight = param(RECWeight.none, "none (NoIS) | importance_sampling | truncated_importance_sampling | advantage (RED-Weight)")
    eps_low: float = param(0.2, "keep ratio >= 1 - eps_low (authors' release: 0.2)")
    eps_high: float = param(0.2, "keep ratio <= 1 + eps_high (authors' release: 0.2)")
    eps_low_prime: float = param(0.6, "ring: A >= 0 tokens with ratio <= 1 - eps_low_prime also kept; TIS floor (authors' release: 0.6)")
    eps_high_prime: float = param(2.0, "ring: A <= 0 tokens with ratio >= 1 + eps_high_prime also kept; TIS cap (authors' release: 2)")
    regularizer: RECRegularizer = param(RECRegularizer.none, "none | k2 (OPMD) | forward_kl (AsymRE)")
    regularizer_coef: float = param(0.0, "coefficient tau of the regulariser (authors' release: 0)")
    temp: float = param(1.0, "temperature of weight=advantage, w = exp(A / temp) (authors' release: 1)")


@POLICY_LOSSES.register("rec", paper=_REC_PAPER, params=RECParams)
def rec_loss(
    inp: PolicyLossInput,
    *,
    clip_mode: str,
    weight: str,
    eps_low: float,
    eps_high: float,
    eps_low_prime: float,
    eps_high_prime: float,
    regularizer: str,
    regularizer_coef: float,
    temp: float,
) -> Tuple[torch.Tensor, Metrics]:
    """Group-relative REINFORCE with regularisation by clipping (REC) or by an added term (REP).

    The paper derives group-relative REINFORCE, ``-A_t grad log pi(y_t)`` with
    ``A`` the group-centred reward, without assuming the data come from the
    current policy; off-policy it only needs the update regularised. The loss
    per token (``r = pi / pi_old``, all weights detached):

    ``loss_t = -keep_t * w_t * A_t * r_t / sg(r_t)  +  reg_t``

    so its gradient is ``-keep_t w_t A_t grad log pi`` (the value is ``-keep w A``).

    * ``keep`` (``clip_mode``): ``none`` 1; ``one_side`` PPO's binding side,
      ``r <= 1 + eps_high`` for ``A >= 0`` and ``r >= 1 - eps_low`` for ``A <= 0``;
      ``two_side`` ``1 - eps_low <= r <= 1 + eps_high``; ``ring`` two_side, plus
      ``A >= 0`` tokens with ``r <= 1 - eps_low_prime`` and ``A <= 0`` tokens with
      ``r >= 1 + eps_high_prime`` (the updates that move the ratio back to 1).
    * ``w`` (``weight``): ``none`` 1 (NoIS, the paper's recommendation);
      ``importance_sampling`` ``r`` (with one_side this is GRPO's gradient);
      ``truncated_importance_sampling`` ``clip(r, 1 - eps_low_prime, 1 + eps_high_prime)``;
      ``advantage`` ``exp(A / temp)`` (RED-Weight: up-weights high-reward samples).
    * ``reg`` (``regularizer``): ``k2`` ``tau (log pi - log pi_old)^2`` (Kimi's
      OPMD, the 1/2 absorbed into tau as in the release); ``forward_kl``
      ``-tau log pi`` (Meta's AsymRE: its gradient is REINFORCE with the
      baseline lowered by tau; written ``-tau (log pi - log pi_old)``, same
      gradient, value 0 on-policy).

    Returns:
        ``(loss_mat [B, R], metrics)``; ``clip_frac`` is the share of tokens not kept.
    Raises:
        ValueError: an unknown ``clip_mode`` / ``weight`` / ``regularizer``, or ``temp <= 0``.
    """
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages
    r = ratio.detach()
    in_band = (r >= 1.0 - eps_low) & (r <= 1.0 + eps_high)
    if clip_mode == "none":
        keep = torch.ones_like(r, dtype=torch.bool)
    elif clip_mode == "one_side":
        keep = ((A >= 0) & (r <= 1.0 + eps_high)) | ((A <= 0) & (r >= 1.0 - eps_low))
    elif clip_mode == "two_side":
        keep = in_band
    elif clip_mode == "ring":
        keep = in_band | ((A >= 0) & (r <= 1.0 - eps_low_prime)) | ((A <= 0) & (r >= 1.0 + eps_high_prime))
    else:
        raise ValueError(f"rec: clip_mode={clip_mode!r}: valid choices are {', '.join(c.value for c in RECClip)}")
    if weight == "none":
        w = torch.ones_like(r)
    elif weight == "importance_sampling":
        w = r
    elif weight == "truncated_importance_sampling":
        w = r.clamp(1.0 - eps_low_prime, 1.0 + eps_high_prime)
    elif weight == "advantage":
        if temp <= 0:
            raise ValueError(f"rec: temp must be > 0, got {temp}")
        w = torch.exp(A / temp)
    else:
        raise ValueError(f"rec: weight={weight!r}: valid choices are {', '.join(c.value for c in RECWeight)}")
    loss = _is_weighted_pg(ratio, (w * keep.float()).detach(), A)
    if regularizer == "k2":
        loss = loss + regularizer_coef * (inp.logprobs - inp.old_logprobs) ** 2
    elif regularizer == "forward_kl":
        loss = loss - regularizer_coef * (inp.logprobs - inp.old_logprobs)
    elif regularizer != "none":
        raise ValueError(f"rec: regularizer={regularizer!r}: valid choices are "
                         f"{', '.join(c.value for c in RECRegularizer)}")
    with torch.no_grad():
        dropped = (~keep).float()
        low = dropped * (r < 1.0).float()
        high = dropped * (r >= 1.0).float()
    return loss, _clip_metrics(ratio, log_ratio, low, high, inp.response_mask)


class Divergence(Choice):
    """DPPO's per-token divergence: binary total variation or binary KL."""

    tv = "tv"
    kl = "kl"


class DPPODirection(Choice):
    """DPPO's direction test: the ratio's (PPO's) or the predicted change of the divergence (arXiv:2607.10848)."""

    ratio = "ratio"
    predictive = "predictive"


class TopKEstimator(Choice):
    """How the predictive mask reads a top-K support (:mod:`rlpost.algos.predictive_mask`)."""

    tail = "tail"
    renorm = "renorm"


class DPPOAnchor(Choice):
    """The policy DPPO's trust region is centred on: the rollout (behaviour) policy or the recomputed old one."""

    rollout = "rollout"
    old = "old"


@dataclass(frozen=True)
class DPPOParams:
    """DPPO's divergence trust region (arXiv:2602.04879; authors' Stable-RL release and run script)."""

    divergence: Divergence = param(Divergence.tv, "tv: |pi - mu| of the sampled token; kl: binary KL (sampled token vs the rest)")
    eps_low: float = param(0.15, "threshold for A <= 0 tokens whose probability falls (authors' run script: 0.15 TV, use 0.05 for KL)")
    eps_high: float = param(0.15, "threshold for A > 0 tokens whose probability rises (authors' run script: 0.15 TV, use 0.05 for KL)")
    anchor: DPPOAnchor = param(DPPOAnchor.rollout, "rollout: centre on the behaviour policy (the authors' recommended bypass mode); old: recomputed")
    ratio_cap: float = param(1e4, "cap on the detached IS ratio pi / mu (authors' run script: 10000, i.e. off)")
    direction: DPPODirection = param(DPPODirection.ratio, "ratio: DPPO's direction test; predictive: mask only if the step is "
                                     "predicted to raise the top-K divergence (arXiv:2607.10848; needs anchor=old)")
    topk_estimator: TopKEstimator = param(TopKEstimator.tail, "predictive: tail (support + rest-of-mass category) or renorm")
    topk: int = param(16, "predictive: support size K per position (the sampled token + the anchor's top tokens)")


def _binary_kl(p_anchor: torch.Tensor, lp_anchor: torch.Tensor, p: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(mu) || Bernoulli(pi)) of "the sampled token vs every other token", ``[B, R]`` nats."""
    return p_anchor * (lp_anchor - lp) + (1.0 - p_anchor) * torch.log((1.0 - p_anchor + 1e-8) / (1.0 - p + 1e-8))


@POLICY_LOSSES.register(
    "dppo",
    paper="Rethinking the Trust Region in LLM Reinforcement Learning (DPPO, arXiv:2602.04879)",
    params=DPPOParams, extras=("region_support_logprobs", "region_anchor_logprobs"), optional_extras=("region_support_logprobs", "region_anchor_logprobs"))
def dppo_loss(
    inp: PolicyLossInput,
    *,
    divergence: str,
    eps_low: float,
    eps_high: float,
    anchor: str,
    ratio_cap: float,
    direction: str,
    topk_estimator: str,
    topk: int,
) -> Tuple[torch.Tensor, Metrics]:
    """DPPO: importance-weighted policy gradient masked by a divergence trust region, not a ratio clip.

    PPO's ratio ``pi / mu`` of the sampled token is a one-sample estimate of the
    policy change that over-penalises rare tokens (1e-5 -> 1e-3 is a ratio of
    100) and under-constrains likely ones (0.99 -> 0.8 is a ratio of 0.81).
    DPPO measures the change by a divergence of the binary distribution
    "sampled token vs the rest" (the paper's Binary approximation; ``mu`` the
    anchor probability, ``pi`` the current one):

    * ``tv``: ``pi - mu``; a token is out of the region when ``pi - mu > eps_high``
      with ``A > 0`` or ``pi - mu < -eps_low`` with ``A <= 0``;
    * ``kl``: ``mu log(mu / pi) + (1 - mu) log((1 - mu) / (1 - pi))``; out when it
      exceeds ``eps_high`` with ``A > 0`` and ``pi > mu``, or ``eps_low`` with
      ``A <= 0`` and ``pi < mu``.

    Loss per token: ``-A * sg(min(pi / mu, ratio_cap) * keep) * log pi`` (as the
    release), written ``-A * sg(w / r) * r`` so its value is ``-A w`` and its
    gradient ``-A w grad log pi``; tokens outside the region get no gradient.
    ``anchor="rollout"`` centres the region and the ratio on
    ``inp.rollout_logprobs`` (the release's recommended bypass mode; falls back to
    ``old_logprobs`` when None); ``"old"`` on the recomputed ``old_logprobs``. The
    Top-K approximation needs the full vocabulary distributions, which the loss
    interface does not carry: not implemented.

    ``direction="predictive"`` ("Predictive Divergence Masks for LLM RL",
    arXiv:2607.10848; :mod:`rlpost.algos.predictive_mask`): proximity and direction
    both use the ``divergence`` (tv or KL(mu || pi)) over a top-``topk`` support of the
    anchor (``topk_estimator``), and a token is masked when it is outside the region
    and the policy-gradient step on it is predicted, in closed form, to raise that
    divergence. Reads ``inp.extras["region_anchor_logprobs"]`` / ``inp.extras["region_support_logprobs"]``
    (the runner records the pre-update policy's top-K in its old-log-probs pass, so
    it needs ``anchor=old``; the rollout engines do not record the behaviour policy's).

    Returns:
        ``(loss_mat [B, R], metrics)``; ``clip_frac`` is the share of masked tokens;
        with ``predictive``, ``region_divergence`` (mean top-K divergence) and
        ``direction_disagree`` (share of tokens whose predicted direction differs from the ratio's).
    Raises:
        ValueError: an unknown ``divergence``, ``anchor`` or ``direction``, or
            ``predictive`` without the support log-probs.
    """
    if anchor == "rollout":
        lp_mu = inp.rollout_logprobs if inp.rollout_logprobs is not None else inp.old_logprobs
    elif anchor == "old":
        lp_mu = inp.old_logprobs
    else:
        raise ValueError(f"dppo: anchor={anchor!r}: valid choices are {', '.join(c.value for c in DPPOAnchor)}")
    lp_mu = lp_mu.detach()
    A = inp.advantages
    with torch.no_grad():
        lp = inp.logprobs.detach()
        p, mu = torch.exp(lp), torch.exp(lp_mu)
        if divergence == "tv":
            bad_pos = (p - mu) > eps_high
            bad_neg = (p - mu) < -eps_low
        elif divergence == "kl":
            kl = _binary_kl(mu, lp_mu, p, lp)
            bad_pos = (kl > eps_high) & (p > mu)
            bad_neg = (kl > eps_low) & (p < mu)
        else:
            raise ValueError(f"dppo: divergence={divergence!r}: valid choices are {', '.join(c.value for c in Divergence)}")
        bad = torch.where(A > 0, bad_pos, bad_neg)
        extra: Metrics = {}
        if direction == "predictive":
            from rlpost.algos.predictive_mask import predictive_out_of_region

            if inp.extras.get("region_support_logprobs") is None or inp.extras.get("region_anchor_logprobs") is None:
                raise ValueError("dppo direction=predictive needs region_support_logprobs and region_anchor_logprobs "
                                 "(the runner records the anchor's top-K with algo.loss_params.anchor=old)")
            bad, D, dD = predictive_out_of_region(inp.extras.get("region_support_logprobs").detach(), inp.extras.get("region_anchor_logprobs"),
                                                  A, divergence, topk_estimator, eps_low, eps_high)
            ratio_dir = (A * (p - mu)) > 0
            m = inp.response_mask
            extra = {"region_divergence": masked_mean(D.to(m.dtype), m),
                     "direction_disagree": masked_mean(((dD > 0) != ratio_dir).to(m.dtype), m)}
        elif direction != "ratio":
            raise ValueError(f"dppo: direction={direction!r}: valid choices are {', '.join(c.value for c in DPPODirection)}")
        w = torch.exp((lp - lp_mu).clamp(max=20.0)).clamp(max=ratio_cap) * (~bad).float()
    ratio, log_ratio = _ratio(inp)
    loss = _is_weighted_pg(ratio, w, A)
    with torch.no_grad():
        high = (bad & (A > 0)).float()
        low = (bad & (A <= 0)).float()
    return loss, {**_clip_metrics(ratio, log_ratio, low, high, inp.response_mask), **extra}



# --- Issue 17, second batch: TPO, CPGD, CFPO, KPO ---------------------------------------------------

_TPO_PAPER = "Target Policy Optimization (TPO, arXiv:2604.06159); authors' code https://github.com/JeanKaddour/tpo"


@dataclass(frozen=True)
class TPOParams:
    """TPO's target temperature (arXiv:2604.06159: eta = 1 throughout, robust over [0.25, 2])."""

    eta: float = param(1.0, "temperature of the target q ∝ p_old exp(u / eta) (paper: 1)")


def _group_log_softmax(x: torch.Tensor, inv: torch.Tensor, G: int) -> torch.Tensor:
    """``[N]`` log-softmax of ``x`` ``[N]`` within the groups ``inv`` (dense ids in ``[0, G)``), float64."""
    x = x.double()
    mx = torch.full((G,), float("-inf"), dtype=torch.float64, device=x.device).scatter_reduce(
        0, inv, x, reduce="amax", include_self=True)
    z = torch.zeros(G, dtype=torch.float64, device=x.device).index_add_(0, inv, torch.exp(x - mx[inv]))
    return x - mx[inv] - torch.log(z)[inv]


@POLICY_LOSSES.register("tpo", paper=_TPO_PAPER, params=TPOParams, batch_statistics=True, needs_group=True,
                        sequence_sum=True)
def tpo_loss(inp: PolicyLossInput, *, eta: float) -> Tuple[torch.Tensor, Metrics]:
    """TPO: fit the group's distribution over its sampled completions to a target, by cross-entropy.

    For each group of ``K`` completions of one prompt, with sequence log-probs
    ``l_i = sum_t log pi(y_it)`` (over the response mask), the policy over the
    group is ``p_i = softmax_group(l)_i`` and the target is
    ``q_i ∝ p_old_i exp(u_i / eta)`` (``p_old`` from ``inp.old_logprobs``, frozen;
    ``u_i`` the sequence's advantage, which the preset makes TPO's within-group
    z-score with the population std, zero for a zero-variance group). The loss
    ``-sum_i q_i log p_i`` has gradient ``p_i - q_i`` on ``l_i`` (Proposition 1):
    it vanishes once the policy matches the target, and a zero-variance group
    (``u = 0``, ``q = p_old``) contributes nothing on the rollout snapshot.

    Written per token so that it aggregates with ``seq-mean-token-sum`` into the
    paper's loss averaged over groups: ``loss_t = K (p_i - q_i) (log pi_t - sg(log pi_t))
    + v_i / L_i`` with ``v_i = -K q_i log p_i`` (a constant carrying the value),
    ``L_i`` the sequence's response tokens and ``K`` its group's size. ``p_i`` is
    computed from the detached log-probs of the whole mini-batch
    (:func:`batch_view`), so the gradient does not depend on the micro-batch
    split. A group split across mini-batches (``algo.mini_batches > 1`` shuffles
    rows) is fitted on the members present, with ``q`` renormalised over them
    (our choice; the paper updates on whole groups).

    Metrics: ``tpo_target_gap`` (mean ``|p - q|``), ``tpo_q_max`` (mean of the
    group's largest target mass), both per sequence (``seq_`` prefix).

    Raises:
        ValueError: ``inp.group_index`` is None, or ``eta <= 0``.
    """
    if eta <= 0:
        raise ValueError(f"tpo: eta must be > 0, got {eta}")
    if inp.group_index is None:
        raise ValueError("tpo needs PolicyLossInput.group_index (the group of each row); the trainer passes it")
    full, rows = batch_view(inp)
    gi = full.group_index if full.group_index is not None else inp.group_index

    inv, G = group_ids(gi.to(full.response_mask.device))
    fm = full.response_mask.double()
    ell = (full.logprobs.detach().double() * fm).sum(-1)
    ell_old = (full.old_logprobs.detach().double() * fm).sum(-1)
    L = fm.sum(-1)
    u = (full.advantages.double() * fm).sum(-1) / L.clamp(min=1.0)
    log_p = _group_log_softmax(ell, inv, G)
    log_q = _group_log_softmax(_group_log_softmax(ell_old, inv, G) + u / eta, inv, G)
    p, q = torch.exp(log_p), torch.exp(log_q)
    K = torch.zeros(G, dtype=torch.float64, device=fm.device).index_add_(0, inv, torch.ones_like(ell))[inv]
    coef = (K * (p - q))[rows].to(inp.logprobs.dtype)
    value = (-K * q * log_p)[rows]
    m = inp.response_mask
    Lr = m.sum(-1).clamp(min=1.0)
    loss = coef[:, None] * (inp.logprobs - inp.logprobs.detach()) + (value / Lr.double()).to(m.dtype)[:, None] * m
    ratio, log_ratio = _ratio(inp)
    z = torch.zeros_like(ratio)
    metrics = _clip_metrics(ratio, log_ratio, z, z, m)
    with torch.no_grad():
        qmax = torch.zeros(G, dtype=torch.float64, device=fm.device).scatter_reduce(
            0, inv, q, reduce="amax", include_self=True)[inv]
        metrics["seq_tpo_target_gap"] = _nonempty_mean((p - q).abs()[rows].float(), m)
        metrics["seq_tpo_q_max"] = _nonempty_mean(qmax[rows].float(), m)
    return loss, metrics


_CPGD_PAPER = ("CPGD: Toward Stable Rule-based Reinforcement Learning for Language Models (arXiv:2505.12504); "
               "authors' code https://github.com/ModalMinds/MM-EUREKA")


@dataclass(frozen=True)
class CPGDParams:
    """CPGD's log-ratio clip and policy-drift weight (arXiv:2505.12504; the authors' release defaults)."""

    eps_low: float = param(0.2, "A < 0 tokens: log-ratio floor log(1 - eps_low) (authors' release: clip_eps 0.2)")
    eps_high: float = param(0.2, "A > 0 tokens: log-ratio cap log(1 + eps_high) (authors' release: clip_eps 0.2)")
    drift_coef: float = param(0.01, "weight of the policy-drift penalty KL(pi_old || pi) (authors' release: 0.01)")


@POLICY_LOSSES.register("cpgd", paper=_CPGD_PAPER, params=CPGDParams)
def cpgd_loss(
    inp: PolicyLossInput, *, eps_low: float, eps_high: float, drift_coef: float
) -> Tuple[torch.Tensor, Metrics]:
    """CPGD: a clipped *log*-ratio policy gradient plus a KL policy-drift penalty, no importance ratio.

    ``loss_t = -A_t clip_A(log r_t) + drift_coef (r_t - 1 - log r_t)`` with
    ``log r = log pi - log pi_old`` and the one-sided clip of the release:
    ``min(log r, log(1 + eps_high))`` for ``A > 0``, ``max(log r, log(1 - eps_low))``
    otherwise. Inside the range the gradient is ``-A grad log pi`` (REINFORCE,
    not the ratio-weighted PPO gradient, so large ratios are not amplified);
    outside it is 0. The drift term is the unbiased estimate of
    ``KL(pi_old || pi)`` from tokens sampled by ``pi_old``; its gradient
    ``(r - 1) grad log pi`` pulls the policy back toward ``pi_old`` once it moved.
    The release also offers a clip range on the drift term and a
    "clip-filter-like" weight; their formulas were not in the code we could
    read, so neither is implemented (the drift here is unclipped).

    Returns:
        ``(loss_mat [B, R], metrics)``; ``clip_frac*`` count tokens whose
        clipped log-ratio cuts the gradient; ``policy_drift`` the mean drift term.
    Raises:
        ValueError: ``eps_low`` not in [0, 1), ``eps_high <= 0`` or ``drift_coef < 0``.
    """
    if not 0.0 <= eps_low < 1.0 or eps_high <= 0 or drift_coef < 0:
        raise ValueError(f"cpgd: need 0 <= eps_low < 1, eps_high > 0, drift_coef >= 0; got {eps_low}, {eps_high}, {drift_coef}")
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages
    hi, lo = math.log1p(eps_high), math.log1p(-eps_low)
    clipped = torch.where(A > 0, log_ratio.clamp(max=hi), log_ratio.clamp(min=lo))
    drift = ratio - 1.0 - log_ratio
    loss = -A * clipped + drift_coef * drift
    with torch.no_grad():
        high = ((log_ratio > hi) & (A > 0)).float()
        low = ((log_ratio < lo) & (A <= 0)).float()
        metrics = _clip_metrics(ratio, log_ratio, low, high, inp.response_mask)
        metrics["policy_drift"] = masked_mean(drift.detach(), inp.response_mask)
    return loss, metrics


_CFPO_PAPER = ("Clipping-Free Policy Optimization for Large Language Models (CFPO, arXiv:2601.22801); the penalty form "
               "of Simple Policy Optimization (arXiv:2401.16025)")


@dataclass(frozen=True)
class CFPOParams:
    """CFPO's trust-region radius: PPO's epsilon reused, "no additional hyperparameters" (arXiv:2601.22801)."""

    eps: float = param(0.2, "radius of the quadratic penalty: the objective peaks at r = 1 + eps sign(A) (PPO's 0.2)")


@POLICY_LOSSES.register("cfpo", paper=_CFPO_PAPER, params=CFPOParams)
def cfpo_loss(inp: PolicyLossInput, *, eps: float) -> Tuple[torch.Tensor, Metrics]:
    """CFPO: PPO's clip replaced by a convex quadratic penalty on the ratio (differentiable everywhere).

    ``loss_t = -( r_t A_t - |A_t| / (2 eps) (r_t - 1)^2 )``. For fixed ``A`` the
    objective is a concave parabola in ``r`` whose maximum is exactly PPO's
    clip boundary ``r = 1 + eps sign(A)``: inside the range it pulls ``r`` toward
    the boundary like PPO, outside it pushes ``r`` back (PPO's clip only stops
    pushing, leaving a zero-gradient region). The gradient is
    ``-(A - |A| (r - 1) / eps) r grad log pi``; on-policy (``r = 1``) it is
    ``-A grad log pi``. The CFPO abstract describes a convex quadratic penalty
    derived from a total-variation constraint with no new hyperparameter; the
    formula we could read is this one, from Simple Policy Optimization
    (arXiv:2401.16025), which derives it from the same TV bound: our reading.
    ``clip_frac*`` count tokens beyond the boundary (where the gradient reverses).

    Raises:
        ValueError: ``eps <= 0``.
    """
    if eps <= 0:
        raise ValueError(f"cfpo: eps must be > 0, got {eps}")
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages
    loss = -(ratio * A - A.abs() / (2.0 * eps) * (ratio - 1.0) ** 2)
    with torch.no_grad():
        high = ((ratio > 1.0 + eps) & (A > 0)).float()
        low = ((ratio < 1.0 - eps) & (A < 0)).float()
    return loss, _clip_metrics(ratio, log_ratio, low, high, inp.response_mask)


@dataclass(frozen=True)
class KPOParams:
    """KPO's causal Kalman filter on the token log-ratio; the noise variances are our choices (not in the abstract)."""

    process_var: float = param(0.01, "Q: variance of the latent log-ratio's step per token (our choice)")
    obs_var: float = param(0.1, "R: variance of one token's observed log-ratio around the latent one (our choice)")
    init_var: float = param(1.0, "P_0: variance of the prior x_0 = 0 (ratio 1) before the first token (our choice)")
    eps_low: float = param(0.2, "PPO clip on the filtered ratio: floor 1 - eps_low (PPO's 0.2)")
    eps_high: float = param(0.2, "PPO clip on the filtered ratio: cap 1 + eps_high (PPO's 0.2)")


def kalman_filter_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, process_var: float, obs_var: float, init_var: float
) -> torch.Tensor:
    """Causal scalar Kalman filter of each row's token log-ratios, ``[B, R] -> [B, R]`` (differentiable).

    Random-walk state ``x_t = x_{t-1} + w`` (variance ``process_var``), observation
    ``z_t = log r_t = x_t + v`` (variance ``obs_var``), prior ``x_0 = 0`` with
    variance ``init_var``. Per masked token: ``P <- P + Q``, ``K = P / (P + R)``,
    ``x <- x + K (z_t - x)``, ``P <- (1 - K) P``; unmasked positions carry ``x``
    and ``P`` unchanged (and are returned as 0). The gains do not depend on the
    data, so ``x_t`` is a fixed weighted sum of ``z_1..z_t`` and gradients reach
    every earlier token of the row.
    """
    B, R = log_ratio.shape
    x = torch.zeros(B, dtype=log_ratio.dtype, device=log_ratio.device)
    P = torch.full((B,), float(init_var), dtype=torch.float64, device=log_ratio.device)
    out = []
    for t in range(R):
        mt = mask[:, t] > 0
        Pp = P + process_var
        gain = torch.where(mt, Pp / (Pp + obs_var), torch.zeros_like(Pp))
        x = x + gain.to(x.dtype) * (log_ratio[:, t] - x)
        P = torch.where(mt, (1.0 - gain) * Pp, P)
        out.append(x * mt.to(x.dtype))
    return torch.stack(out, dim=1) if out else log_ratio * 0


@POLICY_LOSSES.register(
    "kpo",
    paper="Online Causal Kalman Filtering for Stable and Effective Policy Optimization (KPO, arXiv:2602.10609)",
    params=KPOParams,
)
def kpo_loss(
    inp: PolicyLossInput, *, process_var: float, obs_var: float, init_var: float, eps_low: float, eps_high: float
) -> Tuple[torch.Tensor, Metrics]:
    """KPO: PPO's clipped surrogate on Kalman-filtered importance ratios.

    The token ratio ``r_t = pi / pi_old`` is a noisy observation of a latent
    off-policy deviation that evolves along the sequence; a causal Kalman
    filter (:func:`kalman_filter_log_ratio`, past tokens only) estimates it as
    ``x_t`` in log space, and ``rho_t = exp(x_t)`` replaces ``r_t`` in
    ``-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)``. Spikes of single
    tokens are smoothed (unlike the token ratio) while local structure is kept
    (unlike GSPO's one sequence ratio). On-policy ``rho = 1``; the gradient of a
    token's loss reaches the earlier tokens that its filtered ratio averages.
    The abstract gives no noise variances, prior or clip: ``Q = 0.01``,
    ``R = 0.1`` (steady-state gain about 0.27), ``P_0 = 1`` and PPO's 0.2 are our
    choices. Metric ``kpo_ratio_mean``: mean filtered ratio.

    Raises:
        ValueError: a variance not > 0.
    """
    if min(process_var, obs_var, init_var) <= 0:
        raise ValueError(f"kpo: variances must be > 0, got Q={process_var}, R={obs_var}, P0={init_var}")
    ratio, log_ratio = _ratio(inp)
    x = kalman_filter_log_ratio(log_ratio, inp.response_mask, process_var, obs_var, init_var)
    return _ppo_on_smoothed_log_ratio(inp, ratio, log_ratio, x, eps_low, eps_high, "kpo_ratio_mean")


def _ppo_on_smoothed_log_ratio(inp, ratio, log_ratio, x, eps_low, eps_high, metric):
    """PPO's clipped surrogate with the token ratio replaced by ``exp(x)``, ``x`` ``[B, R]`` a causal
    smoothing of the token log-ratios (shared by KPO's Kalman filter and PNPO's prefix mean);
    ``metric`` names the mean smoothed ratio."""
    m = inp.response_mask
    rho = torch.exp(x.clamp(-20.0, 20.0))
    loss, low, high, _ = _ppo_core(rho, inp.advantages, eps_low, eps_high, None, m)
    metrics = _clip_metrics(ratio, log_ratio, low, high, m)
    metrics[metric] = masked_mean(rho.detach(), m)
    return loss, metrics


@dataclass(frozen=True)
class PNPOParams:
    """PNPO's clip on the prefix-normalised ratio; the abstract gives no range: PPO's 0.2 (our choice)."""

    eps_low: float = param(0.2, "floor 1 - eps_low of the prefix geometric-mean ratio (our choice: PPO's 0.2)")
    eps_high: float = param(0.2, "cap 1 + eps_high of the prefix geometric-mean ratio (our choice: PPO's 0.2)")


def prefix_mean_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]``: the mean of the masked token log-ratios over each token's causal prefix (itself included).

    ``exp`` of it is PNPO's ``(prod_{s<=t} r_s)^(1/t)``; unmasked positions are 0.
    """
    m = mask.to(log_ratio.dtype)
    return torch.cumsum(log_ratio * m, dim=-1) / torch.cumsum(m, dim=-1).clamp(min=1.0) * m


@POLICY_LOSSES.register(
    "pnpo",
    paper="PNPO: Prefix-Normalized Policy Optimization (the geometric mean of the prefix ratios as the token weight)",
    params=PNPOParams,
)
def pnpo_loss(inp: PolicyLossInput, *, eps_low: float, eps_high: float) -> Tuple[torch.Tensor, Metrics]:
    """PNPO: PPO-clip on the geometric mean of the importance ratios over each token's prefix.

    The exact off-policy weight of token ``t`` is the prefix product
    ``prod_{s<=t} r_s``, whose range explodes with ``t``; PNPO uses its geometric
    mean ``rho_t = (prod_{s<=t} r_s)^(1/t)`` (:func:`prefix_mean_log_ratio`): the
    dependence on the causal prefix stays, the log-weight range is compressed.
    ``rho_t`` carries the gradient of every prefix token (``1/t`` each).
    The first token's weight is its own ratio; the last token's is GSPO's
    sequence ratio. The clip range (PPO's 0.2) is our choice. Metric
    ``pnpo_ratio_mean``. Its effect shows when a batch is reused
    (``algo.ppo_epochs > 1``; the paper compares 1 and 4 epochs).
    """
    ratio, log_ratio = _ratio(inp)
    x = prefix_mean_log_ratio(log_ratio, inp.response_mask)
    return _ppo_on_smoothed_log_ratio(inp, ratio, log_ratio, x, eps_low, eps_high, "pnpo_ratio_mean")



_SSPO_PAPER = "SSPO: Subsentence-level Policy Optimization (arXiv:2511.04256)"


@dataclass(frozen=True)
class SSPOParams:
    """SSPO's subsentence ratio clip with entropy-scaled bounds; the abstract gives no constants: our choices."""

    eps_low: float = param(0.2, "base lower clip of the subsentence ratio (our choice: PPO's 0.2)")
    eps_high: float = param(0.2, "base upper clip of the subsentence ratio (our choice: PPO's 0.2)")
    min_scale: float = param(0.5, "smallest entropy scale of the bounds, for the lowest-entropy subsentences (our choice)")
    max_scale: float = param(2.0, "largest entropy scale of the bounds, for the highest-entropy subsentences (our choice)")


def segment_means(x: torch.Tensor, segment_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]``: each token's value replaced by the masked mean of ``x`` over its (row, segment).

    ``segment_ids`` ``[B, R]`` long, non-negative and < R (a row's subsentence
    index); positions outside ``mask`` get 0. Differentiable in ``x``.
    """
    B, R = x.shape
    key = (torch.arange(B, device=x.device)[:, None] * R + segment_ids.clamp(0, R - 1)).flatten()
    w = mask.flatten().to(x.dtype)
    tot = torch.zeros(B * R, dtype=x.dtype, device=x.device).index_add(0, key, x.flatten() * w)
    cnt = torch.zeros(B * R, dtype=x.dtype, device=x.device).index_add(0, key, w)
    return (tot / cnt.clamp(min=1.0))[key].view(B, R) * mask


@POLICY_LOSSES.register("sspo", paper=_SSPO_PAPER, params=SSPOParams, needs_entropy=True, needs_segments=True,
                        batch_statistics=True, extras=("segment_ids",))
def sspo_loss(
    inp: PolicyLossInput, *, eps_low: float, eps_high: float, min_scale: float, max_scale: float
) -> Tuple[torch.Tensor, Metrics]:
    """SSPO: PPO-clip on a *subsentence* importance ratio, with bounds widened for high-entropy subsentences.

    Between GRPO's token ratio (sensitive to outlier tokens) and GSPO's one
    ratio per response (a few extreme tokens decide for the whole response),
    each subsentence ``s`` gets the geometric-mean ratio
    ``r_s = exp(mean_{t in s} log r_t)``, written GSPO-token style so token ``t``
    uses ``sg(r_s) pi_t / sg(pi_t)``. The clip range of a subsentence scales with
    its mean token entropy ``H_s`` relative to the mini-batch's mean token
    entropy ``H_bar`` (:func:`batch_view`): ``eps_s = eps * clip(H_s / H_bar,
    min_scale, max_scale)``, so uncertain subsentences may move further and
    confident ones are held tighter. Subsentences are cut after tokens
    containing ``, . ; : ! ?`` or a newline (``inp.extras["segment_ids"]``, computed by the
    runner from the token texts, :func:`rlpost.algos.inputs.subsentence_ids`).
    The abstract gives neither the entropy-to-bound map nor the constants: the
    ratio map, 0.2 and [0.5, 2] are our choices. Metrics: ``eps_high_mean``,
    ``seg_ratio_mean``.

    Raises:
        ValueError: ``inp.extras["segment_ids"]`` or ``inp.entropy`` is None, or ``min_scale > max_scale``.
    """
    if inp.extras.get("segment_ids") is None or inp.entropy is None:
        raise ValueError("sspo needs PolicyLossInput.segment_ids (subsentence of each token) and entropy; "
                         "the runner computes them")
    if min_scale > max_scale or min_scale <= 0:
        raise ValueError(f"sspo: need 0 < min_scale <= max_scale, got {min_scale}, {max_scale}")
    m = inp.response_mask
    ratio, log_ratio = _ratio(inp)
    seg = inp.extras.get("segment_ids").to(m.device).long()
    log_s = segment_means(log_ratio.detach(), seg, m)
    s_t = torch.exp((log_s + inp.logprobs - inp.logprobs.detach()).clamp(max=20.0))
    full, _rows = batch_view(inp)
    with torch.no_grad():
        h_bar = masked_mean(full.entropy.float(), full.response_mask).clamp(min=1e-6)
        scale = (segment_means(inp.entropy.float(), seg, m) / h_bar).clamp(min_scale, max_scale)
        lo, hi = eps_low * scale, eps_high * scale
    loss, low, high, _ = _ppo_core(s_t, inp.advantages, lo, hi, None, m)
    metrics = _clip_metrics(ratio, log_ratio, low, high, m)
    with torch.no_grad():
        metrics["eps_high_mean"] = masked_mean(hi, m)
        metrics["seg_ratio_mean"] = masked_mean(torch.exp(log_s), m)
    return loss, metrics



class NATSelector(Choice):
    """Which tokens NAT keeps: independent coin flips (URS) or a random prefix of each response (RPC)."""

    urs = "urs"
    rpc = "rpc"


@dataclass(frozen=True)
class NATParams:
    """NAT's token selector on PPO's clipped surrogate; the keep rate is our choice (the abstract gives none)."""

    selector: NATSelector = param(NATSelector.urs, "urs: keep each token with probability keep_prob; rpc: keep a "
                                                   "uniformly random prefix of each response")
    keep_prob: float = param(0.5, "URS inclusion probability (our choice)")
    eps_low: float = param(0.2, "PPO clip floor of the kept tokens (PPO's 0.2)")
    eps_high: float = param(0.2, "PPO clip cap of the kept tokens (PPO's 0.2)")

    def __post_init__(self) -> None:
        _nat_check(str(getattr(self.selector, "name", self.selector)), float(self.keep_prob))


def nat_inclusion(mask: torch.Tensor, selector: str, keep_prob: float, gen: Optional[torch.Generator]):
    """``(keep [N, R] bool, pi [N, R] inclusion probability)`` of NAT's token selectors.

    URS keeps each response token independently with probability ``keep_prob``.
    RPC draws a cut ``c`` uniform in ``1..L`` per response (``L`` its response
    tokens) and keeps the first ``c`` of them, so the ``k``-th response token
    (0-based) is kept with probability ``(L - k) / L``. Selectors of "Not all
    tokens are needed (NAT): token efficient reinforcement learning" (arXiv:2603.06619).
    """
    m = mask > 0
    u = torch.rand(mask.shape, generator=gen).to(mask.device)
    if selector == "urs":
        pi = torch.full_like(mask, float(keep_prob))
        return (u < keep_prob) & m, pi
    k = (torch.cumsum(m.long(), dim=-1) - 1).clamp(min=0)  # index among the response tokens
    L = m.long().sum(-1, keepdim=True).clamp(min=1)
    cut = torch.floor(u[:, :1] * L).long() + 1  # uniform in 1..L
    pi = (L - k).to(mask.dtype) / L.to(mask.dtype)
    return (k < cut) & m, pi


def _nat_check(selector: str, keep_prob: float) -> None:
    if selector not in ("urs", "rpc"):
        raise ValueError(f"nat: selector={selector!r}: valid choices are urs, rpc")
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"nat: keep_prob must be in (0, 1], got {keep_prob}")


def nat_draw(mask: torch.Tensor, gen: Optional[torch.Generator], *, selector: str, keep_prob: float,
             **_: object) -> torch.Tensor:
    """NAT's token draw as Horvitz-Thompson weights ``keep / pi``, ``[N, R]`` float (0 = token not drawn).

    The ``token_draw`` of loss ``nat``: the trainer calls it once per mini-batch
    on the mini-batch's response mask ``[N, R]`` (0/1) with a generator seeded
    per mini-batch, before the update's forward pass, and hands the result to
    every micro-batch as ``extras['token_weights']`` (see
    :data:`EXTRA_INPUTS`). Positions with weight 0 are not needed by the loss,
    so the trainer's forward may leave them out (``trainer.drawn_forward``).
    Other loss parameters are accepted and ignored.

    Raises:
        ValueError: ``keep_prob`` not in (0, 1] or an unknown ``selector``.
    """
    _nat_check(selector, keep_prob)
    keep, pi = nat_inclusion(mask.float(), selector, keep_prob, gen)
    return keep.float() / pi.float().clamp(min=1e-6)


@POLICY_LOSSES.register(
    "nat",
    paper="Not all tokens are needed (NAT): token efficient reinforcement learning (arXiv:2603.06619)",
    params=NATParams,
    extras=("token_weights",),
    optional_extras=("token_weights",),
    token_draw=nat_draw,
)
def nat_loss(
    inp: PolicyLossInput, *, selector: str, keep_prob: float, eps_low: float, eps_high: float
) -> Tuple[torch.Tensor, Metrics]:
    """NAT: PPO's clipped surrogate on a random subset of response tokens, each reweighted by 1 / inclusion probability.

    ``loss_t = keep_t / pi_t * ppo_clip_t``: in expectation over the draw this is
    the full-token loss (Horvitz-Thompson), so the gradient stays unbiased while
    only the kept tokens carry it (:func:`nat_inclusion` gives the URS and RPC
    selectors). The weights come from ``inp.extras['token_weights']``, drawn by
    :func:`nat_draw` on the whole mini-batch before the update's forward (the
    trainer's ``token_draw`` hook), so they do not depend on the micro-batch
    split, and the forward can stop after each micro-batch's last drawn column
    (RPC's compute saving; docs/ALGORITHMS.md, "NAT"). Called without them (a
    direct call), the loss draws them itself on :func:`batch_view` with
    ``inp.seed``: the same draw. Clip metrics are means over the drawn tokens
    (undrawn positions may not have gone forward). ``keep_prob = 0.5`` is our
    choice.

    Raises:
        ValueError: ``keep_prob`` not in (0, 1] or an unknown ``selector``.
    """
    _nat_check(selector, keep_prob)
    m = inp.response_mask
    w = inp.extras.get("token_weights")
    if w is None:
        full, rows = batch_view(inp)
        gen = None if inp.seed is None else torch.Generator(device="cpu").manual_seed(int(inp.seed))
        w = nat_draw(full.response_mask.cpu(), gen, selector=selector, keep_prob=keep_prob)[rows.cpu()]
    w = w.to(m.device)
    drawn = ((w > 0) & (m > 0)).to(m.dtype)
    ratio, log_ratio = _ratio(inp)
    loss, low, high, _ = _ppo_core(ratio, inp.advantages, eps_low, eps_high, None, m)
    metrics = _clip_metrics(ratio, log_ratio, low, high, drawn)
    return loss * w.to(loss.dtype), metrics


def compute_policy_loss(name: str, inp: PolicyLossInput, **params: object) -> Tuple[torch.Tensor, Metrics]:
    """Run registered policy loss ``name`` with its declared defaults overridden by ``params``.

    Raises:
        ConfigError: unknown loss name, or a parameter the loss does not declare
            (the message lists the valid keys).
    """
    return POLICY_LOSSES.get(name)(inp, **POLICY_LOSSES.kwargs(name, params, "algo.loss_params"))


# --- Issue 17, third batch: FIPO (future-KL token weights), HölderPO (power-mean sequence ratio) ------

_FIPO_PAPER = ("FIPO: Eliciting Deep Reasoning with Future-KL Influenced Policy Optimization (arXiv:2603.19835); "
               "loss as in the ms-swift port of the authors' verl code (github.com/modelscope/ms-swift, pull 9328)")


@dataclass(frozen=True)
class FIPOParams:
    """FIPO on DAPO's clipped surrogate; defaults are the authors' 32B run script (as the ms-swift port states)."""

    eps_low: float = param(0.2, "PPO ratio floor 1 - eps_low (DAPO scaffold: 0.2)")
    eps_high: float = param(0.28, "PPO ratio cap 1 + eps_high (DAPO clip-higher, the 32B script: 0.28)")
    dual_clip: Optional[float] = param(10.0, "dual clip c on A < 0 tokens; ratio > c also leaves the future sum (script: 10)")
    decay_rate: float = param(32.0, "half-life in tokens of the future-KL discount: gamma = 2^(-1/decay_rate) (script: 32)")
    weight_clip: Optional[float] = param(0.2, "influence weight clipped to [1 - c, 1 + c] (script: 0.2), or null for no clip")
    weight_clip_high_only: bool = param(False, "clip the weight to [1, 1 + c] instead (ms-swift default true; the 32B script: false)")
    safety_threshold: Optional[float] = param(3.0, "A < 0 tokens with ratio above this keep a weight in [0.8, 1] (script: 3.0), or null")


def future_kl(log_ratio: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """FIPO's discounted future log-ratio ``F_t = sum_{k>=t} gamma^(k-t) m_k d_k`` per row, ``[B, R]``.

    ``d = log_ratio`` (the signed per-token log-prob shift ``log pi - log pi_old``);
    ``F_t = m_t d_t + gamma F_{t+1}``, run backwards over positions in float64
    (O(R) memory; a position outside ``mask`` passes the discounted sum through);
    0 outside ``mask``.
    """
    m = mask.double()
    d = log_ratio.double() * m
    out = torch.zeros_like(d)
    acc = torch.zeros_like(d[..., 0])
    for t in range(d.shape[-1] - 1, -1, -1):
        acc = d[..., t] + gamma * acc
        out[..., t] = acc
    return (out * m).to(log_ratio.dtype)


@POLICY_LOSSES.register("fipo", paper=_FIPO_PAPER, params=FIPOParams)
def fipo_loss(
    inp: PolicyLossInput,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: Optional[float],
    decay_rate: float,
    weight_clip: Optional[float],
    weight_clip_high_only: bool,
    safety_threshold: Optional[float],
) -> Tuple[torch.Tensor, Metrics]:
    """FIPO: DAPO's clipped surrogate with each token's loss weighted by its future-KL influence.

    Outcome rewards give every token of a response one advantage. FIPO
    re-weights token ``t`` by how much the update is already moving the rest of
    the trajectory: ``F_t = sum_{k>=t} gamma^(k-t) (log pi_k - log pi_old_k)``
    (:func:`future_kl`, ``gamma = 2^(-1/decay_rate)``), with tokens whose ratio
    exceeds ``dual_clip`` left out of the sum; the weight is
    ``f_t = clip(exp(F_t), 1 - weight_clip, 1 + weight_clip)`` (lower bound 1
    with ``weight_clip_high_only``), detached, and for ``A < 0`` tokens whose
    ratio exceeds ``safety_threshold`` clipped further to ``[0.8, 1]`` (no
    amplified penalty on tokens that already rose a lot). Loss per token:
    ``f_t * PPO(r_t, A_t)`` with PPO's clip ``[1 - eps_low, 1 + eps_high]`` and
    dual clip, i.e. the advantage becomes ``A_t f_t``. On-policy (``r = 1``)
    every ``f_t = 1`` and the loss is DAPO's: the weights act from the second
    update on a batch (``algo.ppo_epochs > 1`` or ``algo.mini_batches > 1``;
    the 32B script makes 3 updates per batch).

    Followed where the abstract is silent: the ms-swift port's formula and the
    authors' 32B script values (declaration defaults). Shapes: every tensor of
    ``inp`` ``[B, R]``. Metrics: ``fipo_future_kl`` (mean ``F_t``),
    ``fipo_weight_mean``, ``fipo_safety_frac`` (share of tokens whose weight the
    safety rule capped).

    Raises:
        ValueError: ``decay_rate <= 0``, ``weight_clip`` not in [0, 1), or
            ``safety_threshold < 0``.
    """
    if decay_rate <= 0:
        raise ValueError(f"fipo: decay_rate must be > 0, got {decay_rate}")
    if weight_clip is not None and not 0.0 <= weight_clip < 1.0:
        raise ValueError(f"fipo: weight_clip must be in [0, 1) or null, got {weight_clip}")
    if safety_threshold is not None and safety_threshold < 0:
        raise ValueError(f"fipo: safety_threshold must be >= 0 or null, got {safety_threshold}")
    m = inp.response_mask
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages
    with torch.no_grad():
        d = log_ratio.detach()
        if dual_clip is not None:
            d = torch.where(ratio.detach() > dual_clip, torch.zeros_like(d), d)
        F = future_kl(d, m, 2.0 ** (-1.0 / decay_rate))
        f = torch.exp(F.clamp(max=20.0))
        if weight_clip is not None:
            f = f.clamp(1.0 if weight_clip_high_only else 1.0 - weight_clip, 1.0 + weight_clip)
        unsafe = torch.zeros_like(m, dtype=torch.bool)
        if safety_threshold is not None:
            unsafe = (A < 0) & (ratio.detach() > safety_threshold)
            f = torch.where(unsafe, f.clamp(0.8, 1.0), f)
    loss, low, high, extra = _ppo_core(ratio, A, eps_low, eps_high, dual_clip, m)
    metrics = _clip_metrics(ratio, log_ratio, low, high, m)
    metrics.update(extra)
    with torch.no_grad():
        metrics["fipo_future_kl"] = masked_mean(F, m)
        metrics["fipo_weight_mean"] = masked_mean(f, m)
        metrics["fipo_safety_frac"] = masked_mean(unsafe.float(), m)
    return loss * f, metrics


_HOLDER_PAPER = "Hölder Policy Optimisation (HölderPO, arXiv:2605.12058); authors' code https://github.com/YihangChen9/HolderPO"


class HolderSchedule(Choice):
    """How HölderPO's exponent ``p`` moves between ``p_min`` and ``p_max`` over ``schedule_steps`` (authors' code)."""

    constant = "constant"
    linear = "linear"
    linear_dec = "linear_dec"
    sin = "sin"
    cos = "cos"
    poly = "poly"
    poly_dec = "poly_dec"
    cubic = "cubic"
    cubic_dec = "cubic_dec"


@dataclass(frozen=True)
class HolderPOParams:
    """HölderPO's sequence-level power-mean ratio and its p schedule (authors' math script: linear 2 -> -2)."""

    eps_low: float = param(0.2, "sequence ratio floor 1 - eps_low (authors' script CLIPRANGE 0.2)")
    eps_high: float = param(0.2, "sequence ratio cap 1 + eps_high (authors' script CLIPRANGE 0.2)")
    schedule: HolderSchedule = param(HolderSchedule.linear_dec, "p schedule (authors' math script: linear_dec, p_max to p_min)")
    p: float = param(1.0, "the exponent when schedule=constant (1: arithmetic mean, 0: geometric mean = GSPO's ratio)")
    p_min: float = param(-2.0, "lower end of the schedule (authors' math script: -2)")
    p_max: float = param(2.0, "upper end of the schedule (authors' math script: 2)")
    schedule_steps: int = param(500, "training steps the schedule spans, then p stays at its end (authors' script: 500)")
    power: float = param(2.0, "exponent n of the poly / poly_dec schedules (authors' default 2)")


def holder_p(step: int, schedule: str, p: float, p_min: float, p_max: float, schedule_steps: int, power: float) -> float:
    """HölderPO's exponent at training step ``step`` (0-based), as the authors' ``_get_current_holder_p``.

    ``progress = min(1, step / schedule_steps)``; ``linear_dec``:
    ``p_max - (p_max - p_min) progress``; ``cos``: ``mid + amp cos(pi progress)``;
    ``cubic``: ``mid + amp (2 progress - 1)^3`` (``mid``, ``amp`` the centre and
    half-width of ``[p_min, p_max]``); the ``*_dec`` forms mirror them.

    Raises:
        ValueError: an unknown ``schedule`` or ``schedule_steps < 1``.
    """
    if schedule == "constant":
        return float(p)
    if schedule_steps < 1:
        raise ValueError(f"holderpo: schedule_steps must be >= 1, got {schedule_steps}")
    t = min(1.0, max(0, step) / schedule_steps)
    mid, amp = (p_min + p_max) / 2.0, (p_max - p_min) / 2.0
    table = {
        "linear": p_min + (p_max - p_min) * t,
        "linear_dec": p_max - (p_max - p_min) * t,
        "sin": mid - amp * math.cos(math.pi * t),
        "cos": mid + amp * math.cos(math.pi * t),
        "poly": p_min + (p_max - p_min) * t ** power,
        "poly_dec": p_max - (p_max - p_min) * t ** power,
        "cubic": mid + amp * (2.0 * t - 1.0) ** 3,
        "cubic_dec": mid - amp * (2.0 * t - 1.0) ** 3,
    }
    if schedule not in table:
        raise ValueError(f"holderpo: schedule={schedule!r}: valid choices are {', '.join(c.value for c in HolderSchedule)}")
    return float(table[schedule])


def holder_mean_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """``[B]`` log of the Hölder mean ``((1/L) sum_t r_t^p)^(1/p)`` of each row's masked token ratios.

    Computed in log space, ``(logsumexp_t(p log r_t) - log L) / p``, so large
    ``|p|`` cannot overflow; ``|p| < 1e-6`` gives the geometric-mean limit
    ``mean_t log r_t`` (the authors' threshold). A row without tokens gives 0.
    """
    m = mask > 0
    L = m.sum(-1).clamp(min=1).to(log_ratio.dtype)
    if abs(p) < 1e-6:
        return (log_ratio * mask).sum(-1) / L
    z = torch.where(m, p * log_ratio, torch.full_like(log_ratio, float("-inf")))
    lse = torch.logsumexp(z, dim=-1)
    out = (lse - torch.log(L)) / p
    return torch.where(m.any(-1), out, torch.zeros_like(out))


@POLICY_LOSSES.register("holderpo", paper=_HOLDER_PAPER, params=HolderPOParams, sequence_level=True)
def holderpo_loss(
    inp: PolicyLossInput,
    *,
    eps_low: float,
    eps_high: float,
    schedule: str,
    p: float,
    p_min: float,
    p_max: float,
    schedule_steps: int,
    power: float,
) -> Tuple[torch.Tensor, Metrics]:
    """HölderPO: PPO's clip on each sequence's Hölder (power) mean of its token ratios, with p annealed.

    ``rho_i = ((1/L_i) sum_t r_it^p)^(1/p)`` (:func:`holder_mean_log_ratio`);
    ``p = 1`` is the arithmetic mean, ``p -> 0`` the geometric mean (GSPO's and
    GMPO's sequence ratio), large ``p`` concentrates the gradient on the tokens
    with the largest ratios (each token's share of ``d rho`` is
    ``r_t^p / sum_s r_s^p``), negative ``p`` on the smallest. Per sequence
    ``loss_i = max(-A_i rho_i, -A_i clip(rho_i, 1 - eps_low, 1 + eps_high))``
    with ``A_i`` the sequence mean of the token advantages, placed on each of
    its tokens: ``seq-mean-token-mean`` gives the authors' mean over sequences.
    ``p`` follows ``schedule`` at training step ``inp.step``
    (:func:`holder_p`; None counts as step 0): the authors' math script anneals
    it linearly from 2 to -2, so that early updates amplify sparse signals and
    late ones have bounded variance (the paper's argument). On-policy every ``rho = 1`` whatever ``p``,
    so the loss equals GRPO's until a batch is reused (the authors make one
    update per mini-batch of a larger rollout batch: ``algo.mini_batches > 1``).
    The token-level variant of the authors' code (``holder_token``) is not
    implemented. Metrics: ``holder_p``, ``seq_ratio_mean``.

    Raises:
        ValueError: see :func:`holder_p`.
    """
    cur_p = holder_p(inp.step or 0, schedule, p, p_min, p_max, schedule_steps, power)
    m = inp.response_mask
    ratio, log_ratio = _ratio(inp)
    log_rho = holder_mean_log_ratio(log_ratio, m, cur_p)
    rho = torch.exp(log_rho.clamp(-20.0, 20.0))
    A = _seq_mean(inp.advantages, m)
    seq_loss = torch.maximum(-A * rho, -A * torch.clamp(rho, 1.0 - eps_low, 1.0 + eps_high))
    loss = seq_loss[:, None] * torch.ones_like(log_ratio)
    with torch.no_grad():
        low = ((rho < 1.0 - eps_low) & (A < 0)).float()[:, None].expand_as(m)
        high = ((rho > 1.0 + eps_high) & (A > 0)).float()[:, None].expand_as(m)
        metrics = _clip_metrics(ratio, log_ratio, low, high, m)
        metrics["holder_p"] = torch.tensor(cur_p)
        metrics["seq_ratio_mean"] = _nonempty_mean(rho.detach(), m)
    return loss, metrics


_P3O_PAPER = ("Trust the Batch, On- or Off-Policy: Adaptive Policy Optimization for RL Post-Training (arXiv:2605.12380); "
              "authors' code https://github.com/FeynRL-project/FeynRL (algs/P3O), after P3O: Policy-on Policy-off "
              "Policy Optimization (arXiv:1905.01756)")


@POLICY_LOSSES.register("p3o", paper=_P3O_PAPER, batch_statistics=True)
def p3o_loss(inp: PolicyLossInput) -> Tuple[torch.Tensor, Metrics]:
    """The batch-adaptive ESS objective: the ratio cap and the trust-region weight both set by the batch's ESS.

    With token ratios ``w = pi / pi_old`` over the response tokens of the
    mini-batch, ``ESS = (sum w)^2 / (n sum w^2 + 1e-8 n)`` in ``(0, 1]`` (the
    normalised effective sample size; ``n`` the token count). Per token

        ``loss_t = -sg(min(r_t, ESS)) A_t log pi_t + (1 - ESS) KL_t``,
        ``KL_t = log r_t + 1 / r_t - 1`` (the release's k3 estimate of
        ``KL(pi || pi_old)``, exponent clamped to [-10, 10]).

    Fresh data (``ESS`` near 1) gives the plain score-function update ``-A grad
    log pi`` with no pull-back; stale or mismatched data concentrates the
    ratios, so ``ESS`` falls, the weight of every token is capped at it (high-ratio
    tokens keep a nonzero weight ``ESS``, unlike a PPO clip) and the KL to
    ``pi_old`` takes over. No clip range and no KL coefficient: the objective
    has no parameters. The PG term is written ``-A sg(min(r, ESS) / r) r`` so
    its value is ``-A min(r, ESS)`` (the release's value multiplies by ``log pi``;
    the gradient is the same).

    Departure from the release, for micro-batch invariance: the release takes
    ``ESS`` over each micro-batch (summed across data-parallel ranks); here it is
    over the whole mini-batch of the optimizer step (registry tag
    ``batch_statistics``: :func:`batch_view`), the batch that the paper's title
    says to trust. Shapes: ``inp`` tensors ``[B, R]``. Metrics: ``ess`` (0-d),
    ``kl_behavioral`` (mean ``KL_t``).
    """
    full, _ = batch_view(inp)
    with torch.no_grad():
        fm = full.response_mask.double()
        fw = torch.exp((full.logprobs.double() - full.old_logprobs.double()).clamp(-20.0, 20.0)) * fm
        n = fm.sum()
        ess = float((fw.sum() ** 2 / (fw.pow(2).sum() + 1e-8) / n).clamp(0.0, 1.0)) if n > 0 else 1.0
    m = inp.response_mask
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages
    w = torch.clamp(ratio.detach(), max=ess)
    kl = log_ratio + torch.exp((-log_ratio).clamp(-10.0, 10.0)) - 1.0
    loss = _is_weighted_pg(ratio, w, A) + (1.0 - ess) * kl
    with torch.no_grad():
        capped = (ratio.detach() > ess + 1e-6).float()  # on-policy r = 1 and ESS = 1 - O(1e-8): not capped
        metrics = _clip_metrics(ratio, log_ratio, capped * (A < 0).float(), capped * (A > 0).float(), m)
        metrics["clip_frac"] = masked_mean(capped, m)
        metrics["ess"] = torch.tensor(ess)
        metrics["kl_behavioral"] = masked_mean(kl.detach(), m)
    return loss, metrics


_ERC_PAPER = ("Entropy Ratio Clipping as a Soft Global Constraint for Stable Reinforcement Learning (ERC, "
              "arXiv:2512.05591); authors' code https://github.com/Kwai-Klear/ERC (loss grpo_erc)")


@dataclass(frozen=True)
class ERCParams:
    """ERC on DAPO's clipped surrogate; defaults are the authors' DAPO + ERC run script."""

    eps_low: float = param(0.2, "PPO ratio floor 1 - eps_low (authors' script: 0.2)")
    eps_high: float = param(0.28, "PPO ratio cap 1 + eps_high (authors' script: 0.28)")
    dual_clip: Optional[float] = param(10.0, "dual clip c on A < 0 tokens (authors' script clip_ratio_c: 10), or null")
    entropy_ratio_low: float = param(0.95, "tokens whose entropy ratio H / H_old is not above this get no gradient (script: 0.95)")
    entropy_ratio_high: float = param(1.05, "tokens whose entropy ratio H / H_old is not below this get no gradient (script: 1.05)")


@POLICY_LOSSES.register("erc", paper=_ERC_PAPER, params=ERCParams, needs_entropy=True, needs_old_entropy=True, extras=("old_entropy",), optional_extras=("old_entropy",))
def erc_loss(
    inp: PolicyLossInput,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: Optional[float],
    entropy_ratio_low: float,
    entropy_ratio_high: float,
) -> Tuple[torch.Tensor, Metrics]:
    """ERC: DAPO's clipped surrogate, with the gradient cut where a token's entropy moved too far from pi_old's.

    PPO's clip sees only the sampled token's ratio; probability mass moved onto
    tokens that were not sampled shows in the entropy of the whole next-token
    distribution. ERC compares, at each response position, the entropy of the
    current policy with that of the old one, ``rho_t = (H_t + 1e-8) / (H_old_t +
    1e-8)``, and keeps the token's gradient only when
    ``entropy_ratio_low < rho_t < entropy_ratio_high`` (the release detaches the
    loss of the other tokens: their value stays in the loss, their gradient is
    0). The surrogate is PPO's with ``eps_low`` / ``eps_high`` and dual clip.

    ``inp.entropy`` is the current policy's entropy (tag ``needs_entropy``);
    ``inp.extras["old_entropy"]`` the old policy's (tag ``needs_old_entropy``: the runner
    computes it with the old log-probs when the batch is reused). Without it
    (one on-policy pass) the old policy is the current one and every ratio is 1.
    Shapes ``[B, R]``. Metrics: ``erc_masked_frac`` (share of tokens whose
    gradient the entropy ratio cut; the paper reports about 20%),
    ``entropy_ratio_mean``.

    Raises:
        ValueError: ``inp.entropy`` is None, or ``entropy_ratio_low >= 1`` or
            ``entropy_ratio_high <= 1`` (the band must contain ratio 1).
    """
    if not entropy_ratio_low < 1.0 < entropy_ratio_high:
        raise ValueError(f"erc: need entropy_ratio_low < 1 < entropy_ratio_high, got {entropy_ratio_low}, {entropy_ratio_high}")
    if inp.entropy is None:
        raise ValueError("erc needs PolicyLossInput.entropy (the trainer computes it for losses tagged needs_entropy)")
    m = inp.response_mask
    ratio, log_ratio = _ratio(inp)
    A = inp.advantages
    loss, low, high, extra = _ppo_core(ratio, A, eps_low, eps_high, dual_clip, m)
    with torch.no_grad():
        H = inp.entropy.detach().float()
        H_old = H if inp.extras.get("old_entropy") is None else inp.extras.get("old_entropy").detach().float()
        rho = (H + 1e-8) / (H_old + 1e-8)
        keep = (rho > entropy_ratio_low) & (rho < entropy_ratio_high)
    loss = torch.where(keep, loss, loss.detach())
    metrics = _clip_metrics(ratio, log_ratio, low, high, m)
    metrics.update(extra)
    with torch.no_grad():
        metrics["erc_masked_frac"] = masked_mean((~keep).float(), m)
        metrics["entropy_ratio_mean"] = masked_mean(rho, m)
    return loss, metrics
