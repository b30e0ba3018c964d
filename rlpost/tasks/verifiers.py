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
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional

from rlpost.core.errors import ConfigError
from rlpost.core.registry import Registry

VERIFIERS = Registry("verifier", "task.reward.verifier")

_NUM = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


#: a plain number in scientific notation (``3.2e-5``, ``6E3``), not part of a word or a longer number
_SCI = re.compile(r"(?<![\w.])([-+]?(?:\d+\.?\d*|\.\d+))[eE]([-+]?\d+)(?![\w.])")
_DOLLAR_FRAGMENT = re.compile(r"(?<!\\)\$([^$]+?)(?<!\\)\$")


def answer_text(value: Any) -> str:
    """The text of an answer value, the same way for gold answers and predictions.

    A list or tuple (a JSONL answer field holding several answers) becomes its
    elements joined by ``", "`` (never its Python repr, whose doubled
    backslashes would break LaTeX); an integral float is written as an integer
    (AMC's ``27.0`` -> ``27``); anything else is ``str(value)`` stripped.
    """
    if isinstance(value, (list, tuple)):
        return ", ".join(answer_text(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def normalize_math_answer(text: Any) -> str:
    """Rewrite an answer so math-verify reads it as intended; applied to gold and prediction alike.

    * Scientific notation ``3.2e-5`` becomes ``3.2\\times10^{-5}`` (math-verify's
      expression parser reads ``e`` as Euler's number: ``3.2e-5`` would be
      ``3.2 e - 5`` and ``6e3`` would equal ``3e6``).
    * Several ``$...$`` fragments (``x = $3$ or $x=5$``) become one set of all
      of them, ``$3$, $x=5$`` (math-verify's LaTeX extraction would keep one
      fragment); the prose between them is dropped.
    * Escaped ``\\$`` currency signs and one leading ``$`` sign are removed; an
      answer wrapped in one ``$...$`` is unwrapped.
    """
    s = answer_text(text)
    frags = _DOLLAR_FRAGMENT.findall(s)
    if len(frags) > 1:
        s = ", ".join(f.strip() for f in frags)
    s = s.replace("\\$", "").strip()
    if len(s) > 1 and s.startswith("$") and s.endswith("$"):
        s = s.strip("$")
    s = s.lstrip("$").strip()  # a leading currency sign
    return _SCI.sub(lambda m: f"{m.group(1)}\\times10^{{{int(m.group(2))}}}", s)


class _Budget(BaseException):
    """The per-sample time budget of :func:`math_verify_answer` ran out.

    A ``BaseException`` (like ``KeyboardInterrupt``) so that math-verify's and
    sympy's own ``except Exception`` handlers cannot swallow it and go on
    parsing past the budget.
    """


@contextmanager
def _time_budget(seconds: float) -> Iterator[None]:
    """Raise :class:`_Budget` after ``seconds`` of wall time (SIGALRM timer; main thread only, else no limit)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):  # noqa: ARG001 - signal handler signature
        raise _Budget()

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, old)


def _quiet_math_verify() -> None:
    """Silence math-verify's one-time "Timeout is disabled" warning: :func:`_time_budget` is the timeout."""
    import math_verify.grader as grader
    import math_verify.parser as parser

    parser.TIMEOUT_WARNING_SHOWN = True
    grader.TIMEOUT_WARNING_SHOWN = True


def _mv_parse(text: Any) -> List[Any]:
    """math-verify parse of a normalised answer: as inline LaTeX, then raw, then boxed (first that parses).

    No timeout of its own: the caller holds one budget for the whole sample.
    """
    from math_verify import parse

    _quiet_math_verify()
    s = normalize_math_answer(text)
    if not s:
        return []
    for cand in (f"${s}$", s, f"\\boxed{{{s}}}"):
        parsed = parse(cand, parsing_timeout=None)
        if parsed:
            return parsed
    return []


@VERIFIERS.register(
    "math_verify",
    paper="Math-Verify (Hugging Face, github.com/huggingface/Math-Verify)",
    description="symbolic/numeric equivalence of math answers (fractions, LaTeX, sets, units stripped)",
)
def math_verify_answer(pred: str, gold: Any, float_rounding: int = 6, timeout: float = 3.0, **_: Any) -> float:
    """1.0 when math-verify judges ``pred`` equivalent to ``gold``, else 0.0.

    Both sides go through :func:`math_verify.parse` (LaTeX and plain expressions;
    ``\\boxed{}`` is unwrapped, units and ``\\text{}`` are stripped, ``\\$`` and
    ``%`` are ignored), then :func:`math_verify.verify` checks symbolic or numeric
    equality (``\\frac{1}{2}`` = 0.5, ``\\boxed{27}`` = 27.0, ``025`` = 25). Both
    sides are first normalised the same way by :func:`normalize_math_answer`
    (scientific notation, several ``$...$`` fragments, list answers).

    Args:
        pred: the extracted model answer (or a whole response).
        gold: the gold answer (string or number).
        float_rounding: decimals kept in numeric comparison.
        timeout: one wall-time budget in seconds for the whole sample (every
            parse attempt of both sides and the comparison together); when it
            runs out the sample scores 0. Our choice: 3 s, below the reward
            worker's ``task.reward.timeout_s`` (5 s), so a slow input returns 0
            here instead of getting the worker killed and re-forked. Enforced
            with a SIGALRM timer, which works in the reward worker's main
            thread; called from another thread there is no limit.
    """
    from math_verify import verify

    try:
        with _time_budget(timeout):
            g = _mv_parse(gold)
            p = _mv_parse(pred) if g else []
            if not g or not p:
                return 0.0
            return float(verify(g, p, float_rounding=float_rounding, timeout_seconds=None))
    except _Budget:
        return 0.0


def normalize_text(s: Any) -> str:
    """Lower-cased text without surrounding whitespace, ``$``, trailing period or thousands commas."""
    t = answer_text(s).strip("$").strip().rstrip(".").lower()
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
