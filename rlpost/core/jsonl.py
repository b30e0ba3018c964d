"""Reading JSON Lines files with errors that name the file, the line and the fix.

One reader for every JSONL input rlpost takes from a user (task files, reward-model pairs,
XRPO's exemplar corpus), so a malformed line reads the same way everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple, Type, Union


def iter_jsonl(path: Union[str, Path], error: Type[Exception], what: str = "", fix: str = "") -> Iterator[Tuple[int, Dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line of the JSON Lines file ``path``, streamed.

    Args:
        path: the file (read as UTF-8).
        error: the exception class to raise (e.g. ``DataError``, ``ConfigError``).
        what: how the message introduces the file (e.g. ``"sampler=xrpo_icl: exemplar file"``);
            empty: the path alone.
        fix: appended to every message (e.g. ``"Fix: ..."``).
    Yields:
        ``(n, obj)`` with ``n`` 1-based over all lines, blank ones included, and ``obj`` a dict.
    Raises:
        error: a line that is not JSON (``PATH:N is not JSON (reason)``) or is JSON but not an
            object (``PATH:N is a JSON list, expected an object``).
    """
    head = f"{what} {path}" if what else str(path)
    tail = f" {fix}" if fix else ""
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{head}:{n} is not JSON ({e.msg}); each line must be one JSON object.{tail}") from None
            if not isinstance(obj, dict):
                raise error(f"{head}:{n} is a JSON {type(obj).__name__}, expected an object.{tail}")
            yield n, obj
