"""Evaluation: greedy accuracy, pass@k / maj@k / mean@k with bootstrap CIs, paired comparisons.

The names below are loaded on first use (PEP 562): :mod:`rlpost.eval.evaluate` imports
torch, and ``rlpost --version`` or ``rlpost compare`` (which read only :mod:`rlpost.eval.stats`)
should not pay for it. ``rlpost.eval.evaluate`` is the function, as when this package imported it
eagerly (the submodule of the same name is ``sys.modules["rlpost.eval.evaluate"]``).
"""

import sys
import types
from typing import Any

_LAZY = {
    "aggregate": "rlpost.eval.evaluate", "evaluate": "rlpost.eval.evaluate", "format_result": "rlpost.eval.evaluate",
    "save_result": "rlpost.eval.evaluate", "scalar_metrics": "rlpost.eval.evaluate",
    "bootstrap_ci": "rlpost.eval.stats", "maj_at_k": "rlpost.eval.stats", "paired_bootstrap": "rlpost.eval.stats",
    "pass_at_k": "rlpost.eval.stats",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    """``rlpost.eval.evaluate`` etc., imported when first asked for."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlpost.eval' has no attribute {name!r}")


class _Package(types.ModuleType):
    """Importing the submodule ``evaluate`` binds the package attribute to the module; keep the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "evaluate" and isinstance(value, types.ModuleType):
            value = value.evaluate
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
