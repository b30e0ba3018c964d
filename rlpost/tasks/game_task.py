"""A game task: FrozenLake boards played through ``env=frozenlake`` (the Gymnasium adapter).

Each example is one FrozenLake board drawn by Gymnasium's own ``generate_random_map`` (every
board it returns has a path from S to G), seeded by ``task.data_seed`` and the example's
position, and deduplicated: the first ``eval_size`` distinct boards are held out, the next
``train_size`` train, so the splits never share a board. The board travels to the environment
as ``Example.meta['env_kwargs'] = {'desc': board}`` (:class:`rlpost.envs.gym.GymnasiumEnv`
builds its game from it). The reward is the game's (1 on reaching G), weighted in by
``sampler.params.env_reward_weight``; the task's own verifier scores 0, and held-out accuracy
is then the share of boards solved (:func:`rlpost.eval.episodes.evaluate_episodes`).
"""

from __future__ import annotations

import re
from typing import Any, List, Optional

from rlpost.core.errors import ConfigError
from rlpost.tasks.base import TASKS, Example, Task

_ACTION = re.compile(r"<action>\s*(-?\d+)\s*</action>")


@TASKS.register("frozenlake", description="FrozenLake boards (Gymnasium generate_random_map) for env=frozenlake; reward from the game")
class FrozenLakeTask(Task):
    """Random FrozenLake boards; see the module docstring.

    ``task.params``: ``size`` (board side, default 4) and ``p`` (probability that a cell is
    frozen, default 0.8), the arguments of ``generate_random_map``.

    Raises:
        ConfigError: gymnasium missing, unknown ``task.params`` keys, or ``size < 2``.
    """

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        try:
            from gymnasium.envs.toy_text.frozen_lake import generate_random_map
        except ImportError:
            raise ConfigError("task=frozenlake needs the gymnasium package: pip install gymnasium (or rlpost[agents])") from None
        from omegaconf import DictConfig, OmegaConf

        params = cfg.params or {}
        params = dict(OmegaConf.to_container(params, resolve=True) if isinstance(params, DictConfig) else params)
        bad = sorted(set(params) - {"size", "p"})
        if bad:
            raise ConfigError(f"task.params for kind=frozenlake: unknown key(s) {bad}; valid: size, p")
        size, p = int(params.get("size", 4)), float(params.get("p", 0.8))
        if size < 2:
            raise ConfigError(f"task.params.size={size}: a FrozenLake board needs size >= 2")
        want = int(cfg.eval_size) + int(cfg.train_size)
        boards, seen = [], set()
        for k in range(20 * max(1, want)):
            b = tuple(generate_random_map(size=size, p=p, seed=int(cfg.data_seed) * 1_000_003 + k))
            if b not in seen:
                seen.add(b)
                boards.append(list(b))
            if len(boards) >= want:
                break
        n_eval = min(int(cfg.eval_size), len(boards) // 2)
        self._eval = [self._example(i, b) for i, b in enumerate(boards[:n_eval])]
        self._train = [self._example(i, b) for i, b in enumerate(boards[n_eval:])]

    def _example(self, i: int, board: List[str]) -> Example:
        q = (self.cfg.instruction or "").strip()
        return Example(index=i, question=q, answer="G", meta={"env_kwargs": {"desc": board}, "board": board})

    def train_examples(self) -> List[Example]:
        """Training boards."""
        return self._train

    def eval_examples(self) -> List[Example]:
        """Held-out boards (none is a training board)."""
        return self._eval

    def user_message(self, example: Example) -> str:
        """The instruction (the environment adds the board and the action format)."""
        return example.question

    def extract_answer(self, response: str) -> Optional[str]:
        """The last ``<action>N</action>`` of the turn, or None."""
        found = _ACTION.findall(response or "")
        return found[-1] if found else None

    def score(self, response: str, example: Example) -> float:
        """0.0: the game's reward (through ``env_reward_weight``) is the signal, not the final text."""
        return 0.0
