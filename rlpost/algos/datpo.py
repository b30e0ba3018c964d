"""DATPO's block-level tree advantage with the annealed sibling-diversity bonus (``algo.adv_estimator=datpo``).

Paper: "Difficulty-Adaptive Tree-Structured Policy Optimization for Expanding Reasoning Coverage in RLVR"
(DATPO, arXiv:2609.08650). The formula below is the authors' README
(``A(b) = A_base(b) + 1[A_base(b) > 0] alpha Div_sib(b)``, alpha annealed) and their code
(https://github.com/colin31472/DATPO, ``TreeSearchEngine._assign_advantages``, ``_scheduled_alpha``,
``_estimate_node_value``; ``config.yaml``: ``divergence_alpha 0.2``, ``divergence_alpha_min 0.0``,
``adv_normalization false``), which we follow. The tree comes from ``sampler=datpo``
(:mod:`rlpost.samplers.datpo`), one expansion round.

Tree nodes of one prompt: the prompt node, value ``V0`` = mean reward of its roots; a fork node ``(k, t)``
(root ``k``'s prefix of ``t`` tokens), value ``V(k, t)`` = mean reward of its branches and of root ``k``
(the authors' ``_estimate_node_value``). A root's fork points ``t1 < ... < tm`` chain its fork nodes, so
the base advantage per block is the value gained crossing it:

* root ``k``: ``[0, t1)`` gets ``V(k, t1) - V0``; ``[ti, ti+1)`` gets ``V(k, ti+1) - V(k, ti)``; its tail
  ``[tm, L)`` gets ``R_k - V(k, tm)``; a root without a fork ``R_k - V0`` on every token;
* a branch of ``(k, t)`` (its response is its suffix): ``R - V(k, t)``.

Then ``A = A_base + 1[A_base > 0] alpha Div`` per token, ``Div`` = ``extras['datpo_div']`` (the block's sibling
divergence, written by the sampler), and ``alpha = c + (c_min - c) min(1, step / anneal_steps)`` (linear, the
authors' ``_scheduled_alpha`` with progress = ``step / anneal_steps``; ``anneal_steps = 0``: constant ``c``;
the authors anneal over the whole run, which a component cannot know, so recipes set it to ``steps``). No
normalisation by the group's std (the authors' ``adv_normalization: false``). Without the tree's extras
every row is a root without fork: ``R - mean_g R``, i.e. Dr. GRPO (``grpo`` with ``norm_by_std: false``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.core.registry import param

PAPER = ("Difficulty-Adaptive Tree-Structured Policy Optimization for Expanding Reasoning Coverage in RLVR "
         "(DATPO, arXiv:2609.08650)")

DIV_KEY, ROOT_KEY, STEP_KEY, PREFIX_KEY = "datpo_div", "datpo_root", "datpo_step", "shared_prefix_len"


def scheduled_coef(coef: float, coef_min: float, step: int, anneal_steps: int) -> float:
    """The diversity weight at ``step``: ``coef + (coef_min - coef) min(1, step / anneal_steps)``; ``coef`` if
    ``anneal_steps <= 0`` (the authors' ``_scheduled_alpha``)."""
    if int(anneal_steps) <= 0:
        return float(coef)
    prog = min(max(float(step) / float(anneal_steps), 0.0), 1.0)
    return float(coef) + (float(coef_min) - float(coef)) * prog


def tree_block_advantages(rewards: List[float], prefix: List[int], root: List[int],
                          lengths: List[int]) -> Dict[int, List[Tuple[int, int, float]]]:
    """The base advantage ``A_base`` of one prompt's rows as token blocks: ``{row: [(start, end, A)]}``.

    Args:
        rewards, prefix, root, lengths: per row of the group (in order): reward, ``shared_prefix_len`` (0 on
            roots, the fork position on branches), ``datpo_root`` (the root's rank) and response tokens.
    Returns:
        blocks of every row (module docstring). A branch whose root row is missing (dropped) still gets
        ``R - V(k, t)`` with ``V`` over the branches present.
    Raises:
        ValueError: two root rows with the same rank.
    """
    roots = [i for i, t in enumerate(prefix) if int(t) == 0]
    rank: Dict[int, int] = {}
    for i in roots:
        if int(root[i]) in rank:
            raise ValueError(f"datpo: two root rows of rank {int(root[i])} in one group (datpo_root must be unique "
                             f"among rows with shared_prefix_len 0)")
        rank[int(root[i])] = i
    v0 = sum(rewards[i] for i in roots) / len(roots) if roots else sum(rewards) / max(len(rewards), 1)
    nodes: Dict[Tuple[int, int], List[int]] = {}
    for i, t in enumerate(prefix):
        if int(t) > 0:
            nodes.setdefault((int(root[i]), int(t)), []).append(i)

    def value(k: int, t: int) -> float:
        vals = [rewards[i] for i in nodes[(k, t)]] + ([rewards[rank[k]]] if k in rank else [])
        return sum(vals) / len(vals)

    out: Dict[int, List[Tuple[int, int, float]]] = {}
    for k, i in rank.items():
        ts = sorted(t for (kk, t) in nodes if kk == k)
        segs, prev_t, prev_v = [], 0, v0
        for t in ts:
            v = value(k, t)
            segs.append((prev_t, t, v - prev_v))
            prev_t, prev_v = t, v
        segs.append((prev_t, int(lengths[i]), float(rewards[i]) - prev_v))
        out[i] = [(a, b, x) for a, b, x in segs if b > a]
    for (k, t), rows in nodes.items():
        v = value(k, t)
        for i in rows:
            out[i] = [(0, int(lengths[i]), float(rewards[i]) - v)]
    return out


@dataclass(frozen=True)
class DatpoAdvParams:
    """DATPO's advantage (defaults: the authors' ``config.yaml``)."""

    sibling_diversity_coef: float = param(0.2, "alpha: weight of the sibling-diversity bonus on positive-advantage "
                                          "blocks at step 0 (authors' divergence_alpha)")
    sibling_diversity_coef_min: float = param(0.0, "alpha after annealing (authors' divergence_alpha_min)")
    anneal_steps: int = param(0, "steps of the linear anneal from coef to coef_min (0: constant coef; the authors "
                              "anneal over the whole run: set it to steps)")

    def __post_init__(self) -> None:
        if float(self.sibling_diversity_coef) < 0 or float(self.sibling_diversity_coef_min) < 0 \
                or int(self.anneal_steps) < 0:
            raise ValueError(f"datpo: sibling_diversity_coef={self.sibling_diversity_coef}, sibling_diversity_coef_min="
                             f"{self.sibling_diversity_coef_min} and anneal_steps={self.anneal_steps} must be >= 0")


@ADV_ESTIMATORS.register("datpo", paper=PAPER, params=DatpoAdvParams, needs_group=True, sampler="datpo")
def datpo_advantage(inp: AdvantageInput, *, sibling_diversity_coef: float, sibling_diversity_coef_min: float,
                    anneal_steps: int) -> AdvantageOutput:
    """Block-level tree advantage plus ``alpha Div`` on positive blocks (module docstring).

    Reads ``inp.extras['shared_prefix_len' | 'datpo_root' | 'datpo_step']`` ``[B]`` and ``['datpo_div']``
    ``[B, R]`` (sampler=datpo); without them every row is a root (Dr. GRPO) and ``Div = 0``.

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]``, extras.
        sibling_diversity_coef, sibling_diversity_coef_min, anneal_steps: :class:`DatpoAdvParams`.
    Returns:
        AdvantageOutput with ``advantages [B, R]`` float32 (0 off the mask), ``returns=None``.
    Raises:
        ValueError: a negative coefficient or ``anneal_steps``; a malformed tree (:func:`tree_block_advantages`).
    """
    if float(sibling_diversity_coef) < 0 or float(sibling_diversity_coef_min) < 0 or int(anneal_steps) < 0:
        raise ValueError(f"datpo: sibling_diversity_coef={sibling_diversity_coef}, sibling_diversity_coef_min="
                         f"{sibling_diversity_coef_min} and anneal_steps={anneal_steps} must be >= 0 (algo.adv_params)")
    mask = inp.response_mask
    B, R = mask.shape
    r = inp.rewards.double().cpu()
    gi = inp.group_index.cpu()
    ex = inp.extras or {}
    pre = ex.get(PREFIX_KEY)
    pre = torch.zeros(B, dtype=torch.long) if pre is None else pre.cpu().long()
    root = ex.get(ROOT_KEY)
    root = torch.arange(B, dtype=torch.long) if root is None else root.cpu().long()
    lens = mask.sum(-1).long().cpu()
    base = torch.zeros(B, R, dtype=torch.float64)
    for g in torch.unique(gi).tolist():
        rows = torch.nonzero(gi == g).flatten().tolist()
        blocks = tree_block_advantages([float(r[k]) for k in rows], [int(pre[k]) for k in rows],
                                       [int(root[k]) for k in rows], [int(lens[k]) for k in rows])
        for loc, segs in blocks.items():
            for a, b, x in segs:
                base[rows[loc], a:b] = x
    adv = base
    div = ex.get(DIV_KEY)
    step = ex.get(STEP_KEY)
    alpha = scheduled_coef(sibling_diversity_coef, sibling_diversity_coef_min,
                           int(step.max()) if step is not None and step.numel() else 0, anneal_steps)
    if div is not None and alpha > 0:
        d = torch.zeros(B, R, dtype=torch.float64)
        w = min(R, div.shape[1])
        d[:, :w] = div[:, :w].double().cpu()
        adv = base + (base > 0).double() * alpha * d
    return AdvantageOutput(advantages=(adv * mask.double().cpu()).float().to(mask.device), returns=None)
