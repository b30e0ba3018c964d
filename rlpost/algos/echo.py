"""ECHO's token statistics, its confidence-adaptive clip and its entropy-confidence advantage shaping.

"ECHO: Entropy-Confidence Hybrid Optimization for Test-Time Reinforcement Learning" (Zhao, Yang,
Liu, Zhao, Guo; arXiv:2602.02150; code https://github.com/user683/ECHO, a verl fork). Test-time RL:
the rewards are TTRL's majority-vote pseudo-labels (``task.reward.majority_vote=true``), the
rollouts a tree (``sampler=echo``, :mod:`rlpost.samplers.echo`), the update GRPO with two changes
(``algo=echo``: this file's estimator ``echo`` and loss ``echo``).

Token statistics (paper Sec. 3; the release's ``dp_actor._compute_topk_confidence``). At response
position ``t`` with next-token distribution ``P_t`` (the policy's softmax at the sampling
temperature):

    H_t = -sum_j P_t(j) log P_t(j)                       token entropy (nats)
    C_t = (1/k) sum_{v in top-k(P_t)} P_t(v)             token confidence (mean top-k probability, k = 5)
    C^G_t = mean(C_{t-W_G+1..t})                          grouped confidence (the window shrinks at the start)
    C_tail = mean of C over a response's last W_T tokens  tail confidence (one number per response)

Update (the release's ``core_algos.apply_hybrid_advantage_shaping``; followed where it is more
precise than the text):

    A_i   = (r_i - mean_g r) / (std_g r + 1e-6)                            GRPO on the pseudo-labels
    S_t   = clip(alpha z(H)_t + beta z(1 - C)_t, -s_max, s_max)            z: whitened over the batch's response tokens
    A_i,t = A_i (1 + a S_t) + lambda (S_t - mean_{group of i} S)           a = mult_coeff 0.1, lambda = add_coeff 0
    eps_i = eps_min + (eps_max - eps_min) sigmoid(kappa (1 - C_tail,i))   per response, both sides of the clip

``z`` is the batch-wide masked whitening ``(x - mean) / sqrt(var + 1e-8)`` (unbiased variance), as
the release's ``masked_whiten`` over the whole step's response tokens; the group mean of the
additive term is over the group's response tokens. With ``kappa = 4`` and ``C in [0, 1]`` the clip
range lies in ``[eps_min + 0.5 (eps_max - eps_min), eps_min + 0.982 (eps_max - eps_min)]``: a less
confident tail widens it. The loss is verl's vanilla PPO clip with that per-response range and
verl's dual clip ``c = 3`` on negative advantages (the release's default ``clip_ratio_c``).

``H`` and ``C`` come from the pre-update policy's pass over the sampled responses
(:mod:`rlpost.methods.echo`: ``extras['echo_entropy']``, ``extras['echo_confidence']``), as the
release computes them with the old log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, grpo_advantage
from rlpost.algos.losses import EXTRA_INPUTS, PolicyLossInput, _clip_metrics, _ppo_core, _ratio
from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
from rlpost.algos.utils import masked_mean, masked_whiten
from rlpost.core.registry import param

PAPER = ("ECHO: Entropy-Confidence Hybrid Optimization for Test-Time Reinforcement Learning (arXiv:2602.02150); "
         "code https://github.com/user683/ECHO")

ENTROPY_KEY = "echo_entropy"
CONFIDENCE_KEY = "echo_confidence"
EXTRA_INPUTS.setdefault(CONFIDENCE_KEY, "[B, R] the pre-update policy's token confidence C_t (mean probability of "
                        "its top-k next tokens, ECHO), no grad; written by methods/echo.py")

Metrics = dict


# ---------------------------------------------------------------- token statistics


def token_entropy_from_probs(probs: torch.Tensor) -> torch.Tensor:
    """``H = -sum_j p_j log p_j`` (nats) over the last dim: ``[..., V]`` probabilities -> ``[...]``. ``0 log 0 = 0``."""
    p = probs.double()
    return -(torch.where(p > 0, p * torch.log(p.clamp(min=1e-300)), torch.zeros_like(p))).sum(-1)


def token_confidence(probs: torch.Tensor, k: int) -> torch.Tensor:
    """ECHO's token confidence ``C = (1/k) sum of the k largest probabilities``: ``[..., V]`` -> ``[...]``.

    ``k`` is capped at ``V``. Raises ValueError for ``k < 1``.
    """
    if int(k) < 1:
        raise ValueError(f"echo: confidence top-k must be >= 1, got {k}")
    kk = min(int(k), probs.shape[-1])
    return torch.topk(probs.double(), kk, dim=-1).values.mean(-1)


def confidence_from_top_logprobs(top_logprobs: torch.Tensor) -> torch.Tensor:
    """``C`` from the top-k log-probs of each position: ``[..., k]`` (nats) -> ``[...]`` mean of their probabilities."""
    return top_logprobs.double().exp().mean(-1)


def grouped_confidence(conf: torch.Tensor, window: int) -> torch.Tensor:
    """Grouped confidence ``C^G_t = mean(C_{max(0, t-W+1)}..C_t)`` of one response: ``[T]`` -> ``[T]``.

    The trailing window holds ``min(W, t + 1)`` tokens (the release's slice). Raises ValueError for ``W < 1``.
    """
    if int(window) < 1:
        raise ValueError(f"echo: group_window must be >= 1, got {window}")
    c = conf.double().reshape(-1)
    cs = torch.cat([c.new_zeros(1), torch.cumsum(c, 0)])
    t = torch.arange(c.numel())
    lo = (t - int(window) + 1).clamp(min=0)
    return (cs[t + 1] - cs[lo]) / (t + 1 - lo).double()


def entropy_delta(entropy: torch.Tensor, window: int) -> torch.Tensor:
    """``dH_t = H_t - mean(H_{max(0, t-W)}..H_{t-1})`` of one response (``dH_0 = 0``): ``[T]`` -> ``[T]``.

    The release's ``delta_entropy``: the entropy's rise over the mean of the ``W`` tokens before it.
    Raises ValueError for ``W < 1``.
    """
    if int(window) < 1:
        raise ValueError(f"echo: entropy_window must be >= 1, got {window}")
    h = entropy.double().reshape(-1)
    out = torch.zeros_like(h)
    for t in range(1, h.numel()):
        out[t] = h[t] - h[max(0, t - int(window)):t].mean()
    return out


def tail_confidence(conf: torch.Tensor, mask: torch.Tensor, window: int) -> torch.Tensor:
    """``C_tail`` per response: mean ``C`` over its last ``min(W, length)`` tokens, clamped to ``[0, 1]``.

    Shapes ``conf``, ``mask`` ``[B, R]`` (right-padded, ``mask`` 1 on the response's tokens) -> ``[B]``;
    0 for an empty response. ``W <= 0`` takes the whole response (the release's rule).
    """
    B, R = conf.shape
    lengths = (mask > 0).sum(-1)
    W = R if int(window) <= 0 else int(window)
    pos = torch.arange(R, device=conf.device).unsqueeze(0)
    tail = ((pos < lengths.unsqueeze(1)) & (pos >= (lengths - W).clamp(min=0).unsqueeze(1))).to(conf.dtype)
    val = (conf * tail).sum(-1) / tail.sum(-1).clamp(min=1.0)
    return val.clamp(0.0, 1.0)


def branch_width(entropy: float, group_conf: float, *, entropy_low: float, entropy_high: float,
                 branch_threshold: float, alpha: float, beta: float, min_branches: int, max_branches: int) -> int:
    """ECHO's branch width at a fork (the release's ``_compute_branch_width``).

    ``b = clip(round(b_min + alpha (H - H_low) / (H_high - H_low) - beta (C^G - tau) / |tau|), b_min, b_max)``:
    wider where the entropy is high, narrower where the grouped confidence is above the
    threshold ``tau``. Denominators are floored at 1e-9; ``round`` is round-half-to-even (numpy's).
    """
    span = max(float(entropy_high) - float(entropy_low), 1e-9)
    raw = (float(min_branches) + float(alpha) * (float(entropy) - float(entropy_low)) / span
           - float(beta) * (float(group_conf) - float(branch_threshold)) / max(abs(float(branch_threshold)), 1e-9))
    return int(min(max(round(raw), int(min_branches)), int(max_branches)))


def adaptive_clip(tail_conf: torch.Tensor, eps_min: float, eps_max: float, kappa: float) -> torch.Tensor:
    """ECHO's confidence-adaptive clip range ``eps = eps_min + (eps_max - eps_min) sigmoid(kappa (1 - C_tail))``, shape of ``tail_conf``."""
    return eps_min + (eps_max - eps_min) * torch.sigmoid(kappa * (1.0 - tail_conf))


def hybrid_score(entropy: torch.Tensor, confidence: torch.Tensor, mask: torch.Tensor, *, alpha: float,
                 beta: float, s_max: Optional[float]) -> torch.Tensor:
    """``S_t = clip(alpha z(H)_t + beta z(1 - C)_t, -s_max, s_max)``, ``[B, R]``, 0 outside ``mask``.

    ``z`` whitens over every masked token of the batch (:func:`rlpost.algos.utils.masked_whiten`);
    ``C`` is clamped to ``[0, 1]`` first. ``s_max`` None: no clip.
    """
    m = mask.double()
    zh = masked_whiten(entropy.double(), m)
    zc = masked_whiten(1.0 - confidence.double().clamp(0.0, 1.0), m)
    S = alpha * zh + beta * zc
    if s_max is not None:
        S = S.clamp(-float(s_max), float(s_max))
    return S * m


def shape_advantages(adv: torch.Tensor, S: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor, *,
                     mult_coeff: float, add_coeff: float) -> torch.Tensor:
    """``A (1 + a S) + lambda (S - group token-mean of S)``, ``[B, R]``, 0 outside ``mask``.

    ``adv``, ``S``, ``mask`` ``[B, R]``; ``group_index`` ``[B]``. The group mean is over the
    group's masked tokens (the release's ``_broadcast_group_mean``).
    """
    A = adv.double()
    m = mask.double()
    if mult_coeff != 0:
        A = A * (1.0 + mult_coeff * S.double())
    if add_coeff != 0:
        gm = torch.zeros(adv.shape[0], dtype=torch.float64, device=adv.device)
        for g in torch.unique(group_index):
            rows = group_index == g
            gm[rows] = masked_mean(S.double()[rows], m[rows])
        A = A + add_coeff * (S.double() - gm.unsqueeze(1))
    return A * m


# ---------------------------------------------------------------- estimator


@dataclass(frozen=True)
class EchoAdvParams:
    """ECHO's hybrid advantage shaping (the release's ``algorithm.hybrid_adv`` defaults)."""

    alpha: float = param(1.0, "weight of the entropy z-score in S_t (release: 1.0)")
    beta: float = param(1.0, "weight of the inverse-confidence z-score z(1 - C) in S_t (release: 1.0)")
    s_max: Optional[float] = param(2.0, "S_t is clipped to [-s_max, s_max] (release: 2.0), or null")
    mult_coeff: float = param(0.1, "a of the multiplicative shaping A (1 + a S_t) (release: 0.1)")
    add_coeff: float = param(0.0, "lambda of the additive shaping lambda (S_t - group mean S) (release: 0.0)")
    confidence_top_k: int = param(5, "k of the token confidence C_t = mean top-k probability (release: 5)")
    eps: float = param(1e-6, "GRPO's std floor (verl's 1e-6)")


def _stats(inp: AdvantageInput) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(H, C)`` ``[B, R]``: the ECHO pass's extras, else stand-ins (see :func:`echo_advantage`)."""
    ex = inp.extras or {}
    m = inp.response_mask
    H = ex.get(ENTROPY_KEY)
    if H is None:
        H = inp.entropy if inp.entropy is not None else torch.zeros_like(m)
    C = ex.get(CONFIDENCE_KEY)
    if C is None:
        lp = inp.old_logprobs if inp.old_logprobs is not None else inp.rollout_logprobs
        C = lp.detach().float().exp() * m if lp is not None else torch.zeros_like(m)
    R = m.shape[1]
    return H[:, :R].to(m.device), C[:, :R].to(m.device)


@ADV_ESTIMATORS.register("echo", paper=PAPER, params=EchoAdvParams, needs_group=True)
def echo_advantage(inp: AdvantageInput, *, alpha: float, beta: float, s_max: Optional[float], mult_coeff: float,
                   add_coeff: float, confidence_top_k: int, eps: float) -> AdvantageOutput:
    """GRPO on the (majority-vote) rewards, reshaped per token by ECHO's entropy-confidence score.

    Reads ``rewards`` ``[B]``, ``group_index`` ``[B]``, ``response_mask`` ``[B, R]`` and
    ``extras['echo_entropy']`` / ``extras['echo_confidence']`` ``[B, R]`` (the pre-update
    policy's ``H_t`` in nats and ``C_t``; ``confidence_top_k`` is the ``k`` that pass uses).
    Returns ``advantages`` ``[B, R]`` (see the module docstring), no returns. Without the extras
    (called outside a run with ``adv_estimator=echo``) ``inp.entropy`` (else 0) and the sampled
    token's ``exp(old_logprobs)`` (the release's fused-kernel stand-in; else 0) are used.

    Raises:
        ValueError: ``s_max <= 0``, ``confidence_top_k < 1``.
    """
    if s_max is not None and not s_max > 0:
        raise ValueError(f"echo: s_max must be > 0 (or null), got {s_max}")
    if int(confidence_top_k) < 1:
        raise ValueError(f"echo: confidence_top_k must be >= 1, got {confidence_top_k}")
    H, C = _stats(inp)
    m = inp.response_mask
    base = grpo_advantage(inp, norm_by_std=True, eps=eps, baseline="mean", unbiased_std=True, std_scope="group")
    S = hybrid_score(H, C, m, alpha=alpha, beta=beta, s_max=s_max)
    A = shape_advantages(base.advantages, S, m, inp.group_index, mult_coeff=mult_coeff, add_coeff=add_coeff)
    return AdvantageOutput(advantages=A.to(base.advantages.dtype))


# ---------------------------------------------------------------- loss


@dataclass(frozen=True)
class EchoLossParams:
    """ECHO's confidence-adaptive clip (the release's ``hybrid_adv`` eps_min / eps_max / kappa / tail_window)."""

    eps_min: float = param(0.05, "smallest clip range (release: 0.05)")
    eps_max: float = param(0.2, "largest clip range (release: 0.2)")
    kappa: float = param(4.0, "slope of the sigmoid in 1 - C_tail (release: 4.0)")
    tail_window: int = param(16, "W_T: the last W_T response tokens give C_tail (release: 16; <= 0: the whole response)")
    dual_clip: Optional[float] = param(3.0, "dual clip c on A < 0 tokens (verl's clip_ratio_c 3.0, on in the release's loss), or null")


@POLICY_LOSSES.register("echo", paper=PAPER, params=EchoLossParams, extras=(CONFIDENCE_KEY,),
                       optional_extras=(CONFIDENCE_KEY,))
def echo_loss(inp: PolicyLossInput, *, eps_min: float, eps_max: float, kappa: float, tail_window: int,
              dual_clip: Optional[float]) -> Tuple[torch.Tensor, Metrics]:
    """PPO clip with ECHO's per-response clip range ``eps_i`` from its tail confidence.

    ``eps_i = eps_min + (eps_max - eps_min) sigmoid(kappa (1 - C_tail,i))`` with ``C_tail,i`` the
    mean of ``extras['echo_confidence']`` ``[B, R]`` over the last ``tail_window`` tokens of
    ``response_mask`` (:func:`tail_confidence`); ``1 - eps_i <= r <= 1 + eps_i`` on every token
    of response ``i``, dual clip ``c`` on negative advantages. Per row, so micro-batches do not
    change it. Without the extra (a loss run with another estimator and no ECHO pass) the sampled
    token's old probability ``exp(old_logprobs)`` stands in for ``C_t``, as on the release's
    fused-kernel path. Returns ``(loss [B, R], metrics)``; metrics add ``echo_clip_eps_mean`` and
    ``echo_tail_confidence_mean`` (token-weighted means over the response tokens).

    Raises:
        ValueError: ``not 0 <= eps_min <= eps_max < 1``, ``dual_clip <= 1``.
    """
    if not 0.0 <= eps_min <= eps_max < 1.0:
        raise ValueError(f"echo: need 0 <= eps_min <= eps_max < 1, got {eps_min}, {eps_max}")
    C = (inp.extras or {}).get(CONFIDENCE_KEY)
    m = inp.response_mask
    R = m.shape[1]
    if C is None:  # the release's fused-kernel path: the sampled token's old probability stands in
        C = inp.old_logprobs.detach().float().exp() * m
    C = C[:, :R].to(m.device).float()
    with torch.no_grad():
        tail = tail_confidence(C, m, tail_window)
        eps = adaptive_clip(tail, eps_min, eps_max, kappa).unsqueeze(1).expand_as(m).to(inp.logprobs.dtype)
    ratio, log_ratio = _ratio(inp)
    loss, low, high, extra = _ppo_core(ratio, inp.advantages, eps, eps, dual_clip, m)
    metrics = _clip_metrics(ratio, log_ratio, low, high, m)
    metrics.update(extra)
    with torch.no_grad():
        # token-weighted, as every loss metric: the trainer's token-weighted merge keeps them micro-batch invariant
        metrics["echo_clip_eps_mean"] = masked_mean(eps, m)
        metrics["echo_tail_confidence_mean"] = masked_mean(tail.unsqueeze(1).expand_as(m).to(m.dtype), m)
    return loss, metrics
