"""Small public benchmark files shipped with rlpost, so the task presets work without the hub.

See ``rlpost/data/SOURCES.md`` for each file's origin and licence. Task presets
name them as ``${rlpost_data:gsm8k/test.jsonl}``, an OmegaConf resolver
(:func:`register_resolver`) that gives the absolute path inside the installed
package, so ``rlpost config task=gsm8k`` prints a path the user can open.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

DATA_DIR = Path(__file__).resolve().parent


def data_path(rel: str) -> str:
    """Absolute path of a shipped data file, e.g. ``data_path("gsm8k/test.jsonl")``."""
    return str(DATA_DIR / rel)


def register_resolver() -> None:
    """Register the ``rlpost_data`` OmegaConf resolver (idempotent)."""
    if not OmegaConf.has_resolver("rlpost_data"):
        OmegaConf.register_new_resolver("rlpost_data", data_path)
