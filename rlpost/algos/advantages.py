"""Advantage estimators: rewards (and values) -> per-token advantages.

Calling convention: ``fn(inp: AdvantageInput, *, <params>) -> AdvantageOutput``. Every
estimator returns ``[B, R]`` advantages that are 0 outside ``response_mask``.
Estimators are pure: no model, no config object. Each estimator's ``<params>``
are declared once, by the frozen dataclass registered with it (``params=``:
the paper's defaults, one doc line per field; :mod:`rlpost.core.registry`).

Numerics shared by every estimator: rewards are promoted to float64 and every
baseline (group mean, leave-one-out mean, length-weighted mean, median, VCPO's
baseline) and std stays float64 until the advantage itself is formed; only the
returned advantages are float32. A zero-variance group is recognised from its
rewards being exactly equal (:func:`rlpost.algos.utils.group_all_equal`), never
from a computed std being positive, and its members get advantage exactly 0 in
every group-baseline estimator (``grpo``, ``rloo``, ``opo``, ``gpg``,
``mc_grpo``, ``hapo``). Estimators whose baseline is not the group's own
rewards follow their paper instead: ``gae`` and ``sao`` (critic baseline),
``reinforce`` (no baseline), ``reinforce_pp`` (global whitening),
``reinforce_pp_baseline`` (group mean then global whitening: a zero-variance
group has return exactly 0 before the batch-wide shift), ``remax`` (greedy
rollout baseline) and ``mssr`` (per-prompt running baseline). In all of them a
batch whose values are all equal whitens to exactly 0.

The group-baseline estimators ``grpo`` (and Dr. GRPO), ``rloo``, ``gpg``,
``opo`` and ``reinforce_pp_baseline`` take ``baseline``: ``"mean"`` (their
own baseline, the default) or ``"min_variance"``, VCPO's minimum-variance
baseline for off-policy data ("Stable Asynchrony: Variance-Controlled
Off-Policy RL for LLMs", arXiv:2602.17616): the group's rewards weighted by the
squared sequence importance weights ``pi_old / pi_behav``
(:func:`rlpost.algos.offpolicy.min_variance_baseline`). On-policy (all weights
1) it is each estimator's own baseline.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from rlpost.algos.offpolicy import group_normalized_weights, min_variance_baseline, sequence_log_weights
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.utils import (
    group_all_equal,
    group_ids,
    group_median,
    group_stats,
    masked_mean,
    masked_whiten,
)
from rlpost.core.registry import Choice, param


@dataclass
class AdvantageInput:
    """Inputs every estimator may read.

    Attributes:
        rewards: ``[B]`` scalar outcome reward per sequence.
        response_mask: ``[B, R]`` 0/1 float mask of loss-carrying tokens.
        group_index: ``[B]`` long; equal ids = same prompt in this step.
        values: ``[B, R]`` critic estimates V(s_t) before emitting token t, or None.
        token_rewards: ``[B, R]`` per-token rewards added to the outcome reward
            (e.g. a KL-in-reward penalty), or None.
        entropy: ``[B, R]`` per-token policy entropy in nats, or None.
        baseline_rewards: ``[B]`` reward of a baseline rollout (ReMax), or None.
        old_logprobs: ``[B, R]`` log-probs (nats) of the response tokens under the
            proximal policy (the trainer before this step's update), or None.
        rollout_logprobs: ``[B, R]`` behaviour log-probs the rollout engine
            recorded (per token; stitched across versions for partial
            rollouts), or None. With ``old_logprobs`` they give VCPO's sequence
            importance weights (``baseline="min_variance"``).
        answer_ids: ``[B]`` long, the cluster of each response's extracted final
            answer (equal ids = same answer; an unparseable response gets an id
            of its own), or None. Estimators tagged ``needs_answers``
            (``seed_grpo``) read it.
        teacher_logprobs: ``[B, R]`` a frozen teacher's log-probs of the response
            tokens (``model.teacher``), or None; estimators tagged
            ``needs_teacher`` (``opd_token``) read it.
        reference_rewards: ``[B, N]`` rewards of N responses of each row's prompt
            sampled from the frozen reference policy, or None; estimators tagged
            ``needs_reference_rewards`` (``a_star``: the optimal value V*) read it.
        privileged_shifts: ``[B, R, 2]`` each response token's log-prob shift under two
            privileged prompt contexts (correct / wrong answer asserted), or None;
            estimators tagged ``needs_privileged_shifts`` (``cscr``) read it.
        truncated: ``[B]`` bool, rows cut by the rollout window that continue in a
            later step (their outcome is not known yet), or None (no row is cut);
            ``egae`` (T-PPO) bootstraps them from the critic.
        window_mask: ``[B, R]`` 0/1, the tokens generated in this step's window
            (earlier windows' tokens were trained in earlier steps), or None (every
            response token); ``egae`` restricts the policy update to them.
        probe_values: ``[B]`` each row's reward prediction by POISE's online probe
            from that row's own hidden-state features, NaN while the probe is not
            fitted yet, or None; ``poise`` forms the cross-rollout baseline from it.
        response_ids: ``[B, R]`` long, the response token ids (model and, in multi-turn
            episodes, inserted environment tokens), or None; estimators that match turns
            by what the environment returned (``hgpo``, ``rtmc``, ``g2po``) read it.
        extras: the step's other named inputs (``batch.extras``), for estimators that read one
            a method provides (``inp.extras[key]``).
    """

    rewards: torch.Tensor
    response_mask: torch.Tensor
    group_index: torch.Tensor
    values: Optional[torch.Tensor] = None
    token_rewards: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    baseline_rewards: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    rollout_logprobs: Optional[torch.Tensor] = None
    answer_ids: Optional[torch.Tensor] = None
    teacher_logprobs: Optional[torch.Tensor] = None
    reference_rewards: Optional[torch.Tensor] = None
    privileged_shifts: Optional[torch.Tensor] = None
    truncated: Optional[torch.Tensor] = None
    window_mask: Optional[torch.Tensor] = None
    probe_values: Optional[torch.Tensor] = None
    response_ids: Optional[torch.Tensor] = None
    extras: Dict[str, Any] = dataclasses.field(default_factory=dict)

    #: the ``batch.extras`` key of a field whose key differs from its name
    EXTRAS_KEYS = {"truncated": "window_truncated"}

    @classmethod
    def from_batch(cls, batch: Any, token_rewards: Optional[torch.Tensor] = None) -> "AdvantageInput":
        """The estimator's input from a :class:`rlpost.core.batch.RolloutBatch`: every optional field from
        ``batch.extras`` under its own name (or :attr:`EXTRAS_KEYS`), absent -> None; ``extras`` holds
        every entry of ``batch.extras`` (a new estimator input needs no new field: a method writes it
        there in its ``prepare`` hook and the estimator reads ``inp.extras[key]``)."""
        opt = {f.name: batch.extras.get(cls.EXTRAS_KEYS.get(f.name, f.name)) for f in dataclasses.fields(cls)
               if f.name not in ("rewards", "response_mask", "group_index", "token_rewards", "rollout_logprobs",
                                 "response_ids", "extras")}
        return cls(rewards=batch.rewards, response_mask=batch.response_mask, group_index=batch.group_index,
                   token_rewards=token_rewards, rollout_logprobs=batch.rollout_logprobs,
                   response_ids=batch.response_ids, extras=dict(batch.extras), **opt)


class Baseline(Choice):
    """``algo.adv_params.baseline`` of the group-baseline estimators."""

    mean = "mean"
    min_variance = "min_variance"


class StdScope(Choice):
    """Over which rewards GRPO's std is taken: each prompt's group, or the whole batch."""

    group = "group"
    batch = "batch"


#: choices of ``algo.adv_params.baseline`` for the group-baseline estimators
BASELINES = tuple(b.value for b in Baseline)

_BASELINE_DOC = "mean: the estimator's own group baseline; min_variance: VCPO's importance-weighted one (arXiv:2602.17616)"


@dataclass(frozen=True)
class GRPOParams:
    """GRPO's group normalisation (DeepSeekMath, arXiv:2402.03300: (r - mean) / std)."""

    norm_by_std: bool = param(True, "divide by the group std (GRPO: true; Dr. GRPO arXiv:2503.20783: false)")
    eps: float = param(1e-6, "added to the group std (numerical guard; GRPO reference code: 1e-6)")
    baseline: Baseline = param(Baseline.mean, _BASELINE_DOC)
    unbiased_std: bool = param(True, "Bessel-corrected group std (GRPO reference code); false: population std "
                               "(TPO's z-score, arXiv:2604.06159)")
    std_scope: StdScope = param(StdScope.group, "group: each group's std (GRPO); batch: the std of all the step's "
                                "rewards, the group mean still subtracted (TRL scale_rewards='batch')")


@dataclass(frozen=True)
class GAEParams:
    """GAE (arXiv:1506.02438) as PPO for LLMs uses it (InstructGPT arXiv:2203.02155: gamma 1, lambda 0.95)."""

    gamma: float = param(1.0, "discount per token (LLM PPO: 1)")
    lam: float = param(0.95, "GAE lambda (LLM PPO practice: 0.95)")
    whiten: bool = param(True, "whiten advantages over the batch (standard PPO practice)")


@dataclass(frozen=True)
class SAOParams:
    """SAO's value-baseline advantage; the abstract gives no estimator, so Monte-Carlo GAE(1, 1) (our choice)."""

    gamma: float = param(1.0, "discount per token (our choice: 1)")
    lam: float = param(1.0, "GAE lambda; 1 = R - V(s_t), the unbiased choice for a sparse reward (our choice)")
    whiten: bool = param(False, "whiten over the batch; off keeps the sign's meaning (our choice)")


@dataclass(frozen=True)
class BaselineParams:
    """The baseline choice of a group-baseline estimator without other parameters."""

    baseline: Baseline = param(Baseline.mean, _BASELINE_DOC)


@dataclass(frozen=True)
class ReinforcePPParams:
    """REINFORCE++'s reward-to-go (arXiv:2501.03262: gamma = 1)."""

    gamma: float = param(1.0, "discount of the token reward-to-go (REINFORCE++: 1)")


@dataclass(frozen=True)
class ReinforcePPBaselineParams:
    """REINFORCE++-baseline (arXiv:2501.03262): group mean subtracted, then global whitening."""

    gamma: float = param(1.0, "discount of the token reward-to-go (REINFORCE++: 1)")
    baseline: Baseline = param(Baseline.mean, _BASELINE_DOC)


@dataclass(frozen=True)
class GPGParams:
    """GPG's rectified group advantage (arXiv:2504.02546; authors' best setting F_norm = 1, alpha = B / (B - M))."""

    norm_by_std: bool = param(False, "F_norm = group std instead of 1 (authors' best and released setting: false)")
    eps: float = param(1e-6, "added to the std when norm_by_std")
    baseline: Baseline = param(Baseline.mean, _BASELINE_DOC)


@dataclass(frozen=True)
class MCGRPOParams:
    """MC-GRPO's median-centred advantage (the abstract gives the centring only; std normalisation is our choice)."""

    norm_by_std: bool = param(True, "divide by the std of all G + 1 rewards (our choice)")
    eps: float = param(1e-6, "added to the std")


@dataclass(frozen=True)
class HAPOAdvParams:
    """HAPO's Token-Level Group Average (arXiv:2509.16591; fallback bound from the authors' release)."""

    norm_by_std: bool = param(True, "divide by the token-level group std (HAPO: true)")
    eps: float = param(1e-6, "added to the std")
    max_abs: float = param(5.0, "a group with any |A_i| >= max_abs falls back to GRPO's advantage (authors' release: 5)")


@dataclass(frozen=True)
class MSSRParams:
    """MSSR's single-rollout advantage with bounded entropy shaping (arXiv:2512.18215; shaping of arXiv:2506.14758)."""

    entropy_alpha: float = param(0.4, "entropy bonus scale alpha (Reasoning with Exploration, arXiv:2506.14758: 0.4)")
    entropy_kappa: float = param(2.0, "bonus <= |A| / kappa, kappa > 1 (arXiv:2506.14758: 2)")
    batch_norm: bool = param(True, "divide by the batch std of A (group-free normalisation)")
    eps: float = param(1e-6, "added to the batch std")


def min_variance_group_baseline(
    inp: AdvantageInput, score_sq: Optional[torch.Tensor] = None, leave_one_out: bool = False
) -> torch.Tensor:
    """VCPO's off-policy minimum-variance group baseline ``[B]`` (arXiv:2602.17616).

    Sequence weights ``w_i = prod_t pi_old / pi_behav`` over the response mask
    (from ``inp.old_logprobs`` and ``inp.rollout_logprobs``, rescaled per group so
    they cannot overflow), then
    :func:`rlpost.algos.offpolicy.min_variance_baseline`:
    ``b_g = sum w_i^2 s_i r_i / sum w_i^2 s_i`` (``s_i = score_sq`` or 1).

    Raises:
        ValueError: ``inp.old_logprobs`` or ``inp.rollout_logprobs`` is None.
    """

    if inp.old_logprobs is None or inp.rollout_logprobs is None:
        raise ValueError("baseline='min_variance' needs old_logprobs and rollout_logprobs (the sequence "
                         "importance weights pi_old / pi_behav); the runner computes old_logprobs for it")
    lw = sequence_log_weights(inp.old_logprobs, inp.rollout_logprobs, inp.response_mask)
    w = group_normalized_weights(lw, inp.group_index)
    sq = None if score_sq is None else score_sq.double()
    return min_variance_baseline(inp.rewards.double(), w, inp.group_index, sq, leave_one_out)


def _check_baseline(baseline: str) -> None:
    if baseline not in BASELINES:
        raise ValueError(f"baseline={baseline!r}: valid choices are {', '.join(BASELINES)}")


@dataclass
class AdvantageOutput:
    """Estimator output.

    Attributes:
        advantages: ``[B, R]`` per-token advantages, 0 outside the mask.
        returns: ``[B, R]`` value targets for a critic, or None for critic-free
            estimators.
        loss_mask: ``[B, R]`` 0/1 mask that the trainer multiplies into the
            response mask (sequences an estimator excludes from the update, such
            as MC-GRPO's median pivot), or None to keep every token.
        value_mask: ``[B, R]`` 0/1 positions where the critic regresses on ``returns``
            (``sapo_ar``: turn starts), or None for every response token.
        extras: named ``[B]`` or ``[B, R]`` tensors the estimator computed over the whole
            batch for the loss (``mopd``: each row's domain budget weight); the runner puts
            them into ``batch.extras``. An estimator that returns some declares their keys
            with the registry tag ``provides=(...)`` (config validation counts it as their provider).
    """

    advantages: torch.Tensor
    returns: Optional[torch.Tensor] = None
    loss_mask: Optional[torch.Tensor] = None
    value_mask: Optional[torch.Tensor] = None
    extras: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def outcome_token_rewards(inp: AdvantageInput) -> torch.Tensor:
    """``[B, R]`` float64 rewards with the outcome reward on each sequence's last response token.

    ``inp.token_rewards`` (if any) is added on every token.
    """
    mask = inp.response_mask
    B, R = mask.shape
    lengths = mask.sum(-1).long()
    # the last masked position (not lengths - 1: a multi-turn episode's mask has environment holes)
    last = (torch.arange(R) * (mask > 0)).argmax(-1) if R else torch.zeros(B, dtype=torch.long)
    tr = torch.zeros(B, R, dtype=torch.float64)
    has = lengths > 0
    tr[torch.arange(B)[has], last[has]] = inp.rewards.double()[has]
    if inp.token_rewards is not None:
        tr = tr + inp.token_rewards.double() * mask.double()
    return tr


@ADV_ESTIMATORS.register(
    "grpo",
    paper="DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models (arXiv:2402.03300)",
    params=GRPOParams,
    needs_group=True,
)
def grpo_advantage(
    inp: AdvantageInput, *, norm_by_std: bool, eps: float, baseline: str, unbiased_std: bool, std_scope: str
) -> AdvantageOutput:
    """Group-relative outcome advantage: ``A_i = (r_i - mean_g) / (std_g + eps)``.

    The same advantage is broadcast to every response token of sequence ``i``.
    ``std_g`` is the unbiased (Bessel-corrected) standard deviation of the group's
    rewards, as in the GRPO reference implementations. With ``norm_by_std=False``
    it is Dr. GRPO's ``r_i - mean_g`` (arXiv:2503.20783).

    A group whose rewards are all equal (zero variance) gets advantage exactly 0,
    never NaN; a group of size 1 likewise gets 0.

    With ``baseline="min_variance"`` the group mean is replaced by VCPO's
    minimum-variance baseline (:func:`min_variance_group_baseline`,
    arXiv:2602.17616) in groups with reward variance; ``std_g`` stays the plain
    group std. On-policy (``old_logprobs == rollout_logprobs``) the result is
    bit-identical to ``baseline="mean"``.

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]``
            (and ``old_logprobs`` / ``rollout_logprobs`` ``[B, R]`` for ``min_variance``).
        norm_by_std: divide by the group std.
        eps: added to the std.
        baseline: ``"mean"`` or ``"min_variance"``.
        unbiased_std: Bessel-corrected std (default); false uses the population
            std ``sqrt(sum (r - mean)^2 / G)``, TPO's within-group z-score
            ("Target Policy Optimization", arXiv:2604.06159, Appendix A).
        std_scope: ``"group"`` (GRPO) or ``"batch"``: ``A_i = (r_i - mean_g) / (std_B + eps)``
            with ``std_B`` the std of all ``B`` rewards of the step (Bessel-corrected unless
            ``unbiased_std`` is false), TRL's ``scale_rewards="batch"``; zero-variance groups
            still get 0.
    Returns:
        AdvantageOutput with ``advantages [B, R]`` and ``returns=None``.
    Raises:
        ValueError: unknown ``baseline``, or ``min_variance`` without log-probs.
    """
    _check_baseline(baseline)
    r = inp.rewards.double()
    mean, std, cnt = group_stats(r, inp.group_index)
    if not unbiased_std:
        std = std * torch.sqrt(((cnt - 1) / cnt.clamp(min=1)).clamp(min=0))
    flat = group_all_equal(r, inp.group_index)
    if baseline == "min_variance":
        mean = torch.where(flat, mean, min_variance_group_baseline(inp))
    adv = r - mean
    if norm_by_std:
        if str(std_scope) == "batch":
            std = r.std(unbiased=bool(unbiased_std)) if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
        adv = adv / (std + eps)
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return AdvantageOutput(advantages=_broadcast(adv, inp.response_mask), returns=None)


def discounted_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    bootstrap: Optional[torch.Tensor] = None,
):
    """Generalised advantage estimation over right-padded sequences.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V`` after the last response
    token taken as ``bootstrap`` (default 0: the episode ends; T-PPO's ``egae``
    passes the critic's value at the cut for a window-truncated row);
    ``A_t = delta_t + gamma * lam * A_{t+1}``;
    ``returns = A + V``. Positions outside ``mask`` get 0. Mask-0 positions inside a
    response (environment tokens of a multi-turn episode) are skipped: ``t + 1`` is the
    next masked token, so the environment's text is part of the transition between two
    model tokens, not an end of the episode.

    Args:
        token_rewards, values, mask: ``[B, R]``.
        gamma: discount, lam: GAE lambda.
        bootstrap: ``[B]`` value of the state after each row's last response token, or None (0).
    Returns:
        ``(advantages [B, R], returns [B, R])``, float64.
    """
    B, R = mask.shape
    mask = mask.double()
    values = values.double() * mask
    token_rewards = token_rewards.double()
    adv = torch.zeros(B, R, dtype=torch.float64)
    last = torch.zeros(B, dtype=torch.float64)
    next_v = torch.zeros(B, dtype=torch.float64) if bootstrap is None else bootstrap.double().clone()
    for t in range(R - 1, -1, -1):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_v - values[:, t]
        # mask-0 positions carry A_{t+1} and V_{t+1} through unchanged (trailing padding: both stay 0)
        last = torch.where(m > 0, delta + gamma * lam * last, last)
        adv[:, t] = last * m
        next_v = torch.where(m > 0, values[:, t], next_v)
    returns = (adv + values) * mask
    return adv * mask, returns


