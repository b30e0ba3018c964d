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
* the cluster ids of the responses' extracted final answers for estimators
  tagged ``needs_answers`` (SEED-GRPO's semantic entropy);
* the subsentence index of every response token for losses tagged
  ``needs_segments`` (SSPO).

Per-token sampling temperature is not an algorithm concern: HAPO's adaptive
temperature is owned by ``sampler=adaptive_temperature``
(:class:`rlpost.samplers.temperature.AdaptiveTemperatureSampler`): ``algo=hapo``
composes with it (:data:`TEMPERATURE_SAMPLERS`, read by
:func:`rlpost.config.compose.compose_config`) and :func:`check_sampler` refuses
a conflicting sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

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
        answers: cluster the responses' extracted final answers (SEED-GRPO).
        segments: subsentence index of every response token (SSPO).
        reference_rewards: N > 0: rewards of N reference-policy samples of each
            row's prompt (A*-PO's V*; N is the estimator's ``num_value_samples``).
        skill: N > 0: the log-probs of every response token with a hindsight skill
            of at most N tokens in context (SEED; N is the loss's ``skill_tokens``).
        privileged_shifts: each response token's log-prob shift under two
            privileged prompt contexts (CSCR; :func:`rlpost.algos.cscr.privileged_shifts`).
        probe: the parameters of an estimator tagged ``needs_probe`` (POISE's online
            hidden-state probe, :class:`rlpost.algos.poise.PoiseProbe`), else None.
    """

    entropy: bool = False
    baseline_rollout: bool = False
    beta_baseline: bool = False
    reference_responses: bool = False
    answers: bool = False
    segments: bool = False
    reference_rewards: int = 0
    skill: int = 0
    privileged_shifts: bool = False
    probe: Optional[Dict[str, Any]] = None


def algo_requirements(algo_cfg: Any) -> AlgoRequirements:
    """Read the registry tags of ``algo.adv_estimator`` / ``algo.loss``."""
    adv, loss = algo_cfg.adv_estimator, algo_cfg.loss
    return AlgoRequirements(
        entropy=bool(ADV_ESTIMATORS.tag(adv, "needs_entropy", False)),
        baseline_rollout=bool(ADV_ESTIMATORS.tag(adv, "needs_baseline_rollout", False)),
        beta_baseline=adv == "mssr",
        reference_responses=bool(POLICY_LOSSES.tag(loss, "needs_reference_responses", False)),
        answers=bool(ADV_ESTIMATORS.tag(adv, "needs_answers", False)),
        segments=bool(POLICY_LOSSES.tag(loss, "needs_segments", False)),
        reference_rewards=_reference_samples(algo_cfg),
        skill=_skill_tokens(algo_cfg),
        privileged_shifts=bool(ADV_ESTIMATORS.tag(adv, "needs_privileged_shifts", False)),
        probe=_probe_params(algo_cfg),
    )


def _probe_params(algo_cfg: Any) -> Optional[Dict[str, Any]]:
    """The estimator's parameters when it is tagged ``needs_probe`` (POISE), else None."""
    adv = str(algo_cfg.adv_estimator)
    if not ADV_ESTIMATORS.tag(adv, "needs_probe", False):
        return None
    from rlpost.algos.validate import adv_overrides

    return dict(ADV_ESTIMATORS.kwargs(adv, adv_overrides(algo_cfg), "algo.adv_params"))


def _skill_tokens(algo_cfg: Any) -> int:
    """Skill length budget of a loss tagged ``needs_skill="<param>"`` (its parameter of that name), else 0."""
    key = POLICY_LOSSES.tag(str(algo_cfg.loss), "needs_skill", None)
    if not key:
        return 0
    from rlpost.algos.validate import loss_kwargs

    return max(1, int(loss_kwargs(algo_cfg)[key]))


def _reference_samples(algo_cfg: Any) -> int:
    """N of an estimator tagged ``needs_reference_rewards="<param>"`` (its parameter of that name), else 0."""
    key = ADV_ESTIMATORS.tag(str(algo_cfg.adv_estimator), "needs_reference_rewards", None)
    if not key:
        return 0
    from rlpost.algos.validate import adv_overrides

    return int(ADV_ESTIMATORS.kwargs(str(algo_cfg.adv_estimator), adv_overrides(algo_cfg), "algo.adv_params")[key])


#: losses whose paper samples with a per-token temperature, and the sampler that owns it
TEMPERATURE_SAMPLERS = {"hapo": "adaptive_temperature"}


def check_sampler(algo_cfg: Any, sampler_name: str) -> None:
    """Per-token temperature has one owner, the sampler: refuse conflicting settings.

    HAPO ("From Uniform to Heterogeneous: Tailoring Policy Optimization to Every
    Token's Nature", arXiv:2509.16591) samples with its Adaptive Temperature
    Sampling, which ``sampler=adaptive_temperature`` implements (its ``tau``
    is ``sampler.params.tau``). ``algo.loss=hapo`` with another sampler, or a
    temperature range given to the algorithm (``algo.loss_params.temperature_tau``,
    where it used to live), is a configuration error.

    Raises:
        rlpost.errors.ConfigError: either conflict, naming the fix.
    """
    from rlpost.errors import ConfigError

    lp = dict(algo_cfg.loss_params or {})
    if "temperature_tau" in lp:
        raise ConfigError(f"algo.loss_params.temperature_tau={lp['temperature_tau']}: the per-token temperature is "
                          f"owned by the sampler. Fix: sampler=adaptive_temperature "
                          f"sampler.params.tau={lp['temperature_tau']} (and drop algo.loss_params.temperature_tau).")
    want = TEMPERATURE_SAMPLERS.get(str(algo_cfg.loss))
    if want is not None and sampler_name != want:
        raise ConfigError(f"algo.loss={algo_cfg.loss} samples with per-token adaptive temperature, which "
                          f"sampler={want} owns; sampler={sampler_name} would drop it. Fix: add sampler={want}.")


class AlgoState:
    """Cross-step state of the algorithm glue: MSSR's Beta tracker, POISE's online probe."""

    def __init__(self, req: AlgoRequirements) -> None:
        self.req = req
        self.tracker: Optional[BetaBaselineTracker] = BetaBaselineTracker() if req.beta_baseline else None
        self.probe: Optional[Any] = None
        if req.probe is not None:
            from rlpost.algos.poise import PoiseProbe

            self.probe = PoiseProbe(req.probe)

    def state_dict(self) -> Dict[str, Any]:
        """Serializable state for checkpoints (saved by :meth:`rlpost.runner.Run.checkpoint`).

        ``{"tracker": BetaBaselineTracker.state_dict() or None}``, plus ``"probe"``
        (:meth:`rlpost.algos.poise.PoiseProbe.state_dict`) when POISE's probe exists.
        """
        sd: Dict[str, Any] = {"tracker": None if self.tracker is None else self.tracker.state_dict()}
        if self.probe is not None:
            sd["probe"] = self.probe.state_dict()
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (an old checkpoint's ``entropy_stats`` is ignored)."""
        if self.tracker is not None and sd.get("tracker"):
            self.tracker.load_state_dict(sd["tracker"])
        if self.probe is not None and sd.get("probe"):
            self.probe.load_state_dict(sd["probe"])


def normalise_answer(answer: Optional[str]) -> Optional[str]:
    """Canonical form of an extracted answer for clustering: numbers by value, text by its words, lower case.

    ``"12"``, ``"12.0"`` and ``" 12 "`` are one answer; None and ``""`` stay None.
    """
    if answer is None:
        return None
    a = " ".join(str(answer).strip().split()).lower().rstrip(".")
    if not a:
        return None
    try:
        v = float(a.replace(",", ""))
        return repr(int(v)) if v.is_integer() else repr(v)
    except ValueError:
        return a


def answer_cluster_ids(texts: List[str], answer_format: str) -> torch.Tensor:
    """``[B]`` long cluster ids of the responses' final answers (SEED-GRPO's semantic clusters).

    Answers are extracted by the task's ``answer_format``
    (:func:`rlpost.tasks.answer_tags.extract_answer`) and compared after
    :func:`normalise_answer`; a response with no extractable answer is a
    cluster of its own (negative id). Ids are only compared within a group.
    """
    from rlpost.tasks.answer_tags import extract_answer

    ids: Dict[str, int] = {}
    out = []
    for i, t in enumerate(texts):
        a = normalise_answer(extract_answer(t, answer_format))
        out.append(-(i + 1) if a is None else ids.setdefault(a, len(ids)))
    return torch.tensor(out, dtype=torch.long)


#: characters that end a subsentence (SSPO): the token containing one is the subsentence's last
SUBSENTENCE_END = (",", ".", ";", ":", "!", "?", "\n")


def subsentence_ids(response_ids: torch.Tensor, mask: torch.Tensor, tokenizer: Any) -> torch.Tensor:
    """``[B, R]`` long subsentence index of each response token (SSPO, arXiv:2511.04256).

    A subsentence ends after a token whose text contains one of
    :data:`SUBSENTENCE_END` (our choice of delimiters; the paper splits on
    punctuation); indices count from 0 in each row, and only positions in
    ``mask`` advance them.
    """
    B, R = response_ids.shape
    ends: Dict[int, bool] = {}
    out = torch.zeros(B, R, dtype=torch.long)
    for b in range(B):
        k = 0
        for t in range(R):
            out[b, t] = k
            if mask[b, t] <= 0:
                continue
            tid = int(response_ids[b, t])
            if tid not in ends:
                txt = tokenizer.decode([tid])
                ends[tid] = any(c in txt for c in SUBSENTENCE_END)
            if ends[tid]:
                k += 1
    return out.clamp(max=max(R - 1, 0))


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
    reference_rewards: Optional[Callable[[int], torch.Tensor]] = None,
    skill_logprobs: Optional[Callable[[int], Any]] = None,
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
        reference_rewards: callable ``n -> [B, n]`` rewards of n reference-policy
            samples of each row's prompt (A*-PO), or None.
        skill_logprobs: callable ``n -> ([B, R] log-probs, skills)``: each response's
            log-probs with a hindsight skill of at most n tokens in context (SEED,
            :func:`rlpost.algos.seed.batch_skill_logprobs`), or None; written to
            ``batch.extras['teacher_logprobs']`` (the skill-conditioned self-teacher).
        tokenizer, answer_format, max_len: for SFT's reference answers.
    Effects:
        for SFT, replaces the batch's responses by the reference answers
        (``batch.answers``) with rollout log-probs 0; sets
        ``batch.extras['entropy']`` and ``batch.extras['baseline_rewards']``;
        updates the MSSR tracker.
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
    if req.answers:
        ids = answer_cluster_ids(list(batch.response_texts), answer_format)
        batch.extras["answer_ids"] = ids
        m["adv/answer_clusters_mean"] = float(len(set(ids.tolist())) / max(1, len(set(batch.group_index.tolist()))))
    if req.segments:
        if tokenizer is None:
            raise ValueError("SSPO needs the tokenizer to find subsentence boundaries")
        seg = subsentence_ids(batch.response_ids, batch.response_mask, tokenizer)
        batch.extras["segment_ids"] = seg
        m["sspo/subsentences_mean"] = float(((seg * batch.response_mask.long()).amax(-1) + 1).float().mean())
    if req.privileged_shifts:  # CSCR: three no-grad passes (plain, correct-asserted, wrong-asserted prompts)
        from rlpost.algos.cscr import privileged_shifts

        if tokenizer is None:
            raise ValueError("CSCR needs the tokenizer to write the privileged contexts")
        sh = privileged_shifts(batch, trainer, tokenizer)
        batch.extras["privileged_shifts"] = sh
        m["adv/privileged_shift_abs_mean"] = float(sh.abs().mean(-1).sum() / batch.response_mask.sum().clamp(min=1))
    if req.entropy:
        _, ent = trainer.compute_logprobs(batch, with_entropy=True)
        batch.extras["entropy"] = ent
    if req.baseline_rollout:
        if greedy_rewards is None:
            raise ValueError("this estimator needs a greedy baseline rollout but the runner gave none")
        b = greedy_rewards().float()
        batch.extras["baseline_rewards"] = b
        m["adv/baseline_reward_mean"] = float(b.mean())
    if req.reference_rewards:
        if reference_rewards is None:
            raise ValueError("this estimator needs reference-policy samples of each prompt but the runner gave none")
        rr = reference_rewards(req.reference_rewards).float()
        batch.extras["reference_rewards"] = rr
        m["adv/reference_reward_mean"] = float(rr.mean())
    if req.skill:
        if skill_logprobs is None:
            raise ValueError("this loss needs the skill-context log-probs (SEED) but the runner gave none")
        lp, skills = skill_logprobs(req.skill)
        batch.extras["teacher_logprobs"] = lp.float()
        m["seed/skill_chars_mean"] = float(sum(len(s) for s in skills) / max(1, len(skills)))
        m["seed/skill_empty_frac"] = float(sum(1 for s in skills if not s) / max(1, len(skills)))
    if state.probe is not None:  # POISE: pre-update predictions, then the probe's refit (rlpost.algos.poise)
        from rlpost.algos.poise import probe_step

        m.update(probe_step(state.probe, batch, trainer, float(req.probe["layer_frac"]),
                            int(req.probe["pool_tokens"])))
    if state.tracker is not None:
        pidx = [int(i) for i in batch.prompt_index]
        batch.extras["baseline_rewards"] = state.tracker.baseline(pidx)
        state.tracker.update(pidx, [float(r) for r in batch.rewards])
        m["adv/beta_baseline_mean"] = float(batch.extras["baseline_rewards"].mean())
    return m
