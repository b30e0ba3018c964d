"""R^3L's update: Pivotal Credit Assignment (shared prefix masked) and Positive Amplification.

"R^3L: Reflect-then-Retry Reinforcement Learning with Language-Guided
Exploration, Pivotal Credit, and Positive Amplification" (Shi, Chen, Li, Pan,
Sun, Xu, Zhou, Li; arXiv:2601.03715; authors' code
https://github.com/shiweijiezero/R3L, a Trinity-RFT fork). The rollouts come
from ``sampler=r3l`` (:mod:`rlpost.samplers.r3l`): a failed attempt is
reflected upon, the reflection names the step where it went wrong, and the
retry keeps the attempt's steps before it and regenerates the rest.

Only the abstract was readable here; the formulas follow the authors' code
(``opmd_reweight_adv`` advantage, ``opmd`` loss, ``R3L_*_workflow``), which the
R^3L configs (``examples/R3L/*/opmd_R3L_*.yaml``) run:

* **Advantage** (OPMD's group-mean baseline, no std): ``s_i = r_i - mean_g(r)``
  (a group of one: ``s_i = r_i``).
* **Positive Amplification** (the release's reweighting): a successful row
  (``r_i >= success_threshold``, 1 in the release) gets ``A_i = success_advantage``
  (1.0, whatever the group's mean); any other row with ``s_i >= 0`` gets
  ``A_i = positive_weight * s_i`` (3 in the release); a row below the mean keeps
  ``A_i = s_i``. So a group where one of eight attempts succeeds gives the success
  ``1`` (not ``0.875``) and each failure ``-0.125``: positive signal dominates a
  failure-heavy group. Note (the release's rule, kept): a group whose rows all
  succeed gets ``A = 1`` for each, not 0.
* **Pivotal Credit Assignment**: a retried row and the failed attempt it came
  from share the attempt's first ``k`` steps (the prefix the retry kept); their
  first ``r3l_prefix_len`` response tokens get ``loss_mask`` 0, so the gradient
  falls only on the diverging suffixes (the release masks the first
  ``retry_from_step`` assistant turns of both, "for fair comparison").
* **Off-policy retried segments.** The retry was sampled with the reflection in
  its context, but it is trained under the original prompt (the release's
  "distill" trajectory, guidance removed), with a loss whose ratio is taken
  against the trainer's own pre-update log-probs (the release's OPMD loss
  ``-A log pi`` has no importance weight at all), so the guided context's
  behaviour log-probs never enter the update. ``retry_is_cap > 0`` (our
  addition, off by default) also multiplies a retried row's advantage by the
  truncated per-token geometric-mean ratio of the two contexts,
  ``w_i = min(cap, exp(mean_{t in suffix}(log pi_old(y_t | x, prefix) -
  log mu(y_t | x, reflection, prefix))))`` (``mu``: the rollout engine's
  log-probs under the guided context), so a retry the unguided policy finds
  unlikely counts less.

The release also trains two more reward-1 rows per successful retry (the
reflection text itself and the retry under the guided context, each in a group
of its own); they are left out here (the policy learns to reflect only through
its retries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.utils import group_stats
from rlpost.core.registry import param

PAPER = ("R^3L: Reflect-then-Retry Reinforcement Learning with Language-Guided Exploration, Pivotal Credit, "
         "and Positive Amplification (arXiv:2601.03715)")

#: ``batch.extras`` keys ``sampler=r3l`` writes: ``[B]`` long shared-prefix tokens at the start of each
#: response (0: none), ``[B]`` float 1 on retried rows
PREFIX_KEY, RETRIED_KEY = "r3l_prefix_len", "r3l_retried"


@dataclass(frozen=True)
class R3LParams:
    """R^3L's advantage (arXiv:2601.03715); defaults from the authors' ``opmd_reweight_adv``."""

    positive_weight: float = param(3.0, "Positive Amplification: a non-successful row at or above the group "
                                   "mean gets positive_weight * (r - mean) (release: 3)")
    success_threshold: float = param(1.0, "a row with reward >= this is a success (release: 1)")
    success_advantage: float = param(1.0, "the advantage of every successful row (release: 1)")
    norm_by_std: bool = param(False, "divide r - mean by the group std + eps first (release's grpo_reweight_adv "
                              "variant; opmd_reweight_adv, which the R3L configs run: false)")
    eps: float = param(1e-6, "added to the std when norm_by_std")
    pivotal_mask: bool = param(True, "Pivotal Credit Assignment: mask the shared prefix (r3l_prefix_len) of "
                               "retried rows and their source attempts")
    retry_is_cap: float = param(0.0, "0: no importance weight on retried rows (release); c > 0: their advantage "
                                "times min(c, exp(mean suffix (old - rollout log-prob))) (our addition; needs "
                                "old log-probs)")


def positive_amplified(rewards: torch.Tensor, group_index: torch.Tensor, *, positive_weight: float,
                       success_threshold: float, success_advantage: float, norm_by_std: bool = False,
                       eps: float = 1e-6) -> torch.Tensor:
    """``[B]`` float64 sequence advantages with Positive Amplification (module docstring).

    ``s_i = r_i - mean_g`` (``/ (std_g + eps)`` with ``norm_by_std``; a group of one:
    ``s_i = r_i``); ``A_i = success_advantage`` if ``r_i >= success_threshold``, else
    ``positive_weight * s_i`` if ``s_i >= 0``, else ``s_i``.

    Args:
        rewards: ``[B]`` outcome rewards; group_index: ``[B]`` long group ids.
    """
    r = rewards.double()
    mean, std, cnt = group_stats(r, group_index)
    single = cnt <= 1
    s = torch.where(single, r, r - mean)
    if norm_by_std:
        s = torch.where(single, s, s / (std + eps))
    amp = torch.where(s >= 0, float(positive_weight) * s, s)
    return torch.where(r >= float(success_threshold), torch.full_like(r, float(success_advantage)), amp)


def prefix_keep_mask(response_mask: torch.Tensor, prefix_len: Optional[torch.Tensor]) -> torch.Tensor:
    """``[B, R]`` 0/1 float64: response tokens after each row's first ``prefix_len[b]`` tokens.

    ``prefix_len`` ``[B]`` long counts response positions from the start (the shared
    prefix of a retried row and of its source attempt); None or 0 keeps every token.
    """
    m = (response_mask > 0).double()
    if prefix_len is None:
        return m
    pos = torch.arange(m.shape[1]).unsqueeze(0)
    return m * (pos >= prefix_len.long().view(-1, 1)).double()


def retry_importance_weight(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, keep: torch.Tensor,
                            cap: float) -> torch.Tensor:
    """``[B]`` float64 ``min(cap, exp(mean_t (old - rollout)))`` over the tokens ``keep`` marks (1 for a row
    without any); log-probs ``[B, R]`` in nats, ``keep`` ``[B, R]`` 0/1, ``cap > 0``."""
    d = (old_logprobs.double() - rollout_logprobs.double()) * keep
    n = keep.sum(-1)
    mean = torch.where(n > 0, d.sum(-1) / n.clamp(min=1), torch.zeros_like(n))
    return torch.exp(mean.clamp(max=math.log(cap)))


@ADV_ESTIMATORS.register("r3l", paper=PAPER, params=R3LParams, needs_group=True,
                         zero_variance=('Positive Amplification: a success gets A = 1 even in an all-success group '
                                        "(the authors' opmd_reweight_adv)"))
def r3l_advantage(inp: AdvantageInput, *, positive_weight: float, success_threshold: float,
                  success_advantage: float, norm_by_std: bool, eps: float, pivotal_mask: bool,
                  retry_is_cap: float) -> AdvantageOutput:
    """R^3L's token advantages and loss mask (module docstring; the authors' code).

    Shapes: ``inp.rewards`` ``[B]``, ``inp.group_index`` ``[B]``, ``inp.response_mask``
    ``[B, R]``; from ``sampler=r3l``: ``inp.extras['r3l_prefix_len']`` ``[B]`` long and
    ``inp.extras['r3l_retried']`` ``[B]`` (absent: no row is a retry, nothing is
    masked); with ``retry_is_cap > 0`` also ``old_logprobs`` and ``rollout_logprobs``
    ``[B, R]`` (nats). Returns ``advantages`` ``[B, R]`` (the row's amplified advantage
    on its kept tokens, 0 elsewhere) and ``loss_mask`` ``[B, R]`` (0 on the shared
    prefixes) when a prefix is masked, no returns.

    Raises:
        ValueError: ``positive_weight < 0``, ``retry_is_cap < 0``, or ``retry_is_cap > 0``
            without old log-probs (the run computes them for it: ``rlpost.methods.r3l``).
    """
    if not positive_weight >= 0:
        raise ValueError(f"r3l: positive_weight={positive_weight!r} must be >= 0 (release: 3)")
    if not retry_is_cap >= 0:
        raise ValueError(f"r3l: retry_is_cap={retry_is_cap!r} must be >= 0 (0: no importance weight)")
    adv = positive_amplified(inp.rewards, inp.group_index, positive_weight=positive_weight,
                             success_threshold=success_threshold, success_advantage=success_advantage,
                             norm_by_std=norm_by_std, eps=eps)
    pre = inp.extras.get(PREFIX_KEY)
    keep = prefix_keep_mask(inp.response_mask, pre if pivotal_mask else None)
    retried = inp.extras.get(RETRIED_KEY)
    if retry_is_cap > 0 and retried is not None and bool((retried > 0).any()):
        if inp.old_logprobs is None or inp.rollout_logprobs is None:
            raise ValueError("r3l: retry_is_cap > 0 needs old_logprobs and rollout_logprobs (the run computes the "
                             "old log-probs when algo.adv_params.retry_is_cap > 0)")
        w = retry_importance_weight(inp.old_logprobs, inp.rollout_logprobs, keep, retry_is_cap)
        adv = torch.where(retried.double() > 0, adv * w, adv)
    out = (adv.view(-1, 1) * keep).float()
    masked = pre is not None and pivotal_mask and bool((pre > 0).any())
    return AdvantageOutput(advantages=out, returns=None,
                           loss_mask=keep.to(inp.response_mask.dtype) if masked else None)
