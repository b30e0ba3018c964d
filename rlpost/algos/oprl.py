"""OPRL: an implicit PRM trained online by trajectory DPO; step advantages from its rewards plus episode advantages.

"Online Process Reward Learning for Agentic Reinforcement Learning" (OPRL,
arXiv:2509.19199). Alternating with the policy, an implicit process reward
model ``pi_phi`` (a language model, here a copy of the policy) is trained on
the step's rollouts with a trajectory-level DPO objective on outcome
preferences ``tau+ > tau-`` (pairs of one prompt's rollouts, the better
outcome preferred):

    J(phi) = -E log sigmoid(beta [log pi_phi(tau+)/pi_old(tau+) - log pi_phi(tau-)/pi_old(tau-)])

with ``pi_old`` the policy before this step's update. The implicit reward of
step (action) ``a_k`` is ``r_k = beta log pi_phi(a_k | prefix) / pi_old(a_k | prefix)``,
a sum over the step's tokens. Step-level advantages from these rewards are
combined with episode-level advantages from the outcome.

Read: the abstract and two public summaries giving the DPO objective and the
step reward above; the paper's advantage formulas and constants were not
readable and no code was found. Our reading (:class:`OPRLParams`,
:func:`oprl_advantage`): the episode advantage is GRPO's z-scored outcome; the
step advantage is the step reward z-scored over all steps of the prompt's
group; ``A_t = A^E + step_weight * A^S_k(t)``. Steps are turns in the paper's
agentic tasks; here they come from the shared segmentation rule
(:func:`rlpost.tasks.steps.segment_steps`) over the response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.vps import outcome_plus_steps
from rlpost.core.registry import param

PAPER = "Online Process Reward Learning for Agentic Reinforcement Learning (OPRL, arXiv:2509.19199)"


@dataclass(frozen=True)
class OPRLParams:
    """OPRL's implicit PRM and advantage mix; constants the abstract leaves open are our choices."""

    segment: str = param("newline", "step segmentation rule (rlpost list step_segment): newline | step_k | sentence")
    beta: float = param(0.05, "DPO beta of the PRM objective and of the implicit step reward (our choice: PRIME's "
                        "implicit-PRM value, arXiv:2502.01456)")
    step_weight: float = param(1.0, "weight of the step advantage added to the episode advantage (our choice 1)")
    prm_lr: float = param(1e-6, "Adam learning rate of the implicit PRM (our choice: PRIME's PRM learning rate)")
    prm_updates: int = param(1, "PRM gradient steps per RL step, each over all of the step's preference pairs")
    eps: float = param(1e-6, "added to the group stds (GRPO reference code: 1e-6)")


def preference_pairs(rewards: torch.Tensor, group_index: torch.Tensor) -> List[Tuple[int, int]]:
    """Every ``(i, j)`` of one group with ``rewards[i] > rewards[j]`` (``i`` preferred), in row order."""
    r, g = rewards.tolist(), group_index.tolist()
    return [(i, j) for i in range(len(r)) for j in range(len(r)) if g[i] == g[j] and r[i] > r[j]]


def dpo_loss(s_phi: torch.Tensor, s_old: torch.Tensor, pairs: List[Tuple[int, int]], beta: float) -> torch.Tensor:
    """Trajectory DPO loss, the mean over ``pairs`` of ``-log sigmoid(beta [(s_phi_i - s_old_i) - (s_phi_j - s_old_j)])``.

    Args:
        s_phi: ``[B]`` sequence log-probs (nats, summed over response tokens) under the PRM (may carry grad).
        s_old: ``[B]`` the same under the pre-update policy.
        pairs: ``(preferred, rejected)`` row indices.
    Raises:
        ValueError: no pairs.
    """
    if not pairs:
        raise ValueError("dpo_loss: no preference pairs")
    i = torch.tensor([p[0] for p in pairs])
    j = torch.tensor([p[1] for p in pairs])
    h = (s_phi - s_old)
    return -torch.nn.functional.logsigmoid(beta * (h[i] - h[j])).mean()


def step_rewards(lp_phi: torch.Tensor, lp_old: torch.Tensor, segment: torch.Tensor, beta: float) -> torch.Tensor:
    """``[B, R]`` float32: on every token of step ``k`` the step's implicit reward ``beta sum_{t in k} (lp_phi - lp_old)``.

    ``segment`` ``[B, R]`` long: step number of each token (1-based, 0 outside every step).
    """
    d = (lp_phi.double() - lp_old.double()) * (segment > 0)
    out = torch.zeros(lp_phi.shape, dtype=torch.float64)
    for b in range(segment.shape[0]):
        for k in set(int(x) for x in segment[b].tolist() if x > 0):
            sel = segment[b] == k
            out[b][sel] = beta * float(d[b][sel].sum())
    return out.float()


def _oprl_example(logprobs: torch.Tensor, generator: torch.Generator) -> Dict[str, Any]:
    """Implicit-PRM step rewards per position and steps of two tokens (segments 1, 2, ...), what the method writes."""
    B, R = logprobs.shape
    return {"extras": {"oprl_step_rewards": torch.rand(B, R, generator=generator),
                       "oprl_segment": (torch.arange(R) // 2 + 1).expand(B, R).clone()}}


@ADV_ESTIMATORS.register("oprl", paper=PAPER, params=OPRLParams, needs_group=True, needs_implicit_prm=True,
                         example_inputs=_oprl_example,
                         zero_variance=('a zero-variance group keeps its implicit-PRM step advantages (dense credit '
                                        'where the outcome gives none)'))
def oprl_advantage(inp: AdvantageInput, *, segment: str, beta: float, step_weight: float, prm_lr: float,
                   prm_updates: int, eps: float) -> AdvantageOutput:
    """``A_it = A^E_i + step_weight * A^S_ik(t)``: episode advantage plus the step's implicit-reward advantage.

    ``A^E_i = (r_i - mean_g) / (std_g + eps)`` (GRPO; 0 for a zero-variance
    group); ``A^S`` is the step reward (``inp.extras['oprl_step_rewards']``
    ``[B, R]``, one value per step on its tokens, from the ``oprl`` method)
    z-scored over the ``(row, step)`` pairs of the group
    (:func:`rlpost.algos.vps.normalized_progress`), 0 on tokens outside every
    step. A zero-variance group keeps its step advantages (dense credit where
    the outcome gives none: the paper's point; a listed exception to the
    group-baseline invariant). ``segment``, ``beta``, ``prm_lr`` and
    ``prm_updates`` are read by the method. Shapes: ``[B]`` -> ``[B, R]``
    float32, 0 outside ``response_mask``.

    Raises:
        ValueError: the step rewards are missing, or ``step_weight < 0``.
    """
    return outcome_plus_steps(inp, "oprl", ("oprl_step_rewards", "oprl_segment"),
                              "the oprl method's implicit PRM, run for estimators tagged needs_implicit_prm",
                              ("step_weight", step_weight), eps, flat_groups_keep_steps=True)
