"""AT²PO's Entropy-Guided Tree Expansion for multi-turn episodes (``sampler.params.branching=at2po``).

Paper: "AT²PO: Agentic Turn-based Policy Optimization via Tree Search" (arXiv:2601.04767); we follow
the authors' code (github.com/zzfoutofspace/ATPO, ``vllm_rollout_with_tools_tree_offline.py``,
``expansion_mode=entropy``) where the text leaves the rule open. The episodes of one prompt form a
turn tree: the root is the prompt, a node is one model turn (plus the environment text that follows
it), a node's children are the turns sampled next from the state it leads to.

1. ``N`` episodes per prompt are run to their end (``initial_rollouts``; 0: half the group);
2. for each of ``expansion_iterations`` rounds, per prompt, ``K`` nodes are chosen among the
   *non-leaf* nodes (the turns some episode continued after, and the root) by the score
   ``H(n) - alpha * (|children(parent(n))| - 1)`` (top ``K``, highest first; the root's score uses its
   own child count and its entropy is 0), where ``H(n)`` is the mean surprisal ``-log pi`` of the
   turn's sampled tokens (the paper's Monte Carlo entropy estimate) and ``alpha`` the branching
   penalty (``branch_penalty``, 0.05 in the code). With fewer candidates than ``K`` the best ones are
   taken again, in order (the code's duplication);
3. each chosen node gets one new sibling: a copy of the episode *before* that turn (ids, masks,
   rollout log-probs, counters, environment state; so it shares the prefix id for id) that samples
   the turn anew and runs to its end; choosing the root starts a fresh episode.

The group's ``G - N`` rows are split over the rounds as evenly as possible, the earlier rounds
taking the remainder (our reading: the code's ``samples_per_tree = initial + iterations * beam``
fixes ``K`` per round; here ``G`` is ``algo.n_samples_per_prompt``). Rows carry the same tree record
as ARPO's branches, ``extras['branch_parent']`` / ``extras['branch_prefix_len']``, which the
``at2po`` estimator (:mod:`rlpost.algos.at2po`) reads.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: node id of a group's root (the prompt) in :class:`TurnTree`
ROOT = -1


def expansion_sizes(budget: int, iterations: int) -> List[int]:
    """Branches per expansion round: ``budget`` split over ``iterations`` rounds, earlier rounds first.

    Raises:
        ValueError: ``budget < 0`` or ``iterations < 1``.
    """
    if budget < 0 or iterations < 1:
        raise ValueError(f"expansion needs budget >= 0 and iterations >= 1, got {budget}, {iterations}")
    q, r = divmod(int(budget), int(iterations))
    return [q + (1 if j < r else 0) for j in range(int(iterations))]


def select_expansion_nodes(candidates: Sequence[Tuple[Any, float, int]], k: int, penalty: float) -> List[Any]:
    """The authors' entropy-mode choice of ``k`` nodes to branch from.

    Args:
        candidates: ``(node, H, siblings)`` per non-leaf node, in tree order (root first): ``H`` the turn's
            mean surprisal in nats (0 for the root), ``siblings`` the child count of its parent (of the
            root itself for the root).
        k: nodes to choose (>= 0).
        penalty: ``alpha`` of the score ``H - alpha * (siblings - 1)``.
    Returns:
        ``k`` nodes, by score (highest first, ties in candidate order); when there are fewer than ``k``
        candidates the sorted list is repeated (the code's duplication); empty without candidates.
    """
    if k <= 0 or not candidates:
        return []
    scored = sorted(enumerate(candidates), key=lambda t: (-(t[1][1] - penalty * (t[1][2] - 1)), t[0]))
    order = [c[0] for _, c in scored]
    out: List[Any] = []
    while len(out) < k:
        out.extend(order[: k - len(out)])
    return out


class TurnTree:
    """One sampling step's turn trees (one per prompt position) with a snapshot of the state before each turn.

    ``before_turn(e)`` is called for each live episode just before its next turn is generated: it
    creates the turn's node (a child of the episode's last node, or of its prompt's root), remembers a
    deep copy of the episode as it is then, and records the node on the episode (``e.node_path``).
    ``after_turn(e, lps)`` stores the turn's entropy once it is sampled.
    """

    def __init__(self) -> None:
        self.parent: List[int] = []
        self.pos: List[int] = []
        self.entropy: List[float] = []
        self.snap: List[Any] = []
        self.owner: List[Any] = []
        self.children: Dict[Tuple[int, int], List[int]] = {}  # (pos, node or ROOT) -> child nodes

    def before_turn(self, e: Any) -> int:
        """Create the node of ``e``'s next turn (snapshotting ``e`` before it); returns the node id."""
        par = e.node_path[-1] if e.node_path else ROOT
        nid = len(self.parent)
        self.parent.append(par)
        self.pos.append(int(e.pos))
        self.entropy.append(0.0)
        self.snap.append(copy.deepcopy(e))
        self.owner.append(e)
        self.children.setdefault((int(e.pos), par), []).append(nid)
        e.node_path.append(nid)
        return nid

    def after_turn(self, e: Any, lps: Sequence[float]) -> None:
        """Entropy of ``e``'s turn just sampled: the mean surprisal of its sampled tokens (0 for an empty turn)."""
        lps = list(lps)
        self.entropy[e.node_path[-1]] = -sum(lps) / len(lps) if lps else 0.0

    def candidates(self, pos: int) -> List[Tuple[int, float, int]]:
        """``(node, H, siblings)`` of prompt ``pos``'s non-leaf nodes, root first, then in creation order."""
        root_kids = len(self.children.get((pos, ROOT), []))
        out = [(ROOT, 0.0, root_kids)] if root_kids else []
        for n in range(len(self.parent)):
            if self.pos[n] == pos and self.children.get((pos, n)):
                out.append((n, self.entropy[n], len(self.children[(pos, self.parent[n])])))
        return out

    def branch(self, node: int, eps: List[Any]) -> Tuple[Any, int, int]:
        """A new episode that re-samples ``node``'s turn: ``(episode copy, parent row in eps, prefix length)``.

        The copy is of the state before the turn (:meth:`before_turn`'s snapshot); its parent row is the
        episode that sampled ``node`` (found by identity in ``eps``).
        """
        b = copy.deepcopy(self.snap[node])
        owner = self.owner[node]
        row = next(i for i, x in enumerate(eps) if x is owner)  # identity: a dataclass == compares fields
        return b, row, len(b.ids)


def expand(sampler: Any, engine: Any, eps: List[Any], prompts: Sequence[Any], counts: Sequence[int], params: Any,
           ctx: Any, tok: Any, eos_ids: Any, stats: Dict[str, Any], call: int, tree: TurnTree,
           rng: Optional[Any] = None) -> int:
    """Run the expansion rounds (see the module docstring); new episodes are appended to ``eps``.

    Args:
        sampler: the :class:`rlpost.samplers.episode.EpisodeSampler` (its ``n_global``, ``expansion_iterations``,
            ``branch_penalty``, ``_new_episode`` and ``_run``).
        eps: the step's episodes, the initial ones already run to their end.
        prompts, counts: per prompt position, its prompt ids and its group size ``G``.
        params, ctx, tok, eos_ids, stats, call: as for ``EpisodeSampler._run``.
        tree: the step's :class:`TurnTree` (filled by the sampler's rounds).
    Returns:
        the next engine-call number.
    """
    sizes = [expansion_sizes(int(c) - sampler.n_global(int(c)), sampler.expansion_iterations) for c in counts]
    for it in range(sampler.expansion_iterations):
        new: List[Any] = []
        for pos in range(len(counts)):
            for node in select_expansion_nodes(tree.candidates(pos), sizes[pos][it], sampler.branch_penalty):
                if node == ROOT:
                    b = sampler._new_episode(ctx, pos, prompts[pos], tok)
                    b.parent, b.prefix_len = -1, 0
                else:
                    b, row, n = tree.branch(node, eps)
                    b.parent, b.prefix_len = row, n
                b.can_branch = False
                new.append(b)
                stats["branches"] = stats.get("branches", 0) + 1
        if not new:
            continue
        eps.extend(new)  # appended before they run, so a later round finds their rows
        call = sampler._run(engine, new, params, ctx, tok, eos_ids, [0] * len(counts), rng, stats, call)
    return call
