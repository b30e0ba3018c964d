"""Environments and tools for multi-turn episodes (see docs/AGENTS.md)."""

from rlpost.envs.base import ENVS, Env, EnvStep, ToolEnv, make_env  # noqa: F401
from rlpost.envs import gym as _gym  # noqa: F401  (registers the gymnasium adapter; gymnasium imported lazily)
from rlpost.envs.tools import TOOLS, ToolCall, parse_tool_calls  # noqa: F401
