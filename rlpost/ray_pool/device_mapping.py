"""``launcher.device_mapping``: which devices each model of each stage runs on (ROLL's per-stage device mapping).

"Reinforcement Learning Optimization for Large-Scale Learning: An Efficient and
User-Friendly Scaling Library" (ROLL, arXiv:2506.06122; authors' code
https://github.com/alibaba/ROLL) assigns devices to every worker cluster with a
``device_mapping`` list of device ranks per role (``actor_train``, ``actor_infer``,
``reference``, ``critic``, reward clusters). Two roles whose lists share a device
take turns on it (colocated, time-sharing); disjoint lists run side by side
(disaggregated). The authors' code (``roll/configs/worker_config.py``,
``roll/distributed/scheduler/resource_manager.py``) derives a role's worker count
as ``len(device_mapping) // num_gpus_per_worker``, maps rank ``r`` to node
``r // num_gpus_per_node`` and local device ``r % num_gpus_per_node``, pins each
Ray actor to its devices by setting ``CUDA_VISIBLE_DEVICES`` in the actor's
environment with Ray's own setting switched off
(``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``), and only warns when an
asynchronous pipeline lets the inference role share devices with another.

rlpost takes the declaration and its checks, for the components it has
(:data:`STAGES`)::

    launcher.device_mapping: {actor: [0], rollout: [1, 2], reward: [0]}

* ``actor``: the trainer's device (the driver process: exactly ``trainer.num_procs``
  ids, i.e. one under ``launcher=ray``). Required.
* ``rollout``: the devices of the Ray rollout workers, worker ``i`` on
  ``rollout[i % len(rollout)]`` (several workers per device share it, as fractional
  ``gpus_per_worker`` do). Required; every listed device must get a worker.
* ``reference``, ``critic``: the KL reference and the value model. rlpost's trainer
  holds both beside the policy in its own process, so they must equal ``actor``
  (the default); separate devices for them are not built.
* ``reward``: the device the model rewards (``task.reward.models``: reward models,
  local judges, PRMs) load on in the driver (one id). The rule verifier needs no
  device (it runs in the driver or in ``launcher.reward_workers`` CPU actors).

Ids are indices into this node's visible CUDA devices (``CUDA_VISIBLE_DEVICES``
order), one node only (rlpost's own choice: multi-node pools keep
``launcher.placement=disaggregated``). On a CPU run every id resolves to ``cpu``:
the checks and the resolved plan are exercised, nothing is pinned.
Everything here is pure (no Ray, no CUDA calls): :func:`resolve` takes the
visible device count as an argument.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from rlpost.core.errors import ConfigError

#: the stages a mapping may name (ROLL's roles actor_train, actor_infer, reference, critic, rewards)
STAGES = ("actor", "rollout", "reference", "critic", "reward")
#: stages every mapping must name
REQUIRED = ("actor", "rollout")
#: stages that live in the trainer's process beside the policy: their devices must be the actor's
TRAINER_HELD = ("reference", "critic")


@dataclass(frozen=True)
class StagePlacement:
    """Where one stage runs.

    Attributes:
        stage: one of :data:`STAGES`.
        ids: the declared device ids (indices into the visible devices).
        devices: ``cuda:<id>`` per id as the driver addresses them, or ``cpu`` on a CPU run.
        worker_ids: for the rollout stage, the device id of each Ray worker
            (worker ``i`` on ``ids[i % len(ids)]``); empty for in-driver stages.
        worker_visible: the ``CUDA_VISIBLE_DEVICES`` value each worker is started
            with (the physical index behind its id: the driver's own
            ``CUDA_VISIBLE_DEVICES`` entry, else the id); empty on CPU.
    """

    stage: str
    ids: Tuple[int, ...]
    devices: Tuple[str, ...]
    worker_ids: Tuple[int, ...] = ()
    worker_visible: Tuple[str, ...] = ()


@dataclass(frozen=True)
class DevicePlan:
    """A validated device mapping resolved into each component's placement (:func:`resolve`).

    Attributes:
        stages: stage -> :class:`StagePlacement` (absent stages are not placed by the mapping).
        sharing: for each pair of placed stages, ``colocated`` (same devices: they
            take turns), ``partly shared`` or ``disaggregated`` (no device in common).
        cuda: whether ids are CUDA devices (False: every id resolved to ``cpu``).
        workers_per_device: rollout workers on each rollout device id.
    """

    stages: Dict[str, StagePlacement]
    sharing: Dict[Tuple[str, str], str] = field(default_factory=dict)
    cuda: bool = False
    workers_per_device: Dict[int, int] = field(default_factory=dict)

    def device(self, stage: str) -> Optional[str]:
        """The first device of ``stage`` (what an in-driver component loads on), or None when unmapped."""
        p = self.stages.get(stage)
        return p.devices[0] if p else None

    def rollout_exclusive(self) -> bool:
        """Every rollout worker has a device of its own, shared with no other worker and not with the actor
        (what an NCCL weight broadcast needs: one device per rank)."""
        r = self.stages["rollout"]
        return (all(v == 1 for v in self.workers_per_device.values())
                and not set(r.ids) & set(self.stages["actor"].ids))

    def describe(self, stage: str) -> str:
        """One phrase for ``rlpost config --graph``: ``on cuda:1, cuda:2 (disaggregated from actor)``."""
        p = self.stages.get(stage)
        if p is None:
            return ""
        where = ", ".join(p.devices) if self.cuda else f"cpu (device ids {list(p.ids)})"
        rel = [_PHRASE[m].format(o) for (a, o), m in self.sharing.items() if a == stage]
        rel += [_PHRASE[m].format(a) for (a, o), m in self.sharing.items() if o == stage]
        return f"on {where}" + (f" ({'; '.join(rel)})" if rel else "")

    def table(self) -> str:
        """A multi-line summary: each stage, its ids, devices and workers, then the sharing of every pair."""
        lines = []
        for s in STAGES:
            p = self.stages.get(s)
            if p is None:
                continue
            w = f", {len(p.worker_ids)} workers on ids {list(p.worker_ids)}" if p.worker_ids else ""
            lines.append(f"{s:<10} ids {list(p.ids)} -> {', '.join(sorted(set(p.devices)))}{w}")
        for (a, b), m in self.sharing.items():
            lines.append(f"{a} / {b}: {m}")
        return "\n".join(lines)


_PHRASE = {"colocated": "time-shares its devices with {}", "partly shared": "shares some devices with {}",
           "disaggregated": "disaggregated from {}"}


def _ids(stage: str, value: Any) -> Tuple[int, ...]:
    """A stage's declared ids as a tuple of ints, or a ConfigError naming the stage and the fix."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"launcher.device_mapping.{stage}={value!r} is not a list of device ids. "
                          f"Fix: launcher.device_mapping.{stage}=[0] (indices of the visible devices).")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"launcher.device_mapping.{stage} holds {v!r}: device ids are integers >= 0. "
                              f"Fix: e.g. launcher.device_mapping.{stage}=[0,1].")
        out.append(int(v))
    if not out:
        raise ConfigError(f"launcher.device_mapping.{stage} is empty. Fix: give it at least one device id, "
                          f"or leave the stage out.")
    if len(set(out)) != len(out):
        dup = sorted({v for v in out if out.count(v) > 1})
        raise ConfigError(f"launcher.device_mapping.{stage}={out} names device(s) {dup} twice. Fix: list each "
                          f"device once (several rollout workers per device come from launcher.num_rollout_workers).")
    return tuple(out)


