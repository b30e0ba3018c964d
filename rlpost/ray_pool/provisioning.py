"""Sizing the rollout-worker pool: ECHO-2's overlap capacity model, provisioning rule and cost-aware activation.

Paper: "ECHO-2: A Large-Scale Distributed Rollout Framework for Cost-Efficient
Reinforcement Learning" (arXiv:2602.02192). A central learner trains while remote
inference workers generate rollouts with a policy snapshot at most ``S`` learner
steps old; rollout generation, snapshot dissemination and training overlap.

What was read, and what is our reading (docs/SCALING.md, "ECHO-2"): the paper's
equations could not be read here (only its abstract and third-party summaries of
its Section 3 were reachable). From those summaries: ``R`` rollouts per learner
update, ``T_train`` seconds per update, a snapshot published every ``kappa``
learner steps with ``kappa = S - 1`` by default, worker ``i`` producing ``mu_i``
rollouts per second, ``A`` the active workers, and the overlap condition stated in
words: during one publication period of ``kappa`` steps the learner consumes
``kappa * R`` rollouts and publishes one snapshot, and generating those rollouts
plus disseminating the snapshot must fit in the period so that the learner never
waits. Written as an inequality (our reading)::

    T_bcast + kappa * R / sum_{i in A} mu_i  <=  kappa * T_train

which gives the provisioning rule ``sum mu_i >= kappa R / (kappa T_train - T_bcast)``.
The dissemination latency of the peer-assisted pipelined broadcast and the
activation rule (the cheapest set of workers that meets the rule) are our
reading too; see :func:`pipelined_broadcast_s` and :func:`cheapest_activation`.

Everything here is a pure function of numbers (no Ray, no torch): ``rlpost``'s
``launcher=ray`` uses :func:`plan_from_config` when
``launcher.num_rollout_workers=auto``, and ``scripts/plan_rollout_workers.py``
prints the plan of a config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from rlpost.core.errors import ConfigError

# launcher.provisioning.*: every key, its default, its meaning (conf/launcher/ray.yaml declares the same set)
PROVISIONING_DEFAULTS: Dict[str, Any] = {
    "train_s": None,               # T_train: learner seconds per update (measured: time/update_s + old/ref passes)
    "rollouts_per_step": None,     # R (null: selector.prompts_per_step x algo.n_samples_per_prompt)
    "staleness": None,             # S (null: executor.max_staleness)
    "publish_every": None,         # kappa (null: S - 1, the paper's default)
    "bcast_s": None,               # T_bcast declared directly (null: the pipelined-broadcast model below)
    "model_bytes": None,           # snapshot size in bytes for the broadcast model (null with bcast_s null: T_bcast = 0)
    "link_bytes_per_s": None,      # per-hop bandwidth of the broadcast model, bytes/s
    "hop_latency_s": 0.0,          # per-chunk, per-hop latency of the broadcast model
    "chunks": 1,                   # chunks the snapshot is cut into for the pipeline
    "worker_rollouts_per_s": None,  # mu of one worker of a homogeneous pool
    "worker_kinds": [],            # heterogeneous pool: [{name, rollouts_per_s, cost_per_hour, count}]
    "max_workers": 1024,           # a homogeneous plan above this stops the run (our choice: a unit slip, not a pool); null: no cap
}
KIND_KEYS = ("name", "rollouts_per_s", "cost_per_hour", "count")


# --------------------------------------------------------------------------- the capacity model


def publish_period(staleness: int, publish_every: Optional[int] = None) -> int:
    """``kappa``: learner steps between two published snapshots.

    Args:
        staleness: ``S``, the most learner steps a rollout's policy may lag the learner.
        publish_every: an explicit ``kappa``; None takes the paper's default ``S - 1``
            (one step of the staleness budget is left to dissemination).
    Returns:
        ``kappa >= 1``.
    Raises:
        ConfigError: ``S < 2`` with the default (``S - 1 = 0`` leaves no period), or an
            explicit ``kappa`` outside ``1..S`` (our bound: a snapshot used for more than
            ``S`` steps would produce rollouts older than the budget).
    """
    s = int(staleness)
    if publish_every is None:
        if s < 2:
            raise ConfigError(f"provisioning: the paper's publication period kappa = S - 1 needs staleness S >= 2, got "
                              f"S={s}. Fix: executor=async executor.max_staleness=2 (or launcher.provisioning.staleness=2), or set "
                              f"launcher.provisioning.publish_every=1 to model a push after every step.")
        return s - 1
    k = int(publish_every)
    if not 1 <= k <= max(s, 1):
        raise ConfigError(f"launcher.provisioning.publish_every={k} must lie in 1..S (S={s}): a snapshot kept longer "
                          f"than S steps generates rollouts older than the staleness budget.")
    return k


def cycle_s(rollouts_per_step: float, train_s: float, bcast_s: float, kappa: int, throughput: float) -> Tuple[float, float]:
    """One publication period on each side of the overlap condition (our reading of the paper's model).

    Args:
        rollouts_per_step: ``R``.
        train_s: ``T_train`` in seconds.
        bcast_s: ``T_bcast`` in seconds.
        kappa: publication period in learner steps.
        throughput: aggregate rollout throughput ``sum mu_i`` in rollouts per second (> 0).
    Returns:
        ``(learner_s, rollout_side_s)`` = ``(kappa T_train, T_bcast + kappa R / sum mu_i)``;
        the learner never waits when the second is <= the first.
    """
    if throughput <= 0:
        raise ConfigError(f"provisioning: aggregate rollout throughput must be > 0 rollouts/s, got {throughput}.")
    return kappa * train_s, bcast_s + kappa * rollouts_per_step / throughput


def learner_utilization(rollouts_per_step: float, train_s: float, bcast_s: float, kappa: int, throughput: float) -> float:
    """Fraction of wall time the learner trains: ``kappa T_train / max(kappa T_train, T_bcast + kappa R / mu)``.

    Our reading: when the rollout side of a period is longer, the learner waits for the
    difference once per period. Returns a number in ``(0, 1]``.
    """
    learn, roll = cycle_s(rollouts_per_step, train_s, bcast_s, kappa, throughput)
    return learn / max(learn, roll)


def required_throughput(rollouts_per_step: float, train_s: float, bcast_s: float, kappa: int) -> float:
    """The provisioning rule: the least aggregate rollout throughput (rollouts/s) that keeps the learner busy.

    ``sum mu_i >= kappa R / (kappa T_train - T_bcast)`` (our reading of the overlap
    condition, see the module doc). With ``T_bcast = 0`` this is ``R / T_train``:
    produce a batch per learner step.

    Raises:
        ConfigError: non-positive ``R`` or ``T_train``, negative ``T_bcast``, or
            ``kappa T_train <= T_bcast``: dissemination alone fills the period and no
            number of workers keeps the learner busy (raise S, or speed up dissemination).
    """
    if rollouts_per_step <= 0 or train_s <= 0:
        raise ConfigError(f"provisioning: rollouts_per_step ({rollouts_per_step}) and train_s ({train_s}) must be > 0.")
    if bcast_s < 0:
        raise ConfigError(f"provisioning: bcast_s={bcast_s} must be >= 0.")
    window = kappa * train_s - bcast_s
    if window <= 0:
        raise ConfigError(f"provisioning: dissemination takes {bcast_s:.3g} s but a publication period of kappa={kappa} "
                          f"steps is {kappa * train_s:.3g} s of training, so no number of workers keeps the learner "
                          f"busy. Fix: a larger staleness budget (executor.max_staleness), more chunks or bandwidth "
                          f"for the broadcast, or launcher.num_rollout_workers=N set by hand.")
    return kappa * rollouts_per_step / window


def workers_needed(required: float, worker_rollouts_per_s: float) -> int:
    """Homogeneous pool: ``ceil(required / mu)`` workers (at least 1).

    Raises:
        ConfigError: ``mu <= 0``.
    """
    if worker_rollouts_per_s <= 0:
        raise ConfigError(f"launcher.provisioning.worker_rollouts_per_s={worker_rollouts_per_s} must be > 0.")
    # a hair of tolerance so that an exact ratio (e.g. 10.000000000000002) does not add a worker
    return max(1, math.ceil(required / worker_rollouts_per_s - 1e-9))


# --------------------------------------------------------------------------- dissemination


def pipelined_broadcast_s(model_bytes: float, link_bytes_per_s: float, n_workers: int, chunks: int = 1,
                          hop_latency_s: float = 0.0) -> float:
    """Latency for a snapshot to reach all ``n_workers`` through a peer relay chain, cut into ``chunks`` (our reading).

    The learner sends chunk 1 to worker 1, which forwards it to worker 2 while it
    receives chunk 2, and so on: the last chunk reaches the last worker after
    ``chunks + n_workers - 1`` chunk-hops of ``model_bytes / (chunks * link) + hop_latency``
    seconds each::

        T_bcast = (C + N - 1) * (M / (C B) + l)

    ``chunks=1`` is store-and-forward along the chain (``N M / B``); many chunks
    approach one model transfer ``M / B`` however many workers there are, which is
    why the learner's uplink stops being the bottleneck. The paper's own formula was
    not readable; this is the standard chunked-pipeline latency.

    Raises:
        ConfigError: non-positive size, bandwidth, workers or chunks, or negative latency.
    """
    if model_bytes <= 0 or link_bytes_per_s <= 0 or n_workers < 1 or chunks < 1 or hop_latency_s < 0:
        raise ConfigError(f"provisioning broadcast model: model_bytes={model_bytes}, link_bytes_per_s="
                          f"{link_bytes_per_s}, n_workers={n_workers}, chunks={chunks} must be > 0 and "
                          f"hop_latency_s={hop_latency_s} >= 0.")
    return (chunks + n_workers - 1) * (model_bytes / (chunks * link_bytes_per_s) + hop_latency_s)


def one_to_many_broadcast_s(model_bytes: float, link_bytes_per_s: float, n_workers: int) -> float:
    """The comparison point: the learner uploads the whole snapshot to each worker over its own link, ``N M / B``."""
    if model_bytes <= 0 or link_bytes_per_s <= 0 or n_workers < 1:
        raise ConfigError("provisioning broadcast model: model_bytes, link_bytes_per_s and n_workers must be > 0.")
    return n_workers * model_bytes / link_bytes_per_s


# --------------------------------------------------------------------------- cost-aware activation


@dataclass(frozen=True)
class WorkerKind:
    """A declared kind of rollout worker.

    Attributes:
        name: label (e.g. ``a100-cloud``).
        rollouts_per_s: throughput ``mu`` of one worker of this kind, rollouts per second (> 0).
        cost_per_hour: price of one worker, any currency per hour (>= 0).
        count: how many are available (>= 0).
    """

    name: str
    rollouts_per_s: float
    cost_per_hour: float
    count: int


@dataclass
class Activation:
    """The chosen workers: ``counts[name]`` of each kind, their throughput and cost per hour."""

    counts: Dict[str, int] = field(default_factory=dict)
    throughput: float = 0.0
    cost_per_hour: float = 0.0

    @property
    def n_workers(self) -> int:
        """Workers activated, all kinds together."""
        return sum(self.counts.values())


def parse_kinds(raw: Sequence[Mapping[str, Any]]) -> List[WorkerKind]:
    """``launcher.provisioning.worker_kinds`` as :class:`WorkerKind` s.

    Raises:
        ConfigError: an entry with a missing or unknown key, a duplicate name, or a value out of range.
    """
    kinds: List[WorkerKind] = []
    for i, d in enumerate(raw):
        where = f"launcher.provisioning.worker_kinds[{i}]"
        if not isinstance(d, Mapping):
            raise ConfigError(f"{where}: expected a mapping with keys {', '.join(KIND_KEYS)}, got {d!r}.")
        extra = sorted(set(d) - set(KIND_KEYS))
        missing = [k for k in KIND_KEYS if k not in d]
        if extra or missing:
            raise ConfigError(f"{where}: " + (f"unknown key(s) {', '.join(extra)}; " if extra else "")
                              + (f"missing {', '.join(missing)}; " if missing else "")
                              + f"the keys are {', '.join(KIND_KEYS)}.")
        k = WorkerKind(str(d["name"]), float(d["rollouts_per_s"]), float(d["cost_per_hour"]), int(d["count"]))
        if k.rollouts_per_s <= 0 or k.cost_per_hour < 0 or k.count < 0:
            raise ConfigError(f"{where} ({k.name}): rollouts_per_s must be > 0, cost_per_hour >= 0, count >= 0.")
        if any(o.name == k.name for o in kinds):
            raise ConfigError(f"{where}: duplicate name {k.name!r}.")
        kinds.append(k)
    return kinds


def cheapest_activation(kinds: Sequence[WorkerKind], required: float) -> Activation:
    """The cheapest set of available workers whose throughput meets ``required`` rollouts/s (our reading).

    Minimises ``sum_k n_k cost_k`` subject to ``sum_k n_k mu_k >= required`` and
    ``0 <= n_k <= count_k`` (integers): an exact branch and bound over the kinds in
    order of cost per rollout, bounded below by the fractional relaxation. Ties in
    cost go to fewer workers, then to more throughput. The paper states the rule as
    activating the cheapest workers that sustain the learner; greedily taking the
    lowest cost per rollout first can overshoot (see tests), so the exact optimum is
    what is returned.

    Raises:
        ConfigError: no kinds, or all available workers together fall short of ``required``.
    """
    if not kinds:
        raise ConfigError("launcher.provisioning.worker_kinds is empty: declare at least one kind of worker.")
    total = sum(k.rollouts_per_s * k.count for k in kinds)
    if total + 1e-9 < required:
        raise ConfigError(f"provisioning: every declared worker together gives {total:.4g} rollouts/s but the rule needs "
                          f"{required:.4g}. Fix: more workers (worker_kinds[].count), a larger staleness budget, or a "
                          f"faster learner step.")
    order = sorted(kinds, key=lambda k: (k.cost_per_hour / k.rollouts_per_s, k.name))
    best: List[Any] = [(math.inf, math.inf, math.inf), None]  # (cost, workers, -throughput), counts in `order`

    def search(i: int, need: float, cost: float, n: int, thr: float, counts: Tuple[int, ...]) -> None:
        if need <= 1e-9:
            key = (round(cost, 9), n, -thr)
            if key < best[0]:
                best[:] = [key, counts]
            return
        if i == len(order):
            return
        # fractional lower bound: the rest of the need at the best remaining cost per rollout
        rest = order[i:]
        if sum(k.rollouts_per_s * k.count for k in rest) + 1e-9 < need:
            return
        bound = cost + need * min(k.cost_per_hour / k.rollouts_per_s for k in rest)
        if round(bound, 9) > best[0][0]:
            return
        k = order[i]
        top = min(k.count, math.ceil(need / k.rollouts_per_s - 1e-9))
        for m in range(top, -1, -1):
            search(i + 1, need - m * k.rollouts_per_s, cost + m * k.cost_per_hour, n + m,
                   thr + m * k.rollouts_per_s, counts + (m,))

    search(0, float(required), 0.0, 0, 0.0, ())
    chosen = best[1] + (0,) * (len(order) - len(best[1]))
    counts = {k.name: m for k, m in zip(order, chosen) if m > 0}
    by_name = {k.name: k for k in kinds}
    return Activation(counts={n: counts[n] for n in sorted(counts)},
                      throughput=sum(by_name[n].rollouts_per_s * m for n, m in counts.items()),
                      cost_per_hour=sum(by_name[n].cost_per_hour * m for n, m in counts.items()))


# --------------------------------------------------------------------------- a config's plan


@dataclass
class Plan:
    """The provisioning rule's numbers for one config (what ``scripts/plan_rollout_workers.py`` prints).

    Attributes:
        rollouts_per_step, train_s, staleness, kappa: ``R``, ``T_train``, ``S``, ``kappa``.
        bcast_s: ``T_bcast`` used (declared, or from the broadcast model at ``n_workers``).
        required: rollouts/s the rule needs.
        n_workers: workers to run.
        activation: the chosen kinds (heterogeneous pools), else None.
        utilization: the learner's predicted busy fraction with the chosen workers.
    """

    rollouts_per_step: float
    train_s: float
    staleness: int
    kappa: int
    bcast_s: float
    required: float
    n_workers: int
    activation: Optional[Activation]
    utilization: float

    def lines(self) -> List[str]:
        """Human-readable lines, one number each."""
        out = [f"R (rollouts per learner step)        {self.rollouts_per_step:g}",
               f"T_train (s per learner step)         {self.train_s:g}",
               f"S (staleness budget, steps)          {self.staleness}",
               f"kappa (steps between snapshots)      {self.kappa}",
               f"T_bcast (s to reach every worker)    {self.bcast_s:.4g}",
               f"required throughput (rollouts/s)     {self.required:.4g}  = kappa R / (kappa T_train - T_bcast)",
               f"workers                              {self.n_workers}"]
        if self.activation is not None:
            a = self.activation
            out.append("activated                            "
                       + ", ".join(f"{n} x{m}" for n, m in a.counts.items())
                       + f"  ({a.throughput:.4g} rollouts/s, {a.cost_per_hour:.4g} per hour)")
        out.append(f"predicted learner utilization        {self.utilization:.3f}")
        return out


def check_provisioning(raw: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``launcher.provisioning`` with defaults filled in.

    Raises:
        ConfigError: an unknown key (naming the valid ones).
    """
    given = dict(raw or {})
    extra = sorted(set(given) - set(PROVISIONING_DEFAULTS))
    if extra:
        raise ConfigError(f"launcher.provisioning: unknown key(s) {', '.join(extra)}. Valid keys: "
                          f"{', '.join(PROVISIONING_DEFAULTS)}.")
    return {**PROVISIONING_DEFAULTS, **given}


def plan(p: Mapping[str, Any], rollouts_per_step: float, staleness: int) -> Plan:
    """Apply the rule to checked provisioning settings ``p`` (:func:`check_provisioning`).

    ``T_bcast``: ``p["bcast_s"]`` when declared; else the pipelined-broadcast model at
    the pool's own size when ``model_bytes`` is given (the pool is grown until the
    rule holds at the ``T_bcast`` of the pool it yields); else 0.

    Raises:
        ConfigError: ``train_s`` missing, neither ``worker_rollouts_per_s`` nor
            ``worker_kinds`` given (or both), or any error of the functions above.
    """
    if p.get("train_s") is None:
        raise ConfigError("launcher.num_rollout_workers=auto needs launcher.provisioning.train_s (seconds per learner "
                          "step; a run's time/update_s plus its log-prob passes is a measured value).")
    kinds = parse_kinds(p.get("worker_kinds") or [])
    mu = p.get("worker_rollouts_per_s")
    if (mu is None) == (not kinds):
        raise ConfigError("launcher.provisioning: give exactly one of worker_rollouts_per_s (one kind of worker) and "
                          "worker_kinds (several kinds, with cost_per_hour and count).")
    r = float(p["rollouts_per_step"]) if p.get("rollouts_per_step") is not None else float(rollouts_per_step)
    s = int(p["staleness"]) if p.get("staleness") is not None else int(staleness)
    kappa = publish_period(s, p.get("publish_every"))
    t_train = float(p["train_s"])
    modelled = p.get("bcast_s") is None and p.get("model_bytes") is not None
    if modelled and p.get("link_bytes_per_s") is None:
        raise ConfigError("launcher.provisioning.model_bytes needs link_bytes_per_s (or declare bcast_s instead).")

    def bcast(n: int) -> float:
        if p.get("bcast_s") is not None:
            return float(p["bcast_s"])
        if not modelled:
            return 0.0
        return pipelined_broadcast_s(float(p["model_bytes"]), float(p["link_bytes_per_s"]), n, int(p["chunks"]),
                                     float(p["hop_latency_s"]))

    cap_workers = p.get("max_workers")
    if cap_workers is not None and (isinstance(cap_workers, bool) or not isinstance(cap_workers, int) or cap_workers < 1):
        raise ConfigError(f"launcher.provisioning.max_workers={cap_workers!r} must be an integer >= 1, or null for no cap. "
                          f"Fix: launcher.provisioning.max_workers=1024.")
    n, act = 1, None
    cap = sum(k.count for k in kinds) if kinds else 100_000
    while True:  # T_bcast grows with the pool under the chain model: iterate to the pool that satisfies itself
        tb = bcast(n)
        req = required_throughput(r, t_train, tb, kappa)
        if kinds:
            act = cheapest_activation(kinds, req)
            m, thr = act.n_workers, act.throughput
        else:
            m = workers_needed(req, float(mu))
            thr = m * float(mu)
            if cap_workers is not None and m > cap_workers:
                raise ConfigError(
                    f"launcher.num_rollout_workers=auto: the rule needs {m} workers of {float(mu):.4g} rollouts/s each "
                    f"({req:.4g} rollouts/s), above launcher.provisioning.max_workers={cap_workers}. Fix: "
                    f"check the units of train_s (seconds per learner step) and worker_rollouts_per_s (rollouts per "
                    f"second of one worker), or raise launcher.provisioning.max_workers if the pool is meant.")
        if m <= n or not modelled:  # m >= n always (T_bcast only grows with the pool): m == n here
            n = m
            break
        if m > cap:
            raise ConfigError(f"provisioning: the broadcast chain grows faster than the workers help (needs {m} > {cap}). "
                              f"Fix: more chunks, more bandwidth, or a larger staleness budget.")
        n = m
    util = learner_utilization(r, t_train, tb, kappa, thr)
    return Plan(r, t_train, s, kappa, tb, req, n, act, util)


def plan_from_config(cfg: Any) -> Plan:
    """:func:`plan` for a composed rlpost config (``R`` and ``S`` from the selector, algorithm and executor)."""
    p = check_provisioning(cfg.launcher.get("provisioning"))
    r = int(cfg.selector.prompts_per_step) * int(cfg.algo.n_samples_per_prompt)
    s = int(cfg.executor.max_staleness) if str(cfg.executor.name) == "async" else 0
    try:
        return plan(p, r, s)
    except (TypeError, ValueError) as e:  # a setting that is not a number (e.g. worker_rollouts_per_s=abc)
        raise ConfigError(f"launcher.provisioning: {e}. Fix: every time, size and rate is a number "
                          f"(docs/SCALING.md, \"ECHO-2\").") from None
