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


_HASHES = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*\$?([^\n]*?)(?:\.\s|\.?$|\n)", re.IGNORECASE)


def extract_hashes(text: str) -> Optional[str]:
    """The text after the last ``####`` marker (GSM8K style), stripped; None if absent or empty.

    ``"... #### 1,000"`` gives ``"1,000"`` (use :func:`parse_gsm8k_gold` to get a
    clean number).
    """
    found = _HASHES.findall(text or "")
    if not found:
        return None
    ans = found[-1].strip()
    return ans or None


def extract_answer_is(text: str) -> Optional[str]:
    """The phrase after the last "the answer is" (up to the end of the sentence); None if absent."""
    found = _ANSWER_IS.findall(text or "")
    if not found:
        return None
    ans = found[-1].strip().rstrip(".").strip()
    return ans or None


def parse_gsm8k_gold(answer: str) -> Optional[str]:
    """The gold number of a GSM8K answer field (``"... #### 1,000"`` -> ``"1000"``).

    Thousands separators, a ``$`` sign and a trailing period are removed.
    Returns None when the field has no ``####`` marker.
    """
    ans = extract_hashes(answer)
    if ans is None:
        return None
    ans = ans.replace("$", "").replace(",", "").strip().rstrip(".")
    return ans or None


def extract_auto(text: str) -> Optional[str]:
    """First answer found by, in order: ``<answer>`` tags, ``\\boxed{}``, ``####``,
    "the answer is ...", the last number. Robust extraction for free-form responses."""
    for fn in (extract_tagged, extract_boxed, extract_hashes, extract_answer_is, extract_last_number):
        ans = fn(text)
        if ans:
            return ans
    return None


#: answer_format -> extractor. ``auto`` tries every format (see :func:`extract_auto`).
EXTRACTORS = {
    "tags": extract_tagged,
    "boxed": extract_boxed,
    "last_number": extract_last_number,
    "hashes": extract_hashes,
    "auto": extract_auto,
}

#: A ready answer-format instruction for each strict format (for ``task.instruction``).
INSTRUCTIONS = {
    "tags": "Think step by step, then give the final answer inside <answer></answer> tags.",
    "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
    "last_number": "Solve the problem step by step and end your response with the final number.",
    "hashes": "Solve the problem step by step and write the final answer after ####.",
}


def extract_answer(text: str, answer_format: str) -> Optional[str]:
    """Final answer of ``text`` by ``answer_format``: tags | boxed | last_number | hashes | auto.

    Raises:
        ValueError: unknown format (the task layer turns this into a ConfigError
            at construction time).
    """
    fn = EXTRACTORS.get(answer_format)
    if fn is None:
        raise ValueError(f"unknown answer_format {answer_format!r}; valid: {', '.join(EXTRACTORS)}")
    return fn(text)
