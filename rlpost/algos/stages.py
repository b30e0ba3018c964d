"""Per-step preparation that some algorithm presets need beyond rollouts and rewards.

The estimators and losses are pure tensor functions; a few methods need the
runner to gather one more input first. This module holds that glue so the
runner only calls :func:`prepare_algo_inputs` (after rewards, before
advantages) and reads the flags of :func:`algo_requirements`:

* per-token entropy of the rollout tokens for estimators tagged
  ``needs_entropy`` (MSSR's entropy shaping);
* a greedy rollout per prompt whose reward is the baseline for estimators
  tagged ``needs_baseline_rollout`` (ReMax, arXiv:2310.10505);
* a per-prompt Beta-posterior baseline for single-rollout MSSR;
* reference answers in place of the sampled responses for losses tagged
  ``needs_reference_responses`` (SFT);
* HAPO's adaptive temperature hook (``algo.loss_params.temperature_tau > 0``),
  built from the entropy statistics of the previous step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from rlpost.algos.hapo import EntropyStats, entropy_hhat, make_temperature_hook
from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
from rlpost.algos.shaping import BetaBaselineTracker


@dataclass
class AlgoRequirements:
    """What an ``algo`` config needs from the runner each step.

    Attributes:
        entropy: rollout-token entropy ``[B, R]`` for the estimator.
        baseline_rollout: a greedy rollout per prompt (ReMax).
        beta_baseline: a per-prompt Beta-posterior baseline (MSSR).
        reference_responses: train on reference answers instead of samples (SFT).
        temperature_tau: HAPO's adaptive-temperature range (0 = off).
    """

    entropy: bool = False
    baseline_rollout: bool = False
    beta_baseline: bool = False
    reference_responses: bool = False
    temperature_tau: float = 0.0


def algo_requirements(algo_cfg: Any) -> AlgoRequirements:
    """Read the registry tags of ``algo.adv_estimator`` / ``algo.loss`` and HAPO's ``temperature_tau``."""
    adv, loss = algo_cfg.adv_estimator, algo_cfg.loss
    from rlpost.algos.validate import loss_kwargs

    lp = loss_kwargs(algo_cfg)  # the loss's declared defaults (hapo: tau 0.05) + overrides
    tau = float(lp.get("temperature_tau", 0.0) or 0.0)
    return AlgoRequirements(
        entropy=bool(ADV_ESTIMATORS.tag(adv, "needs_entropy", False)) or tau > 0,
        baseline_rollout=bool(ADV_ESTIMATORS.tag(adv, "needs_baseline_rollout", False)),
        beta_baseline=adv == "mssr",
        reference_responses=bool(POLICY_LOSSES.tag(loss, "needs_reference_responses", False)),
        temperature_tau=tau,
    )


class AlgoState:
    """Cross-step state of the algorithm glue: MSSR's Beta tracker and HAPO's entropy statistics."""

    def __init__(self, req: AlgoRequirements) -> None:
        self.req = req
        self.tracker: Optional[BetaBaselineTracker] = BetaBaselineTracker() if req.beta_baseline else None
        self.entropy_stats: Optional[EntropyStats] = None

    def temperature_hook(self, base_temperature: float) -> Optional[Callable]:
        """HAPO's hook for the next rollout (None when HAPO sampling is off)."""
        if self.req.temperature_tau <= 0:
            return None
        return make_temperature_hook(base_temperature, self.entropy_stats, self.req.temperature_tau)

    def state_dict(self) -> Dict[str, Any]:
        """Serializable state for checkpoints (saved by :meth:`rlpost.runner.Run.checkpoint`).

        ``{"tracker": BetaBaselineTracker.state_dict() or None, "entropy_stats":
        the EntropyStats fields as a dict or None}`` (copies, not live objects).
        """
        return {
            "tracker": None if self.tracker is None else self.tracker.state_dict(),
            "entropy_stats": None if self.entropy_stats is None else asdict(self.entropy_stats),
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        if self.tracker is not None and sd.get("tracker"):
            self.tracker.load_state_dict(sd["tracker"])
        if sd.get("entropy_stats"):
            self.entropy_stats = EntropyStats(**sd["entropy_stats"])


def reference_response(answer: Any, answer_format: str) -> str:
    """The reference completion an SFT step trains on, in the task's answer format.

    ``tags`` -> ``<answer>A</answer>``, ``boxed`` -> ``\\boxed{A}``, otherwise ``A``.
    """
    a = str(answer)
    if answer_format == "tags":
        return f"<answer>{a}</answer>"
    if answer_format == "boxed":
        return f"\\boxed{{{a}}}"
    return a


def reference_tensors(texts: List[str], tokenizer: Any, max_len: int):
    """Tokenise reference completions (+ EOS) into right-padded ``(ids [B, R], mask [B, R])``."""
    eos = tokenizer.eos_token_id
    rows = []
    for t in texts:
        ids = list(tokenizer(t, add_special_tokens=False)["input_ids"])[: max(1, max_len - 1)]
        rows.append(ids + ([eos] if eos is not None else []))
    R = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    ids = torch.full((len(rows), R), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), R)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1.0
    return ids, mask


