"""``sampler=m3po``: M3PO's multi-path collaborative rollouts (a group's paths mix their inputs while thinking).

"Multi-Path Collaborative Reasoning via Reinforcement Learning" (Lv, Zhou, Zhu, Wang, Huang, Lv;
arXiv:2512.01485, v2 read; the method is called Multi-Path Perception Policy Optimization, M3PO;
project page https://multi-path-collaborative-reasoning.github.io, whose code link says "coming
soon": no authors' code was read). The ``N`` rollouts of one prompt are decoded together, and at
every thinking step each path is fed, instead of the embedding of the token it just sampled, a
convex combination of that embedding and its peers' sampled-token embeddings, the peers weighted
by how similar their next-token distributions are to its own.

One decode step ``l`` of a group (section 3.2, Eqs. 2-6), for the paths ``i`` still thinking:

1. ``p_i``: the distribution path ``i`` sampled its token ``x_i`` from at step ``l``;
2. ``S_ij = p_i . p_j / (|p_i| |p_j|)`` (cosine of the distributions, Eq. 3), the diagonal masked
   (Eq. 4);
3. ``A_ij = exp(S_ij / T) / sum_{k != i} exp(S_ik / T)`` over the peers ``j != i`` (Eq. 5);
4. ``c_i = sum_j A_ij e(x_j)`` (Eq. 6), ``e`` the model's input-embedding module;
5. the input fed after ``x_i`` is ``h_i = (1 - lambda) e(x_i) + lambda c_i`` (Eq. 2) instead of
   ``e(x_i)``.

The recorded token stays ``x_i``; ``h_i`` is a weighted sum of token embeddings with ids
``[x_i, x_j for the peers]`` and weights ``[1 - lambda, lambda A_ij]``, recorded in
``extras['m3po_mixed' / 'm3po_id<j>' / 'm3po_w<j>']`` (:mod:`rlpost.samplers.input_mixing`).
:mod:`rlpost.methods.m3po` feeds the trainer's log-prob passes the same inputs (Eq. 8: "the
gradient updates are computed using the hybrid thinking embeddings as context"), weights
constant, gradient through the embedding table. Paper defaults (Table 3): ``lambda = 0.1``,
``T = 0.1``, group size 4 (QA) / 8 (math). The mechanism runs only in training rollouts:
evaluation decodes single paths (the paper's "Inference").

Thinking phase: a path thinks until it writes the delimiter ``####`` (the paper's prompt puts the
answer after it; "the answer phase remains isolated"), and "when a trajectory exits the thinking
mode it no longer participates in subsequent cross-path collaboration". Our reading of the
details the text leaves open:

- a path exits at the step whose token completes the delimiter (or is EOS, or completes a stop
  string): from that step on it neither mixes nor is a peer (the step feeds its own token);
- the paper sets an exited path's similarities to 0 "before the softmax" yet says it neither
  contributes nor receives: we leave it out of the softmax (weight exactly 0);
- a path with no thinking peer left is fed its own token's embedding;
- ``p_i`` is the distribution the step sampled from (the rollout temperature and top-k/p
  applied; at the default temperature 1 without truncation, the policy's own);
- the paper's text says the gating "computes cooperation weights based on distributional
  consistency and value estimates"; its equations have no value term, and we follow the equations.

A group's paths must be in one decode batch: the sampler packs whole groups into engine calls of
at most ``rollout.batch_size`` rows (each call keeps the rows' sampling streams, ``row_offset``),
and a group larger than that is an error; under data-parallel rollouts each call is one group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from rlpost.core.errors import ConfigError
from rlpost.core.registry import param
from rlpost.rollout.base import concat_generations
from rlpost.samplers.base import SAMPLERS, Sampler, SampleResult, engine_model, generate_groups, step_params
from rlpost.samplers.input_mixing import MixtureKeys, MixtureRecord, mixed_embedding, mixture_extras

#: the ``extras`` keys of the mixtures: ``m3po_id0`` the path's own token, then its peers'
KEYS = MixtureKeys("m3po")


def cross_path_attention(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[m, m]`` cooperative weights ``A`` (Eqs. 3-5) of ``m`` paths' next-token distributions ``probs`` ``[m, V]``.

    ``A[i, j] = softmax_{j != i}(cos(p_i, p_j) / temperature)``, ``A[i, i] = 0``; each row sums
    to 1 when ``m >= 2`` (a single path gets the all-zero row: no peer).

    Raises:
        ValueError: ``temperature <= 0``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (paper: 0.1)")
    p = F.normalize(probs.double(), dim=-1)
    s = (p @ p.T) / float(temperature)
    m = s.shape[0]
    if m < 2:
        return torch.zeros(m, m, dtype=probs.dtype if probs.is_floating_point() else torch.float32)
    eye = torch.eye(m, dtype=torch.bool, device=s.device)
    return torch.softmax(s.masked_fill(eye, float("-inf")), dim=-1).float()


def hybrid_mixtures(probs: torch.Tensor, tokens: torch.Tensor, lam: float, temperature: float
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ids and weights of the hybrid thinking embeddings of ``m`` thinking paths of one group (Eq. 2).

    Args:
        probs: ``[m, V]`` each path's next-token distribution at this step.
        tokens: ``[m]`` each path's sampled token.
        lam: ``lambda`` in [0, 1], the peers' share.
        temperature: ``T`` > 0 of the cross-path softmax.
    Returns:
        ``(ids [m, m] long, weights [m, m] float)``: row ``i`` is ``[x_i, x_j for j != i in order]``
        with weights ``[1 - lam, lam * A_ij]``, so ``h_i = sum_j weights[i, j] e(ids[i, j])``.
    """
    m = tokens.shape[0]
    A = cross_path_attention(probs, temperature)
    ids = torch.empty(m, m, dtype=torch.long)
    w = torch.empty(m, m)
    for i in range(m):
        peers = [j for j in range(m) if j != i]
        ids[i, 0] = tokens[i]
        w[i, 0] = 1.0 - lam
        ids[i, 1:] = tokens[peers]
        w[i, 1:] = lam * A[i, peers]
    return ids, w


