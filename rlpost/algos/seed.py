"""SEED: self-evolving on-policy distillation from the policy's own hindsight skills (``algo=seed``).

"SEED: Self-Evolving On-Policy Distillation for Agentic Reinforcement Learning"
(Wu, Yang, Lu, Zhang, Shen, Feng, Luo, Lian, Zhang, Wen, Tao; arXiv:2607.14777;
code https://github.com/jinyangwu/SEED). During RL the frozen policy ``pi_old``
both samples the trajectories and, as *analyzer*, reads each finished trajectory
and writes a natural-language hindsight skill ``s``. The sampled tokens are
re-scored under the ordinary context and under the skill-augmented one; with
``l_skill`` / ``l_theta`` their log-probs, the skill-induced shift
``Delta = sg[l_skill - l_theta]`` gates a distillation term

    L_opd = E[ m * sigma(beta * Delta) * (sg[l_skill] - l_theta) ],

whose gradient is a gate-weighted NLL of the sampled tokens: tokens the skill
makes likelier are pushed up harder. It is trained next to the outcome RL loss:
``L_SEED = L_rl + lambda_opd * L_opd`` (GRPO with PPO clip 0.2, KL 0.01,
``beta = 5``, ``lambda_opd = 0.01``, group size 8 in the paper's runs).

Here ``L_rl`` is :func:`rlpost.algos.losses.ppo_clip_loss` on the estimator's
advantages (``algo.adv_estimator``, GRPO in the preset), and the skill-context
log-probs ride on the batch as ``extras['teacher_logprobs']`` (the
skill-conditioned policy is SEED's self-teacher), written by the runner's
``algo_inputs`` stage through :func:`batch_skill_logprobs` for losses tagged
``needs_skill``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from rlpost.algos.losses import PolicyLossInput, ppo_clip_loss
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.utils import masked_mean
from rlpost.core.registry import param
from rlpost.rollout.hf import left_pad

#: the analyzer's instruction (our wording; the paper first fine-tunes its analyzer on skills an external model wrote)
ANALYZER_TEMPLATE = (
    "Here is a problem, an attempt at it and the verdict on the attempt.\n\n"
    "Problem: {question}\n\nAttempt: {response}\n\nVerdict: the attempt is {verdict}.\n\n"
    "Write one short, reusable rule (a workflow, a key observation or a mistake to avoid) "
    "that would help solve problems like this one. Reply with the rule only."
)
#: how a skill enters the context: a line in front of the rendered prompt (our choice of H(h, s), template-agnostic)
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


def skill_contexts(tokenizer: Any, prompts: Sequence[List[int]], skills: Sequence[str]) -> List[List[int]]:
    """Each row's skill-augmented context: :data:`SKILL_TEMPLATE` tokens, then the row's prompt (unchanged for an empty skill).

    Raises:
        ValueError: ``prompts`` and ``skills`` differ in length.
    """
    if len(prompts) != len(skills):
        raise ValueError(f"skill_contexts: {len(prompts)} prompts but {len(skills)} skills")
    return [(list(tokenizer.encode(SKILL_TEMPLATE.format(skill=s), add_special_tokens=False)) if s else []) + list(p)
            for p, s in zip(prompts, skills)]


def batch_skill_logprobs(batch: Any, questions: Sequence[str], engine: Any, logprobs: Any, tokenizer: Any,
                         sampling: Any, skill_tokens: int, threshold: float = 0.5) -> Tuple[torch.Tensor, List[str]]:
    """SEED's hindsight pass on a rollout batch: the policy writes a skill per response, then scores it in that context.

    Args:
        batch: a :class:`rlpost.core.batch.RolloutBatch` with ``rewards`` and ``response_texts``.
        questions: the task text of each row.
        engine: the rollout engine (the weights that sampled the batch: ``pi_old`` as analyzer).
        logprobs: ``batch -> ([B, R], ...)``, the trainer's no-grad pass (the kernel of the old log-probs).
        tokenizer: the policy's tokenizer.
        sampling: the step's :class:`rlpost.rollout.base.SamplingParams`; the analyzer samples
            with them and ``max_new_tokens = skill_tokens`` (sampling rather than greedy is our
            choice: greedy decoding of a weak policy repeats one token).
        skill_tokens: length budget of a skill.
        threshold: reward at or above which the verdict is ``correct``.
    Returns:
        ``(l_skill [B, R], skills)``: log-probs of the batch's response tokens with the
        skill in context (0 on padding), and the skill texts.
    """

    rows = []
    for b in range(len(batch)):
        verdict = "correct" if float(batch.rewards[b]) >= threshold else "incorrect"
        rows.append(analyzer_prompt_ids(tokenizer, questions[b], batch.response_texts[b], verdict))
    sp = dataclasses.replace(sampling, max_new_tokens=int(skill_tokens), temperature_hook=None)
    skills = [t.strip() for t in engine.generate(rows, sp).texts]
    prompts = [batch.prompt_ids[b][batch.prompt_mask[b] > 0].tolist() for b in range(len(batch))]
    pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else 0
    ids, mask = left_pad(skill_contexts(tokenizer, prompts, skills), pad)
    aug = dataclasses.replace(batch, prompt_ids=ids, prompt_mask=mask.to(batch.prompt_mask.dtype), extras={})
    lp = logprobs(aug)[0]
    return lp * batch.response_mask, skills


@dataclass(frozen=True)
class SeedLossParams:
    """SEED (arXiv:2607.14777): PPO clip next to the gated skill-distillation term; defaults are the paper's."""

    opd_coef: float = param(0.01, "lambda_opd, weight of the distillation term (paper: 0.01)")
    gate_beta: float = param(5.0, "beta_opd, sharpness of the gate sigmoid(beta * Delta) (paper: 5.0)")
    skill_tokens: int = param(48, "length budget of a hindsight skill the analyzer writes (ours; read by the algo_inputs stage)")
    eps_low: float = param(0.2, "PPO lower clip (paper: 0.2)")
    eps_high: float = param(0.2, "PPO upper clip (paper: 0.2)")
    dual_clip: Optional[float] = param(None, "dual-clip constant, or null (off)")


