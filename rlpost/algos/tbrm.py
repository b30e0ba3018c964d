"""TBRM: one KL-regularised Bellman residual per trajectory, with the policy's own logits as Q-values.

"Trajectory Bellman Residual Minimization: A Simple Value-Based Method for LLM
Reasoning" (TBRM, Yuan, Chen, Jia, Rakhlin, Xie; arXiv:2505.15311; authors' code
https://github.com/rlx-lab/TBRM, which could not be read from here). The abstract
fixes the mechanism (logits as Q-values, one trajectory-level Bellman residual under a
KL-regularised target, no critic / importance ratio / clipping, one sample per
prompt); the exact objective is not quoted in any text reachable from here, so it is
derived below from that mechanism.

Derivation. Token-level MDP: state ``s_h`` = prompt + first ``h-1`` response tokens,
action ``a_h`` = the next token, deterministic transitions, the verifier's reward
``r`` at the end. KL-regularised optimum with strength ``beta`` and reference
``pi_ref``: ``pi*(a|s) propto pi_ref(a|s) exp(Q*(s, a) / beta)``,
``V*(s) = beta log sum_a pi_ref(a|s) exp(Q*(s, a) / beta)`` and the Bellman equation
``Q*(s_h, a_h) = r_h + V*(s_{h+1})`` (``V = 0`` after the last token). Reading the
logits ``z_theta`` of the LM as Q-values in the parameterisation
``Q_theta(s, a) = beta (z_theta(s, a) - log pi_ref(a|s))`` makes the induced policy
exactly the LM's softmax, ``pi_theta = softmax(z_theta)``, and gives
``V_theta(s) = beta logsumexp_a z_theta(s, a)`` and
``Q_theta(s, a) - V_theta(s) = beta log pi_theta(a|s) / pi_ref(a|s)``. Summing the
per-step residuals ``Q_theta(s_h, a_h) - r_h - V_theta(s_{h+1})`` along the
trajectory, the ``V`` of every intermediate state cancels (telescopes) and one
residual per trajectory remains::

    delta(x, y) = V_theta(s_1) + beta sum_h log pi_theta(a_h|s_h) / pi_ref(a_h|s_h) - r(x, y)

TBRM minimises ``E[delta^2]`` over trajectories from any behaviour policy (here: the
rollout policy, one sample per prompt). ``V_theta(s_1)`` is the log-normaliser of the
first response position's logits, the only place where the logits' per-state offset
is not cancelled: it is the trajectory's baseline, learned through the same network.
Logits are those the trainer samples with (divided by the rollout temperature), so
``V_theta(s_1) = beta logsumexp(z / T)`` at the last prompt position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from rlpost.algos.losses import PolicyLossInput, _nonempty_mean, ratio_metrics
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.models.logprobs import backbone_and_head
from rlpost.core.registry import param

Metrics = Dict[str, torch.Tensor]

_PAPER = ("Trajectory Bellman Residual Minimization: A Simple Value-Based Method for LLM Reasoning "
          "(TBRM, arXiv:2505.15311); authors' code https://github.com/rlx-lab/TBRM")


def first_position_log_normaliser(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """``[B]`` ``logsumexp_v z(s_1, v) / T``: the log-normaliser of the first response token's logits (with grad).

    One forward pass of the backbone over the (left-padded) prompts, the LM head at the
    last prompt position only (``[B, V]`` logits, not ``[B, P, V]``). Gradients flow
    into the model: TBRM's ``V_theta(s_1)`` is learned through it.

    Args:
        model: a transformers causal LM (``base_model`` + output embeddings).
        prompt_ids, prompt_mask: ``[B, P]`` left-padded prompts.
        temperature: scalar, or ``[B, R]`` per-token temperatures (the first column is
            used; 0 entries are read as 1), as the trainer's log-prob pass.
    Returns:
        ``[B]`` float32, nats.
    Raises:
        TypeError: the model has no separable decoder and LM head.
    """
    base, head = backbone_and_head(model)
    pos = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    h = base(input_ids=prompt_ids, attention_mask=prompt_mask.long(), position_ids=pos).last_hidden_state
    z = head(h[:, -1]).float()  # left padding: the last column is every row's last prompt token
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(z.device, z.dtype)
        t = t[:, 0] if t.dim() == 2 else t
        t = torch.where(t > 0, t, torch.ones_like(t))
        z = z / t[:, None]
    elif float(temperature) not in (0.0, 1.0):
        z = z / float(temperature)
    return torch.logsumexp(z, dim=-1)


def trajectory_residual(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    log_normaliser: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """``[B]`` TBRM's residual ``beta (logZ_1 + sum_t (log pi - log pi_ref)) - r`` of each trajectory.

    Args:
        logprobs, ref_logprobs: ``[B, R]`` sampled-token log-probs of the policy (with grad)
            and of the reference.
        log_normaliser: ``[B]`` ``logsumexp`` of the first response position's logits
            (:func:`first_position_log_normaliser`), so ``V_theta(s_1) = beta * log_normaliser``.
        rewards: ``[B]`` sequence rewards.
        mask: ``[B, R]`` 0/1 response mask.
        beta: KL-regularisation strength (> 0).
    Raises:
        ValueError: ``beta <= 0``.
    """
    if beta <= 0:
        raise ValueError(f"tbrm: beta must be > 0, got {beta}")
    ell = ((logprobs - ref_logprobs.to(logprobs.dtype)) * mask).sum(-1)
    return beta * (log_normaliser.to(logprobs.dtype) + ell) - rewards.to(logprobs.dtype)


@dataclass(frozen=True)
class TBRMParams:
    """TBRM's KL strength (the paper's beta; the value is this library's choice, see the loss's docstring)."""

    beta: float = param(0.01, "beta: KL-regularisation strength of the Bellman target (not confirmed from the paper)")


def _tbrm_example(logprobs: torch.Tensor, generator: torch.Generator) -> dict:
    """The reference log-probs near the current ones, and ``log Z(s_1)`` ``[B]`` as a leaf with grad (the trainer
    computes it from the first position's logits in a run; the batch-level record is the reference only)."""
    ref = logprobs + 0.2 * torch.randn(logprobs.shape, generator=generator)
    z = (5.0 + torch.randn(logprobs.shape[0], generator=generator)).requires_grad_(True)
    return {"extras": {"ref_logprobs": ref, "first_log_normaliser": z}, "batch_extras": {"ref_logprobs": ref}}


@POLICY_LOSSES.register("tbrm", paper=_PAPER, params=TBRMParams, needs_ref=True, sequence_sum=True,
                        needs_first_log_normaliser=True, extras=("ref_logprobs", "first_log_normaliser"),
                        example_inputs=_tbrm_example)
def tbrm_loss(inp: PolicyLossInput, *, beta: float) -> Tuple[torch.Tensor, Metrics]:
    """TBRM: ``delta(x, y)^2`` per trajectory, the squared trajectory Bellman residual (module docstring).

    The reward is read from the advantages: the ``tbrm`` preset uses the ``reward``
    estimator (raw sequence reward broadcast to the tokens; no baseline, since
    ``V_theta(s_1)`` is the baseline). Written per token as ``delta^2 / L`` on each of
    the ``L`` real tokens, so ``seq-mean-token-sum`` is the mean over trajectories;
    rows are whole in every micro-batch. No ratio, no clipping: the objective is valid
    for any behaviour policy (reused or stale batches need no correction).

    ``beta``: the paper's value is not confirmed here; 0.01 is this library's choice
    (rewards are 0/1, so ``beta sum_t log pi/pi_ref`` of order 1 allows a log-ratio of
    order 100 nats over a response before the residual binds).

    Args:
        inp: needs ``ref_logprobs`` ``[B, R]`` (tag ``needs_ref``) and
            ``first_log_normaliser`` ``[B]`` (tag ``needs_first_log_normaliser``: the
            trainer computes it with :func:`first_position_log_normaliser`).
    Returns:
        ``(loss_mat [B, R], metrics)``; ``seq_tbrm_residual`` is the mean residual,
        ``seq_tbrm_v1`` the mean ``V_theta(s_1)``.
    Raises:
        ValueError: a missing input, or ``beta <= 0``.
    """
    if inp.extras.get("ref_logprobs") is None:
        raise ValueError("tbrm needs ref_logprobs (the runner computes them for losses tagged needs_ref)")
    if inp.extras.get("first_log_normaliser") is None:
        raise ValueError("tbrm needs first_log_normaliser (the trainer computes it for losses tagged "
                         "needs_first_log_normaliser)")
    m = inp.response_mask
    L = m.sum(-1).clamp(min=1.0)
    r = (inp.advantages * m).sum(-1) / L
    delta = trajectory_residual(inp.logprobs, inp.extras.get("ref_logprobs"), inp.extras.get("first_log_normaliser"), r, m, beta)
    loss = (delta ** 2 / L)[:, None] * m
    with torch.no_grad():
        lr = (inp.logprobs - inp.old_logprobs).clamp(-20.0, 20.0)
        metrics = {**ratio_metrics(lr.exp(), lr, m), "clip_frac": torch.zeros((), device=m.device),
                   "seq_tbrm_residual": _nonempty_mean(delta.detach(), m),
                   "seq_tbrm_v1": _nonempty_mean(beta * inp.extras.get("first_log_normaliser").detach().to(m.dtype), m)}
    return loss, metrics
