"""Apriel-Reasoner's difficulty-aware length penalty: DAPO's overlong punishment scaled by the group's solve rate.

"Apriel-Reasoner: RL Post-Training for General-Purpose and Efficient Reasoning"
(arXiv:2604.02007; authors' code https://github.com/ServiceNow/PipelineRL,
``pipelinerl/actor.py``, "Difficulty-aware length penalty adjustment"). The
standard length penalty is DAPO's soft overlong punishment ("DAPO: An
Open-Source LLM Reinforcement Learning System at Scale", arXiv:2503.14476):
``o_i`` in ``[-1, 0]`` over the last ``L_cache`` tokens of the budget. The
extension rescales it per rollout from the difficulty of its prompt, measured
by the group's solve rate ``p_g`` (share of the group's rollouts that succeed):

* a successful rollout gets ``o_i * p_g ** gamma``: on a hard prompt (low
  ``p_g``) a long correct answer is barely punished, on an easy one (``p_g = 1``)
  it gets the full penalty, so the policy learns to think longer only where it pays;
* a failed rollout gets ``o_i * failure_scale``;
* a rollout that hit the generation limit (``extras['length_capped']``, written
  by :class:`rlpost.methods.length_cap.LengthCap`) keeps the full penalty.

The shaped reward is ``r_i + o_i (s_i - 1)`` (the reward function already added
``o_i``), and the advantage is GRPO's on it. It needs no extra pass ("no
additional training overhead"). The text of the paper could not be read here
beyond its abstract; the rule and the constants ``gamma = 0.5``,
``failure_scale = 0.5`` are those of the authors' code and its ``conf/base.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, grpo_advantage
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.utils import group_stats
from rlpost.core.registry import param

_APRIEL_PAPER = "Apriel-Reasoner: RL Post-Training for General-Purpose and Efficient Reasoning (arXiv:2604.02007)"


@dataclass(frozen=True)
class AprielParams:
    """The difficulty-aware scaling of the overlong penalty (authors' PipelineRL code and conf/base.yaml)."""

    gamma: float = param(0.5, "exponent of the solve rate scaling a successful rollout's penalty (authors: 0.5)")
    failure_scale: float = param(0.5, "scale of a failed rollout's penalty, in [0, 1] (authors' conf: 0.5; their "
                                 "code's fallback: 1)")
    success_threshold: float = param(0.5, "a rollout succeeds when its correctness is above this (our reading of "
                                     "the authors' success flag for rlpost's [0, 1] correctness)")
    eps: float = param(1e-6, "added to GRPO's group std")


def difficulty_aware_scale(correct: torch.Tensor, group_index: torch.Tensor, capped: torch.Tensor, *, gamma: float,
                           failure_scale: float, success_threshold: float) -> torch.Tensor:
    """``[B]`` float64 factor ``s_i`` applied to each rollout's overlong penalty (arXiv:2604.02007).

    ``s_i = p_g ** gamma`` for a successful rollout (``correct > success_threshold``),
    ``failure_scale`` for a failed one, 1 for a ``capped`` one; ``p_g`` is the
    share of successful rollouts in row ``i``'s group.

    Args:
        correct: ``[B]`` correctness component of the reward.
        group_index: ``[B]`` long group ids.
        capped: ``[B]`` bool, rows that reached the generation limit.
    Raises:
        ValueError: ``gamma < 0`` or ``failure_scale`` outside [0, 1] (the authors' asserts).
    """
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if not 0.0 <= failure_scale <= 1.0:
        raise ValueError(f"failure_scale must be in [0, 1], got {failure_scale}")
    success = (correct.double() > success_threshold).double()
    rate, _, _ = group_stats(success, group_index)
    s = torch.where(success > 0, rate.clamp(min=0.0) ** float(gamma), torch.full_like(rate, float(failure_scale)))
    return torch.where(capped.bool(), torch.ones_like(s), s)


@ADV_ESTIMATORS.register("apriel", paper=_APRIEL_PAPER, params=AprielParams, needs_group=True, needs_length_cap=True)
def apriel_advantage(inp: AdvantageInput, *, gamma: float, failure_scale: float, success_threshold: float,
                     eps: float) -> AdvantageOutput:
    """GRPO's advantage on rewards whose overlong penalty is rescaled by :func:`difficulty_aware_scale`.

    Reads ``inp.extras['reward_overlong']`` ``[B]`` (DAPO's penalty the reward
    function added, ``<= 0``; absent: 0), ``inp.extras['reward_correct']`` ``[B]``
    (absent: the reward less the penalty) and ``inp.extras['length_capped']``
    ``[B]`` bool (absent: no row capped). That the run has an overlong window at
    all is checked at start-up (:meth:`rlpost.methods.length_cap.LengthCap.validate`). Shaped reward
    ``r'_i = r_i + o_i (s_i - 1)``; then ``A_i = (r'_i - mean_g) / (std_g + eps)``
    (Bessel-corrected std; a group whose shaped rewards are all equal gets 0).
    With no overlong penalty anywhere in the batch it is GRPO exactly.

    Shapes: returns ``advantages`` ``[B, R]``, 0 outside ``inp.response_mask``.

    Raises:
        ValueError: bad parameters (:func:`difficulty_aware_scale`).
    """
    ex = inp.extras
    o = ex.get("reward_overlong")
    o = torch.zeros_like(inp.rewards, dtype=torch.float64) if o is None else o.double()
    correct = ex.get("reward_correct")
    correct = inp.rewards.double() - o if correct is None else correct
    capped = ex.get("length_capped")
    capped = torch.zeros(inp.rewards.shape, dtype=torch.bool) if capped is None else capped
    s = difficulty_aware_scale(correct, inp.group_index, capped, gamma=gamma,
                               failure_scale=failure_scale, success_threshold=success_threshold)
    shaped = AdvantageInput(rewards=(inp.rewards.double() + o * (s - 1.0)).float(), response_mask=inp.response_mask,
                            group_index=inp.group_index)
    return grpo_advantage(shaped, norm_by_std=True, eps=eps, baseline="mean", unbiased_std=True, std_scope="group")
