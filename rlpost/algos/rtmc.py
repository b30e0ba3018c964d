"""RTMC: Monte Carlo Q-values pooled over the rollout tree of a group (``algo.adv_estimator=rtmc``).

"RTMC: Step-Level Credit Assignment via Rollout Trees" (Wang, Zheng, Xu; arXiv:2604.11037). The
episodes of one prompt often pass through the same intermediate states, so together they form a
tree whose branches split at decision points. RTMC pools the returns of all episodes that reach a
state to estimate ``V(s)`` and, per action taken there, ``Q(s, a)``; a step's advantage is
``Q(s, a) - V(s)``, with no critic. States and actions are matched through compact signatures of
the interaction history; a state seen too rarely falls back to the trajectory (GRPO) advantage.

Read from the abstract and secondary summaries only (no code is public; the full text could not
be opened from here). This library's reading, each constant named in :class:`RTMCParams`:

* **state** of turn ``k`` = its whole history: the observations before it (the environment text,
  :mod:`rlpost.algos.turn_states`), with ``with_actions=true`` also the model's turn tokens. This is
  a tree node: two episodes are at the same node only if everything observable so far agrees;
* **action signature** of turn ``k`` = what it caused: the environment text it got back (the next
  observation), or for an episode's last turn (no reply) its own tokens. This is the compression
  the paper describes (a tool call is identified by its observable effect, not its wording), our
  choice; ``with_actions=true`` uses the turn's tokens for every turn instead;
* ``V(s)`` = mean return-to-go over the visits of ``s``; ``Q(s, a)`` = the mean over the visits that
  took ``a``, smoothed toward ``V(s)`` with ``prior_strength`` pseudo-visits (our reading of the
  paper's "prior-based value smoothing", which its ablation says matters);
* a state with fewer than ``min_state_support`` visits uses the fallback: GRPO's centred episode
  return (``fallback=grpo``, the catalog's knob) or 0;
* all advantages of a group are divided by the std of its episodes' returns (``norm_by_std``), so
  the tree term and the fallback are on one scale.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Hashable, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.turn_states import Turn, broadcast_turns, episode_turns, history_key
from rlpost.core.registry import Choice, param

_PAPER = "RTMC: Step-Level Credit Assignment via Rollout Trees (arXiv:2604.11037)"


class Fallback(Choice):
    """What a turn at a rarely visited state gets."""

    grpo = "grpo"
    zero = "zero"


@dataclass(frozen=True)
class RTMCParams:
    """RTMC (arXiv:2604.11037); constants the text would fix are our choices, stated."""

    gamma: float = param(1.0, "discount per turn of the return-to-go (outcome-rewarded agent tasks: 1, our choice)")
    prior_strength: float = param(1.0, "pseudo-visits pulling Q(s, a) toward V(s), >= 0; 0 = plain Monte Carlo means (our choice)")
    min_state_support: int = param(2, "visits a state needs for its tree advantage, >= 1; below it the fallback (1 visit gives Q = V)")
    fallback: Fallback = param(Fallback.grpo, "below min_state_support: grpo (the episode's centred return) or zero")
    with_actions: bool = param(False, "states and actions also compare the model's turn tokens (false: matched by what the environment returned)")
    norm_by_std: bool = param(True, "divide the group's advantages by the std of its episode returns (unchanged where that std is 0)")
    eps: float = param(1e-6, "added to the std")


def _action_key(t: Turn, with_actions: bool) -> Hashable:
    """A turn's action signature: its next observation (or, last turn / ``with_actions``, its tokens)."""
    if with_actions or t.next_obs is None:
        return ("tokens", t.act)
    return ("obs", t.next_obs)


@ADV_ESTIMATORS.register("rtmc", paper=_PAPER, params=RTMCParams, needs_group=True, uses_token_rewards=True,
                         needs_episodes=True)