def _relation(a: Sequence[int], b: Sequence[int]) -> str:
    sa, sb = set(a), set(b)
    if sa == sb:
        return "colocated"
    return "partly shared" if sa & sb else "disaggregated"


def visible_ids(env: Optional[Mapping[str, str]] = None) -> Optional[List[str]]:
    """The driver's ``CUDA_VISIBLE_DEVICES`` entries (None when unset: id ``k`` is physical device ``k``)."""
    v = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if v is None or v.strip() == "":
        return None
    return [x.strip() for x in v.split(",") if x.strip()]


def resolve(mapping: Optional[Mapping[str, Any]], *, n_visible: Optional[int], num_rollout_workers: int,
            trainer_procs: int = 1, has_model_rewards: bool = False,
            env: Optional[Mapping[str, str]] = None) -> Optional[DevicePlan]:
    """Validate a ``launcher.device_mapping`` and resolve it into each component's placement.

    Args:
        mapping: ``{stage: [device id, ...]}`` (:data:`STAGES`), or None (no mapping: None is returned).
        n_visible: the number of visible CUDA devices, or None on a CPU run (ids then
            resolve to ``cpu`` and are not checked against a count).
        num_rollout_workers: the rollout pool's size (``launcher.num_rollout_workers``, resolved).
        trainer_procs: ``trainer.num_procs`` (the actor's ids: one per trainer process).
        has_model_rewards: the config has ``task.reward.models`` (what ``reward`` places).
        env: the environment to read ``CUDA_VISIBLE_DEVICES`` from (default: this process's).
    Returns:
        :class:`DevicePlan`, or None when ``mapping`` is None.
    Raises:
        ConfigError: an unknown stage (with the closest valid name), a missing ``actor`` or
            ``rollout``, ids that are not distinct non-negative integers, an id
            ``>= n_visible``, an actor list whose length is not ``trainer_procs``, a
            reference or critic on other devices than the actor, fewer rollout workers
            than rollout devices, a ``reward`` entry without model rewards or with more
            than one id.
    """
    if mapping is None:
        return None
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"launcher.device_mapping={mapping!r} is not a mapping of stage -> device ids. Fix: "
                          f"launcher.device_mapping='{{actor:[0],rollout:[1]}}'.")
    for k in mapping:
        if k not in STAGES:
            near = difflib.get_close_matches(str(k), STAGES, n=1)
            raise ConfigError(f"launcher.device_mapping.{k} is not a stage" + (f" (did you mean {near[0]}?)" if near else "")
                              + f". Valid stages: {', '.join(STAGES)}.")
    stages = {k: _ids(k, v) for k, v in mapping.items() if v is not None}
    for k in REQUIRED:
        if k not in stages:
            raise ConfigError(f"launcher.device_mapping has no {k}: a mapping names at least "
                              f"{' and '.join(REQUIRED)}. Fix: e.g. launcher.device_mapping='{{actor:[0],rollout:[1]}}'.")
    cuda = n_visible is not None
    if cuda:
        for k, ids in stages.items():
            bad = [i for i in ids if i >= n_visible]
            if bad:
                raise ConfigError(f"launcher.device_mapping.{k}={list(ids)} names device(s) {bad}, but {n_visible} "
                                  f"device(s) are visible (ids 0..{n_visible - 1}"
                                  + (f", CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}"
                                     if os.environ.get("CUDA_VISIBLE_DEVICES") else "")
                                  + f"). Fix: use ids below {n_visible}, or make more devices visible.")
    if len(stages["actor"]) != int(trainer_procs):
        raise ConfigError(f"launcher.device_mapping.actor={list(stages['actor'])} lists {len(stages['actor'])} "
                          f"device(s) but the trainer runs {trainer_procs} process(es), one device each (launcher=ray "
                          f"keeps the trainer in the driver). Fix: launcher.device_mapping.actor=[{stages['actor'][0]}].")
    for k in TRAINER_HELD:
        if k in stages and set(stages[k]) != set(stages["actor"]):
            raise ConfigError(f"launcher.device_mapping.{k}={list(stages[k])} differs from actor="
                              f"{list(stages['actor'])}: rlpost's trainer holds the {k} model beside the policy in its "
                              f"own process, so it runs on the actor's device (separate {k} devices are not built). "
                              f"Fix: leave {k} out of the mapping, or set it to {list(stages['actor'])}.")
    for k in TRAINER_HELD:
        stages.setdefault(k, stages["actor"])
    if "reward" in stages:
        if not has_model_rewards:
            raise ConfigError("launcher.device_mapping.reward places the model rewards (task.reward.models), and this "
                              "config has none; the rule verifier needs no device (it runs in the driver, or in "
                              "launcher.reward_workers CPU actors). Fix: leave reward out of the mapping.")
        if len(stages["reward"]) != 1:
            raise ConfigError(f"launcher.device_mapping.reward={list(stages['reward'])}: the model rewards load in the "
                              f"driver process, on one device. Fix: launcher.device_mapping.reward=[{stages['reward'][0]}].")
    n = int(num_rollout_workers)
    rids = stages["rollout"]
    if n < len(rids):
        raise ConfigError(f"launcher.device_mapping.rollout={list(rids)} lists {len(rids)} devices but "
                          f"launcher.num_rollout_workers={n}: device(s) {list(rids[n:])} would get no worker. Fix: "
                          f"launcher.num_rollout_workers={len(rids)} (or a multiple), or list fewer devices.")
    worker_ids = tuple(rids[i % len(rids)] for i in range(n))
    phys = visible_ids(env)
    if cuda and phys is not None and len(phys) < (n_visible or 0):
        phys = None  # a CUDA_VISIBLE_DEVICES torch did not honour as read: fall back to the ids themselves

    def physical(i: int) -> str:
        return phys[i] if phys is not None else str(i)

    placed: Dict[str, StagePlacement] = {}
    for k in STAGES:
        if k not in stages:
            continue
        ids = stages[k]
        devs = tuple(f"cuda:{i}" if cuda else "cpu" for i in ids)
        if k == "rollout":
            placed[k] = StagePlacement(k, ids, devs, worker_ids,
                                       tuple(physical(i) for i in worker_ids) if cuda else ())
        else:
            placed[k] = StagePlacement(k, ids, devs)
    sharing: Dict[Tuple[str, str], str] = {}
    order = [s for s in ("actor", "rollout", "reward") if s in placed]
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            sharing[(a, b)] = _relation(placed[a].ids, placed[b].ids)
    per_dev = {i: worker_ids.count(i) for i in rids}
    return DevicePlan(placed, sharing, cuda, per_dev)


