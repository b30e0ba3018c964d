"""RC-GRPO's reward tokens, as pure functions, and its two estimators (stage 1 and stage 2).

"RC-GRPO: Reward-Conditioned Group Relative Policy Optimization for Multi-Turn Tool Calling Agents"
(Zhong, Zhai, Song, Bian, Liu and Tan, arXiv:2602.03025; no authors' code was found). GRPO after SFT
stalls when a group's rewards are all equal (the SFT policy is peaked: every rollout succeeds, or
every one fails), so its group-normalised advantage is 0. RC-GRPO makes the spread a controlled
variable with discrete *reward tokens* in the prompt:

* stage 1, the Reward-Conditioned Trajectory Policy (RCTP): supervised fine-tuning on trajectories of
  mixed quality, each prompted with the token of its own reward (``<|high_reward|>`` for a good one,
  ``<|low_reward|>`` for a bad one), so the model learns to produce either quality on demand;
* stage 2: GRPO whose rollouts of one prompt are conditioned on *different* reward tokens drawn for
  that group, so the group holds both quality modes and its advantage is informative;
* evaluation: conditioned on the high-reward token.

What was read: the abstract and public summaries of the paper (the method section could not be read).
Our reading, where those are silent (each a declared parameter):

* **Vocabulary.** ``tokens``, ordered best first, default ``["<|high_reward|>", "<|low_reward|>"]``
  (the paper's examples). The tokens are a declared plain-text tag, not added special tokens: rlpost's
  model group has no added-token support (no embedding resize), and every task encodes its text with
  ``split_special_tokens`` (:mod:`rlpost.tasks.chat`), so the tag is a few ordinary tokens.
* **Placement.** The tag is the first line of the user turn, before the question
  (:func:`tagged_question`); the system prompt and the answer instruction stay where the task puts them.
* **Stage-1 data and labels.** The trajectories are the current policy's own samples under the plain
  prompt, scored by the task's verifier and labelled *in hindsight* with the token of their reward
  (:func:`token_for_reward`: the first token whose lower bound in ``reward_bounds`` the reward reaches,
  else the last); the loss is the negative log-likelihood of each response given its tagged prompt,
  every row weight 1 (estimator ``rctp`` with loss ``gpg``: ``-1 * log pi(y_t | x, token)``). The paper
  fine-tunes on a stored mixed-quality set; a run with ``steps = N`` draws that set online instead.
* **Stage-2 token mix.** ``token_mix`` weights per token (default equal); ``assign=balanced`` splits
  each group's ``c`` rollouts by largest remainder (:func:`group_token_counts`: 8 -> 4 high + 4 low,
  3 -> 2 + 1), ``assign=random`` draws each rollout's token independently with those weights.
* **What the loss sees.** ``train_on=conditioned`` (default): a rollout is trained under the prompt it
  was sampled from, token included (the policy ratio and the engine's log-probs share one context);
  ``train_on=original`` swaps the plain prompt back (the token is then invisible to the loss).
* **Advantage.** Plain GRPO over the whole prompt group, whatever the tokens (estimator ``rc_grpo``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, _broadcast, grpo_advantage
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.core.apportion import apportion
from rlpost.core.registry import param

PAPER = ("RC-GRPO: Reward-Conditioned Group Relative Policy Optimization for Multi-Turn Tool Calling Agents "
         "(arXiv:2602.03025)")

#: the paper's example reward tokens, best first
DEFAULT_TOKENS = ("<|high_reward|>", "<|low_reward|>")


# ----------------------------------------------------------------- the tokens
def tagged_question(question: str, token: str) -> str:
    """The question with reward token ``token`` as its first line: ``f"{token}\\n{question}"`` (our placement)."""
    return f"{token}\n{question}"


def token_for_reward(reward: float, bounds: Sequence[float]) -> int:
    """Index of the reward token of a trajectory with ``reward`` (stage-1 hindsight label).

    ``bounds`` ``[K - 1]`` descending lower bounds of tokens ``0 .. K - 2``: the first ``k`` with
    ``reward >= bounds[k]``, else ``K - 1`` (the lowest token). Two tokens, ``bounds = [1.0]``: a
    correct answer (reward 1) is token 0 (high), anything less token 1 (low).
    """
    for k, b in enumerate(bounds):
        if float(reward) >= float(b):
            return k
    return len(bounds)


def group_token_counts(c: int, mix: Sequence[float]) -> List[int]:
    """Rollouts per token of a group of ``c``: ``c * mix`` split by largest remainder, ties to the better token.

    ``[4, 4]`` for ``c = 8``, mix ``[0.5, 0.5]``; ``[2, 1]`` for ``c = 3``; ``[1, 0]`` for ``c = 1``.
    Raises:
        ValueError: ``c < 0``, a negative weight, or weights summing to 0.
    """
    if int(c) < 0:
        raise ValueError(f"group size {c} must be >= 0")
    if any(float(w) < 0 for w in mix) or sum(float(w) for w in mix) <= 0:
        raise ValueError(f"token_mix {list(mix)} must be non-negative with a positive sum")
    return [int(x) for x in apportion([float(w) for w in mix], int(c))]


def assign_group_tokens(counts: Sequence[int], mix: Sequence[float], assign: str = "balanced",
                        generator: Optional[torch.Generator] = None) -> List[List[int]]:
    """Each group's rollout tokens (token indices, one list per group, best token first when balanced).

    Args:
        counts: rollouts of each group.
        mix: ``[K]`` weight of each token.
        assign: ``balanced`` (:func:`group_token_counts`, deterministic) or ``random`` (each rollout's
            token drawn independently with probabilities ``mix / sum(mix)`` from ``generator``).
    Raises:
        ValueError: see :func:`group_token_counts`; an unknown ``assign``.
    """
    out: List[List[int]] = []
    if assign == "balanced":
        for c in counts:
            out.append([k for k, n in enumerate(group_token_counts(c, mix)) for _ in range(n)])
        return out
    if assign != "random":
        raise ValueError(f"assign={assign!r}: valid choices are balanced, random")
    group_token_counts(0, mix)  # the weights' checks
    p = torch.tensor([float(w) for w in mix], dtype=torch.float64)
    for c in counts:
        out.append(torch.multinomial(p, int(c), replacement=True, generator=generator).tolist() if int(c) else [])
    return out


# ----------------------------------------------------------------- estimators
@dataclass(frozen=True)
class RCTPParams:
    """Stage 1 (RCTP) weighs every relabelled trajectory alike (maximum likelihood); no parameters."""


@ADV_ESTIMATORS.register("rctp", paper=PAPER + ", stage 1 (RCTP)", params=RCTPParams, sampler="rctp",
                         no_baseline=True,
                         zero_variance=('an SFT weight 1 on every relabelled trajectory (RC-GRPO stage 1): the reward '
                                        "only chose the prompt's token"))
def rctp_advantage(inp: AdvantageInput) -> AdvantageOutput:
    """Weight 1 on every response token: with loss ``gpg`` the loss is ``-log pi(y_t | x, token)``.

    The rows are the policy's samples, each under the prompt tagged with the token of its own reward
    (``sampler=rctp``, :mod:`rlpost.samplers.rc_grpo`), so this is RCTP's supervised objective on
    mixed-quality trajectories; rewards only chose the token. Shapes: ``advantages`` ``[B, R]``,
    1 on ``inp.response_mask``, 0 elsewhere.
    """
    return AdvantageOutput(advantages=_broadcast(torch.ones(inp.response_mask.shape[0], dtype=torch.float64),
                                                 inp.response_mask), returns=None)


@dataclass(frozen=True)
class RCGRPOParams:
    """Stage 2: GRPO's group normalisation over each prompt's rollouts, whatever their reward tokens."""

    eps: float = param(1e-6, "added to the group std (GRPO reference code: 1e-6)")


@ADV_ESTIMATORS.register("rc_grpo", paper=PAPER, params=RCGRPOParams, needs_group=True, sampler="rc_grpo")
def rc_grpo_advantage(inp: AdvantageInput, *, eps: float) -> AdvantageOutput:
    """GRPO's ``(r_i - mean_g) / (std_g + eps)`` over each prompt's group of reward-conditioned rollouts.

    The group is the prompt (``inp.group_index``): rollouts conditioned on different tokens share one
    mean and one Bessel-corrected std, so the token mix is what gives the group its spread. A group of
    equal rewards gets 0. Shapes: ``advantages`` ``[B, R]``.
    """
    return grpo_advantage(inp, norm_by_std=True, eps=float(eps), baseline="mean", unbiased_std=True,
                          std_scope="group")
