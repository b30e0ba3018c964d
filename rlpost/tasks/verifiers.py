"""Answer verifiers: compare an extracted answer with a gold answer.

Every verifier is ``fn(pred: str, gold: Any, **params) -> float`` in [0, 1],
registered in :data:`VERIFIERS` and chosen with ``task.reward.verifier``
(parameters in ``task.reward.verifier_params``). A verifier may raise or hang on
hostile input; :class:`rlpost.rewards.RewardFunction` runs it in a worker process
with a timeout, so failures become reward 0 and are counted.
"""

from __future__ import annotations

import math
import re
from typing import Any, List, Optional

from rlpost.errors import ConfigError
from rlpost.registry import Registry

VERIFIERS = Registry("verifier", "task.reward.verifier")

_NUM = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def _mv_parse(text: Any, timeout: int) -> List[Any]:
    """math-verify parse of an answer string, trying it as inline LaTeX, raw, then boxed."""
    from math_verify import parse

    s = str(text).strip().replace("\\$", "")
    if len(s) > 1 and s.startswith("$") and s.endswith("$"):
        s = s.strip("$")
    s = s.lstrip("$")  # a leading currency sign
    if not s:
        return []
    for cand in (f"${s}$", s, f"\\boxed{{{s}}}"):
        parsed = parse(cand, parsing_timeout=timeout)
        if parsed:
            return parsed
    return []


@VERIFIERS.register(
    "math_verify",
    paper="Math-Verify (Hugging Face, github.com/huggingface/Math-Verify)",
    description="symbolic/numeric equivalence of math answers (fractions, LaTeX, sets, units stripped)",
)
def math_verify_answer(pred: str, gold: Any, float_rounding: int = 6, timeout: int = 5, **_: Any) -> float:
    """1.0 when math-verify judges ``pred`` equivalent to ``gold``, else 0.0.

    Both sides go through :func:`math_verify.parse` (LaTeX and plain expressions;
    ``\\boxed{}`` is unwrapped, units and ``\\text{}`` are stripped, ``\\$`` and
    ``%`` are ignored), then :func:`math_verify.verify` checks symbolic or numeric
    equality (``\\frac{1}{2}`` = 0.5, ``\\boxed{27}`` = 27.0, ``025`` = 25).

    Args:
        pred: the extracted model answer (or a whole response).
        gold: the gold answer (string or number).
        float_rounding: decimals kept in numeric comparison.
        timeout: seconds for math-verify's own parse/verify guard (it uses
            ``signal.alarm``, which works in the reward worker's main thread).
    """
    from math_verify import verify

    if isinstance(gold, float) and gold.is_integer():
        gold = int(gold)
    g = _mv_parse(gold, timeout)
    p = _mv_parse(pred, timeout)
    if not g or not p:
        return 0.0
    return float(verify(g, p, float_rounding=float_rounding, timeout_seconds=timeout))


def normalize_text(s: Any) -> str:
    """Lower-cased text without surrounding whitespace, ``$``, trailing period or thousands commas."""
    t = str(s).strip().strip("$").strip().rstrip(".").lower()
    t = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", t)
    return " ".join(t.split())


@VERIFIERS.register("exact", description="exact string match after light normalisation")
def exact_match(pred: str, gold: Any, normalize: bool = True, **_: Any) -> float:
    """1.0 when ``pred`` equals ``gold`` (after :func:`normalize_text` when ``normalize``)."""
    if normalize:
        return float(normalize_text(pred) == normalize_text(gold))
    return float(str(pred) == str(gold))


def to_number(s: Any) -> Optional[float]:
    """``s`` as a float (``1,000``, ``$5``, ``50%``, ``3/4`` accepted), or None."""
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return float(s)
    t = normalize_text(s).replace("\\$", "").lstrip("$").rstrip("%").replace("\\%", "").strip()
    if _NUM.match(t):
        return float(t)
    m = re.match(r"^([-+]?\d+)\s*/\s*(\d+)$", t)
    if m and int(m.group(2)) != 0:
        return int(m.group(1)) / int(m.group(2))
    return None


@VERIFIERS.register("numeric", description="numbers equal within a relative/absolute tolerance")
def numeric_match(pred: str, gold: Any, rel_tol: float = 1e-6, abs_tol: float = 1e-9, **_: Any) -> float:
    """1.0 when both parse as numbers (see :func:`to_number`) and ``math.isclose`` within tolerances."""
    p, g = to_number(pred), to_number(gold)
    if p is None or g is None:
        return 0.0
    return float(math.isclose(p, g, rel_tol=rel_tol, abs_tol=abs_tol))


@VERIFIERS.register("regex", description="the answer fully matches the gold answer read as a regular expression")
def regex_match(pred: str, gold: Any, ignore_case: bool = True, **_: Any) -> float:
    """1.0 when ``pred`` (stripped) fully matches the regular expression ``gold``.

    Raises:
        ConfigError: ``gold`` is not a valid regular expression.
    """
    try:
        pat = re.compile(str(gold), re.IGNORECASE if ignore_case else 0)
    except re.error as e:
        raise ConfigError(f"gold answer {gold!r} is not a valid regular expression for verifier=regex: {e}") from None
    return float(pat.fullmatch(str(pred).strip()) is not None)


@VERIFIERS.register(
    "reasoning_gym",
    paper="Reasoning Gym (arXiv:2505.24760)",
    description="a reasoning-gym dataset's own scorer (verifier_params.dataset=<name>)",
)
def reasoning_gym_match(pred: str, gold: Any, dataset: Optional[str] = None, entry: Optional[dict] = None, **_: Any) -> float:
    """Score with reasoning-gym dataset ``dataset``'s ``score_answer`` (partial credit allowed).

    ``entry`` is the reasoning-gym entry when known; otherwise one is built as
    ``{"answer": gold, "metadata": {}}``, which suffices for scorers that only
    compare with the answer.

    Raises:
        ConfigError: ``dataset`` missing or unknown.
    """
    import reasoning_gym

    if not dataset:
        raise ConfigError("verifier=reasoning_gym needs task.reward.verifier_params.dataset=<reasoning-gym dataset name>")
    try:
        fn = reasoning_gym.get_score_answer_fn(dataset)
    except ValueError:
        raise ConfigError(f"verifier_params.dataset={dataset!r} is not a reasoning-gym dataset") from None
    return float(fn(pred, entry if entry is not None else {"answer": str(gold), "metadata": {}}))


def verify(name: str, pred: Optional[str], gold: Any, params: Optional[dict] = None) -> float:
    """Run verifier ``name`` on ``pred``; a missing prediction scores 0.

    Raises:
        ConfigError: unknown verifier name (lists the choices).
    """
    fn = VERIFIERS.get(name)
    if pred is None:
        return 0.0
    return float(fn(pred, gold, **dict(params or {})))
