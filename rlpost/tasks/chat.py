"""Chat-template encoding where only the template's own framing may carry special-token ids.

Prompt text, tool output and environment observations are encoded as plain text
(``split_special_tokens``), so text holding a special token's literal string
(``<|im_end|>``...) cannot close a turn or forge an assistant header. Used by
:meth:`rlpost.tasks.base.Task.render_prompt` and the episode sampler
(:mod:`rlpost.samplers.episode`).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

_PLAIN = "\u2063RLPOST_PLAIN_{}\u2063"
_PLAIN_RE = re.compile("\u2063RLPOST_PLAIN_(\\d+)\u2063")


def _special_strings(tokenizer: Any) -> List[str]:
    """The tokenizer's special-token strings (``all_special_tokens`` and added tokens marked special), longest first."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(t, "special", False):
            found.add(str(t))
    return sorted((s for s in found if s), key=len, reverse=True)


def encode_plain(tokenizer: Any, text: str) -> List[int]:
    """Token ids of ``text`` as plain text: a special token's literal text (``<|im_end|>``) is split into
    ordinary tokens (``split_special_tokens=True``), never encoded as the special id.

    Raises:
        TypeError: the tokenizer cannot encode special-token text as plain text (it has no
            ``split_special_tokens``; use a Hugging Face tokenizer from transformers >= 4.40).
    """
    try:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    except TypeError as e:  # pragma: no cover - every transformers tokenizer of the supported versions has it
        raise TypeError(f"tokenizer {type(tokenizer).__name__} has no split_special_tokens: environment text could "
                        "forge special tokens; use a transformers (>= 4.40) tokenizer") from e


def encode_framed(tokenizer: Any, framing: List[str], contents: List[str]) -> List[int]:
    """Token ids of ``framing[0] + contents[0] + framing[1] + ... + framing[-1]`` where only ``framing``
    (the chat template's own text) may carry special ids; every ``contents[i]`` is plain text.

    Identical to ``tokenizer(text, add_special_tokens=False)`` whenever no content holds a special
    token's literal text (a tokenizer splits its input at special tokens first and encodes the text
    between them alone; this does the same, with the split points taken from the framing only).

    Raises:
        ValueError: ``len(framing) != len(contents) + 1``.
    """
    if len(framing) != len(contents) + 1:
        raise ValueError(f"encode_framed: {len(framing)} framing pieces for {len(contents)} contents (need one more)")
    specials = _special_strings(tokenizer)
    split = re.compile("(" + "|".join(re.escape(s) for s in specials) + ")") if specials else None
    segs: List[list] = []  # [is_special, text]

    def plain(t: str) -> None:
        if not t:
            return
        if segs and not segs[-1][0]:
            segs[-1][1] += t
        else:
            segs.append([False, t])

    for i, f in enumerate(framing):
        for part in (split.split(f) if split is not None else [f]):
            if part and split is not None and part in specials:
                segs.append([True, part])
            else:
                plain(part)
        if i < len(contents):
            plain(contents[i])
    ids: List[int] = []
    for is_special, t in segs:
        ids.extend([int(tokenizer.convert_tokens_to_ids(t))] if is_special else encode_plain(tokenizer, t))
    return ids


def template_parts(tokenizer: Any, messages: List[Dict[str, str]], add_generation_prompt: bool,
                   after: Optional[str] = None) -> tuple:
    """The chat template's rendering of ``messages`` split into ``(framing, contents)`` for :func:`encode_framed`.

    Each content is rendered once as a stand-in (so its place in the template's text is known) and
    once as itself (so a template that edits contents, e.g. strips them, is followed). ``after``:
    keep only the text after this marker (it must be inside one content, left as is).

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("template_parts needs a tokenizer with a chat template")
    stand = [dict(m, content=_PLAIN.format(i)) if (after is None or after not in m["content"]) else dict(m)
             for i, m in enumerate(messages)]
    ts = tokenizer.apply_chat_template(stand, tokenize=False, add_generation_prompt=add_generation_prompt)
    tr = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    if after is not None:
        ts, tr = ts[ts.index(after) + len(after):], tr[tr.index(after) + len(after):]
    pieces = _PLAIN_RE.split(ts)  # framing, index, framing, index, ...
    framing, idx = pieces[0::2], [int(k) for k in pieces[1::2]]
    m = re.fullmatch("(.*?)".join(re.escape(f) for f in framing), tr, flags=re.DOTALL)
    contents = list(m.groups()) if m is not None and len(idx) else [messages[k]["content"] for k in idx]
    return framing, contents
