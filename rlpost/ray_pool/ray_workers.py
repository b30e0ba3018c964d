"""``launcher=ray``: the trainer in the driver process, rollouts in a pool of Ray actors.

Each :class:`RolloutWorker` actor holds its own copy of the policy and a rollout
engine built by :func:`rlpost.rollout.build_engine` (``rollout=hf`` on CPU or a GPU,
``rollout=vllm`` on a GPU). The driver's :class:`RayRolloutPool` is a rollout engine
(:class:`rlpost.rollout.base.RolloutEngine`) to the runner, so the run graph, the
samplers, the partial-rollout producer and both executors use it unchanged:

* **generate** (one call of the sampler driver): the rows are cut into runs of
  identical prompts (a group is never split), the runs are apportioned equally
  across workers (:func:`rlpost.distributed.local_run_rows`, the split the
  data-parallel ranks use), every slice goes to its worker with
  ``SamplingParams.row_offset`` set to its first row, and the results are
  concatenated in row order. Row ``i`` samples from its own stream (seed + row
  offset + i), so the tokens do not depend on the number of workers.
* **weights** (:meth:`RayRolloutPool.sync_weights`, after every update, or before
  each producer step under ``executor=async``): with ``weight_sync=object_store``
  the state_dict is put once into Ray's object store as numpy arrays
  (:func:`state_arrays`) and every worker maps and loads the same object (no
  per-worker pickling: same-node workers read it from shared memory, other nodes
  fetch one copy each); with ``weight_sync=collective`` the driver broadcasts
  every tensor over a process group it shares with the workers (NCCL on GPUs,
  gloo on CPU; :class:`WeightGroup`). Each generate call carries the weights
  version, so a worker that missed a push (a replacement) loads the newest
  weights before generating.
* **recovery**: when a worker dies mid-step (``RayActorError``), its slices are
  regenerated with the same seeds and row offsets on a replacement worker (up to
  ``launcher.max_restarts`` replacements over the run) or on a remaining one;
  nothing is lost, the step's output is the one an undisturbed pool gives. Each
  failure is logged as a warning and counted in ``ray/worker_failures``.

The layout follows the "hybrid" trainer/rollout split of RL post-training systems
(HybridFlow, "HybridFlow: A Flexible and Efficient RLHF Framework", arXiv:2409.19256;
OpenRLHF, arXiv:2405.11143, which also places vLLM engines as Ray actors and
broadcasts weights to them over NCCL); the placement rules and the recovery policy
are rlpost's.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from rlpost.core.errors import ConfigError, RlpostError
from rlpost.distributed import local_run_rows
from rlpost.models.loader import load_policy
from rlpost.models.lora import is_lora, merged_state_dict
from rlpost.rollout import build_engine
from rlpost.rollout.base import EngineConfig, concat_generations

log = logging.getLogger("rlpost")

_PKG_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding this checkout's rlpost package


# ------------------------------------------------------------------ weights as object-store arrays
def _policy_state(policy: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """What rollout workers load: the plain model's state_dict (a LoRA policy merged, W + (alpha/r) B A)."""

    return merged_state_dict(policy) if is_lora(policy) else policy.state_dict()


def state_arrays(state: Dict[str, torch.Tensor]) -> Dict[str, Tuple[str, Any]]:
    """``state`` as ``{name: (torch dtype name, numpy array)}`` for Ray's zero-copy numpy path.

    Ray stores numpy arrays out-of-band in the shared-memory object store and a
    reader on the same node maps them without a copy; torch tensors would be
    pickled. 16-bit floats numpy lacks (bfloat16) travel as their int16 bits.
    """
    out = {}
    for k, v in state.items():
        t = v.detach().to("cpu").contiguous()
        if t.dtype in (torch.bfloat16, torch.float16):
            out[k] = (str(t.dtype).replace("torch.", ""), t.view(torch.int16).numpy())
        else:
            out[k] = (str(t.dtype).replace("torch.", ""), t.numpy())
    return out


