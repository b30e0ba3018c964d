"""DARE's label-free reward and its GRPO advantage ("Distribution-Aware Reward Estimation for Test-Time
Reinforcement Learning", Du, Huang and Li, arXiv:2601.21804).

Test-time RL without gold answers: each rollout is rewarded from the distribution of the final
answers its group produced, not from a majority-vote label (TTRL, arXiv:2504.16084). For a group of
``M`` rollouts with final answers ``y_k`` and mean token entropies ``h_k`` (nats):

1. uncertainty-aware distribution: ``n(y)`` rollouts answer ``y``; ``u(y)`` is the mean of ``h_k``
   over them; ``p(y) = (n(y) / (u(y) + eps)) / sum_y' n(y') / (u(y') + eps)``;
2. distribution pruning: answers with ``p(y) < tau`` leave the support; ``p`` is renormalised over
   the answers left (``p~``) and the count statistics are recomputed on them (``M~`` rollouts);
3. reward with exploration bonus: ``r_i = p~(y_i) + alpha b~(y_i)``,
   ``b~(y) = (1 - n(y) / M~) (1 - u(y))``: largest for a rare answer given with low entropy;
4. GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)`` on every response token.

Where these formulas come from: the paper's method section could not be read here; steps 1-3 are
taken from two independent summaries of it that agree term by term (a survey entry and a reading
note, both quoting the paper's equations). Our reading, where those give no value or rule:

- ``alpha = 0.5`` (the paper: "alpha in [0, 1]"; its value is not reported in what was read);
- ``tau = 0.1`` (the pruning threshold; no value reported);
- ``1 - u`` is clipped to ``[0, 1]``: mean token entropy in nats can exceed 1, and a negative bonus
  would punish the rare confident answers the bonus is meant to reward;
- the group's most probable answer is never pruned (a threshold above every ``p`` would otherwise
  leave no support);
- a rollout with no extractable answer (a negative ``answer_ids`` entry) and a pruned rollout get
  reward 0 and count in no statistic;
- ``eps = 1e-8`` (the smoothing one summary reports);
- the batch's verifier rewards are not read: DARE's reward needs the policy's token entropy, which
  exists only after the rollout stage, so the estimator forms it (the verifier's gold-answer
  rewards still reach the metrics and the selector).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, _broadcast
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.utils import group_all_equal, group_ids, group_stats
from rlpost.core.registry import param

_PAPER = "Distribution-Aware Reward Estimation for Test-Time Reinforcement Learning (DARE, arXiv:2601.21804)"


@dataclass(frozen=True)
class DAREParams:
    """DARE's label-free reward (arXiv:2601.21804) and the GRPO normalisation it is optimised with."""

    alpha: float = param(0.5, "exploration bonus weight alpha in [0, 1] (our choice 0.5; no value reported)")
    prune_threshold: float = param(0.1, "distribution pruning threshold tau on p(y) (our choice 0.1; no value reported)")
    uncertainty_eps: float = param(1e-8, "smoothing in n(y) / (u(y) + eps) (the value a summary of the method reports)")
    clip_bonus: bool = param(True, "clip 1 - u(y) to [0, 1] so the bonus is never a penalty (our reading)")
    norm_by_std: bool = param(True, "divide by the group std (GRPO, which DARE optimises with)")
    eps: float = param(1e-6, "added to the group std (GRPO reference code: 1e-6)")


