"""AT²PO's turn-wise credit over the rollout tree and its turn-level policy loss ATPO.

Paper: "AT²PO: Agentic Turn-based Policy Optimization via Tree Search" (Zong, Chen, Li et al.,
arXiv:2601.04767; authors' code github.com/zzfoutofspace/ATPO, read in ``ATPO/verl_atpo``). Three
parts; the two here are pure tensor functions, the third (Entropy-Guided Tree Expansion) is a
rollout sampler option, ``sampler.params.branching=at2po`` (:mod:`rlpost.samplers.turn_tree`).

**Turn-wise Credit Assignment** (``algo.adv_estimator=at2po``). The episodes of one prompt form a
turn-level tree: the root is the prompt, a node is one model turn (with the environment text that
follows it), a leaf is an episode's last turn. The authors' script
(``ATPO/scripts/ATPO_qwen3_4B.sh``: ``leaf_value_norm=True``, ``node_value_mode=child_softmax``,
``node_adv_mode=node_value``; the code in ``vllm_rollout_with_tools_tree_offline.py``) computes:

1. leaf values: the episode's outcome reward, normalised over the tree's leaves (the group):
   ``(r - mean) / (std + 1e-6)`` with numpy's population std;
2. node values, recursively from the leaves: ``V(n) = sum_c softmax_c(H_c) V(c)`` over the
   children ``c`` of ``n``, ``H_c`` the child's turn entropy (mean surprisal ``-log pi`` of its
   sampled tokens); ``child_mean`` (the plain mean over children, the code's config default and
   the paper's "Monte Carlo bootstrapping over descendants") and ``leaf_mean`` (the mean over all
   leaves below) are the code's other modes;
3. the advantage of every token of node ``n``'s turn: ``V(n)`` itself (``node_value``; the paper's
   ablation finds the value used directly works best), or ``V(n) - V(parent)`` (``diff_parent``),
   or ``V(n) - V(root)`` (``diff_global``).

We follow the authors' script where the text and the code's config defaults differ
(``child_softmax``, leaf normalisation on). The tree is read from the sampler's record
``extras['branch_parent']`` / ``extras['branch_prefix_len']`` (any branching sampler:
``at2po``, ``arpo``, ``aepo``): a branch row shares with its parent row exactly the turns that end
inside the shared prefix. Without that record every row is its own chain below the root, and every
turn of a row gets its normalised reward: GRPO with the population std.

**ATPO** (``algo.loss=atpo``), the authors' ``compute_policy_loss_gspo_turn``: GSPO's
length-normalised ratio taken per turn instead of per sequence. For token ``t`` of turn ``k``
(a maximal run of mask-1 tokens, :func:`rlpost.algos.turns.turn_spans`)::

    s_k  = exp( mean_{t' in turn k} (log pi(y_t') - log pi_old(y_t')) )
    s_t  = sg(s_k) * pi(y_t) / sg(pi(y_t))                       (value s_k, gradient s_k grad log pi)
    loss = max(-A_t s_t, -A_t clip(s_t, 1 - eps_low, 1 + eps_high))

so a turn is kept or clipped as a whole. The script's clip is ``eps_low = 3e-3``,
``eps_high = 4e-3`` and its aggregation ``seq-mean-token-mean`` (hard-coded in the loss); the log
ratio is clamped at 10 before ``exp`` as in the code. On single-turn rows ATPO is GSPO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.losses import Metrics, PolicyLossInput, _clip_metrics, _nonempty_mean, _ratio
from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
from rlpost.algos.turns import turn_spans
from rlpost.core.registry import Choice, param

PAPER = "AT2PO: Agentic Turn-based Policy Optimization via Tree Search (arXiv:2601.04767)"


# --------------------------------------------------------------------------- ATPO: the turn-level ratio loss
def turn_ids(mask: torch.Tensor) -> torch.Tensor:
    """Turn number of every token: ``[B, R]`` long, ``1..K`` on the ``K`` runs of mask-1 tokens of a row, 0 off the mask.

    A run starts where the mask turns on (:func:`rlpost.algos.turns.turn_spans` gives the same runs).
    """
    on = mask > 0
    prev = torch.zeros_like(on)
    prev[:, 1:] = on[:, :-1]
    start = on & ~prev
    return torch.cumsum(start.long(), dim=-1) * on.long()


def turn_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each token's mean of ``x`` over its own turn, ``[B, R]`` (0 off the mask).

    Args:
        x, mask: ``[B, R]``; turns are the runs of ``mask > 0`` (:func:`turn_ids`).
    """
    tid = turn_ids(mask)
    B, R = mask.shape
    on = (mask > 0).to(x.dtype)
    s = torch.zeros(B, R + 1, dtype=x.dtype, device=x.device).scatter_add_(1, tid, x * on)
    n = torch.zeros(B, R + 1, dtype=x.dtype, device=x.device).scatter_add_(1, tid, on)
    return torch.gather(s / n.clamp(min=1), 1, tid) * on


