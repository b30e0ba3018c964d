"""Where the config tree is and which presets each group has (no other rlpost import)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List


def conf_dir() -> Path:
    """The config tree: ``$RLPOST_CONF_DIR`` or ``conf/`` beside the package."""
    env = os.environ.get("RLPOST_CONF_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "conf"


def group_choices(group: str) -> List[str]:
    """Preset names available in ``conf/<group>/``; for Hydra's own groups (``hydra/launcher``),
    the choices Hydra and its installed plugins register (basic, joblib, submitit_slurm, ...)."""
    d = conf_dir() / group
    if d.exists():
        return sorted(p.stem for p in d.glob("*.yaml"))
    if group.startswith("hydra/"):
        from hydra.core.config_store import ConfigStore
        from hydra.core.plugins import Plugins

        Plugins.instance()  # imports the installed plugins, which register their configs
        node: Any = ConfigStore.instance().repo
        for part in group.split("/"):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        return sorted(k[:-5] for k in node if k.endswith(".yaml"))
    return []
