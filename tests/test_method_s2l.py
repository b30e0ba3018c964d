"""S2L-PO (arXiv:2605.30789): the annealing schedules and the per-prompt split by hand; mixed groups from two
fake engines (a learner that always fails, an explorer that always answers, with its own log-probs); the
config checks; one tiny run whose explorer is a second tiny model."""

import dataclasses
import math

import pytest
import torch

from fake_engine import FakeEngine
from rlpost.core.errors import ConfigError
from rlpost.rollout.base import SamplingParams
from rlpost.samplers.base import SamplerContext
from rlpost.samplers.s2l import S2LSampler, S2LSamplerParams, explorer_fraction, split_counts


def test_schedules_by_hand():
    f = lambda step, sched: explorer_fraction(step, 0.5, 0.1, 100, sched)  # noqa: E731
    # linear: 0.5 + (0.1 - 0.5) u
    assert [f(s, "linear") for s in (0, 25, 100, 300)] == pytest.approx([0.5, 0.4, 0.1, 0.1])
    # cosine: 0.1 + 0.4 (1 + cos(pi u)) / 2; u = 0.25 -> 0.1 + 0.2 * 1.70711 = 0.44142
    assert f(25, "cosine") == pytest.approx(0.1 + 0.2 * (1 + math.cos(math.pi / 4)))
    assert (f(0, "cosine"), f(50, "cosine"), f(100, "cosine")) == pytest.approx((0.5, 0.3, 0.1))
    # step: the start share until anneal_steps, then the end share
    assert (f(99, "step"), f(100, "step")) == (0.5, 0.1)
    assert explorer_fraction(0, 0.5, 0.1, 0, "linear") == 0.1  # no annealing window: the end share throughout
    with pytest.raises(ValueError):
        explorer_fraction(0, 0.5, 0.0, 10, "exp")


def test_split_counts_by_hand():
    # floor(f c + 0.5): 0.5 * [4, 3, 1, 0] -> 2, floor(2.0) = 2, floor(1.0) = 1, 0
    assert split_counts([4, 3, 1, 0], 0.5) == [2, 2, 1, 0]
    # 0.25 * [4, 3, 1] + 0.5 -> 1.5, 1.25, 0.75
    assert split_counts([4, 3, 1], 0.25) == [1, 1, 0]
    assert split_counts([4, 3], 1.0) == [4, 3] and split_counts([4, 3], 0.0) == [0, 0]


class Explorer(FakeEngine):
    """Always answers correctly ("1..."), 4 tokens, log-prob -1.0 per token (the learner's FakeEngine: -0.5)."""

    def __init__(self):
        super().__init__({1: 1.0}, resp_len=4)

    def generate(self, prompts, params):
        g = super().generate(prompts, params)
        return dataclasses.replace(g, rollout_logprobs=2.0 * g.rollout_logprobs)


def _sampler(n=4, **kw):
    p = dataclasses.asdict(S2LSamplerParams())
    p.update(explorer_model="tiny", **kw)
    s = S2LSampler(n, **p)
    s.set_explorer(Explorer())
    return s


PARAMS = SamplingParams(max_new_tokens=8, seed=3)
PROMPTS = [[1, 5], [1, 6]]


def test_mixed_groups_from_learner_and_explorer():
    s = _sampler()
    learner = FakeEngine({1: 0.0}, resp_len=6)
    res = s.sample(learner, PROMPTS, PARAMS, SamplerContext(step=1))
    gen, flag = res.generation, res.extras["explorer_row"]
    # f(0) = 0.5 of n = 4: two rows per prompt from each engine, one group per prompt
    assert res.group_index.tolist() == [0, 0, 1, 1, 0, 0, 1, 1] and flag.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len(learner.calls) == 1 and len(s.explorer.calls) == 1 and len(s.explorer.calls[0]) == 4
    lengths = gen.response_mask.sum(1).tolist()
    assert lengths == [6, 6, 6, 6, 4, 4, 4, 4]
    assert all(gen.response_ids[i, 0] == (3 if flag[i] else 4) for i in range(8))  # explorer rows answer
    # the explorer's rows carry its own log-probs (the behaviour policy for the TIS weight)
    lp = gen.rollout_logprobs
    assert torch.allclose(lp[flag > 0].sum(1), torch.full((4,), -4.0))
    assert torch.allclose(lp[flag == 0].sum(1), torch.full((4,), -3.0))
    assert res.metrics["sampler/s2l_explorer_fraction"] == 0.5 and res.metrics["sampler/s2l_explorer_rows"] == 4.0