@ADV_ESTIMATORS.register(
    "gae",
    paper="High-Dimensional Continuous Control Using Generalized Advantage Estimation (arXiv:1506.02438); "
    "PPO for LLMs as in InstructGPT (arXiv:2203.02155)",
    params=GAEParams,
    needs_critic=True,
    uses_token_rewards=True,
    zero_variance="critic baseline",
)
def gae_advantage(
    inp: AdvantageInput, *, gamma: float, lam: float, whiten: bool
) -> AdvantageOutput:
    """PPO's token-level advantage from a critic with GAE(gamma, lambda).

    The outcome reward sits on the last response token (plus any
    ``token_rewards``, e.g. KL-in-reward). Advantages are whitened over the batch
    when ``whiten`` (standard PPO practice); returns are computed before whitening.

    Raises:
        ValueError: if ``inp.values`` is None (GAE needs a critic).
    """
    if inp.values is None:
        raise ValueError("GAE needs critic values (inp.values); use a critic or a critic-free estimator")
    tr = outcome_token_rewards(inp)
    adv, ret = discounted_gae(tr, inp.values, inp.response_mask, gamma, lam)
    if whiten:
        adv = masked_whiten(adv, inp.response_mask)
    return AdvantageOutput(advantages=adv.float(), returns=ret.float())


