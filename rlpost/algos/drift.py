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

- the repeat penalty (``compute_trajectory_penalty``): ``P = lambda (1 - D / N)`` with ``N`` the
  entries of the episode's answer list and ``D`` its distinct non-empty entries (0 when ``N = 0``),
  subtracted from the return undiscounted, ``R = sum_k gamma^k r_k - P``, for every row
  (successful or not), before the weights. In the authors' released data script
  (``src/generate_weighted_data_vllm_metamathqa.py``) the list holds one normalised answer per turn
  whose response parsed into an answer (a turn without one adds nothing to it); here the episode
  sampler applies the task's ``extract_answer`` to each model turn's text and counts those turns
  (``extras['episode_answer_turns']``) and their distinct answers after the authors'
  ``normalize_answer`` (lower case, whitespace removed; ``extras['episode_distinct_answers']``,
  :class:`rlpost.samplers.episode.EpisodeSampler`). A single-turn row always gets 0 (one answer is
  one distinct answer). ``lambda = 0.5`` is their ``TRAJECTORY_PENALTY_LAMBDA``.

Defaults ``beta = 0.1`` and ``gamma = 0.9`` are the authors' ``scripts/run_weight_sft.sh``; their
script's argparse defaults (0.2, 0.7) differ. Not built: the data script's format penalty (``-0.1``
per turn whose response holds no ``<answer>`` block, added to R): in rlpost's tool episodes a turn
without an answer is a tool call, which that penalty would punish.
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


#: the episode sampler's per-row counts the repeat penalty reads
ANSWER_TURNS_KEY = "episode_answer_turns"
DISTINCT_ANSWERS_KEY = "episode_distinct_answers"


def repeat_penalty_of(answer_turns: torch.Tensor, distinct_answers: torch.Tensor, coef: float) -> torch.Tensor:
    """DRIFT's repeat penalty ``coef (1 - D / N)`` per row (arXiv:2605.31455; authors' ``compute_trajectory_penalty``).

    Args:
        answer_turns: ``[B]`` N, the turns whose text gave an answer.
        distinct_answers: ``[B]`` D <= N, the distinct non-empty answers among them.
        coef: lambda (authors: 0.5).
    Returns:
        ``[B]`` float64, 0 where ``N = 0``, clamped at 0 from below (as the authors' ``max(0, .)``).
    Raises:
        ValueError: a row with ``D > N`` or a negative count.
    """
    n, d = answer_turns.double(), distinct_answers.double()
    if bool((d > n).any()) or bool((n < 0).any()) or bool((d < 0).any()):
        raise ValueError("drift: repeat penalty needs 0 <= distinct answers <= answering turns on every row")
    p = coef * (1.0 - d / n.clamp(min=1.0))
    return torch.where(n > 0, p.clamp(min=0.0), torch.zeros_like(p))


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
    repeat_penalty: float = param(0.5, "lambda of the repeat penalty lambda (1 - distinct answers / answering turns) "
                                       "subtracted from the return, 0 off (authors: 0.5)")

    def __post_init__(self) -> None:
        if not float(self.beta) > 0:
            raise ValueError(f"drift: beta must be > 0, got {self.beta}")
        if not 0.0 <= float(self.gamma) <= 1.0:
            raise ValueError(f"drift: gamma must be in [0, 1], got {self.gamma}")
        if float(self.repeat_penalty) < 0:
            raise ValueError(f"drift: repeat_penalty must be >= 0, got {self.repeat_penalty}")


@ADV_ESTIMATORS.register(
    "drift",
    paper="DRIFT: Decoupled Rollouts and Importance-Weighted Fine-Tuning for Efficient Multi-Turn Optimization "
          "(arXiv:2605.31455)",
    params=DriftParams,
    needs_group=True,
    needs_frozen_rollouts=True,
    no_baseline=True,
    zero_variance="an importance weight exp(R / beta) / group mean, not a baseline: equal returns weigh 1 each",
)
def drift_advantage(inp: AdvantageInput, *, beta: float, gamma: float, repeat_penalty: float) -> AdvantageOutput:
    """DRIFT's per-row importance weight on every loss token (the ``gpg`` loss then gives weighted SFT).

    ``A_{i,t} = w_i`` with ``w = group_softmax_weights(discounted_returns(...) - P, group_index, beta)``,
    ``P`` the repeat penalty (:func:`repeat_penalty`) of ``extras['episode_answer_turns']`` and
    ``extras['episode_distinct_answers']`` (absent: 0, which is every single-turn row's value).

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]``, token_rewards ``[B, R]`` or None,
            extras (the two counts, ``[B]``).
        repeat_penalty: its lambda (0: no penalty).
    Returns:
        AdvantageOutput with ``advantages [B, R]`` (float32, 0 off the mask).
    Raises:
        ValueError: ``beta <= 0``; ``repeat_penalty > 0`` on rows of several model turns without the counts
            (a sampler that does not record per-turn answers: use ``sampler=episode`` with a task).
    """
    R = discounted_returns(inp.rewards, inp.response_mask, gamma, inp.token_rewards)
    ex = inp.extras or {}
    if ANSWER_TURNS_KEY in ex and DISTINCT_ANSWERS_KEY in ex:
        P = repeat_penalty_of(ex[ANSWER_TURNS_KEY], ex[DISTINCT_ANSWERS_KEY], repeat_penalty)
    else:
        if repeat_penalty and any(len(turn_spans(m)) > 1 for m in inp.response_mask):
            raise ValueError("drift: rows of several model turns but no per-turn answer counts "
                             f"(extras '{ANSWER_TURNS_KEY}', '{DISTINCT_ANSWERS_KEY}') for the repeat penalty; "
                             "the episode sampler records them when a task is attached (or set "
                             "algo.adv_params.repeat_penalty=0)")
        P = torch.zeros(R.shape[0], dtype=torch.float64)
    R = R - P
    w = group_softmax_weights(R, inp.group_index, beta)
    return AdvantageOutput(advantages=(w[:, None] * inp.response_mask.double()).float(), returns=None)
