"""``launcher.reward_workers``: the rule verifier runs in a pool of Ray actors, behind :class:`RewardFunction`.

ROLL ("Reinforcement Learning Optimization for Large-Scale Learning: An Efficient and
User-Friendly Scaling Library", arXiv:2506.06122; https://github.com/alibaba/ROLL) scores
rewards in separate reward worker clusters: each reward domain has a cluster of
``world_size`` Ray actors (CPU-only for rule verifiers such as its math verifier),
the batch is split evenly across them and the scores come back in row order; inside
a worker a verifier that raises or exceeds its time limit gives that row 0. The
authors' code does not recover a worker that dies (the exception reaches the
pipeline).

rlpost keeps every reward term in :class:`rlpost.rewards.scoring.RewardFunction` and
moves only the verifier calls (``RewardFunction.correctness``, the hook
``RewardFunction.backend``) into :class:`RayRewardPool`; shaping, TTRL labels and
model rewards stay in the driver, so the scores are the in-process ones. The
recovery policy is ours (ROLL has none):

* a worker that dies while scoring its slice (a verifier that segfaults or calls
  ``os._exit``, an OOM kill) is replaced while ``launcher.reward_max_restarts``
  allows, and its slice is rescored in the driver's isolated verifier process
  (one forked process, per-row timeout, a crashing row scores 0 and counts as a
  verifier error), so every row is scored and a row that crashes twice costs one
  row, not a worker;
* a slice that is not back within ``task.reward.timeout_s`` x its rows (plus
  ``GRACE_S``) is treated the same way (the worker is killed first), so a hanging
  verifier cannot stall the trainer beyond that deadline plus the rescoring's
  per-row timeouts;
* with no live worker and no replacement left, every later batch is scored in the
  driver's isolated process (the ``launcher=none`` path).

Counts per step: ``reward/worker_failures``, ``reward/worker_timeouts`` (the subset
that hit the deadline), ``reward/worker_restarts``, ``reward/worker_rescored`` (rows
rescored in the driver), summed over the step's scoring calls; ``reward/workers`` (live
workers) is returned per call only.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

log = logging.getLogger("rlpost")

#: seconds added to a slice's deadline (timeout_s x rows) for the round trip
GRACE_S = 5.0


class RewardWorker:
    """One reward worker (a Ray actor of :class:`RayRewardPool`): the task's verifier on a slice of rows.

    Args:
        task: the run's :class:`rlpost.tasks.Task` (from the object store).
        index: the worker's slot (logs only).
    """

    def __init__(self, task: Any, index: int) -> None:
        self.task, self.index = task, index

    def ping(self) -> Tuple[int, str]:
        """``(process id, Ray node id)``."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def score(self, responses: List[str], examples: List[Any]) -> List[Tuple[str, float, bool]]:
        """``(status, score, format_ok)`` per row, exactly as the in-process verifier gives them
        (:func:`rlpost.rewards.scoring.verify`: a raising or NaN verifier is ``("error", 0.0, False)``)."""
        from rlpost.rewards.scoring import verify

        return [verify(self.task, r, e) for r, e in zip(responses, examples)]

    def close(self) -> None:
        """Nothing to free (:func:`rlpost.ray_pool.ray_workers.stop_actors` calls it before the actor exits)."""


def split_rows(n: int, k: int) -> List[Tuple[int, int]]:
    """``n`` rows cut into ``min(n, k)`` contiguous slices whose sizes differ by at most one (ROLL's even split).

    Raises:
        ValueError: ``k < 1``.
    """
    if k < 1:
        raise ValueError(f"split_rows needs at least one worker, got {k}")
    k = min(k, n)
    out, a = [], 0
    for j in range(k):
        b = a + n // k + (1 if j < n % k else 0)
        out.append((a, b))
        a = b
    return out