def rtmc_advantage(inp: AdvantageInput, *, gamma: float, prior_strength: float, min_state_support: int,
                   fallback: str, with_actions: bool, norm_by_std: bool, eps: float) -> AdvantageOutput:
    """Rollout-tree Monte Carlo advantage of every model turn.

    For turn ``k`` of episode ``i`` at state ``s`` (:func:`rlpost.algos.turn_states.history_key` with
    the whole history) taking action ``a``, with ``n_s`` visits of ``s`` in the group, ``n_sa`` of them
    taking ``a``, and returns-to-go ``G``::

        V(s)    = mean_{visits of s} G
        Q~(s,a) = (sum_{visits of (s, a)} G + m V(s)) / (n_sa + m)          m = prior_strength
        A_{i,k} = (Q~(s,a) - V(s)) / S_g            if n_s >= min_state_support
                = (G_{i,0} - mean_g G_0) / S_g      otherwise (fallback=grpo; 0 for fallback=zero)

    ``S_g`` = ``std_g(G_0) + eps`` (unbiased std of the group's episode returns) with ``norm_by_std``
    and a std above 0, else 1. Every token of the turn gets ``A_{i,k}``.

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]``, response_ids ``[B, R]``,
            token_rewards ``[B, R]`` or None.
        gamma, prior_strength, min_state_support, fallback, with_actions, norm_by_std, eps: :class:`RTMCParams`.
    Returns:
        AdvantageOutput with ``advantages [B, R]`` float32 (0 off the mask), ``returns=None``.
    Raises:
        ValueError: ``prior_strength < 0``, ``min_state_support < 1``, an unknown fallback, gamma outside
            [0, 1], or no ``response_ids``.
    """
    if float(prior_strength) < 0 or int(min_state_support) < 1:
        raise ValueError(f"rtmc: prior_strength must be >= 0 and min_state_support >= 1, got "
                         f"{prior_strength}, {min_state_support}")
    fallback = Fallback(str(fallback)).value
    mask = inp.response_mask
    turns = episode_turns(inp.response_ids, mask, inp.rewards, inp.group_index, inp.token_rewards, gamma)
    s_stat: Dict[Hashable, Tuple[float, int]] = defaultdict(lambda: (0.0, 0))
    sa_stat: Dict[Hashable, Tuple[float, int]] = defaultdict(lambda: (0.0, 0))
    keys = {}
    for row in turns:
        for t in row:
            s = history_key(row, t.index, t.index, with_actions)
            sa = (s, _action_key(t, with_actions))
            keys[(t.row, t.index)] = (s, sa)
            tot, n = s_stat[s]
            s_stat[s] = (tot + t.ret, n + 1)
            tot, n = sa_stat[sa]
            sa_stat[sa] = (tot + t.ret, n + 1)
    # per group: mean and scale of the episode returns G_0 (the fallback and the common scale)
    ep: Dict[int, list] = defaultdict(list)
    for row in turns:
        if row:
            ep[row[0].group].append(row[0].ret)
    g_mean, g_scale = {}, {}
    for g, xs in ep.items():
        x = torch.tensor(xs, dtype=torch.float64)
        g_mean[g] = float(x[0]) if bool((x == x[0]).all()) else float(x.mean())  # a flat group: exactly 0
        sd = float(x.std()) if x.numel() > 1 else 0.0
        g_scale[g] = sd + float(eps) if (norm_by_std and sd > 0) else 1.0
    m = float(prior_strength)
    per_turn: Dict[Tuple[int, int], float] = {}
    for row in turns:
        for t in row:
            s, sa = keys[(t.row, t.index)]
            s_tot, n_s = s_stat[s]
            if n_s >= int(min_state_support):
                v = s_tot / n_s
                sa_tot, n_sa = sa_stat[sa]
                q = (sa_tot + m * v) / (n_sa + m)
                a = q - v
            elif fallback == Fallback.grpo.value:
                a = row[0].ret - g_mean[t.group]
            else:
                a = 0.0
            per_turn[(t.row, t.index)] = a / g_scale[t.group]
    adv = broadcast_turns(turns, per_turn, tuple(mask.shape)) * mask.double()
    return AdvantageOutput(advantages=adv.float(), returns=None)