@dataclass(frozen=True)
class M3POSamplerParams:
    """Parameters of :class:`M3POSampler` (M3PO, arXiv:2512.01485, Table 3)."""

    mix_lambda: float = param(0.1, "lambda of Eq. 2, the peers' share of a thinking path's input, in [0, 1] "
                              "(paper: 0.1; collapse at >= 0.5, 0 is plain group sampling).")
    attn_temperature: float = param(0.1, "T of Eq. 5, the temperature of the softmax over peers' distribution "
                                    "similarities, > 0 (paper: 0.1; 0.5 and 1.0 did worse).")
    think_end: str = param("####", "a path stops mixing, and stops being a peer, once its response contains this "
                           "text (the paper's answer delimiter); empty: the whole response thinks.")


def _m3po_example(logprobs: torch.Tensor, generator: torch.Generator) -> dict:
    """What the decode hook records on a third of the positions: the path's own token at 1 - lambda and three
    peers' tokens sharing lambda = .1 (token ids below 100, inside every test vocabulary)."""
    shape = tuple(logprobs.shape)
    m = (torch.rand(shape, generator=generator) < 0.33).float()
    rec = {"m3po_mixed": m, "m3po_w0": 0.9 * m, "m3po_w1": 0.06 * m, "m3po_w2": 0.03 * m, "m3po_w3": 0.01 * m}
    for j in range(4):
        rec[f"m3po_id{j}"] = torch.randint(10, 100, shape, generator=generator)
    return {"batch_extras": rec}


