"""``sampler=shuffle_r1``: Shuffle-R1's Pairwise Trajectory Sampling and Advantage-based Batch Shuffle.

"Shuffle-R1: Efficient RL framework for Multimodal Large Language Models via
Data-centric Dynamic Shuffle" (arXiv:2508.05612; authors' code
https://github.com/xiaomi-research/shuffle-r1). The pure parts (pairing, pair
weights, the resampling) are in :mod:`rlpost.algos.shuffle_r1`; this sampler runs
them on a step's scored groups and hands the batch the kept, redrawn rows with
their full-group advantages in ``extras['pair_advantage']``, which
``adv_estimator=shuffle_r1`` (``algo=shuffle_r1``) trains with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from rlpost.algos.shuffle_r1 import (
    PairWeight,
    abs_resample,
    group_advantages,
    max_contrast_pairs,
    pair_weights,
)
from rlpost.core.registry import param
from rlpost.samplers.base import (
    SAMPLERS,
    SampleResult,
    Sampler,
    generate_groups,
    score_rows,
    select_rows,
    step_params,
)


@dataclass(frozen=True)
class ShuffleR1SamplerParams:
    """PTS and ABS settings (authors' examples/qwen2_5_vl_7b.sh and shuffle_r1/config.py)."""

    prune_ratio: float = param(0.5, "share of each group's pairs PTS drops, least contrasting first (authors: 0.5)")
    replay_times: int = param(8, "ABS rounds; each draws 1/replay_times of the kept pairs (authors: 8; 1 = no ABS)")
    weight: PairWeight = param(PairWeight.sum, "ABS weight of a pair: sum |A|, max |A|, mean |A| or pos |max A| "
                               "(authors: sum)")
    power: float = param(1.0, "ABS draws with probability weight ** power (authors' 'power' method, p = 1)")
    eps: float = param(1e-6, "added to the group std of the ranking advantage (authors: 1e-6)")


@SAMPLERS.register(
    "shuffle_r1",
    paper="Shuffle-R1: Efficient RL framework for Multimodal Large Language Models via Data-centric Dynamic Shuffle "
          "(arXiv:2508.05612)",
    description="n rollouts per prompt, the most contrasting max-min pairs kept, then redrawn by their |advantage|.",
    params=ShuffleR1SamplerParams,
)
class ShuffleR1Sampler(Sampler):
    """PTS then ABS on each step's groups.

    Every prompt gets ``n`` (even) rollouts, all scored. ``A`` is GRPO's advantage
    over the full group (:func:`rlpost.algos.shuffle_r1.group_advantages`); PTS keeps
    each group's ``int(n/2 (1 - prune_ratio))`` outermost max-min pairs; ABS redraws the
    batch's kept pairs (:func:`rlpost.algos.shuffle_r1.abs_resample`, seeded by
    ``ctx.seed`` and ``ctx.step``). The returned batch lists the drawn pairs' rows in
    draw order (a pair's two rows adjacent), a pair drawn in several rounds repeated;
    ``extras['pair_advantage']`` ``[B]`` carries each row's ``A``. Rows no pair kept
    go to :attr:`SampleResult.dropped` (the selector still sees their rewards).

    Metrics: ``sampler/pairs_kept``, ``sampler/pairs_drawn_unique`` (distinct pairs in
    the batch), ``sampler/abs_weight_mean`` and ``sampler/zero_adv_frac`` (share of
    batch rows with advantage 0: the rollout silencing PTS and ABS act on).

    Raises:
        ValueError: an odd group size, ``prune_ratio`` outside [0, 1), ``replay_times < 1``
            or ``power < 0`` (at construction, so a bad config fails before any rollout).
    """

    def __init__(self, n_samples: int, *, prune_ratio: float, replay_times: int, weight: str, power: float,
                 eps: float) -> None:
        super().__init__(n_samples)
        if n_samples % 2:
            raise ValueError(f"sampler=shuffle_r1 pairs each group's rollouts: algo.n_samples_per_prompt must be even, "
                             f"got {n_samples}")
        if not 0.0 <= prune_ratio < 1.0:
            raise ValueError(f"prune_ratio must be in [0, 1), got {prune_ratio}")
        if int(n_samples // 2 * (1.0 - prune_ratio)) < 1:
            raise ValueError(f"prune_ratio={prune_ratio} keeps no pair of a group of {n_samples}; lower it or raise "
                             f"algo.n_samples_per_prompt")
        if replay_times < 1 or power < 0:
            raise ValueError(f"replay_times must be >= 1 and power >= 0, got {replay_times} and {power}")
        pair_weights(torch.zeros(1), torch.zeros(1), str(weight))  # an unknown weight fails here
        self.prune_ratio, self.replay_times = float(prune_ratio), int(replay_times)
        self.weight, self.power, self.eps = str(weight), float(power), float(eps)

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        res = generate_groups(engine, prompts, self.counts(len(prompts), ctx), step_params(params, ctx, 0))
        score_rows(ctx, res)
        adv = group_advantages(res.rewards, res.group_index, self.eps)
        pairs: List[tuple] = []
        for g in sorted(set(res.group_index.tolist())):
            rows = torch.nonzero(res.group_index == g).flatten()
            pairs.extend((int(rows[h]), int(rows[l])) for h, l in max_contrast_pairs(adv[rows], self.prune_ratio))
        hi = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        lo = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        w = pair_weights(adv[hi], adv[lo], self.weight)
        gen = torch.Generator().manual_seed((int(ctx.seed) * 1_000_003 + int(ctx.step)) % (2 ** 63 - 1))
        drawn = abs_resample(w, self.replay_times, self.power, gen)
        keep = [r for i in drawn for r in pairs[i]]
        kept_set = {r for p in pairs for r in p}
        dropped = []
        for g in sorted(set(res.group_index.tolist())):
            out = [float(res.rewards[r]) for r in torch.nonzero(res.group_index == g).flatten().tolist()
                   if r not in kept_set]
            if out:
                dropped.append((int(g), out))
        extras = {k: v[keep] for k, v in res.extras.items()}
        extras["pair_advantage"] = adv[keep].float()
        out = SampleResult(generation=select_rows(res.generation, keep), group_index=res.group_index[keep],
                           rollouts_spent=res.rollouts_spent, extras=extras, rewards=res.rewards[keep], dropped=dropped)
        out.metrics = {"sampler/pairs_kept": float(len(pairs)), "sampler/pairs_drawn_unique": float(len(set(drawn))),
                       "sampler/abs_weight_mean": float(w.mean()) if len(w) else 0.0,
                       "sampler/zero_adv_frac": float((adv[keep] == 0).double().mean()) if keep else 0.0}
        return out
