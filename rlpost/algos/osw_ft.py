"""OSW-FT's success-rate weight and weighted SFT loss ("Online Self-Weighted Fine-Tuning", Wen, He, Peng
and Cheng, arXiv:2609.00734).

Plain SFT on each query's expert trajectory ``o*``, its loss scaled by the oracle trajectory's advantage
under the current policy (the paper's Eq. 5 and 9, Algorithm 1):

    w(q) = 1 - p_hat(q),    p_hat(q) = (1/K) sum_k R(o_k),    o_k ~ pi_theta(.|q),  R in {0, 1}
    L(theta) = - (1/|M|) sum_q w(q) log pi_theta(o* | q)

The ``K`` probe rollouts (the paper: ``K = 2`` at temperature 1) only estimate ``w``; no gradient flows
through them or through ``w`` (Remark 4: the weight is held fixed for the update). Here the probes are
the step's own rollouts: ``algo.n_samples_per_prompt = K`` responses per prompt, scored by the task's
verifier; :mod:`rlpost.methods.osw_ft` then swaps each row's response for the expert trajectory.

Our reading where the paper leaves a choice open:

- the token aggregation is ``algo=sft``'s (``token-mean`` over the batch), so OSW-FT and its SFT
  baseline differ only in the weight (Algorithm 1 writes the sequence log-likelihood; the paper calls
  it "the standard SFT loss" rescaled);
- ``R`` is the verifier's correctness component (``extras['reward_correct']``, the format bonus and
  length terms left out), which must lie in ``[0, 1]``;
- each of a prompt's ``K`` rows carries the same expert trajectory and weight; with equal group sizes
  the token-mean gradient equals that of one row per prompt.

``weight="hard"`` is the paper's hard-thresholded ablation (Table 3): ``w = 0`` when all ``K`` probes
succeed, else 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, _broadcast
from rlpost.algos.inputs import reference_response
from rlpost.algos.losses import Metrics, PolicyLossInput, _clip_metrics, _ratio
from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
from rlpost.algos.utils import group_stats, masked_mean
from rlpost.core.registry import Choice, param

_PAPER = "Online Self-Weighted Fine-Tuning (OSW-FT, arXiv:2609.00734)"

#: the correctness component of the reward (``RolloutBatch.extras``), OSW-FT's binary R
CORRECT_KEY = "reward_correct"


class Weighting(Choice):
    """``algo.adv_params.weight`` of ``osw_ft``."""

    linear = "linear"
    hard = "hard"


@dataclass(frozen=True)
class OSWFTParams:
    """OSW-FT's per-query weight from the probe rollouts' success rate (arXiv:2609.00734)."""

    weight: Weighting = param(Weighting.linear, "linear: w = 1 - p_hat (OSW-FT, Eq. 9); hard: w = 0 if every probe "
                              "succeeds else 1 (the paper's hard-thresholded ablation, Table 3)")


def success_weights(correct: torch.Tensor, group_index: torch.Tensor, weight: str = "linear") -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row OSW-FT weight from its group's probe successes.

    Args:
        correct: ``[B]`` verifier correctness of each probe rollout, in ``[0, 1]`` (binary for OSW-FT).
        group_index: ``[B]`` prompt group ids: a group is one query's ``K`` probes.
        weight: ``"linear"`` (``1 - p_hat``) or ``"hard"`` (``0`` if ``p_hat == 1`` else ``1``).
    Returns:
        ``(w [B] float64, p_hat [B] float64)``, constant within a group.
    Raises:
        ValueError: correctness outside ``[0, 1]``, mismatched shapes, or an unknown ``weight``.
    """
    if correct.shape != group_index.shape or correct.dim() != 1:
        raise ValueError(f"success_weights: correct {tuple(correct.shape)} and group_index {tuple(group_index.shape)} "
                         f"must both be [B]")
    c = correct.double()
    if bool(((c < 0) | (c > 1)).any()):
        raise ValueError("osw_ft needs a correctness reward in [0, 1] (a binary verifier, the paper's R(o)); got "
                         f"values in [{float(c.min())}, {float(c.max())}]")
    p_hat, _, _ = group_stats(c, group_index)
    if weight == "linear":
        w = 1.0 - p_hat
    elif weight == "hard":
        w = (p_hat < 1.0).double()
    else:
        raise ValueError(f"osw_ft: weight={weight!r}: valid choices are linear, hard")
    return w, p_hat