def test_annealed_to_the_learner_and_selector_counts():
    s = _sampler(anneal_steps=10)
    learner = FakeEngine({1: 0.0})
    res = s.sample(learner, PROMPTS, PARAMS, SamplerContext(step=11))  # 10 steps done, f = 0: explorer not asked
    assert s.explorer.calls == [] and res.extras["explorer_row"].tolist() == [0.0] * 8
    assert s.fraction(1) == 0.5 and s.fraction(11) == 0.0  # the run's steps are 1-based
    # step 6 (5 done): f = 0.25; a selector's counts [3, 1] -> explorer floor(1.25) = 1 and floor(0.75) = 0
    res = s.sample(learner, PROMPTS, PARAMS, SamplerContext(step=6, rollout_counts=[3, 1]))
    assert res.group_index.tolist() == [0, 0, 1, 0] and res.extras["explorer_row"].tolist() == [0, 0, 0, 1]
    assert s.explorer.calls == [[[1, 5]]]
    # all rows from the explorer at f = 1
    full = _sampler(fraction_start=1.0, fraction_end=1.0)
    res = full.sample(FakeEngine({1: 0.0}), PROMPTS, PARAMS, SamplerContext(step=0))
    assert res.extras["explorer_row"].tolist() == [1.0] * 8


@pytest.mark.parametrize("kw", [dict(explorer_model=""), dict(fraction_start=1.5), dict(fraction_end=0.6),
                                dict(anneal_steps=-1), dict(anneal_schedule="exp")])
def test_bad_parameters_raise(kw):
    p = dataclasses.asdict(S2LSamplerParams())
    p.update(explorer_model="tiny")
    p.update(kw)
    with pytest.raises(ValueError):
        S2LSampler(4, **p)


def test_recipe_and_config_errors(compose):
    from rlpost.config.compose import validate_config

    cfg = compose(["+recipe=s2l_po", "model=tiny", "logger=none"])
    validate_config(cfg)
    assert (cfg.sampler.name, cfg.sampler.params.explorer_model, cfg.precision.correction) == ("s2l", "smollm2-135m",
                                                                                                 "tis")
    for bad in (["sampler=s2l"], ["sampler=s2l", "+sampler.params.explorer_model=no-such-model"],
                ["sampler=s2l", "+sampler.params.explorer_model=tiny", "+sampler.params.explorer_modle=tiny"],
                ["sampler=s2l", "+sampler.params.explorer_model=tiny", "+sampler.params.fraction_end=0.9"]):
        with pytest.raises(ConfigError):
            validate_config(compose(["model=tiny", "logger=none", *bad]))


@pytest.mark.usefixtures("one_thread")
def test_recipe_one_step_with_a_tiny_explorer(tmp_path):
    import json

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["+recipe=s2l_po", "model=tiny", "sampler.params.explorer_model=tiny", "steps=1",
                          "logger=jsonl", "selector.prompts_per_step=2", "rollout.max_new_tokens=8",
                          "eval.at_end=false", "eval.at_start=false", "checkpoint.every=0"])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r = [r for r in rows if "reward/mean" in r][0]
    assert math.isfinite(r["loss/policy"])
    assert r["sampler/s2l_explorer_fraction"] == 0.5 and r["sampler/s2l_explorer_rows"] == 4.0  # 2 prompts x 4 x 0.5
