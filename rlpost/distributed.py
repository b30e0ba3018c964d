"""Data-parallel rollouts: each rank of a ``torch.distributed`` launch generates and scores 1/N of a step.

With ``trainer=deepspeed trainer.num_procs=N`` (or ``torchrun`` / ``deepspeed``
launchers across nodes) every rank runs the same run graph with the same seeds.
Without sharding each rank would generate, score and run the reference/critic
passes of the *whole* step, so N processes did N times the rollout work. Here:

* **selection** stays replicated: every rank's selector holds the same state and
  draws the same prompts (same RNG, same updates);
* **generation** (:class:`ShardedEngine`): every ``generate`` call is split into
  contiguous runs of identical prompts (a group is never split), the runs are
  apportioned across ranks (:func:`rlpost.core.apportion.apportion`, equal weights,
  so uneven counts differ by at most one run), each rank generates its runs and
  the results are all-gathered, so every rank holds the whole call's output in
  the single-process row order. Row ``i`` of the call samples from its own
  stream (``SamplingParams.seed + row_offset + i``), so the tokens do not depend
  on the number of ranks;
* **scoring** (:class:`ShardedScorer`): the same split by runs of equal prompt
  index (TTRL's majority vote sees a whole group), rewards all-gathered;
* **log-prob, reference and critic passes** (:func:`sharded_rows`,
  :func:`gather_rows`): each rank computes the rows of its share of the batch's
  groups and the ``[B, R]`` results are all-gathered;
* everything downstream that needs the whole batch (group and batch statistics,
  REINFORCE++ whitening, selector and sampler updates, metrics) then runs on
  identical full tensors on every rank, so results do not depend on N;
* the **update** keeps DeepSpeed's split (rows ``rank::world`` of every
  mini-batch, loss normalised by the global denominator), whose all-reduced
  gradient equals the single-process gradient.

Small Python objects travel with ``all_gather_object`` (pickled over gloo on
CPU, NCCL on GPU with the rank's current device). Every rank makes the same
collective calls in the same order because their control flow only reads
gathered (identical) data.

This is the classic data-parallel scheme of RL post-training systems (e.g.
"HybridFlow: A Flexible and Efficient RLHF Framework", arXiv:2409.19256, splits
rollout and experience preparation across data-parallel workers the same way);
the choices of where to gather are rlpost's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rlpost.core.apportion import apportion
from rlpost.rewards.scoring import Rewards
from rlpost.rollout.base import concat_generations


def world_size() -> int:
    """Processes in the default ``torch.distributed`` group (1 when not initialised)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank (0 when ``torch.distributed`` is not initialised)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_gather_object(obj: Any) -> List[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` without ``torch.distributed``). Collective."""
    import torch.distributed as dist

    n = world_size()
    if n == 1:
        return [obj]
    out: List[Any] = [None] * n
    dist.all_gather_object(out, obj)
    return out


def runs(keys: Sequence[Any]) -> List[Tuple[int, int]]:
    """``[start, end)`` row ranges of the maximal runs of equal consecutive ``keys``.

    >>> runs([5, 5, 7, 7, 7, 5])
    [(0, 2), (2, 5), (5, 6)]
    """
    out: List[Tuple[int, int]] = []
    for i, k in enumerate(keys):
        if out and keys[out[-1][0]] == k:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def split_units(n_units: int, world: int) -> List[Tuple[int, int]]:
    """Contiguous ``[start, end)`` unit ranges of each rank: ``n_units`` apportioned equally, lower ranks first.

    Raises:
        ValueError: ``world < 1``.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    counts = apportion([1.0] * world, n_units)
    out, a = [], 0
    for c in counts:
        out.append((a, a + c))
        a += c
    return out


def local_run_rows(keys: Sequence[Any], r: int, world: int) -> Tuple[int, int]:
    """``[start, end)`` rows of rank ``r`` when rows ``keys`` are split by runs of equal keys."""
    rr = runs(keys)
    a, b = split_units(len(rr), world)[r]
    if a == b:
        return (rr[a - 1][1], rr[a - 1][1]) if a > 0 else (0, 0)
    return rr[a][0], rr[b - 1][1]


def sharded_rows(group_index: torch.Tensor, r: Optional[int] = None, world: Optional[int] = None) -> List[int]:
    """Rows of a batch that rank ``r`` computes: the rows of its share of the groups (no group is split).

    Groups are ordered by their id and apportioned equally across ranks
    (:func:`split_units`); rows keep their batch order.

    Args:
        group_index: ``[B]`` long group id of each row.
        r, world: rank and world size (default: this process's).
    """
    r = rank() if r is None else r
    world = world_size() if world is None else world
    gids = sorted(set(int(g) for g in group_index.tolist()))
    a, b = split_units(len(gids), world)[r]
    mine = set(gids[a:b])
    return [i for i, g in enumerate(group_index.tolist()) if int(g) in mine]


def gather_rows(local: Optional[torch.Tensor], rows: List[int], B: int, width: int) -> torch.Tensor:
    """Assemble the full ``[B, width, ...]`` tensor from every rank's ``[len(rows), w, ...]`` block (zeros
    elsewhere). Collective.

    Trailing dimensions after the token axis are kept (a critic with ``algo.critic.num_heads > 1``
    gives ``[B, R, heads]`` values).

    Args:
        local: this rank's rows (None when it has none); ``w <= width``.
        rows: this rank's row indices into the batch.
        B, width: the full tensor's first two sizes.
    """
    parts = all_gather_object((rows, None if local is None else local.detach().cpu()))
    first = next((t for _, t in parts if t is not None), None)
    dtype = torch.float32 if first is None else first.dtype
    full = torch.zeros(B, width, *([] if first is None else first.shape[2:]), dtype=dtype)
    for rs, t in parts:
        if t is not None and rs:
            full[torch.tensor(rs, dtype=torch.long), : t.shape[1]] = t
    return full


class ShardedEngine:
    """A rollout engine whose ``generate`` calls are split across ranks and all-gathered (collective).

    Every rank must call :meth:`generate` with the same prompts and parameters
    (true under the replicated run graph). A call's rows are cut into runs of
    identical prompts (a group's samples share a prompt and are never split;
    the hf engine prefills each distinct prompt once), the runs are apportioned
    equally across ranks, rank ``r`` generates its contiguous slice with
    ``row_offset`` set to the slice's first row, and the slices are
    concatenated in rank order: the single-process call's rows in its order.

    Everything else (``sync_weights``, ``close``, ``pad_id``, ``model``...) goes
    to the wrapped engine; :attr:`inner` is the local engine itself (for work
    that only one rank does, such as evaluation).

    Args:
        inner: the rank's own rollout engine.
    Attributes:
        rows_generated: rows this rank generated so far (its share of every call).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rows_generated = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)

    def generate(self, prompts: List[List[int]], params: Any) -> Any:
        """Generate ``prompts`` (one response each) with this rank's share; returns the whole call's result."""

        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        a, b = local_run_rows([tuple(p) for p in prompts], rank(), world_size())
        local = None
        self.rows_generated += b - a
        if b > a:
            local = self.inner.generate(prompts[a:b], dataclasses.replace(params, row_offset=int(params.row_offset) + a))
        parts = [p for p in all_gather_object(local) if p is not None]
        return concat_generations(parts, int(getattr(self.inner, "pad_id", 0) or 0))

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Load the trainer's weights into this rank's engine."""
        self.inner.sync_weights(policy)

    def close(self) -> None:
        """Close this rank's engine."""
        self.inner.close()


class ShardedScorer:
    """The step's scorer with each call's rows split across ranks by runs of equal prompt index (collective).

    Args:
        scorer: this rank's :class:`rlpost.rewards.StepScorer`.
    Attributes:
        seconds: this rank's scoring wall time.
    """

    def __init__(self, scorer: Any) -> None:
        self.scorer = scorer

    @property
    def seconds(self) -> float:
        return float(self.scorer.seconds)

    def __call__(self, prompt_indices: Sequence[int], texts: Sequence[str], lengths: torch.Tensor) -> Any:
        """Score this rank's share and return every rank's :class:`rlpost.rewards.Rewards`, concatenated."""

        lengths = torch.as_tensor(lengths)
        a, b = local_run_rows([int(i) for i in prompt_indices], rank(), world_size())
        out = self.scorer(list(prompt_indices)[a:b], list(texts)[a:b], lengths[a:b])
        parts = all_gather_object((b - a, out))
        keys = sorted(set().union(*(p.components.keys() for _, p in parts)))
        comps = {k: torch.cat([p.components.get(k, torch.zeros(n)).float() for n, p in parts]) for k in keys}
        fmt = None
        if any(p.format_ok is not None for _, p in parts):
            fmt = torch.cat([(p.format_ok if p.format_ok is not None else torch.zeros(n)).float() for n, p in parts])
        return Rewards(torch.cat([p.total.float() for _, p in parts]), comps, {}, fmt)

    def metrics(self) -> Dict[str, float]:
        """The step's scorer metrics over every rank: call, error and timeout counts summed, TTRL means pooled."""
        parts = all_gather_object((self.scorer.calls, dict(self.scorer._sums), self.scorer._n))
        calls = sum(c for c, _, _ in parts)
        n = sum(k for _, _, k in parts)
        sums: Dict[str, float] = {}
        for _, s, _ in parts:
            for k, v in s.items():
                sums[k] = sums.get(k, 0.0) + v
        m = {"reward/verifier_calls": float(calls), "reward/verifier_errors": 0.0, "reward/verifier_timeouts": 0.0}
        for k, v in sums.items():
            m[k] = v if k in m else v / max(1, n)
        return m
