"""KL estimators, entropy and the critic's value loss.

KL estimators follow John Schulman's note "Approximating KL Divergence" (2020) as
used by GRPO (arXiv:2402.03300): with ``log_r = ref_logprobs - logprobs`` on
tokens sampled from the current policy,

* ``k1 = -log_r``            (unbiased, high variance, can be negative)
* ``k2 = 0.5 * log_r ** 2``   (biased, low variance)
* ``k3 = exp(log_r) - 1 - log_r`` (unbiased, low variance, always >= 0)

All take and return ``[B, R]`` tensors in nats.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from rlpost.algos.registries import KL_ESTIMATORS
from rlpost.algos.utils import masked_mean


@KL_ESTIMATORS.register("k1", paper="Schulman, Approximating KL Divergence (2020, joschu.net/blog/kl-approx.html)")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``log pi - log pi_ref`` per token."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2", paper="Schulman, Approximating KL Divergence (2020, joschu.net/blog/kl-approx.html)")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``0.5 * (log pi - log pi_ref)^2`` per token."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3", paper="Schulman (2020); GRPO (arXiv:2402.03300)")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, clamp: float = 20.0,
          value_clamp: Optional[float] = None) -> torch.Tensor:
    """``exp(log_r) - 1 - log_r`` with ``log_r = log pi_ref - log pi`` (clamped to +-``clamp``), ``[B, R]``.

    The estimate itself is not clamped by default (``value_clamp=None``), as TRL's and oat's k3;
    verl's ``low_var_kl`` clamps it to ``[-10, 10]``: ``value_clamp=10`` reproduces that
    (verl ``core_algos.py`` ``kl_penalty``). Schulman, "Approximating KL Divergence" (2020); GRPO
    (arXiv:2402.03300).

    Raises:
        ValueError: ``value_clamp <= 0``.
    """
    log_r = (ref_logprobs - logprobs).clamp(-clamp, clamp)
    k3 = torch.exp(log_r) - 1.0 - log_r
    if value_clamp is not None:
        if float(value_clamp) <= 0:
            raise ValueError(f"k3 value_clamp must be > 0 (verl: 10), got {value_clamp}")
        k3 = k3.clamp(-float(value_clamp), float(value_clamp))
    return k3


@KL_ESTIMATORS.register("k3_clamped", paper="verl's low_var_kl: k3 clamped to [-10, 10] (Schulman 2020; GRPO arXiv:2402.03300)")
def kl_k3_clamped(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """:func:`kl_k3` with the estimate clamped to ``[-10, 10]`` per token ``[B, R]``, as verl's ``low_var_kl``
    (``algo.kl.estimator=k3_clamped``; plain ``k3`` follows TRL and oat and is not clamped)."""
    return kl_k3(logprobs, ref_logprobs, value_clamp=10.0)


def kl_penalty(estimator: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL estimate ``[B, R]`` with the registered ``estimator``.

    Raises:
        ConfigError: unknown estimator.
    """
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: Optional[float] = 0.2,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Clipped value loss of PPO (arXiv:1707.06347, as in OpenAI baselines).

    ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``, token-mean over
    the mask. Without ``clip_range`` it is the plain squared error.

    Args:
        values: ``[B, R]`` current critic outputs (with grad).
        old_values: ``[B, R]`` critic outputs at rollout time.
        returns: ``[B, R]`` targets.
        mask: ``[B, R]``.
    Returns:
        ``(per-token loss [B, R], metrics)``; metrics ``vf_clip_frac``,
        ``vf_explained_var``.
    """
    err = (values - returns) ** 2
    if clip_range is not None:
        v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
        err_clip = (v_clip - returns) ** 2
        loss = 0.5 * torch.maximum(err, err_clip)
        with torch.no_grad():
            frac = masked_mean((err_clip > err).float(), mask)
    else:
        loss = 0.5 * err
        frac = torch.tensor(0.0)
    with torch.no_grad():
        var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
        var_e = masked_mean((returns - values - masked_mean(returns - values, mask)) ** 2, mask)
        ev = 1.0 - var_e / var_r.clamp(min=1e-8)
    return loss, {"vf_clip_frac": frac, "vf_explained_var": ev}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of the softmax of ``logits`` ``[..., V]`` -> ``[...]``.

    Computed as ``logsumexp(z) - sum softmax(z) z`` in float32.
    """
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    return lse - (p * z).sum(-1)


def kl_reward_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, coef: float, estimator: str = "k1"
) -> torch.Tensor:
    """Per-token rewards ``-coef * KL_t`` for KL-in-reward (InstructGPT arXiv:2203.02155; REINFORCE++).

    Pass the result as ``AdvantageInput.token_rewards`` to an estimator tagged
    ``uses_token_rewards`` (gae, sao, reinforce_pp, reinforce_pp_baseline, remax).

    Args:
        logprobs: ``[B, R]`` log-probs of the sampled tokens under the rollout-time
            policy (no grad needed), ref_logprobs: under the reference policy.
        mask: ``[B, R]``.
        coef: KL coefficient beta (>= 0).
        estimator: k1 | k2 | k3.
    Returns:
        ``[B, R]`` detached token rewards, 0 outside the mask.
    """
    with torch.no_grad():
        return -coef * kl_penalty(estimator, logprobs.detach(), ref_logprobs.detach()) * mask


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-token entropy-bonus loss ``-coef * H_t`` ``[B, R]`` (0 outside ``mask``).

    ``entropy`` must carry gradient for the bonus to act (the trainer's entropy
    of the current policy); aggregate it with the same mode as the policy loss.
    Entropy regularisation as in A3C (arXiv:1602.01783).
    """
    return -coef * entropy * mask
