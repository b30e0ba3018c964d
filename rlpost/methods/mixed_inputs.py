"""The trainer side of the samplers that feed mixed input embeddings (N-GRPO, M3PO).

A sampler built on :mod:`rlpost.samplers.input_mixing` feeds the decoder, at some response
positions, a weighted sum of token embeddings instead of the recorded token's embedding, and
records the ids and weights. The trainer's log-prob passes (pre-update, reference, update) must
score the responses on the same inputs, or the rollout and trainer log-probs disagree (and the
update would train the policy on inputs it never saw). :func:`mixed_inputs` does that with a
forward hook on the input-embedding module; :class:`MixedInputsMethod` is the method base both
``n_grpo`` ("N-GRPO: Embedding-Level Neighbor Mixing for Enhanced Policy Optimization",
arXiv:2606.10768) and ``m3po`` ("Multi-Path Collaborative Reasoning via Reinforcement Learning",
arXiv:2512.01485) register, each naming its sampler and its extras keys.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from rlpost.core.errors import ConfigError
from rlpost.methods.base import Method
from rlpost.samplers.input_mixing import MixtureKeys, mixed_embedding, mixture_of


@contextlib.contextmanager
def mixed_inputs(model: torch.nn.Module, batch: Any, keys: MixtureKeys) -> Iterator[None]:
    """Within the context, ``model``'s input embeddings at ``batch``'s mixed response positions are the mixtures.

    The mixtures are ``sum_j w_j embed(id_j)`` from ``batch.extras`` (``keys``), the weights
    constant, the gradient through the embedding table. The hook recognises the calls of
    :func:`rlpost.models.logprobs.packed_response_states` by their input ids: ``[b, P + R]``
    whose last ``R`` columns are the responses (the plain forward; offset ``P``) or ``[b, R]``
    equal to the responses (the shared-prefix response forward; offset 0). Any other call (the
    shared prompts) is left alone. Each row's mixtures depend on its own extras only, so a
    micro-batch (a slice of rows with its extras) gets the same inputs as the whole batch.
    """
    resp = batch.response_ids
    b, R = resp.shape
    mix = mixture_of(batch.extras, R, keys)
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


class MixedInputsMethod(Method):
    """Base of the methods whose sampler feeds mixed input embeddings: the trainer's passes see the same inputs.

    Subclasses set ``name`` (and register), ``sampler`` (the ``sampler.name`` they apply to) and
    ``keys`` (the sampler's :class:`MixtureKeys`).
    """

    sampler = ""
    keys = MixtureKeys("")

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(cls.sampler) and str(cfg.sampler.name) == cls.sampler

    def validate(self) -> None:
        """Raises ConfigError unless the rollout engine is the plain transformers one (the one running decode hooks)."""
        ro = self.cfg.rollout
        if str(ro.get("engine", "")) != "hf" or ro.get("speculative") is not None:
            raise ConfigError(f"sampler={self.sampler} feeds mixed input embeddings step by step, which only the "
                              f"plain transformers engine runs (got rollout.engine={ro.get('engine')!r}"
                              f"{', speculative decoding' if ro.get('speculative') is not None else ''}). Fix: rollout=hf.")

    def logprob_context(self, model: torch.nn.Module, batch: Any) -> Any:
        return mixed_inputs(model, batch, self.keys)
