"""HGPO: advantages within nested groups of turns that share more and more history (``algo.adv_estimator=hgpo``).

"Hierarchy-of-Groups Policy Optimization for Long-Horizon Agentic Tasks" (He, Feng, Wei, Cheng,
Feng, An; arXiv:2602.22817). Step-level group RL (GiGPO, arXiv:2505.10978) compares steps that
share the current state; HGPO's point is *context inconsistency*: two such steps may have been
reached through different histories, so the model saw different prompts. HGPO puts each step into
nested groups ``G_0 ⊇ G_1 ⊇ ... ⊇ G_K``: ``G_j`` holds the group's steps with the same current
state **and** the same last ``j`` steps of history (the paper's k-step context operator), computes
a relative advantage of the step's return inside each group and aggregates them with weights that
favour the deeper (more consistent, smaller) groups.

Read from the abstract and secondary summaries only (the paper's full text and its verl-agent
recipe could not be opened from here); the formulas below are this library's reading, each choice
named in :class:`HGPOParams`:

* a step is a model turn; its state is the environment text before it, its history the previous
  turns' (action, observation) pairs (:mod:`rlpost.algos.turn_states`, which also says why);
* the step's return ``G_k`` is the discounted per-turn return-to-go (GiGPO's step return);
* level ``j``'s advantage is GRPO's z-score of ``G`` within ``G_j`` (``(G - mean) / (std + eps)``,
  0 in a group whose returns are all equal); a group of one step carries no comparison and is left
  out; levels deeper than the history a turn has (``j > k``) would repeat level ``k`` and are left out;
* the adaptive weights are ``w_j ∝ (j + 1)^alpha`` over the levels kept (deeper = more weight),
  normalised to sum 1;
* as in GiGPO, the step-level term is added to the episode-level GRPO advantage:
  ``A = A^E + omega * A^H``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Tuple

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, _grpo_centred
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.turn_states import broadcast_turns, episode_turns, history_key, zscores
from rlpost.core.registry import param

_PAPER = "Hierarchy-of-Groups Policy Optimization for Long-Horizon Agentic Tasks (HGPO, arXiv:2602.22817)"


@dataclass(frozen=True)
class HGPOParams:
    """HGPO's hierarchy (arXiv:2602.22817); the constants the paper's text would fix are our choices, stated."""

    levels: int = param(2, "deepest history match K (levels 0..K; 0 = same current observation only), >= 0 (our choice)")
    alpha: float = param(1.0, "level weights w_j ∝ (j+1)^alpha: 0 = equal, larger = deeper groups count more, >= 0 (our choice)")
    gamma: float = param(0.95, "discount per turn of the step return (GiGPO's / verl-agent's step-level default)")
    episode_coef: float = param(1.0, "omega: A = A^E + omega * A^H (GiGPO's combination with the episode-level GRPO term, omega 1)")
    with_actions: bool = param(True, "history pairs compare the model's turn tokens too (the paper's context is the prompt the model saw)")
    norm_by_std: bool = param(True, "divide by the group std (GRPO); false: mean-centred only")
    eps: float = param(1e-6, "added to the std")


@ADV_ESTIMATORS.register("hgpo", paper=_PAPER, params=HGPOParams, needs_group=True, uses_token_rewards=True,
                         needs_episodes=True)
def hgpo_advantage(inp: AdvantageInput, *, levels: int, alpha: float, gamma: float, episode_coef: float,
                   with_actions: bool, norm_by_std: bool, eps: float) -> AdvantageOutput:
    """Hierarchy-of-groups advantage of every model turn of every episode.

    For turn ``k`` (return ``G_k``) and level ``j = 0..min(K, k)``, ``G_j`` = the turns of the same
    group with the same key :func:`rlpost.algos.turn_states.history_key` ``(obs_k, j previous
    (action, obs) pairs)``; ``A_j = (G_k - mean_{G_j} G) / (std_{G_j} G + eps)`` for ``|G_j| >= 2``.
    Then ``A^H = sum_j w_j A_j / sum_j w_j`` over those levels with ``w_j = (j + 1)^alpha`` (0 when no
    level has two members) and every token of the turn gets ``A^E + episode_coef * A^H``, ``A^E``
    being GRPO's outcome advantage of the row.

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]``, response_ids ``[B, R]``,
            token_rewards ``[B, R]`` or None (per-turn rewards).
        levels, alpha, gamma, episode_coef, with_actions, norm_by_std, eps: :class:`HGPOParams`.
    Returns:
        AdvantageOutput with ``advantages [B, R]`` float32 (0 off the mask), ``returns=None``.
    Raises:
        ValueError: ``levels < 0``, ``alpha < 0``, gamma outside [0, 1], or no ``response_ids``.
    """
    if int(levels) < 0 or float(alpha) < 0:
        raise ValueError(f"hgpo: levels and alpha must be >= 0, got levels={levels}, alpha={alpha}")
    mask = inp.response_mask
    turns = episode_turns(inp.response_ids, mask, inp.rewards, inp.group_index, inp.token_rewards, gamma)
    members: Dict[Tuple, List[Tuple[int, int]]] = defaultdict(list)
    for row in turns:
        for t in row:
            for j in range(min(int(levels), t.index) + 1):
                members[(j,) + history_key(row, t.index, j, with_actions)].append((t.row, t.index))
    level_adv: Dict[Tuple, float] = {}  # (j, row, turn) -> A_j, only for groups of >= 2 turns
    for key, steps in members.items():
        if len(steps) < 2:
            continue
        zs = zscores([turns[r][k].ret for r, k in steps], eps, norm_by_std)
        for (r, k), z in zip(steps, zs):
            level_adv[(key[0], r, k)] = z
    a_ep, _ = _grpo_centred(inp, norm_by_std, eps)
    per_turn: Dict[Tuple[int, int], float] = {}
    for row in turns:
        for t in row:
            num = den = 0.0
            for j in range(min(int(levels), t.index) + 1):
                if (j, t.row, t.index) in level_adv:
                    w = float(j + 1) ** float(alpha)
                    num += w * level_adv[(j, t.row, t.index)]
                    den += w
            a_h = num / den if den > 0 else 0.0
            per_turn[(t.row, t.index)] = float(a_ep[t.row]) + float(episode_coef) * a_h
    adv = broadcast_turns(turns, per_turn, tuple(mask.shape)) * mask.double()
    return AdvantageOutput(advantages=adv.float(), returns=None)
