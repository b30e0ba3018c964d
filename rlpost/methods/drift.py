"""DRIFT's decoupled rollouts: every step samples the frozen reference policy, never the trained one.

"DRIFT: Decoupled Rollouts and Importance-Weighted Fine-Tuning for Efficient Multi-Turn
Optimization" (arXiv:2605.31455). The paper samples a dataset of interaction trajectories from the
fixed reference policy once, offline, then fine-tunes on it with return weights. Inside the RL loop
the same distribution is drawn step by step: the run builds its rollout engine over the frozen
reference copy (``Needs.frozen_rollouts``) and never loads the trainer's weights into it, while
evaluation keeps an engine over the trained policy. Each prompt is thus answered by ``pi_ref``
whenever it is drawn (a fresh sample per visit instead of one stored dataset; the same
distribution). The estimator tagged ``needs_frozen_rollouts`` (``drift``,
:mod:`rlpost.algos.drift`) turns the rows' returns into weights; ``prepare`` logs the mean repeat
penalty (``drift/repeat_penalty_mean``) of the rows' per-turn answer counts, which the episode
sampler records.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from rlpost.algos.drift import ANSWER_TURNS_KEY, DISTINCT_ANSWERS_KEY, repeat_penalty_of
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.validate import adv_overrides
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method, Needs, RunServices


@METHODS.register("drift", paper="DRIFT (arXiv:2605.31455)")
class FrozenRollouts(Method):
    """Rollouts from the frozen reference policy (DRIFT's offline sampling, drawn per step).

    Raises:
        ConfigError: (``validate``) ``executor=async`` or ``launcher=ray``, whose producers load the
            trainer's weights into the rollout engine themselves, or a negative ``repeat_penalty``;
            (``setup``) no separate reference copy (``model.lora``).
    """

    name = "drift"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "needs_frozen_rollouts", False))

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        adv = str(cfg.algo.adv_estimator)
        self.repeat_coef = float(ADV_ESTIMATORS.kwargs(adv, adv_overrides(cfg.algo), "algo.adv_params")
                                 .get("repeat_penalty", 0.0))

    def validate(self) -> None:
        if self.repeat_coef < 0:
            raise ConfigError(f"algo.adv_params.repeat_penalty must be >= 0 (a penalty), got {self.repeat_coef}. "
                              f"Fix: 0.5 (the authors') or 0 (off).")
        if str(self.cfg.executor.name) == "async":
            raise ConfigError(f"adv_estimator={self.cfg.algo.adv_estimator} samples the frozen reference policy, but "
                              f"executor=async loads the trainer's weights into the rollout engine. Fix: executor=sync.")
        launcher = self.cfg.get("launcher", None)
        if launcher is not None and str(launcher.get("name", "none")) != "none":
            raise ConfigError(f"adv_estimator={self.cfg.algo.adv_estimator} samples the frozen reference policy, which "
                              f"the Ray rollout pool does not hold. Fix: launcher=none.")

    def needs(self) -> Needs:
        return Needs(reference_policy=True, frozen_rollouts=True)

    def describe(self) -> str:
        return "rollouts from the frozen reference policy (DRIFT)"

    def setup(self, run: RunServices) -> None:
        if run.reference_policy is None:
            raise ConfigError(f"adv_estimator={self.cfg.algo.adv_estimator} samples the frozen reference policy, which "
                              f"model.lora shares with the policy (no separate copy). Fix: model.lora.rank=0.")

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        """Log ``drift/repeat_penalty_mean`` (and ``drift/answer_turns_mean``) when the rows carry per-turn answer counts."""
        ex = batch.extras
        if ANSWER_TURNS_KEY not in ex or DISTINCT_ANSWERS_KEY not in ex:
            return {}
        p = repeat_penalty_of(ex[ANSWER_TURNS_KEY], ex[DISTINCT_ANSWERS_KEY], self.repeat_coef)
        return {"drift/repeat_penalty_mean": float(p.mean()) if len(p) else 0.0,
                "drift/answer_turns_mean": float(torch.as_tensor(ex[ANSWER_TURNS_KEY]).float().mean())}
