"""OTR: one-token rollouts, supervised fine-tuning as a token-level policy gradient.

"One-Token Rollout: Guiding Supervised Fine-Tuning of LLMs with Policy Gradient" (Ming, Wu et al.,
arXiv:2509.26313). Every position ``t`` of a supervised response is a one-step episode: the prefix is
teacher-forced (the reference answer up to ``t``), ``K`` candidate tokens ``a_{t,1..K}`` are drawn
from an exploratory copy of the current policy ``pi'(a|s_t) = softmax(l_a / kappa)`` (``kappa > 1``
flattens it), and each candidate earns ``R = 1`` when it equals the reference token ``x_t`` and
``R = beta`` otherwise. The policy-gradient estimate is ``(1/K) sum_j R_j grad log pi(a_{t,j}|s_t)``,
so the loss of position ``t`` is

    loss_t = -(1/K) * sum_j R(a_{t,j}, x_t) * log pi_theta(a_{t,j} | s_t)

(``pi_theta`` at temperature 1, the policy's own distribution). A negative ``beta`` pushes down
the probability of the sampled wrong tokens (the paper's second term); ``beta = 0`` keeps only the
ground-truth term, which is SFT reweighted by the share of candidates that hit ``x_t``.

The candidates are drawn inside the update's forward from the very logits the gradient flows
through (detached for the draw), so they are on-policy for every update; nothing is generated.
Choices the paper leaves open or that we could not read: the gradient ignores that the samples
come from ``pi'`` rather than ``pi`` (no importance weight: we read the paper's estimator as
written above); ``beta`` default ``-0.1`` (the paper only says ``beta < 1``); defaults ``K = 256``
and ``kappa = 1.3`` are the values the paper's method section uses. The reference responses are
the ones ``algo=sft`` trains on (the task's answer in its answer format, + EOS), so ``algo=sft``
is the baseline on the same data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from rlpost.algos.losses import POLICY_LOSSES, PolicyLossInput, _clip_metrics, _ratio, masked_mean
from rlpost.core.registry import param
from rlpost.models.logprobs import packed_response_states


@dataclass(frozen=True)
class OTRParams:
    """OTR's knobs (arXiv:2509.26313)."""

    k: int = param(256, "candidate tokens drawn per teacher-forced position (paper: 256)")
    kappa: float = param(1.3, "temperature of the exploratory sampling copy pi' (paper: 1.3)")
    beta: float = param(-0.1, "reward of a candidate that is not the reference token (paper: beta < 1; -0.1 is our choice)")

    def __post_init__(self) -> None:
        if int(self.k) < 1:
            raise ValueError(f"otr: k must be >= 1 candidate per position, got {self.k}")
        if not float(self.kappa) > 0:
            raise ValueError(f"otr: kappa must be > 0 (a temperature), got {self.kappa}")
        if not float(self.beta) < 1:
            raise ValueError(f"otr: beta must be < 1 (the reward of a wrong candidate), got {self.beta}")


def otr_candidates(logits: torch.Tensor, targets: torch.Tensor, k: int, kappa: float, beta: float,
                   generator: Optional[torch.Generator] = None,
                   uniforms: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Draw ``k`` candidates per position from ``softmax(logits / kappa)`` and reward them against ``targets``.

    Args:
        logits: ``[N, V]`` next-token logits of N teacher-forced positions (read detached).
        targets: ``[N]`` long reference tokens.
        k, kappa, beta: see :class:`OTRParams`.
        generator: CPU generator for the draws (None: torch's global RNG); unused with ``uniforms``.
        uniforms: ``[N, k]`` uniforms in [0, 1): draw by inverse CDF from these instead (what the
            trainer does, so that a position's candidates do not depend on the micro-batch split).
    Returns:
        ``(ids [N, k] long, rewards [N, k] float)``: candidates drawn with replacement, and 1 where a
        candidate equals the target, ``beta`` elsewhere.
    Raises:
        ValueError: ``targets`` not ``[N]`` for ``logits`` ``[N, V]``, or ``uniforms`` not ``[N, k]``.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits {tuple(logits.shape)} must be [N, V] and targets {tuple(targets.shape)} [N]")
    if logits.shape[0] == 0:
        z = torch.zeros(0, int(k), dtype=torch.long, device=logits.device)
        return z, z.float()
    probs = torch.softmax(logits.detach().float().cpu() / float(kappa), -1)
    if uniforms is not None:
        if uniforms.shape != (logits.shape[0], int(k)):
            raise ValueError(f"uniforms {tuple(uniforms.shape)} must be [N, k] = {(logits.shape[0], int(k))}")
        cdf = probs.double().cumsum(-1)
        ids = torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1:]).contiguous(), right=True)
        ids = ids.clamp(max=probs.shape[-1] - 1).to(logits.device)
    else:
        ids = torch.multinomial(probs, int(k), replacement=True, generator=generator).to(logits.device)
    hit = ids == targets[:, None].to(ids.device)
    return ids, torch.where(hit, torch.ones_like(ids, dtype=torch.float32), torch.full_like(ids, float(beta), dtype=torch.float32))


