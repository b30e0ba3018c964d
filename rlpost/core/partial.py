"""Partial rollouts: a carry-over buffer for unfinished responses, and cross-stage behaviour log-probs.

Implements the rollout side of

* **APRIL** -- "APRIL: Active Partial Rollouts in Reinforcement Learning to Tame
  Long-tail Generation", arXiv:2509.18521: over-provision rollout requests
  (``ceil(over_provision * needed)`` in flight), stop a round once its token
  budget is spent, train on what finished and keep the unfinished responses to
  continue in later rounds; and
* **CoPRIS** -- "CoPRIS: Efficient and Stable Reinforcement Learning via
  Concurrency-Controlled Partial Rollout with Importance Sampling"
  (arXiv:2511.05589): the continued response keeps, for every token, the
  log-prob of the policy version that actually sampled it, so importance
  weights against the current trainer are per token and cross policy stages
  (cross-stage importance sampling).

A round (:func:`continue_round`) extends every unfinished entry by at most
``chunk_tokens`` tokens, generating from ``prompt + partial response`` under the
engine's current weights. An entry leaves the buffer when it finished (EOS /
stop string) or reached ``max_new_tokens`` in total (then it is a truncated
rollout, exactly like an unfinished one-shot rollout).

**Groups are kept together.** Group-based advantages (GRPO, DAPO, ...) need
every member of a prompt's group, so entries are added a whole group at a time
(:meth:`PartialRolloutBuffer.add_group`) and :meth:`PartialRolloutBuffer.pop_ready`
releases a group only once *all* its members are done; no partial group is ever
returned. A group-free setup is the special case ``group size 1``.

**Driving it.** :class:`PartialRolloutProducer` is what the runner calls each
step when ``executor.partial_rollout=true`` (with ``executor=sync`` or
``executor=async``; see :meth:`rlpost.run.runner.Run.collect`): it tops the buffer up
to ``ceil(over_provision * needed)`` groups in flight with prompts from the
selector, runs rounds under the engine's current weights until ``needed`` groups
are complete (at least one round), pops exactly ``needed`` whole groups (oldest
first) and carries everything else into the next step. Its state (buffer, queued
prompts, version map) is saved in checkpoints.

Known limits of continuing with token ids through ``RolloutEngine.generate``:
a stop string that straddles two chunks is only seen if the engine's stop check
decodes the whole continuation (the HF engine decodes the new response only),
and per-token temperature hooks restart their step counter each chunk.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch


def num_requests(needed: int, over_provision: float, in_flight: int) -> int:
    """How many new groups to start this round (APRIL over-provisioning, arXiv:2509.18521).

    APRIL keeps ``ceil(over_provision * needed)`` groups in flight; the ones
    carried over from earlier rounds count.

    Args:
        needed: groups the step must train on (>= 0).
        over_provision: >= 1.
        in_flight: unfinished groups already in the buffer (>= 0).

    Returns:
        ``max(0, ceil(over_provision * needed) - in_flight)``.

    Raises:
        ValueError: ``over_provision < 1`` or a negative count.
    """
    if over_provision < 1:
        raise ValueError(f"over_provision={over_provision} must be >= 1")
    if needed < 0 or in_flight < 0:
        raise ValueError(f"needed={needed} and in_flight={in_flight} must be >= 0")
    return max(0, math.ceil(over_provision * needed - 1e-9) - in_flight)


def take_from_queue(queue: List[int], new: int, select: Callable[[], Sequence[int]]) -> Tuple[List[int], List[int]]:
    """The next ``new`` prompt indices, topping ``queue`` up from the selector first.

    The selector hands out whole batches of prompt indices; the partial-rollout
    schedulers start ``new`` groups per round (:func:`num_requests`), so the rest of a
    selector batch waits in ``queue`` for later rounds.

    Returns:
        ``(take, rest)``: the first ``new`` indices and the remaining queue.

    Raises:
        RuntimeError: ``select()`` returned no prompts while more were needed.
    """
    queue = list(queue)
    while len(queue) < new:
        got = [int(i) for i in select()]
        if not got:
            raise RuntimeError("the selector returned no prompts")
        queue.extend(got)
    return queue[:new], queue[new:]


@dataclass
class PartialEntry:
    """One (possibly unfinished) response in the carry-over buffer (APRIL arXiv:2509.18521; CoPRIS).

    Plain lists, no tensors; raises nothing.

    Attributes:
        prompt_ids: the prompt's token ids (unpadded).
        group: group key (all members of one prompt's group share it).
        response_ids: generated ids so far, length ``n <= max_new_tokens``.
        logprobs: ``n`` behaviour log-probs (nats), each under the policy
            version that sampled that token.
        versions: ``n`` policy versions, one per token.
        temperatures: ``n`` sampling temperatures, one per token, when the
            engine reported them (empty otherwise).
        rounds: chunks (rounds) this entry was extended in.
        finished: EOS / stop string reached.
        done: finished, or ``n == max_new_tokens`` (truncated); a done entry
            gets no more tokens.
        meta: free per-entry payload (e.g. the dataset index).
    """

    prompt_ids: List[int]
    group: int
    response_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)
    temperatures: List[float] = field(default_factory=list)
    rounds: int = 0
    finished: bool = False
    done: bool = False
    meta: Dict[str, Any] = field(default_factory=dict)


@dataclass
class StitchedBatch:
    """Complete groups popped from the buffer, as padded tensors (``B`` rows, ``R`` = longest response).

    APRIL (arXiv:2509.18521) stitched responses carrying CoPRIS per-token
    behaviour log-probs for cross-stage importance sampling.

    Attributes:
        prompt_ids: ``[B, P]`` left-padded prompt ids; prompt_mask ``[B, P]`` long.
        response_ids: ``[B, R]`` right-padded stitched response ids.
        response_mask: ``[B, R]`` float, 1 on generated tokens.
        rollout_logprobs: ``[B, R]`` per-token behaviour log-probs (0 on padding).
        token_version: ``[B, R]`` long, policy version that sampled each token
            (-1 on padding).
        finished: ``[B]`` bool (False: truncated at max_new_tokens).
        group: ``[B]`` long group keys (rows of a group are contiguous).
        meta: ``B`` per-entry payloads.
        temperatures: ``[B, R]`` per-token sampling temperatures (0 on padding),
            or None when some entry has none recorded.
        rounds: ``[B]`` long, chunks each response was generated in.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    token_version: torch.Tensor
    finished: torch.Tensor
    group: torch.Tensor
    meta: List[Dict[str, Any]]
    temperatures: Optional[torch.Tensor] = None
    rounds: Optional[torch.Tensor] = None

    def token_staleness(self, current_version: int) -> torch.Tensor:
        """``[B, R]`` long: ``current_version - token_version`` on tokens, 0 on padding (CoPRIS staleness).

        Raises:
            ValueError: a token is newer than ``current_version``.
        """
        m = self.response_mask.bool()
        st = torch.where(m, current_version - self.token_version, torch.zeros_like(self.token_version))
        if bool((st < 0).any()):
            raise ValueError(f"tokens newer than current_version={current_version}")
        return st

    def cross_stage_log_ratio(self, current_logprobs: torch.Tensor) -> torch.Tensor:
        """``[B, R]`` per-token ``log pi_current - log pi_behaviour`` (CoPRIS cross-stage IS), 0 on padding.

        Args:
            current_logprobs: ``[B, R]`` log-probs of the stitched tokens under the
                current trainer policy.

        Raises:
            ValueError: shape mismatch.
        """
        if current_logprobs.shape != self.rollout_logprobs.shape:
            raise ValueError(f"current_logprobs {tuple(current_logprobs.shape)} != {tuple(self.rollout_logprobs.shape)}")
        return (current_logprobs - self.rollout_logprobs) * self.response_mask


class PartialRolloutBuffer:
    """Carry-over buffer of partial responses (APRIL arXiv:2509.18521; CoPRIS cross-stage IS).

    Args:
        max_new_tokens: total response budget of one entry across all rounds (>= 1).
        pad_id: padding id of :meth:`pop_ready`'s tensors.

    Raises:
        ValueError: ``max_new_tokens < 1``.
    """

    def __init__(self, max_new_tokens: int, pad_id: int = 0) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        self.max_new_tokens = int(max_new_tokens)
        self.pad_id = int(pad_id)
        self.entries: Dict[int, PartialEntry] = {}
        self._next_id = 0
        self._next_group = 0

    def __len__(self) -> int:
        return len(self.entries)

    # ----------------------------------------------------------------- adding
    def add_group(self, prompt_ids: List[int], size: int, meta: Optional[Dict[str, Any]] = None) -> int:
        """Add ``size`` empty entries for one prompt (a whole group); returns the group key.

        Raises:
            ValueError: ``size < 1`` or an empty prompt.
        """
        if size < 1:
            raise ValueError(f"group size {size} must be >= 1")
        if not prompt_ids:
            raise ValueError("empty prompt")
        g = self._next_group
        self._next_group += 1
        for _ in range(size):
            self.entries[self._next_id] = PartialEntry(list(map(int, prompt_ids)), g, meta=dict(meta or {}))
            self._next_id += 1
        return g

    def pending(self) -> List[int]:
        """Ids of entries that still generate (not done), in insertion order (APRIL arXiv:2509.18521). Raises nothing."""
        return [i for i, e in self.entries.items() if not e.done]

    def in_flight_groups(self) -> int:
        """Number of groups with at least one entry in the buffer (APRIL arXiv:2509.18521 in-flight count). Raises nothing."""
        return len({e.group for e in self.entries.values()})

    def remaining(self, entry_id: int) -> int:
        """Tokens entry ``entry_id`` may still generate (``max_new_tokens - len(response)``).

        Raises:
            KeyError: unknown entry.
        """
        return self.max_new_tokens - len(self.entries[entry_id].response_ids)

    def context(self, entry_id: int) -> List[int]:
        """Prompt + partial response ids: what generation continues from (APRIL arXiv:2509.18521).

        Raises:
            KeyError: unknown entry.
        """
        e = self.entries[entry_id]
        return e.prompt_ids + e.response_ids

    # -------------------------------------------------------------- extending
    def extend(self, entry_id: int, ids: List[int], logprobs: List[float], version: int, finished: bool,
               temperatures: Optional[List[float]] = None) -> None:
        """Append one chunk sampled by policy ``version`` to an entry.

        Args:
            entry_id: a pending entry.
            ids: the chunk's ``k`` token ids (without padding).
            logprobs: their ``k`` behaviour log-probs.
            version: policy version that sampled the chunk (recorded per token).
            finished: the chunk ended in EOS / a stop string.
            temperatures: the ``k`` temperatures the tokens were sampled at, or
                None (then the stitched batch has no temperatures).

        Raises:
            KeyError: unknown entry. ValueError: entry already done, length
            mismatch, or the chunk would exceed ``max_new_tokens`` in total.
        """
        e = self.entries[entry_id]
        if e.done:
            raise ValueError(f"entry {entry_id} is done")
        if len(ids) != len(logprobs) or (temperatures is not None and len(temperatures) != len(ids)):
            raise ValueError(f"{len(ids)} ids but {len(logprobs)} log-probs"
                             + ("" if temperatures is None else f" and {len(temperatures)} temperatures"))
        if len(ids) > self.remaining(entry_id):
            raise ValueError(f"chunk of {len(ids)} tokens exceeds the {self.remaining(entry_id)} left of max_new_tokens")
        e.response_ids.extend(int(t) for t in ids)
        e.logprobs.extend(float(x) for x in logprobs)
        e.versions.extend([int(version)] * len(ids))
        if temperatures is not None:
            e.temperatures.extend(float(x) for x in temperatures)
        e.rounds += 1
        e.finished = bool(finished)
        e.done = e.finished or len(e.response_ids) >= self.max_new_tokens

    # ---------------------------------------------------------------- popping
    def ready_groups(self) -> List[int]:
        """Group keys whose members are all done, oldest first (groups are never split). Raises nothing."""
        state: Dict[int, bool] = {}
        for e in self.entries.values():
            state[e.group] = state.get(e.group, True) and e.done
        return [g for g, ok in state.items() if ok]

    def pop_ready(self, max_groups: Optional[int] = None) -> Optional[StitchedBatch]:
        """Remove up to ``max_groups`` complete groups (oldest first) and stitch them (APRIL arXiv:2509.18521).

        Raises nothing; shapes as in :class:`StitchedBatch`.

        Returns:
            a :class:`StitchedBatch`, or None if no group is complete.
        """
        groups = self.ready_groups()
        if max_groups is not None:
            groups = groups[: max(0, int(max_groups))]
        if not groups:
            return None
        keep = set(groups)
        ids = [i for i, e in self.entries.items() if e.group in keep]
        rows = [self.entries.pop(i) for i in ids]
        return stitch(rows, self.pad_id)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Plain-python copy of the buffer (entries with their tokens, log-probs and versions) for checkpoints.

        APRIL (arXiv:2509.18521) carry-over state; raises nothing.
        """
        return {
            "max_new_tokens": self.max_new_tokens,
            "entries": [(i, dataclasses.asdict(e)) for i, e in self.entries.items()],
            "next_id": self._next_id,
            "next_group": self._next_group,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (entry ids, order and group keys are kept).

        Raises:
            ValueError: the saved buffer was made for another ``max_new_tokens``.
        """
        if int(state["max_new_tokens"]) != self.max_new_tokens:
            raise ValueError(f"checkpointed partial rollouts were generated with max_new_tokens="
                             f"{state['max_new_tokens']}, this run has {self.max_new_tokens}")
        self.entries = {int(i): PartialEntry(**e) for i, e in state["entries"]}
        self._next_id = int(state["next_id"])
        self._next_group = int(state["next_group"])


def stitch(rows: List[PartialEntry], pad_id: int = 0) -> StitchedBatch:
    """Pad entries into a :class:`StitchedBatch` (token ids, log-probs and versions kept exactly).

    CoPRIS cross-stage behaviour log-probs; APRIL (arXiv:2509.18521) resumed responses.
    Output shapes ``[B, P]`` / ``[B, R]`` as documented on :class:`StitchedBatch`.

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("nothing to stitch")
    B = len(rows)
    P = max(len(r.prompt_ids) for r in rows)
    R = max(1, max(len(r.response_ids) for r in rows))
    pid = torch.full((B, P), pad_id, dtype=torch.long)
    pm = torch.zeros((B, P), dtype=torch.long)
    rid = torch.full((B, R), pad_id, dtype=torch.long)
    rm = torch.zeros((B, R))
    lp = torch.zeros((B, R))
    ver = torch.full((B, R), -1, dtype=torch.long)
    has_t = all(len(r.temperatures) == len(r.response_ids) for r in rows)
    temps = torch.zeros((B, R)) if has_t else None
    for b, r in enumerate(rows):
        p, n = len(r.prompt_ids), len(r.response_ids)
        pid[b, P - p:] = torch.tensor(r.prompt_ids, dtype=torch.long)
        pm[b, P - p:] = 1
        if n:
            rid[b, :n] = torch.tensor(r.response_ids, dtype=torch.long)
            rm[b, :n] = 1
            lp[b, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
            ver[b, :n] = torch.tensor(r.versions, dtype=torch.long)
            if temps is not None:
                temps[b, :n] = torch.tensor(r.temperatures, dtype=torch.float32)
    return StitchedBatch(
        prompt_ids=pid, prompt_mask=pm, response_ids=rid, response_mask=rm, rollout_logprobs=lp,
        token_version=ver, finished=torch.tensor([r.finished for r in rows], dtype=torch.bool),
        group=torch.tensor([r.group for r in rows], dtype=torch.long), meta=[r.meta for r in rows],
        temperatures=temps, rounds=torch.tensor([r.rounds for r in rows], dtype=torch.long),
    )


def continue_round(buffer: PartialRolloutBuffer, engine: Any, params: Any, version: int, chunk_tokens: int) -> int:
    """One partial-rollout round: extend every pending entry by at most ``chunk_tokens`` tokens.

    Each pending entry is continued from ``prompt + partial response`` with
    ``max_new_tokens = min(chunk_tokens, remaining)``; entries with the same
    limit share one ``engine.generate`` call, largest limit first. The first
    call samples with ``params.seed`` itself and call ``k`` with
    ``params.seed + 1_000_003 * k``, so a round in which every entry starts
    fresh with ``chunk_tokens >= max_new_tokens`` is the very same engine call
    as a one-shot group rollout. The sampled tokens are recorded with their
    log-probs, temperatures and ``version`` (APRIL arXiv:2509.18521 / CoPRIS
    cross-stage IS).

    Args:
        buffer: the carry-over buffer.
        engine: a :class:`rlpost.rollout.base.RolloutEngine`.
        params: :class:`rlpost.rollout.base.SamplingParams` (its ``max_new_tokens``
            is replaced per call).
        version: policy version of the engine's weights.
        chunk_tokens: per-round token budget of one entry (>= 1).

    Returns:
        the number of tokens generated this round.

    Raises:
        ValueError: ``chunk_tokens < 1``, or the engine returned more tokens than asked.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    by_limit: Dict[int, List[int]] = {}
    for i in buffer.pending():
        by_limit.setdefault(min(chunk_tokens, buffer.remaining(i)), []).append(i)
    total = 0
    for call, (limit, ids) in enumerate(sorted(by_limit.items(), reverse=True)):
        seed = None if params.seed is None else int(params.seed) + 1_000_003 * call
        p = dataclasses.replace(params, max_new_tokens=limit, seed=seed)
        gen = engine.generate([buffer.context(i) for i in ids], p)
        for b, i in enumerate(ids):
            n = int(gen.response_mask[b].sum())
            if n > limit:
                raise ValueError(f"engine returned {n} tokens, asked for at most {limit}")
            temps = gen.temperatures[b, :n].tolist() if getattr(gen, "temperatures", None) is not None else None
            buffer.extend(i, gen.response_ids[b, :n].tolist(), gen.rollout_logprobs[b, :n].tolist(),
                          version, bool(gen.finished[b]), temps)
            total += n
    return total


@dataclass
class PartialStep:
    """One step of :class:`PartialRolloutProducer` (APRIL arXiv:2509.18521; CoPRIS cross-stage IS).

    Attributes:
        batch: ``needed`` whole groups (``B`` rows), stitched.
        prompt_index: ``B`` dataset indices, one per row.
        token_step: ``[B, R]`` long, RL step of the weights that sampled each
            token (``weights_step`` of the round; -1 on padding).
        new_groups: groups started this step.
        rounds: rounds (``continue_round`` calls) run this step.
        tokens: tokens generated this step (trained now or carried).
        metrics: ``partial/...`` scalars (see :meth:`PartialRolloutProducer.produce`).
        extras: in window mode (``train_unfinished``, T-PPO) ``window_mask`` ``[B, R]`` float
            (1 on the tokens no earlier step trained on) and ``window_truncated`` ``[B]`` bool
            (rows cut by the window that stay in the buffer); else empty.
    """

    batch: StitchedBatch
    prompt_index: List[int]
    token_step: torch.Tensor
    new_groups: int
    rounds: int
    tokens: int
    metrics: Dict[str, float]
    extras: Dict[str, torch.Tensor] = field(default_factory=dict)


class PartialRolloutProducer:
    """The per-step driver of partial rollouts (APRIL arXiv:2509.18521; CoPRIS arXiv:2511.05589).

    Holds the carry-over :class:`PartialRolloutBuffer`, the prompts drawn from
    the selector but not started yet, and the RL step of every policy version
    whose tokens are still in the buffer. No tensors are kept between steps.

    Args:
        max_new_tokens: total response budget (``rollout.max_new_tokens``).
        group_size: rollouts per prompt (a group is added and released whole).
        over_provision: APRIL's factor (>= 1): ``ceil(over_provision * needed)``
            groups in flight.
        chunk_tokens: per-round token budget of one response (>= 1).
        pad_id: padding id of the stitched tensors.
        train_unfinished: window mode of "Truncated Proximal Policy Optimization" (T-PPO,
            arXiv:2506.15050): each step runs exactly one round (the window is
            ``chunk_tokens``) and trains on the ``needed`` oldest groups in flight whether
            their responses finished or not. Finished (done) responses leave the buffer, so
            new prompts take their groups' places once a whole group is done; a cut response
            is trained on as it is and stays to be continued. Each token is trained once: a
            row's ``window_mask`` marks the tokens generated since the last step that trained
            that response (earlier tokens stay as context only).

    Raises:
        ValueError: ``over_provision < 1``, ``chunk_tokens < 1``, ``group_size < 1``
            or ``max_new_tokens < 1``.
    """

    def __init__(self, max_new_tokens: int, group_size: int, over_provision: float = 1.0,
                 chunk_tokens: int = 16, pad_id: int = 0, train_unfinished: bool = False) -> None:
        if over_provision < 1:
            raise ValueError(f"over_provision={over_provision} must be >= 1")
        if chunk_tokens < 1 or group_size < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens} and group_size={group_size} must be >= 1")
        self.buffer = PartialRolloutBuffer(max_new_tokens, pad_id)
        self.group_size = int(group_size)
        self.over_provision = float(over_provision)
        self.chunk_tokens = int(chunk_tokens)
        self.train_unfinished = bool(train_unfinished)
        self.queue: List[int] = []  # dataset indices selected but not started yet
        self.version_step: Dict[int, int] = {}  # policy version -> RL step of those weights

    def produce(self, needed: int, select: Any, encode: Any, engine: Any, params: Any,
                version: int, weights_step: int) -> PartialStep:
        """Top up, generate and release ``needed`` complete groups for one RL step.

        1. Groups already in the buffer count as in flight; ``num_requests``
           more are started (APRIL over-provisioning) with prompts from
           ``select()`` (called as often as needed; leftovers wait in a queue).
        2. Rounds of :func:`continue_round` under the engine's current weights
           (recorded as ``version``) run until ``needed`` groups are complete or
           nothing is pending, at least one round when anything is pending.
           Round ``r > 0`` samples with ``params.seed + 7919 * r``.
        3. The ``needed`` oldest complete groups are popped; the rest (finished
           or not) stays for the next step.

        Args:
            needed: groups to train on (>= 1).
            select: ``fn() -> list of dataset indices`` (e.g. ``selector.select(step)``).
            encode: ``fn(dataset index) -> prompt token ids``.
            engine: a :class:`rlpost.rollout.base.RolloutEngine` holding the weights of ``version``.
            params: the step's :class:`rlpost.rollout.base.SamplingParams`.
            version: trainer version (optimizer steps) of the engine's weights.
            weights_step: RL steps those weights have completed.

        Returns:
            a :class:`PartialStep`; its ``metrics``: ``partial/new_groups``,
            ``partial/carried_in_groups`` (in flight at the start),
            ``partial/carried_groups`` / ``partial/carried_responses`` /
            ``partial/carried_tokens`` (left for the next step),
            ``partial/rounds`` (this step), ``partial/tokens_generated``,
            ``partial/rounds_mean`` (chunks per trained response),
            ``partial/resumed_frac`` (trained responses continued in a later
            step than they began), ``partial/multi_version_frac`` (trained
            responses whose tokens come from more than one policy version),
            ``partial/queued_prompts``.

        Raises:
            ValueError: ``needed < 1``; RuntimeError: ``select()`` returned nothing.
        """
        if needed < 1:
            raise ValueError(f"needed={needed} must be >= 1")
        buf = self.buffer
        self.version_step[int(version)] = int(weights_step)
        for i in buf.pending():  # begun in an earlier step, continued now
            if buf.entries[i].response_ids:
                buf.entries[i].meta["resumed"] = True
        carried_in = buf.in_flight_groups()
        new = num_requests(needed, self.over_provision, carried_in)
        take, self.queue = take_from_queue(self.queue, new, select)
        for idx in take:
            buf.add_group(list(encode(idx)), self.group_size, meta={"prompt_index": idx})
        rounds = tokens = 0
        if self.train_unfinished:  # T-PPO: the first token of each response no step has trained on yet
            for i in buf.pending():
                e = buf.entries[i]
                if e.meta.get("window_start") is None:
                    e.meta["window_start"] = len(e.response_ids)
        while True:
            if self.train_unfinished and rounds:  # one window per step
                break
            if buf.pending():
                p = params
                if rounds and params.seed is not None:
                    p = dataclasses.replace(params, seed=int(params.seed) + 7919 * rounds)
                tokens += continue_round(buf, engine, p, version, self.chunk_tokens)
                rounds += 1
            if len(buf.ready_groups()) >= needed or not buf.pending():
                break
        extras: Dict[str, torch.Tensor] = {}
        if self.train_unfinished:
            sb, extras = self._window_batch(needed)
        else:
            sb = buf.pop_ready(needed)
            assert sb is not None and len(set(sb.group.tolist())) == needed  # in_flight + new >= needed
        token_step = torch.full_like(sb.token_version, -1)
        for v in sb.token_version.unique().tolist():
            if v >= 0:
                token_step[sb.token_version == v] = self.version_step[int(v)]
        live = {v for e in buf.entries.values() for v in e.versions} | {int(version)}
        self.version_step = {v: s for v, s in self.version_step.items() if v in live}
        mask = sb.response_mask.bool()
        tv = sb.token_version
        n_versions = torch.tensor([len(set(tv[b][mask[b]].tolist())) for b in range(len(tv))], dtype=torch.float32)
        metrics = {
            "partial/new_groups": float(new),
            "partial/carried_in_groups": float(carried_in),
            "partial/carried_groups": float(buf.in_flight_groups()),
            "partial/carried_responses": float(len(buf)),
            "partial/carried_tokens": float(sum(len(e.response_ids) for e in buf.entries.values())),
            "partial/rounds": float(rounds),
            "partial/tokens_generated": float(tokens),
            "partial/rounds_mean": float(sb.rounds.float().mean()),
            "partial/resumed_frac": float(sum(bool(m.get("resumed")) for m in sb.meta) / len(sb.meta)),
            "partial/multi_version_frac": float((n_versions > 1).float().mean()),
            "partial/queued_prompts": float(len(self.queue)),
        }
        if self.train_unfinished:
            metrics["partial/window_truncated_frac"] = float(extras["window_truncated"].float().mean())
            metrics["partial/window_tokens"] = float(extras["window_mask"].sum())
        return PartialStep(sb, [int(m["prompt_index"]) for m in sb.meta], token_step, new, rounds, tokens, metrics,
                           extras)

    def _window_batch(self, needed: int):
        """T-PPO window mode (arXiv:2506.15050): the ``needed`` oldest groups in flight, finished or not.

        Done rows are popped; unfinished rows are copied (their entries stay in the buffer,
        their ``window_start`` cleared so the next step trains only what it generates).

        Returns:
            ``(StitchedBatch, {"window_mask": [B, R] float, "window_truncated": [B] bool})``.
        """
        buf = self.buffer
        order: List[int] = []
        for e in buf.entries.values():
            if e.group not in order:
                order.append(e.group)
        keep = set(order[:needed])
        rows: List[PartialEntry] = []
        starts: List[int] = []
        cut: List[bool] = []
        for i in [i for i, e in buf.entries.items() if e.group in keep]:
            e = buf.entries[i]
            start = e.meta.get("window_start")
            starts.append(len(e.response_ids) if start is None else int(start))
            cut.append(not e.done)
            if e.done:
                rows.append(buf.entries.pop(i))
            else:
                rows.append(dataclasses.replace(e, response_ids=list(e.response_ids), logprobs=list(e.logprobs),
                                                versions=list(e.versions), temperatures=list(e.temperatures),
                                                meta=dict(e.meta)))
                e.meta["window_start"] = None
        sb = stitch(rows, buf.pad_id)
        wm = torch.zeros_like(sb.response_mask)
        for b, (r, s0) in enumerate(zip(rows, starts)):
            wm[b, s0:len(r.response_ids)] = 1.0
        return sb, {"window_mask": wm, "window_truncated": torch.tensor(cut, dtype=torch.bool)}

    def state_dict(self) -> Dict[str, Any]:
        """Buffer, queued prompts and version map, as plain python (saved in checkpoints). Raises nothing."""
        return {"buffer": self.buffer.state_dict(), "queue": list(self.queue),
                "version_step": dict(self.version_step)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: from :meth:`PartialRolloutBuffer.load_state_dict`.
        """
        self.buffer.load_state_dict(state["buffer"])
        self.queue = [int(i) for i in state["queue"]]
        self.version_step = {int(v): int(s) for v, s in state["version_step"].items()}