def _seed_example(logprobs: torch.Tensor, generator: torch.Generator) -> dict:
    """The skill-context log-probs (the self-teacher) near the plain ones (the seed method's stage in a run)."""
    t = logprobs + 0.3 * torch.randn(logprobs.shape, generator=generator)
    return {"extras": {"teacher_logprobs": t}, "batch_extras": {"teacher_logprobs": t}}


@POLICY_LOSSES.register(
    "seed",
    paper="SEED: Self-Evolving On-Policy Distillation for Agentic Reinforcement Learning (arXiv:2607.14777); "
    "code https://github.com/jinyangwu/SEED",
    params=SeedLossParams,
    needs_skill="skill_tokens", extras=("teacher_logprobs",), example_inputs=_seed_example)
def seed_loss(inp: PolicyLossInput, *, opd_coef: float, gate_beta: float, skill_tokens: int, eps_low: float,
              eps_high: float, dual_clip: Optional[float]) -> Tuple[torch.Tensor, dict]:
    """PPO-clip outcome loss plus SEED's gated on-policy distillation toward the skill-conditioned policy.

    Per token: ``L_t = L^clip_t + lambda * g_t * (l_skill_t - l_theta_t)`` with
    ``Delta_t = sg[l_skill_t - l_theta_t]`` and ``g_t = sigmoid(beta * Delta_t)``;
    ``l_theta = inp.logprobs`` (with grad), ``l_skill = inp.extras.get("teacher_logprobs")``
    (no grad). The gradient of the second term is ``-lambda * g_t * grad
    l_theta_t``: a gate-weighted NLL of the sampled token, strongest (``g -> 1``)
    where the skill raised the token's probability and fading (``g -> 0``) where it
    lowered it. The term's value is ``lambda * g * Delta`` (0 when the two
    contexts agree, then the gate is 1/2 and the gradient ``-lambda/2 * grad
    l_theta``).

    Where we simplify: ``l_skill`` is scored once per step by the pre-update
    policy (the paper re-scores with the trainable policy; identical on the
    first on-policy mini-batch, stale by the update's drift afterwards);
    ``Delta`` uses the current ``l_theta`` as the paper writes it.

    Args:
        inp: ``logprobs``, ``old_logprobs``, ``advantages``, ``response_mask``
            ``[B, R]`` and ``teacher_logprobs`` ``[B, R]`` (the skill-context log-probs).
        opd_coef, gate_beta: ``lambda_opd``, ``beta_opd``.
        skill_tokens: read by the runner's stage, not here.
        eps_low, eps_high, dual_clip: of :func:`rlpost.algos.losses.ppo_clip_loss`.
    Returns:
        ``(loss_mat [B, R], metrics)``; metrics of ``ppo_clip`` plus ``seed/gate_mean``,
        ``seed/skill_shift_mean`` (mean ``Delta``), ``seed/opd_term`` (token mean of
        ``g * Delta``).
    Raises:
        ValueError: ``inp.extras["teacher_logprobs"]`` is missing (the ``algo_inputs`` stage
            writes it for losses tagged ``needs_skill``).
    """
    if inp.extras.get("teacher_logprobs") is None:
        raise ValueError("seed needs the skill-context log-probs (batch.extras['teacher_logprobs']); the runner's "
                         "algo_inputs stage writes them for losses tagged needs_skill")
    loss, metrics = ppo_clip_loss(inp, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    m = inp.response_mask
    l_skill = inp.extras.get("teacher_logprobs").to(inp.logprobs.device, inp.logprobs.dtype).detach()
    delta = (l_skill - inp.logprobs).detach()
    gate = torch.sigmoid(gate_beta * delta)
    opd = gate * (l_skill - inp.logprobs) * m
    with torch.no_grad():
        metrics.update({"seed/gate_mean": masked_mean(gate, m), "seed/skill_shift_mean": masked_mean(delta, m),
                        "seed/opd_term": masked_mean(opd.detach(), m)})
    return loss + opd_coef * opd, metrics
