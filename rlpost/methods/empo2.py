"""EMPO²'s update side: the off-policy rows' ratio denominator and the low-probability row mask.

"Exploratory Memory-Augmented LLM Agent via Hybrid On- and Off-Policy Optimization" (EMPO²,
arXiv:2602.23008); authors' code github.com/microsoft/agent-lightning (branch ``archive/agl``),
``contrib/agentlightning/contrib/algorithm/env_verl/trainer.py`` and ``core_empo2.py``.
:mod:`rlpost.samplers.empo2` samples the off-policy rows *with* memory and gives them their
memory-free prompt back. In the authors' trainer those rows' old log-probs are computed on the
prompt **with** the memory, while the update's log-probs are on the prompt **without** it, so the
PPO-clip ratio is ``pi_theta(y_t | s, no memory) / pi_old(y_t | s, memory)`` (clip 0.2 / 0.3, dual
clip 10: ``algo=empo2``). With ``A > 0`` this imitates the memory-guided token with the importance
weight; with ``A < 0`` and the ratio below ``1 - eps_low`` the clip removes the gradient.

Here the denominator of an off-policy row is its rollout log-probs: the engine's log-probs of the
sampled tokens under the same weights and the memory context (the authors recompute them with
the trainer; the two differ only by engine/trainer numerics, which the trainer's on-policy log-prob
test bounds at 1e-4 on ``rollout=hf``). Then, as the authors' ``low_prob_token_masking`` (applied to
every row after the advantages), a row whose smallest old log-prob over its loss mask is below
``sampler.params.low_prob_threshold`` (-5.0) loses its whole loss mask. Masking here runs before the
advantages; the outcome estimators' row advantages do not read the mask, so it acts the same.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import torch

from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method, Needs


def offpolicy_old_logprobs(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                           offpolicy: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` old log-probs with the off-policy rows' loss-mask tokens taken from ``rollout``.

    Args:
        old: ``[B, R]`` the trainer's pre-update log-probs on each row's (memory-free) prompt.
        rollout: ``[B, R]`` the engine's log-probs of the sampled tokens (memory context on off-policy rows).
        mask: ``[B, R]`` loss mask.
        offpolicy: ``[B]`` 1.0 on off-policy rows.
    """
    pick = (offpolicy.to(old.device) > 0).unsqueeze(1) & (mask.to(old.device) > 0)
    return torch.where(pick, rollout.to(old), old)


def low_prob_row_mask(old: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[B]`` bool: rows whose smallest old log-prob over the loss mask is ``< threshold`` (authors' masking).

    A row with an empty mask is never flagged.
    """
    big = torch.where(mask > 0, old, torch.full_like(old, float("inf")))
    return big.min(dim=1).values < float(threshold)


def _sampler_params(cfg: Any) -> Dict[str, Any]:
    from rlpost.core.registry import as_dict
    from rlpost.samplers.base import SAMPLERS

    return SAMPLERS.kwargs("empo2", as_dict(cfg.sampler.params), "sampler.params")


@METHODS.register("empo2", paper="EMPO² (arXiv:2602.23008)")
class EMPO2Update(Method):
    """Off-policy rows' ratio denominator and the low-probability row mask (module docstring).

    Applies with ``sampler=empo2``. Needs the old log-prob pass (the ratio's denominator of the
    on-policy rows; the off-policy rows' is replaced in :meth:`after_old_logprobs`).

    Raises:
        ConfigError: (``validate``) ``executor.partial_rollout=true`` (carried episodes would lose
            their memory plan).
    """

    name = "empo2"
    paper = "EMPO² (arXiv:2602.23008)"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return str(cfg.sampler.name) == "empo2"

    def validate(self) -> None:
        ex = self.cfg.get("executor", None)
        if ex is not None and bool(ex.get("partial_rollout", False)):
            raise ConfigError("sampler=empo2 samples whole episodes with this step's memory plan; partial rollouts "
                              "would carry them across steps. Fix: executor.partial_rollout=false.")

    def needs(self) -> Needs:
        return Needs(old_logprobs=True)

    def describe(self) -> Optional[str]:
        return "EMPO²: off-policy rows' old log-probs from the memory context; low-probability rows masked"

    def after_old_logprobs(self, batch: Any, run: Any) -> Dict[str, Any]:
        """Off-policy rows get the rollout log-probs as old log-probs; rows below the threshold lose their mask."""
        ex = batch.extras
        old, mask = ex["old_logprobs"], batch.response_mask
        out: Dict[str, Any] = {}
        off = ex.get("empo2_offpolicy")
        if off is not None and bool((off > 0).any()):
            rows = (off > 0).to(old.device)
            m = mask[rows] > 0
            gap = (old[rows] - batch.rollout_logprobs.to(old)[rows])[m]
            out["empo2/offpolicy_logratio_mean"] = float(gap.mean()) if gap.numel() else 0.0
            ex["old_logprobs"] = old = offpolicy_old_logprobs(old, batch.rollout_logprobs, mask, off)
        thr = _sampler_params(self.cfg)["low_prob_threshold"]
        if thr is not None:
            drop = low_prob_row_mask(old, mask, float(thr))
            if bool(drop.any()):
                batch.response_mask = mask * (~drop).to(mask.dtype).unsqueeze(1)
            out["empo2/low_prob_masked_frac"] = float(drop.float().mean())
            if drop.numel() and bool(drop.all()) and not getattr(self, "_warned_all_masked", False):
                self._warned_all_masked = True  # once a run: the metric above counts every later step
                logging.getLogger("rlpost").warning(
                    f"EMPO²: sampler.params.low_prob_threshold={thr} masked every row of step {getattr(run, 'step', '?')} "
                    f"(each has a token whose old log-prob is below it), so the step has no gradient. Fix: "
                    f"sampler.params.low_prob_threshold=null (the authors' ScienceWorld setting) or a lower threshold; "
                    f"empo2/low_prob_masked_frac shows the share each step.")
        return out
