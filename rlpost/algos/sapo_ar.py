"""Single-rollout autoregressive policy optimisation: turn-level values, trajectory GAE, a SARSA value target.

SAPO: Single-Rollout Autoregressive Policy Optimization for Agentic Reinforcement
Learning (arXiv:2608.19842; the preset is ``sapo_ar`` because ``sapo`` is Soft Adaptive
Policy Optimization, arXiv:2511.20347) trains an LLM agent from one
rollout per prompt. Policy and value share one autoregressive backbone, the value is
read at turn boundaries, the PPO objective and an auxiliary on-policy SARSA value
objective are optimised separately, and per-turn credit comes from a trajectory-level
GAE over turns with advantages normalised over the batch. Only the abstract and
secondary summaries were readable from here (no code); this module follows that description, and
the constants are this library's choices (stated in the parameter docs).

A turn is a maximal run of loss tokens (``response_mask > 0``): in a multi-turn
episode the environment's tokens between turns are masked out, so the runs are the
model's turns; a single-turn response is one turn. Turn ``k`` starts at position
``s_k``; its value is the critic's ``V(s_k)`` (the state before the turn's first
token), its reward ``r_k`` the sum of the token rewards inside it (the outcome on the
last token, per-turn rewards on each turn's last token). With ``V_K = 0``::

    delta_k = r_k + gamma V_{k+1} - V_k,   A_k = sum_j (gamma lam)^j delta_{k+j}
    SARSA target of V(s_k): r_k + gamma V_{k+1}   (the next state actually reached, on-policy)

``A_k`` is normalised over every turn of the batch (mean 0, std 1) and broadcast to the
turn's tokens; the critic is regressed only at the turn starts (``value_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, outcome_token_rewards
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.turns import turn_spans as row_turn_spans
from rlpost.core.registry import param

_PAPER = ("SAPO: Single-Rollout Autoregressive Policy Optimization for Agentic RL (arXiv:2608.19842): "
          "shared-backbone values at turn boundaries, SARSA value objective, trajectory-level GAE")


def turn_spans(mask: torch.Tensor) -> List[List[Tuple[int, int]]]:
    """Per row of ``mask`` ``[B, R]``, the ``(start, end)`` (end exclusive) of each maximal run of
    ``mask > 0``: the model's turns (:func:`rlpost.algos.turns.turn_spans` of each row)."""
    return [row_turn_spans(row) for row in mask]


def turn_gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trajectory-level GAE over turns.

    Args:
        token_rewards: ``[B, R]`` rewards per token (outcome on the last loss token).
        values: ``[B, R]`` critic values ``V`` of the state before each token.
        mask: ``[B, R]`` loss mask; its runs are the turns.
        gamma, lam: discount and GAE lambda over turns.
    Returns:
        ``(turn advantages [B, R] broadcast over each turn's tokens (unnormalised),
        SARSA targets [B, R] at turn starts, value_mask [B, R] 1 at turn starts,
        turn_adv [N] the N turns' advantages in row order)``, float64.
    """
    B, R = mask.shape
    adv = torch.zeros(B, R, dtype=torch.float64)
    ret = torch.zeros(B, R, dtype=torch.float64)
    vmask = torch.zeros(B, R, dtype=torch.float64)
    flat: List[float] = []
    tr, v = token_rewards.double(), values.double()
    for b, spans in enumerate(turn_spans(mask)):
        K = len(spans)
        rk = [float((tr[b, s:e] * (mask[b, s:e] > 0)).sum()) for s, e in spans]
        vk = [float(v[b, s]) for s, _ in spans] + [0.0]
        a_next = 0.0
        row_adv = [0.0] * K
        for k in range(K - 1, -1, -1):
            delta = rk[k] + gamma * vk[k + 1] - vk[k]
            a_next = delta + gamma * lam * a_next
            row_adv[k] = a_next
        for k, (s, e) in enumerate(spans):
            adv[b, s:e] = row_adv[k] * (mask[b, s:e] > 0).double()
            ret[b, s] = rk[k] + gamma * vk[k + 1]
            vmask[b, s] = 1.0
        flat.extend(row_adv)
    return adv, ret, vmask, torch.tensor(flat, dtype=torch.float64)


@dataclass(frozen=True)
class SapoARParams:
    """Turn-level GAE constants (our choices: the method's values were not readable)."""

    gamma: float = param(1.0, "discount over turns (our choice: 1, undiscounted episodic reward)")
    lam: float = param(0.95, "GAE lambda over turns (our choice: 0.95, the PPO default)")
    adv_norm: bool = param(True, "normalise the turn advantages over the batch (mean 0, std 1), as the method")


@ADV_ESTIMATORS.register("sapo_ar", paper=_PAPER, params=SapoARParams, needs_critic=True, uses_token_rewards=True,
                         zero_variance=('turn-level critic baseline (one rollout per prompt: no group), normalised '
                                        "over the batch's turns"))
def sapo_ar_advantage(inp: AdvantageInput, *, gamma: float, lam: float, adv_norm: bool) -> AdvantageOutput:
    """Turn-level trajectory GAE with batch normalisation and SARSA value targets at turn starts (module docstring).

    One rollout per prompt is enough (no group statistic). Shapes: ``[B]`` rewards and
    ``[B, R]`` values -> ``[B, R]`` advantages, returns and ``value_mask``.

    Raises:
        ValueError: no ``inp.values`` (the estimator needs the critic), or ``gamma`` /
            ``lam`` outside [0, 1].
    """
    if inp.values is None:
        raise ValueError("sapo_ar needs critic values (inp.values): set algo.critic.enabled=true")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"sapo_ar: gamma and lam must be in [0, 1], got {gamma}, {lam}")
    tr = outcome_token_rewards(inp)
    adv, ret, vmask, turns = turn_gae(tr, inp.values, inp.response_mask, gamma, lam)
    if adv_norm and turns.numel() > 0:
        mu = turns.mean()
        sd = turns.std(unbiased=False) if turns.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
        on = inp.response_mask > 0
        adv = torch.where(on, (adv - mu) / (sd + 1e-8), torch.zeros_like(adv))
    return AdvantageOutput(advantages=adv.float(), returns=ret.float(), value_mask=vmask.float())
