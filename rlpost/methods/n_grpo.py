"""N-GRPO's trainer side: the log-prob passes see the mixed input embeddings the rollout fed.

"N-GRPO: Embedding-Level Neighbor Mixing for Enhanced Policy Optimization" (arXiv:2606.10768;
code https://github.com/ZJUSCL/N-GRPO). ``sampler=neighbor_mixing``
(:mod:`rlpost.samplers.neighbor_mixing`) feeds the decoder, at some response positions, a
weighted mixture of token embeddings instead of the recorded token's. The release's actor
(verl ``dp_actor._forward_micro_batch``) rebuilds the same inputs from the stored ids and
weights for every log-prob pass: ``sum_j w_j embed(id_j)`` with the weights constant and the
gradient flowing through the embedding table. This method does that for the trainer's
pre-update, reference and update passes through :meth:`Method.logprob_context`: a forward
hook on the model's input-embedding module replaces its output at the mixed positions. The
algorithm is otherwise the run's (the paper: GRPO with a k3 KL loss).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method
from rlpost.samplers.neighbor_mixing import ID_KEY, MIXED_KEY, WEIGHT_KEY, mixed_embedding


def _mixture_of(batch: Any, R: int):
    """``(mixed [b, R] bool, ids [b, R, k], weights [b, R, k])`` from ``batch.extras`` (None: no mixed position)."""
    ex = batch.extras
    if MIXED_KEY not in ex:
        return None
    mixed = ex[MIXED_KEY][:, :R] > 0
    if not bool(mixed.any()):
        return None
    k = 0
    while ID_KEY.format(k) in ex:
        k += 1
    ids = torch.stack([ex[ID_KEY.format(j)][:, :R] for j in range(k)], -1).long()
    w = torch.stack([ex[WEIGHT_KEY.format(j)][:, :R] for j in range(k)], -1).float()
    return mixed, ids, w


@contextlib.contextmanager
def mixed_inputs(model: torch.nn.Module, batch: Any) -> Iterator[None]:
    """Within the context, ``model``'s input embeddings at ``batch``'s mixed response positions are the mixtures.

    The hook recognises the calls of :func:`rlpost.models.logprobs.packed_response_states`
    by their input ids: ``[b, P + R]`` whose last ``R`` columns are the responses (the
    plain forward; offset ``P``) or ``[b, R]`` equal to the responses (the shared-prefix
    response forward; offset 0). Any other call (the shared prompts) is left alone.
    """
    resp = batch.response_ids
    b, R = resp.shape
    mix = _mixture_of(batch, R)
    if mix is None:
        yield
        return
    mixed, ids, w = mix
    rows, pos = mixed.nonzero(as_tuple=True)
    embed = model.get_input_embeddings()
    busy = [False]

    def hook(module, args, output):
        if busy[0] or not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 2:
            return None
        x = args[0]
        if x.shape[0] != b or x.shape[1] < R or not torch.equal(x[:, x.shape[1] - R:].cpu(), resp.cpu()):
            return None
        off = x.shape[1] - R
        busy[0] = True
        try:
            dev = output.device
            m = mixed_embedding(module, ids[rows, pos].to(dev), w[rows, pos].to(dev))
        finally:
            busy[0] = False
        return output.index_put((rows.to(dev), (pos + off).to(dev)), m.to(output.dtype))

    handle = embed.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@METHODS.register("n_grpo", paper="N-GRPO: Embedding-Level Neighbor Mixing for Enhanced Policy Optimization "
                  "(arXiv:2606.10768)")
class NeighborMixedInputs(Method):
    """Feed the trainer's log-prob passes the rollout's mixed input embeddings (``sampler=neighbor_mixing``)."""

    name = "n_grpo"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return str(cfg.sampler.name) == "neighbor_mixing"

    def validate(self) -> None:
        ro = self.cfg.rollout
        if str(ro.get("engine", "")) != "hf" or ro.get("speculative") is not None:
            raise ConfigError("sampler=neighbor_mixing feeds mixed input embeddings step by step, which only the "
                              f"plain transformers engine runs (got rollout.engine={ro.get('engine')!r}"
                              f"{', speculative decoding' if ro.get('speculative') is not None else ''}). Fix: rollout=hf.")

    def logprob_context(self, model: torch.nn.Module, batch: Any) -> Any:
        return mixed_inputs(model, batch)
