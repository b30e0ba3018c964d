"""TRACE (arXiv:2606.11119), ``sampler=trace_tree``: the mixed-reward value and the greedy allocation by
hand, one gradient step of the logistic success predictor by hand, the tree on the tiny model
(continuations share their prefix id for id; the budget is exact), the checkpoint state, GRPO over
all the leaves of a root by hand, the config errors, and one training step of the preset."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlpost.rewards.scoring import Rewards
from rlpost.rollout.base import SamplingParams
from rlpost.samplers.base import SamplerContext
from rlpost.samplers.trace import FEATURES, PrefixSuccessPredictor, TraceTreeSampler, allocate, mixed_probability
from tests.conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ the mixed-reward value, by hand
def test_mixed_probability_by_hand():
    assert mixed_probability(0.5, 3) == pytest.approx(1 - 0.125 - 0.125)  # 0.75
    assert mixed_probability(0.9, 2) == pytest.approx(1 - 0.81 - 0.01)  # 0.18
    assert mixed_probability(0.5, 1) == 0.0 and mixed_probability(0.3, 0) == 0.0
    # a known failure below the anchor: one success among k new rollouts makes it mixed
    assert mixed_probability(0.3, 2, failures=1) == pytest.approx(1 - 0.7 ** 2)  # 0.51
    assert mixed_probability(0.8, 2, successes=1) == pytest.approx(1 - 0.8 ** 2)  # 0.36
    assert mixed_probability(0.8, 0, successes=2, failures=1) == 1.0
    with pytest.raises(ValueError, match=r"p in \[0, 1\]"):
        mixed_probability(1.5, 2)


def test_root_allocation_by_hand():
    # stage 1: two prompts, p = 0.5 and 0.9, one root each already, 3 more to place.
    # gains from k=1: 0.5 (M(.5,2)) vs 0.18 (M(.9,2)) -> prompt 0; then 0.25 vs 0.18 -> prompt 0;
    # then M(.5,4) - M(.5,3) = 0.125 vs 0.18 -> prompt 1
    assert allocate([0.5, 0.9], 3, start=[1, 1]) == [2, 1]
    assert sum(allocate([0.2, 0.5, 0.7], 11, start=[1, 1, 1])) == 11  # the budget, exactly


def test_prefix_expansion_by_hand_on_a_small_tree():
    # anchors: root 0 (p .5, one success and one failure below it: already mixed, gains 0), root 1 (p .9, two
    # successes: gain 1 - .9 = .1), prefix A (p .3 below a failed episode: gains .3, .21, .147), prefix B
    # (p .8 below a success: gains .2, .16). Budget 4: A (.3), A (.21), B (.2), B (.16).
    new = allocate([0.5, 0.9, 0.3, 0.8], 4, successes=[1, 2, 0, 1], failures=[1, 0, 1, 0], fallback=[0, 1])
    assert new == [0, 0, 2, 2]
    # nothing gains (every anchor mixed): the root with the fewest rows, ties to the lower index
    assert allocate([0.5, 0.5, 0.5], 3, successes=[2, 1, 1], failures=[1, 1, 1], fallback=[0, 1]) == [1, 2, 0]
    with pytest.raises(ValueError, match="fallback"):
        allocate([0.5], 1, successes=[1], failures=[1], fallback=[3])


# ------------------------------------------------------------------ the success predictor, by hand
def test_predictor_one_gradient_step_by_hand():
    pr = PrefixSuccessPredictor(["bias", "depth"], lr=0.5, epochs=1)
    assert pr.w.tolist() == [0.0, 0.0]  # no prompt_rate feature: starts at p = 1/2
    X, y = torch.tensor([[1.0, 0.0], [1.0, 0.5]]), torch.tensor([1.0, 0.0])
    # p = (.5, .5); grad = X^T (p - y) / 2 = ((-.5 + .5) / 2, (0 * -.5 + .5 * .5) / 2) = (0, .125)
    before = pr.update(X, y)
    assert before == pytest.approx(math.log(2))
    assert pr.w.tolist() == pytest.approx([0.0, -0.0625])
    # a second step with weight decay: p = (.5, sigmoid(-.03125)); grad + l2 * w
    pr.l2 = 0.1
    p2 = 1 / (1 + math.exp(0.03125))
    g = [(0.5 - 1 + p2) / 2, (0.5 * p2) / 2 + 0.1 * -0.0625]
    pr.update(X, y)
    assert pr.w.tolist() == pytest.approx([-0.5 * g[0], -0.0625 - 0.5 * g[1]])


def test_predictor_starts_at_the_prompts_smoothed_rate():
    pr = PrefixSuccessPredictor(["bias", "prompt_rate"], lr=0.1, epochs=1)
    # 2 root successes of 2: (2 + 1) / (2 + 2) = 0.75 -> logit ln 3 -> p = 0.75
    assert float(pr.predict(torch.tensor([[1.0, math.log(3)]]))[0]) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="each must be one of"):
        PrefixSuccessPredictor(["bias", "entropy"], lr=0.1, epochs=1)
    with pytest.raises(ValueError, match="predictor_lr"):
        PrefixSuccessPredictor(["bias"], lr=0.0, epochs=1)


# ------------------------------------------------------------------ the tree on the tiny model
@pytest.fixture(scope="module")
def tiny_engine():
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.rollout.hf import HFRolloutEngine

    policy, tk = load_policy(compose_config(tiny_overrides()).model, torch.float32, seed=0)
    return HFRolloutEngine(policy, tk, batch_size=16)


class _EchoEnv:
    """Every turn gets an observation back, so every later turn is an anchor; never done (the turn cap ends it)."""

    instructions = ""

    def __init__(self):
        self.k = 0

    def reset(self, example):
        return None

    def step(self, text):
        from rlpost.envs.base import EnvStep

        self.k += 1
        return EnvStep([{"role": "tool", "content": f"obs {self.k}"}], 0.0, False, {"tool_calls": 1})


@pytest.fixture
def echo_env(monkeypatch):
    import rlpost.samplers.episode as episode  # the sampler's own binding of make_env

    monkeypatch.setattr(episode, "make_env", lambda name, params=None: _EchoEnv())


def _score(calls):
    def score(rows, texts, lengths):  # success: an even number of characters in the final turn
        calls.append(len(texts))
        r = torch.tensor([float(len(t) % 2 == 0) for t in texts])
        return Rewards(r, {"correct": r})
    return score


def _sampler(n=4, **kw):
    args = dict(max_turns=3, max_total_tokens=400, transcripts=False)
    args.update(kw)
    return TraceTreeSampler(n, **args)


SP = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, stop=list("aeiou "))  # random model: short turns


def test_tree_shares_prefixes_and_spends_the_budget_exactly(tiny_engine, echo_env):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    calls = []
    s = _sampler(4, root_share=0.25)  # R = max(3, round(.25 * 12)) = 3 roots, 9 rollouts in stage 2
    res = s.sample(tiny_engine, prompts, SP, SamplerContext(score=_score(calls), step=1, prompt_indices=[0, 1, 2]))
    g, ex = res.generation, res.extras
    assert g.response_ids.shape[0] == 12 == res.rollouts_spent and sum(calls) == 12  # every row scored once
    assert res.group_index.tolist() == sorted(res.group_index.tolist())
    assert res.metrics["trace/root_rollouts"] + res.metrics["trace/prefix_rollouts"] == 12
    # 3 roots + at most 2 prefixes (before turns 2 and 3) per root episode (a turn cut at its token limit ends it)
    assert 3 < res.metrics["trace/anchors"] <= 3 + 3 * 2
    par, pre = ex["branch_parent"].tolist(), ex["branch_prefix_len"].tolist()
    assert sum(p >= 0 for p in par) == res.metrics["trace/prefix_rollouts"] > 0
    for i, (p, n) in enumerate(zip(par, pre)):
        if p < 0:
            assert n == 0
            continue
        assert par[p] == -1 and res.group_index[p] == res.group_index[i] and n > 0  # a root episode's prefix
        for f in ("response_ids", "response_mask", "rollout_logprobs", "temperatures"):
            assert torch.equal(getattr(g, f)[i, :n], getattr(g, f)[p, :n]), f
        assert torch.equal(g.prompt_ids[i], g.prompt_ids[p])
    assert torch.equal(res.rewards, ex["reward_correct"])
    assert torch.equal(res.rewards, torch.tensor([float(len(t) % 2 == 0) for t in g.texts]))
    # the predictor learned from this step; the prompts' root counts grew by their root episodes
    assert s.predictor.w.tolist() != [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert sum(v[1] for v in s.prompt_stats.values()) == res.metrics["trace/root_rollouts"]


@pytest.mark.parametrize("share,n", [(1.0, 2), (0.5, 3), (0.1, 5)])
def test_budget_is_exact_for_any_share(tiny_engine, echo_env, share, n):
    prompts = [[5, 6, 7], [8, 9]]
    res = _sampler(n, root_share=share).sample(tiny_engine, prompts, SP, SamplerContext(score=_score([]), step=2))
    assert res.generation.response_ids.shape[0] == 2 * n == res.rollouts_spent
    assert res.metrics["trace/root_rollouts"] >= 2  # min_roots per prompt
    if share == 1.0:
        assert res.metrics["trace/prefix_rollouts"] == 0


def test_checkpoint_round_trip_of_the_predictor(tiny_engine, echo_env):
    s = _sampler(4)
    s.sample(tiny_engine, [[5, 6, 7], [8, 9]], SP, SamplerContext(score=_score([]), step=1, prompt_indices=[3, 7]))
    state = s.state_dict()
    t = _sampler(4)
    t.load_state_dict(json.loads(json.dumps(state)))  # plain values only
    assert t.predictor.w.tolist() == s.predictor.w.tolist() and t.prompt_stats == s.prompt_stats
    assert set(t.prompt_stats) == {3, 7}
    x = torch.tensor([t.feature_vector((1, 1, 0, 20), t.prompt_rate_logit(3))], dtype=torch.float64)
    assert torch.equal(t.predictor.predict(x), s.predictor.predict(x))
    t.load_state_dict({})  # a fresh run's empty state changes nothing
    assert t.predictor.w.tolist() == s.predictor.w.tolist()
    u = _sampler(4, features=["bias", "depth"])
    with pytest.raises(ValueError, match="Fix: resume with sampler.params.features"):
        u.load_state_dict(state)


def test_one_rollout_per_prompt_is_plain_episodes_and_learns_nothing(tiny_engine, echo_env):
    s = _sampler(4)
    w = s.predictor.w.clone()
    res = s.sample(tiny_engine, [[5, 6], [7, 8]], SP, SamplerContext(score=_score([]), step=0, rollout_counts=[1, 1]))
    assert res.generation.response_ids.shape[0] == 2 and torch.equal(s.predictor.w, w) and not s.prompt_stats


# ------------------------------------------------------------------ advantages over all the leaves of a root
def test_grpo_over_all_leaves_of_a_root_by_hand():
    from rlpost.algos.advantages import AdvantageInput, compute_advantages

    # root 0 has 4 leaves (2 roots + 2 continuations), rewards 1, 0, 0, 1; root 1 has 2 leaves, 1 and 0
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    inp = AdvantageInput(rewards=r, response_mask=torch.ones(6, 2), group_index=torch.tensor([0, 0, 0, 0, 1, 1]))
    out = compute_advantages("grpo", inp)
    s0 = math.sqrt(4 * 0.25 / 3)  # Bessel-corrected std of (1, 0, 0, 1)
    s1 = math.sqrt(0.5)
    want = [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, 0.5 / s1, -0.5 / s1]
    assert out.advantages[:, 0].tolist() == pytest.approx(want, rel=1e-4)


# ------------------------------------------------------------------ config errors
def test_config_errors(compose):
    from rlpost.config.compose import validate_config
    from rlpost.core.errors import ConfigError
    from rlpost.samplers.base import build_sampler

    ok = compose(tiny_overrides("sampler=trace_tree"))
    assert ok.sampler.name == "trace_tree"
    with pytest.raises(ConfigError, match="root_shar"):
        validate_config(compose(tiny_overrides("sampler=trace_tree", "+sampler.params.root_shar=0.5")))
    for over, msg in [("sampler.params.root_share=0", "root_share"), ("sampler.params.branching=arpo", "branching=none"),
                      ("sampler.params.features=[bias,entropy]", "each must be one of")]:
        cfg = compose(tiny_overrides("sampler=trace_tree", over))
        with pytest.raises(ConfigError, match=msg):
            build_sampler(cfg.sampler, cfg.algo.n_samples_per_prompt)
    with pytest.raises(ConfigError, match="n_samples_per_prompt=4"):
        build_sampler(ok.sampler, 1)
    # turn-matching estimators accept the tree (it is made of episodes); a single-turn sampler is refused
    from rlpost.methods.base import MethodSet

    MethodSet.for_config(compose(tiny_overrides("sampler=trace_tree", "algo=rtmc")))
    with pytest.raises(ConfigError, match="single-turn rows"):
        MethodSet.for_config(compose(tiny_overrides("sampler=group", "algo=rtmc")))
    assert set(FEATURES) == set(build_sampler(ok.sampler, 4).predictor.features)


# ------------------------------------------------------------------ one training step of the preset
def test_one_step_on_calculator_episodes_tiny(compose, tmp_path):
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("sampler=trace_tree", "task=multiply", "steps=1", "eval.at_end=false", "eval.every=0",
                                 "sampler.params.max_total_tokens=40", "checkpoint.every=1"))
    train(cfg, tmp_path / "t")
    rows = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    m = next(r for r in rows if "trace/root_rollouts" in r)
    assert m["trace/root_rollouts"] + m["trace/prefix_rollouts"] == 16  # 4 prompts x 4
    assert math.isfinite(m["trace/predictor_loss"]) and "episode/turns_mean" in m
    state = torch.load(next((tmp_path / "t" / "checkpoints").glob("step_*")) / "state.pt", weights_only=False)
    sampler_state = state["sampler"]
    assert len(sampler_state["predictor"]["w"]) == len(FEATURES) and sampler_state["prompt_stats"]
