"""Adapter: Gymnasium environments with discrete actions, played in text.

Gymnasium (the Farama Foundation's maintained successor of OpenAI Gym, https://gymnasium.farama.org)
is the established reset/step standard; its ``toy_text`` environments (FrozenLake, Taxi,
CliffWalking, Blackjack) render as text (``render_mode="ansi"``) and run offline on CPU.
The adapter runs them unchanged: the observation is the environment's text rendering, the
action is the last ``<action>N</action>`` (else the last integer) in the model's turn, and the
environment's reward is the turn reward. Install with ``pip install gymnasium`` (or ``rlpost[agents]``).
"""

from __future__ import annotations

import re
from typing import Any, Dict, Optional

from rlpost.core.errors import ConfigError
from rlpost.envs.base import ENVS, Env, EnvStep

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ACTION = re.compile(r"<action>\s*(-?\d+)\s*</action>")
_INT = re.compile(r"-?\d+")


@ENVS.register("gymnasium", description="Any Gymnasium env with Discrete actions, rendered as text (ansi).")
class GymnasiumEnv(Env):
    """A Gymnasium environment played through text.

    Args:
        env_id: registered Gymnasium id, e.g. ``FrozenLake-v1``.
        env_kwargs: keyword arguments of ``gymnasium.make`` (e.g. ``{is_slippery: false}``).
        action_help: one line telling the model what the actions mean (added to the observation).

    Raises:
        ConfigError: gymnasium is not installed, or the env has no ``Discrete`` action space.
    """

    def __init__(self, env_id: str = "FrozenLake-v1", env_kwargs: Optional[Dict[str, Any]] = None,
                 action_help: str = "") -> None:

        try:
            import gymnasium
        except ImportError:
            raise ConfigError("sampler.params.env=gymnasium needs the gymnasium package: pip install gymnasium") from None
        self.env_id, self.env_kwargs = env_id, dict(env_kwargs or {})
        self.env = gymnasium.make(env_id, render_mode="ansi", **self.env_kwargs)
        n = getattr(self.env.action_space, "n", None)
        if n is None:
            raise ConfigError(f"gymnasium env {env_id} has a non-Discrete action space; only Discrete is supported")
        self.n_actions = int(n)
        self.action_help = action_help
        self.instructions = f"Reply with one action as <action>N</action>, N in 0..{self.n_actions - 1}. {action_help}".strip()

    def _observe(self, obs: Any) -> str:
        try:
            txt = self.env.render()
        except Exception:  # noqa: BLE001 - some envs cannot render; the raw observation is the fallback
            txt = None
        return _ANSI.sub("", txt).strip("\n") if isinstance(txt, str) and txt.strip() else f"Observation: {obs}"

    def reset(self, example: Any) -> Optional[str]:
        """Reset with seed ``example.index`` (reproducible per prompt); returns the rendered state and the action format.

        ``example.meta['env_kwargs']``, when present, are ``gymnasium.make`` arguments of this
        example's game over ``env_kwargs`` (``task=frozenlake`` gives each example its own board).
        """
        import gymnasium

        kw = (getattr(example, "meta", None) or {}).get("env_kwargs")
        if kw:
            self.env = gymnasium.make(self.env_id, render_mode="ansi", **{**self.env_kwargs, **dict(kw)})
        obs, _ = self.env.reset(seed=int(getattr(example, "index", 0)))
        return f"{self._observe(obs)}\n{self.instructions}"

    def parse_action(self, text: str) -> Optional[int]:
        """The action in ``text``: the last ``<action>N</action>``, else the last integer; None if none is valid."""
        m = _ACTION.findall(text or "") or _INT.findall(text or "")
        if not m:
            return None
        a = int(m[-1])
        return a if 0 <= a < self.n_actions else None

    def step(self, text: str) -> EnvStep:  # noqa: D102
        a = self.parse_action(text)
        if a is None:
            msg = f"Invalid action. {self.instructions}"
            return EnvStep([{"role": "user", "content": msg}], 0.0, False,
                           {"tool_calls": 1, "tool_errors": 1, "tool_timeouts": 0, "void": 1})
        obs, r, term, trunc, _ = self.env.step(a)
        done = bool(term or trunc)
        msgs = [] if done else [{"role": "user", "content": self._observe(obs)}]
        return EnvStep(msgs, float(r), done, {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0, "void": 0})
