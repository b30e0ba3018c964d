"""Which rows reached the generation limit: ``batch.extras['length_capped']`` ``[B]`` bool.

For estimators tagged ``needs_length_cap`` (``apriel``, the difficulty-aware
length penalty of "Apriel-Reasoner: RL Post-Training for General-Purpose and
Efficient Reasoning", arXiv:2604.02007: a rollout that hit the
token budget keeps DAPO's full overlong penalty whatever its group's solve rate).
A row is capped when its length reaches ``rollout.max_new_tokens``; multi-turn
episodes compare their longest model turn (``extras['overlong_lengths']``, the
length DAPO's window already uses), the budget being per turn.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.validate import old_shaping_spelling
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method, Needs, RunServices


def length_capped(lengths: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """``[B]`` bool: ``lengths >= max_new_tokens`` (lengths ``[B]`` in generated tokens)."""
    return lengths.long() >= int(max_new_tokens)


@METHODS.register("length_cap", paper="Apriel-Reasoner (arXiv:2604.02007)")
class LengthCap(Method):
    """Flags the rows that used the whole ``rollout.max_new_tokens`` budget."""

    name = "length_cap"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "needs_length_cap", False))

    def validate(self) -> None:
        """The estimator rescales DAPO's overlong penalty: without an overlong window it would be plain GRPO."""

        task_buf = float(getattr(getattr(self.cfg.task, "reward", None), "overlong_buffer", 0) or 0)
        algo_buf = float(old_shaping_spelling(self.cfg.algo).get("overlong_buffer", 0) or 0)  # the old spelling
        if task_buf <= 0 and algo_buf <= 0:
            raise ConfigError(f"adv_estimator={self.cfg.algo.adv_estimator} rescales DAPO's overlong penalty, but no "
                              f"overlong window is set. Fix: task.reward.overlong_buffer=0.2 (a share of "
                              f"rollout.max_new_tokens; the algo=apriel_reasoner preset sets it), or a token count.")

    def needs(self) -> Needs:
        return Needs(provides=("length_capped",))

    def describe(self) -> str:
        return "rows at the generation limit"

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        lengths = batch.extras.get("overlong_lengths")
        if lengths is None:
            lengths = batch.response_mask.sum(-1)
        capped = length_capped(lengths, int(self.cfg.rollout.max_new_tokens))
        batch.extras["length_capped"] = capped
        return {"adv/length_capped_frac": float(capped.float().mean())}
