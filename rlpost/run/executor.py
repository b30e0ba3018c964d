"""Executors: who produces each step's rollouts and when (``executor=sync`` | ``executor=async``).

The run graph splits into a **producer** half (select -> rollout -> reward,
:meth:`rlpost.run.runner.Run.collect`) and a **learner** half (log-probs ->
advantages -> update, :meth:`rlpost.run.runner.Run.learn`).

* :class:`SyncExecutor` runs them one after the other: the rollouts of step
  ``s`` come from the weights after step ``s - 1``.
* :class:`AsyncExecutor` runs the producer in a background thread with its own
  copy of the weights, so generation of the next steps overlaps the update of
  this one (the one-step-off / bounded-staleness pipelines of AReaL,
  arXiv:2505.24298, and of SAO, arXiv:2607.07508). The producer may start step
  ``t`` once the learner has *asked* for step ``t - max_staleness`` and has
  finished step ``t - 1 - max_staleness``; it then loads the newest weights.
  Hence every sample is at most ``executor.max_staleness`` policy versions
  (RL steps) older than the learner that consumes it, and with
  ``max_staleness=0`` the two halves strictly alternate in the synchronous
  order: the run is identical to ``executor=sync`` (tested).

A thread rather than a process: generation and the update are torch kernels
that release the GIL, the rollout copy needs no pickling, and with two CPU
cores a process would only add copies. On GPUs the same split maps onto
vLLM (rollout) and DeepSpeed (update) engines.

Each batch records the version of the weights that produced it
(``batch.policy_version``, in trainer optimizer steps, and
``extras['policy_step']`` in RL steps); metrics report
``async/staleness_mean``, ``async/staleness_max``, ``async/staleness_hist_<k>``
(share of samples ``k`` steps old) and ``async/wait_s`` (learner time spent
waiting for rollouts).

**Partial rollouts** (``executor.partial_rollout=true``; APRIL arXiv:2509.18521,
CoPRIS arXiv:2511.05589) work with both executors: the producer half runs
:class:`rlpost.core.partial.PartialRolloutProducer` (see :func:`check_partial`), and a
response may then hold tokens of several policy versions
(``extras['token_version']`` / ``extras['token_policy_step']``, ``[B, R]``). A
row's ``policy_version`` / ``policy_step`` is that of its oldest token, so with
carried-over tokens ``async/staleness_max`` can exceed ``max_staleness``
(``async/staleness_hist_over_k`` reports the share); the bound still holds for
the weights each step's rounds run under (asserted per step).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional

from rlpost.core.errors import ConfigError
from rlpost.selectors.base import SELECTORS

EXECUTORS = ("sync", "async")
PARTIAL_SAMPLERS = ("group", "single")


def rollouts_overlap_updates(executor_cfg: Any) -> bool:
    """Whether the rollout engine generates while the trainer updates (``executor=async`` with
    ``max_staleness > 0``): the engine then needs weights of its own, not the trainer's module.
    At ``max_staleness=0`` the two halves strictly alternate, so sharing stays safe and exact."""
    return str(executor_cfg.name) == "async" and int(executor_cfg.max_staleness) > 0


def build_executor(cfg: Any, run: Any) -> "SyncExecutor":
    """The executor named by ``cfg.executor.name`` for ``run``.

    Raises:
        ConfigError: unknown name, negative ``max_staleness``, an
            asynchronous run on several processes with staleness > 0 (processes
            would consume different batches), or bad partial-rollout settings
            (:func:`check_partial`).
    """
    name = cfg.executor.name
    if name not in EXECUTORS:
        raise ConfigError(f"Unknown executor={name!r}. Valid choices: {', '.join(EXECUTORS)}.")
    k = int(cfg.executor.max_staleness)
    if k < 0:
        raise ConfigError(f"executor.max_staleness={k} must be >= 0.")
    check_partial(cfg)
    if name == "sync":
        return SyncExecutor(run)
    if int(getattr(cfg.trainer, "num_procs", 1)) > 1 and k > 0:
        raise ConfigError("executor=async with executor.max_staleness > 0 runs on one process "
                          "(each process would train on different batches). Fix: trainer.num_procs=1, "
                          "or executor.max_staleness=0.")
    return AsyncExecutor(run, k)


def check_partial(cfg: Any) -> None:
    """Validate the partial-rollout knobs (APRIL arXiv:2509.18521; CoPRIS arXiv:2511.05589).

    With ``executor.partial_rollout=true`` the producer half of every step
    (:meth:`rlpost.run.runner.Run.collect`, under ``executor=sync`` or
    ``executor=async``) goes through :class:`rlpost.core.partial.PartialRolloutProducer`
    instead of the sampler: prompts come straight from ``selector.select`` and
    every prompt gets one whole group of plain rollouts. Samplers with their own
    generation logic and selectors that act between generation and training
    (filter and refill, per-prompt budgets, hints, batch edits) have no place in
    that path, so they are refused rather than silently ignored.

    Raises:
        ConfigError: ``over_provision < 1``, ``partial_chunk_tokens < 1``, a
            sampler other than ``group`` / ``single``, or a selector that filters
            groups, allocates rollouts, gives hints or post-processes the batch.
    """
    ex = cfg.executor
    if bool(getattr(ex, "partial_train_unfinished", False)):
        if not bool(getattr(ex, "partial_rollout", False)):
            raise ConfigError("executor.partial_train_unfinished=true (T-PPO's window, arXiv:2506.15050) trains on "
                              "responses cut by a partial-rollout round. Fix: executor.partial_rollout=true, or "
                              "executor.partial_train_unfinished=false.")
        if cfg.sampler.name == "episode":
            raise ConfigError("executor.partial_train_unfinished=true cuts single responses, not multi-turn episodes. "
                              "Fix: sampler=group (or single), or executor.partial_train_unfinished=false.")
    if not bool(getattr(ex, "partial_rollout", False)):
        return
    op = float(getattr(ex, "over_provision", 1.0))
    if op < 1:
        raise ConfigError(f"executor.over_provision={op} must be >= 1 (APRIL keeps ceil(over_provision * needed) "
                          f"groups in flight). Fix: executor.over_provision=1.5, or 1 for no over-provisioning.")
    chunk = int(getattr(ex, "partial_chunk_tokens", 16))
    if chunk < 1:
        raise ConfigError(f"executor.partial_chunk_tokens={chunk} must be >= 1 (tokens per response per round).")
    sampler = cfg.sampler.name
    if sampler == "episode":  # unfinished episodes are carried whole (rlpost.samplers.episode_partial)
        sp = cfg.sampler.params or {}
        if str(sp.get("branching", "none")) != "none":
            raise ConfigError("executor.partial_rollout=true carries episodes without branching. "
                              "Fix: sampler.params.branching=none, or executor.partial_rollout=false.")
        if float(sp.get("env_reward_weight", 0.0) or 0.0) and str(sp.get("env_reward_at", "episode")) == "episode":
            raise ConfigError("executor.partial_rollout=true with env_reward_weight needs per-turn token rewards. "
                              "Fix: sampler.params.env_reward_at=turn, or executor.partial_rollout=false.")
    elif sampler not in PARTIAL_SAMPLERS:
        raise ConfigError(f"executor.partial_rollout=true generates plain groups through the carry-over buffer, "
                          f"so sampler={sampler} would be ignored. Fix: sampler=group (or single), or "
                          f"executor.partial_rollout=false.")
    import rlpost.selectors  # noqa: F401  (registers)

    roles = sorted(r.value for r in SELECTORS.get(cfg.selector.name).roles)  # declared roles beyond prompt choice
    if roles:
        plain = ", ".join(e.name for e in SELECTORS if not e.obj.roles)
        raise ConfigError(f"executor.partial_rollout=true takes prompts from selector.select only; "
                          f"selector={cfg.selector.name} also does {', '.join(roles)} between generation and training, "
                          f"which the carry-over buffer does not do. Fix: a selector that only chooses prompts "
                          f"({plain}), or executor.partial_rollout=false.")


class SyncExecutor:
    """Roll out, then learn, every step. ``step()`` returns the step's metrics."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def step(self) -> Dict[str, Any]:
        """Run the next step (collect + learn)."""
        r = self.run
        return r.learn(r.collect(r.step + 1, r.trainer.version, r.step))

    def paused(self):
        """Context in which the producer is idle (no-op here)."""
        return _Null()

    def close(self) -> None:
        """Nothing to stop."""


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Paused:
    def __init__(self, ex: "AsyncExecutor") -> None:
        self.ex = ex

    def __enter__(self):
        self.ex.engine_lock.acquire()
        self.ex.run.engine.sync_weights(self.ex.run.trainer.policy)
        return self

    def __exit__(self, *exc):
        self.ex.engine_lock.release()
        return False