def arrays_state(arrays: Dict[str, Tuple[str, Any]]) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`state_arrays` (tensors view the arrays; ``load_state_dict`` copies from them)."""
    import warnings

    out = {}
    with warnings.catch_warnings():  # object-store arrays are read-only; the tensors are only read
        warnings.simplefilter("ignore", UserWarning)
        for k, (dt, a) in arrays.items():
            t = torch.from_numpy(a)
            out[k] = t.view(getattr(torch, dt)) if dt in ("bfloat16", "float16") else t
    return out


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process (as :func:`rlpost.run.runner.cpu_seconds`, without importing the runner)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class WeightGroup:
    """A process group of the driver (rank 0) and the rollout workers (ranks 1..n) for weight broadcasts.

    Built with ``torch.distributed``'s process-group constructors on their own
    TCPStore, so it neither needs nor disturbs the default group a DeepSpeed
    trainer may hold. ``backend``: ``nccl`` (GPU workers; tensors go device to
    device) or ``gloo`` (CPU). The same class runs on both sides
    (:meth:`RolloutWorker.join_weight_group`).

    Args:
        host, port: the TCPStore rank 0 serves.
        rank, world: this process's rank and the group size.
        backend: ``nccl`` | ``gloo``.
        timeout_s: how long a broadcast waits for the other ranks.
    """

    def __init__(self, host: str, port: int, rank: int, world: int, backend: str, timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        td = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, world, rank == 0, timeout=td)
        self.backend, self.rank = backend, rank
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world, dist.ProcessGroupNCCL.Options())
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world, td)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Broadcast ``t`` from rank 0 in place (every rank calls it with a tensor of the same shape)."""
        import torch.distributed as dist

        o = dist.BroadcastOptions()
        o.rootRank, o.rootTensor = 0, 0
        self.pg.broadcast([t], o).wait()
        return t