@ADV_ESTIMATORS.register(
    "sao",
    paper="Single-Rollout Asynchronous Optimization for Agentic Reinforcement Learning (SAO, arXiv:2607.07508)",
    params=SAOParams,
    needs_critic=True,
    uses_token_rewards=True,
    zero_variance="critic baseline",
)
def sao_advantage(
    inp: AdvantageInput,
    *,
    gamma: float,
    lam: float,
    whiten: bool,
) -> AdvantageOutput:
    """Single-rollout advantage with a learned value model as baseline (SAO).

    With one rollout per prompt there is no group to take a baseline from; SAO
    uses a trained value model instead. The abstract does not give the estimator;
    our choice (documented): GAE with ``gamma=1, lam=1`` by default, which reduces
    to ``A_t = R - V(s_t)`` (Monte-Carlo return minus the value of each prefix),
    the lowest-bias choice for a sparse outcome reward. ``whiten`` is off by
    default so the sign of ``A`` keeps its meaning (better/worse than predicted).

    Raises:
        ValueError: if ``inp.values`` is None.
    """
    if inp.values is None:
        raise ValueError("SAO needs a value model (inp.values); set algo.critic.enabled=true")
    tr = outcome_token_rewards(inp)
    adv, ret = discounted_gae(tr, inp.values, inp.response_mask, gamma, lam)
    if whiten:
        adv = masked_whiten(adv, inp.response_mask)
    return AdvantageOutput(advantages=adv.float(), returns=ret.float())


