"""Supervised fine-tuning inside the RL loop: the step trains on the reference answers, not the samples.

A loss tagged ``needs_reference_responses`` (``sft``) gets the batch's responses
replaced by each example's reference answer in the task's answer format
(:func:`rlpost.algos.inputs.reference_response`), with rollout log-probs 0.
Those tokens were not sampled, so the trainer's log-probs ignore the sampler's
top-k / top-p (``Needs.untruncated``; docs/ALGORITHMS.md, "Sampling
distribution parity").
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from rlpost.algos.inputs import reference_response, reference_tensors
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.methods.base import METHODS, Method, Needs, RunServices


@METHODS.register("reference_responses", paper="supervised fine-tuning on reference answers")
class ReferenceResponses(Method):
    """Replace the sampled responses by the reference answers (before every other input)."""

    name = "reference_responses"
    order = 0

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(POLICY_LOSSES.tag(str(cfg.algo.loss), "needs_reference_responses", False))

    def needs(self) -> Needs:
        return Needs(untruncated=True)

    def describe(self) -> str:
        return "reference answers (SFT)"

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        texts = [reference_response(a, str(self.cfg.task.answer_format)) for a in batch.answers]
        ids, mask = reference_tensors(texts, run.tokenizer, int(self.cfg.rollout.max_new_tokens))
        batch.response_ids, batch.response_mask = ids, mask
        batch.rollout_logprobs = torch.zeros_like(mask)
        batch.response_texts = texts
        batch.extras = {k: v for k, v in batch.extras.items() if v.dim() == 1}
        return {"sft/reference_length_mean": float(mask.sum(-1).mean())}
