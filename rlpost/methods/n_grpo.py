"""N-GRPO's trainer side: the log-prob passes see the mixed input embeddings the rollout fed.

"N-GRPO: Embedding-Level Neighbor Mixing for Enhanced Policy Optimization" (arXiv:2606.10768;
code https://github.com/ZJUSCL/N-GRPO). ``sampler=neighbor_mixing``
(:mod:`rlpost.samplers.neighbor_mixing`) feeds the decoder, at some response positions, a
weighted mixture of token embeddings instead of the recorded token's. The release's actor
(verl ``dp_actor._forward_micro_batch``) rebuilds the same inputs from the stored ids and
weights for every log-prob pass: ``sum_j w_j embed(id_j)`` with the weights constant and the
gradient flowing through the embedding table. This method does that for the trainer's
pre-update, reference and update passes through :meth:`Method.logprob_context`
(:class:`rlpost.methods.mixed_inputs.MixedInputsMethod`, shared with M3PO). The algorithm is
otherwise the run's (the paper: GRPO with a k3 KL loss).
"""

from __future__ import annotations

from typing import Any

import torch

from rlpost.methods import mixed_inputs as _mixed
from rlpost.methods.base import METHODS
from rlpost.methods.mixed_inputs import MixedInputsMethod
from rlpost.samplers.neighbor_mixing import KEYS


def mixed_inputs(model: torch.nn.Module, batch: Any):
    """:func:`rlpost.methods.mixed_inputs.mixed_inputs` with N-GRPO's extras keys (``nm_*``)."""
    return _mixed.mixed_inputs(model, batch, KEYS)


@METHODS.register("n_grpo", paper="N-GRPO: Embedding-Level Neighbor Mixing for Enhanced Policy Optimization "
                  "(arXiv:2606.10768)")
class NeighborMixedInputs(MixedInputsMethod):
    """Feed the trainer's log-prob passes the rollout's mixed input embeddings (``sampler=neighbor_mixing``)."""

    name = "n_grpo"
    sampler = "neighbor_mixing"
    keys = KEYS