def otr_forward(fwd: Any, mb: Any, with_entropy: bool, entropy_grad: bool,
                params: Dict[str, Any], seed: Optional[int] = None):
    """The policy update's forward for ``loss=otr``: reference log-probs plus K rewarded candidates per position.

    One backbone pass over prompt + reference response (:func:`rlpost.models.logprobs.packed_response_states`),
    the LM head on the N real response positions (``[N, V]`` logits, with gradient), candidates drawn
    by :func:`otr_candidates` from those logits (detached).

    Args:
        fwd: the trainer's :class:`rlpost.methods.base.ForwardPass` (device, autocast, the module being trained).
        mb: micro-batch (:class:`rlpost.core.batch.RolloutBatch`) whose responses are the reference answers.
        with_entropy, entropy_grad: also return the per-token entropy (with grad when ``entropy_grad``).
        params: the loss's resolved parameters (``k``, ``kappa``, ``beta``).
        seed: seed of the candidate draws (None: global RNG). With a seed, candidate ``j`` of response
            position ``t`` of the mini-batch's row ``r`` (``mb.extras['_row']``, else the micro-batch's
            own row) reads the counter-based uniform of key ``(seed, r, t, j)``
            (:func:`rlpost.rollout.hf.row_uniforms`), so the draws, and with them the gradient, do not
            depend on how the mini-batch is split into micro-batches.
    Returns:
        ``(logprobs [b, R], entropy [b, R] or None, loss inputs)``: the last a dict with
        ``support_logprobs`` ``[b, R, K]`` (``log pi_theta`` of the candidates, with grad) and
        ``support_rewards`` ``[b, R, K]``; zeros on padding.
    """

    dev = fwd.device
    attn = mb.extras.get("response_attn", (mb.response_mask > 0).long())
    B, R = mb.response_ids.shape
    K = int(params["k"])
    with fwd.autocast():
        head, flat_idx, hs, tgt, _ = packed_response_states(
            fwd.model, mb.prompt_ids.to(dev), mb.prompt_mask.to(dev), mb.response_ids.to(dev), attn.to(dev), 1.0)
        logits = head(hs).float()  # [N, V]
    logp = torch.log_softmax(logits, -1)
    u = None
    if seed is not None:
        from rlpost.rollout.hf import _wrap64, row_uniforms

        fi = flat_idx.cpu()
        rows = mb.extras.get("_row", torch.arange(B))[fi // R].long()
        pos = fi % R
        # one key per (seed, row, position, candidate); int64 products wrap, which only permutes keys
        key = ((_wrap64(int(seed) * 1_000_003) + rows) * 1_000_033 + pos)[:, None] * K + torch.arange(K)[None, :]
        u = row_uniforms(key.reshape(-1), 0).view(-1, K)
    ids, rew = otr_candidates(logits, tgt, K, float(params["kappa"]), float(params["beta"]), uniforms=u)
    lp_flat = logp.gather(-1, tgt[:, None]).squeeze(-1)
    sup_flat = logp.gather(-1, ids)

    def grid(x: torch.Tensor, width: int = 0) -> torch.Tensor:
        shape = (B * R, width) if width else (B * R,)
        out = torch.zeros(shape, dtype=x.dtype, device=x.device).index_copy(0, flat_idx, x)
        return out.view(B, R, width) if width else out.view(B, R)

    ent = None
    if with_entropy:
        e = -(logp.exp() * logp).sum(-1)
        ent = grid(e if entropy_grad else e.detach())
    return grid(lp_flat), ent, {"support_logprobs": grid(sup_flat, K), "support_rewards": grid(rew, K)}


def _otr_example(logprobs: torch.Tensor, generator: torch.Generator) -> dict:
    """8 candidate tokens per position: the policy's log-probs on them (a leaf with grad) and a reward each
    (1 for a hit, beta = -0.1 otherwise); otr_forward computes both in a run."""
    s = torch.log_softmax(torch.randn(*logprobs.shape, 24, generator=generator), -1)[..., :8]
    hit = torch.rand(*logprobs.shape, 8, generator=generator) < 0.3
    return {"extras": {"support_logprobs": s.clone().requires_grad_(True),
                       "support_rewards": torch.where(hit, torch.ones_like(s), torch.full_like(s, -0.1))}}


@POLICY_LOSSES.register(
    "otr",
    paper="One-Token Rollout: Guiding Supervised Fine-Tuning of LLMs with Policy Gradient (OTR, arXiv:2509.26313)",
    params=OTRParams,
    needs_reference_responses=True,
    one_token_rollout=True, extras=("support_logprobs", "support_rewards"), example_inputs=_otr_example)
def otr_loss(inp: PolicyLossInput, *, k: int = 256, kappa: float = 1.3, beta: float = -0.1) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """``loss_t = -(1/K) sum_j R_j log pi(a_{t,j} | s_t)`` over the K candidates of each reference position.

    Reads ``inp.extras["support_logprobs"]`` ``[B, R, K]`` (log-probs of the candidates, with grad) and
    ``inp.extras["support_rewards"]`` ``[B, R, K]`` (1 on a hit of the reference token, ``beta`` elsewhere),
    both filled by :func:`otr_forward`; ``k``, ``kappa`` and ``beta`` act there. Returns the
    per-token loss ``[B, R]`` and metrics ``nll`` (masked mean ``-log pi(x_t)`` of the reference
    tokens) and ``otr_hit_rate`` (share of candidates equal to the reference token).

    Raises:
        ValueError: the support inputs are missing (the trainer did not run :func:`otr_forward`).
    """
    sup, rew = inp.extras.get("support_logprobs"), inp.extras.get("support_rewards")
    if sup is None or rew is None:
        raise ValueError("loss=otr needs support_logprobs and support_rewards from rlpost.algos.otr.otr_forward")
    ratio, log_ratio = _ratio(inp)
    Kc = max(1, sup.shape[-1])
    loss = -(rew.to(sup.dtype) * sup).sum(-1) / Kc
    z = torch.zeros_like(ratio)
    metrics = _clip_metrics(ratio, log_ratio, z, z, inp.response_mask)
    metrics["nll"] = masked_mean(-inp.logprobs.detach(), inp.response_mask)
    hit = (rew == 1.0).float().mean(-1)
    metrics["otr_hit_rate"] = masked_mean(hit, inp.response_mask)
    return loss, metrics