def prepare_algo_inputs(
    state: AlgoState,
    batch: Any,
    trainer: Any,
    *,
    greedy_rewards: Optional[Callable[[], torch.Tensor]] = None,
    tokenizer: Any = None,
    answer_format: str = "tags",
    max_len: int = 64,
) -> Dict[str, Any]:
    """Fill ``batch.extras`` with what the estimator needs; returns metrics.

    Args:
        state: the run's :class:`AlgoState`.
        batch: the step's :class:`rlpost.batch.RolloutBatch` with rewards.
        trainer: has ``compute_logprobs(batch, which='policy', with_entropy=True)``.
        greedy_rewards: callable returning ``[B]`` rewards of a greedy rollout of
            each row's prompt (ReMax), or None.
        tokenizer, answer_format, max_len: for SFT's reference answers.
    Effects:
        for SFT, replaces the batch's responses by the reference answers
        (``batch.answers``) with rollout log-probs 0; sets
        ``batch.extras['entropy']`` and ``batch.extras['baseline_rewards']``;
        updates the MSSR tracker and HAPO's entropy statistics for the next step.
    Raises:
        ValueError: a needed input (greedy rollout, tokenizer) was not given.
    """
    req = state.req
    m: Dict[str, Any] = {}
    if req.reference_responses:
        if tokenizer is None:
            raise ValueError("SFT needs the tokenizer to encode reference answers")
        texts = [reference_response(a, answer_format) for a in batch.answers]
        ids, mask = reference_tensors(texts, tokenizer, max_len)
        batch.response_ids, batch.response_mask = ids, mask
        batch.rollout_logprobs = torch.zeros_like(mask)
        batch.response_texts = texts
        batch.extras = {k: v for k, v in batch.extras.items() if v.dim() == 1}
        m["sft/reference_length_mean"] = float(mask.sum(-1).mean())
    if req.entropy:
        _, ent = trainer.compute_logprobs(batch, with_entropy=True)
        batch.extras["entropy"] = ent
        if req.temperature_tau > 0 and ent is not None:
            _, state.entropy_stats = entropy_hhat(ent, batch.response_mask)
    if req.baseline_rollout:
        if greedy_rewards is None:
            raise ValueError("this estimator needs a greedy baseline rollout but the runner gave none")
        b = greedy_rewards().float()
        batch.extras["baseline_rewards"] = b
        m["adv/baseline_reward_mean"] = float(b.mean())
    if state.tracker is not None:
        pidx = [int(i) for i in batch.prompt_index]
        batch.extras["baseline_rewards"] = state.tracker.baseline(pidx)
        state.tracker.update(pidx, [float(r) for r in batch.rewards])
        m["adv/beta_baseline_mean"] = float(batch.extras["baseline_rewards"].mean())
    return m
