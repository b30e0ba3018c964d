"""Step segmentation of a response: a declared rule (``segment=newline | step_k | sentence``) shared by
everything that works on reasoning steps: the PRM verifier (:mod:`rlpost.rewards.process`), SCOPE's
first-error repair (:mod:`rlpost.samplers.scope`), GRPO-VPS's answer probes (:mod:`rlpost.algos.vps`)
and OPRL. Plain text functions, plus the map from a step's last character to the policy's token.
"""

from __future__ import annotations

import bisect
import re
from typing import Any, Callable, List, Optional, Sequence, Tuple

from rlpost.core.registry import Registry

#: step segmentation rules: ``fn(text) -> [(start, end)]`` character spans of the steps, in order
SEGMENTERS = Registry("step segmentation rule", "segment")

Span = Tuple[int, int]


def _strip_span(text: str, a: int, b: int) -> Optional[Span]:
    """``(a', b')`` with surrounding whitespace removed, or None when only whitespace."""
    while a < b and text[a].isspace():
        a += 1
    while b > a and text[b - 1].isspace():
        b -= 1
    return (a, b) if b > a else None


@SEGMENTERS.register("newline", description="one step per non-empty line")
def segment_newline(text: str) -> List[Span]:
    """Each non-empty line is a step (its span without surrounding whitespace)."""
    out, start = [], 0
    for m in re.finditer(r"\n", text + "\n"):
        sp = _strip_span(text, start, min(m.start(), len(text)))
        if sp:
            out.append(sp)
        start = m.end()
    return out


_STEP_RE = re.compile(r"(?mi)^[ \t]*step[ \t]*(\d+)[ \t]*[:.)]")


@SEGMENTERS.register("step_k", description="steps introduced by 'Step k:' at a line start; text before the first is not a step")
def segment_step_k(text: str) -> List[Span]:
    """Step ``k`` runs from its ``Step k:`` marker (at a line start, any case, ``:``/``.``/``)``)
    to the next marker or the end of the text; text before the first marker is no step."""
    starts = [m.start() for m in _STEP_RE.finditer(text)]
    out = []
    for i, a in enumerate(starts):
        sp = _strip_span(text, a, starts[i + 1] if i + 1 < len(starts) else len(text))
        if sp:
            out.append(sp)
    return out


@SEGMENTERS.register("sentence", description="sentences: ends at . ! ? followed by whitespace, and at line breaks")
def segment_sentence(text: str) -> List[Span]:
    """Sentences: a step ends after ``.``, ``!`` or ``?`` followed by whitespace (a decimal point
    ``3.5`` does not end one), and at every line break."""
    out, start = [], 0
    for m in re.finditer(r"(?<=[.!?])\s+|\n", text):
        sp = _strip_span(text, start, m.start())
        if sp:
            out.append(sp)
        start = m.end()
    sp = _strip_span(text, start, len(text))
    if sp:
        out.append(sp)
    return out


def segment_steps(text: str, rule: str = "newline", require: bool = False) -> List[Span]:
    """Character spans ``(start, end)`` of the steps of ``text`` under segmentation ``rule``.

    Args:
        rule: a :data:`SEGMENTERS` name.
        require: raise when no step is found.
    Raises:
        ConfigError: unknown rule (lists the choices).
        ValueError: ``require`` and no step found (names the rule and the fix).
    """
    spans = SEGMENTERS.get(rule)(text or "")
    if require and not spans:
        raise ValueError(f"segmentation rule {rule!r} found no steps in {text[:80]!r}. Fix: another rule "
                         f"(newline, sentence) or a prompt that asks for that step format.")
    return spans


def char_to_token(offsets: Sequence[Tuple[int, int]], char_end: int) -> int:
    """Index of the token that holds character ``char_end - 1`` (the last character of a step).

    Args:
        offsets: ``(start, end)`` character span of each token (a fast tokenizer's offset mapping).
    Returns:
        the first token whose end is past ``char_end - 1``; the last token when none is.
    """
    ends = [e for _, e in offsets]
    return min(bisect.bisect_left(ends, char_end), len(offsets) - 1)


def policy_step_positions(tokenizer: Any, response: str, spans: Sequence[Span]) -> List[int]:
    """Response-token index of each step's last token, from the policy tokenizer's offsets.

    The response text is re-tokenized (``add_special_tokens=False``); for a
    BPE tokenizer decode-then-encode usually gives back the generated ids, and
    where it does not the position is that of the token holding the step's
    last character in the re-tokenized text (clamped to the response later,
    :func:`place_token_rewards`).
    """
    enc = tokenizer(response, add_special_tokens=False, return_offsets_mapping=True)
    offs = enc["offset_mapping"]
    if not offs:
        return [0 for _ in spans]
    return [char_to_token(offs, b) for _, b in spans]


def segmenter(rule: str) -> Callable[[str], List[Span]]:
    """The segmentation function of ``rule`` (see :func:`segment_steps` for errors)."""
    return SEGMENTERS.get(rule)
