"""GRPO-VPS: GRPO's outcome advantage refined by answer-probability progress at step boundaries.

"GRPO-VPS: Enhancing Group Relative Policy Optimization with Verifiable Process
Supervision for Effective Reasoning" (arXiv:2604.20659). Each response is cut
into steps by the shared segmentation rule (:func:`rlpost.tasks.steps.segment_steps`).
After every step prefix the reference answer is appended and its conditional
probability under the current policy is measured by a teacher-forced, no-grad
pass; the change of that probability from one step to the next is the step's
progress. The progress refines GRPO's single trajectory-level advantage on the
tokens of each step. No Monte-Carlo rollouts and no reward model.

Only the abstract and summaries of the paper were readable here, and no code
was found. What the abstract fixes: steps, the probability of the correct
answer appended at each boundary, the segment-wise change as progress, a
refinement of GRPO's advantage. Our reading, stated in :class:`VPSParams` and
:func:`vps_advantage`:

* the probe is ``prefix + answer_prefix + answer``, scored on the answer tokens
  only, with their joint probability ``p = exp(sum log pi)``; ``p_0`` is the
  probe after no reasoning (the bare prompt), so step 1's progress is measured
  against the model's prior belief;
* progress ``d_k = p_k - p_{k-1}`` is z-scored over all steps of the group's
  responses (so it is on the scale of GRPO's z-scored advantage) and added,
  times ``progress_weight``, to GRPO's advantage on the step's tokens
  (from the token after the previous step's last token to the step's last token);
* tokens outside every step (text before the first ``Step k:`` marker, the
  whitespace and EOS after the last step) and responses without any step keep
  GRPO's advantage (counted: ``adv/vps_no_step_rows``).

The parts: :func:`step_token_ends` (steps -> response-token positions),
:func:`probe_batch` (the teacher-forced probes), :func:`answer_progress`
(the method's passes, ``batch.extras['vps_progress']`` ``[B, R]`` and
``vps_segment`` ``[B, R]``) and the ``grpo_vps`` estimator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.utils import group_all_equal, group_stats
from rlpost.core.batch import RolloutBatch
from rlpost.core.registry import param
from rlpost.tasks.steps import policy_step_positions, segment_steps

PAPER = ("GRPO-VPS: Enhancing Group Relative Policy Optimization with Verifiable Process Supervision "
         "for Effective Reasoning (arXiv:2604.20659)")


@dataclass(frozen=True)
class VPSParams:
    """GRPO-VPS's probe and refinement; the abstract gives no formula or constant, so these are our choices."""

    segment: str = param("newline", "step segmentation rule (rlpost list step_segment): newline | step_k | sentence")
    answer_prefix: str = param("\nThe answer is ", "text put between a step prefix and the reference answer in each "
                               "probe (our wording; its tokens are conditioned on, not scored)")
    progress_weight: float = param(1.0, "weight of the z-scored step progress added to GRPO's advantage (our choice 1)")
    eps: float = param(1e-6, "added to the group stds of the rewards and of the progress (GRPO reference code: 1e-6)")


def step_token_ends(tokenizer: Any, text: str, rule: str, n_tokens: int) -> List[int]:
    """Response-token index of each step's last token (strictly increasing, each ``< n_tokens``).

    Steps are the spans of :func:`rlpost.tasks.steps.segment_steps` under
    ``rule``; each span's end is mapped to the token holding its last character
    in the policy tokenizer's re-tokenization of ``text``
    (:func:`rlpost.tasks.steps.policy_step_positions`) and clamped to the
    response's ``n_tokens`` tokens. Steps that land on the same token as the
    step before are merged into it (a step ends once).

    Raises:
        ConfigError: unknown rule.
    """

    spans = segment_steps(text, rule)
    if not spans or n_tokens <= 0:
        return []
    out: List[int] = []
    for t in policy_step_positions(tokenizer, text, spans):
        t = min(int(t), n_tokens - 1)
        if not out or t > out[-1]:
            out.append(t)
    return out


