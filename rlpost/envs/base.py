"""rlpost's environment protocol: what an episode talks to between the model's turns.

An :class:`Env` is made fresh for every episode. :meth:`Env.reset` gets the task example and
may return an observation that is added to the user turn; then, after every model turn,
:meth:`Env.step` gets the turn's decoded text and returns the messages to insert (tool
results, game observations), a per-turn reward and whether the episode is over. The sampler
(:class:`rlpost.samplers.episode.EpisodeSampler`) owns tokens: it never re-tokenises model
text, and tokenises only the inserted messages, rendered with the model's chat template.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from rlpost.envs.tools import build_tools, call_tool, parse_tool_calls
from rlpost.core.registry import Registry

ENVS = Registry("environment", "sampler.params.env")


@dataclass
class EnvStep:
    """What the environment answers to one model turn.

    Attributes:
        messages: chat messages to insert before the next model turn (``{"role", "content"}``;
            role ``tool`` for tool results); empty when ``done``.
        reward: per-turn reward (summed into the episode's ``reward_env`` when the sampler
            weights environment rewards; 0 for tool environments).
        done: the episode is over (a final answer, or the environment's own end).
        info: counters of this turn: ``tool_calls``, ``tool_errors``, ``tool_timeouts``,
            ``void`` (the turn held neither a well-formed action nor a final answer; SimpleTIR).
    """

    messages: List[Dict[str, str]] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: Dict[str, float] = field(default_factory=dict)


class Env:
    """Base class of rlpost environments (one instance per episode)."""

    #: text added to the system prompt describing the environment's action format ("" = none)
    instructions: str = ""

    def reset(self, example: Any) -> Optional[str]:
        """Start an episode for task ``example``; an observation to add to the user turn, or None."""
        return None

    def step(self, text: str) -> EnvStep:
        """React to the model turn ``text`` (decoded, special tokens skipped). Must not raise for bad model output."""
        raise NotImplementedError

    def step_at_cap(self, text: str) -> EnvStep:
        """React to the model's last allowed turn (``sampler.params.max_turns`` reached).

        No model turn follows, so an observation would never be used. The default is
        :meth:`step` (a game's last action is a transition whose reward counts); environments
        whose actions have side effects (tools) override it to act only when the turn ends the
        episode. The sampler marks the episode truncated unless the step is ``done``.
        """
        return self.step(text)


@ENVS.register("tools", description="Tool calls (<tool_call> JSON) executed by registered tools; a turn without one is the final answer.")
class ToolEnv(Env):
    """Executes the turn's ``<tool_call>`` blocks (:func:`rlpost.envs.tools.parse_tool_calls`);
    a turn without a call ends the episode (the final answer, scored by the task's verifier).

    Args:
        tools: registered tool names (``rlpost.envs.tools.TOOLS``), e.g. ``[calculator]``.
        tool_params: ``{tool: {kwarg: value}}`` (e.g. ``{python: {wall_s: 5}}``).
        max_calls_per_turn: calls executed per turn; further calls get an error message.
        max_result_chars: a tool result is cut to this many characters.

    Raises:
        ConfigError: unknown tool; TypeError: bad tool parameter.
    """

    def __init__(self, tools: Optional[List[str]] = None, tool_params: Optional[Dict[str, Any]] = None,
                 max_calls_per_turn: int = 4, max_result_chars: int = 1000) -> None:
        self.tools = build_tools(list(tools or ["calculator"]), tool_params)
        self.max_calls_per_turn = int(max_calls_per_turn)
        self.max_result_chars = int(max_result_chars)
        names = ", ".join(f"{t.name}({', '.join(t.parameters)})" for t in self.tools.values())
        self.instructions = (f"Tools: {names}. Call one as <tool_call>{{\"name\": \"NAME\", \"arguments\": {{...}}}}"
                             "</tool_call> and wait for the result; answer without a tool call when done.")

    def step_at_cap(self, text: str) -> EnvStep:
        """The last allowed turn: a final answer ends the episode as in :meth:`step`; a turn that still
        calls tools runs none of them (no side effects; ``info['tool_calls_skipped']`` counts them,
        ``tool_calls`` stays 0) and the sampler marks the episode truncated."""
        calls = parse_tool_calls(text)
        if not calls:
            return self.step(text)
        return EnvStep([], 0.0, False, {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0,
                                        "tool_calls_skipped": len(calls),
                                        "void": float(all(c.error is not None for c in calls))})

    def step(self, text: str) -> EnvStep:  # noqa: D102
        calls = parse_tool_calls(text)
        if not calls:
            return EnvStep(done=True, info={"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "void": 0})
        msgs, errors, timeouts = [], 0, 0
        for i, c in enumerate(calls):
            if i >= self.max_calls_per_turn:
                res_text, err, to = f"Error: at most {self.max_calls_per_turn} tool calls per turn.", True, False
            else:
                r = call_tool(self.tools, c)
                res_text, err, to = r.content, r.error, r.timed_out
            errors += int(err)
            timeouts += int(to)
            msgs.append({"role": "tool", "content": res_text[: self.max_result_chars]})
        void = float(all(c.error is not None for c in calls))  # no well-formed call and no answer
        return EnvStep(msgs, 0.0, False, {"tool_calls": len(calls), "tool_errors": errors, "tool_timeouts": timeouts,
                                          "void": void})


def make_env(name: str, params: Optional[Dict[str, Any]] = None) -> Env:
    """A fresh environment ``name`` with ``params`` (one per episode).

    Raises:
        ConfigError: unknown environment (lists the valid ones).
        TypeError: a bad parameter.
    """
    import rlpost.envs  # noqa: F401  (registers the built-in environments)

    return ENVS.get(name)(**dict(params or {}))


def timed_step(env: Env, text: str, last: bool = False) -> tuple:
    """``(env.step(text), seconds)`` (``env.step_at_cap(text)`` when ``last``: the turn cap is reached);
    an exception inside the environment becomes a done step with ``info['env_errors'] = 1`` (it costs
    the episode, never the run)."""
    t0 = time.perf_counter()
    try:
        fn = getattr(env, "step_at_cap", None) if last else None
        out = fn(text) if fn is not None else env.step(text)
    except Exception as e:  # noqa: BLE001 - an environment bug must not stop training
        out = EnvStep([], 0.0, True, {"env_errors": 1, "error": f"{type(e).__name__}: {e}"})  # type: ignore[dict-item]
    return out, time.perf_counter() - t0