@ADV_ESTIMATORS.register("osw_ft", paper=_PAPER, params=OSWFTParams, needs_group=True,
                         no_baseline=True,
                         zero_variance=("an SFT weight 1 - p_hat (the probes' success rate), not a baseline: 0.9 "
                                        'success weighs 0.1'))
def osw_ft_advantage(inp: AdvantageInput, *, weight: str) -> AdvantageOutput:
    """The expert trajectory's advantage ``1 - p_hat(q)`` (OSW-FT's weight) on every response token.

    ``p_hat`` is the mean of the group's correctness (``inp.extras['reward_correct']`` ``[B]`` when the
    reward function recorded it, else ``inp.rewards``), computed on the probe rollouts before the
    method swapped in the expert trajectories (rewards are not touched by the swap). With loss
    ``osw_ft`` the result is SFT weighted per query.

    Raises:
        ValueError: see :func:`success_weights`.
    """
    correct = inp.extras.get(CORRECT_KEY)
    correct = inp.rewards if correct is None else correct
    w, _ = success_weights(correct.reshape(-1), inp.group_index, weight)
    return AdvantageOutput(advantages=_broadcast(w, inp.response_mask))


@POLICY_LOSSES.register("osw_ft", paper=_PAPER, needs_expert_trajectories=True,
                        example_inputs=lambda logprobs, generator: {"overrides": ["algo.adv_estimator=osw_ft"]})
def osw_ft_loss(inp: PolicyLossInput) -> Tuple[torch.Tensor, Metrics]:
    """Weighted negative log-likelihood ``-w * log pi(o*_t)`` of the expert trajectory's tokens.

    ``inp.advantages`` ``[B, R]`` holds the weight ``w`` (estimator ``osw_ft``) on each token; it is a
    constant (no gradient flows through it). The responses are the expert trajectories (the trainer's
    batch after :mod:`rlpost.methods.osw_ft`, tag ``needs_expert_trajectories``). Metrics: ``nll``,
    the unweighted masked mean NLL; ``weight_mean``, the token-weighted mean of ``w``.
    """
    ratio, log_ratio = _ratio(inp)
    w = inp.advantages.detach()
    loss = -w * inp.logprobs
    z = torch.zeros_like(ratio)
    metrics = _clip_metrics(ratio, log_ratio, z, z, inp.response_mask)
    metrics["nll"] = masked_mean(-inp.logprobs.detach(), inp.response_mask)
    metrics["weight_mean"] = masked_mean(w, inp.response_mask)
    return loss, metrics


def expert_trajectory(solution: str, answer: Any, answer_format: str,
                      extract: Optional[Callable[[str], Optional[str]]] = None) -> str:
    """The expert trajectory ``o*`` OSW-FT trains on: the task's worked solution, ending in its answer.

    Args:
        solution: the worked solution (:meth:`rlpost.tasks.base.Task.reference_solution`: the data's own
            solution, else the bare gold answer).
        answer: the gold answer.
        answer_format: the task's answer format (``tags``, ``boxed``, ``last_number``, ...).
        extract: ``text -> answer or None``, the task's answer extractor; when it finds no answer in
            ``solution``, the answer in the task's format (:func:`rlpost.algos.inputs.reference_response`)
            is appended on a new line (our reading: the trajectory must end in an answer the verifier reads).
    Returns:
        the trajectory text (the bare formatted answer when the solution is empty or just the answer).
    """
    sol = str(solution or "").strip()
    formatted = reference_response(answer, answer_format)
    if not sol or sol == str(answer).strip():
        return formatted
    if extract is not None and extract(sol) is None:
        return f"{sol}\n{formatted}"
    return sol
