"""Advantage estimators: rewards (and values) -> per-token advantages.

Calling convention: ``fn(inp: AdvantageInput, **params) -> AdvantageOutput``. Every
estimator returns ``[B, R]`` advantages that are 0 outside ``response_mask``.
Estimators are pure: no model, no config object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.utils import group_stats, masked_whiten


@dataclass
class AdvantageInput:
    """Inputs every estimator may read.

    Attributes:
        rewards: ``[B]`` scalar outcome reward per sequence.
        response_mask: ``[B, R]`` 0/1 float mask of loss-carrying tokens.
        group_index: ``[B]`` long; equal ids = same prompt in this step.
        values: ``[B, R]`` critic estimates V(s_t) before emitting token t, or None.
        token_rewards: ``[B, R]`` per-token rewards added to the outcome reward
            (e.g. a KL-in-reward penalty), or None.
        entropy: ``[B, R]`` per-token policy entropy in nats, or None.
        baseline_rewards: ``[B]`` reward of a baseline rollout (ReMax), or None.
    """

    rewards: torch.Tensor
    response_mask: torch.Tensor
    group_index: torch.Tensor
    values: Optional[torch.Tensor] = None
    token_rewards: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    baseline_rewards: Optional[torch.Tensor] = None


@dataclass
class AdvantageOutput:
    """Estimator output.

    Attributes:
        advantages: ``[B, R]`` per-token advantages, 0 outside the mask.
        returns: ``[B, R]`` value targets for a critic, or None for critic-free
            estimators.
    """

    advantages: torch.Tensor
    returns: Optional[torch.Tensor] = None


def outcome_token_rewards(inp: AdvantageInput) -> torch.Tensor:
    """``[B, R]`` rewards with the outcome reward on each sequence's last response token.

    ``inp.token_rewards`` (if any) is added on every token.
    """
    mask = inp.response_mask
    B, R = mask.shape
    lengths = mask.sum(-1).long()
    last = (lengths - 1).clamp(min=0)
    tr = torch.zeros(B, R, dtype=torch.float32)
    has = lengths > 0
    tr[torch.arange(B)[has], last[has]] = inp.rewards.float()[has]
    if inp.token_rewards is not None:
        tr = tr + inp.token_rewards.float() * mask
    return tr


@ADV_ESTIMATORS.register(
    "grpo",
    paper="DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models (arXiv:2402.03300)",
)
def grpo_advantage(inp: AdvantageInput, norm_by_std: bool = True, eps: float = 1e-6, **_: object) -> AdvantageOutput:
    """Group-relative outcome advantage: ``A_i = (r_i - mean_g) / (std_g + eps)``.

    The same advantage is broadcast to every response token of sequence ``i``.
    ``std_g`` is the unbiased (Bessel-corrected) standard deviation of the group's
    rewards, as in the GRPO reference implementations. With ``norm_by_std=False``
    it is Dr. GRPO's ``r_i - mean_g`` (arXiv:2503.20783).

    A group whose rewards are all equal (zero variance) gets advantage exactly 0,
    never NaN; a group of size 1 likewise gets 0.

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]``.
        norm_by_std: divide by the group std.
        eps: added to the std.
    Returns:
        AdvantageOutput with ``advantages [B, R]`` and ``returns=None``.
    """
    r = inp.rewards.float()
    mean, std, _ = group_stats(r, inp.group_index)
    adv = r - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(std > 0, adv, torch.zeros_like(adv)) if norm_by_std else adv
    return AdvantageOutput(advantages=adv[:, None] * inp.response_mask, returns=None)


def discounted_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
):
    """Generalised advantage estimation over right-padded sequences.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V`` after the last response
    token taken as 0 (episode ends); ``A_t = delta_t + gamma * lam * A_{t+1}``;
    ``returns = A + V``. Positions outside ``mask`` get 0.

    Args:
        token_rewards, values, mask: ``[B, R]``.
        gamma: discount, lam: GAE lambda.
    Returns:
        ``(advantages [B, R], returns [B, R])``, float32.
    """
    B, R = mask.shape
    mask = mask.float()
    values = values.float() * mask
    adv = torch.zeros(B, R)
    last = torch.zeros(B)
    next_v = torch.zeros(B)
    for t in range(R - 1, -1, -1):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_v - values[:, t]
        last = delta + gamma * lam * last
        last = last * m
        adv[:, t] = last
        # Carry V_{t+1} only across real tokens: padding resets the bootstrap.
        next_v = values[:, t] * m
    returns = (adv + values) * mask
    return adv * mask, returns


@ADV_ESTIMATORS.register(
    "gae",
    paper="High-Dimensional Continuous Control Using Generalized Advantage Estimation (arXiv:1506.02438); "
    "PPO for LLMs as in InstructGPT (arXiv:2203.02155)",
    needs_critic=True,
)
def gae_advantage(
    inp: AdvantageInput, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True, **_: object
) -> AdvantageOutput:
    """PPO's token-level advantage from a critic with GAE(gamma, lambda).

    The outcome reward sits on the last response token (plus any
    ``token_rewards``, e.g. KL-in-reward). Advantages are whitened over the batch
    when ``whiten`` (standard PPO practice); returns are computed before whitening.

    Raises:
        ValueError: if ``inp.values`` is None (GAE needs a critic).
    """
    if inp.values is None:
        raise ValueError("GAE needs critic values (inp.values); use a critic or a critic-free estimator")
    tr = outcome_token_rewards(inp)
    adv, ret = discounted_gae(tr, inp.values, inp.response_mask, gamma, lam)
    if whiten:
        adv = masked_whiten(adv, inp.response_mask)
    return AdvantageOutput(advantages=adv, returns=ret)


@ADV_ESTIMATORS.register(
    "sao",
    paper="SAO: Single-rollout Asynchronous Optimization (seed abstract 1; GLM agentic RL)",
    needs_critic=True,
)
def sao_advantage(
    inp: AdvantageInput,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = False,
    **_: object,
) -> AdvantageOutput:
    """Single-rollout advantage with a learned value model as baseline (SAO).

    With one rollout per prompt there is no group to take a baseline from; SAO
    uses a trained value model instead. The abstract does not give the estimator;
    our choice (documented): GAE with ``gamma=1, lam=1`` by default, which reduces
    to ``A_t = R - V(s_t)`` (Monte-Carlo return minus the value of each prefix),
    the lowest-bias choice for a sparse outcome reward. ``whiten`` is off by
    default so the sign of ``A`` keeps its meaning (better/worse than predicted).

    Raises:
        ValueError: if ``inp.values`` is None.
    """
    if inp.values is None:
        raise ValueError("SAO needs a value model (inp.values); set algo.critic.enabled=true")
    tr = outcome_token_rewards(inp)
    adv, ret = discounted_gae(tr, inp.values, inp.response_mask, gamma, lam)
    if whiten:
        adv = masked_whiten(adv, inp.response_mask)
    return AdvantageOutput(advantages=adv, returns=ret)


def compute_advantages(name: str, inp: AdvantageInput, **params: object) -> AdvantageOutput:
    """Run the registered estimator ``name`` on ``inp`` with its ``params``.

    Raises:
        ConfigError: unknown estimator name.
    """
    return ADV_ESTIMATORS.get(name)(inp, **params)
