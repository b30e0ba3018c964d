"""Prompt selectors: which dataset prompts enter each RL step.

A selector keeps state across steps (reward histories, posteriors), is updated
with each step's rewards, and is saved in checkpoints so that a resumed run
selects exactly the same prompts.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from rlpost.registry import Registry

SELECTORS = Registry("prompt selector", "selector")


class Selector:
    """Base class.

    Args:
        num_prompts: size of the training split (indices ``0..num_prompts-1``).
        prompts_per_step: prompts to return from :meth:`select`.
        seed: seed of the selector's own random generator.
    """

    def __init__(self, num_prompts: int, prompts_per_step: int, seed: int = 0, **params: Any) -> None:
        if num_prompts <= 0:
            raise ValueError("the training split is empty")
        self.num_prompts = num_prompts
        self.prompts_per_step = prompts_per_step
        self.rng = np.random.default_rng(seed)

    def select(self, step: int) -> List[int]:
        """Dataset indices of the prompts for ``step``."""
        raise NotImplementedError

    def update(self, prompt_indices: List[int], rewards: List[List[float]]) -> None:
        """Record the rewards of each selected prompt's rollouts (one list per prompt)."""

    def metrics(self) -> Dict[str, float]:
        """Selector metrics for the step log (``selector/...``)."""
        return {}

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue identically after a resume."""
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.rng.bit_generator.state = state["rng"]


@SELECTORS.register("uniform", paper="", description="Shuffled passes over the training split (the baseline).")
class UniformSelector(Selector):
    """Epoch-wise shuffled order without replacement; reshuffles after each pass."""

    def __init__(self, num_prompts: int, prompts_per_step: int, seed: int = 0, **params: Any) -> None:
        super().__init__(num_prompts, prompts_per_step, seed)
        self.order: List[int] = []
        self.pos = 0

    def select(self, step: int) -> List[int]:
        out: List[int] = []
        while len(out) < self.prompts_per_step:
            if self.pos >= len(self.order):
                self.order = self.rng.permutation(self.num_prompts).tolist()
                self.pos = 0
            take = self.order[self.pos : self.pos + self.prompts_per_step - len(out)]
            self.pos += len(take)
            out.extend(take)
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "order": list(self.order), "pos": self.pos}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.order = list(state["order"])
        self.pos = int(state["pos"])


def build_selector(cfg: Any, num_prompts: int, seed: int) -> Selector:
    """Instantiate ``cfg.name`` with ``cfg.params``.

    Raises:
        ConfigError: unknown selector or unknown parameter.
    """
    from rlpost.errors import ConfigError

    cls = SELECTORS.get(cfg.name)
    try:
        return cls(num_prompts, cfg.prompts_per_step, seed, **dict(cfg.params or {}))
    except TypeError as e:
        raise ConfigError(f"selector={cfg.name}: bad selector.params {dict(cfg.params or {})}: {e}") from None
