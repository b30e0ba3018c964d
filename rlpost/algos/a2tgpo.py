"""A²TGPO's turn advantages and adaptive turn-level clip ("A²TGPO: Agentic Turn-Group Policy
Optimization with Adaptive Turn-level Clipping", arXiv:2605.06200).

Information gain (IG) of model turn ``k`` of an episode: ``IG_k = P_{k+1} - P_k``, where ``P_k``
is the policy's probability of the reference answer given the context just before turn ``k``
(prompt, earlier turns and environment text), teacher-forced after a short answer prefix and
taken as ``exp(mean log-prob)`` of the answer tokens (IGPO's ``prob_diff``, the IG A²TGPO keeps;
"Information Gain-based Policy Optimization", arXiv:2510.14967, authors' code
GuoqingWang1/IGPO). An episode of ``K`` turns has ``K - 1`` IG values (turns ``0 .. K-2``); its
final turn carries the outcome reward. :mod:`rlpost.methods.a2tgpo` runs the passes.

The three changes of A²TGPO, as read here:

1. turn-group normalisation: ``IG_k`` is normalised within its (prompt group, turn index) group,
   ``n_k = (IG_k - mean) / (std + eps)`` over the group's episodes that have an IG at turn ``k``
   (population std; a group of one gives 0); the outcome is normalised within the prompt group
   (GRPO; a zero-variance group gives 0);
2. variance-rescaled discounted accumulation: with the terms ``n_0 .. n_{K-2}, n_out``,
   ``A_k = (sum_{j >= k} gamma^(j-k) n_j) / sqrt(K - k)`` (``K - k`` terms are summed), on turn
   ``k``'s tokens;
3. adaptive turn-level clip: the clip range of turn ``k``'s tokens is scaled by
   ``c_k = 1 + beta (2 sigmoid(n_k) - 1)`` (``c = 1`` on the final turn), so ``c`` lies in
   ``(1 - beta, 1 + beta)``: wider for informative turns, narrower for uninformative ones.

The form of ``c`` and ``beta = 0.3`` are from a reading of the authors' code (the paper's own
formula could not be read here); ``gamma = 1`` follows IGPO's code default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.losses import EXTRA_INPUTS, Metrics, PolicyLossInput, _clip_metrics, _ppo_core, _ratio
from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
from rlpost.algos.turns import turn_spans
from rlpost.algos.utils import group_all_equal, group_stats
from rlpost.core.registry import param

#: the extra input the A²TGPO method writes and its loss reads
TURN_IG_KEY = "turn_info_gain"
EXTRA_INPUTS.setdefault(TURN_IG_KEY, "[B, R] each model token's turn-group-normalised information gain of its "
                                     "turn (0 on an episode's final turn and off the mask); algo=a2tgpo's method")


def turn_group_normalise(ig: Sequence[Sequence[float]], group_index: torch.Tensor, eps: float = 1e-6) -> List[List[float]]:
    """Normalise each row's per-turn IG within its (group, turn index) group.

    Args:
        ig: per row, ``IG_0 .. IG_{K_i - 2}`` (possibly empty).
        group_index: ``[B]`` prompt group ids.
        eps: added to the std.
    Returns:
        per row, ``(IG_k - mean_{g,k}) / (std_{g,k} + eps)``, mean and population std over the
        rows of the same group that have an IG at turn ``k``; exactly 0 where that group has one
        row or all its values are equal.
    """
    cells: Dict[Tuple[int, int], List[float]] = {}
    for i, row in enumerate(ig):
        for k, v in enumerate(row):
            cells.setdefault((int(group_index[i]), k), []).append(float(v))
    stats = {}
    for key, vals in cells.items():
        m = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - m) ** 2 for v in vals) / len(vals))
        stats[key] = (m, sd, len(vals) > 1 and max(vals) > min(vals))
    out = []
    for i, row in enumerate(ig):
        g = int(group_index[i])
        o = []
        for k, v in enumerate(row):
            m, sd, varied = stats[(g, k)]
            o.append((float(v) - m) / (sd + eps) if varied else 0.0)
        out.append(o)
    return out


@dataclass(frozen=True)
class A2TGPOParams:
    """A²TGPO's accumulation (arXiv:2605.06200); gamma = 1 as IGPO's code default (our choice)."""

    gamma: float = param(1.0, "discount per turn of the accumulated normalised terms (IGPO's code default 1)")
    sqrt_rescale: bool = param(True, "divide turn k's accumulated sum by sqrt(K - k), the number of summed terms "
                                     "(A2TGPO's variance rescaling; false: IGPO's plain discounted sum)")
    eps: float = param(1e-6, "added to the group std of the outcome")


@ADV_ESTIMATORS.register(
    "a2tgpo",
    paper="A2TGPO: Agentic Turn-Group Policy Optimization with Adaptive Turn-level Clipping (arXiv:2605.06200)",
    params=A2TGPOParams,
    needs_group=True,
)
def a2tgpo_advantage(inp: AdvantageInput, *, gamma: float, sqrt_rescale: bool, eps: float) -> AdvantageOutput:
    """Turn advantages from turn-group-normalised IG and the group-normalised outcome.

    For row ``i`` with turns ``0 .. K-1`` (the runs of mask-1 tokens, :func:`turn_spans`), terms
    ``t_k = n_k`` (the normalised IG of turn ``k``, read from ``inp.extras['turn_info_gain']`` at
    the turn's first token) for ``k < K-1`` and ``t_{K-1} = (R_i - mean_g R) / (std_g R + eps)``
    (0 in a zero-variance group); ``A_k = sum_{j >= k} gamma^(j-k) t_j`` divided by
    ``sqrt(K - k)`` when ``sqrt_rescale``. Without the extra (or on single-turn rows) this is
    GRPO's advantage.

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]``, extras.
    Returns:
        AdvantageOutput with ``advantages [B, R]`` (float32, 0 off the mask).
    """
    mask = inp.response_mask
    r = inp.rewards.double()
    mean, std, _ = group_stats(r, inp.group_index)
    out_n = (r - mean) / (std + eps)
    out_n = torch.where(group_all_equal(r, inp.group_index), torch.zeros_like(out_n), out_n)
    ig = (inp.extras or {}).get(TURN_IG_KEY)
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        spans = turn_spans(mask[i])
        K = len(spans)
        terms = [float(ig[i, s]) if ig is not None else 0.0 for s, _ in spans[:-1]] + [float(out_n[i])]
        run = 0.0
        for k in range(K - 1, -1, -1):
            run = terms[k] + gamma * run
            s, e = spans[k]
            adv[i, s:e] = run / math.sqrt(K - k) if sqrt_rescale else run
    return AdvantageOutput(advantages=(adv * mask.double()).float(), returns=None)


@dataclass(frozen=True)
class A2TGPOClipParams:
    """A²TGPO's adaptive turn-level clip around PPO's range (beta from the authors' code, as read)."""

    eps_low: float = param(0.2, "base lower clip range (PPO's 0.2; our choice)")
    eps_high: float = param(0.2, "base upper clip range (PPO's 0.2; our choice)")
    beta: float = param(0.3, "clip scale c = 1 + beta (2 sigmoid(n_k) - 1) of a turn with normalised IG n_k "
                             "(0.3 in the authors' code as read)")


@POLICY_LOSSES.register(
    "a2tgpo_clip",
    paper="A2TGPO: Agentic Turn-Group Policy Optimization with Adaptive Turn-level Clipping (arXiv:2605.06200)",
    params=A2TGPOClipParams,
    extras=(TURN_IG_KEY,),
    optional_extras=(TURN_IG_KEY,),
    example_inputs=lambda logprobs, generator: {"overrides": ["algo.adv_estimator=a2tgpo"]},  # the only estimator
)
def a2tgpo_clip_loss(inp: PolicyLossInput, *, eps_low: float, eps_high: float, beta: float) -> Tuple[torch.Tensor, Metrics]:
    """PPO's clipped surrogate with a per-token clip range scaled by the turn's IG.

    ``c_t = 1 + beta (2 sigmoid(n_t) - 1)`` with ``n_t = extras['turn_info_gain']`` (``[B, R]``;
    absent: 0, i.e. ``c = 1`` and this is ``ppo_clip``); per token the range is
    ``[1 - eps_low c_t, 1 + eps_high c_t]``.

    Returns:
        ``(loss_mat [B, R], metrics)``, metrics with ``clip_scale_mean`` over the mask.
    Raises:
        ValueError: ``beta`` outside [0, 1) (the range must stay positive).
    """
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"a2tgpo_clip: beta must be in [0, 1), got {beta}")
    ratio, log_ratio = _ratio(inp)
    m = inp.response_mask
    n = inp.extras.get(TURN_IG_KEY)
    c = torch.ones_like(ratio) if n is None else 1.0 + beta * (2.0 * torch.sigmoid(n.to(ratio)) - 1.0)
    loss, low, high, extra = _ppo_core(ratio, inp.advantages, eps_low * c, eps_high * c, None, m)
    metrics = _clip_metrics(ratio, log_ratio, low, high, m)
    metrics.update(extra)
    metrics["clip_scale_mean"] = (c.detach() * m).sum() / m.sum().clamp(min=1)
    return loss, metrics
