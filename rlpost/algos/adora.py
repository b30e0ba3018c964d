"""ADORA's advantage reweighting: groups whose rollouts currently favour long correct reasoning keep their advantage.

"ADORA: Training Reasoning Models with Dynamic Advantage Estimation on
Reinforcement Learning" (ADORA, Advantage Dynamics via Online Rollout
Adaptation; arXiv:2602.10019; authors' code
https://github.com/ShadeCloak/ADORA, ``verl/trainer/ppo/core_algos.py``,
``compute_grpo_outcome_advantage_ADORA``). From each step's own rollouts every
prompt's group is labelled, for this step only, a *temporarily advantageous*
(TAS) or *temporarily disadvantageous* (TDS) sample, and its GRPO advantages are
multiplied by that label's weight.

The rule is the one of the authors' released LLM code (the "Length Advantage"
criterion; the paper's text beyond its abstract could not be read here): a
group is TAS when its *longest correct* response is longer than the *mean
length of its incorrect* responses, i.e. the policy is currently rewarded for
reasoning longer on that prompt; otherwise TDS and its advantages are scaled by
``tds_weight`` (the code's ``lamda``, 0.1). A group with no correct response is
TDS; a group with correct responses and no counted incorrect one is TAS. The
paper's other criterion (a "Difficulty Advantage" used for vision-language
models) is not in the released code and is not implemented. A summary of the
paper speaks of amplification for strong LLMs; ``tas_weight > 1`` expresses that
(the released code keeps TAS at 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, _broadcast, grpo_advantage
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.core.registry import param

_ADORA_PAPER = ("ADORA: Training Reasoning Models with Dynamic Advantage Estimation on Reinforcement Learning "
                "(arXiv:2602.10019)")


@dataclass(frozen=True)
class ADORAParams:
    """ADORA's Length-Advantage labelling and weights (authors' code and ADORA.sh)."""

    correct_threshold: float = param(0.5, "a response whose reward is above this is correct (our choice 0.5: rlpost's correctness "
                                     "is in [0, 1]; the authors' code uses 1.01 on Logic-RL's -3..3 reward)")
    tds_weight: float = param(0.1, "advantage weight of a temporarily disadvantageous group (authors' lamda: 0.1)")
    tas_weight: float = param(1.0, "advantage weight of a temporarily advantageous group (authors' code: 1)")
    max_length_threshold: int = param(0, "incorrect responses of at least this many tokens leave the mean incorrect "
                                      "length; 0 = none, our choice (the authors' ADORA.sh sets 3900 with a 2048-token budget, so it never bound)")
    eps: float = param(1e-6, "added to the group std (authors' code: 1e-6)")


def adora_group_labels(rewards: torch.Tensor, lengths: torch.Tensor, group_index: torch.Tensor,
                       correct_threshold: float, max_length_threshold: int = 0) -> torch.Tensor:
    """``[B]`` bool, True for rows of a temporarily advantageous group (ADORA's Length Advantage, arXiv:2602.10019).

    Within each group: ``max_pos`` is the longest response among those with
    ``reward > correct_threshold`` (-inf if none), ``mean_neg`` the mean length of
    the others, counting only those shorter than ``max_length_threshold`` tokens
    when it is > 0 (-inf if none are counted). The group is advantageous iff
    ``max_pos > mean_neg``.

    Args:
        rewards: ``[B]`` scalar rewards.
        lengths: ``[B]`` response lengths in tokens.
        group_index: ``[B]`` long group ids.
    """
    out = torch.zeros(rewards.shape[0], dtype=torch.bool)
    lens = lengths.double()
    for g in torch.unique(group_index).tolist():
        rows = group_index == g
        pos = rows & (rewards.double() > correct_threshold)
        neg = rows & ~pos
        if max_length_threshold > 0:
            neg = neg & (lens < max_length_threshold)
        max_pos = float(lens[pos].max()) if bool(pos.any()) else float("-inf")
        mean_neg = float(lens[neg].mean()) if bool(neg.any()) else float("-inf")
        out[rows] = max_pos > mean_neg
    return out


@ADV_ESTIMATORS.register("adora", paper=_ADORA_PAPER, params=ADORAParams, needs_group=True)
def adora_advantage(inp: AdvantageInput, *, correct_threshold: float, tds_weight: float, tas_weight: float,
                    max_length_threshold: int, eps: float) -> AdvantageOutput:
    """GRPO's advantage times ADORA's per-group weight: ``A_i = w_g (r_i - mean_g) / (std_g + eps)``.

    ``std_g`` is the Bessel-corrected group std (as the authors' code, torch's
    ``std``); ``w_g = tas_weight`` for a group :func:`adora_group_labels` marks
    advantageous, else ``tds_weight``. Lengths are the response-mask sums.
    Zero-variance groups and groups of one get 0 (rlpost's GRPO; the authors'
    code leaves a lone response its raw reward).

    Shapes: ``inp.rewards`` ``[B]``, ``inp.response_mask`` ``[B, R]``; returns
    ``advantages`` ``[B, R]`` (0 outside the mask), no returns.

    Raises:
        ValueError: a negative weight or ``max_length_threshold < 0``.
    """
    if tds_weight < 0 or tas_weight < 0:
        raise ValueError(f"ADORA's weights must be >= 0, got tds_weight={tds_weight}, tas_weight={tas_weight}")
    if max_length_threshold < 0:
        raise ValueError(f"max_length_threshold must be >= 0 (0 = off), got {max_length_threshold}")
    base = grpo_advantage(inp, norm_by_std=True, eps=eps, baseline="mean", unbiased_std=True, std_scope="group")
    tas = adora_group_labels(inp.rewards, inp.response_mask.sum(-1), inp.group_index, correct_threshold,
                             max_length_threshold)
    w = torch.where(tas, torch.tensor(float(tas_weight)), torch.tensor(float(tds_weight))).to(base.advantages.dtype)
    return AdvantageOutput(advantages=base.advantages * _broadcast(w, inp.response_mask), returns=None)
