"""DRIFT's return-based importance weights ("DRIFT: Decoupled Rollouts and Importance-Weighted
Fine-Tuning for Efficient Multi-Turn Optimization", arXiv:2605.31455; authors' code
github.com/2020-qqtcg/DRIFT, ``src/weight_sft.py``).

DRIFT reads the KL-regularised RL objective ``max E[R] - beta KL(pi || pi_ref)`` through its closed
form ``pi* ~ pi_ref exp(R / beta)``: fitting ``pi*`` by maximum likelihood on trajectories sampled
from ``pi_ref`` is supervised fine-tuning with importance weights ``exp(R / beta)``. The
trajectories come from the frozen reference policy (the run's rollout engine holds the reference
copy and never receives the trainer's weights: :mod:`rlpost.methods.drift`).

As in the authors' code:

- the return of an episode is its discounted turn rewards ``R = sum_k gamma^k r_k`` (turns
  numbered from 0); here a row's outcome reward counts as the reward of its last model turn and
  per-turn rewards (``token_rewards`` on a turn's tokens, ``env_reward_at=turn``) as those of
  their turns;
- weights are self-normalised within each prompt's group, ``w_i = exp(R_i / beta) /
  mean_{j in g} exp(R_j / beta)`` (max-shifted for stability; mean 1 per group);
- the loss is ``mean_i w_i * mean_t(-log pi(y_t))`` (per-sample token mean, batch mean): the
  ``gpg`` loss ``-A log pi`` with ``A_t = w_i`` and ``loss_agg=seq-mean-token-mean``.

Defaults ``beta = 0.1`` and ``gamma = 0.9`` are the authors' ``scripts/run_weight_sft.sh``; their
script's argparse defaults (0.2, 0.7) differ. The code's repeat penalty (``0.5 (1 - distinct
answers / turns)``, subtracted from R) needs one parsed answer per turn and is not built here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.turns import turn_spans
from rlpost.core.registry import param


def discounted_returns(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float,
                       token_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's discounted return over its model turns (DRIFT, arXiv:2605.31455).

    Args:
        rewards: ``[B]`` outcome reward, counted as the reward of the row's last model turn.
        response_mask: ``[B, R]`` 0/1; a turn is a run of mask-1 tokens (:func:`turn_spans`).
        gamma: discount per turn.
        token_rewards: ``[B, R]`` per-token rewards (e.g. per-turn environment rewards), or None;
            turn ``k``'s reward adds the sum over its tokens.
    Returns:
        ``[B]`` float64 ``sum_k gamma^k r_k``; a row without model tokens gets its reward undiscounted.
    """
    out = torch.zeros(rewards.shape[0], dtype=torch.float64)
    for i in range(rewards.shape[0]):
        spans = turn_spans(response_mask[i])
        K = max(len(spans), 1)
        total = float(rewards[i]) * gamma ** (K - 1)
        if token_rewards is not None:
            for k, (s, e) in enumerate(spans):
                total += gamma ** k * float(token_rewards[i, s:e].sum())
        out[i] = total
    return out


def group_softmax_weights(returns: torch.Tensor, group_index: torch.Tensor, beta: float) -> torch.Tensor:
    """DRIFT's importance weights ``exp(R_i / beta) / mean_{j in g(i)} exp(R_j / beta)``.

    Args:
        returns: ``[B]`` returns.
        group_index: ``[B]`` prompt group ids.
        beta: KL temperature, > 0.
    Returns:
        ``[B]`` float64 weights, mean 1 within every group (a group of one gets 1).
    Raises:
        ValueError: ``beta <= 0``.
    """
    if beta <= 0:
        raise ValueError(f"drift: beta must be > 0, got {beta}")
    s = returns.double() / beta
    w = torch.zeros_like(s)
    for g in torch.unique(group_index):
        idx = group_index == g
        e = torch.exp(s[idx] - s[idx].max())
        w[idx] = e / e.mean()
    return w


@dataclass(frozen=True)
class DriftParams:
    """DRIFT's return weights (arXiv:2605.31455; authors' scripts/run_weight_sft.sh)."""

    beta: float = param(0.1, "KL temperature of the weights exp(R / beta) (authors: 0.1)")
    gamma: float = param(0.9, "discount per model turn of the return (authors: 0.9)")


@ADV_ESTIMATORS.register(
    "drift",
    paper="DRIFT: Decoupled Rollouts and Importance-Weighted Fine-Tuning for Efficient Multi-Turn Optimization "
          "(arXiv:2605.31455)",
    params=DriftParams,
    needs_group=True,
    needs_frozen_rollouts=True,
)
def drift_advantage(inp: AdvantageInput, *, beta: float, gamma: float) -> AdvantageOutput:
    """DRIFT's per-row importance weight on every loss token (the ``gpg`` loss then gives weighted SFT).

    ``A_{i,t} = w_i`` with ``w = group_softmax_weights(discounted_returns(...), group_index, beta)``.

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]``, token_rewards ``[B, R]`` or None.
    Returns:
        AdvantageOutput with ``advantages [B, R]`` (float32, 0 off the mask).
    Raises:
        ValueError: ``beta <= 0``.
    """
    R = discounted_returns(inp.rewards, inp.response_mask, gamma, inp.token_rewards)
    w = group_softmax_weights(R, inp.group_index, beta)
    return AdvantageOutput(advantages=(w[:, None] * inp.response_mask.double()).float(), returns=None)
