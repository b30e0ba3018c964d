"""What the samplers that feed the decoder mixed input embeddings share (N-GRPO, M3PO).

A sampler of this kind replaces, at some response positions ``t`` of row ``r``, the input the
decoder is fed after token ``t`` (the embedding of that token) by a weighted sum of token
embeddings ``sum_j w_j emb(id_j)`` (its :data:`rlpost.rollout.base.DecodeHook` returns the
mixtures as ``inputs_embeds``). It records each mixture's ids and weights in ``batch.extras`` so
that the trainer's log-prob passes feed the same inputs
(:func:`rlpost.methods.mixed_inputs.mixed_inputs`); what differs between the methods is only which
ids and weights a mixture has:

- "N-GRPO: Embedding-Level Neighbor Mixing for Enhanced Policy Optimization" (arXiv:2606.10768,
  :mod:`rlpost.samplers.neighbor_mixing`): the top token and its embedding-table neighbours,
  weighted by their probabilities;
- "Multi-Path Collaborative Reasoning via Reinforcement Learning" (M3PO, arXiv:2512.01485,
  :mod:`rlpost.samplers.m3po`): the row's own sampled token and its group peers' sampled tokens,
  weighted by ``1 - lambda`` and ``lambda`` times the cross-path attention.

Extras, per sampler prefix ``p`` (``[B, R]`` each): ``<p>_mixed`` (1.0 where the input was a
mixture), ``<p>_id<j>`` (long, the ``j``-th id) and ``<p>_w<j>`` (float, its weight), ``j < k``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

#: one recorded mixture: ``(row, t) -> (ids [k] long, weights [k] float)``
MixtureRecord = Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class MixtureKeys:
    """The ``batch.extras`` keys of one sampler's mixtures.

    ``<prefix>_mixed``, ``<prefix>_id<j>`` and ``<prefix>_w<j>`` (N-GRPO: ``nm``, M3PO: ``m3po``).
    """

    prefix: str

    @property
    def mixed(self) -> str:
        """Key of the ``[B, R]`` 0/1 mask of mixed positions."""
        return f"{self.prefix}_mixed"

    def id(self, j: int) -> str:
        """Key of the ``[B, R]`` long ``j``-th id."""
        return f"{self.prefix}_id{j}"

    def weight(self, j: int) -> str:
        """Key of the ``[B, R]`` float weight of the ``j``-th id."""
        return f"{self.prefix}_w{j}"


def mixed_embedding(embed: torch.nn.Module, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[..., j] embed(ids[..., j])``: ``[..., H]`` from ``ids`` / ``weights`` ``[..., k]``.

    ``embed`` is the model's input-embedding module (so a scaled embedding, as Gemma's, is
    mixed after its scale); the weights are cast to its dtype and carry no gradient, the
    gradient flows through the embedding table.
    """
    e = embed(ids)
    return (weights.detach().to(e.dtype)[..., None] * e).sum(-2)


def mixture_extras(record: MixtureRecord, B: int, R: int, k: int, keys: MixtureKeys) -> Dict[str, torch.Tensor]:
    """The ``[B, R]`` extras of ``record`` (mixtures of ``k`` ids each): the mask, ``k`` id and ``k`` weight tensors.

    Positions ``t >= R`` (steps past the batch's response width) are dropped; unmixed
    positions hold id 0 and weight 0.
    """
    out = {keys.mixed: torch.zeros(B, R)}
    for j in range(k):
        out[keys.id(j)] = torch.zeros(B, R, dtype=torch.long)
        out[keys.weight(j)] = torch.zeros(B, R)
    for (r, t), (ids, w) in record.items():
        if t < R:
            out[keys.mixed][r, t] = 1.0
            for j in range(k):
                out[keys.id(j)][r, t] = ids[j]
                out[keys.weight(j)][r, t] = w[j]
    return out


def mixture_of(extras: Mapping[str, Any], R: int, keys: MixtureKeys
               ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(mixed [b, R] bool, ids [b, R, k] long, weights [b, R, k] float)`` from ``extras``; None: no mixed position."""
    if keys.mixed not in extras:
        return None
    mixed = extras[keys.mixed][:, :R] > 0
    if not bool(mixed.any()):
        return None
    k = 0
    while keys.id(k) in extras:
        k += 1
    ids = torch.stack([extras[keys.id(j)][:, :R] for j in range(k)], -1).long()
    w = torch.stack([extras[keys.weight(j)][:, :R] for j in range(k)], -1).float()
    return mixed, ids, w
