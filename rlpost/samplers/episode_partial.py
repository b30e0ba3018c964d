"""Partial rollouts of multi-turn episodes: unfinished episodes carried across RL steps.

``executor.partial_rollout=true`` with ``env=...`` (``sampler=episode``). The token-chunk producer
of :mod:`rlpost.core.partial` continues plain responses; an episode also has an environment, a turn
count and inserted environment text, so this producer carries the episodes themselves
(:class:`rlpost.samplers.episode._Episode`: token ids, loss mask, per-token rollout log-probs and
temperatures, turn count, the live environment object, the transcript) and advances them one
**turn** per round (:meth:`rlpost.samplers.episode.EpisodeSampler.round`).

The schedule is APRIL's ("APRIL: Active Partial Rollouts in Reinforcement Learning to Tame
Long-tail Generation", arXiv:2509.18521), with a model turn as the unit of work instead of a token
chunk: keep ``ceil(over_provision * needed)`` groups in flight, run rounds under the current
weights until ``needed`` groups are complete (at least one round), release the ``needed`` oldest
complete groups and carry the rest, finished or not, into the next step. A carried episode resumes
at its next turn under the newer weights: its earlier tokens keep the log-probs of the policy that
sampled them (CoPRIS cross-stage importance sampling, "CoPRIS: Efficient and Stable Reinforcement
Learning via Concurrency-Controlled Partial Rollout with Importance Sampling", arXiv:2511.05589),
and ``token_version`` records, per token, the version that sampled it (inserted environment text:
the version of the turn it answers).

Not combined with branching (``sampler.params.branching``) or with episode-level environment
rewards (use ``env_reward_at=turn``); the runner refuses both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch

from rlpost.core.partial import PartialStep, StitchedBatch, num_requests, take_from_queue
from rlpost.rollout.hf import left_pad
from rlpost.samplers.base import SamplerContext


@dataclass
class EpisodePartialStep(PartialStep):
    """:class:`rlpost.core.partial.PartialStep` plus what episodes add.

    Attributes:
        texts: each row's final-turn text (what the verifier scores).
        extras: per-row episode extras (``response_attn``, ``episode_turns``, ``turn_rewards`` ...).
        episodes: the released episodes, row order (for transcripts).
    """

    texts: List[str] = field(default_factory=list)
    extras: Dict[str, torch.Tensor] = field(default_factory=dict)
    episodes: List[Any] = field(default_factory=list)


class EpisodePartialProducer:
    """Carries unfinished multi-turn episodes across RL steps (APRIL schedule, one turn per round).

    Args:
        sampler: the run's :class:`rlpost.samplers.episode.EpisodeSampler` (environment, limits,
            the task and training examples given by ``attach``).
        group_size: episodes per prompt (released whole).
        over_provision: APRIL's factor (>= 1).
        pad_id: padding id.

    Raises:
        ValueError: ``over_provision < 1`` or ``group_size < 1``; branching on.
    """

    def __init__(self, sampler: Any, group_size: int, over_provision: float = 1.0, pad_id: int = 0) -> None:
        if over_provision < 1 or group_size < 1:
            raise ValueError(f"over_provision={over_provision} must be >= 1 and group_size={group_size} >= 1")
        if sampler.branching != "none":
            raise ValueError("partial rollouts of episodes do not branch; set sampler.params.branching=none")
        self.sampler = sampler
        self.group_size, self.over_provision, self.pad_id = int(group_size), float(over_provision), int(pad_id)
        self.groups: Dict[int, List[Any]] = {}  # group key -> its episodes (insertion order = age)
        self.group_prompt: Dict[int, int] = {}  # group key -> dataset index
        self.next_key = 0
        self.queue: List[int] = []
        self.version_step: Dict[int, int] = {}

    @property
    def buffer(self) -> "EpisodePartialProducer":  # the runner reads producer.buffer only for len()
        return self

    def __len__(self) -> int:
        return sum(len(v) for v in self.groups.values())

    def _ready(self) -> List[int]:
        return [g for g, eps in self.groups.items() if all(e.done for e in eps)]

    def _open_groups(self, take: List[int], encode: Any, tok: Any) -> None:
        """A new group of ``group_size`` fresh episodes for each prompt index in ``take``."""

        s = self.sampler
        for idx in take:
            ctx = SamplerContext(prompt_indices=[idx])
            g = self.next_key
            self.next_key += 1
            self.groups[g] = []
            for _ in range(self.group_size):
                e = s._new_episode(ctx, 0, list(encode(idx)), tok)
                e.pos = g
                self.groups[g].append(e)
            self.group_prompt[g] = idx

    def _advance(self, needed: int, engine: Any, params: Any, version: int, tok: Any, eos_ids: set) -> tuple:
        """Turn rounds over every live episode until ``needed`` groups are complete or none is live;
        returns ``(rounds, generated model tokens)``."""
        import contextlib
        import dataclasses

        s = self.sampler
        rounds = tokens = 0
        session = getattr(engine, "session", None)
        with (session() if session is not None else contextlib.nullcontext()):
            while True:
                live = [e for eps in self.groups.values() for e in eps if not e.done]
                if live:
                    p = params
                    if rounds and params.seed is not None:
                        p = dataclasses.replace(params, seed=int(params.seed) + 7919 * rounds)
                    before = sum(int(sum(e.mask)) for e in live)
                    s.round(engine, live, p, tok, eos_ids)
                    tokens += sum(int(sum(e.mask)) for e in live) - before
                    for e in live:
                        e.vers.extend([int(version)] * (len(e.ids) - len(e.vers)))
                        e.rounds += 1
                    rounds += 1
                if len(self._ready()) >= needed or not live:
                    break
        return rounds, tokens

    def produce(self, needed: int, select: Any, encode: Any, engine: Any, params: Any,
                version: int, weights_step: int) -> EpisodePartialStep:
        """Top up, advance carried and new episodes turn by turn, release ``needed`` complete groups.

        Same contract as :meth:`rlpost.core.partial.PartialRolloutProducer.produce` (``select``,
        ``encode``, ``version``, ``weights_step``; round ``r > 0`` samples with
        ``params.seed + 7919 * r``), with episodes: every row's ``response_ids`` are its model
        turns and inserted environment text, id for id as sampled and inserted, ``response_mask``
        1 exactly on the model's tokens.

        Returns:
            an :class:`EpisodePartialStep` (its ``batch`` a :class:`rlpost.core.partial.StitchedBatch`);
            metrics as the token producer's (``partial/...``) plus the ``episode/...`` ones of
            the released episodes.
        Raises:
            ValueError: ``needed < 1``; RuntimeError: ``select()`` returned nothing.
        """

        if needed < 1:
            raise ValueError(f"needed={needed} must be >= 1")
        s, tok = self.sampler, engine.tokenizer
        eos_ids = set(getattr(engine, "eos_ids", None) or [tok.eos_token_id])
        self.version_step[int(version)] = int(weights_step)
        for eps in self.groups.values():
            for e in eps:
                if not e.done and e.ids:
                    e.resumed = True
        carried_in = len(self.groups)
        new = num_requests(needed, self.over_provision, carried_in)
        take, self.queue = take_from_queue(self.queue, new, select)
        self._open_groups(take, encode, tok)
        rounds, tokens = self._advance(needed, engine, params, version, tok, eos_ids)
        keys = self._ready()[:needed]
        assert len(keys) == needed  # in flight + new >= needed, and every episode ends within max_turns rounds
        popped = [(self.groups.pop(g), self.group_prompt.pop(g)) for g in keys]
        eps = [e for members, _ in popped for e in members]
        prompt_index = [idx for members, idx in popped for _ in members]
        pos = {g: k for k, g in enumerate(keys)}
        res = s._assemble(eps, [pos[e.pos] for e in eps], engine, None, left_pad)
        if s.void_turn_filter and s.task is not None:
            for e in eps:
                if e.finished and s.task.extract_answer(e.final_text) is None:
                    e.void = True
            void = torch.tensor([e.void for e in eps], dtype=torch.bool)
            res.generation.response_mask[void] = 0.0
            res.metrics["episode/void_filtered_frac"] = float(void.float().mean())
        gen = res.generation
        B, R = gen.response_ids.shape
        tv = torch.full((B, R), -1, dtype=torch.long)
        for i, e in enumerate(eps):
            tv[i, : len(e.vers)] = torch.tensor(e.vers, dtype=torch.long)
        sb = StitchedBatch(gen.prompt_ids, gen.prompt_mask, gen.response_ids, gen.response_mask, gen.rollout_logprobs,
                           tv, gen.finished, torch.tensor([e.pos for e in eps], dtype=torch.long),
                           [{"prompt_index": i} for i in prompt_index], gen.temperatures,
                           torch.tensor([e.rounds for e in eps], dtype=torch.long))
        token_step = torch.full_like(tv, -1)
        for v in tv.unique().tolist():
            if v >= 0:
                token_step[tv == v] = self.version_step[int(v)]
        live_v = {v for g in self.groups.values() for e in g for v in e.vers} | {int(version)}
        self.version_step = {v: st for v, st in self.version_step.items() if v in live_v}
        m = gen.response_mask.bool()
        n_versions = torch.tensor([len(set(tv[b][m[b]].tolist())) for b in range(B)], dtype=torch.float32)
        metrics = {
            "partial/new_groups": float(new),
            "partial/carried_in_groups": float(carried_in),
            "partial/carried_groups": float(len(self.groups)),
            "partial/carried_responses": float(len(self)),
            "partial/carried_tokens": float(sum(len(e.ids) for g in self.groups.values() for e in g)),
            "partial/rounds": float(rounds),
            "partial/tokens_generated": float(tokens),
            "partial/rounds_mean": float(sum(e.rounds for e in eps) / B),
            "partial/resumed_frac": float(sum(bool(e.resumed) for e in eps) / B),
            "partial/multi_version_frac": float((n_versions > 1).float().mean()) if B else 0.0,
            "partial/queued_prompts": float(len(self.queue)),
            **res.metrics,
        }
        return EpisodePartialStep(sb, prompt_index, token_step, new, rounds, tokens, metrics,
                                  texts=list(gen.texts), extras=dict(res.extras), episodes=eps)

    def state_dict(self) -> Dict[str, Any]:
        """Queued prompts and the version map. Carried episodes hold live environments (processes, game
        state) and are not saved: a run resumed from a checkpoint restarts its unfinished episodes."""
        return {"queue": list(self.queue), "version_step": dict(self.version_step)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the queue; unfinished episodes are not restored, see there)."""
        self.queue = [int(i) for i in state.get("queue", [])]
        self.version_step = {int(v): int(st) for v, st in state.get("version_step", {}).items()}
