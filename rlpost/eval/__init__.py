"""Evaluation: greedy accuracy, pass@k / maj@k / mean@k with bootstrap CIs, paired comparisons.

The names below are loaded on first use (PEP 562): :mod:`rlpost.eval.evaluate` imports
torch, and ``rlpost --version`` or ``rlpost compare`` (which read only :mod:`rlpost.eval.stats`)
should not pay for it.
"""

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
