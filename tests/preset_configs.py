"""One composed config per algorithm preset for the whole test session (Hydra's compose costs about a second of
the 2-core machine per call, and several registry-wide files read every preset)."""

from __future__ import annotations

import functools

from omegaconf import DictConfig


@functools.lru_cache(maxsize=None)
def preset_config(name: str) -> DictConfig:
    """``algo=name`` with ``model=tiny`` through the real Hydra config tree, composed once per session.

    Read-only: callers that change it copy it first (``copy.deepcopy``).

    Raises:
        ConfigError: an unknown preset (what ``compose_config`` raises).
    """
    from rlpost.config.compose import compose_config

    cfg = compose_config([f"algo={name}", "model=tiny"])
    from omegaconf import OmegaConf

    OmegaConf.set_readonly(cfg, True)
    return cfg