@dataclass(frozen=True)
class ATPOParams:
    """ATPO's clip range on the per-turn geometric-mean ratio (the authors' script: 3e-3 / 4e-3)."""

    eps_low: float = param(3e-3, "turn ratio floor 1 - eps_low (authors' script ATPO_qwen3_4B.sh: clip_ratio_low=3e-3)")
    eps_high: float = param(4e-3, "turn ratio cap 1 + eps_high (authors' script: clip_ratio_high=4e-3)")


@POLICY_LOSSES.register("atpo", paper=PAPER, params=ATPOParams, sequence_level=True)
def atpo_loss(inp: PolicyLossInput, *, eps_low: float, eps_high: float) -> Tuple[torch.Tensor, Metrics]:
    """ATPO: PPO clip on each turn's length-normalised importance ratio (GSPO-token form per turn).

    ``s_k = exp(mean over turn k of (log pi - log pi_old))``; every token of turn ``k`` uses
    ``s_t = sg(s_k) pi / sg(pi)`` in ``max(-A s_t, -A clip(s_t, 1-eps_low, 1+eps_high))`` (see the
    module docstring; the authors' ``compute_policy_loss_gspo_turn``). Turns are the runs of mask-1
    tokens of a row (:func:`turn_ids`); a single-turn row is GSPO's sequence ratio.

    Args:
        inp: logprobs / old_logprobs / advantages / response_mask ``[B, R]`` (:class:`PolicyLossInput`).
        eps_low, eps_high: the clip range (both > 0 and eps_low < 1).
    Returns:
        ``(loss_mat [B, R], metrics)``: the standard clip metrics (``clip_frac`` counts tokens of clipped
        turns), ``turn_ratio_mean`` (token mean of ``s_k``) and ``seq_turns`` (turns per row).
    Raises:
        ValueError: ``eps_low`` not in (0, 1) or ``eps_high`` not > 0.
    """
    if not (0.0 < eps_low < 1.0 and eps_high > 0.0):
        raise ValueError(f"atpo: eps_low must be in (0, 1) and eps_high > 0, got {eps_low}, {eps_high} "
                         "(set algo.loss_params.eps_low / eps_high)")
    m = inp.response_mask
    ratio, log_ratio = _ratio(inp)
    log_s = turn_mean(log_ratio, m)
    log_st = (log_s.detach() + inp.logprobs - inp.logprobs.detach()).clamp(max=10.0)  # the authors' clamp
    s_t = torch.exp(log_st)
    A = inp.advantages
    loss = torch.maximum(-A * s_t, -A * torch.clamp(s_t, 1.0 - eps_low, 1.0 + eps_high))
    with torch.no_grad():
        low = ((s_t < 1.0 - eps_low) & (A < 0)).float()
        high = ((s_t > 1.0 + eps_high) & (A > 0)).float()
        metrics = _clip_metrics(ratio, log_ratio, low, high, m)
        on = m > 0
        metrics["turn_ratio_mean"] = (torch.exp(log_s) * m).sum() / m.sum().clamp(min=1)
        metrics["seq_turns"] = _nonempty_mean(turn_ids(m).max(dim=-1).values.to(m.dtype), m) if bool(on.any()) \
            else torch.tensor(0.0)
    return loss, metrics


# --------------------------------------------------------------------------- turn-wise credit over the tree
class NodeValue(Choice):
    """``algo.adv_params.node_value``: how a node's value comes from its subtree (authors' ``node_value_mode``)."""

    child_softmax = "child_softmax"
    child_mean = "child_mean"
    leaf_mean = "leaf_mean"


class NodeAdvantage(Choice):
    """``algo.adv_params.node_advantage``: a turn's advantage from the node values (authors' ``node_adv_mode``)."""

    node_value = "node_value"
    diff_parent = "diff_parent"
    diff_global = "diff_global"


@dataclass(frozen=True)
class TurnTree:
    """One group's turn tree as the estimator sees it.

    Attributes:
        parent: per node, its parent node id (-1: a child of the root).
        entropy: per node, the mean surprisal (nats) of its turn's sampled tokens.
        leaf_of_row: per row of the group (in order), its leaf node (its last turn), or -1 for a row
            without a model token (a leaf of the root with no turn).
        spans: per row, ``[(start, end, node)]`` of its turns.
    """

    parent: List[int]
    entropy: List[float]
    leaf_of_row: List[int]
    spans: List[List[Tuple[int, int, int]]]


