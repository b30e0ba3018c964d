"""ECHO's update inputs: the pre-update policy's token entropy and token confidence, recorded with the old log-probs.

"ECHO: Entropy-Confidence Hybrid Optimization for Test-Time Reinforcement Learning" (arXiv:2602.02150;
code https://github.com/user683/ECHO). The release computes both in the old-log-prob pass
(``dp_actor._forward_micro_batch(calculate_confidence=True)``): ``H_t`` over the whole vocabulary
and ``C_t`` = mean of the top-k probabilities, at the sampling temperature. This method runs one
no-grad pass of the trainer's policy after the ``old_logprobs`` stage and writes
``extras['echo_entropy']`` and ``extras['echo_confidence']`` ``[B, R]`` (0 on padding), which the
estimator ``echo`` (hybrid shaping) and the loss ``echo`` (adaptive clip) read.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from rlpost.algos.echo import CONFIDENCE_KEY, ENTROPY_KEY, EchoAdvParams, confidence_from_top_logprobs
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.validate import adv_overrides
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method, Needs, RunServices
from rlpost.models.teacher import support_logprobs


def confidence_top_k(algo_cfg: Any) -> int:
    """``k`` of ECHO's token confidence: ``algo.adv_params.confidence_top_k`` with ``adv_estimator=echo``, else its default."""
    if str(getattr(algo_cfg, "adv_estimator", "")) == "echo":
        return int(ADV_ESTIMATORS.kwargs("echo", adv_overrides(algo_cfg), "algo.adv_params")["confidence_top_k"])
    return int(EchoAdvParams().confidence_top_k)


@torch.no_grad()
def entropy_confidence_record(fwd, batch, k: int) -> Dict[str, torch.Tensor]:
    """``{'echo_entropy', 'echo_confidence'}`` ``[B, R]`` float32 on CPU, 0 on padding.

    One no-grad pass of ``fwd.policy`` (:func:`rlpost.models.teacher.support_logprobs` with
    ``k_top = k`` and the entropy, untruncated, at the trainer's temperature):
    ``H_t`` in nats, ``C_t = mean(exp(top-k log-probs))``.
    """
    attn = batch.extras.get("response_attn", (batch.response_mask > 0).long())
    dev = fwd.device
    with fwd.autocast():
        _, ent, top_lp, _ = support_logprobs(
            fwd.policy, batch.prompt_ids.to(dev), batch.prompt_mask.to(dev), batch.response_ids.to(dev),
            attn.to(dev), temperature=fwd.temperature(batch), k_top=k, chunk_size=fwd.chunk_size, with_entropy=True)
    m = (batch.response_mask > 0).float()
    conf = confidence_from_top_logprobs(top_lp.float()).float().cpu() * m
    return {ENTROPY_KEY: ent.float().cpu() * m, CONFIDENCE_KEY: conf}


@METHODS.register("echo", paper="ECHO: Entropy-Confidence Hybrid Optimization for Test-Time Reinforcement "
                  "Learning (arXiv:2602.02150)")
class EchoStatistics(Method):
    """Record ``H_t`` and ``C_t`` of the pre-update policy for ``adv_estimator=echo`` / ``loss=echo``."""

    name = "echo"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return str(cfg.algo.adv_estimator) == "echo" or str(cfg.algo.loss) == "echo"

    def validate(self) -> None:
        if confidence_top_k(self.cfg.algo) < 1:
            raise ConfigError(f"algo.adv_params.confidence_top_k={confidence_top_k(self.cfg.algo)} must be >= 1 "
                              "(ECHO's confidence is the mean of the top-k next-token probabilities; release: 5)")

    def needs(self) -> Needs:
        return Needs(old_logprobs=True, provides=(ENTROPY_KEY, CONFIDENCE_KEY))

    def after_old_logprobs(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        rec = entropy_confidence_record(run.forward_pass(), batch, confidence_top_k(self.cfg.algo))
        batch.extras.update(rec)
        m = (batch.response_mask > 0).float()
        n = m.sum().clamp(min=1.0)
        return {"echo/entropy_mean": float((rec[ENTROPY_KEY] * m).sum() / n),
                "echo/confidence_mean": float((rec[CONFIDENCE_KEY] * m).sum() / n)}
