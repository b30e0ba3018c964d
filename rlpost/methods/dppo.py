"""DPPO's predictive direction: the pre-update policy's top-K support, recorded with the old log-probs.

``algo.loss=dppo`` with ``direction=predictive`` (:mod:`rlpost.algos.predictive_mask`)
compares the current and the anchor policy on a per-position token support:
the ``old_logprobs`` stage records the anchor's top-K ids and log-probs
(``extras['old_topk_ids']``, ``extras['old_topk_logprobs']`` ``[B, R, K]``),
and the update's forward returns the current policy's log-probs on them.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from rlpost.algos.predictive_mask import anchor_support
from rlpost.algos.validate import loss_kwargs
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, ForwardOut, ForwardPass, Method, Needs, RunServices
from rlpost.models.teacher import support_logprobs, support_pass


def _value(x: Any) -> str:
    return str(getattr(x, "value", x))


def predictive_topk(algo_cfg) -> int:
    """``K`` when ``algo`` is ``dppo`` with ``direction=predictive`` (the runner then records the anchor's top-K), else 0."""
    if str(getattr(algo_cfg, "loss", "")) != "dppo":
        return 0
    kw = loss_kwargs(algo_cfg)
    if str(getattr(kw["direction"], "value", kw["direction"])) != "predictive":
        return 0
    return int(kw["topk"])


@torch.no_grad()
def anchor_topk_record(fwd, batch, k: int):
    """``{'old_topk_ids', 'old_topk_logprobs'}`` ``[B, R, K]``: the pre-update policy's support for the predictive mask.

    One no-grad pass of the trainer's policy (:func:`rlpost.models.teacher.support_logprobs`
    with ``k_top = K``, untruncated log-probs at the trainer's temperature), then
    :func:`anchor_support` puts the sampled token in slot 0 with the policy's own
    (untruncated) log-prob of it.

    Raises:
        ValueError: ``k < 2``.
    """
    if k < 2:
        raise ValueError(f"dppo direction=predictive: topk must be >= 2 (the sampled token and one other), got {k}")
    attn = batch.extras.get("response_attn", (batch.response_mask > 0).long())
    dev = fwd.device
    with fwd.autocast():  # the sampled token's log-prob comes back untruncated (no top_k / top_p passed)
        samp_lp, _, top_lp, top_ids = support_logprobs(
            fwd.policy, batch.prompt_ids.to(dev), batch.prompt_mask.to(dev), batch.response_ids.to(dev),
            attn.to(dev), temperature=fwd.temperature(batch), k_top=k, chunk_size=fwd.chunk_size)
    ids, lps = anchor_support(batch.response_ids.to(dev), top_ids, top_lp.float(), samp_lp.float())
    return {"old_topk_ids": ids.cpu(), "old_topk_logprobs": lps.cpu()}


def region_support_pass(fwd, mb, with_entropy: bool, entropy_grad: bool):
    """The update's forward for the predictive direction: sampled log-probs and the current policy on the support.

    Args:
        fwd: the trainer's :class:`rlpost.methods.base.ForwardPass`.
        mb: micro-batch with ``extras['old_topk_ids']`` / ``extras['old_topk_logprobs']`` ``[b, R, K]``
            (:func:`anchor_topk_record`).
        with_entropy, entropy_grad: also return the entropy (gradient not supported).
    Returns:
        ``(logprobs [b, R], entropy or None, loss extras)``; the extras are
        ``region_support_logprobs`` (detached) and ``region_anchor_logprobs`` ``[b, R, K]``
        for :func:`rlpost.algos.losses.dppo_loss`.
    Raises:
        ConfigError: an entropy bonus with gradient (not differentiated on this path).
    """
    if entropy_grad:
        raise ConfigError("algo.entropy_coef != 0 with dppo direction=predictive: the entropy bonus's gradient is "
                          "not computed on this path. Fix: algo.entropy_coef=0.")
    lp, ent, sup = support_pass(fwd, mb, mb.extras["old_topk_ids"], with_entropy)
    dev, R = fwd.device, lp.shape[1]
    return lp, ent, {"region_support_logprobs": sup.detach().float(),
                     "region_anchor_logprobs": mb.extras["old_topk_logprobs"][:, :R].to(dev).float()}


@METHODS.register("dppo_predictive", paper="DPPO's predictive trust-region direction")
class PredictiveRegion(Method):
    """Record the anchor's top-K support; forward on it."""

    name = "dppo_predictive"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return str(cfg.algo.loss) == "dppo" and _value(loss_kwargs(cfg.algo)["direction"]) == "predictive"

    def validate(self) -> None:
        dk = loss_kwargs(self.cfg.algo)
        if _value(dk["anchor"]) != "old":
            raise ConfigError("algo.loss_params.direction=predictive needs algo.loss_params.anchor=old: the top-K "
                              "support is recorded from the pre-update policy (the rollout engines do not record "
                              "the behaviour policy's top-K). Fix: add anchor: old, or use direction=ratio.")
        if int(dk["topk"]) < 2:
            raise ConfigError(f"algo.loss_params.topk={dk['topk']} must be >= 2 (the sampled token and one other)")

    def needs(self) -> Needs:
        return Needs(old_logprobs=True, provides=("region_support_logprobs", "region_anchor_logprobs"))

    def after_old_logprobs(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        batch.extras.update(anchor_topk_record(run.forward_pass(), batch, predictive_topk(self.cfg.algo)))
        return {}

    def forward(self, fwd: ForwardPass, mb: Any, with_entropy: bool, entropy_grad: bool) -> Optional[ForwardOut]:
        if "old_topk_ids" not in mb.extras:
            return None
        return region_support_pass(fwd, mb, with_entropy, entropy_grad)