def probe_batch(prompt_ids: Sequence[Sequence[int]], answer_ids: Sequence[Sequence[int]], pad_id: int = 0) -> Any:
    """A :class:`rlpost.core.batch.RolloutBatch` of probes: prompt ``prompt_ids[j]`` (left-padded), response ``answer_ids[j]``.

    The response mask covers the answer tokens only, so a log-prob pass gives
    ``log pi(answer | probe prompt)`` token by token.

    Raises:
        ValueError: no probes, or an empty answer.
    """

    if not prompt_ids:
        raise ValueError("probe_batch: no probes")
    if any(len(a) == 0 for a in answer_ids):
        raise ValueError("probe_batch: an answer with no tokens")
    N, P, A = len(prompt_ids), max(len(p) for p in prompt_ids), max(len(a) for a in answer_ids)
    pid = torch.full((N, P), int(pad_id), dtype=torch.long)
    pm = torch.zeros(N, P, dtype=torch.long)
    rid = torch.full((N, A), int(pad_id), dtype=torch.long)
    rm = torch.zeros(N, A)
    for j, (p, a) in enumerate(zip(prompt_ids, answer_ids)):
        pid[j, P - len(p):] = torch.tensor(list(p), dtype=torch.long)
        pm[j, P - len(p):] = 1
        rid[j, :len(a)] = torch.tensor(list(a), dtype=torch.long)
        rm[j, :len(a)] = 1
    return RolloutBatch(prompt_ids=pid, prompt_mask=pm, response_ids=rid, response_mask=rm,
                        rollout_logprobs=torch.zeros(N, A), group_index=torch.zeros(N, dtype=torch.long),
                        prompt_index=torch.zeros(N, dtype=torch.long))


def answer_text(answer: Any) -> str:
    """The reference answer as the text appended to a probe.

    Raises:
        ValueError: no reference answer (None or empty): GRPO-VPS needs one per prompt.
    """
    if answer is None or (isinstance(answer, (list, tuple, dict)) and not answer):
        raise ValueError("grpo_vps probes the reference answer, but a training example has none (answer=None). "
                         "Fix: a task whose examples carry a gold answer (arithmetic, gsm8k, math), or another estimator.")
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    s = str(answer).strip()
    if not s:
        raise ValueError("grpo_vps probes the reference answer, but a training example's answer is empty. "
                         "Fix: a task whose examples carry a gold answer, or another estimator.")
    return s


def segment_progress(p: Sequence[float]) -> List[float]:
    """``d_k = p_k - p_{k-1}`` for ``k = 1..K`` from the probe probabilities ``p_0..p_K``."""
    return [float(p[k]) - float(p[k - 1]) for k in range(1, len(p))]


