"""The package's layers (docs/ARCHITECTURE.md, "Layers"): no module imports from a higher layer.

Every ``rlpost`` import in ``rlpost/`` is read with the ast module, module-level and function-local
alike, and each file's layer is looked up by its folder. A new folder must be given a layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rlpost"

#: folder (or top-level module) -> layer, as the table in docs/ARCHITECTURE.md
LAYERS = {
    "core": 1,
    "config": 2, "envs": 2, "tasks": 2, "models": 2, "rollout": 2, "algos": 2,
    "selectors": 3, "samplers": 3, "methods": 3, "rewards": 3, "trainer": 3, "ray_pool": 3, "distributed": 3,
    "run": 4, "eval": 4,
    "cli": 5, "experiments": 5, "__init__": 5,
}


def _part(module: str) -> str:
    """The folder or top-level module of ``rlpost.<part>...``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports():
    for f in sorted(ROOT.rglob("*.py")):
        src = _part(".".join(("rlpost",) + f.relative_to(ROOT).with_suffix("").parts))
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").startswith("rlpost."):
                yield f, n.lineno, src, _part(n.module)
            elif isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.startswith("rlpost."):
                        yield f, n.lineno, src, _part(a.name)


def test_every_folder_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert parts - set(LAYERS) == set(), "give the new folder a layer in LAYERS and docs/ARCHITECTURE.md"


def test_no_import_runs_up_a_layer():
    up = [f"{f.relative_to(ROOT.parent)}:{line} ({src}, layer {LAYERS[src]}) imports {dst} (layer {LAYERS[dst]})"
          for f, line, src, dst in _imports() if LAYERS[dst] > LAYERS[src]]
    assert up == []


def test_the_check_reads_real_imports():
    """The walk finds the runner's imports of lower layers (a walk that found nothing would pass vacuously)."""
    seen = {(src, dst) for _, _, src, dst in _imports()}
    assert {("run", "algos"), ("run", "core"), ("trainer", "algos"), ("cli", "run")} <= seen
