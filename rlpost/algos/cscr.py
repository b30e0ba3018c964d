"""CSCR: GRPO with less credit on the tokens that privileged outcome contexts move most.

Counterfactual Sensitivity Credit Reallocation (CSCR; the paper's title and
arXiv id were not found here: only its abstract was readable). Its diagnosis:
re-scoring a fixed response under two opposite privileged contexts, one
asserting the answer is correct and one asserting it is wrong, moves most
tokens' log-probs the same way under both, and the largest moves fall on easily
substituted surface tokens. The magnitude of the shift measures counterfactual
sensitivity, not learning value. CSCR therefore extends GRPO: tokens with high
sensitivity get less of the response's credit, and the token advantages are
renormalised so that each response's total credit and its verifier-given sign
are unchanged.

The parts here: :func:`privileged_batch` (the response under a prompt with a
context sentence prepended), :func:`privileged_shifts` (the runner's two extra
teacher-forced passes, tag ``needs_privileged_shifts``) and the ``cscr``
estimator. The context sentences, the sensitivity measure (mean absolute shift
under the two contexts) and the down-weighting function are our choices, stated
in :class:`CSCRParams` and :func:`cscr_advantage`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.utils import group_all_equal, group_stats
from rlpost.core.registry import param

_CSCR_PAPER = ("Counterfactual Sensitivity Credit Reallocation (CSCR), an extension of GRPO "
               "(title and arXiv id not found; implemented from the abstract)")

#: the two privileged contexts (our wording; the abstract says only "asserting correctness / incorrectness")
CONTEXT_CORRECT = "Note: the answer below is correct.\n"
CONTEXT_WRONG = "Note: the answer below is wrong.\n"


@dataclass(frozen=True)
class CSCRParams:
    """CSCR on GRPO's z-scored advantage; the abstract gives no formula or constant, so all are our choices."""

    downweight_strength: float = param(0.5, "beta in u_t = 1 / (1 + beta s_t / mean s): 0 is GRPO; the abstract: "
                                       "moderate works best, strong destabilises (our choice 0.5)")
    eps: float = param(1e-6, "added to the group std (GRPO reference code: 1e-6)")


def privileged_batch(batch: Any, context_ids: torch.Tensor) -> Any:
    """A copy of ``batch`` whose every prompt starts with ``context_ids`` (``[C]`` long); responses unchanged.

    The prompts are left-padded (:class:`rlpost.core.batch.RolloutBatch`); the
    context goes right before each prompt's first real token, so the chat
    template and the response stay aligned. Extras are dropped (the copy only
    feeds a log-prob pass).
    """
    B, P = batch.prompt_ids.shape
    C = int(context_ids.numel())
    ids = torch.full((B, P + C), int(batch.prompt_ids[0, 0]) if B else 0, dtype=batch.prompt_ids.dtype)
    mask = torch.zeros(B, P + C, dtype=batch.prompt_mask.dtype)
    for b in range(B):
        real = batch.prompt_ids[b][batch.prompt_mask[b] > 0]
        row = torch.cat([context_ids.to(real.dtype), real])
        ids[b, P + C - len(row):] = row
        mask[b, P + C - len(row):] = 1
    return replace(batch, prompt_ids=ids, prompt_mask=mask, extras={})


def privileged_shifts(batch: Any, logprobs: Any, tokenizer: Any) -> torch.Tensor:
    """``[B, R, 2]`` log-prob shifts ``log pi(y_t | c, x) - log pi(y_t | x)`` of each response token under the
    correct-answer and wrong-answer contexts (:data:`CONTEXT_CORRECT`, :data:`CONTEXT_WRONG`); 0 outside the mask.

    Three no-grad teacher-forced passes of the current policy
    (``logprobs(batch) -> ([B, R], ...)``, the trainer's no-grad pass): the plain prompt and the two privileged ones.
    """
    base = logprobs(batch)[0]
    out = []
    for text in (CONTEXT_CORRECT, CONTEXT_WRONG):
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        out.append(logprobs(privileged_batch(batch, ids))[0] - base)
    return torch.stack(out, -1) * batch.response_mask[..., None]


def sensitivity_weights(shifts: torch.Tensor, mask: torch.Tensor, beta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(u [B, R], s [B, R])``: renormalised credit shares and sensitivities, float64.

    ``s_t = (|d+_t| + |d-_t|) / 2`` (mean absolute shift under the two
    contexts); ``u_t = 1 / (1 + beta s_t / mean_row(s))`` renormalised to mean 1
    over the row's tokens, so ``sum_t u_t = L`` (the row's credit budget). A row
    whose sensitivities are all 0 keeps ``u = 1``; 0 outside ``mask``.
    """
    m = mask.double()
    s = shifts.double().abs().mean(-1) * m
    L = m.sum(-1, keepdim=True).clamp(min=1.0)
    s_bar = s.sum(-1, keepdim=True) / L
    rel = torch.where(s_bar > 0, s / s_bar.clamp(min=1e-300), torch.zeros_like(s))
    u = m / (1.0 + beta * rel)
    u = u * L / u.sum(-1, keepdim=True).clamp(min=1e-300)
    return u * m, s


@ADV_ESTIMATORS.register("cscr", paper=_CSCR_PAPER, params=CSCRParams, needs_group=True, needs_privileged_shifts=True)
def cscr_advantage(inp: AdvantageInput, *, downweight_strength: float, eps: float) -> AdvantageOutput:
    """GRPO's ``A_i = (r_i - mean_g) / (std_g + eps)`` reallocated over tokens: ``A_it = A_i u_it``.

    ``u_it`` from :func:`sensitivity_weights` of ``inp.privileged_shifts``: a
    token twice as sensitive as its row's average gets ``1 / (1 + 2 beta)``
    before renormalisation. Since ``u > 0`` and ``sum_t u_it = L_i``, each token
    keeps the sign of ``A_i`` and the row's summed credit ``L_i A_i`` is
    unchanged (the abstract's "preserve the original credit budget and
    verifier-determined direction"). ``downweight_strength = 0`` is GRPO.
    Zero-variance groups get 0.

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]``,
            privileged_shifts ``[B, R, 2]`` (the runner's :func:`privileged_shifts`).
    Returns:
        AdvantageOutput with ``advantages [B, R]`` float32.
    Raises:
        ValueError: ``privileged_shifts`` missing, or ``downweight_strength < 0``.
    """
    if downweight_strength < 0:
        raise ValueError(f"cscr: downweight_strength must be >= 0, got {downweight_strength}")
    if inp.privileged_shifts is None:
        raise ValueError("cscr needs AdvantageInput.privileged_shifts (the runner computes them for estimators "
                         "tagged needs_privileged_shifts)")
    r = inp.rewards.double()
    mean, std, _ = group_stats(r, inp.group_index)
    A = torch.where(group_all_equal(r, inp.group_index), torch.zeros_like(r), (r - mean) / (std + eps))
    u, _ = sensitivity_weights(inp.privileged_shifts, inp.response_mask, downweight_strength)
    return AdvantageOutput(advantages=(A[:, None] * u).float())