def answer_progress(batch: Any, logprobs: Callable[..., Tuple[torch.Tensor, Any]], tokenizer: Any, rule: str,
                    answer_prefix: str) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, float]]:
    """The probes' progress on every response token: ``(progress [B, R], segment [B, R], metrics)``.

    For row ``i`` with steps ending at response tokens ``e_1 < ... < e_K``
    (:func:`step_token_ends`), ``K + 1`` probes ``prompt_i + y_i[:e_k + 1] +
    answer_prefix`` -> ``answer_i`` (``k = 0``: no response token) are scored
    by ``logprobs`` (the trainer's no-grad pass of the current policy, at the
    rollout's sampling temperature) in one call. ``p_k = exp(sum of the answer
    tokens' log-probs)``; ``progress[i, t] = p_k - p_{k-1}`` on the tokens of
    step ``k`` (``e_{k-1} < t <= e_k``), and ``segment[i, t] = k`` there
    (1-based; 0 outside every step and outside the mask).

    Returns:
        progress float32 ``[B, R]``, segment long ``[B, R]``, and metrics
        (``adv/vps_steps_per_row``, ``adv/vps_no_step_rows``, ``adv/vps_p_final_mean``
        (the probe after the whole response), ``adv/vps_progress_mean``).
    Raises:
        ValueError: a row without a reference answer (:func:`answer_text`).
    """
    B, R = batch.response_ids.shape
    lead = list(tokenizer(answer_prefix, add_special_tokens=False)["input_ids"]) if answer_prefix else []
    lengths = batch.response_mask.sum(-1).long().tolist()
    prompts: List[List[int]] = []
    answers: List[List[int]] = []
    owner: List[Tuple[int, List[int]]] = []
    for i in range(B):
        n = int(lengths[i])
        ends = step_token_ends(tokenizer, batch.response_texts[i], rule, n) if n else []
        owner.append((len(prompts), ends))
        if not ends:
            continue
        ans = list(tokenizer(answer_text(batch.answers[i]), add_special_tokens=False)["input_ids"])
        real = batch.prompt_ids[i][batch.prompt_mask[i] > 0].tolist()
        resp = batch.response_ids[i].tolist()
        for k in range(len(ends) + 1):
            prefix = resp[:ends[k - 1] + 1] if k else []
            prompts.append(real + prefix + lead)
            answers.append(ans)
    progress = torch.zeros(B, R)
    segment = torch.zeros(B, R, dtype=torch.long)
    no_step = sum(1 for _, e in owner if not e)
    if not prompts:
        return progress, segment, {"adv/vps_steps_per_row": 0.0, "adv/vps_no_step_rows": float(no_step),
                                   "adv/vps_p_final_mean": 0.0, "adv/vps_progress_mean": 0.0}
    pb = probe_batch(prompts, answers, int(batch.prompt_ids[0, 0]))
    lp = logprobs(pb)[0]
    p = torch.exp((lp.double() * pb.response_mask.double()).sum(-1)).tolist()
    finals, deltas = [], []
    for i, (start, ends) in enumerate(owner):
        if not ends:
            continue
        d = segment_progress(p[start:start + len(ends) + 1])
        finals.append(p[start + len(ends)])
        deltas.extend(d)
        prev = -1
        for k, (e, dk) in enumerate(zip(ends, d), start=1):
            progress[i, prev + 1:e + 1] = dk
            segment[i, prev + 1:e + 1] = k
            prev = e
    m = batch.response_mask > 0
    progress, segment = progress * m, segment * m
    rows = B - no_step
    return progress, segment, {"adv/vps_steps_per_row": len(deltas) / max(1, rows), "adv/vps_no_step_rows": float(no_step),
                               "adv/vps_p_final_mean": sum(finals) / max(1, len(finals)),
                               "adv/vps_progress_mean": sum(deltas) / max(1, len(deltas))}


