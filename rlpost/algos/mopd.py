"""Open-MOPD: multi-teacher on-policy distillation with a balanced optimization budget across domains.

"Open-MOPD: Diagnosing and Fixing Capability Imbalance in Multi-Teacher On-Policy
Distillation" (Gao, Chi, Yan et al.; arXiv:2608.19098; code
https://github.com/BytedTsinghua-SIA/Open-MOPD: ``training/verl/verl/workers/actor/mt_opd.py``,
the ``mt_opd`` branch of ``ray_trainer.py``, the refresh in ``dp_actor.py``, the
launcher settings in ``scripts/local/mt_opd.sh``). Each prompt is routed by its known
domain label to that domain's frozen teacher (``model.teachers``, oracle routing:
:class:`rlpost.models.teacher.RoutedTeacher`); the student learns from the routed
teacher's log-probs on its own rollouts. The paper finds that the teachers' strengths
do not add up because domains compete for one token-level budget, and fixes three things:

1. **Token-share balancing.** Under token-mean aggregation a domain's share of the
   gradient is its share of response tokens ``s_d = n_d L_d / sum_j n_j L_j``, not its
   prompt share. Weight domain ``d`` by ``w_d^share = g*_d / s_d`` (``g*``: target shares,
   equal by default), measured on the step's own batch.
2. **Gap-following allocation.** With ``m_d`` = the mean ``|r_t|`` per response token of
   domain ``d`` (the remaining teacher-student gap),
   ``w~_d = w_d^share * clamp((m_d / m_ref)^alpha, 0.05, 20)`` with ``alpha = 1``; then
   ``w_d = w~_d / sum_j w~_j s_j`` keeps the batch's token-mean loss scale. ``m_ref`` is
   not written on the paper's page; the authors' code (``reward_scale_direction=multiply``,
   unanchored, ``reward_scale_stat=mean``) takes ``m_ref = sum_d w_d^share m_d / sum_d w_d^share``,
   which we follow.
3. **Reward refresh.** The reward ``r_t = log pi_T(y_t) - log pi_theta(y_t)`` depends on the
   student; after an inner update the stored one describes an older student. Before every
   inner update (every optimizer step of the batch: ``algo.mini_batches = 4`` in the
   paper's runs) the loss recomputes it from the current student's log-probs of the same
   tokens and the cached teacher log-probs (no extra teacher pass, no new rollout); the
   domain weight multiplies the refreshed reward, as in the authors' actor.

The token reward. The authors score the student's top-16 tokens at each position,
``r_t(v) = delta_t(v) softmax_S(log pi_theta)(v)`` over the student's top-k set ``S``
(``reward_weight_mode=student_p``, ``top_k_strategy=only_stu``). rlpost's teacher stage
gives the sampled token's log-prob (and a teacher-side top-K, not the student's); so
here ``k = 1``: the sampled token, where the softmax weight over a one-token set is 1
and ``r_t = log pi_T(y_t) - log pi_theta(y_t)`` (the sampled-token OPD advantage of
``opd_token``). This departure is ours. The gap measure ``m_d`` is then the mean
absolute sampled-token log-ratio of the domain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.losses import Metrics, PolicyLossInput, _clip_metrics, _ppo_core, _ratio, masked_mean
from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
from rlpost.core.registry import param

_PAPER = ("Open-MOPD: Diagnosing and Fixing Capability Imbalance in Multi-Teacher On-Policy Distillation "
          "(arXiv:2608.19098); code https://github.com/BytedTsinghua-SIA/Open-MOPD")

#: ``batch.extras`` keys: each row's domain index and its domain's target share (the ``mopd`` method writes them),
#: and each row's budget weight (the ``mopd`` estimator writes it for the loss)
DOMAIN_ID, DOMAIN_TARGET, WEIGHT = "domain_id", "domain_target", "mopd_weight"


def domain_budget_weights(
    domain_id: torch.Tensor,
    target: torch.Tensor,
    response_mask: torch.Tensor,
    token_rewards: torch.Tensor,
    *,
    token_share: bool = True,
    gap_alpha: float = 1.0,
    gap_clamp_low: float = 0.05,
    gap_clamp_high: float = 20.0,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Open-MOPD's per-row loss weights: token-share balancing times gap-following allocation.

    With ``n_i`` the response tokens of row ``i``, ``N = sum_i n_i`` and, per domain ``d``
    present in the batch, ``s_d = sum_{i in d} n_i / N``, ``g*_d`` = its target normalised
    over the present domains and ``m_d = sum_{i in d} sum_t |r_it| / sum_{i in d} n_i``:

        base_d = g*_d / s_d                 (1 without token_share)
        m_ref  = sum_d base_d m_d / sum_d base_d
        w~_d   = base_d * clamp((m_d / m_ref)^alpha, low, high)      (base_d when alpha = 0)
        w_i    = w~_{d(i)} * N / sum_j w~_{d(j)} n_j

    so ``sum_i w_i n_i = N``: the token-mean loss keeps its scale and only the domains' shares
    move (arXiv:2608.19098; ``compute_domain_loss_weights`` of the authors' ``mt_opd.py``).
    A domain whose rows hold no response token keeps weight 1 (it enters no loss).

    Args:
        domain_id: ``[B]`` long, each row's domain index.
        target: ``[B]`` float >= 0, the target share of each row's domain (equal within a
            domain); all zero means equal shares.
        response_mask: ``[B, R]`` 0/1.
        token_rewards: ``[B, R]`` the per-token distillation reward ``r_t`` (only ``|r_t|`` is read).
        token_share: apply the ``g*_d / s_d`` factor.
        gap_alpha: exponent ``alpha`` of the gap ratio (0: no gap-following).
        gap_clamp_low, gap_clamp_high: bounds of the gap factor.
    Returns:
        ``(weights [B] float32, metrics)``: per domain index ``k`` the token share
        ``mopd/d{k}/token_share``, the gap ``mopd/d{k}/gap`` and the weight ``mopd/d{k}/weight``.
    """
    m = response_mask.double()
    n = m.sum(-1)
    total = n.sum().clamp(min=1.0)
    ids = domain_id.long()
    present = sorted(set(ids.tolist()))
    raw = {d: float(target[ids == d][0]) for d in present}
    if sum(raw.values()) <= 0:
        raw = {d: 1.0 for d in present}
    tsum = sum(raw.values())
    absr = (token_rewards.double().abs() * m).sum(-1)
    base, mag, share = {}, {}, {}
    for d in present:
        rows = ids == d
        tok = float(n[rows].sum())
        share[d] = tok / float(total)
        if tok <= 0:
            continue
        base[d] = (raw[d] / tsum) / share[d] if token_share else 1.0
        mag[d] = float(absr[rows].sum()) / tok
    scale = dict(base)
    if gap_alpha > 0 and base:
        bsum = sum(base.values())
        ref = max(sum(base[d] * mag[d] for d in base) / max(bsum, 1e-12), 1e-12)
        for d in base:
            fac = (max(mag[d], 1e-12) / ref) ** gap_alpha
            scale[d] = base[d] * min(max(fac, gap_clamp_low), gap_clamp_high)
    w = torch.ones(len(ids), dtype=torch.float64)
    for d, sc in scale.items():
        w[ids == d] = sc
    w = w * (total / (w * n).sum().clamp(min=1e-12))
    metrics: Dict[str, float] = {}
    for d in present:
        metrics[f"mopd/d{d}/token_share"] = share[d]
        if d in mag:
            metrics[f"mopd/d{d}/gap"] = mag[d]
            metrics[f"mopd/d{d}/weight"] = float(w[ids == d][0])
    return w.float(), metrics


