"""The predictive divergence mask: DPPO's trust region with a direction test that predicts the divergence's change.

"Predictive Divergence Masks for LLM RL" (arXiv:2607.10848). PPO-style masks ask two
things of a token: proximity (has the policy left the region around the anchor
``mu``?) and direction (does this token's update push it further out?). DPPO
("Rethinking the Trust Region in LLM Reinforcement Learning", arXiv:2602.04879)
replaced the proximity test by a divergence but kept the ratio's direction test
(``A > 0`` and ``pi > mu``, or ``A < 0`` and ``pi < mu``), a one-sample proxy that can
disagree in sign with the change of the divergence itself. The predictive mask masks
a token only when the next policy-gradient step on it is predicted to raise the same
divergence that defines the region.

Only the abstract could be read from here; the closed form and the two top-K
estimators below are derived in this library (the paper states that both exist,
not their formulas):

* Closed form. A softmax policy ``pi = softmax(z)`` over the vocabulary. A
  policy-gradient step on the sampled token ``a`` with advantage ``A`` moves the
  logits by ``dz = eta A (e_a - pi)`` (the gradient of ``A log pi_a``). For a
  divergence ``D(mu, pi)`` with logit gradient ``g = dD/dz`` the first-order change
  is ``dD = eta A (g_a - sum_v pi_v g_v)``, with

  - ``kl`` = ``KL(mu || pi) = sum mu log(mu / pi)``: ``g_v = pi_v - mu_v``;
  - ``tv`` = ``1/2 sum |pi - mu|``: ``g_v = 1/2 pi_v (s_v - sum_u s_u pi_u)``, ``s = sign(pi - mu)``.

  For DPPO's binary divergences (the sampled token against the rest) this sign is
  always ``sign(A) sign(pi_a - mu_a)``, the ratio's direction; it differs only for a
  divergence over more of the distribution, which is what this mask uses.

* Top-K estimators, for when only ``mu``'s top-K log-probs are known. The support is
  the sampled token (slot 0) plus ``K`` of ``mu``'s most likely other tokens; both
  policies are read there.

  - ``tail``: the support plus one "tail" category holding the rest of each
    policy's mass (``1 - sum``), as DPPO's Top-K divergence approximation;
  - ``renorm``: the support alone, each policy renormalised to sum 1 on it.

  ``full`` uses the whole vocabulary (exact; for tests and analysis).
"""

from __future__ import annotations

from typing import Tuple

import torch

_EPS = 1e-12


