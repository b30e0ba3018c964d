"""Answer extraction helpers shared by tasks."""

from __future__ import annotations

import re
from typing import Optional

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_tagged(text: str) -> Optional[str]:
    """Content of the last ``<answer>...</answer>`` pair, stripped; None if absent."""
    found = _ANSWER_TAG.findall(text or "")
    return found[-1].strip() if found else None


def extract_last_number(text: str) -> Optional[str]:
    """The last number in ``text`` with thousands separators removed; None if none."""
    found = _NUMBER.findall(text or "")
    return found[-1].replace(",", "") if found else None


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (balanced braces); None if absent."""
    text = text or ""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def extract_answer(text: str, answer_format: str) -> Optional[str]:
    """Final answer of ``text`` by ``answer_format``: tags | boxed | last_number.

    Raises:
        ValueError: unknown format.
    """
    if answer_format == "tags":
        return extract_tagged(text)
    if answer_format == "boxed":
        return extract_boxed(text)
    if answer_format == "last_number":
        return extract_last_number(text)
    raise ValueError(f"unknown answer_format {answer_format!r}; valid: tags, boxed, last_number")