@dataclass(frozen=True)
class MOPDParams:
    """Open-MOPD's budget allocation (arXiv:2608.19098; the authors' ``mt_opd.sh`` settings)."""

    target_shares: Optional[Dict[str, float]] = param(
        None, "{domain: target share g*_d} of the token budget, every domain of model.teachers named (normalised "
              "over the domains present in a batch); null: equal shares (the paper's 1/3 each)")
    token_share: bool = param(True, "token-share balancing: weight each domain by g*_d / its share of response tokens")
    gap_alpha: float = param(1.0, "gap-following exponent alpha on (m_d / m_ref); 0 turns gap-following off")
    gap_clamp_low: float = param(0.05, "lower bound of the gap factor (m_d / m_ref)^alpha")
    gap_clamp_high: float = param(20.0, "upper bound of the gap factor")

    def __post_init__(self) -> None:
        """Range checks (a ``ValueError`` here is reported as a ConfigError naming ``algo.adv_params``)."""
        if float(self.gap_alpha) < 0:
            raise ValueError(f"gap_alpha={self.gap_alpha} must be >= 0 (0: gap-following off)")
        if not 0.0 < float(self.gap_clamp_low) <= float(self.gap_clamp_high):
            raise ValueError(f"gap_clamp_low={self.gap_clamp_low} and gap_clamp_high={self.gap_clamp_high} must satisfy "
                             f"0 < low <= high")
        bad = {d: g for d, g in (self.target_shares or {}).items() if not float(g) > 0}
        if bad:
            raise ValueError(f"target_shares {bad}: every domain's share must be > 0")


