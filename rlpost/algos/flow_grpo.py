"""Flow-GRPO (``algo.adv_estimator=flow_grpo``): the trajectory's outcome broadcast to every planner turn,
group-normalised.

Paper: "In-the-Flow Agentic System Optimization for Effective Planning and Tool Use" (AgentFlow,
arXiv:2510.05592); authors' code https://github.com/lupantech/AgentFlow. Flow-GRPO turns multi-turn
optimisation into single-turn updates: every planner turn of trajectory ``i`` is one sample, and all
of them get the same advantage from the trajectory's single verifiable outcome ``R_i``.

Rows come from ``sampler=agentflow`` (:mod:`rlpost.samplers.agentflow`): one row per planner turn,
``rewards[row] = R_(episode of row)`` (the broadcast), ``extras['flow_episode']`` the episode id.
The group is the prompt (``group_index``). Two normalisations:

* ``normalize_over=turn`` (default, **the authors' code**): the authors' trainer (``agentflow/verl``)
  gives each planner call its own sample whose GRPO ``uid`` is the question, and runs verl's GRPO:
  mean and (Bessel-corrected) std over *all planner-turn rows* of the question's rollouts. That is
  exactly ``grpo`` on these rows, so this mode delegates to it (the identity is tested).
* ``normalize_over=episode`` (our reading of the paper's text, "group-normalized advantages" over
  the G trajectories of a query): ``A_i = (R_i - mean_k R_k) / (std_k R_k + eps)`` with the mean and
  unbiased std over the group's *episodes*, each counted once however many turns it took, then copied
  to every turn row of episode ``i``. Without ``extras['flow_episode']`` each row is its own episode
  (single-turn rows), which is again ``grpo``.

The two differ when episodes of a group take different numbers of turns: with per-turn statistics a
long episode weighs more in its group's mean and std.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, grpo_advantage
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.utils import group_all_equal, group_stats
from rlpost.core.registry import Choice, param


class NormalizeOver(Choice):
    """``algo.adv_params.normalize_over``: which samples Flow-GRPO's group mean and std run over."""

    turn = "turn"
    episode = "episode"


@dataclass(frozen=True)
class FlowGRPOParams:
    """Flow-GRPO (AgentFlow, arXiv:2510.05592): broadcast outcome, group-normalised."""

    normalize_over: NormalizeOver = param(NormalizeOver.turn, "turn: mean/std over every planner-turn row of the group (authors' code: verl GRPO, uid = question); episode: over the group's episodes, each once (our reading of the paper's text)")
    norm_by_std: bool = param(True, "divide by the group std (GRPO)")
    eps: float = param(1e-6, "added to the group std (verl's GRPO: 1e-6)")


@ADV_ESTIMATORS.register(
    "flow_grpo",
    paper="In-the-Flow Agentic System Optimization for Effective Planning and Tool Use (AgentFlow, arXiv:2510.05592)",
    params=FlowGRPOParams,
    needs_group=True,
)
def flow_grpo_advantage(inp: AdvantageInput, *, normalize_over: str, norm_by_std: bool, eps: float) -> AdvantageOutput:
    """Flow-GRPO advantage of every planner-turn row.

    ``turn``: ``grpo`` on the rows (mean / unbiased std over the group's turn rows).
    ``episode``: for row ``j`` of episode ``i`` in group ``g``,
    ``A_j = (R_i - mean_{k in g} R_k) / (std_{k in g} R_k + eps)`` over the group's episodes (each
    once; ``R_i`` read from any of its rows: they all carry it); 0 in a group whose episode
    rewards are all equal or that has one episode.

    Args:
        inp: rewards ``[B]`` (the episode outcome on each of its turn rows), response_mask ``[B, R]``,
            group_index ``[B]``, ``extras['flow_episode']`` ``[B]`` long (episode of each row) for ``episode``.
        normalize_over: ``turn`` or ``episode``.
        norm_by_std, eps: GRPO's normalisation.
    Returns:
        AdvantageOutput with ``advantages [B, R]`` float32 (the row's value on its mask, 0 elsewhere), ``returns=None``.
    Raises:
        ValueError: an unknown ``normalize_over``, or rows of one episode with different rewards or groups
            (the broadcast was broken upstream).
    """
    mode = str(getattr(normalize_over, "value", normalize_over))
    if mode == "turn":
        return grpo_advantage(inp, norm_by_std=norm_by_std, eps=eps, baseline="mean", unbiased_std=True, std_scope="group")
    if mode != "episode":
        raise ValueError(f"normalize_over={mode!r}: valid choices are turn, episode")
    B = inp.rewards.shape[0]
    ep = (inp.extras or {}).get("flow_episode")
    ep = torch.arange(B) if ep is None else ep.long()
    uniq, inv = torch.unique(ep, return_inverse=True)
    E = uniq.numel()
    first = torch.full((E,), B, dtype=torch.long).scatter_reduce(0, inv, torch.arange(B), reduce="amin")
    r_ep, g_ep = inp.rewards.double()[first], inp.group_index.long()[first]
    if not (torch.equal(r_ep[inv], inp.rewards.double()) and torch.equal(g_ep[inv], inp.group_index.long())):
        raise ValueError("flow_grpo: the turn rows of one episode must share its reward and group (Flow-GRPO "
                         "broadcasts one outcome per trajectory); sampler=agentflow writes them so")
    mean, std, _ = group_stats(r_ep, g_ep)
    a = r_ep - mean
    if norm_by_std:
        a = a / (std + eps)
    a = torch.where(group_all_equal(r_ep, g_ep), torch.zeros_like(a), a)
    mask = inp.response_mask
    return AdvantageOutput(advantages=(a[inv][:, None] * mask.double()).float(), returns=None)
