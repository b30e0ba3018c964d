"""Where the test suite's time goes: per file, per marker, and the slowest tests, from pytest's JUnit XML.

Profile the README's test command, then read it::

    .venv/bin/python -m pytest -q --durations=0 --junitxml=/tmp/tests.xml
    .venv/bin/python scripts/test_times.py /tmp/tests.xml            # markers read by collecting this checkout
    .venv/bin/python scripts/test_times.py /tmp/tests.xml --root DIR # ... or another checkout (an older commit)
    .venv/bin/python scripts/test_times.py /tmp/tests.xml --top 10 --compare /tmp/before.xml

JUnit XML carries no markers, so the markers of each test are found by collecting the suite once per
marker (``pytest --collect-only -q -m <marker>`` in ``--root``); ``--no-markers`` skips that. A test's
time is its call plus its setup and teardown (what pytest's JUnit writer records), so a module- or
session-scoped fixture is charged to the first test that uses it. The output is Markdown, for
docs/TESTING.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Set, Tuple

MARKERS = ("slow", "vllm")


def read_junit(path: Path) -> List[Tuple[str, float, str]]:
    """``(node id, seconds, outcome)`` of every test case in a pytest JUnit XML file.

    The node id is rebuilt as pytest prints it (``tests/test_x.py::test_fn[param]``, a class between);
    outcome is ``passed``, ``failed``, ``error`` or ``skipped``.

    Raises:
        SystemExit: the file is missing or holds no test case (names the file).
    """
    if not path.is_file():
        raise SystemExit(f"test_times: {path} does not exist (run pytest with --junitxml={path} first)")
    cases = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        cls, name = tc.get("classname", ""), tc.get("name", "")
        parts = cls.split(".")
        # classname is 'tests.test_x' or 'tests.test_x.TestClass': the module is the first part named test_*
        idx = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        node = "/".join(parts[: idx + 1]) + ".py::" + "::".join(parts[idx + 1:] + [name])
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if tc.find(tag) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
        cases.append((node, float(tc.get("time", 0.0)), outcome))
    if not cases:
        raise SystemExit(f"test_times: {path} holds no <testcase>")
    return cases


def collect_marked(root: Path, marker: str) -> Set[str]:
    """Node ids that carry ``marker`` in the checkout at ``root`` (``pytest --collect-only -m marker``)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-o", "addopts=", "-m", marker], cwd=root, capture_output=True, text=True)
    return {line.strip() for line in out.stdout.splitlines() if "::" in line}


def summarize(cases: List[Tuple[str, float, str]], marked: Dict[str, Set[str]]) -> Dict[str, Dict[str, float]]:
    """Seconds and test counts per file and per marker tier (``unmarked`` for the rest)."""
    per_file: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    per_marker: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    for node, t, _ in cases:
        f = per_file[node.split("::")[0]]
        f[0] += t
        f[1] += 1
        tiers = [m for m, ids in marked.items() if node in ids] or ["unmarked"]
        for m in tiers:
            per_marker[m][0] += t
            per_marker[m][1] += 1
    return {"file": {k: v for k, v in per_file.items()}, "marker": {k: v for k, v in per_marker.items()}}


def _table(rows: List[Tuple], head: Tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    """Print the Markdown profile of one JUnit XML file (and its change against ``--compare``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("xml", type=Path)
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                    help="checkout whose tests are collected for markers (default: this one)")
    ap.add_argument("--top", type=int, default=30, help="how many slowest tests to list (default 30)")
    ap.add_argument("--files", type=int, default=25, help="how many files to list (default 25; 0: all)")
    ap.add_argument("--compare", type=Path, help="an earlier JUnit XML: print its totals beside")
    ap.add_argument("--no-markers", action="store_true", help="do not collect the suite for markers")
    a = ap.parse_args(argv)

    cases = read_junit(a.xml)
    marked = {} if a.no_markers else {m: collect_marked(a.root, m) for m in MARKERS}
    s = summarize(cases, marked)
    total = sum(t for _, t, _ in cases)
    outcomes: Dict[str, int] = defaultdict(int)
    for _, _, o in cases:
        outcomes[o] += 1
    print(f"{len(cases)} tests, {total:.0f} s in tests ({total / 60:.1f} min); "
          + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())))
    if a.compare:
        before = read_junit(a.compare)
        bt = sum(t for _, t, _ in before)
        print(f"compared with {a.compare}: {len(before)} tests, {bt:.0f} s ({bt / 60:.1f} min); ratio {total / bt:.2f}")
    print("\n### Per marker\n")
    rows = [(m, int(n), f"{t:.0f}", f"{100 * t / total:.1f}%") for m, (t, n) in
            sorted(s["marker"].items(), key=lambda kv: -kv[1][0])]
    print(_table(rows, ("marker", "tests", "seconds", "share")))
    print("\n### Per file\n")
    files = sorted(s["file"].items(), key=lambda kv: -kv[1][0])
    if a.files:
        files = files[: a.files]
    rows = [(f"`{f}`", int(n), f"{t:.1f}", f"{100 * t / total:.1f}%") for f, (t, n) in files]
    print(_table(rows, ("file", "tests", "seconds", "share")))
    print(f"\n### The {a.top} slowest tests\n")
    slow = sorted(cases, key=lambda c: -c[1])[: a.top]
    print(_table([(f"`{n}`", f"{t:.1f}") for n, t, _ in slow], ("test", "seconds")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