@SAMPLERS.register(
    "m3po",
    paper="Multi-Path Collaborative Reasoning via Reinforcement Learning (M3PO, arXiv:2512.01485)",
    description="Group sampling whose paths, while thinking, are fed their token's embedding mixed with their "
                "peers', weighted by next-token distribution similarity.",
    params=M3POSamplerParams,
    process_local_hooks="the mixed inputs its decode hook records for the trainer",
    example_inputs=_m3po_example,
)
class M3POSampler(Sampler):
    """``n_samples`` rollouts per prompt with M3PO's cross-path mixing (see the module docstring).

    Needs the engine's torch model (``rollout=hf``): the mixtures are fed as ``inputs_embeds``
    through the engine's decode hook (:data:`rlpost.rollout.base.DecodeHook`).

    Args:
        mix_lambda: ``lambda`` in [0, 1].
        attn_temperature: ``T`` > 0.
        think_end: the answer delimiter ('' never stops).
    Raises:
        ValueError: a parameter out of range.
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int, *, mix_lambda: float, attn_temperature: float, think_end: str) -> None:
        super().__init__(n_samples)
        if not 0.0 <= float(mix_lambda) <= 1.0:
            raise ValueError(f"mix_lambda={mix_lambda} must be in [0, 1] (paper: 0.1)")
        if not float(attn_temperature) > 0:
            raise ValueError(f"attn_temperature={attn_temperature} must be > 0 (paper: 0.1)")
        self.lam, self.T, self.think_end = float(mix_lambda), float(attn_temperature), str(think_end)

    def decode_hook(self, engine, sizes: Sequence[int], stop: Sequence[str] = ()):
        """``(hook, record)`` for one engine call whose rows are groups of ``sizes`` rows, in order.

        ``record`` fills with ``(call row, t) -> (ids [k], weights [k])``, ``k = max(sizes)``
        (a smaller group's mixtures are padded with the path's own id at weight 0).
        """
        embed = engine_model(engine, "sampler=m3po feeds mixed input embeddings to the decoder").get_input_embeddings()
        dev = embed.weight.device
        group = [g for g, n in enumerate(sizes) for _ in range(int(n))]
        k = max([int(n) for n in sizes] + [1])
        eos = set(int(e) for e in (getattr(engine, "eos_ids", None) or ()))
        markers = [s for s in [self.think_end, *stop] if s]
        tokenizer = getattr(engine, "tokenizer", None)
        history: Dict[int, List[int]] = {}
        exited: set = set()
        record: MixtureRecord = {}

        def hook(logp: torch.Tensor, tok: torch.Tensor, rows: torch.Tensor, t: int):
            thinking = []
            for i, r in enumerate(rows.tolist()):
                if r in exited:
                    continue
                x = int(tok[i])
                h = history.setdefault(r, [])
                h.append(x)
                if x in eos or (markers and any(s in tokenizer.decode(h[-16:], skip_special_tokens=True)
                                                for s in markers)):
                    exited.add(r)  # this step's token ends the thinking phase: no mixing from here on
                    continue
                thinking.append(i)
            if self.lam == 0.0 or len(thinking) < 2:
                return tok, None
            by_group: Dict[int, List[int]] = {}
            for i in thinking:
                by_group.setdefault(group[int(rows[i])], []).append(i)
            embeds = None
            for members in by_group.values():
                if len(members) < 2:
                    continue  # no thinking peer left: the path is fed its own token
                idx = torch.tensor(members)
                ids, w = hybrid_mixtures(logp[idx].float().exp(), tok[idx], self.lam, self.T)
                if ids.shape[1] < k:  # pad to the call's widest group: own id at weight 0
                    pad = k - ids.shape[1]
                    ids = torch.cat([ids, ids[:, :1].expand(-1, pad)], 1)
                    w = torch.cat([w, torch.zeros(len(members), pad)], 1)
                if embeds is None:
                    embeds = embed(tok.to(dev))
                embeds[idx.to(dev)] = mixed_embedding(embed, ids.to(dev), w.to(dev))
                for a, i in enumerate(members):
                    record[(int(rows[i]), t)] = (ids[a], w[a])
            return tok, embeds

        return hook, record

    def _calls(self, engine, counts: Sequence[int]) -> List[List[int]]:
        """Prompt indices of each engine call: whole groups, at most the engine's ``batch_size`` rows.

        Raises:
            ConfigError: a group larger than the engine's batch.
        """
        cap = int(getattr(engine, "batch_size", 0) or 0)
        one_each = getattr(engine, "inner", None) is not None  # data-parallel rollouts split calls across ranks
        calls: List[List[int]] = []
        rows = 0
        for i, n in enumerate(counts):
            if n <= 0:
                continue
            if cap and n > cap:
                raise ConfigError(f"sampler=m3po decodes a group's {n} paths in one batch, but rollout.batch_size is "
                                  f"{cap}. Fix: rollout.batch_size>={n}.")
            if not calls or one_each or (cap and rows + n > cap):
                calls.append([])
                rows = 0
            calls[-1].append(i)
            rows += n
        return calls

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        p = step_params(params, ctx, 0)
        counts = self.counts(len(prompts), ctx)
        engine_model(engine, "sampler=m3po feeds mixed input embeddings to the decoder")
        parts: List[SampleResult] = []
        record: MixtureRecord = {}
        start = 0
        for call in self._calls(engine, counts):
            sizes = [counts[i] for i in call]
            hook, rec = self.decode_hook(engine, sizes, p.stop)
            q = dataclasses.replace(p, decode_hook=hook, row_offset=int(p.row_offset) + start)
            parts.append(generate_groups(engine, [prompts[i] for i in call], sizes, q, positions=call))
            record.update({(start + r, t): v for (r, t), v in rec.items()})
            start += sum(sizes)
        if not parts:
            raise ValueError("no rollouts requested")
        gen = concat_generations([r.generation for r in parts], int(getattr(engine, "pad_id", 0) or 0))
        res = SampleResult(generation=gen, group_index=torch.cat([r.group_index for r in parts]),
                           rollouts_spent=sum(r.rollouts_spent for r in parts))
        B, R = gen.response_ids.shape
        k = max([c for c in counts if c > 0] + [1])
        ex = mixture_extras(record, B, R, k, KEYS)
        real = gen.response_mask > 0
        ex[KEYS.mixed] = ex[KEYS.mixed] * real.float()
        res.extras.update(ex)
        m = ex[KEYS.mixed] > 0
        res.metrics["sampler/m3po_mixed_fraction"] = float(m.sum() / real.sum().clamp(min=1))
        if bool(m.any()) and k > 1 and self.lam > 0:  # how concentrated the attention over peers is (1: one peer)
            peer = torch.stack([ex[KEYS.weight(j)] for j in range(1, k)], -1)
            res.metrics["sampler/m3po_top_peer_attention"] = float(peer.max(-1).values[m].mean() / self.lam)
        return res
