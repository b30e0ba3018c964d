"""GRPO-VPS's answer probes: the reference answer's probability after each step prefix.

"GRPO-VPS: Enhancing Group Relative Policy Optimization with Verifiable Process
Supervision for Effective Reasoning" (arXiv:2604.20659; :mod:`rlpost.algos.vps`).
One no-grad teacher-forced pass of the current policy over every row's
``K + 1`` probes (:func:`rlpost.algos.vps.answer_progress`); the estimator
tagged ``needs_answer_probes`` (``grpo_vps``) reads ``batch.extras['vps_progress']``
and ``['vps_segment']`` ``[B, R]``.

Rows without a step keep GRPO's advantage (counted, ``adv/vps_no_step_rows``);
if no row of a step has one, the segmentation rule does not fit the policy's
output and the run stops with the fix (the first time it happens, at the step
it happens: nothing trained is lost beyond that step's rollouts).
"""

from __future__ import annotations

from typing import Any, Dict

from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.validate import adv_overrides
from rlpost.algos.vps import answer_progress
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method, Needs, RunServices
from rlpost.tasks.steps import SEGMENTERS


@METHODS.register("grpo_vps", paper="GRPO-VPS (arXiv:2604.20659)")
class AnswerProbes(Method):
    """``batch.extras['vps_progress']`` / ``['vps_segment']`` from the answer probes at step boundaries.

    Raises:
        ConfigError: (``validate``) an unknown segmentation rule, a negative
            progress weight; (``prepare``) no row of the batch has a step.
    """

    name = "grpo_vps"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        adv = str(cfg.algo.adv_estimator)
        self.params = dict(ADV_ESTIMATORS.kwargs(adv, adv_overrides(cfg.algo), "algo.adv_params"))

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "needs_answer_probes", False))

    def validate(self) -> None:

        try:
            SEGMENTERS.entry(str(self.params["segment"]))
        except ConfigError as e:
            raise ConfigError(f"algo.adv_params.segment: {e}") from None
        if float(self.params["progress_weight"]) < 0:
            raise ConfigError(f"algo.adv_params.progress_weight={self.params['progress_weight']} must be >= 0 "
                              f"(0 is GRPO). Fix: a weight >= 0.")

    def needs(self) -> Needs:
        return Needs(provides=("vps_progress", "vps_segment"))

    def describe(self) -> str:
        return "reference-answer probes after each step prefix (GRPO-VPS)"

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:

        prog, seg, metrics = answer_progress(batch, run.logprobs, run.tokenizer, str(self.params["segment"]),
                                             str(self.params["answer_prefix"]))
        if len(batch) and metrics["adv/vps_no_step_rows"] == len(batch):
            raise ConfigError(
                f"grpo_vps: segmentation rule algo.adv_params.segment={self.params['segment']!r} found no steps in any "
                f"of the {len(batch)} responses of step {run.step} (e.g. {batch.response_texts[0][:60]!r}), so the "
                f"answer probes give no progress. Fix: algo.adv_params.segment=newline or sentence, or a prompt "
                f"(task.system_prompt) that asks for that step format.")
        batch.extras["vps_progress"], batch.extras["vps_segment"] = prog, seg
        return metrics