def support_distributions(
    pi_logprobs: torch.Tensor, mu_logprobs: torch.Tensor, estimator: str
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(p, q)`` ``[..., C]``: the current and anchor distributions on the estimator's categories.

    Args:
        pi_logprobs, mu_logprobs: ``[..., K]`` log-probs (full-vocabulary normalised) of
            the current policy and of the anchor on the same token support (slot 0: the
            sampled token); ``full``: the whole vocabulary.
        estimator: ``tail`` (``C = K + 1``: the support plus the remaining mass),
            ``renorm`` (``C = K``, renormalised) or ``full`` (``C = K``, as given).
    Raises:
        ValueError: an unknown estimator or mismatched shapes.
    """
    if pi_logprobs.shape != mu_logprobs.shape:
        raise ValueError(f"predictive mask: support shapes differ: {tuple(pi_logprobs.shape)} vs {tuple(mu_logprobs.shape)}")
    p, q = pi_logprobs.double().exp(), mu_logprobs.double().exp()
    if estimator == "full":
        return p, q
    if estimator == "renorm":
        return p / p.sum(-1, keepdim=True).clamp(min=_EPS), q / q.sum(-1, keepdim=True).clamp(min=_EPS)
    if estimator == "tail":
        pt = (1.0 - p.sum(-1, keepdim=True)).clamp(min=0.0)
        qt = (1.0 - q.sum(-1, keepdim=True)).clamp(min=0.0)
        return torch.cat([p, pt], -1), torch.cat([q, qt], -1)
    raise ValueError(f"predictive mask: topk_estimator={estimator!r}: valid choices are tail, renorm, full")


def divergence(p: torch.Tensor, q: torch.Tensor, kind: str) -> torch.Tensor:
    """``[...]`` ``KL(q || p)`` (``kl``) or ``1/2 sum |p - q|`` (``tv``) over the last axis (q = anchor, p = current).

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind == "kl":
        return torch.where(q > 0, q * (torch.log(q.clamp(min=_EPS)) - torch.log(p.clamp(min=_EPS))),
                           torch.zeros_like(q)).sum(-1)
    if kind == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    raise ValueError(f"predictive mask: divergence={kind!r}: valid choices are tv, kl")


def predicted_change(p: torch.Tensor, q: torch.Tensor, advantages: torch.Tensor, kind: str) -> torch.Tensor:
    """``[...]`` first-order change of ``D(q, p)`` per unit step size when a PG step on category 0 (the sampled
    token) with advantage ``A`` moves the logits by ``A (e_0 - p)``: ``A (g_0 - sum_c p_c g_c)``.

    Args:
        p, q: ``[..., C]`` current and anchor distributions (:func:`support_distributions`).
        advantages: ``[...]``.
        kind: ``kl`` or ``tv`` (module docstring for ``g``).
    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind == "kl":
        g = p - q
    elif kind == "tv":
        s = torch.sign(p - q)
        g = 0.5 * p * (s - (s * p).sum(-1, keepdim=True))
    else:
        raise ValueError(f"predictive mask: divergence={kind!r}: valid choices are tv, kl")
    return advantages.double() * (g[..., 0] - (p * g).sum(-1))


def predictive_out_of_region(
    pi_logprobs: torch.Tensor,
    mu_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    kind: str,
    estimator: str,
    eps_low: float,
    eps_high: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out [B, R] bool, D [B, R], dD [B, R])``: tokens past the region (``D > eps``) whose step would raise ``D``.

    ``eps_high`` is the threshold of ``A > 0`` tokens and ``eps_low`` of ``A <= 0`` ones
    (DPPO's split). A token with ``A = 0`` gets no gradient either way.

    Args:
        pi_logprobs, mu_logprobs: ``[B, R, K]`` support log-probs (slot 0 = sampled token).
        advantages: ``[B, R]``.
    """
    p, q = support_distributions(pi_logprobs, mu_logprobs, estimator)
    D = divergence(p, q, kind)
    dD = predicted_change(p, q, advantages, kind)
    eps = torch.where(advantages > 0, torch.full_like(D, eps_high), torch.full_like(D, eps_low))
    return (D > eps) & (dD > 0), D, dD


def anchor_support(
    sampled_ids: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, sampled_logprobs: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(ids, logprobs)`` ``[B, R, K]``: the sampled token in slot 0, then the anchor's top tokens other than it.

    The sampled token leaves the top-K list where it is in it, else the K-th token
    does, so the support always has ``K`` distinct tokens with the sampled one first.

    Args:
        sampled_ids: ``[B, R]`` long.
        topk_ids, topk_logprobs: ``[B, R, K]`` the anchor's ``K`` most likely tokens and
            their log-probs (descending).
        sampled_logprobs: ``[B, R]`` the anchor's log-prob of the sampled token.
    Returns:
        ids ``[B, R, K]`` long and the anchor's log-probs there ``[B, R, K]``.
    """
    K = topk_ids.shape[-1]
    is_sampled = topk_ids == sampled_ids[..., None]
    last = torch.nn.functional.one_hot(torch.full_like(sampled_ids, K - 1), K).bool()
    drop = torch.where(is_sampled.any(-1, keepdim=True), is_sampled, last)
    rest_ids = topk_ids[~drop].view(*topk_ids.shape[:-1], K - 1)
    rest_lp = topk_logprobs[~drop].view(*topk_ids.shape[:-1], K - 1)
    ids = torch.cat([sampled_ids[..., None].to(rest_ids.dtype), rest_ids], -1)
    lps = torch.cat([sampled_logprobs[..., None].to(rest_lp.dtype), rest_lp], -1)
    return ids, lps
