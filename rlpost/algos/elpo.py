"""ELPO's hierarchical advantage over the binary-search rollout tree and its error-localized adaptive clip.

Paper: "Learning from the Irrecoverable: Error-Localized Policy Optimization for Tool-Integrated LLM
Reasoning" (ELPO, arXiv:2602.09598; no code released). The tree is built by ``sampler=elpo``
(:mod:`rlpost.samplers.elpo`): per prompt group, one failed rollout ``tau`` (``extras['elpo_role'] == 1``)
and continuations sampled from its ``j``-step prefixes ``P_j`` (role 2, ``extras['elpo_anchor'] = j``,
``extras['shared_prefix_len']`` = the prefix's tokens). What was readable of the paper (abstract and a
summary) says the tree becomes per-step signals by *hierarchical advantage attribution* that combines
*local branch comparisons* with *global trajectory rankings*, and that an *error-localized adaptive
clip* strengthens the corrective update on the critical step and its suffix; no formula or constant.
Everything below is **our reading**:

**Hierarchical advantage** (``algo.adv_estimator=elpo``). For token ``t`` of row ``i`` in group ``g``::

    A_{i,t} = G_i + lam * L_{i,t}
    G_i     = (R_i - mean_g R) / (std_g R + eps)        (GRPO over all the group's complete rollouts;
                                                          0 in a zero-variance group; Bessel std)

``L`` is the tree's local comparison, nonzero only on tree rows. The tree's nodes are the root
``P_0`` (the prompt), the probed prefixes ``P_j`` of ``tau`` and the leaves (rows); a node's value
``V`` is the mean reward of the leaves below it (``V(P_0)``: the whole group; ``V(P_j)``: ``tau`` and
every continuation from an anchor ``j' >= j``, since those prefixes extend ``P_j``); a leaf's value is
its reward. A segment of a row's tokens that runs from node ``u`` to its next node ``v`` gets
``L = V(v) - V(u)``:

* ``tau``'s tokens ``[c_a, c_b)`` between consecutive anchors ``a < b`` (``c`` the prefix lengths,
  ``a = 0`` for the root) get ``V(P_b) - V(P_a)``, its tokens after the last anchor ``R_tau - V(P_last)``;
  so the segment holding the first irrecoverable step gets the drop from a recoverable value to 0;
* a continuation from ``P_j`` (its response is its suffix) gets ``R_c - V(P_j)``: a comparison with
  its siblings below the same prefix.

``lam = 1`` (our choice). Without the tree's extras every row is plain and this is GRPO exactly.

**Error-localized adaptive clip** (``algo.loss=elpo_clip``): PPO's clipped surrogate with a per-token
range, ``[1 - eps_low, 1 + eps_high]`` by default and ``[1 - error_eps_low, 1 + error_eps_high]`` on
the tokens of ``extras['elpo_error_mask']`` (the localized rollout from its located step on, and the
continuations from irrecoverable prefixes). Defaults 0.2 / 0.2 and 0.3 / 0.3: the error region may
move 1.5x as far in one update (our choice: "strengthen corrective updates"; the paper gives none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.losses import EXTRA_INPUTS, Metrics, PolicyLossInput, _clip_metrics, _ppo_core, _ratio
from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
from rlpost.algos.utils import group_all_equal, group_stats
from rlpost.core.registry import param

PAPER = ("Learning from the Irrecoverable: Error-Localized Policy Optimization for Tool-Integrated LLM "
         "Reasoning (ELPO, arXiv:2602.09598)")

#: the extra input sampler=elpo writes and the loss reads
ERROR_MASK_KEY = "elpo_error_mask"
EXTRA_INPUTS.setdefault(ERROR_MASK_KEY, "[B, R] 1 on tokens at and after ELPO's located first irrecoverable step "
                                        "(sampler=elpo), 0 elsewhere")


def tree_local_advantages(rewards: List[float], role: List[int], anchor: List[int], prefix_len: List[int],
                          lengths: List[int]) -> Dict[int, List[Tuple[int, int, float]]]:
    """The local term ``L`` of one group's rows: ``{row: [(start, end, L)]}`` token segments (module docstring).

    Args:
        rewards, role, anchor, prefix_len, lengths: per row of the group (in order): reward, ``elpo_role``
            (0 plain, 1 localized, 2 continuation), ``elpo_anchor`` (a continuation's ``j``),
            ``shared_prefix_len`` (a continuation's prefix tokens in ``tau``) and response tokens.
    Returns:
        segments of the tree rows (plain rows are absent: their ``L`` is 0); empty when the group has no
        localized row.
    Raises:
        ValueError: more than one localized row, continuations without one, or two continuations of one
            anchor with different prefix lengths.
    """
    taus = [k for k, r in enumerate(role) if r == 1]
    conts = [k for k, r in enumerate(role) if r == 2]
    if not taus:
        if conts:
            raise ValueError("elpo: continuation rows (elpo_role=2) in a group without its localized rollout "
                             "(elpo_role=1); keep the sampler=elpo rows of a group together")
        return {}
    if len(taus) > 1:
        raise ValueError(f"elpo: a group has {len(taus)} localized rollouts (elpo_role=1); sampler=elpo writes one")
    tau = taus[0]
    cut: Dict[int, int] = {}
    for k in conts:
        j, c = int(anchor[k]), int(prefix_len[k])
        if cut.setdefault(j, c) != c:
            raise ValueError(f"elpo: continuations of anchor {j} have prefix lengths {cut[j]} and {c}")
    anchors = sorted(cut)

    def value(j: int) -> float:
        below = [rewards[tau]] + [rewards[k] for k in conts if int(anchor[k]) >= j]
        return sum(below) / len(below)

    root = sum(rewards) / len(rewards)
    out: Dict[int, List[Tuple[int, int, float]]] = {}
    segs: List[Tuple[int, int, float]] = []
    prev_c, prev_v = 0, root
    for j in anchors:
        v = value(j)
        segs.append((prev_c, cut[j], v - prev_v))
        prev_c, prev_v = cut[j], v
    segs.append((prev_c, int(lengths[tau]), float(rewards[tau]) - prev_v))
    out[tau] = [(a, b, x) for a, b, x in segs if b > a]
    for k in conts:
        out[k] = [(0, int(lengths[k]), float(rewards[k]) - value(int(anchor[k])))]
    return out


@dataclass(frozen=True)
class ElpoAdvParams:
    """ELPO's hierarchical advantage (our reading; the paper gives no formula or constant)."""

    local_weight: float = param(1.0, "lam: weight of the tree's local comparison added to the group-normalised "
                                "reward (our choice)")
    eps: float = param(1e-6, "added to the group std (GRPO reference code: 1e-6)")


@ADV_ESTIMATORS.register("elpo", paper=PAPER, params=ElpoAdvParams, needs_group=True, sampler="elpo")
def elpo_advantage(inp: AdvantageInput, *, local_weight: float, eps: float) -> AdvantageOutput:
    """Hierarchical advantage: GRPO's group-normalised reward plus ``lam`` times the tree's local term.

    ``A_{i,t} = G_i + lam L_{i,t}`` (module docstring; :func:`tree_local_advantages`). Reads
    ``inp.extras['elpo_role' | 'elpo_anchor' | 'shared_prefix_len']`` ``[B]`` (sampler=elpo); without
    them ``L = 0`` (GRPO).

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]``, extras.
        local_weight, eps: :class:`ElpoAdvParams`.
    Returns:
        AdvantageOutput with ``advantages [B, R]`` float32 (0 off the mask), ``returns=None``.
    Raises:
        ValueError: a negative ``eps`` or ``local_weight``, or a malformed tree (:func:`tree_local_advantages`).
    """
    if float(eps) < 0 or float(local_weight) < 0:
        raise ValueError(f"elpo: eps and local_weight must be >= 0, got {eps}, {local_weight} "
                         "(algo.adv_params.eps / local_weight)")
    mask = inp.response_mask
    r = inp.rewards.double().cpu()
    gi = inp.group_index.cpu()
    mean, std, _ = group_stats(r, gi)
    glob = torch.where(group_all_equal(r, gi), torch.zeros_like(r), (r - mean) / (std + float(eps)))
    adv = glob[:, None].expand(mask.shape).clone()
    ex = inp.extras or {}
    role = ex.get("elpo_role")
    if role is not None and float(local_weight) > 0:
        anchor = ex.get("elpo_anchor", torch.full_like(role, -1))
        pre = ex.get("shared_prefix_len", torch.zeros_like(role))
        lens = mask.sum(-1).long().cpu()
        for g in torch.unique(gi).tolist():
            rows = torch.nonzero(gi == g).flatten().tolist()
            if not any(int(role[k]) for k in rows):
                continue
            segs = tree_local_advantages([float(r[k]) for k in rows], [int(role[k]) for k in rows],
                                         [int(anchor[k]) for k in rows], [int(pre[k]) for k in rows],
                                         [int(lens[k]) for k in rows])
            for loc, sl in segs.items():
                row = rows[loc]
                for a, b, x in sl:
                    adv[row, a:b] += float(local_weight) * x
    return AdvantageOutput(advantages=(adv * mask.double().cpu()).float().to(mask.device), returns=None)


@dataclass(frozen=True)
class ElpoClipParams:
    """ELPO's error-localized clip ranges (our choice: the paper gives no value)."""

    eps_low: float = param(0.2, "lower clip range off the error region (PPO's 0.2)")
    eps_high: float = param(0.2, "upper clip range off the error region (PPO's 0.2)")
    error_eps_low: float = param(0.3, "lower clip range on the error region (elpo_error_mask = 1; our choice, 1.5x)")
    error_eps_high: float = param(0.3, "upper clip range on the error region (our choice, 1.5x)")


@POLICY_LOSSES.register("elpo_clip", paper=PAPER, params=ElpoClipParams, extras=(ERROR_MASK_KEY,),
                        optional_extras=(ERROR_MASK_KEY,))
def elpo_clip_loss(inp: PolicyLossInput, *, eps_low: float, eps_high: float, error_eps_low: float,
                   error_eps_high: float) -> Tuple[torch.Tensor, Metrics]:
    """PPO's clipped surrogate whose range is ``error_eps_*`` on the error region and ``eps_*`` elsewhere.

    Per token, ``e = extras['elpo_error_mask']`` (``[B, R]`` in {0, 1}; absent: 0, i.e. ``ppo_clip``):
    ``lo = eps_low + e (error_eps_low - eps_low)``, ``hi`` likewise, and the loss
    ``max(-A r, -A clip(r, 1 - lo, 1 + hi))`` with ``r = exp(log pi - log pi_old)``.

    Args:
        inp: logprobs / old_logprobs / advantages / response_mask ``[B, R]``, extras.
        eps_low, eps_high, error_eps_low, error_eps_high: :class:`ElpoClipParams`.
    Returns:
        ``(loss_mat [B, R], metrics)``: the standard clip metrics and ``error_token_frac`` (share of the
        mask's tokens in the error region).
    Raises:
        ValueError: a lower range not in (0, 1) or an upper range not > 0.
    """
    if not (0.0 < eps_low < 1.0 and 0.0 < error_eps_low < 1.0 and eps_high > 0.0 and error_eps_high > 0.0):
        raise ValueError(f"elpo_clip: eps_low / error_eps_low must be in (0, 1) and eps_high / error_eps_high > 0, "
                         f"got {eps_low}, {error_eps_low}, {eps_high}, {error_eps_high} (algo.loss_params)")
    ratio, log_ratio = _ratio(inp)
    m = inp.response_mask
    e = inp.extras.get(ERROR_MASK_KEY)
    e = torch.zeros_like(ratio) if e is None else (e.to(ratio) > 0).to(ratio)
    lo = eps_low + e * (error_eps_low - eps_low)
    hi = eps_high + e * (error_eps_high - eps_high)
    loss, low, high, extra = _ppo_core(ratio, inp.advantages, lo, hi, None, m)
    metrics = _clip_metrics(ratio, log_ratio, low, high, m)
    metrics.update(extra)
    metrics["error_token_frac"] = (e.detach() * m).sum() / m.sum().clamp(min=1)
    return loss, metrics