def _mopd_example(logprobs: torch.Tensor, generator: torch.Generator) -> dict:
    """A smoke run routes each prompt to its domain's teacher: a two-domain task and a tiny teacher each."""
    return {"overrides": ["task=arithmetic_mix", "model.teachers.basic_arithmetic=tiny",
                          "model.teachers.chain_sum=tiny"]}


@ADV_ESTIMATORS.register("mopd", paper=_PAPER, params=MOPDParams, needs_teacher=True, routed_teachers=True,
                         provides=(WEIGHT,), example_inputs=_mopd_example,
                         zero_variance=("not a reward baseline: the routed teacher's minus the student's log-prob, "
                                        'domain-weighted (Open-MOPD)'))
def mopd_advantage(
    inp: AdvantageInput,
    *,
    target_shares: Optional[Dict[str, float]],
    token_share: bool,
    gap_alpha: float,
    gap_clamp_low: float,
    gap_clamp_high: float,
) -> AdvantageOutput:
    """Open-MOPD's rollout-time advantage ``A_it = w_{d(i)} (log pi_T(y_it) - log pi_old(y_it))``.

    ``pi_T`` is the row's routed teacher (``teacher_logprobs``), ``pi_old`` the student at
    rollout time (``old_logprobs`` when computed, else the engine's); ``w`` are
    :func:`domain_budget_weights` over the whole batch, which the loss ``mopd`` reads again
    (``extras['mopd_weight']``) to weight its refreshed reward. ``target_shares`` is read by
    the ``mopd`` method, which writes each row's ``extras['domain_target']``; the domain of
    each row is its ``extras['domain_id']``.

    Shapes: ``[B, R]`` log-probs -> ``[B, R]`` advantages (0 outside the mask), ``extras['mopd_weight']`` ``[B]``.

    Without ``extras['domain_id']`` (the method is not in the run) every row is one domain
    and every weight is 1: sampled-token OPD.

    Raises:
        ValueError: no teacher log-probs (set ``model.teachers``) or no student log-probs.
    """
    if inp.teacher_logprobs is None:
        raise ValueError("mopd needs the routed teachers' log-probs: set model.teachers (the teacher_logprobs stage)")
    student = inp.old_logprobs if inp.old_logprobs is not None else inp.rollout_logprobs
    if student is None:
        raise ValueError("mopd needs the student's rollout-time log-probs (old or rollout log-probs)")
    mask = inp.response_mask
    B = mask.shape[0]
    dom = inp.extras.get(DOMAIN_ID, torch.zeros(B, dtype=torch.long))  # unlabelled: one domain, every weight 1
    tgt = inp.extras.get(DOMAIN_TARGET, torch.ones(B))
    r = (inp.teacher_logprobs.double() - student.double()) * mask.double()
    w, _ = domain_budget_weights(dom, tgt, mask, r,
                                 token_share=token_share, gap_alpha=gap_alpha,
                                 gap_clamp_low=gap_clamp_low, gap_clamp_high=gap_clamp_high)
    return AdvantageOutput(advantages=(w.double()[:, None] * r).float(), extras={WEIGHT: w})


