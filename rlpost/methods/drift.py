"""DRIFT's decoupled rollouts: every step samples the frozen reference policy, never the trained one.

"DRIFT: Decoupled Rollouts and Importance-Weighted Fine-Tuning for Efficient Multi-Turn
Optimization" (arXiv:2605.31455). The paper samples a dataset of interaction trajectories from the
fixed reference policy once, offline, then fine-tunes on it with return weights. Inside the RL loop
the same distribution is drawn step by step: the run builds its rollout engine over the frozen
reference copy (``Needs.frozen_rollouts``) and never loads the trainer's weights into it, while
evaluation keeps an engine over the trained policy. Each prompt is thus answered by ``pi_ref``
whenever it is drawn (a fresh sample per visit instead of one stored dataset; the same
distribution). The estimator tagged ``needs_frozen_rollouts`` (``drift``,
:mod:`rlpost.algos.drift`) turns the rows' returns into weights.
"""

from __future__ import annotations

from typing import Any

from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method, Needs, RunServices


@METHODS.register("drift", paper="DRIFT (arXiv:2605.31455)")
class FrozenRollouts(Method):
    """Rollouts from the frozen reference policy (DRIFT's offline sampling, drawn per step).

    Raises:
        ConfigError: (``validate``) ``executor=async`` or ``launcher=ray``, whose producers load the
            trainer's weights into the rollout engine themselves; (``setup``) no separate reference
            copy (``model.lora``).
    """

    name = "drift"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "needs_frozen_rollouts", False))

    def validate(self) -> None:
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
