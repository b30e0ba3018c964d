"""Shuffle-R1's pairwise trajectory sampling and advantage-based batch shuffle, as pure functions, and its estimator.

"Shuffle-R1: Efficient RL framework for Multimodal Large Language Models via
Data-centric Dynamic Shuffle" (arXiv:2508.05612; authors' code
https://github.com/xiaomi-research/shuffle-r1, ``shuffle_r1/custom_algos.py``
and ``shuffle_r1/ray_trainer.py``). Two problems are named: *advantage
collapsing* (most advantages of a batch near 0) and *rollout silencing* (fewer and
fewer rollouts with a non-zero gradient). The remedies, as the released code does them:

* Pairwise Trajectory Sampling (PTS, :func:`max_contrast_pairs`): each group's
  rollouts are sorted by their GRPO advantage and paired outermost first (largest
  with smallest, second largest with second smallest, ...); only the first
  ``(1 - prune_ratio)`` of the pairs, the most contrasting ones, are trained on
  (the authors' runs: 16 rollouts, ``purning_ratio`` 0.5, so the 4 outermost pairs).
* Advantage-based Batch Shuffle (ABS, :func:`abs_resample`): the kept pairs of the
  whole batch are redrawn in ``replay_times`` rounds (8), each drawing
  ``n_pairs / replay_times`` pairs without replacement with probability
  proportional to ``weight ** power`` (``weight`` = ``|A_hi| + |A_lo|`` by default,
  ``power`` 1), so the batch keeps its size and high-contrast pairs appear up to
  ``replay_times`` times while low-contrast ones may drop out.

The advantages are those of the *full* group, computed before pruning (the
authors' order): the sampler (``sampler=shuffle_r1``,
:mod:`rlpost.samplers.shuffle_r1`) stores them in ``extras['pair_advantage']``
and the ``shuffle_r1`` estimator broadcasts them, since GRPO recomputed on the
kept and repeated rows would change every group's mean and std.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, _broadcast
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.utils import group_all_equal, group_stats
from rlpost.core.registry import Choice, param

_SHUFFLE_R1_PAPER = ("Shuffle-R1: Efficient RL framework for Multimodal Large Language Models via Data-centric "
                     "Dynamic Shuffle (arXiv:2508.05612)")


class PairWeight(Choice):
    """ABS's sampling weight of a pair ``(a, b)`` of advantages (authors' ``sampling_weight``)."""

    sum = "sum"    # |a| + |b| (authors' default)
    max = "max"    # max(|a|, |b|)
    mean = "mean"  # (|a| + |b|) / 2
    pos = "pos"    # |max(a, b)|


@dataclass(frozen=True)
class ShuffleR1AdvParams:
    """The group advantage the pairs are ranked and trained with (authors' GRPO: eps 1e-6)."""

    eps: float = param(1e-6, "added to the group std (authors' code: 1e-6)")


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``[B]`` float64 GRPO advantages ``(r - mean_g) / (std_g + eps)`` (Bessel-corrected std, as the authors' torch.std).

    A group whose rewards are all equal, or of one row, gets 0 (rlpost's GRPO;
    the authors' code leaves a lone row its raw reward).
    """
    r = rewards.double()
    mean, std, _ = group_stats(r, group_index)
    adv = (r - mean) / (std + eps)
    return torch.where(group_all_equal(r, group_index), torch.zeros_like(adv), adv)


def max_contrast_pairs(adv: torch.Tensor, prune_ratio: float) -> List[Tuple[int, int]]:
    """PTS on one group: ``(hi, lo)`` index pairs, outermost first, the first ``int(n/2 (1 - prune_ratio))`` kept.

    ``adv`` ``[n]``; indices are positions in it. Sorting is by descending advantage
    (stable, so ties keep their order); pair ``k`` is the ``k``-th largest with the
    ``k``-th smallest. ``prune_ratio = 0`` keeps every pair.

    Raises:
        ValueError: an odd group size (the authors assert it is even) or ``prune_ratio`` outside [0, 1).
    """
    n = int(adv.shape[0])
    if n % 2:
        raise ValueError(f"Shuffle-R1 pairs a group's rollouts: the group size must be even, got {n}")
    if not 0.0 <= prune_ratio < 1.0:
        raise ValueError(f"prune_ratio must be in [0, 1), got {prune_ratio}")
    order = torch.sort(adv.double(), descending=True, stable=True).indices.tolist()
    pairs = [(order[k], order[n - 1 - k]) for k in range(n // 2)]
    return pairs[: int(len(pairs) * (1.0 - prune_ratio))]


def pair_weights(a_hi: torch.Tensor, a_lo: torch.Tensor, weight: str) -> torch.Tensor:
    """``[P]`` float64 ABS weights of pairs with advantages ``a_hi``, ``a_lo`` ``[P]`` (:class:`PairWeight`).

    Raises:
        ValueError: an unknown ``weight``.
    """
    a, b = a_hi.double(), a_lo.double()
    if weight == "sum":
        return a.abs() + b.abs()
    if weight == "max":
        return torch.maximum(a.abs(), b.abs())
    if weight == "mean":
        return (a.abs() + b.abs()) / 2
    if weight == "pos":
        return torch.maximum(a, b).abs()
    raise ValueError(f"weight={weight!r}: valid choices are {', '.join(w.value for w in PairWeight)}")


def abs_resample(weights: torch.Tensor, replay_times: int, power: float = 1.0,
                 generator: Optional[torch.Generator] = None) -> List[int]:
    """ABS: pair ids drawn in ``T = min(replay_times, P)`` rounds of ``P // T`` draws without replacement.

    Each round draws with probability ``weights ** power / sum`` (``weights`` ``[P]``,
    >= 0); rounds are independent, so a pair appears at most ``replay_times`` times.
    ``replay_times = 1`` returns every pair once, in order (the authors' code). Our
    choices where the code would fail: fewer pairs than rounds (a small CPU batch)
    runs ``P`` rounds of one draw, so the batch never grows; when a round needs more
    pairs than have a positive weight, it takes all of those and fills up uniformly
    from the rest (all weights 0: uniform).

    Raises:
        ValueError: ``replay_times < 1``, ``power < 0`` or a negative weight.
    """
    P = int(weights.shape[0])
    if replay_times < 1:
        raise ValueError(f"replay_times must be >= 1, got {replay_times}")
    if power < 0:
        raise ValueError(f"power must be >= 0, got {power}")
    if bool((weights < 0).any()):
        raise ValueError("ABS weights must be >= 0")
    if replay_times == 1 or P == 0:
        return list(range(P))
    rounds = min(int(replay_times), P)
    k = P // rounds
    w = weights.double() ** float(power)
    pos = torch.nonzero(w > 0).flatten()
    rest = torch.nonzero(w <= 0).flatten()
    out: List[int] = []
    for _ in range(rounds):
        take = min(k, int(pos.numel()))
        drawn = pos[torch.multinomial(w[pos], take, replacement=False, generator=generator)] if take else pos[:0]
        need = k - take
        if need:
            drawn = torch.cat([drawn, rest[torch.randperm(int(rest.numel()), generator=generator)[:need]]])
        out.extend(int(i) for i in drawn)
    return out


@ADV_ESTIMATORS.register("shuffle_r1", paper=_SHUFFLE_R1_PAPER, params=ShuffleR1AdvParams, needs_group=True,
                        sampler="shuffle_r1")
def shuffle_r1_advantage(inp: AdvantageInput, *, eps: float) -> AdvantageOutput:
    """Each row's full-group GRPO advantage, broadcast over its response tokens.

    ``inp.extras['pair_advantage']`` ``[B]`` when ``sampler=shuffle_r1`` wrote it
    (the advantage of the group before PTS and ABS); otherwise the batch holds the
    full groups and it is :func:`group_advantages` of ``inp.rewards`` (GRPO).

    Shapes: returns ``advantages`` ``[B, R]``, 0 outside ``inp.response_mask``.
    """
    a = inp.extras.get("pair_advantage")
    if a is None:
        a = group_advantages(inp.rewards, inp.group_index, eps)
    return AdvantageOutput(advantages=_broadcast(a.double(), inp.response_mask), returns=None)
