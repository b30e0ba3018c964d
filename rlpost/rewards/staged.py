"""PRS: a staged format-then-correctness reward (``task.reward.models.<name>.kind=prs``).

Paper: "Enhancing Agentic RL with Progressive Reward Shaping and Value-based
Sampling Policy Optimization" (Zhuang et al., arXiv:2512.07478), Progressive
Reward Shaping only (VSPO, its sampler half, is not implemented here).

What the abstract states: a curriculum-inspired, stage-wise reward that first
rewards parseable, well-formed output and then factual correctness and answer
quality; short-form answers scored by a length-aware BLEU, long-form answers by
an LLM judge. What it leaves open, and our choices:

* **the stage formula.** Ours gates: a response that fails the format stage
  gets ``-format_penalty`` (default 0); one that passes gets ``format_score``
  plus ``(1 - format_score) * quality``, so a well-formed wrong answer earns
  ``format_score`` and a well-formed correct one earns 1. Quality never counts
  without format: a correct answer in the wrong form cannot be learned first.
* **the curriculum schedule.** ``format_only_steps``: for that many RL steps
  only the format stage pays (``format_score`` on passing, nothing for
  quality); 0 (the default) runs both stages from the start.
* **what "format" means.** The task's own check (``task.format_ok``: an
  answer can be extracted, or ``task.reward.format_regex``), or this entry's
  ``format_regex``.
* **the quality source.** ``quality=rule`` (the task's verifier) or the name of
  another entry of ``task.reward.models`` listed before this one (a ``judge``
  or ``local_judge`` for free-form answers; set that entry's ``weight: 0`` so it
  counts only through PRS). Its scores are clipped to [0, 1].
* the length-aware BLEU of the short-form variant is not implemented.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from rlpost.core.errors import ConfigError
from rlpost.core.registry import param
from rlpost.rewards.models import REWARD_MODELS, ModelReward, ModelScore


def staged_reward(format_ok: torch.Tensor, quality: torch.Tensor, format_score: float, format_penalty: float = 0.0,
                  quality_on: bool = True) -> torch.Tensor:
    """PRS's staged reward (our formula; see the module docstring).

    ``r = -format_penalty`` where the format fails; where it passes,
    ``r = format_score + (1 - format_score) * clip(quality, 0, 1)``, or just
    ``format_score`` when ``quality_on`` is False (the format-only stage).

    Args:
        format_ok: ``[B]`` 1/0 format flags.
        quality: ``[B]`` correctness / judge scores.
    Returns:
        ``[B]`` float32 rewards.
    Raises:
        ValueError: ``format_score`` outside [0, 1] or shapes that differ.
    """
    if not 0.0 <= format_score <= 1.0:
        raise ValueError(f"format_score must be in [0, 1], got {format_score}")
    if format_ok.shape != quality.shape:
        raise ValueError(f"format flags {tuple(format_ok.shape)} and quality {tuple(quality.shape)} differ in shape")
    q = quality.float().clamp(0.0, 1.0) if quality_on else torch.zeros_like(quality, dtype=torch.float32)
    ok = format_ok.float() > 0.5
    return torch.where(ok, format_score + (1.0 - format_score) * q, torch.full_like(q, -float(format_penalty)))


@dataclass(frozen=True)
class PRSParams:
    """Progressive Reward Shaping (arXiv:2512.07478): format stage, then correctness / judge stage."""

    format_score: float = param(0.2, "reward of a well-formed response before its quality counts (stage 1)")
    format_penalty: float = param(0.0, "subtracted from a response that fails the format stage")
    format_regex: str = param("", "regular expression the response must contain (re.search); empty: the task's format check")
    quality: str = param("rule", "stage-2 score: rule (the task's verifier) or the name of an earlier task.reward.models entry (a judge)")
    format_only_steps: int = param(0, "RL steps at the start during which only the format stage pays")


@REWARD_MODELS.register("prs", params=PRSParams, paper="Enhancing Agentic RL with Progressive Reward Shaping and "
                        "Value-based Sampling Policy Optimization (arXiv:2512.07478)",
                        description="PRS: staged format-then-correctness reward, the judge for free-form answers")
class ProgressiveReward(ModelReward):
    """PRS as a reward entry: reads the format check and a quality source, returns :func:`staged_reward`.

    With ``quality=rule`` it calls the task's verifier itself (in-process);
    a run then sets ``task.reward.correct_weight=0`` so correctness is not
    counted twice (``conf/reward_model/prs.yaml`` does).

    Raises:
        ConfigError: (``check``) a bad ``format_regex`` or ``format_score``;
            (``score``) ``quality`` names no earlier entry.
    """

    def __init__(self, *, format_score: float, format_penalty: float, format_regex: str, quality: str,
                 format_only_steps: int) -> None:
        self.format_score, self.format_penalty = float(format_score), float(format_penalty)
        self.format_regex, self.quality = str(format_regex or ""), str(quality)
        self.format_only_steps = int(format_only_steps)
        self.steps_begun = 0

    def check(self) -> None:
        if not 0.0 <= self.format_score <= 1.0:
            raise ConfigError(f"task.reward.models.{self.name}.format_score must be in [0, 1], got {self.format_score}")
        if self.format_regex:
            try:
                re.compile(self.format_regex)
            except re.error as e:
                raise ConfigError(f"task.reward.models.{self.name}.format_regex is not a regular expression: {e}") from None

    def begin_step(self) -> None:
        self.steps_begun += 1

    def format_flags(self, responses: Sequence[str]) -> torch.Tensor:
        """``[B]`` 1/0: this entry's ``format_regex`` found, else the task's ``format_ok``."""
        if self.format_regex:
            f = [re.search(self.format_regex, r or "", re.DOTALL) is not None for r in responses]
        else:
            f = [bool(self.task.format_ok(r)) for r in responses]
        return torch.tensor([float(x) for x in f], dtype=torch.float32)

    def score(self, responses: Sequence[str], examples: Sequence[Any], prior: Mapping[str, ModelScore]) -> ModelScore:
        fmt = self.format_flags(responses)
        errors = 0
        if self.quality == "rule":
            q = []
            for r, e in zip(responses, examples):
                try:
                    q.append(float(self.task.score(r, e)))
                except Exception:  # noqa: BLE001 - a verifier failure is quality 0, counted
                    q.append(0.0)
                    errors += 1
            quality = torch.tensor(q, dtype=torch.float32)
        elif self.quality in prior:
            src: Optional[ModelScore] = prior[self.quality]
            quality = (src.raw if src.raw is not None else src.values).float()
        else:
            raise ConfigError(f"task.reward.models.{self.name}.quality={self.quality!r}: no such entry before it "
                              f"(entries so far: {sorted(prior)}). Fix: quality=rule or the name of a judge entry listed "
                              f"before {self.name!r}.")
        stage2 = self.steps_begun > self.format_only_steps
        v = staged_reward(fmt, quality, self.format_score, self.format_penalty, quality_on=stage2)
        return ModelScore(v, errors, {f"reward/{self.name}_format_mean": float(fmt.mean()) if len(fmt) else 0.0,
                                      f"reward/{self.name}_quality_mean": float(quality.mean()) if len(quality) else 0.0,
                                      f"reward/{self.name}_stage": 2.0 if stage2 else 1.0}, raw=v)