def worker_runtime_env(visible: str) -> Dict[str, Any]:
    """The Ray ``runtime_env`` that pins one actor to physical CUDA device ``visible`` (as ROLL does).

    Ray normally sets ``CUDA_VISIBLE_DEVICES`` to the GPUs it assigned; with
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` it leaves the value given here, so
    the actor's ``cuda`` device is exactly the mapped one. The job's own ``env_vars``
    (``PYTHONPATH``) are merged by Ray.
    """
    return {"env_vars": {"CUDA_VISIBLE_DEVICES": str(visible), "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}


def plan_from_config(cfg: Any, n_visible: Optional[int] = None, cuda: Optional[bool] = None) -> Optional[DevicePlan]:
    """:func:`resolve` for a whole config (``launcher.device_mapping``), or None without a mapping.

    Args:
        cfg: the composed config.
        n_visible: the visible CUDA device count; None: ``torch.cuda.device_count()``
            when the run's device (``cfg.device``) is CUDA, else a CPU plan.
        cuda: force a CUDA (True) or CPU (False) plan; None: from ``cfg.device``.
    Raises:
        ConfigError: as :func:`resolve`; ``cfg.device=cuda`` with no CUDA device visible.
    """
    lc = cfg.get("launcher")
    dm = lc.get("device_mapping") if lc is not None else None
    if dm is None:
        return None
    from omegaconf import OmegaConf

    from rlpost.ray_pool import resolve_num_workers

    mapping = OmegaConf.to_container(dm, resolve=True) if OmegaConf.is_config(dm) else dm
    if cuda is None:
        dev = str(cfg.get("device", "auto"))
        if dev == "cpu":
            cuda = False
        else:
            import torch

            cuda = torch.cuda.is_available()
            if dev.startswith("cuda") and not cuda:
                raise ConfigError(f"device={dev} with launcher.device_mapping, but no CUDA device is visible. "
                                  f"Fix: device=cpu (the mapping resolves to cpu), or run on a GPU node.")
    if cuda and n_visible is None:
        import torch

        n_visible = torch.cuda.device_count()
    models = (cfg.task.get("reward") or {}).get("models") if cfg.get("task") is not None else None
    return resolve(mapping, n_visible=n_visible if cuda else None, num_rollout_workers=resolve_num_workers(cfg),
                   trainer_procs=int(cfg.trainer.get("num_procs", 1) or 1), has_model_rewards=bool(models))
