"""Print structure figures of a checkout: rlpost imports inside functions and functions over 100 lines.

    python scripts/house_stats.py [ROOT]     # ROOT: a checkout (default: this one)

Function-local imports hide a module's real dependencies (docs/ARCHITECTURE.md); a function over
100 lines is a candidate for splitting. Both are counted from the source with the ast module.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def stats(root: Path) -> tuple:
    """``(rlpost imports, those inside a function, [(lines, file, function) over 100 lines])``."""
    total = inner = 0
    long = []
    for f in sorted((root / "rlpost").rglob("*.py")):
        tree = ast.parse(f.read_text())
        local = set()
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                local.update(id(m) for m in ast.walk(n) if isinstance(m, (ast.Import, ast.ImportFrom)))
                if n.end_lineno - n.lineno + 1 > 100:
                    long.append((n.end_lineno - n.lineno + 1, str(f.relative_to(root)), n.name))
        for n in ast.walk(tree):
            ours = ((isinstance(n, ast.ImportFrom) and (n.module or "").startswith("rlpost"))
                    or (isinstance(n, ast.Import) and any(a.name.startswith("rlpost") for a in n.names)))
            if ours:
                total += 1
                inner += id(n) in local
    return total, inner, sorted(long, reverse=True)


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    total, inner, long = stats(root)
    print(f"rlpost imports: {total}, inside functions: {inner}")
    print(f"functions over 100 lines: {len(long)}")
    for n, f, name in long:
        print(f"  {n:4d}  {f}:{name}")
