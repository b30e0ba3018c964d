"""Tools an agent calls, and the tool-call format parsed from the model's text.

Tool-call format (Hermes / Qwen2.5 / Qwen3 chat templates, and the documented format for
SmolLM2-135M-Instruct, whose template has no tool syntax of its own)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123 * 456"}}
    </tool_call>

Each call is one JSON object with ``name`` and ``arguments`` (an object, or a JSON string
holding one, as some models write). A turn may hold several calls; a turn without a
``<tool_call>`` tag is the model's final answer.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union

from rlpost.envs.sandbox import SandboxLimits, run_python
from rlpost.core.registry import Registry

TOOLS = Registry("tool", "sampler.params.tools")

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    """One parsed call: ``name`` and ``arguments``, or ``error`` (a message for the model) when malformed."""

    name: Optional[str]
    arguments: Dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None


def parse_tool_calls(text: str) -> List[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` block of ``text`` (an unclosed last block counts).

    Malformed blocks come back as a :class:`ToolCall` with ``error`` set (never raised):
    invalid JSON, not an object, no string ``name``, ``arguments`` not an object.
    Returns an empty list when ``text`` holds no ``<tool_call>`` tag (a final answer).
    """
    calls: List[ToolCall] = []
    for m in TOOL_CALL_RE.finditer(text or ""):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, error=f"Error: tool call is not valid JSON ({e.msg} at char {e.pos})."))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(None, error='Error: a tool call must be a JSON object {"name": ..., "arguments": {...}}.'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], error="Error: tool call arguments must be a JSON object."))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


@dataclass
class ToolResult:
    """What a tool returns: ``content`` for the model, whether it was an ``error``, whether it ``timed_out``."""

    content: str
    error: bool = False
    timed_out: bool = False


class Tool:
    """Base class: ``name``, a one-line ``description`` and ``parameters`` (JSON-schema properties)
    shown to the model; :meth:`__call__` never raises for bad model input."""

    name = ""
    description = ""
    parameters: Dict[str, Any] = {}

    def __call__(self, **arguments: Any) -> ToolResult:
        raise NotImplementedError

    def schema(self) -> Dict[str, Any]:
        """OpenAI-style function schema (what chat templates with a ``tools`` argument render)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": {"type": "object", "properties": self.parameters,
                                                                "required": list(self.parameters)}}}


_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UN = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def safe_arithmetic(expr: str, max_abs: float = 1e100) -> Union[int, float]:
    """Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses) without ``eval``.

    Raises:
        ValueError: anything else (names, calls, attributes), a too long expression,
            division by zero, an exponent above 1000 or a result larger than ``max_abs``.
    """
    if len(expr) > 500:
        raise ValueError("expression too long (max 500 characters)")
    try:
        tree = ast.parse(expr.replace("^", "**").replace("×", "*"), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expr!r}") from None

    def ev(n: ast.AST) -> Union[int, float]:
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _BIN:
            a, b = ev(n.left), ev(n.right)
            if isinstance(n.op, ast.Pow) and abs(b) > 1000:
                raise ValueError("exponent too large (max 1000)")
            try:
                v = _BIN[type(n.op)](a, b)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
            if isinstance(v, complex) or (isinstance(v, float) and not math.isfinite(v)) or abs(v) > max_abs:
                raise ValueError("result out of range")
            return v
        if isinstance(n, ast.UnaryOp) and type(n.op) in _UN:
            return _UN[type(n.op)](ev(n.operand))
        raise ValueError(f"unsupported syntax {type(n).__name__}; use numbers and + - * / // % ** ( )")

    return ev(tree)


@TOOLS.register("calculator", description="Arithmetic expression evaluator (no eval; numbers and + - * / // % **).")
class Calculator(Tool):
    """Evaluates ``expression`` with :func:`safe_arithmetic`; integral floats print as integers."""

    name = "calculator"
    description = "Evaluate an arithmetic expression, e.g. 123 * 456."
    parameters = {"expression": {"type": "string", "description": "the expression"}}

    def __call__(self, **arguments: Any) -> ToolResult:  # noqa: D102
        expr = arguments.get("expression")
        if not isinstance(expr, str):
            return ToolResult('Error: calculator needs {"expression": "<arithmetic>"}.', error=True)
        try:
            v = safe_arithmetic(expr)
        except ValueError as e:
            return ToolResult(f"Error: {e}", error=True)
        if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
            v = int(v)
        return ToolResult(str(v))


@TOOLS.register("python", description="Runs model-written Python in the sandbox (rlpost.envs.sandbox).")
class PythonTool(Tool):
    """Runs ``code`` through :func:`rlpost.envs.sandbox.run_python`; returns its stdout or an error line.

    Args: the :class:`rlpost.envs.sandbox.SandboxLimits` fields (``wall_s``, ``cpu_s``,
    ``memory_mb``, ``output_bytes``, ``nproc``, ``isolate_network``).
    """

    name = "python"
    description = "Run a Python program and return what it prints (stdout)."
    parameters = {"code": {"type": "string", "description": "the program; print the result"}}

    def __init__(self, **limits: Any) -> None:
        self.limits = SandboxLimits(**limits)

    def __call__(self, **arguments: Any) -> ToolResult:  # noqa: D102
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult('Error: python needs {"code": "<program>"}.', error=True)
        r = run_python(code, self.limits)
        return ToolResult(r.message() or "(no output; print the result)", error=not r.ok, timed_out=r.timed_out)


def build_tools(names: List[str], params: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Tool]:
    """``{name: Tool}`` for the registered tool ``names`` (``params[name]`` are constructor kwargs).

    Raises:
        ConfigError: an unknown tool name (lists the valid ones).
        TypeError: a bad tool parameter.
    """
    params = params or {}
    return {n: TOOLS.get(n)(**dict(params.get(n) or {})) for n in names}


def call_tool(tools: Dict[str, Tool], call: ToolCall) -> ToolResult:
    """Execute one parsed call; malformed or unknown calls and tool exceptions become error results."""
    if call.error:
        return ToolResult(call.error, error=True)
    tool = tools.get(call.name or "")
    if tool is None:
        return ToolResult(f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(tools))}.", error=True)
    try:
        return tool(**call.arguments)
    except Exception as e:  # a tool bug must cost the episode, never the run
        return ToolResult(f"Error: {type(e).__name__}: {e}", error=True)


ToolFn = Callable[..., ToolResult]