class RayRewardPool:
    """``launcher.reward_workers`` Ray actors that run the task's verifier (see the module doc).

    Installed as ``RewardFunction.backend`` (:func:`attach_reward_workers`); the
    reward function calls :meth:`correctness` instead of its own verifier process.

    Args:
        task: the run's task (put once in the object store; every worker reads it).
        n: workers (>= 1).
        cpus: Ray CPUs per worker.
        timeout_s: per-row time allowed (``task.reward.timeout_s``).
        max_restarts: dead workers replaced over the run.
    Attributes:
        workers: live actor handles by slot (None: a slot left empty).
        after_submit: None or ``fn(pool, futures)`` called once a batch's slices are
            submitted (fault injection in tests; ``futures`` maps each future to its slot).
    """

    def __init__(self, task: Any, n: int, cpus: float = 1.0, timeout_s: float = 5.0, max_restarts: int = 2) -> None:
        import ray

        self.n, self.cpus, self.timeout_s = int(n), float(cpus), float(timeout_s)
        self.restarts_left = int(max_restarts)
        self._task_ref = ray.put(task)
        self._cls = ray.remote(RewardWorker)
        self.workers: List[Optional[Any]] = [self._spawn(i) for i in range(self.n)]
        self.placed = ray.get([w.ping.remote() for w in self.workers], timeout=600)
        self.after_submit: Optional[Callable[..., None]] = None
        self._metrics: Dict[str, float] = {}
        log.info(f"launcher.reward_workers: {self.n} Ray reward workers ({self.cpus} CPU each) run the verifier")

    def _spawn(self, slot: int) -> Any:
        return self._cls.options(num_cpus=self.cpus, num_gpus=0, max_restarts=0).remote(self._task_ref, slot)

    def live(self) -> List[int]:
        """Slots holding a worker."""
        return [s for s, w in enumerate(self.workers) if w is not None]

    def _add(self, k: str, v: float) -> None:
        self._metrics[k] = self._metrics.get(k, 0.0) + float(v)

    def pop_metrics(self) -> Dict[str, float]:
        """``reward/worker_*`` counts since the last call, plus ``reward/workers`` (live workers)."""
        m, self._metrics = self._metrics, {}
        for k in ("reward/worker_failures", "reward/worker_timeouts", "reward/worker_restarts", "reward/worker_rescored"):
            m.setdefault(k, 0.0)
        m["reward/workers"] = float(len(self.live()))
        return m

    def _fail(self, slot: int, actor: Any, why: str, rows: Tuple[int, int]) -> None:
        """Worker ``slot`` failed on ``rows``: kill it, replace it while restarts last, log and count."""
        import ray

        self._add("reward/worker_failures", 1.0)
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if self.workers[slot] is not actor:
            return  # replaced by an earlier failure in this batch
        if self.restarts_left > 0:
            self.restarts_left -= 1
            self.workers[slot] = self._spawn(slot)  # starts in the background; the next batch queues on it
            self._add("reward/worker_restarts", 1.0)
            tail = f"replaced it ({self.restarts_left} replacements left)"
        else:
            self.workers[slot] = None
            tail = ("no replacement left" + ("; later batches are scored in the driver" if not self.live() else ""))
        log.warning(f"launcher.reward_workers: reward worker {slot} {why} on rows {rows[0]}-{rows[1]}; {tail}; "
                    f"those rows are rescored in the driver's verifier process")

    def correctness(self, responses: Sequence[str], examples: Sequence[Any],
                    fallback: Callable[[Sequence[str], Sequence[Any]], Tuple[List[float], List[bool], Dict[str, int]]]
                    ) -> Tuple[List[float], List[bool], Dict[str, int]]:
        """Verifier scores, format flags and ``{"errors", "timeouts"}`` counts of a batch (the
        :meth:`rlpost.rewards.scoring.RewardFunction.correctness` contract).

        Args:
            responses, examples: the batch, row-aligned.
            fallback: the driver's isolated per-row scorer, used for the slices of failed workers
                (and for everything when no worker is left).
        """
        import ray

        n = len(responses)
        scores, fmts = [0.0] * n, [False] * n
        counts = {"errors": 0, "timeouts": 0}
        live = self.live()
        if n == 0:
            return scores, fmts, counts
        if not live:
            return fallback(responses, examples)
        pending: Dict[Any, Tuple[int, Any, int, int]] = {}
        for j, (a, b) in enumerate(split_rows(n, len(live))):
            slot = live[j]
            actor = self.workers[slot]
            pending[actor.score.remote(list(responses[a:b]), list(examples[a:b]))] = (slot, actor, a, b)
        if self.after_submit is not None:
            self.after_submit(self, {f: s for f, (s, _, _, _) in pending.items()})
        allowed = self.timeout_s * max(b - a for _, _, a, b in pending.values()) + GRACE_S
        deadline = time.monotonic() + allowed
        failed: List[Tuple[int, int]] = []
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:  # past the deadline: every slice still out is a hung worker
                for f, (slot, actor, a, b) in list(pending.items()):
                    self._add("reward/worker_timeouts", 1.0)
                    self._fail(slot, actor, f"did not answer within {allowed:.0f} s", (a, b))
                    failed.append((a, b))
                pending.clear()
                break
            fut = done[0]
            slot, actor, a, b = pending.pop(fut)
            try:
                rows = ray.get(fut)
            except Exception as e:  # noqa: BLE001 - RayActorError (a dead worker) or an error in the actor itself
                self._fail(slot, actor, f"died ({type(e).__name__})", (a, b))
                failed.append((a, b))
                continue
            for i, (st, s, f) in enumerate(rows):
                scores[a + i], fmts[a + i] = s, f
                counts["errors"] += st == "error"
                counts["timeouts"] += st == "timeout"
        for a, b in failed:
            s, f, c = fallback(list(responses[a:b]), list(examples[a:b]))
            scores[a:b], fmts[a:b] = s, f
            counts["errors"] += c["errors"]
            counts["timeouts"] += c["timeouts"]
            self._add("reward/worker_rescored", b - a)
        return scores, fmts, counts

    def close(self) -> None:
        """Stop the workers (each exits by itself, :func:`rlpost.ray_pool.ray_workers.stop_actors`)."""
        import ray

        if not ray.is_initialized():
            return
        from rlpost.ray_pool.ray_workers import stop_actors

        stop_actors([self.workers[s] for s in self.live()])
        self.workers = [None] * len(self.workers)


def attach_reward_workers(launcher: Any, reward_fn: Any, task: Any) -> Optional[RayRewardPool]:
    """Install a :class:`RayRewardPool` as ``reward_fn.backend`` when ``launcher.reward_workers > 0``.

    Ray must already be initialised (the rollout pool, :class:`rlpost.ray_pool.ray_workers.RayRolloutPool`,
    starts or joins the cluster first). Returns the pool, or None when no reward workers are asked for.
    """
    if launcher is None or launcher.get("name") != "ray" or int(launcher.get("reward_workers", 0) or 0) <= 0:
        return None
    pool = RayRewardPool(task, int(launcher.reward_workers), float(launcher.get("cpus_per_reward_worker", 1.0)),
                         timeout_s=float(reward_fn.timeout_s), max_restarts=int(launcher.get("reward_max_restarts", 2)))
    reward_fn.backend = pool
    return pool
