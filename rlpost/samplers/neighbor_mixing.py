"""``sampler=neighbor_mixing``: N-GRPO's embedding-level neighbour mixing during rollout.

"N-GRPO: Embedding-Level Neighbor Mixing for Enhanced Policy Optimization" (Zhu, Yu, Di, Zhu;
arXiv:2606.10768; code https://github.com/ZJUSCL/N-GRPO). Group sampling, except that at a
random fraction of decode steps the model is fed, instead of the embedding of the token it
just drew, a probability-weighted mixture of that step's most likely token (the anchor) and
the anchor's nearest neighbours in the input-embedding table. The recorded token stays the
sampled one; what changes is the input the next steps see, so the rollout explores near the
policy's own continuation in embedding space.

One step ``t`` of row ``r``, as in the authors' release (sglang ``sampler.py`` "latent
rollout", ``mix_strategy: neighbor``; config ``configs/n-grpo_1_5b.yaml``):

1. with probability ``mix_rate`` (a fresh Bernoulli draw per row and step) the step mixes;
2. anchor ``a = argmax_v p_t(v)``, ``p_t`` the distribution the step sampled from
   (temperature and top-k/p applied);
3. neighbours: the ``mix_top_k - 1`` rows of the embedding table ``E`` most similar to
   ``E[a]`` (``neighbor_metric``: cosine, dot, negative L1 or negative squared L2), ``a``
   itself excluded;
4. weights ``w_j = p_t(id_j) / sum_i p_t(id_i)`` over ``[a, neighbours]``;
5. the input at position ``t`` is ``sum_j w_j emb(id_j)`` (``emb`` the model's input
   embedding module) instead of ``emb(token_t)``.

Mixing stops for a row once its response contains ``stop_mixing_at`` (the release: the
answer marker ``</think>``; the step that completes it already feeds its own token) and never
runs in evaluation. The sampler records, per response position, whether it mixed, the
``mix_top_k`` ids and their weights (``extras['nm_mixed']``, ``'nm_id<j>'``, ``'nm_w<j>'``,
``[B, R]``); :mod:`rlpost.methods.n_grpo` feeds the trainer's log-prob passes the same
inputs (weights held constant, gradient through the embedding table), so the rollout
log-probs and the trainer's pre-update log-probs agree.

Choices of ours: the Bernoulli draw is counter-based per row and position (seeded runs
repeat; the release calls ``torch.rand``); the release's verl-side hf rollout decodes unmixed
steps greedily, its sglang rollout (the one the paper's config runs) samples them, as here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from rlpost.core.registry import param
from rlpost.samplers.base import SAMPLERS, Sampler, engine_model, generate_groups, step_params
from rlpost.samplers.input_mixing import MixtureKeys, mixed_embedding, mixture_extras

#: similarity of embedding rows to the anchor's (the release's ``neighbor_metric``)
METRICS = ("cosine", "dot", "l1", "l2")
#: the ``extras`` keys of the mixtures (``nm_mixed``, ``nm_id<j>`` with 0 the anchor, ``nm_w<j>``)
KEYS = MixtureKeys("nm")
MIXED_KEY = KEYS.mixed
ID_KEY, WEIGHT_KEY = "nm_id{}", "nm_w{}"
_SALT = 0x4E475250  # "NGRP": the mixing draws' stream differs from the token draws'


def neighbour_ids(weight: torch.Tensor, anchor: torch.Tensor, k: int, metric: str,
                  unit: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[n, k]`` ids: each anchor, then its ``k - 1`` nearest rows of ``weight`` (the anchor excluded).

    Args:
        weight: ``[V, H]`` input-embedding table.
        anchor: ``[n]`` token ids.
        k: ids per row, >= 1.
        metric: ``cosine``, ``dot``, ``l1`` (nearest: smallest L1 distance) or ``l2``
            (smallest squared Euclidean distance).
        unit: ``weight`` with unit rows (cosine only; computed when None).
    Raises:
        ValueError: an unknown metric or ``k < 1``.
    """
    if metric not in METRICS:
        raise ValueError(f"neighbor_metric={metric!r}: use one of {', '.join(METRICS)}")
    if k < 1:
        raise ValueError(f"mix_top_k={k} must be >= 1 (the anchor alone is 1)")
    if k == 1:
        return anchor[:, None]
    W = weight.float()
    a = W[anchor]  # [n, H]
    if metric == "cosine":
        u = F.normalize(W, dim=-1) if unit is None else unit
        sim = F.normalize(a, dim=-1) @ u.T
    elif metric == "dot":
        sim = a @ W.T
    elif metric == "l1":
        sim = -torch.cdist(a, W, p=1)
    else:
        sim = 2 * a @ W.T - (W * W).sum(-1)[None] - (a * a).sum(-1, keepdim=True)
    sim = sim.scatter(1, anchor[:, None], float("-inf"))
    return torch.cat([anchor[:, None], sim.topk(k - 1, dim=-1).indices], dim=1)


