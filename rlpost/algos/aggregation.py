"""Loss aggregation modes: how a ``[B, R]`` per-token loss becomes a scalar.

The four modes follow the naming used by verl and by "Understanding R1-Zero-Like
Training: A Critical Perspective" (Dr. GRPO, arXiv:2503.20783):

* ``token-mean``: sum over all tokens / number of tokens (DAPO, arXiv:2503.14476).
* ``seq-mean-token-mean``: mean over tokens of each sequence, then mean over
  sequences (original GRPO, arXiv:2402.03300).
* ``seq-mean-token-sum``: sum over tokens of each sequence, mean over sequences.
* ``seq-mean-token-sum-norm``: sum over tokens divided by a fixed constant
  (``norm_const``, by default the maximum response length), mean over sequences
  (Dr. GRPO: removes the length bias of per-sequence normalisation).

Gradient accumulation: to make the sum of micro-batch losses equal the loss of
the whole mini-batch, pass ``denom`` = :func:`agg_count` of the whole mini-batch
(its number of response tokens for token-mean, its number of sequences with at
least one response token for the seq-* modes). Without ``denom`` the
micro-batch's own count is used. A sequence whose mask is empty adds nothing to
the numerator and is not counted in the seq-* denominators either (as verl does,
``seq_mask = mask.sum(-1) > 0``), so an all-masked padding row, which a
distributed engine adds to keep processes in step, changes neither the loss nor
its gradient.
"""

from __future__ import annotations

from typing import Optional

import torch

from rlpost.algos.registries import LOSS_AGGS


def agg_count(mode: str, mask: torch.Tensor) -> float:
    """The denominator of aggregation ``mode`` for ``mask`` ``[B, R]``.

    Response tokens for ``token-mean``; sequences with at least one response
    token for the seq-* modes. The sum over micro-batches of this count is the
    count of the whole mini-batch, which makes the micro-batch losses (and
    their counts as weights of a logged mean) add up to the mini-batch's.

    Raises:
        ConfigError: unknown mode.
    """
    LOSS_AGGS.get(mode)
    if mode == "token-mean":
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())


def _seqs(mask: torch.Tensor) -> torch.Tensor:
    return (mask.sum(-1) > 0).sum().to(mask.dtype if mask.is_floating_point() else torch.float32)


def _denom(default: torch.Tensor, denom: Optional[float]) -> torch.Tensor:
    if denom is None:
        return default.clamp(min=1.0)
    return torch.as_tensor(float(max(denom, 1.0)), dtype=default.dtype)


@LOSS_AGGS.register("token-mean", paper="DAPO (arXiv:2503.14476)")
def token_mean(
    loss_mat: torch.Tensor, mask: torch.Tensor, denom: Optional[float] = None, norm_const: Optional[float] = None
) -> torch.Tensor:
    """Sum of ``loss_mat * mask`` over all tokens divided by the token count.

    Args:
        loss_mat: ``[B, R]`` per-token loss.
        mask: ``[B, R]`` 0/1 response mask.
        denom: total token count of the mini-batch (for accumulation), or None.
        norm_const: unused (uniform signature).
    Returns:
        scalar tensor.
    """
    return (loss_mat * mask).sum() / _denom(mask.sum(), denom)


@LOSS_AGGS.register("seq-mean-token-mean", paper="GRPO / DeepSeekMath (arXiv:2402.03300)")
def seq_mean_token_mean(
    loss_mat: torch.Tensor, mask: torch.Tensor, denom: Optional[float] = None, norm_const: Optional[float] = None
) -> torch.Tensor:
    """Per-sequence token mean, then the mean over sequences (``denom`` = sequence count).

    Sequences with an empty mask are left out (numerator and count). Shapes as
    :func:`token_mean`.
    """
    per_seq = (loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / _denom(_seqs(mask), denom)


@LOSS_AGGS.register("seq-mean-token-sum", paper="verl loss_agg_mode (github.com/volcengine/verl, verl/trainer/ppo/core_algos.py)")
def seq_mean_token_sum(
    loss_mat: torch.Tensor, mask: torch.Tensor, denom: Optional[float] = None, norm_const: Optional[float] = None
) -> torch.Tensor:
    """Per-sequence token sum, then the mean over sequences. Shapes as :func:`token_mean`."""
    per_seq = (loss_mat * mask).sum(-1)
    return per_seq.sum() / _denom(_seqs(mask), denom)


@LOSS_AGGS.register("seq-mean-token-sum-norm", paper="Dr. GRPO (arXiv:2503.20783)")
def seq_mean_token_sum_norm(
    loss_mat: torch.Tensor, mask: torch.Tensor, denom: Optional[float] = None, norm_const: Optional[float] = None
) -> torch.Tensor:
    """Per-sequence token sum divided by the constant ``norm_const``, mean over sequences.

    ``norm_const`` defaults to the padded response length ``R`` of ``loss_mat``
    (callers pass ``rollout.max_new_tokens`` so it is the same for every batch).
    """
    c = float(norm_const) if norm_const else float(loss_mat.shape[-1])
    per_seq = (loss_mat * mask).sum(-1) / c
    return per_seq.sum() / _denom(_seqs(mask), denom)


def aggregate(
    mode: str,
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    denom: Optional[float] = None,
    norm_const: Optional[float] = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` ``[B, R]`` with the registered mode ``mode``.

    Raises:
        ConfigError: unknown mode (lists the valid ones).
    """
    return LOSS_AGGS.get(mode)(loss_mat, mask, denom=denom, norm_const=norm_const)