def refreshed_advantage(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, weight: torch.Tensor,
                        response_mask: torch.Tensor) -> torch.Tensor:
    """The reward recomputed against the current student: ``w_i (log pi_T(y_it) - sg[log pi_theta(y_it)])``.

    Open-MOPD's reward refresh (arXiv:2608.19098; ``refresh_opd_advantage`` of the authors'
    code, applied before the domain weight there too): the teacher term is cached, only the
    student term is current. ``logprobs`` is detached here: the reward takes no gradient.

    Shapes: ``[B, R]`` log-probs, ``[B]`` weights -> ``[B, R]`` advantages, 0 outside the mask.
    """
    r = teacher_logprobs.to(logprobs.dtype) - logprobs.detach()
    return weight.to(logprobs.dtype)[:, None] * r * response_mask.to(logprobs.dtype)


@dataclass(frozen=True)
class MOPDLossParams:
    """The authors' actor: verl's vanilla PPO loss (clip 0.2 both sides, dual clip 3) with the reward refresh."""

    refresh: bool = param(True, "recompute the reward from the current student before every inner update (the "
                                "paper's student reward refresh); false: the rollout-time advantage throughout")
    eps_low: float = param(0.2, "lower clip: ratio floor 1 - eps_low for A < 0 (verl's clip_ratio_low)")
    eps_high: float = param(0.2, "upper clip: ratio cap 1 + eps_high for A > 0 (verl's clip_ratio_high)")
    dual_clip: Optional[float] = param(3.0, "dual-clip constant c for A < 0 (verl's clip_ratio_c), or null (off)")


def _mopd_loss_example(logprobs: torch.Tensor, generator: torch.Generator) -> dict:
    """A routed teacher's log-probs near the student's and per-row domain weights (its estimator's output in a run)."""
    ex = {"teacher_logprobs": logprobs + 0.3 * torch.randn(logprobs.shape, generator=generator),
          WEIGHT: 0.5 + torch.rand(logprobs.shape[0], generator=generator)}
    return {"extras": ex, "batch_extras": dict(ex)}


@POLICY_LOSSES.register("mopd", paper=_PAPER, params=MOPDLossParams, needs_teacher=True,
                        extras=("teacher_logprobs", WEIGHT), example_inputs=_mopd_loss_example)
def mopd_loss(inp: PolicyLossInput, *, refresh: bool, eps_low: float, eps_high: float,
              dual_clip: Optional[float]) -> Tuple[torch.Tensor, Metrics]:
    """PPO's clipped surrogate on Open-MOPD's advantage, refreshed against the current student.

    With ``refresh`` the advantage of every micro-batch is :func:`refreshed_advantage` of the
    update's own forward pass: at the first inner update of a batch it equals the estimator's
    (the student has not moved yet), from the second on it follows the student; the weights
    of one optimizer step are the same in all its micro-batches, so this is a refresh before
    every inner update. Without it the estimator's rollout-time advantage is used.

    Args:
        inp: :class:`PolicyLossInput` with ``extras['teacher_logprobs']`` ``[B, R]`` (routed
            teacher) and ``extras['mopd_weight']`` ``[B]`` (the estimator's domain weights).
        refresh, eps_low, eps_high, dual_clip: see :class:`MOPDLossParams`.
    Returns:
        ``(loss_mat [B, R], metrics)``; ``mopd/refresh_shift`` is the mean ``|A_refreshed - A_stored|``.
    """
    m = inp.response_mask
    A = inp.advantages
    metrics: Metrics = {}
    if refresh:
        A = refreshed_advantage(inp.logprobs, inp.extras["teacher_logprobs"], inp.extras[WEIGHT], m)
        with torch.no_grad():
            metrics["mopd/refresh_shift"] = masked_mean((A - inp.advantages).abs(), m)
    ratio, log_ratio = _ratio(inp)
    loss, low, high, extra = _ppo_core(ratio, A, eps_low, eps_high, dual_clip, m)
    metrics.update(_clip_metrics(ratio, log_ratio, low, high, m))
    metrics.update(extra)
    return loss, metrics
