"""Launchers: where the rollout half of a step runs (``launcher=none`` | ``launcher=ray``).

``launcher=none`` keeps every rollout in the trainer's process (or splits them across
``torchrun`` ranks, :mod:`rlpost.distributed`). ``launcher=ray`` keeps the trainer in the
driver process and generates in a pool of Ray actors (:mod:`rlpost.ray_pool.ray_workers`).
The runner sees either as a rollout engine (:class:`rlpost.rollout.base.RolloutEngine`):
:func:`build_rollout_backend` is its one hook.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from rlpost.core.errors import ConfigError
from rlpost.rollout.base import EngineConfig
from rlpost.ray_pool import provisioning
from rlpost.ray_pool.ray_workers import RayRolloutPool

LAUNCHERS = ("none", "ray")
PLACEMENTS = ("colocated", "disaggregated")
WEIGHT_SYNCS = ("auto", "object_store", "collective")


def check_launcher(cfg: Any) -> None:
    """Validate ``launcher.*`` (run by :func:`rlpost.config.compose.validate_config`).

    Raises:
        ConfigError: ``launcher=ray`` without Ray installed, ``num_rollout_workers < 1``,
            an unknown ``placement`` / ``weight_sync``, negative resources or restarts,
            ``trainer.num_procs > 1`` (the trainer is one driver process under Ray), or a
            sampler whose per-token temperature hook keeps state in the driver.
    """
    lc = cfg.get("launcher")
    if lc is None or lc.name == "none":
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
    if cfg.sampler.name == "adaptive_temperature":
        raise ConfigError("sampler=adaptive_temperature keeps entropy statistics of every generated token in the driver, "
                          "which Ray rollout workers cannot update. Fix: launcher=none, or another sampler.")


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
    return RayRolloutPool(launcher, ec, local_engine, policy)
