"""M3PO's trainer side: the log-prob passes see the hybrid thinking embeddings the rollout fed.

"Multi-Path Collaborative Reasoning via Reinforcement Learning" (M3PO, arXiv:2512.01485).
``sampler=m3po`` (:mod:`rlpost.samplers.m3po`) feeds each thinking path, after each of its
tokens, ``(1 - lambda) e(x_i) + lambda sum_j A_ij e(x_j)`` (its peers' tokens weighted by
cross-path attention) instead of ``e(x_i)``. The paper computes the policy gradient "using the
hybrid thinking embeddings as context" (Eq. 8); this method rebuilds them in the trainer's
pre-update, reference and update passes from the recorded ids and weights
(:class:`rlpost.methods.mixed_inputs.MixedInputsMethod`, shared with N-GRPO): the weights are
constants of the rollout (our reading: the paper's attention weights come from the rollout's
distributions and each batch is used for one update, so they are the weights of the policy being
updated), the gradient flows through the embedding table. The update itself is the run's
algorithm; the paper's (raw log-probabilities times group-normalised advantages, one update per
batch, KL 0.005) is GRPO with one update per batch, whose ratio is 1 at the update.
"""

from __future__ import annotations

from typing import Any

import torch

from rlpost.methods import mixed_inputs as _mixed
from rlpost.methods.base import METHODS
from rlpost.methods.mixed_inputs import MixedInputsMethod
from rlpost.samplers.m3po import KEYS


def mixed_inputs(model: torch.nn.Module, batch: Any):
    """:func:`rlpost.methods.mixed_inputs.mixed_inputs` with M3PO's extras keys (``m3po_*``)."""
    return _mixed.mixed_inputs(model, batch, KEYS)


@METHODS.register("m3po", paper="Multi-Path Collaborative Reasoning via Reinforcement Learning (M3PO, "
                  "arXiv:2512.01485)")
class M3POMixedInputs(MixedInputsMethod):
    """Feed the trainer's log-prob passes the rollout's hybrid thinking embeddings (``sampler=m3po``)."""

    name = "m3po"
    sampler = "m3po"
    keys = KEYS