def build_turn_tree(mask: torch.Tensor, surprisal: Optional[torch.Tensor], parent_row: Optional[Sequence[int]],
                    prefix_len: Optional[Sequence[int]]) -> TurnTree:
    """The turn tree of one group's rows.

    Row ``i``'s turns are the runs of mask-1 tokens (:func:`turn_spans`). A row with a parent row ``p``
    (``parent_row[i] >= 0``, an index into these rows) and a shared prefix of ``L`` tokens shares with
    ``p`` its turns that end within ``L`` (the same nodes); its later turns are new nodes, the first
    one a child of the last shared node (or of the root). Parents must come before their branches
    (the sampler orders rows by creation within a prompt).

    Args:
        mask: ``[n, R]`` response mask of the group's rows.
        surprisal: ``[n, R]`` ``-log pi`` of each sampled token (rollout log-probs negated) or None (entropy 0).
        parent_row, prefix_len: the branch record, or None (every row a chain below the root).
    Returns:
        :class:`TurnTree`.
    Raises:
        ValueError: a parent row that is not before its branch.
    """
    parent: List[int] = []
    ent: List[float] = []
    leaf_of_row: List[int] = []
    spans_out: List[List[Tuple[int, int, int]]] = []
    for i in range(mask.shape[0]):
        sp = turn_spans(mask[i])
        nodes: List[int] = []
        p = int(parent_row[i]) if parent_row is not None else -1
        if p >= 0:
            if p >= i:
                raise ValueError(f"at2po: row {i} branches from row {p}, which is not before it "
                                 "(extras['branch_parent'] must point to earlier rows of the group)")
            L = int(prefix_len[i])
            for (s, e, nd) in spans_out[p]:
                if e <= L and len(nodes) < len(sp) and sp[len(nodes)] == (s, e):
                    nodes.append(nd)
                else:
                    break
        for s, e in sp[len(nodes):]:
            nid = len(parent)
            parent.append(nodes[-1] if nodes else -1)
            h = float(surprisal[i, s:e].double().mean()) if surprisal is not None and e > s else 0.0
            ent.append(h)
            nodes.append(nid)
        spans_out.append([(s, e, nd) for (s, e), nd in zip(sp, nodes)])
        leaf_of_row.append(nodes[-1] if nodes else -1)
    return TurnTree(parent, ent, leaf_of_row, spans_out)


def tree_values(tree: TurnTree, leaf_values: Sequence[float], mode: str) -> Tuple[List[float], float]:
    """Node values from the leaf values, and the root's value.

    ``child_softmax``: ``V(n) = sum_c softmax(H)_c V(c)`` over the children ``c`` of ``n`` (``H_c`` their
    turn entropies), a leaf's value its row's; ``child_mean``: the plain mean over children; ``leaf_mean``:
    the mean over the leaves below ``n``. A node that is also a row's leaf has no children (the authors'
    tree: a leaf is an episode's last turn). The root's value uses the same rule over its children
    (rows without a turn are leaves of the root with entropy 0).

    Args:
        tree: :func:`build_turn_tree`'s result.
        leaf_values: per row of the group, its leaf value.
        mode: a :class:`NodeValue`.
    Returns:
        ``(values per node, root value)``.
    """
    N = len(tree.parent)
    children: Dict[int, List[Tuple[float, str, int]]] = {n: [] for n in range(-1, N)}  # (entropy, kind, id)
    leaf_val: Dict[int, float] = {}
    empty: List[float] = []
    for r, nd in enumerate(tree.leaf_of_row):
        if nd >= 0:
            leaf_val[nd] = float(leaf_values[r])
        else:
            empty.append(float(leaf_values[r]))
    for n in range(N):
        children[tree.parent[n]].append((tree.entropy[n], "node", n))
    val: Dict[int, float] = {}
    leaves_below: Dict[int, List[float]] = {}
    for n in range(N - 1, -1, -1):  # children always have larger ids than their parent
        if n in leaf_val and not children[n]:
            val[n], leaves_below[n] = leaf_val[n], [leaf_val[n]]
            continue
        val[n], leaves_below[n] = _combine(children[n], val, leaves_below, [], mode)
    root, _ = _combine(children[-1], val, leaves_below, empty, mode)
    return [val[n] for n in range(N)], root


def _combine(kids, val, leaves_below, extra_leaves: List[float], mode: str) -> Tuple[float, List[float]]:
    """A parent's value from its children ``kids`` (``(entropy, kind, id)``) and leaf-only children ``extra_leaves``."""
    vals = [val[k] for _, _, k in kids] + list(extra_leaves)
    hs = [h for h, _, _ in kids] + [0.0] * len(extra_leaves)
    below = [x for _, _, k in kids for x in leaves_below[k]] + list(extra_leaves)
    if not vals:
        return 0.0, below  # the authors' code: a node without a valued child gets 0
    if mode == NodeValue.child_mean.value:
        return sum(vals) / len(vals), below
    if mode == NodeValue.leaf_mean.value:
        return sum(below) / len(below), below
    mx = max(hs)
    w = [math.exp(h - mx) for h in hs]
    z = sum(w)
    return sum(wi * v for wi, v in zip(w, vals)) / z, below


