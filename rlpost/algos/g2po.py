"""G2PO: a state graph over a group's episodes, TD-error advantages on its edges (``algo.adv_estimator=g2po``).

"Group-Graph Policy Optimization for Long-Horizon Agentic Reinforcement Learning" (Wang, Song,
Zhang, Huang, Huang, Wei, Deng, Sun; arXiv:2606.22995). G2PO merges identical observations across
the trajectories of a group into one state-transition graph. A node's value is aggregated over
all the group's returns that pass through it (lower variance than one trajectory's return); an
action is an edge between two nodes and its advantage is the edge's temporal-difference error,
standardised over the whole graph, which singles out the transitions that move the task forward.

Read from the abstract and secondary summaries only (the full text and code could not be opened
from here). This library's reading, each constant named in :class:`G2POParams`:

* a **node** is an observation: the environment text before a turn (the prompt for the first
  turn), merged across the group's episodes by exact equality (:mod:`rlpost.algos.turn_states`);
  unlike a tree (``rtmc``) two episodes meet at a node whatever path led there;
* ``V(node)`` = the mean of the returns-to-go ``G_k`` of every visit of the node (every-visit: an
  episode that comes back to a board position counts each visit); the terminal node after an
  episode's last turn has ``V = 0``;
* the edge of turn ``k`` from ``node_k`` to ``node_{k+1}`` has ``delta_k = r_k + gamma V(node_{k+1}) - V(node_k)``;
* standardisation: ``(delta - mean) / (std + eps)`` over every turn (edge visit) of the group's
  graph (``norm_scope=group``) or of the whole batch (``batch``); no episode-level term is added.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Tuple

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.turn_states import broadcast_turns, episode_turns, zscores
from rlpost.core.registry import Choice, param

_PAPER = "Group-Graph Policy Optimization for Long-Horizon Agentic Reinforcement Learning (G2PO, arXiv:2606.22995)"


class NormScope(Choice):
    """Over which TD errors G2PO standardises."""

    group = "group"
    batch = "batch"


@dataclass(frozen=True)
class G2POParams:
    """G2PO (arXiv:2606.22995); constants the text would fix are our choices, stated."""

    gamma: float = param(0.95, "discount per turn of returns and TD errors (verl-agent's step-level default; our choice)")
    norm_scope: NormScope = param(NormScope.group, "standardise the TD errors over each group's graph (the paper's graph-wide) or the batch")
    norm_by_std: bool = param(True, "divide by the std of the TD errors (false: mean-centred only)")
    eps: float = param(1e-6, "added to the std")


@ADV_ESTIMATORS.register("g2po", paper=_PAPER, params=G2POParams, needs_group=True, uses_token_rewards=True,
                         needs_episodes=True)
def g2po_advantage(inp: AdvantageInput, *, gamma: float, norm_scope: str, norm_by_std: bool,
                   eps: float) -> AdvantageOutput:
    """Edge-centric TD advantage on the group's state graph.

    For turn ``k`` of episode ``i`` (observation node ``o_k``, reward ``r_k``, next node ``o_{k+1}`` or
    the terminal node)::

        V(o)       = mean of G over every visit of o in the group        V(terminal) = 0
        delta_{i,k} = r_k + gamma V(o_{k+1}) - V(o_k)
        A_{i,k}     = (delta_{i,k} - mean delta) / (std delta + eps)    over the group's (or batch's) turns

    (unbiased std; exactly 0 where every delta of the scope is equal). Every token of the turn gets
    ``A_{i,k}``.

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]``, response_ids ``[B, R]``,
            token_rewards ``[B, R]`` or None.
        gamma, norm_scope, norm_by_std, eps: :class:`G2POParams`.
    Returns:
        AdvantageOutput with ``advantages [B, R]`` float32 (0 off the mask), ``returns=None``.
    Raises:
        ValueError: an unknown ``norm_scope``, gamma outside [0, 1], or no ``response_ids``.
    """
    scope = NormScope(str(norm_scope)).value
    mask = inp.response_mask
    turns = episode_turns(inp.response_ids, mask, inp.rewards, inp.group_index, inp.token_rewards, gamma)
    node: Dict[Tuple[int, int], Tuple[float, int]] = defaultdict(lambda: (0.0, 0))
    for row in turns:
        for t in row:
            tot, n = node[(t.group, t.obs)]
            node[(t.group, t.obs)] = (tot + t.ret, n + 1)

    def value(g: int, o) -> float:
        if o is None:
            return 0.0
        tot, n = node[(g, o)]
        return tot / n

    deltas: Dict[Tuple[int, int], float] = {}
    pools: Dict[object, List[Tuple[int, int]]] = defaultdict(list)
    for row in turns:
        for t in row:
            deltas[(t.row, t.index)] = t.reward + float(gamma) * value(t.group, t.next_obs) - value(t.group, t.obs)
            pools[t.group if scope == NormScope.group.value else 0].append((t.row, t.index))
    per_turn: Dict[Tuple[int, int], float] = {}
    for steps in pools.values():
        for st, z in zip(steps, zscores([deltas[s] for s in steps], eps, norm_by_std)):
            per_turn[st] = z
    adv = broadcast_turns(turns, per_turn, tuple(mask.shape)) * mask.double()
    return AdvantageOutput(advantages=adv.float(), returns=None)