def mixing_weights(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` weights ``p(id_j) / sum_i p(id_i)`` of ``ids`` ``[n, k]`` under ``logp`` ``[n, V]`` (log-probs).

    A neighbour outside the sampler's top-k/p set has probability 0 and weight 0; the
    anchor always has positive probability, so the sum is positive.
    """
    p = logp.float().gather(-1, ids).exp()
    return p / p.sum(-1, keepdim=True).clamp_min(1e-12)



@dataclass(frozen=True)
class NeighborMixingSamplerParams:
    """Parameters of :class:`NeighborMixingSampler` (N-GRPO, arXiv:2606.10768; the release's 1.5B config)."""

    mix_top_k: int = param(2, "ids per mixture: the anchor and mix_top_k - 1 embedding neighbours "
                           "(release: 2 for 1.5B, 3 for 7B).")
    mix_rate: float = param(0.1, "probability that a decode step mixes, in [0, 1] (release: 0.1 for 1.5B, 0.15 for 7B).")
    neighbor_metric: str = param("cosine", "similarity of embedding rows: cosine, dot, l1 or l2.")
    stop_mixing_at: str = param("</think>", "a row stops mixing once its response contains this text "
                                "(the answer marker); empty: mix the whole response.")


def _neighbor_mixing_example(logprobs: torch.Tensor, generator: torch.Generator) -> dict:
    """What the decode hook records on a third of the positions: anchor and one neighbour, weights .7 / .3
    (token ids below 100, inside every test vocabulary)."""
    shape = tuple(logprobs.shape)
    m = (torch.rand(shape, generator=generator) < 0.33).float()
    return {"batch_extras": {"nm_mixed": m, "nm_id0": torch.randint(10, 100, shape, generator=generator),
                             "nm_w0": 0.7 * m, "nm_w1": 0.3 * m,
                             "nm_id1": torch.randint(0, 100, shape, generator=generator)}}


@SAMPLERS.register(
    "neighbor_mixing",
    paper="N-GRPO: Embedding-Level Neighbor Mixing for Enhanced Policy Optimization (arXiv:2606.10768)",
    description="Group sampling that feeds, at a random fraction of steps, a mixture of the top token's "
                "embedding-space neighbours.",
    params=NeighborMixingSamplerParams,
    process_local_hooks="the mixed inputs its decode hook records for the trainer",
    example_inputs=_neighbor_mixing_example,
)
class NeighborMixingSampler(Sampler):
    """``n_samples`` rollouts per prompt with N-GRPO's neighbour mixing (see the module docstring).

    Needs the engine's torch model (``rollout=hf``): the mixture is fed as ``inputs_embeds``
    through the engine's decode hook (:data:`rlpost.rollout.base.DecodeHook`).

    Args:
        mix_top_k: ids per mixture (>= 1; 1 feeds the anchor's own embedding).
        mix_rate: per-step mixing probability in [0, 1].
        neighbor_metric: ``cosine``, ``dot``, ``l1`` or ``l2``.
        stop_mixing_at: answer marker after which a row stops mixing ('' never stops).
    Raises:
        ValueError: a parameter out of range.
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int, *, mix_top_k: int, mix_rate: float, neighbor_metric: str,
                 stop_mixing_at: str) -> None:
        super().__init__(n_samples)
        if not 0.0 <= float(mix_rate) <= 1.0:
            raise ValueError(f"mix_rate={mix_rate} must be in [0, 1] (release: 0.1)")
        if int(mix_top_k) < 1:
            raise ValueError(f"mix_top_k={mix_top_k} must be >= 1 (release: 2)")
        if str(neighbor_metric) not in METRICS:
            raise ValueError(f"neighbor_metric={neighbor_metric!r}: use one of {', '.join(METRICS)}")
        self.k, self.rate = int(mix_top_k), float(mix_rate)
        self.metric, self.stop = str(neighbor_metric), str(stop_mixing_at)

    def _stop_ids(self, engine) -> List[int]:
        if not self.stop:
            return []
        return list(engine.tokenizer.encode(self.stop, add_special_tokens=False))

    def decode_hook(self, engine, seed: Optional[int]):
        """``(hook, record)``: the engine's decode hook and the dict it fills, ``(row, t) -> (ids [k], w [k])``."""
        from rlpost.rollout.hf import _wrap64, row_uniforms

        embed = engine_model(engine, "sampler=neighbor_mixing feeds mixed input embeddings to the decoder").get_input_embeddings()
        W = embed.weight.detach()
        unit = F.normalize(W.float(), dim=-1) if self.metric == "cosine" and self.k > 1 else None
        stop_ids = self._stop_ids(engine)
        record: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        recent: Dict[int, List[int]] = {}
        done: set = set()

        def hook(logp: torch.Tensor, tok: torch.Tensor, rows: torch.Tensor, t: int):
            n = tok.shape[0]
            if stop_ids:
                for i, r in enumerate(rows.tolist()):
                    h = recent.setdefault(r, [])
                    h.append(int(tok[i]))
                    del h[:-len(stop_ids)]
                    if h == stop_ids:
                        done.add(r)
            if seed is None:
                u = torch.rand(n, dtype=torch.float64)
            else:
                u = row_uniforms(torch.tensor([_wrap64(seed + _SALT + int(r)) for r in rows.tolist()]), t)
            mix = (u < self.rate) & torch.tensor([int(r) not in done for r in rows.tolist()], dtype=torch.bool)
            if not bool(mix.any()):
                return tok, None
            idx = mix.nonzero().squeeze(-1)
            ids = neighbour_ids(W, logp[idx].argmax(-1).to(W.device), self.k, self.metric, unit)
            w = mixing_weights(logp[idx].to(W.device), ids)
            embeds = embed(tok.to(W.device))
            embeds[idx] = mixed_embedding(embed, ids, w)
            for i, r in enumerate(rows[idx].tolist()):
                record[(r, t)] = (ids[i].cpu(), w[i].cpu())
            return tok, embeds

        return hook, record

    def extras_of(self, record: Dict, B: int, R: int) -> Dict[str, torch.Tensor]:
        """The ``[B, R]`` extras of ``record``: ``nm_mixed`` (0/1), ``nm_id<j>`` (long), ``nm_w<j>`` (float)."""
        return mixture_extras(record, B, R, self.k, KEYS)

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        p = step_params(params, ctx, 0)
        seed = None if p.seed is None else int(p.seed) + int(p.row_offset)
        hook, record = self.decode_hook(engine, seed)
        res = generate_groups(engine, prompts, self.counts(len(prompts), ctx), dataclasses.replace(p, decode_hook=hook))
        gen = res.generation
        B, R = gen.response_ids.shape
        ex = self.extras_of(record, B, R)
        real = gen.response_mask > 0
        ex[MIXED_KEY] = ex[MIXED_KEY] * real.float()
        res.extras.update(ex)
        m = ex[MIXED_KEY] > 0
        res.metrics["sampler/nm_mixed_fraction"] = float(m.sum() / real.sum().clamp(min=1))
        if m.any():
            res.metrics["sampler/nm_anchor_weight_mean"] = float(ex[WEIGHT_KEY.format(0)][m].mean())
            res.metrics["sampler/nm_token_is_anchor"] = float((gen.response_ids[m] == ex[ID_KEY.format(0)][m]).float().mean())
        return res
