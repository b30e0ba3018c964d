"""Shuffle-R1 (arXiv:2508.05612): PTS pairing, ABS resampling and the sampler + estimator, by hand."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from fake_engine import FakeEngine, scorer  # noqa: E402
from rlpost.algos.advantages import AdvantageInput, compute_advantages  # noqa: E402
from rlpost.algos.shuffle_r1 import abs_resample, group_advantages, max_contrast_pairs, pair_weights  # noqa: E402
from rlpost.rollout.base import SamplingParams  # noqa: E402
from rlpost.samplers import SAMPLERS, SamplerContext  # noqa: E402


def test_pts_pairs_by_hand():
    # advantages of one group of 6, sorted descending: idx 3 (2.0), 0 (1.0), 5 (0.5), 1 (-0.2), 4 (-1.0), 2 (-2.3).
    # pairs outermost first: (3, 2), (0, 4), (5, 1); prune_ratio 0.5 keeps int(3 * 0.5) = 1 pair, 0 keeps all 3.
    a = torch.tensor([1.0, -0.2, -2.3, 2.0, -1.0, 0.5])
    assert max_contrast_pairs(a, 0.0) == [(3, 2), (0, 4), (5, 1)]
    assert max_contrast_pairs(a, 0.5) == [(3, 2)]
    assert max_contrast_pairs(a, 0.34) == [(3, 2)]  # int(3 * 0.66) = 1
    with pytest.raises(ValueError, match="even"):
        max_contrast_pairs(a[:5], 0.5)
    # ABS weights of the pair (2.0, -2.3): sum 4.3, max 2.3, mean 2.15, pos 2.0
    hi, lo = torch.tensor([2.0]), torch.tensor([-2.3])
    assert [round(float(pair_weights(hi, lo, w)[0]), 6) for w in ("sum", "max", "mean", "pos")] == [4.3, 2.3, 2.15, 2.0]


def test_group_advantage_by_hand():
    # rewards 1 0 0 0: mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5 -> 1.5, -0.5 x3; an all-equal group -> 0
    a = group_advantages(torch.tensor([1.0, 0, 0, 0, 1, 1]), torch.tensor([0, 0, 0, 0, 1, 1]))
    assert torch.allclose(a, torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0], dtype=torch.float64), atol=1e-5)


def test_abs_resample_invariants():
    g = torch.Generator().manual_seed(0)
    w = torch.tensor([4.0, 2.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    drawn = abs_resample(w, 4, 1.0, g)
    assert len(drawn) == 8  # the batch keeps its size: 4 rounds of 8 // 4 = 2 pairs
    for r in range(4):  # without replacement within a round
        assert len(set(drawn[2 * r: 2 * r + 2])) == 2
    assert abs_resample(w, 1) == list(range(8))  # one round: every pair once, in order
    # zero-weight pairs are drawn only when a round has no positive one left (4 rounds of 4 from 2 positive)
    d2 = abs_resample(torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]), 2, 1.0, g)
    assert len(d2) == 8 and {0, 1} <= set(d2[:4]) and {0, 1} <= set(d2[4:])
    # frequency follows weight ** power: over many draws pair 0 (weight 4) beats pair 2 (weight 1)
    counts = torch.zeros(8)
    for _ in range(300):
        for i in abs_resample(w, 4, 1.0, g):
            counts[i] += 1
    assert counts[0] > counts[2] > counts[4] == 0
    assert len(abs_resample(w[:3], 8, 1.0, g)) == 3  # fewer pairs than rounds: 3 rounds of 1, the size kept
    with pytest.raises(ValueError):
        abs_resample(w, 0)


def test_sampler_keeps_outer_pairs_with_full_group_advantages():
    eng = FakeEngine({10: 0.5, 11: 0.0, 12: 1.0})
    s = SAMPLERS.get("shuffle_r1")(8, prune_ratio=0.5, replay_times=2, weight="sum", power=1.0, eps=1e-6)
    r = s.sample(eng, [[10, 5], [11, 5], [12, 5]], SamplingParams(max_new_tokens=6, seed=5),
                 SamplerContext(score=scorer(), step=0, seed=1))
    assert r.rollouts_spent == 24
    # 3 groups x int(4 pairs x 0.5) = 6 pairs kept; ABS: 2 rounds x 3 pairs = 6 pairs = 12 rows
    assert r.metrics["sampler/pairs_kept"] == 6 and len(r.group_index) == 12
    # every row carries its full group's GRPO advantage (8 rewards), recomputed here from the kept + dropped rewards
    for g in range(3):
        kept = r.rewards[r.group_index == g]
        if len(kept) == 0:
            continue
        allr = sorted(set(kept.tolist()) | {x for p, xs in r.dropped if p == g for x in xs})
        adv = r.extras["pair_advantage"][r.group_index == g]
        if len(allr) == 1:
            assert torch.all(adv == 0)
        else:  # a 0/1 group: correct rows share one positive advantage, the others one negative
            assert len(set(adv[kept > 0.5].tolist())) <= 1 and torch.all(adv[kept > 0.5] > 0)
            assert torch.all(adv[kept < 0.5] < 0)
    # pairs are adjacent (hi, lo) rows of one group
    pa = r.extras["pair_advantage"]
    assert torch.all(pa[0::2] >= pa[1::2]) and torch.equal(r.group_index[0::2], r.group_index[1::2])
    # the estimator broadcasts it, and without the sampler's extra it is GRPO
    mask = torch.ones(len(r.rewards), 3)
    inp = AdvantageInput(rewards=r.rewards, response_mask=mask, group_index=r.group_index,
                         extras={"pair_advantage": r.extras["pair_advantage"]})
    assert torch.allclose(compute_advantages("shuffle_r1", inp).advantages[:, 0], r.extras["pair_advantage"])
    plain = AdvantageInput(rewards=torch.tensor([1.0, 0, 0, 0]), response_mask=torch.ones(4, 2),
                           group_index=torch.zeros(4, dtype=torch.long))
    assert torch.allclose(compute_advantages("shuffle_r1", plain).advantages, compute_advantages("grpo", plain).advantages)


def test_sampler_config_errors():
    with pytest.raises(ValueError, match="even"):
        SAMPLERS.get("shuffle_r1")(5, prune_ratio=0.5, replay_times=8, weight="sum", power=1.0, eps=1e-6)
    with pytest.raises(ValueError, match="keeps no pair"):
        SAMPLERS.get("shuffle_r1")(2, prune_ratio=0.5, replay_times=8, weight="sum", power=1.0, eps=1e-6)
    with pytest.raises(ValueError, match="valid choices"):
        SAMPLERS.get("shuffle_r1")(4, prune_ratio=0.5, replay_times=8, weight="median", power=1.0, eps=1e-6)


def test_shuffle_r1_estimator_composes_with_its_sampler_and_refuses_another():
    """``algo=shuffle_r1`` alone samples with ``sampler=shuffle_r1`` (a composition rule); with another
    sampler the estimator would fall back to GRPO's advantage on unpaired rows, so it is refused."""
    from rlpost.config.compose import compose_config, validate_config
    from rlpost.core.errors import ConfigError

    cfg = compose_config(["algo=shuffle_r1", "model=tiny"])
    assert cfg.sampler.name == "shuffle_r1"
    validate_config(cfg)
    with pytest.raises(ConfigError, match="Fix: sampler=shuffle_r1"):
        validate_config(compose_config(["algo=shuffle_r1", "sampler=group", "model=tiny"]))
