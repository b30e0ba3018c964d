"""A*-PO's stage 1: rewards of N samples of the frozen reference policy per prompt (its V* estimate).

"Accelerating RL for LLM Reasoning with Optimal Advantage Regression"
(A*-PO, arXiv:2505.20686). The paper samples the reference policy offline over
the dataset; here each prompt is sampled on first use, scored once and cached
(the same distribution). Estimators tagged ``needs_reference_rewards="<param>"``
read ``batch.extras['reference_rewards']`` ``[B, N]``, N being that parameter.
The cache is per run (a resumed run samples again on first use).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.validate import adv_overrides
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method, Needs, RunServices


def reference_samples(algo_cfg: Any) -> int:
    """N of an estimator tagged ``needs_reference_rewards="<param>"`` (its parameter of that name), else 0."""
    key = ADV_ESTIMATORS.tag(str(algo_cfg.adv_estimator), "needs_reference_rewards", None)
    if not key:
        return 0
    return int(ADV_ESTIMATORS.kwargs(str(algo_cfg.adv_estimator), adv_overrides(algo_cfg), "algo.adv_params")[key])


@METHODS.register("a_star_po", paper="A*-PO (arXiv:2505.20686)")
class ReferenceRewards(Method):
    """Reference-policy samples per new prompt, scored once and cached."""

    name = "a_star_po"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.n = reference_samples(cfg.algo)
        self.cache: Dict[int, List[float]] = {}
        self.engine: Optional[Any] = None

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "needs_reference_rewards", None))

    def needs(self) -> Needs:
        return Needs(reference_policy=True, provides=("reference_rewards",))

    def describe(self) -> str:
        return f"{self.n} reference-policy samples per new prompt (V*)"

    def setup(self, run: RunServices) -> None:
        if run.reference_policy is None:
            raise ConfigError(f"adv_estimator={self.cfg.algo.adv_estimator} samples the frozen reference policy, which "
                              f"model.lora shares with the policy (no separate copy). Fix: model.lora.rank=0.")

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        n = self.n
        new = sorted({int(i) for i in batch.prompt_index} - set(self.cache))
        if new:
            if self.engine is None:
                self.engine = run.build_engine(run.reference_policy)
            sp = run.sampling_params(run.step)
            sp.temperature_hook = None
            rows = [i for i in new for _ in range(n)]
            g = self.engine.generate([run.prompt_ids(i) for i in rows], sp)
            r = run.reward(g.texts, [run.examples[i] for i in rows], g.response_mask.sum(-1))
            for k, i in enumerate(new):
                self.cache[i] = [float(x) for x in r[k * n:(k + 1) * n]]
        rr = torch.tensor([self.cache[int(i)] for i in batch.prompt_index], dtype=torch.float32)
        batch.extras["reference_rewards"] = rr
        return {"adv/reference_reward_mean": float(rr.mean())}
