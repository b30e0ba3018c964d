"""LENS's transfer objective (CRPO): purified rollouts trained on the original prompt with calibrated ratios.

"Less Noise, More Voice: Reinforcement Learning for Reasoning via Instruction
Purification" (arXiv:2601.21244). ``sampler=lens`` (:mod:`rlpost.samplers.lens`)
puts rollouts sampled on a purified prompt ``x'`` into the group of the original
prompt ``x`` (their prompt ids are ``x``'s again) and marks each row's sample
weight ``w~`` (``extras['lens_weight']``) and purified rows
(``extras['lens_purified']``). Calibrated Rollout Policy Optimization, as the
paper's summaries quote it, optimises a PPO-clip objective (with the run's KL
term) whose ratio is

    rho(y; theta) = pi_theta(y | x) / (w~(y) pi_old(y | x_roll(y)))

with ``x_roll(y)`` the prompt ``y`` was sampled from. This method writes that
denominator into the trust region's anchor after the old log-prob pass
(:func:`calibrated_old_logprobs`): per token, ``log pi_old`` becomes the engine's
log-prob under ``x'`` for a purified row (the behaviour policy, which
``precision.correction=tis`` would otherwise weigh in) and ``log w~`` is added to
every row, so the run's clip loss (``algo.loss``, unchanged) computes
``exp(log pi_theta - log pi_old(.|x_roll) - log w~)``. Our reading: the ratio is
token-level, as the run's loss is (the summaries write it per sequence); rows of
groups LENS left alone have ``w~ = 1`` and keep the trainer's old log-probs.

The method also makes the trainer keep a frozen reference policy (the
interference scores compare the policy with it) and hands it to the sampler.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from rlpost.algos.validate import trainer_loss_params
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method, Needs, RunServices

PAPER = "Less Noise, More Voice: Reinforcement Learning for Reasoning via Instruction Purification (arXiv:2601.21244)"


def calibrated_old_logprobs(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, purified: torch.Tensor,
                            weight: torch.Tensor) -> torch.Tensor:
    """CRPO's anchor ``log(w~ pi_old(y_t | x_roll, y_<t))`` per token, ``[B, R]`` nats.

    Args:
        old_logprobs: ``[B, R]`` the trainer's ``log pi_old(y_t | x, y_<t)`` under the row's (original) prompt.
        rollout_logprobs: ``[B, R]`` the engine's log-probs of the sampled tokens under the prompt sampled from.
        purified: ``[B]`` 1.0 on rows sampled from a purified prompt (their anchor is ``rollout_logprobs``).
        weight: ``[B]`` ``w~ > 0`` of each row.
    Returns:
        ``where(purified, rollout_logprobs, old_logprobs) + log(w~)`` (float32 on ``old_logprobs``' device).
    Raises:
        ValueError: a weight is not positive or a shape does not match.
    """
    if old_logprobs.shape != rollout_logprobs.shape or purified.shape[0] != old_logprobs.shape[0] \
            or weight.shape[0] != old_logprobs.shape[0]:
        raise ValueError(f"shapes do not match: old {tuple(old_logprobs.shape)}, rollout "
                         f"{tuple(rollout_logprobs.shape)}, purified {tuple(purified.shape)}, weight {tuple(weight.shape)}")
    if bool((weight <= 0).any()):
        raise ValueError(f"CRPO weights must be > 0, got {weight.tolist()}")
    dev = old_logprobs.device
    p = purified.to(dev).bool()[:, None]
    base = torch.where(p, rollout_logprobs.to(dev).to(old_logprobs.dtype), old_logprobs)
    return base + torch.log(weight.to(dev).to(old_logprobs.dtype))[:, None]


@METHODS.register("lens", paper=PAPER)
class LENS(Method):
    """CRPO's calibrated anchor after the old log-probs; the frozen reference for ``sampler=lens``'s detector."""

    name = "lens"
    paper = PAPER

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return str(cfg.sampler.name) == "lens"

    def validate(self) -> None:
        if str(trainer_loss_params(self.cfg.algo).proximal) == "a3po":
            raise ConfigError("sampler=lens writes CRPO's ratio denominator into the old log-probs, which "
                              "algo.offpolicy.proximal=a3po never computes. Fix: algo.offpolicy.proximal=recompute.")
        lora = self.cfg.model.get("lora", None)
        if lora is not None and int(lora.get("rank", 0) or 0) > 0:
            raise ConfigError(f"sampler=lens scores prompt tokens against a frozen reference copy of the policy, which a "
                              f"LoRA run (model.lora.rank={lora.rank}) does not keep. Fix: model.lora.rank=0 (full "
                              f"fine-tuning), or another sampler.")
        corr = str(self.cfg.precision.get("correction", "none") or "none")
        if corr != "none":
            raise ConfigError(f"sampler=lens already anchors purified rows on the engine's log-probs (CRPO's "
                              f"pi_old(y|x_roll)); precision.correction={corr} would weigh the same mismatch in a "
                              f"second time. Fix: precision.correction=none.")

    def needs(self) -> Needs:
        return Needs(old_logprobs=True, reference_policy=True)

    def describe(self) -> Optional[str]:
        return "CRPO anchor: purified rows' old log-probs from the engine (purified prompt), + log w~ (lens_weight)"

    def after_old_logprobs(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        pur, w = batch.extras.get("lens_purified"), batch.extras.get("lens_weight")
        if pur is None or w is None:
            return {}
        old = batch.extras["old_logprobs"]
        batch.extras["old_logprobs"] = calibrated_old_logprobs(old, batch.rollout_logprobs, pur, w)
        return {"lens/purified_rows": float(pur.sum()), "lens/weight_mean": float(w.float().mean())}