# --------------------------------------------------------------------------------------- the actor
class RolloutWorker:
    """One rollout worker (run as a Ray actor by :class:`RayRolloutPool`).

    Builds the policy architecture from ``model`` (a LoRA config is built
    without adapters: workers hold merged weights) and an engine with
    :func:`rlpost.rollout.build_engine`; the weights come from the driver.

    Args:
        engine_cfg: the pool's :class:`rlpost.rollout.base.EngineConfig` as a plain dict
            (``rollout``, ``precision``, ``model`` sections as ``OmegaConf.to_container`` gives them, ``seed``).
        gpu: the worker holds a GPU (``launcher.gpus_per_worker > 0``).
        index: the worker's slot in the pool (logs only).
    """

    def __init__(self, engine_cfg: Dict[str, Any], gpu: bool, index: int) -> None:
        from omegaconf import OmegaConf

        model = OmegaConf.create(engine_cfg["model"])
        if model.get("lora") is not None:
            model.lora.rank = 0  # merged weights: a plain model
        ec = EngineConfig(OmegaConf.create(engine_cfg["rollout"]), OmegaConf.create(engine_cfg["precision"]), model,
                          int(engine_cfg["seed"]), share_weights=True)
        self.index = index
        self.device = torch.device("cuda" if gpu else "cpu")
        # vLLM holds its own weights: the worker's torch copy only seeds vLLM's model directory (on a GPU
        # node in 16 bits, on the CPU in fp32, vLLM's CPU rollout dtype) and pushes go straight into vLLM
        self.vllm = str(ec.rollout.engine) == "vllm"
        self.policy, self.tokenizer = load_policy(ec.model, torch.bfloat16 if self.vllm and gpu else torch.float32,
                                                  seed=ec.seed)
        self.policy.eval().requires_grad_(False)
        if not self.vllm:
            self.policy.to(self.device)
        self.engine = build_engine(ec, self.policy, self.tokenizer, self.device)
        self.version = -1
        self.group: Optional[WeightGroup] = None

    def ping(self) -> Tuple[int, str]:
        """``(process id, Ray node id)``: the pool checks placement with it."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def device_info(self) -> Dict[str, Any]:
        """Where this worker runs: ``pid``, ``cuda_visible`` (its ``CUDA_VISIBLE_DEVICES``), ``device``
        (the engine's), and on CUDA the ``uuid`` / ``pci_bus_id`` of its device 0 (what the driver compares with
        the device the mapping named; ``scripts/gpu_check.py --part device_map``)."""
        info: Dict[str, Any] = {"pid": os.getpid(), "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                "device": str(self.device)}
        if self.device.type == "cuda":
            p = torch.cuda.get_device_properties(0)
            info.update(uuid=str(getattr(p, "uuid", "")), pci_bus_id=str(getattr(p, "pci_bus_id", "")),
                        count=torch.cuda.device_count())
        return info

    def load_weights(self, ref: List[Any], version: int) -> float:
        """Load the object-store weights ``ref[0]`` (:func:`state_arrays`) as ``version``; returns seconds."""
        import ray

        t0 = time.perf_counter()
        if version != self.version:
            self._load(arrays_state(ray.get(ref[0])), version)
        return time.perf_counter() - t0

    def _load(self, state: Dict[str, torch.Tensor], version: int) -> None:
        if self.vllm:  # (name, tensor) pairs into vLLM's loader (VLLMRolloutEngine.sync_weights)
            self.engine.sync_weights(list(state.items()))
        else:
            self.policy.load_state_dict(state)
            self.engine.sync_weights(self.policy)
        self.version = version

    def join_weight_group(self, host: str, port: int, rank: int, world: int, backend: str) -> None:
        """Join the driver's :class:`WeightGroup` as ``rank`` (blocks until every rank joined)."""
        self.group = WeightGroup(host, port, rank, world, backend)

    def receive_weights(self, meta: List[Tuple[str, str, List[int]]], version: int) -> float:
        """Receive a broadcast of every tensor named in ``meta`` ``(name, dtype, shape)`` and load it; returns seconds.

        On GPUs the tensors arrive on the worker's device; the engine then loads
        them (``rollout=vllm``: ``model.load_weights`` through ``LLM.apply_model``).
        """
        t0 = time.perf_counter()
        dev = self.device if self.group.backend == "nccl" else torch.device("cpu")
        state = {}
        for name, dt, shape in meta:
            state[name] = self.group.broadcast(torch.empty(shape, dtype=getattr(torch, dt), device=dev))
        self._load(state, version)
        return time.perf_counter() - t0

    def generate(self, prompts: List[List[int]], params: Any, ref: List[Any], version: int) -> Tuple[Any, Dict[str, float]]:
        """Generate one response per prompt with weights ``version`` (loaded from ``ref[0]`` if this worker lacks them).

        Returns:
            ``(GenerationResult, {"cpu_s", "gen_s", "load_s"})``: this process's CPU
            seconds, generation and weight-loading wall seconds of the call.
        """
        cpu0 = _cpu_seconds()
        load = 0.0
        if version != self.version:
            if not ref or ref[0] is None:
                raise RuntimeError(f"rollout worker {self.index} lacks weights version {version}")
            load = self.load_weights(ref, version)
        t0 = time.perf_counter()
        res = self.engine.generate(prompts, params)
        return res, {"cpu_s": _cpu_seconds() - cpu0, "gen_s": time.perf_counter() - t0, "load_s": load}

    def close(self) -> None:
        """Close the engine (vLLM frees its GPU memory)."""
        self.engine.close()


# ---------------------------------------------------------------------------------------- the pool
def init_ray(lc: Any) -> bool:
    """Connect to (``launcher.address``) or start a Ray cluster; returns True when this call started it.

    An already initialised Ray (a test's cluster, a notebook) is reused as it is.

    Raises:
        ConfigError: the address cannot be reached (names the ``ray start`` command).
    """
    import ray

    if ray.is_initialized():
        return False
    env = {"PYTHONPATH": os.pathsep.join(p for p in (_PKG_ROOT, os.environ.get("PYTHONPATH", "")) if p),
           "TOKENIZERS_PARALLELISM": "false"}
    # the workers' own output stays in Ray's session logs (its path goes to cli.log): streamed to the driver
    # it reached the console as "(RolloutWorker pid=...)" lines with raw colour codes; a worker's error still
    # reaches the driver as the failed call's exception
    kw: Dict[str, Any] = {"runtime_env": {"env_vars": env}, "log_to_driver": False, "configure_logging": False}
    addr = lc.address
    if addr in (None, "", "null", "none"):
        kw["include_dashboard"] = False
        if lc.get("object_store_mb"):
            kw["object_store_memory"] = int(lc.object_store_mb) * 2**20
        ray.init(**kw)
        return True
    try:
        ray.init(address=str(addr), **kw)
    except (ConnectionError, RuntimeError) as e:
        raise ConfigError(f"launcher.address={addr}: cannot join a Ray cluster ({str(e).splitlines()[0][:160]}). "
                          f"Fix: start one with `ray start --head` on the head node (and `ray start "
                          f"--address=HEAD:6379` on the others), or launcher.address=null for a local cluster.") from None
    return True