def _broadcast(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` sequence advantages (any float dtype) -> float32 ``[B, R]`` on the response tokens."""
    return (adv.double()[:, None] * mask.double()).float()


def reverse_cumsum(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted reward-to-go ``G_t = sum_{s>=t} gamma^(s-t) r_s`` over masked tokens.

    Args:
        token_rewards, mask: ``[B, R]``.
        gamma: discount.
    Returns:
        ``[B, R]`` float64 returns, 0 outside ``mask``.
    """
    B, R = mask.shape
    token_rewards = token_rewards.double()
    out = torch.zeros(B, R, dtype=torch.float64)
    run = torch.zeros(B, dtype=torch.float64)
    for t in range(R - 1, -1, -1):
        m = mask[:, t].double()
        run = torch.where(m > 0, token_rewards[:, t] + gamma * run, run)  # holes carry the return through
        out[:, t] = run * m
    return out


@ADV_ESTIMATORS.register(
    "reinforce",
    paper="Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement Learning "
    "(REINFORCE, Williams 1992); no baseline",
    no_baseline=True,
    zero_variance="no baseline",
)
def reinforce_advantage(inp: AdvantageInput) -> AdvantageOutput:
    """Plain REINFORCE without a baseline: ``A_i = r_i`` on every response token.

    Also the neutral choice for losses that ignore advantages (``sft``).
    """
    return AdvantageOutput(advantages=_broadcast(inp.rewards, inp.response_mask))


@ADV_ESTIMATORS.register(
    "rloo",
    paper="Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs "
    "(RLOO, arXiv:2402.14740)",
    params=BaselineParams,
    needs_group=True,
)
def rloo_advantage(inp: AdvantageInput, *, baseline: str) -> AdvantageOutput:
    """REINFORCE leave-one-out: ``A_i = r_i - mean_{j != i, j in g} r_j``.

    Equivalently ``G / (G - 1) * (r_i - mean_g)`` for a group of size ``G``. A
    group of one has no other sample and gets 0. No std normalisation (as in the
    paper). Shapes: rewards ``[B]`` -> advantages ``[B, R]``.

    ``baseline="min_variance"``: the leave-one-out mean becomes VCPO's
    minimum-variance baseline over the other members,
    ``sum_{j != i} w_j^2 r_j / sum_{j != i} w_j^2`` (arXiv:2602.17616; our
    leave-one-out form); equal weights give the plain leave-one-out mean.

    Raises:
        ValueError: unknown ``baseline``, or ``min_variance`` without log-probs.
    """
    _check_baseline(baseline)
    r = inp.rewards.double()
    mean, std, cnt = group_stats(r, inp.group_index)
    flat = group_all_equal(r, inp.group_index)
    adv = torch.where(cnt > 1, (r - mean) * cnt / (cnt - 1).clamp(min=1), torch.zeros_like(r))
    if baseline == "min_variance":
        adv = r - min_variance_group_baseline(inp, leave_one_out=True)
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return AdvantageOutput(advantages=_broadcast(adv, inp.response_mask))


@ADV_ESTIMATORS.register(
    "reinforce_pp",
    paper="REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global Advantage Normalization "
    "(arXiv:2501.03262)",
    params=ReinforcePPParams,
    uses_token_rewards=True,
    zero_variance="global whitening over the batch",
)
def reinforce_pp_advantage(inp: AdvantageInput, *, gamma: float) -> AdvantageOutput:
    """REINFORCE++: token reward-to-go, whitened over the whole batch.

    Token rewards are the outcome reward on the last token plus
    ``inp.token_rewards`` (the per-token KL penalty ``-beta * KL`` when the KL
    sits in the reward, as the paper does); ``G_t`` is their discounted
    reward-to-go and the advantage is ``(G_t - mean) / std`` over all response
    tokens of the batch (global, not per group). A batch whose returns are all
    equal gets 0.

    Std: the Bessel-corrected one (:func:`rlpost.algos.utils.masked_whiten`, as verl's
    ``masked_whiten``). OpenRLHF, the REINFORCE++ authors' framework, divides by the population
    std; the two differ by the factor ``sqrt(N / (N - 1))`` over ``N`` response tokens (3.6e-3 on
    advantages up to about 3 in the issue-29 comparison). A documented departure
    (docs/ALGORITHMS.md); the paper's text does not fix it.

    Returns:
        AdvantageOutput with advantages ``[B, R]`` and the un-whitened returns.
    """
    tr = outcome_token_rewards(inp)
    ret = reverse_cumsum(tr, inp.response_mask, gamma)
    return AdvantageOutput(advantages=masked_whiten(ret, inp.response_mask).float(), returns=ret.float())


@ADV_ESTIMATORS.register(
    "reinforce_pp_baseline",
    paper="REINFORCE++ (arXiv:2501.03262), the group-baseline variant",
    params=ReinforcePPBaselineParams,
    needs_group=True,
    uses_token_rewards=True,
    zero_variance="group mean, then global whitening shifts every token",
)
def reinforce_pp_baseline_advantage(
    inp: AdvantageInput, *, gamma: float, baseline: str
) -> AdvantageOutput:
    """REINFORCE++-baseline: subtract the group mean reward, then whiten over the batch.

    ``r'_i = r_i - mean_g``; the token reward-to-go of ``r'`` (plus any
    ``token_rewards``) is whitened over all response tokens of the batch. The
    group mean removes the prompt's difficulty; the global normalisation (not
    per-group std) is the paper's remedy for GRPO's per-prompt std bias. Std: Bessel-corrected,
    a documented departure from OpenRLHF's population std (see :func:`reinforce_pp_advantage`).
    ``baseline="min_variance"`` subtracts VCPO's minimum-variance baseline
    instead (arXiv:2602.17616). Shapes: rewards ``[B]`` -> ``[B, R]``.

    Raises:
        ValueError: unknown ``baseline``, or ``min_variance`` without log-probs.
    """
    _check_baseline(baseline)
    r = inp.rewards.double()
    mean, std, _ = group_stats(r, inp.group_index)
    flat = group_all_equal(r, inp.group_index)
    if baseline == "min_variance":
        mean = torch.where(flat, mean, min_variance_group_baseline(inp))
    shifted = AdvantageInput(**{**inp.__dict__, "rewards": torch.where(flat, torch.zeros_like(r), r - mean)})
    tr = outcome_token_rewards(shifted)
    ret = reverse_cumsum(tr, inp.response_mask, gamma)
    return AdvantageOutput(advantages=masked_whiten(ret, inp.response_mask).float(), returns=ret.float())


@ADV_ESTIMATORS.register(
    "remax",
    paper="ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning LLMs "
    "(arXiv:2310.10505)",
    needs_baseline_rollout=True,
    uses_token_rewards=True,
    zero_variance="greedy-rollout baseline",
)
def remax_advantage(inp: AdvantageInput) -> AdvantageOutput:
    """ReMax: the reward of the greedy response to the same prompt is the baseline.

    ``A_t = G_t - r(greedy)`` with ``G_t`` the (undiscounted) reward-to-go of the
    sampled response, i.e. ``r_i - b_i`` on every token for an outcome reward.
    ``inp.baseline_rewards`` ``[B]`` holds ``b_i``, the reward of a greedy
    rollout of sample ``i``'s prompt (the trainer produces it).

    Raises:
        ValueError: ``inp.baseline_rewards`` is None.
    """
    if inp.baseline_rewards is None:
        raise ValueError("ReMax needs baseline_rewards: the reward of a greedy rollout per prompt")
    tr = outcome_token_rewards(inp)
    ret = reverse_cumsum(tr, inp.response_mask, 1.0)
    adv = (ret - inp.baseline_rewards.double()[:, None]) * inp.response_mask.double()
    return AdvantageOutput(advantages=adv.float(), returns=ret.float())


@ADV_ESTIMATORS.register(
    "opo",
    paper="On-Policy RL with Optimal Reward Baseline (OPO, arXiv:2505.23585)",
    params=BaselineParams,
    needs_group=True,
)
def opo_advantage(inp: AdvantageInput, *, baseline: str) -> AdvantageOutput:
    """OPO's length-weighted optimal baseline: ``b_g = sum_j L_j r_j / sum_j L_j``.

    ``L_j`` is the response length (mask sum) of sample ``j``; ``A_i = r_i - b_g``
    without std normalisation. This is the variance-minimising baseline when the
    squared gradient norm grows with length. Groups whose samples all have
    length 0 get the plain mean.

    ``baseline="min_variance"``: its off-policy form with VCPO's squared
    importance weights (arXiv:2602.17616), ``sum w_j^2 L_j r_j / sum w_j^2 L_j``;
    equal weights give OPO's baseline (up to float rounding: float64 here).
    Shapes: rewards ``[B]`` -> ``[B, R]``.

    Raises:
        ValueError: unknown ``baseline``, or ``min_variance`` without log-probs.
    """
    _check_baseline(baseline)
    r = inp.rewards.double()
    L = inp.response_mask.double().sum(-1)
    inv, G = group_ids(inp.group_index)
    num = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, L * r)
    den = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, L)
    mean, std, _ = group_stats(r, inp.group_index)
    flat = group_all_equal(r, inp.group_index)
    b = torch.where(den[inv] > 0, num[inv] / den[inv].clamp(min=1e-12), mean)
    if baseline == "min_variance":
        b = min_variance_group_baseline(inp, score_sq=L)
    adv = torch.where(flat, torch.zeros_like(r), r - b)
    return AdvantageOutput(advantages=_broadcast(adv, inp.response_mask))


@ADV_ESTIMATORS.register(
    "gpg",
    paper="GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning (arXiv:2504.02546)",
    params=GPGParams,
    needs_group=True,
)
def gpg_advantage(
    inp: AdvantageInput, *, norm_by_std: bool, eps: float, baseline: str
) -> AdvantageOutput:
    """GPG's rectified group advantage ``A_i = alpha * (r_i - mean_g) / F_norm``.

    ``alpha = B / (B - M)`` where ``M`` is the number of samples in groups whose
    rewards are all equal (they carry no gradient), so that the batch-mean
    gradient is not diluted by them (the paper's gradient rectification).
    ``F_norm`` is the group std (+eps) when ``norm_by_std``, else 1. Zero-variance
    groups get 0. ``alpha`` is 1 when every group is degenerate.
    ``baseline="min_variance"`` replaces ``mean_g`` by VCPO's minimum-variance
    baseline (arXiv:2602.17616). Shapes: rewards ``[B]`` -> ``[B, R]``.

    Raises:
        ValueError: unknown ``baseline``, or ``min_variance`` without log-probs.
    """
    _check_baseline(baseline)
    r = inp.rewards.double()
    mean, std, cnt = group_stats(r, inp.group_index)
    valid = ~group_all_equal(r, inp.group_index)
    if baseline == "min_variance":
        mean = torch.where(valid, min_variance_group_baseline(inp), mean)
    B = r.numel()
    n_valid = int(valid.sum())
    alpha = B / n_valid if n_valid > 0 else 1.0
    adv = r - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(valid, alpha * adv, torch.zeros_like(adv))
    return AdvantageOutput(advantages=_broadcast(adv, inp.response_mask))


@ADV_ESTIMATORS.register(
    "mc_grpo",
    paper="MC-GRPO: Median-Centered Group Relative Policy Optimization for Small-Rollout Reinforcement Learning (arXiv:2601.22582)",
    params=MCGRPOParams,
    needs_group=True,
    odd_group=True,
)
def mc_grpo_advantage(
    inp: AdvantageInput, *, norm_by_std: bool, eps: float
) -> AdvantageOutput:
    """Median-centred group advantage over ``G + 1`` rollouts, pivot excluded.

    ``A_i = (r_i - median_g) / (std_g + eps)`` (``/`` only when ``norm_by_std``;
    the std is over all ``G + 1`` rewards, our choice: the abstract gives only
    the centring). In each group one rollout whose reward equals the median,
    the first in batch order, is the *pivot*: it gets advantage 0 and
    ``loss_mask`` 0 so it is left out of the update, leaving ``G`` rollouts with
    gradient. Use an odd group size so the median is a sample. Zero-variance
    groups get 0.

    Returns:
        AdvantageOutput with ``advantages [B, R]`` and ``loss_mask [B, R]``.
    """
    r = inp.rewards.double()
    med = group_median(r, inp.group_index)
    _, std, _ = group_stats(r, inp.group_index)
    flat = group_all_equal(r, inp.group_index)
    adv = r - med
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    inv, G = group_ids(inp.group_index)
    keep = torch.ones_like(r)
    for g in range(G):
        idx = torch.nonzero((inv == g) & (r == med), as_tuple=False).flatten()
        if idx.numel():
            keep[idx[0]] = 0.0
    adv = adv * keep
    return AdvantageOutput(advantages=_broadcast(adv, inp.response_mask), loss_mask=(keep[:, None] * inp.response_mask.double()).float())


@ADV_ESTIMATORS.register(
    "hapo",
    paper="From Uniform to Heterogeneous: Tailoring Policy Optimization to Every Token's Nature "
    "(HAPO, arXiv:2509.16591): Token Level Group Average",
    params=HAPOAdvParams,
    needs_group=True,
)
def hapo_advantage(
    inp: AdvantageInput, *, norm_by_std: bool, eps: float, max_abs: float
) -> AdvantageOutput:
    """HAPO's Token-Level Group Average advantage.

    The group's mean and std are taken over its *tokens* rather than its
    sequences: every token of sample ``i`` carries ``r_i``, so
    ``mu_g = sum_i L_i r_i / sum_i L_i`` and
    ``sigma_g^2 = sum_i L_i (r_i - mu_g)^2 / sum_i L_i`` (population variance).
    ``A_i = (r_i - mu_g) / (sigma_g + eps)``. This accounts for length like a
    token-mean loss does while the baseline stays unbiased for the token-level
    objective. As in the authors' release, a group where any ``|A_i| >= max_abs``
    (a very skewed length/reward mix) falls back to the sequence-level GRPO
    advantage. Zero-variance groups get 0.
    """
    r = inp.rewards.double()
    L = inp.response_mask.double().sum(-1)
    inv, G = group_ids(inp.group_index)
    f64 = dict(dtype=torch.float64)
    den = torch.zeros(G, **f64).index_add_(0, inv, L).clamp(min=1e-12)
    mu = torch.zeros(G, **f64).index_add_(0, inv, L * r) / den
    var = torch.zeros(G, **f64).index_add_(0, inv, L * (r - mu[inv]) ** 2) / den
    sd = var.sqrt()[inv]
    # Equal rewards, or rewards that differ only on empty responses (L = 0 carries no token).
    flat = group_all_equal(torch.where(L > 0, r, mu[inv]), inp.group_index)
    adv = r - mu[inv]
    if norm_by_std:
        adv = adv / (sd + eps)
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    mean_g, std_g, _ = group_stats(r, inp.group_index)
    grpo_seq = (r - mean_g) / (std_g + eps) if norm_by_std else r - mean_g
    grpo_seq = torch.where(group_all_equal(r, inp.group_index), torch.zeros_like(r), grpo_seq)
    too_big = torch.zeros(G, **f64).index_add_(0, inv, (adv.abs() >= max_abs).double()) > 0
    adv = torch.where(too_big[inv], grpo_seq, adv)
    return AdvantageOutput(advantages=_broadcast(adv, inp.response_mask))


@ADV_ESTIMATORS.register(
    "mssr",
    paper="Stable and Efficient Single-Rollout RL for Multimodal Reasoning (MSSR, arXiv:2512.18215); entropy "
    "shaping of Reasoning with Exploration: An Entropy Perspective (arXiv:2506.14758)",
    params=MSSRParams,
    needs_entropy=True,
    zero_variance="per-prompt running baseline",
)
def mssr_advantage(
    inp: AdvantageInput,
    *,
    entropy_alpha: float,
    entropy_kappa: float,
    batch_norm: bool,
    eps: float,
) -> AdvantageOutput:
    """Single-rollout advantage with a prompt baseline and bounded entropy shaping.

    1. Baseline: ``b_i = inp.baseline_rewards[i]``, the running success estimate
       of sample ``i``'s prompt (e.g. the Beta posterior mean of
       :class:`rlpost.algos.shaping.BetaBaselineTracker`); when absent, the batch
       mean reward (our fallback, no per-prompt history).
    2. ``A_i = r_i - b_i``, divided by the batch std of ``A`` when ``batch_norm``
       (group-free normalisation over the whole batch).
    3. Entropy shaping per token: ``A_t = A_i + min(alpha * H_t, |A_i| / kappa)``
       with ``H_t`` the detached token entropy (nats). The bonus is at most
       ``|A_i| / kappa`` (``kappa > 1``), so it never flips the advantage's sign
       and never more than scales its magnitude by ``1 + 1/kappa``: this is the
       bound on advantage magnitudes that keeps single-rollout training from
       collapsing. ``alpha=0.4, kappa=2`` are the entropy-shaping paper's
       defaults (the MSSR abstract gives none).

    Raises:
        ValueError: ``inp.entropy`` is None, or ``entropy_kappa <= 1``.
    """
    if inp.entropy is None:
        raise ValueError("mssr needs per-token entropy (inp.entropy) of the rollout tokens")
    if entropy_kappa <= 1.0:
        raise ValueError(f"entropy_kappa must be > 1 so shaping cannot flip the sign, got {entropy_kappa}")
    r = inp.rewards.double()
    b = inp.baseline_rewards.double() if inp.baseline_rewards is not None else r.mean().expand_as(r)
    adv = r - b
    if inp.baseline_rewards is None and bool((r == r[0]).all()):
        adv = torch.zeros_like(r)  # equal rewards, batch-mean baseline: exactly 0, no rounding residue
    if batch_norm and adv.numel() > 1 and not bool((adv == adv[0]).all()):
        adv = adv / (adv.std() + eps)
    A = _broadcast(adv, inp.response_mask)
    bonus = torch.minimum(entropy_alpha * inp.entropy.float().detach().clamp(min=0), A.abs() / entropy_kappa)
    return AdvantageOutput(advantages=((A + bonus) * inp.response_mask).float())


# --- Difficulty-weighted group advantages: A_i = w(p_g) * (r_i - p_g) -------------------------------
#
# BNPO, MaxRL and F-GRPO share one mechanism: the group-centred reward ``r_i - p_g`` (``p_g`` the
# group's mean reward, its success rate for 0/1 rewards) scaled by a weight that depends only on
# the prompt's difficulty ``p_g``. GRPO itself is the weight ``1 / std_g``. "Advantage Shaping as
# Surrogate Reward Maximization" (arXiv:2510.23049) reads every such weight as the gradient of a
# surrogate objective F(p). The three estimators below differ only in ``w``.


def difficulty_weighted_advantage(
    inp: AdvantageInput, rewards: torch.Tensor, weight: torch.Tensor, centre: torch.Tensor, std: torch.Tensor
) -> AdvantageOutput:
    """``A_i = weight_i * (rewards_i - centre_i)`` on every response token; 0 in zero-variance groups.

    The shared last step of :func:`bnpo_advantage`, :func:`maxrl_advantage` and
    :func:`fgrpo_advantage`.

    Args:
        inp: supplies ``response_mask [B, R]``.
        rewards, weight, centre, std: ``[B]`` (per sample; ``weight``, ``centre``
            and ``std`` constant within a group). A group with ``std == 0``
            (all rewards equal, or a single sample) gets exactly 0, never NaN,
            whatever its weight (the weight may be infinite there).
    Returns:
        AdvantageOutput with ``advantages [B, R]``.
    """
    has_signal = std > 0
    safe_w = torch.where(has_signal, weight, torch.zeros_like(weight))
    adv = torch.where(has_signal, safe_w * (rewards - centre), torch.zeros_like(rewards))
    return AdvantageOutput(advantages=_broadcast(adv.float(), inp.response_mask))


@dataclass(frozen=True)
class BNPOParams:
    """BNPO's reward range (arXiv:2506.02864; authors' release maps rewards to [0, 1] with min 0, max 1)."""

    reward_min: float = param(0.0, "reward mapped to 0 before the Beta fit (authors' release: 0)")
    reward_max: float = param(1.0, "reward mapped to 1 before the Beta fit (authors' release: 1)")
    max_weight: float = param(1e6, "cap on the weight 1 / f_N(p) (authors' release: 1e6)")


def _beta_pdf(p: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """Beta(a, b) density at ``p`` (float64; 0 ** 0 = 1, so a = b = 1 is the uniform density 1)."""
    log_norm = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    return torch.pow(p, a - 1.0) * torch.pow(1.0 - p, b - 1.0) * math.exp(-log_norm)


def bnpo_beta_params(p_groups: torch.Tensor) -> tuple:
    """BNPO's normalising Beta parameters ``(alpha, beta)`` from the batch's group success rates.

    The success rates ``p_g`` of the batch's prompts are fitted by a Beta(a, b)
    with the method of moments (``m`` mean, ``v`` unbiased variance over prompts):
    ``a = (m (1 - m) / v - 1) m``, ``b = (m (1 - m) / v - 1) (1 - m)``; the
    variance-minimising normaliser is then ``alpha = max(1 + a / 3, 1)``,
    ``beta = max(1 + b / 3, 1)`` (BNPO arXiv:2506.02864, Theorem 2; as in the
    authors' release). One prompt: ``m = 0, v = 1`` as in the release, which
    gives ``alpha = beta = 1``. Our choice where the release divides by zero
    (all prompts equally hard, ``v = 0``): ``alpha = beta = 1`` (no
    normalisation, REINFORCE with the group-mean baseline).

    Args:
        p_groups: ``[G]`` float, one success rate in [0, 1] per prompt.
    Returns:
        ``(alpha, beta)`` as Python floats, both >= 1.
    """
    p = p_groups.double()
    if p.numel() > 1:
        m, v = float(p.mean()), float(p.var())
    else:
        m, v = 0.0, 1.0
    if not v > 0:
        return 1.0, 1.0
    k = m * (1.0 - m) / v - 1.0
    a, b = k * m, k * (1.0 - m)
    if not (math.isfinite(a) and math.isfinite(b)):
        return 1.0, 1.0
    return max(1.0 + a / 3.0, 1.0), max(1.0 + b / 3.0, 1.0)


@ADV_ESTIMATORS.register(
    "bnpo",
    paper="BNPO: Beta Normalization Policy Optimization (arXiv:2506.02864)",
    params=BNPOParams,
    needs_group=True,
)
def bnpo_advantage(
    inp: AdvantageInput, *, reward_min: float, reward_max: float, max_weight: float
) -> AdvantageOutput:
    """BNPO: ``A_i = (s_i - p_g) / f_N(p_g; alpha, beta)``, a Beta density as the normaliser.

    ``s_i = (r_i - reward_min) / (reward_max - reward_min)`` (the release's affine
    map of rewards to [0, 1]; the theory is for 0/1 rewards), ``p_g`` the group
    mean of ``s`` (the prompt's estimated success rate), ``f_N`` the density of
    Beta(alpha, beta) with ``(alpha, beta)`` re-fitted on every batch by
    :func:`bnpo_beta_params`. ``1 / f_N`` is capped at ``max_weight``.
    Special cases (the paper's Section 3): alpha = beta = 1 is REINFORCE with the
    group-mean baseline; alpha = beta = 1.5 gives ``f_N ∝ sqrt(p (1 - p))``,
    GRPO's population std. The advantage is in units of ``s``, as in the
    release. Zero-variance groups get 0. The advantage-decomposition extension
    for multi-part rewards is not implemented (our rewards are one scalar).
    Shapes: rewards ``[B]`` -> advantages ``[B, R]``.

    Raises:
        ValueError: ``reward_max <= reward_min``, or a reward outside the range.
    """
    if not reward_max > reward_min:
        raise ValueError(f"bnpo needs reward_max > reward_min, got [{reward_min}, {reward_max}]")
    s = (inp.rewards.double() - reward_min) / (reward_max - reward_min)
    if s.numel() and (float(s.min()) < -1e-9 or float(s.max()) > 1 + 1e-9):
        raise ValueError(f"bnpo: rewards must lie in [reward_min, reward_max] = [{reward_min}, {reward_max}] "
                         f"(got {float(inp.rewards.min())}..{float(inp.rewards.max())}); set algo.adv_params")
    s = s.clamp(0.0, 1.0)
    p, std, _ = group_stats(s, inp.group_index)
    inv, G = group_ids(inp.group_index)
    p_groups = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, p) / torch.zeros(
        G, dtype=torch.float64).index_add_(0, inv, torch.ones_like(p))
    alpha, beta = bnpo_beta_params(p_groups)
    w = (1.0 / _beta_pdf(p, alpha, beta)).clamp(min=0.0, max=max_weight)
    return difficulty_weighted_advantage(inp, s, w, p, std)


@ADV_ESTIMATORS.register(
    "maxrl",
    paper="Maximum Likelihood Reinforcement Learning (MaxRL, arXiv:2602.02710)",
    needs_group=True,
)
def maxrl_advantage(inp: AdvantageInput) -> AdvantageOutput:
    """MaxRL: the group-centred reward divided by the group *mean* (not the std).

    ``A_i = (r_i - p_g) / p_g`` with ``p_g`` the group's mean reward. For 0/1
    rewards with ``K`` successes among ``N`` samples, ``(1/N) sum_i A_i grad log pi(y_i)
    = (1/K) sum_{r_i = 1} grad log pi(y_i) - (1/N) sum_i grad log pi(y_i)``: the
    paper's unbiased estimator of the gradient of its order-N truncated
    log-likelihood objective (the average score of the successful samples),
    with the zero-mean all-sample score as control variate. As ``N`` grows it
    approaches ``grad log p(x)``, i.e. a weight ``1 / p`` on each prompt instead
    of RL's 1: hard prompts count more. Groups with no success (``K = 0``) or
    no variance get 0. Shapes: rewards ``[B]`` -> ``[B, R]``.

    Raises:
        ValueError: a group with reward variance has mean <= 0 (MaxRL is for
            rewards in [0, 1], binary in the paper).
    """
    r = inp.rewards.double()
    p, std, _ = group_stats(r, inp.group_index)
    if bool(((std > 0) & (p <= 0)).any()):
        raise ValueError("maxrl needs non-negative rewards (binary success in the paper): a group with reward "
                         "variance has mean <= 0; shift the reward or use grpo")
    return difficulty_weighted_advantage(inp, r, 1.0 / p.clamp(min=1e-12), p, std)


@dataclass(frozen=True)
class FGRPOParams:
    """F-GRPO's focal weight (1 - p_pos)^gamma on a group-relative advantage (arXiv:2602.06717)."""

    gamma: float = param(1.0, "focal exponent gamma >= 0; 0 = plain GRPO (our choice 1: the tuned value was not in the text we could read)")
    norm_by_std: bool = param(True, "divide by the group std as GRPO does (false: Dr. GRPO-style r - mean)")
    eps: float = param(1e-6, "added to the group std (GRPO reference code: 1e-6)")


@ADV_ESTIMATORS.register(
    "fgrpo",
    paper="F-GRPO: Don't Let Your Policy Learn the Obvious and Forget the Rare (arXiv:2602.06717)",
    params=FGRPOParams,
    needs_group=True,
)
def fgrpo_advantage(inp: AdvantageInput, *, gamma: float, norm_by_std: bool, eps: float) -> AdvantageOutput:
    """F-GRPO: GRPO's advantage scaled by the focal weight ``g(x) = (1 - p_pos(x)) ** gamma``.

    ``p_pos`` is the share of the prompt's rollouts with a positive reward (its
    empirical success rate for 0/1 rewards), so prompts the policy already
    solves are down-weighted and rare-correct solutions of hard prompts keep
    their weight; ``gamma = 0`` is GRPO. ``A_i = g * (r_i - mean_g) / (std_g + eps)``
    (``/ (std_g + eps)`` only when ``norm_by_std``). The paper applies ``g`` to the
    advantage of GRPO, DAPO and CISPO alike: pair this estimator with
    ``algo.loss=ppo_clip`` / DAPO's clip / ``cispo``. Our choices: the default
    ``gamma = 1`` and "positive reward" as success for non-binary rewards.
    Zero-variance groups get 0. Shapes: rewards ``[B]`` -> ``[B, R]``.

    Raises:
        ValueError: ``gamma < 0``.
    """
    if gamma < 0:
        raise ValueError(f"fgrpo: gamma must be >= 0, got {gamma}")
    r = inp.rewards.double()
    mean, std, _ = group_stats(r, inp.group_index)
    p_pos, _, _ = group_stats((r > 0).double(), inp.group_index)
    w = (1.0 - p_pos).clamp(min=0.0) ** gamma
    if norm_by_std:
        w = w / (std + eps)
    return difficulty_weighted_advantage(inp, r, w, mean, std)


@dataclass(frozen=True)
class DGPOParams:
    """DGPO's difficulty-balanced advantage and question weights (arXiv:2601.20614; authors' release values)."""

    dqw: bool = param(True, "difficulty-aware question weighting (DQW) on (authors' release: on)")
    dqw_temp: float = param(2.0, "DQW softmax temperature T (authors' release: 2.0)")
    eps: float = param(1e-4, "added to the group's summed absolute deviation (authors' release: 1e-4)")
    rescale_valid: bool = param(True, "scale by all tokens / tokens of groups with reward variance, as the release does")


@ADV_ESTIMATORS.register(
    "dgpo",
    paper="Harder Is Better: Boosting Mathematical Reasoning via Difficulty-Aware GRPO and Multi-Aspect Question "
    "Reformulation (MathForge / DGPO, arXiv:2601.20614)",
    params=DGPOParams,
    needs_group=True,
)
def dgpo_advantage(
    inp: AdvantageInput, *, dqw: bool, dqw_temp: float, eps: float, rescale_valid: bool
) -> AdvantageOutput:
    """DGPO: mean-absolute-deviation normalisation (DGAE) times a softmax question weight (DQW).

    DGAE: ``A_i = G (r_i - mean_g) / (sum_j |r_j - mean_g| + eps)``, i.e. divided by
    the group's mean absolute deviation instead of its std, so that the total
    update ``sum_i |A_i| = G`` is the same for every question with reward
    variance (GRPO's is largest at success rate 1/2 and shrinks for hard and
    easy questions). DQW: over the ``B_v`` questions with reward variance,
    ``lambda_g = B_v * softmax_g(-mean_g / T)``, harder questions (lower mean
    reward) weigh more; others keep weight 1 (their advantage is 0). With
    ``rescale_valid`` the advantages are also multiplied by (all response
    tokens) / (tokens of questions with variance), the release's correction for
    the zero-advantage groups in a token-mean loss. Follows the authors'
    release (MathForge, TRL GRPO trainer); its per-process balancing ratio is 1
    on one process and is left out. Shapes: rewards ``[B]`` -> ``[B, R]``.

    Raises:
        ValueError: ``dqw_temp <= 0``.
    """
    if dqw_temp <= 0:
        raise ValueError(f"dgpo: dqw_temp must be > 0, got {dqw_temp}")
    r = inp.rewards.double()
    mean, std, cnt = group_stats(r, inp.group_index)
    inv, G = group_ids(inp.group_index)
    abs_dev = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, (r - mean).abs())[inv]
    w = cnt / (abs_dev + eps)
    valid = std > 0
    if dqw or rescale_valid:
        gmean = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, r) / torch.zeros(
            G, dtype=torch.float64).index_add_(0, inv, torch.ones_like(r))
        gvalid = torch.zeros(G, dtype=torch.bool)
        gvalid[inv[valid]] = True
        n_valid = int(gvalid.sum())
        if dqw and n_valid:
            lam = torch.ones(G, dtype=torch.float64)
            lam[gvalid] = n_valid * torch.softmax(-gmean[gvalid] / dqw_temp, dim=0)
            w = w * lam[inv]
        if rescale_valid and n_valid:
            L = inp.response_mask.double().sum(-1)
            w = w * (L.sum() / L[valid].sum().clamp(min=1e-12))
    return difficulty_weighted_advantage(inp, r, w, mean, std)


class MaxAtKBaseline(Choice):
    """Baseline of the max@k estimator: none, or the leave-one-out max@k of the other samples."""

    none = "none"
    loo = "loo"


@dataclass(frozen=True)
class MaxAtKParams:
    """Direct max@k optimisation (arXiv:2510.23393): k and the baseline of its on-policy estimator."""

    k: int = param(4, "k of max@k, 1 <= k <= group size (our choice 4: the paper sweeps k; k = 1 is REINFORCE)")
    baseline: MaxAtKBaseline = param(MaxAtKBaseline.loo, "loo: subtract k * max@k of the other G - 1 samples (unbiased; our choice); none")


def max_at_k_estimate(r: torch.Tensor, k: int) -> float:
    """Unbiased estimate of ``max@k = E[max of k samples' rewards]`` from ``n >= k`` samples ``r`` ``[n]``.

    The U-statistic over all size-k subsets: with rewards sorted ascending,
    ``sum_q C(q - 1, k - 1) / C(n, k) * r_(q)`` (``q`` 1-based rank).
    """
    n = r.numel()
    rs = torch.sort(r.double()).values
    return float(sum(math.comb(q - 1, k - 1) * float(rs[q - 1]) for q in range(1, n + 1)) / math.comb(n, k))


def _max_at_k_example(logprobs: torch.Tensor, generator: torch.Generator) -> Dict[str, Any]:
    """Generic tests' groups hold 3 or 4 samples: k = 2 (k + 1 samples for the leave-one-out baseline)."""
    return {"params": {"k": 2}}


@ADV_ESTIMATORS.register(
    "max_at_k",
    paper="The Best of N Worlds: Aligning Reinforcement Learning with Best-of-N Sampling via max@k Optimization "
    "(arXiv:2510.23393); the same U-statistic as Pass@K Policy Optimization (arXiv:2505.15201)",
    params=MaxAtKParams,
    needs_group=True,
    example_inputs=_max_at_k_example,
)
def max_at_k_advantage(inp: AdvantageInput, *, k: int, baseline: str) -> AdvantageOutput:
    """Unbiased on-policy gradient of max@k (pass@k for 0/1 rewards) as a per-sample advantage.

    ``grad max@k = E[max_{m<=k} r_m * sum_{m<=k} grad log pi(y_m)]``; its unbiased
    estimate from a group of ``n >= k`` samples averages over all size-k subsets
    ``S``, so sample ``i`` gets the coefficient of ``grad log pi(y_i)``
    ``A_i = k * mean_{S ∋ i} max_{j in S} r_j``
    (the factor ``n / C(n, k) = k / C(n - 1, k - 1)`` makes the group-mean
    gradient the estimate; ``k = 1`` gives ``A_i = r_i``). With ascending ranks
    ``q``: ``sum_{S ∋ i} max_S r = C(q_i - 1, k - 1) r_i + sum_{q > q_i} C(q - 2, k - 2) r_(q)``,
    so a sample is credited for the subsets it wins and for those a better
    sample wins with it. ``baseline="loo"`` subtracts ``k * max@k`` estimated
    from the other ``n - 1`` samples (independent of sample ``i``, so the
    estimate stays unbiased; needs ``n - 1 >= k``); this baseline and the
    default ``k = 4`` are our choices. The paper's off-policy correction (ratio
    weights on the subset terms) is not implemented: use it on-policy, or with
    the loss's own importance ratio. A group whose rewards are all equal gets 0.
    Shapes: rewards ``[B]`` -> ``[B, R]``.

    Raises:
        ValueError: ``k < 1``, or a group with reward variance smaller than ``k`` (``k + 1`` with
            ``loo``); config validation refuses such a group size before any model loads.
    """
    if k < 1:
        raise ValueError(f"max_at_k: k must be >= 1, got {k}")
    r = inp.rewards.double()
    inv, G = group_ids(inp.group_index)
    adv = torch.zeros_like(r)
    for g in range(G):
        idx = torch.nonzero(inv == g, as_tuple=False).flatten()
        n = idx.numel()
        rg = r[idx]
        if bool((rg == rg[0]).all()):
            continue  # no reward variance: advantage 0 whatever the group size
        need = k + 1 if baseline == "loo" else k
        if n < need:
            raise ValueError(f"max_at_k: a group has {n} samples, fewer than {need} (k={k}, baseline={baseline}); "
                             f"set algo.n_samples_per_prompt >= {need} or a smaller algo.adv_params.k")
        order = torch.argsort(rg, stable=True)
        rs = rg[order]
        # win[q] = sum over size-k subsets containing the rank-q sample of their max (1-based q)
        win = torch.zeros(n, dtype=torch.float64)
        for q in range(1, n + 1):
            tail = sum(math.comb(j - 2, k - 2) * float(rs[j - 1]) for j in range(q + 1, n + 1)) if k >= 2 else 0.0
            win[q - 1] = math.comb(q - 1, k - 1) * float(rs[q - 1]) + tail
        a = torch.zeros(n, dtype=torch.float64)
        a[order] = k * win / math.comb(n - 1, k - 1)
        if baseline == "loo":
            a = a - torch.tensor([k * max_at_k_estimate(torch.cat([rg[:m], rg[m + 1:]]), k) for m in range(n)],
                                 dtype=torch.float64)
        adv[idx] = a
    return AdvantageOutput(advantages=_broadcast(adv.float(), inp.response_mask))



# --- Issue 17, second batch: EGSW and SEED-GRPO (reweighting GRPO's advantage per sequence / prompt) ---


def _grpo_centred(inp: AdvantageInput, norm_by_std: bool, eps: float):
    """``(A [B] float64, flat [B] bool)``: GRPO's ``(r - mean) / (std + eps)`` (or ``r - mean``), 0 in flat groups."""
    r = inp.rewards.double()
    mean, std, _ = group_stats(r, inp.group_index)
    flat = group_all_equal(r, inp.group_index)
    a = r - mean
    if norm_by_std:
        a = a / (std + eps)
    return torch.where(flat, torch.zeros_like(a), a), flat


@dataclass(frozen=True)
class EGSWParams:
    """EGSW's softmax weighting (arXiv:2503.22456); the paper tunes alpha and P without values we could read."""

    alpha: float = param(0.1, "entropy weight alpha in exp((A + alpha H) / P) (our choice; paper tuned, value not read)")
    temperature: float = param(1.0, "softmax temperature P (our choice; paper tuned, value not read)")
    norm_by_std: bool = param(True, "GRPO's std normalisation of the base advantage (the paper builds on GRPO)")
    eps: float = param(1e-6, "added to the group std")


@ADV_ESTIMATORS.register(
    "egsw",
    paper="Entropy-guided sequence weighting for efficient exploration in RL-based LLM fine-tuning (EGSW, arXiv:2503.22456)",
    params=EGSWParams,
    needs_group=True,
    needs_entropy=True,
)
def egsw_advantage(
    inp: AdvantageInput, *, alpha: float, temperature: float, norm_by_std: bool, eps: float
) -> AdvantageOutput:
    """EGSW (trajectory-wise): GRPO's advantage reweighted by a softmax over the group of advantage + entropy.

    ``w_raw_i = exp((A_i + alpha H_i) / P)`` with ``A_i`` GRPO's advantage and
    ``H_i`` the mean token entropy of response ``i`` (nats, from ``inp.entropy``,
    the rollout tokens under the current policy); ``w_i = w_raw_i / sum_j w_raw_j``
    over the prompt's group, and the advantage becomes ``K w_i A_i`` (``K`` the
    group size, so equal weights give GRPO back: our choice of scale; the paper
    multiplies the policy gradient by ``w``). High-reward, high-uncertainty
    responses get more of the update. Zero-variance groups keep advantage 0.
    The paper's step-wise variant (weights per token position) is not
    implemented; alpha and P were tuned in the paper, ours are stated in
    :class:`EGSWParams`. Shapes: rewards ``[B]``, entropy ``[B, R]`` -> ``[B, R]``.

    Raises:
        ValueError: ``inp.entropy`` is None or ``temperature <= 0``.
    """
    if inp.entropy is None:
        raise ValueError("egsw needs the rollout tokens' entropy (AdvantageInput.entropy); the runner computes it")
    if temperature <= 0:
        raise ValueError(f"egsw: temperature must be > 0, got {temperature}")
    a, _ = _grpo_centred(inp, norm_by_std, eps)
    m = inp.response_mask.double()
    H = (inp.entropy.double() * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    inv, G = group_ids(inp.group_index)
    s = (a + alpha * H) / temperature
    mx = torch.full((G,), float("-inf"), dtype=torch.float64).scatter_reduce(0, inv, s, reduce="amax", include_self=True)
    e = torch.exp(s - mx[inv])
    z = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, e)
    K = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, torch.ones_like(s))
    w = K[inv] * e / z[inv]
    return AdvantageOutput(advantages=_broadcast((w * a).float(), inp.response_mask))


class SEEDScale(Choice):
    """SEED-GRPO's map f from normalised semantic entropy x in [0, 1] to the advantage scale."""

    linear = "linear"
    exponential = "exponential"


@dataclass(frozen=True)
class SEEDGRPOParams:
    """SEED-GRPO's uncertainty scaling A * f(alpha SE / SE_max) (arXiv:2505.12346)."""

    alpha: float = param(0.5, "sensitivity alpha to the normalised semantic entropy (our choice: halves the update at "
                              "maximal uncertainty; the tuned value was not in the text we could read)")
    scale_fn: SEEDScale = param(SEEDScale.linear, "f(x) = 1 - x (linear) or exp(-x) (exponential)")
    norm_by_std: bool = param(True, "GRPO's std normalisation of the base advantage")
    eps: float = param(1e-6, "added to the group std")


def semantic_entropy(answer_ids: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Per-sample ``[B]`` float64 semantic entropy of its group's answer clusters (nats).

    ``SE = -sum_k p_k log p_k`` with ``p_k`` the share of the group's responses
    whose final answer is in cluster ``k`` (equal ``answer_ids`` = same meaning).
    A group of ``G`` distinct answers has the maximum ``log G``.
    """
    inv, G = group_ids(group_index)
    se = torch.zeros(G, dtype=torch.float64)
    for g in range(G):
        ids = answer_ids[inv == g]
        _, counts = torch.unique(ids, return_counts=True)
        p = counts.double() / counts.sum()
        se[g] = -(p * torch.log(p)).sum()
    return se[inv]


@ADV_ESTIMATORS.register(
    "seed_grpo",
    paper="SEED-GRPO: Semantic Entropy Enhanced GRPO for Uncertainty-Aware Policy Optimization (arXiv:2505.12346)",
    params=SEEDGRPOParams,
    needs_group=True,
    needs_answers=True,
)
def seed_grpo_advantage(
    inp: AdvantageInput, *, alpha: float, scale_fn: str, norm_by_std: bool, eps: float
) -> AdvantageOutput:
    """SEED-GRPO: GRPO's advantage scaled down on prompts whose sampled answers disagree.

    ``A_hat_i = A_i f(alpha SE(q) / SE_max(q))`` with ``SE`` the semantic entropy of
    the group's final answers (:func:`semantic_entropy`) and ``SE_max = log G``
    (all answers distinct). Confident prompts (one cluster, ``SE = 0``) keep
    GRPO's advantage; uncertain ones get a more conservative update. Clusters
    are the responses' extracted final answers (``inp.answer_ids``, filled by the
    runner from the task's answer format; answers equal after normalisation are
    one meaning, an unparseable response is its own cluster). Our choices where
    the paper is open for this setting: cluster probabilities from counts (the
    paper sums sequence probabilities, whose scale does not match ``log G`` on
    short samples), ``alpha = 0.5``, linear ``f``.

    Raises:
        ValueError: ``inp.answer_ids`` is None, or an unknown ``scale_fn``.
    """
    if inp.answer_ids is None:
        raise ValueError("seed_grpo needs the responses' answer clusters (AdvantageInput.answer_ids); the runner "
                         "extracts them from the responses")
    if scale_fn not in ("linear", "exponential"):
        raise ValueError(f"seed_grpo: scale_fn={scale_fn!r}: valid choices are linear, exponential")
    a, _ = _grpo_centred(inp, norm_by_std, eps)
    se = semantic_entropy(inp.answer_ids, inp.group_index)
    _, _, cnt = group_stats(inp.rewards.double(), inp.group_index)
    se_max = torch.log(cnt.clamp(min=2.0))
    x = alpha * se / se_max
    f = (1.0 - x) if scale_fn == "linear" else torch.exp(-x)
    return AdvantageOutput(advantages=_broadcast((a * f).float(), inp.response_mask))


def compute_advantages(name: str, inp: AdvantageInput, **params: object) -> AdvantageOutput:
    """Run the registered estimator ``name`` on ``inp`` with its ``params``.

    ``inp.rewards`` are used as they are: all reward shaping (DAPO's soft
    overlong punishment, arXiv:2503.14476, the length penalty) is done once, by
    the reward function (:class:`rlpost.rewards.RewardFunction`). The shaping
    keys a preset may put in ``algo.adv_params`` (``overlong_buffer``,
    ``overlong_penalty``) are read by
    :meth:`rlpost.rewards.RewardFunction.from_config`; callers pass only the
    estimator's own parameters (:func:`rlpost.algos.validate.adv_overrides`).

    Raises:
        ConfigError: unknown estimator name, or a parameter it does not declare
            (a shaping key here would shape the rewards twice).
        ValueError: from the estimator (e.g. GAE without values).
    """
    fn = ADV_ESTIMATORS.get(name)
    return fn(inp, **ADV_ESTIMATORS.kwargs(name, params, "algo.adv_params"))
