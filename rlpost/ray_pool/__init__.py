"""Launchers: where the rollout half of a step runs (``launcher=none`` | ``launcher=ray``).

``launcher=none`` keeps every rollout in the trainer's process (or splits them across
``torchrun`` ranks, :mod:`rlpost.distributed`). ``launcher=ray`` keeps the trainer in the
driver process and generates in a pool of Ray actors (:mod:`rlpost.ray_pool.ray_workers`).
The runner sees either as a rollout engine (:class:`rlpost.rollout.base.RolloutEngine`):
:func:`build_rollout_backend` is its one hook.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Optional

from rlpost.core.errors import ConfigError
from rlpost.rollout.base import EngineConfig
from rlpost.ray_pool import device_mapping, provisioning
from rlpost.ray_pool.ray_workers import RayRolloutPool
from rlpost.ray_pool.reward_workers import attach_reward_workers  # noqa: F401  (re-exported for the runner)

LAUNCHERS = ("none", "ray")
PLACEMENTS = ("colocated", "disaggregated")
WEIGHT_SYNCS = ("auto", "object_store", "collective")


def check_launcher(cfg: Any) -> None:
    """Validate ``launcher.*`` (run by :func:`rlpost.config.compose.validate_config`).

    Raises:
        ConfigError: ``launcher=ray`` without Ray installed, ``num_rollout_workers < 1``,
            an unknown ``placement`` / ``weight_sync``, negative resources or restarts,
            or ``trainer.num_procs > 1`` (the trainer is one driver process under Ray). A sampler
            whose decoding hook keeps state in this process is refused by
            :func:`rlpost.samplers.check_process_local_hooks`.
    """
    lc = cfg.get("launcher")
    if lc is None or lc.name == "none":
        if lc is not None and (lc.get("device_mapping") is not None or int(lc.get("reward_workers", 0) or 0) != 0):
            raise ConfigError("launcher.device_mapping and launcher.reward_workers place Ray actors, which launcher=none "
                              "has none of. Fix: launcher=ray, or leave them out.")
        if lc is not None and str(lc.get("num_rollout_workers", "")).strip().lower() == "auto":
            raise ConfigError("launcher.num_rollout_workers=auto sizes a pool of Ray rollout workers, which launcher=none "
                              "has none of (rollouts run in the driver). Fix: launcher=ray, or leave it out.")
        return
    if lc.name not in LAUNCHERS:  # the schema's enum already rejects this; kept for plain dict configs
        raise ConfigError(f"Unknown launcher={lc.name!r}. Valid choices: {', '.join(LAUNCHERS)}.")
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("launcher=ray needs Ray, which is not installed. Fix: pip install 'ray>=2.9' "
                          "(or pip install -e '.[ray]'), or launcher=none.")
    provisioning.check_provisioning(lc.get("provisioning"))  # a misspelt key is an error even without auto
    n = resolve_num_workers(cfg)
    if n < 1:
        raise ConfigError(f"launcher.num_rollout_workers={n} must be >= 1. Fix: launcher.num_rollout_workers=2.")
    if str(lc.placement) not in PLACEMENTS:
        raise ConfigError(f"launcher.placement={lc.placement!r} is not a placement. Fix: launcher.placement=colocated "
                          f"or launcher.placement=disaggregated.")
    if str(lc.weight_sync) not in WEIGHT_SYNCS:
        raise ConfigError(f"launcher.weight_sync={lc.weight_sync!r} is unknown. Fix: one of {', '.join(WEIGHT_SYNCS)}.")
    for key in ("cpus_per_worker", "gpus_per_worker"):
        if float(lc[key]) < 0:
            raise ConfigError(f"launcher.{key}={lc[key]} must be >= 0.")
    if float(lc.cpus_per_worker) == 0 and float(lc.gpus_per_worker) == 0:
        raise ConfigError("launcher.cpus_per_worker=0 and launcher.gpus_per_worker=0 reserve nothing, so Ray would pack "
                          "every worker anywhere. Fix: launcher.cpus_per_worker=1.")
    if str(lc.weight_sync) == "collective" and 0 < float(lc.gpus_per_worker) < 1:
        raise ConfigError(f"launcher.weight_sync=collective broadcasts over NCCL, which needs one GPU per rank, but "
                          f"launcher.gpus_per_worker={lc.gpus_per_worker} shares a device. Fix: "
                          f"launcher.weight_sync=object_store (or auto), or launcher.gpus_per_worker=1.")
    if int(lc.max_restarts) < 0:
        raise ConfigError(f"launcher.max_restarts={lc.max_restarts} must be >= 0 (0: never replace a dead worker).")
    if int(cfg.trainer.get("num_procs", 1) or 1) > 1:
        raise ConfigError("launcher=ray runs the trainer in the driver process and the rollouts in Ray actors, so "
                          "trainer.num_procs>1 is not supported with it. Fix: trainer.num_procs=1, or launcher=none "
                          "for torchrun data-parallel rollouts.")
    check_roll_settings(cfg)


def check_roll_settings(cfg: Any) -> None:
    """``launcher.device_mapping`` and ``launcher.reward_workers`` (ROLL, arXiv:2506.06122).

    Raises:
        ConfigError: a bad mapping (:func:`rlpost.ray_pool.device_mapping.resolve`), a mapping
            beside ``gpus_per_worker > 0`` or ``placement=disaggregated`` (the mapping owns the
            workers' devices and keeps them on this node), ``weight_sync=collective`` with rollout
            workers that share a device with each other or the trainer, a negative
            ``reward_workers`` / ``reward_max_restarts``, or ``cpus_per_reward_worker <= 0``.
    """
    lc = cfg.launcher
    rw = lc.get("reward_workers", 0)
    if isinstance(rw, bool) or not isinstance(rw, int) or rw < 0:
        raise ConfigError(f"launcher.reward_workers={rw!r} must be an integer >= 0 (0: the verifier runs in the driver). "
                          f"Fix: launcher.reward_workers=2.")
    if rw > 0 and float(lc.get("cpus_per_reward_worker", 1.0)) <= 0:
        raise ConfigError(f"launcher.cpus_per_reward_worker={lc.cpus_per_reward_worker} must be > 0: a reward worker "
                          f"runs the verifier on a CPU. Fix: launcher.cpus_per_reward_worker=1.")
    if int(lc.get("reward_max_restarts", 0)) < 0:
        raise ConfigError(f"launcher.reward_max_restarts={lc.reward_max_restarts} must be >= 0.")
    if lc.get("device_mapping") is None:
        return
    if float(lc.gpus_per_worker) > 0:
        raise ConfigError(f"launcher.device_mapping pins each rollout worker to its device, so "
                          f"launcher.gpus_per_worker={lc.gpus_per_worker} would assign devices twice. Fix: "
                          f"launcher.gpus_per_worker=0 (the mapping's rollout ids give the workers their devices).")
    if str(lc.placement) == "disaggregated":
        raise ConfigError("launcher.device_mapping names devices of this node (colocated or disaggregated per stage "
                          "follows from the ids), and launcher.placement=disaggregated sends workers to other nodes. "
                          "Fix: launcher.placement=colocated with the mapping, or drop the mapping.")
    plan = device_mapping.plan_from_config(cfg)
    if plan.cuda and str(lc.weight_sync) == "collective" and not plan.rollout_exclusive():
        raise ConfigError(f"launcher.weight_sync=collective broadcasts over NCCL, one device per rank, but the mapping "
                          f"puts rollout workers on shared devices (workers per rollout device {plan.workers_per_device}; actor "
                          f"ids {list(plan.stages['actor'].ids)}). Fix: launcher.weight_sync=auto (object_store here), or "
                          f"one rollout worker per device not used by actor.")


def device_plan(cfg: Any) -> Optional["device_mapping.DevicePlan"]:
    """The run's resolved :class:`rlpost.ray_pool.device_mapping.DevicePlan` (None without ``launcher.device_mapping``)."""
    lc = cfg.get("launcher")
    if lc is None or lc.name != "ray" or lc.get("device_mapping") is None:
        return None
    return device_mapping.plan_from_config(cfg)


def describe_devices(cfg: Any, stage: str) -> str:
    """The run graph's note on where ``stage`` (a run-graph stage name) runs under ``launcher.device_mapping``, or ``""``."""
    key = GRAPH_STAGES.get(stage)
    if key is None:
        return ""
    try:
        plan = device_plan(cfg)
    except ConfigError as e:
        return f"; device_mapping not resolved: {e}" if stage == "policy_update" else ""
    if plan is None or key not in plan.stages:
        return ""
    if key == "reward":
        return "; model rewards " + plan.describe("reward")
    return "; " + plan.describe(key)


#: run-graph stage -> device-mapping stage
GRAPH_STAGES = {"rollout": "rollout", "reward": "reward", "old_logprobs": "actor", "ref_logprobs": "reference",
                "values": "critic", "critic_update": "critic", "policy_update": "actor"}


def describe_reward(cfg: Any) -> str:
    """The run graph's note on Ray reward workers (``launcher.reward_workers > 0``), or ``""``."""
    lc = cfg.get("launcher")
    if lc is None or lc.name != "ray" or int(lc.get("reward_workers", 0) or 0) <= 0:
        return ""
    return (f"; the verifier in {lc.reward_workers} Ray reward workers (a dead or hung worker's rows rescored in "
            f"the driver, {lc.get('reward_max_restarts', 2)} replacements)")


def resolve_num_workers(cfg: Any) -> int:
    """``launcher.num_rollout_workers`` as a number: itself, or with ``auto`` the provisioning rule's pool size.

    ``auto`` applies :func:`rlpost.ray_pool.provisioning.plan_from_config` (ECHO-2's
    overlap capacity model, arXiv:2602.02192) to ``launcher.provisioning``.

    Raises:
        ConfigError: a value that is neither an integer nor ``auto``, or any error of the plan.
    """
    v = cfg.launcher.num_rollout_workers
    if isinstance(v, str) and v.strip().lower() == "auto":
        return provisioning.plan_from_config(cfg).n_workers
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ConfigError(f"launcher.num_rollout_workers={v!r} is neither a number nor auto. Fix: "
                          f"launcher.num_rollout_workers=2, or launcher.num_rollout_workers=auto with "
                          f"launcher.provisioning.train_s and worker_rollouts_per_s (docs/SCALING.md, \"ECHO-2\").") from None


def describe_pool(cfg: Any) -> str:
    """The run graph's note on the pool: ``in N Ray workers (placement)``, with the rule's numbers under ``auto``."""
    lc = cfg.launcher
    v = lc.num_rollout_workers
    if isinstance(v, str) and v.strip().lower() == "auto":
        try:
            p = provisioning.plan_from_config(cfg)
        except ConfigError as e:
            return f"in auto Ray workers ({lc.placement}): not planned: {e}"
        return (f"in {p.n_workers} Ray workers ({lc.placement}; auto: >= {p.required:.3g} rollouts/s for R={p.rollouts_per_step:g}, "
                f"T_train={p.train_s:g} s, T_bcast={p.bcast_s:.3g} s, kappa={p.kappa}; learner utilization {p.utilization:.2f})")
    if lc.get("device_mapping") is not None:
        return f"in {v} Ray workers (pinned by launcher.device_mapping)"
    return f"in {v} Ray workers ({lc.placement})"


def build_rollout_backend(launcher: Any, ec: EngineConfig, local_engine: Any, policy: Any, cfg: Any = None) -> Any:
    """The engine the runner generates with: ``local_engine`` itself, or a Ray worker pool in front of it.

    Args:
        launcher: ``cfg.launcher`` (None or ``name=none``: no pool).
        ec: the engine config the workers build their engines from (:class:`rlpost.rollout.base.EngineConfig`).
        local_engine: the driver's own engine (evaluation, HIVE's prompt entropy and
            attribute look-ups such as ``pad_id`` go to it).
        policy: the trainer's policy (the workers start from its weights).
        cfg: the whole config, needed when ``launcher.num_rollout_workers=auto``
            (:func:`resolve_num_workers` reads the selector, algorithm and executor).
    Returns:
        an object with the :class:`rlpost.rollout.base.RolloutEngine` interface.
    """
    if launcher is None or launcher.name == "none":
        return local_engine

    if isinstance(launcher.num_rollout_workers, str):  # auto: the provisioning rule's pool size
        from omegaconf import OmegaConf

        if cfg is None:
            raise ConfigError("launcher.num_rollout_workers=auto needs the whole config to plan the pool.")
        n = resolve_num_workers(cfg)
        launcher = OmegaConf.merge(launcher, {"num_rollout_workers": n})
    plan = device_plan(cfg) if cfg is not None else None
    return RayRolloutPool(launcher, ec, local_engine, policy, **({"plan": plan} if plan is not None else {}))
