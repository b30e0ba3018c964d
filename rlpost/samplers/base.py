"""Samplers: how the chosen prompts become rollouts through the rollout engine.

A sampler may call the engine several times per step (extra rounds, branches
from shared prefixes) and reports how many rollouts it spent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from rlpost.registry import Registry
from rlpost.rollout.base import GenerationResult, RolloutEngine, SamplingParams

SAMPLERS = Registry("sampler", "sampler")


@dataclass
class SampleResult:
    """Rollouts of one step.

    Attributes:
        generation: the concatenated :class:`GenerationResult` (``B`` rows).
        group_index: ``[B]`` long, position of each row's prompt in the step's
            prompt list (rows answering the same prompt share it).
        rollouts_spent: rollouts generated this step, including any discarded.
        extras: optional ``[B]`` / ``[B, R]`` tensors for the batch (e.g.
            ``baseline_rewards``), copied into ``RolloutBatch.extras``.
        metrics: sampler metrics (``sampler/...``).
    """

    generation: GenerationResult
    group_index: torch.Tensor
    rollouts_spent: int
    extras: Dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)


@dataclass
class SamplerContext:
    """What a sampler may use besides the engine.

    Attributes:
        score: ``fn(rows: list[int] prompt positions, texts: list[str]) -> list[float]``
            rewards of fresh responses (for samplers that decide on rewards, e.g.
            extra rounds for hard prompts); None when unavailable.
        step: the RL step.
        seed: base seed for this step's sampling.
    """

    score: Optional[Callable[[List[int], List[str]], List[float]]] = None
    step: int = 0
    seed: int = 0


class Sampler:
    """Base class. ``n_samples``: rollouts per prompt (the group size)."""

    def __init__(self, n_samples: int, **params: Any) -> None:
        if n_samples < 1:
            raise ValueError("n_samples must be >= 1")
        self.n_samples = n_samples

    def sample(
        self, engine: RolloutEngine, prompts: List[List[int]], params: SamplingParams, ctx: SamplerContext
    ) -> SampleResult:
        """Rollouts for ``prompts`` (one token-id list per chosen prompt)."""
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        """Sampler state for checkpoints."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


@SAMPLERS.register("group", description="n rollouts per prompt in one engine call (GRPO-style groups).")
class GroupSampler(Sampler):
    """``n_samples`` independent rollouts of every prompt, in one engine call."""

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see base
        rows = [p for p in prompts for _ in range(self.n_samples)]
        gi = torch.arange(len(prompts)).repeat_interleave(self.n_samples)
        gen = engine.generate(rows, params)
        return SampleResult(generation=gen, group_index=gi, rollouts_spent=len(rows))


@SAMPLERS.register("single", description="One rollout per prompt (SAO, MSSR).")
class SingleSampler(GroupSampler):
    """One rollout per prompt, whatever ``algo.n_samples_per_prompt`` says."""

    def __init__(self, n_samples: int = 1, **params: Any) -> None:
        super().__init__(1)


def build_sampler(cfg: Any, n_samples: int) -> Sampler:
    """Instantiate ``cfg.name`` with ``cfg.params`` and the algorithm's group size.

    Raises:
        ConfigError: unknown sampler or parameter.
    """
    from rlpost.errors import ConfigError

    cls = SAMPLERS.get(cfg.name)
    try:
        return cls(n_samples, **dict(cfg.params or {}))
    except TypeError as e:
        raise ConfigError(f"sampler={cfg.name}: bad sampler.params {dict(cfg.params or {})}: {e}") from None
