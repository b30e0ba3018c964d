"""ReMax's baseline: the reward of a greedy rollout of each prompt.

"ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for
Aligning Large Language Models" (arXiv:2310.10505). Estimators tagged
``needs_baseline_rollout`` read ``batch.extras['baseline_rewards']`` ``[B]``.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.methods.base import METHODS, Method, Needs, RunServices


@METHODS.register("remax", paper="ReMax (arXiv:2310.10505)")
class GreedyBaseline(Method):
    """One greedy rollout per distinct prompt of the batch, scored by the task's reward function."""

    name = "remax"
    paper = "ReMax (arXiv:2310.10505)"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "needs_baseline_rollout", False))

    def needs(self) -> Needs:
        return Needs(provides=("baseline_rewards",))

    def describe(self) -> str:
        return "greedy baseline rollout"

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        uniq = sorted({int(i) for i in batch.prompt_index})
        sp = run.sampling_params(run.step)
        sp.greedy, sp.temperature_hook = True, None
        g = run.engine.generate([run.prompt_ids(i) for i in uniq], sp)
        r_g = run.reward(g.texts, [run.examples[i] for i in uniq], g.response_mask.sum(-1))
        pos = {p: k for k, p in enumerate(uniq)}
        b = torch.stack([r_g[pos[int(i)]] for i in batch.prompt_index]).float()
        batch.extras["baseline_rewards"] = b
        return {"adv/baseline_reward_mean": float(b.mean())}