def sequence_uncertainty(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64 mean token entropy of each response (nats): DARE's trace-level uncertainty.

    Args:
        entropy: ``[B, R]`` per-token policy entropy (nats).
        mask: ``[B, R]`` 0/1 response mask; an empty response has uncertainty 0.
    """
    m = mask.double()
    return (entropy.double() * m).sum(-1) / m.sum(-1).clamp(min=1.0)


def dare_rewards(
    answer_ids: torch.Tensor,
    uncertainty: torch.Tensor,
    group_index: torch.Tensor,
    *,
    alpha: float,
    prune_threshold: float,
    uncertainty_eps: float,
    clip_bonus: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """DARE's per-rollout reward ``p~(y_i) + alpha b~(y_i)`` from the group's answer distribution.

    Args:
        answer_ids: ``[B]`` long answer cluster of each rollout (equal = same answer; negative = no
            answer could be extracted).
        uncertainty: ``[B]`` mean token entropy of each rollout (nats, :func:`sequence_uncertainty`).
        group_index: ``[B]`` prompt group ids.
        alpha, prune_threshold, uncertainty_eps, clip_bonus: see :class:`DAREParams`.
    Returns:
        ``(rewards [B] float64, kept [B] bool)``: the reward, and whether the rollout's answer is in the
        pruned support (False: pruned or unparseable, reward 0).
    Raises:
        ValueError: shapes differ, or negative uncertainties.
    """
    if not (answer_ids.shape == uncertainty.shape == group_index.shape) or answer_ids.dim() != 1:
        raise ValueError(f"dare_rewards: answer_ids {tuple(answer_ids.shape)}, uncertainty {tuple(uncertainty.shape)} and "
                         f"group_index {tuple(group_index.shape)} must all be [B]")
    if bool((uncertainty < 0).any()):
        raise ValueError("dare_rewards: uncertainty (mean token entropy) must be >= 0")
    u_tok = uncertainty.double()
    rewards = torch.zeros(len(answer_ids), dtype=torch.float64)
    kept = torch.zeros(len(answer_ids), dtype=torch.bool)
    inv, G = group_ids(group_index)
    for g in range(G):
        rows = (inv == g).nonzero().flatten()
        rows = rows[answer_ids[rows] >= 0]
        if len(rows) == 0:
            continue
        ans, where = torch.unique(answer_ids[rows], return_inverse=True)
        n = torch.zeros(len(ans), dtype=torch.float64).index_add_(0, where, torch.ones(len(rows), dtype=torch.float64))
        u = torch.zeros(len(ans), dtype=torch.float64).index_add_(0, where, u_tok[rows]) / n
        mass = n / (u + uncertainty_eps)
        p = mass / mass.sum()
        keep = (p >= prune_threshold) | (p == p.max())
        p_t = torch.where(keep, p, torch.zeros_like(p))
        p_t = p_t / p_t.sum()
        m_t = n[keep].sum()
        conf = (1.0 - u).clamp(0.0, 1.0) if clip_bonus else 1.0 - u
        bonus = (1.0 - n / m_t) * conf
        r = torch.where(keep, p_t + alpha * bonus, torch.zeros_like(p))
        rewards[rows] = r[where]
        kept[rows] = keep[where]
    return rewards, kept


@ADV_ESTIMATORS.register("dare", paper=_PAPER, params=DAREParams, needs_group=True, needs_answers=True,
                         needs_entropy=True,
                         no_baseline=True,
                         zero_variance=("label-free: the reward is the group's answer distribution and entropy, not "
                                        "the verifier's reward"))
def dare_advantage(
    inp: AdvantageInput, *, alpha: float, prune_threshold: float, uncertainty_eps: float, clip_bonus: bool,
    norm_by_std: bool, eps: float,
) -> AdvantageOutput:
    """GRPO advantage of DARE's label-free reward (:func:`dare_rewards`), broadcast to the response tokens.

    Reads ``inp.answer_ids`` ``[B]`` (the answer clusters, filled for estimators tagged
    ``needs_answers``), ``inp.entropy`` ``[B, R]`` (nats, tag ``needs_entropy``), ``inp.group_index``
    and ``inp.response_mask``; ``inp.rewards`` (the verifier's) are not read. A group whose DARE
    rewards are all equal (e.g. every rollout gives the same answer) gets advantage exactly 0.

    Raises:
        ValueError: ``answer_ids`` or ``entropy`` missing, or bad parameters.
    """
    if inp.answer_ids is None or inp.entropy is None:
        raise ValueError("dare needs the responses' answer clusters (AdvantageInput.answer_ids) and token entropy "
                         "(AdvantageInput.entropy); the runner fills both for algo=dare")
    if not 0.0 <= alpha <= 1.0 or not 0.0 <= prune_threshold < 1.0 or uncertainty_eps <= 0:
        raise ValueError(f"dare: alpha={alpha} must be in [0, 1], prune_threshold={prune_threshold} in [0, 1), "
                         f"uncertainty_eps={uncertainty_eps} > 0")
    u = sequence_uncertainty(inp.entropy, inp.response_mask)
    r, _ = dare_rewards(inp.answer_ids.long(), u, inp.group_index, alpha=alpha, prune_threshold=prune_threshold,
                        uncertainty_eps=uncertainty_eps, clip_bonus=clip_bonus)
    mean, std, _ = group_stats(r, inp.group_index)
    a = r - mean
    if norm_by_std:
        a = a / (std + eps)
    a = torch.where(group_all_equal(r, inp.group_index), torch.zeros_like(a), a)
    return AdvantageOutput(advantages=_broadcast(a, inp.response_mask))
