"""Turn-level advantages for group methods on multi-turn episodes (``algo.adv_estimator=turn_grpo``).

A multi-turn episode row (:mod:`rlpost.samplers.episode`) holds model turns separated by
inserted environment tokens (``response_mask`` 0). Per-turn rewards arrive as token rewards
placed on the **last model token of each turn** (``sampler.params.env_reward_at=turn``:
the sampler's ``extras['turn_rewards']``, which the runner adds to
``AdvantageInput.token_rewards``). A trajectory-level estimator (GRPO) gives every token of the
episode the same advantage; the turn-level estimator here credits each turn with the rewards
that come at or after it.

Paper: "Reinforcing Multi-Turn Reasoning in LLM Agents via Turn-Level Credit Assignment"
(Zeng et al., arXiv:2505.11821), MT-GRPO: the advantage of a turn's tokens is the
group-normalised turn reward plus the group-normalised outcome advantage. The paper states it for
two turns (turn 1: ``A^T + lambda * A^O``, turn 2: ``A^O``). Our generalisation to K turns (our
choice, documented): a turn's credit is its discounted per-turn **return-to-go**, so a turn is
credited with its own and all later turn rewards, and the outcome advantage applies to every turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.utils import group_all_equal, group_stats
from rlpost.core.registry import param

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput


@dataclass(frozen=True)
class TurnGRPOParams:
    """Turn-level GRPO (MT-GRPO, arXiv:2505.11821, generalised to K turns by return-to-go: our choice)."""

    turn_coef: float = param(1.0, "weight of the turn-level term (MT-GRPO's lambda sits on the outcome; we weight the turn term instead, outcome weight 1)")
    gamma: float = param(1.0, "discount per turn of the per-turn return-to-go (1 = undiscounted)")
    norm_by_std: bool = param(True, "divide the outcome term by the group std (GRPO: true; Dr. GRPO: false)")
    eps: float = param(1e-6, "added to the group std")


def turn_spans(mask_row: torch.Tensor) -> List[Tuple[int, int]]:
    """``[(start, end)]`` (end exclusive) of the maximal runs of mask-1 positions of one row.

    On an episode row these runs are the model's turns: the episode sampler always separates two
    turns by inserted environment tokens (mask 0). A turn of zero sampled tokens has no run.
    """
    m = (mask_row > 0).tolist()
    spans, start = [], None
    for t, on in enumerate(m):
        if on and start is None:
            start = t
        elif not on and start is not None:
            spans.append((start, t))
            start = None
    if start is not None:
        spans.append((start, len(m)))
    return spans


def turn_returns_to_go(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> Tuple[torch.Tensor, list]:
    """Per-turn discounted return-to-go broadcast to each turn's tokens.

    ``r_k`` = the sum of ``token_rewards`` over turn ``k``'s tokens (the sampler puts a turn's
    reward on its last token; a KL-in-reward penalty spreads over the tokens and sums in too);
    ``G_k = sum_{k' >= k} gamma^(k' - k) r_k'``.

    Args:
        token_rewards, mask: ``[B, R]``.
        gamma: discount per turn.
    Returns:
        ``(G [B, R] float64 on each turn's tokens, 0 elsewhere; per-row lists of (start, end, G_k))``.
    """
    B, R = mask.shape
    out = torch.zeros(B, R, dtype=torch.float64)
    per_row = []
    tr = token_rewards.double()
    for i in range(B):
        spans = turn_spans(mask[i])
        rk = [float(tr[i, s:e].sum()) for s, e in spans]
        g, run = [0.0] * len(spans), 0.0
        for k in range(len(spans) - 1, -1, -1):
            run = rk[k] + gamma * run
            g[k] = run
        for (s, e), gk in zip(spans, g):
            out[i, s:e] = gk
        per_row.append([(s, e, gk) for (s, e), gk in zip(spans, g)])
    return out, per_row


@ADV_ESTIMATORS.register(
    "turn_grpo",
    paper="Reinforcing Multi-Turn Reasoning in LLM Agents via Turn-Level Credit Assignment (MT-GRPO, arXiv:2505.11821)",
    params=TurnGRPOParams,
    needs_group=True,
    uses_token_rewards=True,
)
def turn_grpo_advantage(inp: AdvantageInput, *, turn_coef: float, gamma: float, norm_by_std: bool,
                        eps: float) -> AdvantageOutput:
    """Turn-level group advantage on multi-turn episodes.

    For token ``t`` of turn ``k`` of episode ``i`` in group ``g``::

        A_{i,t} = (R_i - mean_g R) / (std_g R + eps)  +  turn_coef * (G_{i,k} - mean_{j in g, K_j > k} G_{j,k})

    where ``R_i`` is the row's outcome reward (``inp.rewards``; GRPO's term, exactly 0 in a
    zero-variance group), ``G_{i,k}`` the discounted per-turn return-to-go
    (:func:`turn_returns_to_go`) and its baseline the mean over the group's episodes that
    reached turn ``k`` (MT-GRPO normalises turn rewards within the group; we subtract the
    mean only, so a turn reached by a single episode gets no turn credit, and a turn reward
    never changes sign by a std division: our choice). Turns are the runs of mask-1 tokens
    (:func:`turn_spans`). Without token rewards the turn term is 0 and the result equals
    ``grpo`` with the same ``norm_by_std`` / ``eps``.

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]``,
            token_rewards ``[B, R]`` or None.
        turn_coef: weight of the turn term; gamma: discount per turn.
        norm_by_std, eps: GRPO's normalisation of the outcome term.
    Returns:
        AdvantageOutput with ``advantages [B, R]`` (float32, 0 off the mask) and ``returns=None``.
    """
    mask = inp.response_mask
    r = inp.rewards.double()
    mean, std, _ = group_stats(r, inp.group_index)
    out_adv = r - mean
    if norm_by_std:
        out_adv = out_adv / (std + eps)
    out_adv = torch.where(group_all_equal(r, inp.group_index), torch.zeros_like(out_adv), out_adv)
    adv = out_adv[:, None] * mask.double()
    if inp.token_rewards is not None and turn_coef != 0:
        _, per_row = turn_returns_to_go(inp.token_rewards, mask, gamma)
        # baseline per (group, turn index): mean G over the group's episodes that reached that turn
        sums: dict = {}
        for i, turns in enumerate(per_row):
            g = int(inp.group_index[i])
            for k, (_, _, gk) in enumerate(turns):
                s, n = sums.get((g, k), (0.0, 0))
                sums[(g, k)] = (s + gk, n + 1)
        for i, turns in enumerate(per_row):
            g = int(inp.group_index[i])
            for k, (s0, e0, gk) in enumerate(turns):
                tot, n = sums[(g, k)]
                adv[i, s0:e0] += turn_coef * (gk - tot / n)
    return AdvantageOutput(advantages=(adv * mask.double()).float(), returns=None)