def _session_logs() -> str:
    """The directory of this Ray session's logs (``/tmp/ray/session_*/logs``), or ``?``."""
    try:
        import ray

        return str(ray._private.worker.global_worker.node.get_logs_dir_path())
    except Exception:  # pragma: no cover - a private API of Ray
        return "?"


def route_ray_logging() -> Tuple[List[logging.Handler], bool]:
    """Send Ray's logger (``ray``) through this process's handlers instead of its own stderr handler.

    Under the CLI that puts Ray's start-up notices in ``cli.log`` and, below ERROR, off the
    console (:data:`rlpost.core.tracking.QUIET_LOGGERS`). Returns what :func:`restore_ray_logging` restores.
    """
    lg = logging.getLogger("ray")
    saved = (list(lg.handlers), lg.propagate)
    if logging.getLogger().handlers:  # the CLI's handlers (Hydra's job logging); elsewhere leave Ray's own
        lg.handlers, lg.propagate = [], True
    return saved


def restore_ray_logging(saved: Tuple[List[logging.Handler], bool]) -> None:
    """Undo :func:`route_ray_logging`."""
    lg = logging.getLogger("ray")
    lg.handlers, lg.propagate = list(saved[0]), saved[1]


def stop_actors(actors: Sequence[Any], timeout_s: float = 60.0) -> None:
    """Stop Ray actors in an order that lets each exit cleanly, before the cluster is shut down.

    Each actor (a :class:`RolloutWorker`: ``ping`` and ``close``) first closes its engine,
    then exits by itself (``__ray_terminate__``, which runs after its pending calls), and
    this waits until it has and, for actors on this node, until their processes are gone.
    Only an actor that has not exited within ``timeout_s`` is killed. Before, the pool called
    ``ray.kill`` on every worker and ``ray.shutdown`` at once, so Ray stopped the node under
    workers that were still being torn down, and a worker could abort mid-exit ("Mutex
    corrupt: both reader and writer lock held", SIGABRT) and print its crash dump on a run
    that had succeeded.
    """
    import ray

    if not actors:
        return
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    here = ray.get_runtime_context().get_node_id()
    pings = [a.ping.remote() for a in actors]
    ready, _ = ray.wait(pings, num_returns=len(pings), timeout=left())
    pids = []
    for ref in ready:
        try:
            pid, node = ray.get(ref)
        except Exception:  # a dead worker: nothing to wait for
            continue
        if node == here:
            pids.append(pid)
    closing = [a.close.remote() for a in actors]
    ray.wait(closing, num_returns=len(closing), timeout=left())
    done = [a.__ray_terminate__.remote() for a in actors]
    exited, _ = ray.wait(done, num_returns=len(done), timeout=left())
    while time.monotonic() < deadline and any(_alive(p) for p in pids):  # the reply precedes the exit itself
        time.sleep(0.05)
    for a, ref in zip(actors, done):
        if ref not in exited:
            try:
                ray.kill(a)
            except Exception:  # pragma: no cover - already gone
                pass


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:  # pragma: no cover - no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