def normalized_progress(progress: torch.Tensor, segment: torch.Tensor, group_index: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """``[B, R]`` float64 progress z-scored over the steps of each group: ``(d - mean_g) / (std_g + eps)``.

    Each step counts once (not once per token): the group's statistics are
    over the ``(row, step)`` pairs of its rows (Bessel-corrected std). A group
    with fewer than two steps, or whose steps' progress is all equal, gets 0;
    tokens outside every step (``segment == 0``) get 0.
    """
    B, R = progress.shape
    out = torch.zeros(B, R, dtype=torch.float64)
    by_group: Dict[int, List[Tuple[int, int, float]]] = {}
    for i in range(B):
        seg = segment[i]
        for k in sorted(set(int(x) for x in seg.tolist() if x > 0)):
            t = int((seg == k).nonzero()[0])
            by_group.setdefault(int(group_index[i]), []).append((i, k, float(progress[i, t])))
    for steps in by_group.values():
        v = torch.tensor([d for _, _, d in steps], dtype=torch.float64)
        if len(v) < 2 or bool((v == v[0]).all()):
            continue
        z = (v - v.mean()) / (v.std() + eps)
        for (i, k, _), zk in zip(steps, z.tolist()):
            out[i][segment[i] == k] = zk
    return out


def outcome_plus_steps(inp: AdvantageInput, name: str, keys: Tuple[str, str], provider: str,
                       weight: Tuple[str, float], eps: float, flat_groups_keep_steps: bool) -> AdvantageOutput:
    """``A_it = A_i + weight * z(s_ik(t))``: GRPO's z-scored outcome advantage (0 in a group whose rewards
    are all equal) plus the z-scored per-step signal ``step_signal`` ``[B, R]`` of :func:`normalized_progress`.

    Shared by GRPO-VPS (the signal is the answer-probability progress; a flat group gets exactly 0,
    steps included: ``flat_groups_keep_steps=False``) and OPRL (the implicit PRM's step rewards, which
    still credit steps when the outcomes tie: ``True``). ``keys`` name the step signal ``[B, R]`` and the
    step index ``[B, R]`` (0: no step) in ``inp.extras``, which ``provider`` (the estimator's method) fills;
    ``weight`` is ``(parameter name, value)`` of the step term's weight.
    Returns ``[B, R]`` float32, 0 outside ``response_mask``.

    Raises:
        ValueError: ``weight < 0``, or the step inputs are missing.
    """
    weight_name, weight = weight
    if weight < 0:
        raise ValueError(f"{name}: {weight_name} must be >= 0, got {weight}")
    step_signal, segment = inp.extras.get(keys[0]), inp.extras.get(keys[1])
    if step_signal is None or segment is None:
        raise ValueError(f"{name} needs batch.extras['{keys[0]}'] and ['{keys[1]}'] ({provider})")
    r = inp.rewards.double()
    mean, std, _ = group_stats(r, inp.group_index)
    flat = group_all_equal(r, inp.group_index)
    A = torch.where(flat, torch.zeros_like(r), (r - mean) / (std + eps))
    z = normalized_progress(step_signal, segment, inp.group_index, eps) if weight else torch.zeros(step_signal.shape, dtype=torch.float64)
    m = inp.response_mask.double()
    if not flat_groups_keep_steps:
        m = m * (~flat).double()[:, None]
    return AdvantageOutput(advantages=((A[:, None] + weight * z) * m).float())


def _vps_example(logprobs: torch.Tensor, generator: torch.Generator) -> Dict[str, Any]:
    """A probe's progress per position and steps of two tokens (segments 1, 2, ...), what the method writes."""
    B, R = logprobs.shape
    return {"extras": {"vps_progress": torch.rand(B, R, generator=generator),
                       "vps_segment": (torch.arange(R) // 2 + 1).expand(B, R).clone()}}


@ADV_ESTIMATORS.register("grpo_vps", paper=PAPER, params=VPSParams, needs_group=True, needs_answer_probes=True,
                         example_inputs=_vps_example)
def vps_advantage(inp: AdvantageInput, *, segment: str, answer_prefix: str, progress_weight: float,
                  eps: float) -> AdvantageOutput:
    """``A_it = A_i + progress_weight * z(d_ik(t))``: GRPO's z-scored outcome advantage plus the step's progress.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` on every response token; a
    zero-variance group gets exactly 0 everywhere, progress included (the
    repository's group-baseline invariant: there is no outcome feedback to
    refine; our reading); ``z(d)`` from :func:`normalized_progress` of
    ``inp.extras['vps_progress']`` / ``['vps_segment']`` ``[B, R]`` (the
    method's probes, :func:`answer_progress`), 0 on tokens outside every step.
    ``progress_weight = 0`` is GRPO. ``segment`` and ``answer_prefix`` are read
    by the probe stage, not here. Shapes: ``[B]`` rewards -> ``[B, R]`` float32,
    0 outside ``response_mask``.

    Raises:
        ValueError: the probes are missing (the ``grpo_vps`` method computes them
            for estimators tagged ``needs_answer_probes``), or ``progress_weight < 0``.
    """
    return outcome_plus_steps(inp, "grpo_vps", ("vps_progress", "vps_segment"),
                              "the grpo_vps method's answer probes, run for estimators tagged needs_answer_probes",
                              ("progress_weight", progress_weight), eps, flat_groups_keep_steps=False)
