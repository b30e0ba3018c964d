"""Partial rollouts: a carry-over buffer for unfinished responses, and cross-stage behaviour log-probs.

Implements the rollout side of

* **APRIL** -- "APRIL: Active Partial Rollouts in Reinforcement Learning to Tame
  Long-tail Generation", arXiv:2509.18521: over-provision rollout requests
  (``ceil(over_provision * needed)`` in flight), stop a round once its token
  budget is spent, train on what finished and keep the unfinished responses to
  continue in later rounds; and
* **CoPRIS** -- "CoPRIS: Efficient and Stable Reinforcement Learning via
  Concurrency-Controlled Partial Rollout with Importance Sampling" (seed
  catalog entry 14): the continued response keeps, for every token, the
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

Status: this module is tested on its own (tests/test_partial.py) but is **not
yet wired into** :class:`rlpost.executor.AsyncExecutor`;
``executor.partial_rollout=true`` raises a :class:`rlpost.errors.ConfigError`
saying so (see :func:`rlpost.executor.build_executor`).

Known limits of continuing with token ids through ``RolloutEngine.generate``:
a stop string that straddles two chunks is only seen if the engine's stop check
decodes the whole continuation (the HF engine decodes the new response only),
and per-token temperature hooks restart their step counter each chunk.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

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
    def extend(self, entry_id: int, ids: List[int], logprobs: List[float], version: int, finished: bool) -> None:
        """Append one chunk sampled by policy ``version`` to an entry.

        Args:
            entry_id: a pending entry.
            ids: the chunk's ``k`` token ids (without padding).
            logprobs: their ``k`` behaviour log-probs.
            version: policy version that sampled the chunk (recorded per token).
            finished: the chunk ended in EOS / a stop string.

        Raises:
            KeyError: unknown entry. ValueError: entry already done, length
            mismatch, or the chunk would exceed ``max_new_tokens`` in total.
        """
        e = self.entries[entry_id]
        if e.done:
            raise ValueError(f"entry {entry_id} is done")
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} ids but {len(logprobs)} log-probs")
        if len(ids) > self.remaining(entry_id):
            raise ValueError(f"chunk of {len(ids)} tokens exceeds the {self.remaining(entry_id)} left of max_new_tokens")
        e.response_ids.extend(int(t) for t in ids)
        e.logprobs.extend(float(x) for x in logprobs)
        e.versions.extend([int(version)] * len(ids))
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
    for b, r in enumerate(rows):
        p, n = len(r.prompt_ids), len(r.response_ids)
        pid[b, P - p:] = torch.tensor(r.prompt_ids, dtype=torch.long)
        pm[b, P - p:] = 1
        if n:
            rid[b, :n] = torch.tensor(r.response_ids, dtype=torch.long)
            rm[b, :n] = 1
            lp[b, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
            ver[b, :n] = torch.tensor(r.versions, dtype=torch.long)
    return StitchedBatch(
        prompt_ids=pid, prompt_mask=pm, response_ids=rid, response_mask=rm, rollout_logprobs=lp,
        token_version=ver, finished=torch.tensor([r.finished for r in rows], dtype=torch.bool),
        group=torch.tensor([r.group for r in rows], dtype=torch.long), meta=[r.meta for r in rows],
    )


def continue_round(buffer: PartialRolloutBuffer, engine: Any, params: Any, version: int, chunk_tokens: int) -> int:
    """One partial-rollout round: extend every pending entry by at most ``chunk_tokens`` tokens.

    Each pending entry is continued from ``prompt + partial response`` with
    ``max_new_tokens = min(chunk_tokens, remaining)``; entries with the same
    limit share one ``engine.generate`` call (seed offset by the limit). The
    sampled tokens are recorded with their log-probs and ``version``
    (APRIL arXiv:2509.18521 / CoPRIS cross-stage IS).

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
    for limit, ids in sorted(by_limit.items()):
        seed = None if params.seed is None else int(params.seed) + 1_000_003 * limit
        p = dataclasses.replace(params, max_new_tokens=limit, seed=seed)
        gen = engine.generate([buffer.context(i) for i in ids], p)
        for b, i in enumerate(ids):
            n = int(gen.response_mask[b].sum())
            if n > limit:
                raise ValueError(f"engine returned {n} tokens, asked for at most {limit}")
            buffer.extend(i, gen.response_ids[b, :n].tolist(), gen.rollout_logprobs[b, :n].tolist(),
                          version, bool(gen.finished[b]))
            total += n
    return total