@dataclass(frozen=True)
class AT2POParams:
    """AT²PO's turn-wise credit (arXiv:2601.04767) as the authors' script sets it."""

    node_value: NodeValue = param(NodeValue.child_softmax, "child_softmax (authors' script: children weighted by "
                                  "softmax of their turn entropies) | child_mean (code default) | leaf_mean")
    node_advantage: NodeAdvantage = param(NodeAdvantage.node_value, "node_value (the value is the advantage; script "
                                          "and paper ablation) | diff_parent (V(n) - V(parent)) | diff_global (V(n) - V(root))")
    leaf_norm: bool = param(True, "normalise the leaves' rewards within the group, (r - mean) / (std + eps), "
                            "population std (authors' script leaf_value_norm=True)")
    eps: float = param(1e-6, "added to the std (authors' code: 1e-6)")


@ADV_ESTIMATORS.register("at2po", paper=PAPER, params=AT2POParams, needs_group=True)
def at2po_advantage(inp: AdvantageInput, *, node_value: str, node_advantage: str, leaf_norm: bool,
                    eps: float) -> AdvantageOutput:
    """Turn-wise credit over each group's turn tree (see the module docstring).

    Per group: leaf values ``v_i = (R_i - mean) / (std_pop + eps)`` (or ``R_i``), node values by
    :func:`tree_values`, and every token of row ``i``'s turn at node ``n`` gets ``V(n)``
    (``node_value``), ``V(n) - V(parent)`` or ``V(n) - V(root)``. A group whose rewards are all equal
    gets 0 with ``leaf_norm``. Node entropies are from ``inp.rollout_logprobs`` (the engine's sampled
    token log-probs, as the authors' vLLM rollout), else ``old_logprobs``, else 0.

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]``, rollout_logprobs ``[B, R]``;
            ``extras['branch_parent']`` / ``extras['branch_prefix_len']`` ``[B]`` long (optional).
        node_value, node_advantage, leaf_norm, eps: :class:`AT2POParams`.
    Returns:
        AdvantageOutput with ``advantages [B, R]`` float32 (0 off the mask), ``returns=None``.
    Raises:
        ValueError: an unknown mode, a negative ``eps``, or a branch record pointing across groups.
    """
    node_value = NodeValue(str(getattr(node_value, "value", node_value))).value
    node_advantage = NodeAdvantage(str(getattr(node_advantage, "value", node_advantage))).value
    if float(eps) < 0:
        raise ValueError(f"at2po: eps must be >= 0, got {eps}")
    mask = inp.response_mask
    lp = inp.rollout_logprobs if inp.rollout_logprobs is not None else inp.old_logprobs
    sur = None if lp is None else (-lp.double().cpu())
    ex = inp.extras or {}
    par, pre = ex.get("branch_parent"), ex.get("branch_prefix_len")
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    r = inp.rewards.double().cpu()
    gi = inp.group_index.cpu()
    for g in torch.unique(gi).tolist():
        rows = torch.nonzero(gi == g).flatten().tolist()
        local = {row: j for j, row in enumerate(rows)}
        p_loc = l_loc = None
        if par is not None and pre is not None:
            p_loc, l_loc = [], []
            for row in rows:
                p = int(par[row])
                if p >= 0 and p not in local:
                    raise ValueError(f"at2po: row {row} branches from row {p} of another group")
                p_loc.append(local[p] if p >= 0 else -1)
                l_loc.append(int(pre[row]))
        m_g = mask[rows].cpu()
        tree = build_turn_tree(m_g, None if sur is None else sur[rows], p_loc, l_loc)
        rg = r[rows]
        if leaf_norm:
            if bool((rg == rg[0]).all()):
                lv = [0.0] * len(rows)
            else:
                lv = ((rg - rg.mean()) / (rg.std(unbiased=False) + float(eps))).tolist()
        else:
            lv = rg.tolist()
        vals, root = tree_values(tree, lv, node_value)
        for j, row in enumerate(rows):
            for s, e, nd in tree.spans[j]:
                v = vals[nd]
                if node_advantage == NodeAdvantage.diff_parent.value:
                    p = tree.parent[nd]
                    v -= vals[p] if p >= 0 else root
                elif node_advantage == NodeAdvantage.diff_global.value:
                    v -= root
                adv[row, s:e] = v
    return AdvantageOutput(advantages=(adv * mask.double().cpu()).float().to(mask.device), returns=None)