class AsyncExecutor(SyncExecutor):
    """Background-thread producer with a staleness bound.

    Args:
        run: the :class:`rlpost.run.runner.Run` (its engine must hold a private copy
            of the weights; :func:`rlpost.rollout.build_engine` does so for
            ``executor=async``).
        max_staleness: the largest allowed ``learner step - 1 - weights step``.
    """

    def __init__(self, run: Any, max_staleness: int) -> None:
        import copy

        super().__init__(run)
        self.k = int(max_staleness)
        self.cv = threading.Condition()
        self.engine_lock = threading.RLock()  # held while the producer uses the engine / selector
        # Published weights: the learner copies its policy here after each step; the producer
        # loads its engine from here, so neither waits for the other's long phases.
        # At max_staleness 0 producer and learner strictly alternate and the producer reads the
        # trainer's weights directly.
        self.shadow_lock = threading.Lock()
        self.shadow = copy.deepcopy(run.trainer.policy).eval().requires_grad_(False) if self.k > 0 else None
        self.shadow_version = (run.trainer.version, run.step)
        self.requested = run.step  # highest step the learner has asked for
        self.done = run.step  # steps whose update finished
        self.ready: Dict[int, Any] = {}
        self.error: Optional[BaseException] = None
        self.stop = False
        self.thread = threading.Thread(target=self._produce, name="rlpost-rollout", daemon=True)
        self.thread.start()

    # ---------------------------------------------------------------- producer
    def _produce(self) -> None:
        r = self.run
        t = r.step + 1
        try:
            while t <= r.cfg.steps:
                with self.cv:
                    self.cv.wait_for(lambda: self.stop or (t <= self.requested + self.k and self.done >= t - 1 - self.k))
                    if self.stop:
                        return
                with self.engine_lock:
                    with self.shadow_lock:
                        r.engine.sync_weights(self.shadow if self.shadow is not None else r.trainer.policy)
                        version, wstep = self.shadow_version
                    c = r.collect(t, version, wstep)
                with self.cv:
                    self.ready[t] = c
                    self.cv.notify_all()
                t += 1
        except BaseException as e:  # surfaced in the learner thread
            with self.cv:
                self.error = e
                self.cv.notify_all()

    # ----------------------------------------------------------------- learner
    def step(self) -> Dict[str, Any]:
        """Wait for the next step's rollouts, learn from them, and report staleness.

        Raises:
            whatever the producer raised; RuntimeError if it stopped early.
        """
        r = self.run
        s = r.step + 1
        t0 = time.perf_counter()
        with self.cv:
            self.requested = s
            self.cv.notify_all()
            self.cv.wait_for(lambda: s in self.ready or self.error is not None)
            if self.error is not None:
                raise self.error
            c = self.ready.pop(s)
        wait = time.perf_counter() - t0
        assert (s - 1) - c.weights_step <= self.k, (s, c.weights_step, self.k)  # guaranteed by the producer's wait
        stale = (s - 1) - c.batch.extras["policy_step"]  # per row: its oldest token's weights
        c.t_start = time.perf_counter() - wait  # the step's wall time includes the wait
        m = r.learn(c, sync_engine=False)
        with self.shadow_lock:
            if self.shadow is not None:
                self.shadow.load_state_dict(r.trainer.policy.state_dict())
            self.shadow_version = (r.trainer.version, s)
        with self.cv:
            self.done = s
            self.cv.notify_all()
        m["async/wait_s"] = wait
        m["async/staleness_mean"] = float(stale.float().mean())
        m["async/staleness_max"] = float(stale.max())
        for k in range(self.k + 1):
            m[f"async/staleness_hist_{k}"] = float((stale == k).float().mean())
        if r.partial is not None:  # carried-over tokens may be older than the bound
            m["async/staleness_hist_over_k"] = float((stale > self.k).float().mean())
        return m

    def paused(self):
        """Context in which the producer is idle and the engine holds the learner's newest weights.

        For evaluation and checkpoints (the selector is not mutated meanwhile).
        """
        return _Paused(self)

    def close(self) -> None:
        """Stop the producer thread (after its current rollout)."""
        with self.cv:
            self.stop = True
            self.cv.notify_all()
        self.thread.join(timeout=600)