class RayRolloutPool:
    """A rollout engine that generates in ``launcher.num_rollout_workers`` Ray actors (see the module doc).

    Args:
        lc: ``cfg.launcher`` (workers, placement, resources, weight sync, restarts).
        ec: the workers' engine config (:class:`rlpost.rollout.base.EngineConfig`).
        local_engine: the driver's engine: evaluation and attribute look-ups
            (``pad_id``, ``tokenizer``, ``model``) go to it, and it is kept in sync.
        policy: the trainer's policy; the workers start from its weights.
    Attributes:
        workers: the live actor handles, by slot.
        rows_generated: rows each slot generated so far.
        after_submit: None or ``fn(pool, futures)`` called once a generate call's
            slices are submitted (fault injection in tests; ``futures`` maps each
            in-flight future to its slot).
    Raises:
        ConfigError: placement ``disaggregated`` asks for more resources than the
            cluster has (names the resources), or a bad ``launcher.address``.
    """

    def __init__(self, lc: Any, ec: EngineConfig, local_engine: Any, policy: torch.nn.Module,
                 plan: Any = None) -> None:
        import ray
        from omegaconf import OmegaConf

        self.lc = lc
        self.plan = plan  # launcher.device_mapping resolved (rlpost.ray_pool.device_mapping.DevicePlan), or None
        self.local = local_engine
        self._ray_logging = route_ray_logging()
        self.started_ray = init_ray(lc)
        if self.started_ray:
            logging.getLogger("ray").info(f"Ray session logs (the rollout workers' output): {_session_logs()}")
        self.engine_cfg = {k: OmegaConf.to_container(getattr(ec, k), resolve=True) for k in ("rollout", "precision", "model")}
        self.engine_cfg["seed"] = int(ec.seed)
        self.n = int(lc.num_rollout_workers)
        self.gpu = float(lc.gpus_per_worker) > 0 or bool(plan is not None and plan.cuda)
        ws = str(lc.weight_sync)
        # NCCL takes one device per rank: a broadcast needs workers on devices of their own (gpus_per_worker >= 1,
        # or a device mapping that gives every worker a device shared with no other rank)
        own = plan.cuda and plan.rollout_exclusive() if plan is not None else float(lc.gpus_per_worker) >= 1
        self.weight_sync = ("collective" if own else "object_store") if ws == "auto" else ws
        self.restarts_left = int(lc.max_restarts)
        rd = str(ec.precision.rollout_dtype)
        self.push_dtype = ({"bf16": torch.bfloat16, "fp16": torch.float16}.get(rd)
                           if str(ec.rollout.engine) == "vllm" else None)
        self.driver_node = ray.get_runtime_context().get_node_id()
        self.pg = None
        self.after_submit: Optional[Callable[..., None]] = None
        self.rows_generated = [0] * self.n
        self.version = 0
        self.ref: List[Any] = [None]
        self.group: Optional[WeightGroup] = None
        self.dead: set = set()
        self._last_src: Optional[torch.nn.Module] = None
        self._metrics: Dict[str, float] = {}
        self._actor_cls = ray.remote(RolloutWorker)
        self._nodes = self._placement_nodes()
        self.workers = [self._spawn(i) for i in range(self.n)]
        self.placed = ray.get([w.ping.remote() for w in self.workers], timeout=600)
        if self.weight_sync == "collective":
            self._build_group()
        self.sync_weights(policy)
        self._metrics = {}  # the start-up push is not a step's
        log.info(f"launcher=ray: {self.n} rollout workers ({lc.placement}, {lc.cpus_per_worker} CPU "
                 f"{lc.gpus_per_worker} GPU each, weights via {self.weight_sync}) on "
                 f"{len(set(n for _, n in self.placed))} node(s)")

    # ------------------------------------------------------------------------ placement
    def _placement_nodes(self) -> List[Optional[str]]:
        """Node ids the workers are pinned to, round robin (``colocated``: the driver's node).

        ``disaggregated``: the alive nodes other than the driver's, or (a single-node
        cluster) a SPREAD placement group over the whole cluster, returned as ``[None]``.
        """
        import ray

        if str(self.lc.placement) == "colocated":
            return [self.driver_node]
        others = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != self.driver_node]
        if others:
            return others
        from ray.util.placement_group import placement_group

        bundle = {"CPU": float(self.lc.cpus_per_worker)}
        if self.gpu:
            bundle["GPU"] = float(self.lc.gpus_per_worker)
        self.pg = placement_group([dict(bundle) for _ in range(self.n)], strategy="SPREAD")
        if not self.pg.wait(timeout_seconds=120):
            raise ConfigError(f"launcher.placement=disaggregated: the Ray cluster cannot hold {self.n} workers of "
                              f"{bundle} (available: {ray.available_resources()}). Fix: fewer "
                              f"launcher.num_rollout_workers, smaller cpus/gpus_per_worker, or add nodes.")
        return [None]

    def _spawn(self, slot: int) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        node = self._nodes[slot % len(self._nodes)]
        if node is not None:
            strategy: Any = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        else:
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=slot)
        opts = {"num_cpus": float(self.lc.cpus_per_worker), "num_gpus": float(self.lc.gpus_per_worker),
                "max_restarts": 0, "scheduling_strategy": strategy}  # the pool replaces dead workers itself
        if self.plan is not None and self.plan.cuda:  # launcher.device_mapping: pinned to its device, as ROLL pins
            from rlpost.ray_pool.device_mapping import worker_runtime_env

            opts["num_gpus"] = 0.01  # a token share: Ray schedules it as a GPU actor, the env below picks the device
            opts["runtime_env"] = worker_runtime_env(self.plan.stages["rollout"].worker_visible[slot])
        return self._actor_cls.options(**opts).remote(self.engine_cfg, self.gpu, slot)

    # ------------------------------------------------------------------------- weights
    def live(self) -> List[int]:
        """Slots of the workers still in the pool (a dead worker without replacement leaves it)."""
        return [s for s in range(len(self.workers)) if s not in self.dead]

    def _build_group(self) -> None:
        """(Re)build the driver + live workers :class:`WeightGroup` (at start-up and after a worker died)."""
        import ray

        backend = "nccl" if self.gpu else "gloo"
        host = ray.util.get_node_ip_address()
        port = _free_port()
        live = self.live()
        futs = [self.workers[s].join_weight_group.remote(host, port, j + 1, len(live) + 1, backend)
                for j, s in enumerate(live)]
        self.group = WeightGroup(host, port, 0, len(live) + 1, backend)
        ray.get(futs)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Push ``policy``'s weights to every worker (and the driver's local engine); blocks until loaded.

        ``object_store``: one ``ray.put`` of the state_dict as numpy arrays, every
        worker loads that one object. ``collective``: one broadcast per tensor from
        the driver (rank 0) to all workers. Seconds go to ``ray/weight_push_s``.
        """
        t0 = time.perf_counter()
        self.local.sync_weights(policy)
        self.version += 1
        self._last_src = policy
        self._push(policy)
        self._add("ray/weight_push_s", time.perf_counter() - t0)

    def _push(self, policy: torch.nn.Module) -> None:
        import ray

        state = _policy_state(policy)
        if self.push_dtype is not None:  # vLLM workers load 16-bit weights: send half the bytes
            state = {k: v.to(self.push_dtype) if v.is_floating_point() else v for k, v in state.items()}
        live = [self.workers[s] for s in self.live()]
        if self.weight_sync == "collective":
            self.ref = [None]
            meta = [(k, str(v.dtype).replace("torch.", ""), list(v.shape)) for k, v in state.items()]
            futs = [w.receive_weights.remote(meta, self.version) for w in live]
            dev = torch.device("cuda") if self.group.backend == "nccl" else torch.device("cpu")
            for v in state.values():
                self.group.broadcast(v.detach().to(dev).contiguous())
            ray.get(futs)
        else:
            self.ref = [ray.put(state_arrays(state))]  # the only copy; workers map it
            ray.get([w.load_weights.remote(self.ref, self.version) for w in live])

    # ------------------------------------------------------------------------ generation
    def generate(self, prompts: List[List[int]], params: Any) -> Any:
        """Generate ``prompts`` across the workers (groups never split); the result in row order.

        Raises:
            ValueError: empty prompt list.
            RlpostError: every worker is dead and no replacement is left.
        """
        import ray
        from ray.exceptions import RayActorError

        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        t0 = time.perf_counter()
        keys = [tuple(p) for p in prompts]
        live = self.live()
        slices = [local_run_rows(keys, j, len(live)) for j in range(len(live))]
        work = [(live[j], a, b) for j, (a, b) in enumerate(slices) if b > a]
        results: Dict[int, Any] = {}
        pending: Dict[Any, Tuple[int, Any, int, int]] = {}  # future -> (slot, actor, a, b)

        def submit(slot: int, a: int, b: int) -> None:
            p = dataclasses.replace(params, row_offset=int(params.row_offset) + a)
            actor = self.workers[slot]
            pending[actor.generate.remote(prompts[a:b], p, self.ref, self.version)] = (slot, actor, a, b)

        for slot, a, b in work:
            submit(slot, a, b)
        if self.after_submit is not None:
            self.after_submit(self, {f: s for f, (s, _, _, _) in pending.items()})
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            fut = done[0]
            slot, actor, a, b = pending.pop(fut)
            try:
                res, stats = ray.get(fut)
            except RayActorError as e:
                submit(self._recover(slot, actor, a, b, e), a, b)
                continue
            results[a] = res
            self.rows_generated[slot] += b - a
            self._add("ray/worker_cpu_s", stats["cpu_s"])
            self._add("ray/worker_load_s", stats["load_s"])
        self._add("ray/generate_s", time.perf_counter() - t0)
        return concat_generations([results[a] for _, a, _ in work], int(getattr(self.local, "pad_id", 0) or 0))

    def _recover(self, slot: int, actor: Any, a: int, b: int, err: BaseException) -> int:
        """``actor`` (slot ``slot``) died running rows ``[a, b)``; returns the slot to regenerate them on.

        The dead worker is replaced while ``launcher.max_restarts`` allows, else it
        leaves the pool and a remaining worker takes the rows. Under
        ``weight_sync=collective`` the group is rebuilt and the last pushed policy
        broadcast again (with ``executor=async`` and ``max_staleness > 0`` that
        policy object may have moved on since the push: those rows then use newer
        weights than their version says; the object store keeps the pushed copy).

        Raises:
            RlpostError: no live worker and no replacement left.
        """
        import ray

        self._add("ray/worker_failures", 1.0)
        if self.workers[slot] is not actor and slot not in self.dead:  # already replaced by an earlier failure
            log.warning(f"launcher=ray: rows {a}-{b} of this step are regenerated on the replacement of rollout "
                        f"worker {slot}, with the same seeds")
            return slot
        if self.restarts_left > 0 and slot not in self.dead:
            self.restarts_left -= 1
            self.workers[slot] = self._spawn(slot)
            ray.get(self.workers[slot].ping.remote(), timeout=600)
            self._add("ray/worker_restarts", 1.0)
            log.warning(f"launcher=ray: rollout worker {slot} died ({type(err).__name__}); replaced it "
                        f"({self.restarts_left} replacements left); rows {a}-{b} of this step are regenerated "
                        f"with the same seeds")
            target = slot
        else:
            self.dead.add(slot)
            live = self.live()
            if not live:
                raise RlpostError(f"launcher=ray: every rollout worker is dead and the launcher.max_restarts="
                                  f"{int(self.lc.max_restarts)} replacements are used up. Fix: raise "
                                  f"launcher.max_restarts, or find why workers die (Ray's logs: "
                                  f"/tmp/ray/session_latest/logs).")
            target = live[(a + slot) % len(live)]
            log.warning(f"launcher=ray: rollout worker {slot} died ({type(err).__name__}) and no replacement is "
                        f"left; rows {a}-{b} of this step are regenerated on worker {target} with the same seeds")
        if self.weight_sync == "collective":
            self._build_group()
            self._push(self._last_src)
        return target

    # --------------------------------------------------------------------------- misc
    def _add(self, key: str, v: float) -> None:
        self._metrics[key] = self._metrics.get(key, 0.0) + float(v)

    def step_metrics(self) -> Dict[str, float]:
        """``ray/...`` sums since the last call (the runner logs them with the step that generated):
        ``worker_cpu_s`` (CPU seconds of all workers), ``generate_s``, ``weight_push_s``,
        ``worker_load_s``, ``worker_failures``, ``worker_restarts``; plus ``ray/workers``."""
        m, self._metrics = self._metrics, {}
        for k in ("ray/worker_failures", "ray/worker_restarts"):
            m.setdefault(k, 0.0)
        m["ray/workers"] = float(self.n)
        return m

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["local"], name)

    def session(self):
        """Dependent generate calls (episodes) need nothing kept across calls here."""
        import contextlib

        return contextlib.nullcontext()

    def close(self) -> None:
        """Stop the workers, each exiting by itself (:func:`stop_actors`), then the Ray cluster when this
        pool started it; Ray's logger gets its own handlers back."""
        import ray

        try:
            if not ray.is_initialized():
                return
            stop_actors([self.workers[s] for s in self.live()])
            if self.pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.pg)
            self.local.close()
            if self.started_ray:
                ray.shutdown()
        finally:
            restore_ray_logging(self._ray_logging)
