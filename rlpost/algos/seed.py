"""SEED: self-evolving on-policy distillation from hindsight skills (``algo=seed``).

"SEED: SElf-Evolving On-Policy Distillation" (Jinyang Wu et al.; code announced
at https://github.com/jinyangwu/SEED; no arXiv id or code could be read here, the
abstract is our source). The policy reads its own finished trajectories and writes
natural-language *hindsight skills* (reusable workflows, decisive observations,
failure-avoidance rules). Each sampled response is then scored twice by the
policy, with the ordinary context and with the skill added; the per-token
log-prob shift is a dense on-policy distillation signal, optimised jointly with
the outcome-reward RL loss.

Here the joint objective is an advantage sum, the form the authors' follow-up
OPID ("OPID: On-Policy Skill Distillation for Agentic Reinforcement Learning",
Yang, Wu et al., arXiv:2606.26790) states: the token-level skill advantage is
added to the group-relative outcome advantage. With a policy-gradient loss
(``ppo_clip``) the gradient is the outcome term plus ``distill_coef`` times the
sampled-token distillation term toward the skill-conditioned policy (the
reverse-KL signal of on-policy distillation, with the skill-conditioned policy
as teacher).

The runner's ``algo_inputs`` stage (:func:`rlpost.algos.stages.prepare_algo_inputs`)
calls :func:`skill_shift` when the estimator is tagged ``needs_skill``: one sampled
analyzer generation per response with the rollout engine (the current weights),
then two no-grad scoring passes of the trainer's policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, grpo_advantage
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.registry import param

#: the analyzer's instruction (our wording; the paper fine-tunes its analyzer on its own template first)
ANALYZER_TEMPLATE = (
    "Here is a problem, an attempt at it and the verdict on the attempt.\n\n"
    "Problem: {question}\n\nAttempt: {response}\n\nVerdict: the attempt is {verdict}.\n\n"
    "Write one short, reusable rule (a workflow, a key observation or a mistake to avoid) "
    "that would help solve problems like this one. Reply with the rule only."
)
#: how a skill enters the context: a line in front of the rendered prompt (our choice, template-agnostic)
SKILL_TEMPLATE = "Skill from earlier attempts: {skill}\n"


def analyzer_prompt_ids(tokenizer: Any, question: str, response: str, verdict: str) -> List[int]:
    """Token ids of the analyzer prompt for one finished trajectory (chat-templated when the tokenizer has one).

    Args:
        tokenizer: the policy's tokenizer.
        question: the task text the policy answered.
        response: the policy's full response text.
        verdict: ``"correct"`` or ``"incorrect"``.
    """
    text = ANALYZER_TEMPLATE.format(question=question, response=response, verdict=verdict)
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids)
    return list(tokenizer(text + "\n")["input_ids"])


def skill_shift(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[List[int]], responses: Sequence[List[int]],
                skills: Sequence[str], pad_id: int = 0) -> torch.Tensor:
    """``[B, R]`` per-token shift ``log pi(y_t | s, x, y_<t) - log pi(y_t | x, y_<t)`` (nats; 0 on padding).

    ``s`` = :data:`SKILL_TEMPLATE` with ``skills[b]``, tokenised and put in front
    of the row's context ``prompts[b]``; both passes by
    :func:`rlpost.samplers.hdl.context_logprobs` (same kernel, temperature 1), so
    an empty skill gives exactly 0. ``R`` = the longest response.

    Raises:
        ValueError: lengths of ``prompts``, ``responses``, ``skills`` differ.
    """
    from rlpost.samplers.hdl import context_logprobs

    if not len(prompts) == len(responses) == len(skills):
        raise ValueError(f"skill_shift: {len(prompts)} prompts, {len(responses)} responses, {len(skills)} skills")
    aug = [(list(tokenizer.encode(SKILL_TEMPLATE.format(skill=s), add_special_tokens=False)) if s else []) + list(p)
           for p, s in zip(prompts, skills)]
    lp0 = context_logprobs(model, prompts, responses, pad_id)
    lp1 = context_logprobs(model, aug, responses, pad_id)
    R = max([len(r) for r in responses] + [0])
    out = torch.zeros(len(responses), R)
    for b, r in enumerate(responses):
        out[b, : len(r)] = lp1[b] - lp0[b]
    return out


def batch_skill_shift(batch: Any, questions: Sequence[str], engine: Any, model: torch.nn.Module, tokenizer: Any,
                      sampling: Any, skill_tokens: int, threshold: float = 0.5) -> Tuple[torch.Tensor, List[str]]:
    """SEED's two steps on a rollout batch: write a hindsight skill per response, then :func:`skill_shift`.

    Args:
        batch: a :class:`rlpost.batch.RolloutBatch` with ``rewards`` and ``response_texts``.
        questions: the task text of each row.
        engine: the rollout engine (current weights): the policy as analyzer.
        model: the trainer's policy module (scores the two contexts).
        tokenizer: the policy's tokenizer.
        sampling: :class:`rlpost.rollout.base.SamplingParams` of the step; the
            analyzer samples with them (same temperature / top-p / seed) and
            ``max_new_tokens = skill_tokens`` (sampling rather than greedy is our
            choice: greedy decoding of a weak policy repeats one token).
        skill_tokens: length budget of a skill.
        threshold: reward at or above which the verdict is ``correct``.
    Returns:
        ``(shift [B, R] aligned with batch.response_ids, skills)``.
    """
    import dataclasses

    rows = []
    for b in range(len(batch)):
        verdict = "correct" if float(batch.rewards[b]) >= threshold else "incorrect"
        rows.append(analyzer_prompt_ids(tokenizer, questions[b], batch.response_texts[b], verdict))
    sp = dataclasses.replace(sampling, max_new_tokens=int(skill_tokens), temperature_hook=None)
    skills = [t.strip() for t in engine.generate(rows, sp).texts]
    prompts = [batch.prompt_ids[b][batch.prompt_mask[b] > 0].tolist() for b in range(len(batch))]
    responses = [batch.response_ids[b][batch.response_mask[b] > 0].tolist() for b in range(len(batch))]
    pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else 0
    d = skill_shift(model, tokenizer, prompts, responses, skills, pad)
    out = torch.zeros(batch.response_ids.shape)
    for b in range(len(batch)):
        idx = (batch.response_mask[b] > 0).nonzero().flatten()
        out[b, idx] = d[b, : len(idx)]
    return out, skills


@dataclass(frozen=True)
class SeedParams:
    """SEED's skill-shift distillation next to GRPO's outcome advantage."""

    distill_coef: float = param(1.0, "weight of the per-token skill shift added to the outcome advantage (the paper's knob; value not given, ours)")
    skill_tokens: int = param(48, "length budget (tokens) of a hindsight skill the analyzer writes (our choice)")
    norm_by_std: bool = param(True, "divide the outcome advantage by the group std (GRPO)")
    eps: float = param(1e-6, "added to the group std")


@ADV_ESTIMATORS.register(
    "seed",
    paper="SEED: SElf-Evolving On-Policy Distillation (code https://github.com/jinyangwu/SEED); joint form as in "
    "OPID: On-Policy Skill Distillation for Agentic Reinforcement Learning (arXiv:2606.26790)",
    params=SeedParams,
    needs_group=True,
    needs_skill=True,
)
def seed_advantage(inp: AdvantageInput, *, distill_coef: float, skill_tokens: int, norm_by_std: bool,
                   eps: float) -> AdvantageOutput:
    """Outcome advantage plus the hindsight-skill log-prob shift: ``A_t = A^GRPO_i + c * d_t``.

    ``A^GRPO_i`` is :func:`rlpost.algos.advantages.grpo_advantage` (group mean,
    Bessel std) broadcast over sequence ``i``; ``d_t = log pi_old(y_t | skill, x,
    y_<t) - log pi_old(y_t | x, y_<t)`` is ``inp.skill_shift`` (computed before the
    update, so no gradient flows through it); ``c`` = ``distill_coef``. A token the
    skill makes likelier is pushed up, one it makes less likely is pushed down,
    even in a group whose rewards are all equal (there ``A^GRPO`` is 0 and the
    update is pure distillation). ``skill_tokens`` is read by the runner's stage,
    not here.

    Shapes: ``skill_shift``, ``response_mask`` ``[B, R]``; ``rewards``,
    ``group_index`` ``[B]`` -> advantages ``[B, R]``, 0 outside the mask.

    Raises:
        ValueError: ``inp.skill_shift`` is missing (the runner's ``algo_inputs``
            stage fills it for estimators tagged ``needs_skill``) or its shape
            differs from the mask's.
    """
    if inp.skill_shift is None:
        raise ValueError("seed needs the skill log-prob shift (batch.extras['skill_shift']); the runner's algo_inputs "
                         "stage computes it for estimators tagged needs_skill")
    if inp.skill_shift.shape != inp.response_mask.shape:
        raise ValueError(f"seed: skill_shift {tuple(inp.skill_shift.shape)} vs response_mask "
                         f"{tuple(inp.response_mask.shape)}")
    base = grpo_advantage(inp, norm_by_std=norm_by_std, eps=eps, baseline="mean", unbiased_std=True).advantages
    m = inp.response_mask
    adv = base.double() + float(distill_coef) * inp.skill_shift.double() * m.double()
    return AdvantageOutput(advantages=(adv * m.double()).float())
