"""HDL (sampler): the hindsight shift of a root, the branch points at its largest |shift|, suffix-only
loss, one scoring per row, and the hindsight context. Moved unchanged from tests/test_methods_pope_hdl_seed_ripo.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fake_engine import FakeEngine, scorer

from rlpost.rollout.base import SamplingParams
from rlpost.samplers import SAMPLERS
from rlpost.samplers.base import SamplerContext, generate_groups, score_rows

from rlpost.samplers.hdl import context_logprobs


PARAMS = SamplingParams(max_new_tokens=6, seed=3)


from hindsight_model import LN20, LN40_78, V, HindsightModel  # noqa: E402,F401  (tests/hindsight_model.py)


def expected_shift(resp):
    """Hand value of the marker-induced shift of each response token (the first one follows the prompt's 9)."""
    out = [0.0]
    for prev, y in zip(resp[:-1], resp[1:]):
        out.append((LN20 if y == 6 else LN40_78) if prev == 7 else 0.0)
    return out


# ------------------------------------------------------------------------------------------- HDL
def _root_with_seven(eng, prompts):
    for seed in range(200):
        p = dataclasses.replace(PARAMS, seed=seed)
        g = eng.generate(prompts, p)
        ids = g.response_ids[0][g.response_mask[0] > 0].tolist()
        if 7 in ids[:-2]:
            eng.calls.clear()
            return p
    raise AssertionError("no seed gives a root with a 7")


def test_context_logprobs_hand_values():
    m = HindsightModel()
    plain = context_logprobs(m, [[1, 9]], [[7, 6, 7, 5]])[0]
    assert torch.allclose(plain, torch.full((4,), -math.log(40.0)))
    marked = context_logprobs(m, [[30, 1, 9]], [[7, 6, 7, 5]])[0]
    assert torch.allclose(marked - plain, torch.tensor([0.0, LN20, 0.0, LN40_78]), atol=1e-6)
    with pytest.raises(ValueError, match="prompts"):
        context_logprobs(m, [[1]], [])


def test_hdl_branch_points_are_the_largest_hindsight_shift_and_only_suffixes_carry_loss():
    eng = FakeEngine({1: 0.5}, resp_len=6, model=HindsightModel())
    prompts = [[1, 9]]
    params = _root_with_seven(eng, prompts)
    # "xx{verdict}" tokenises to marker ids (x = 27) for the fake tokenizer
    s = SAMPLERS.get("hdl")(4, n_roots=1, n_branch_points=1, feedback="xx{verdict}", reflection_tokens=0)
    calls = []
    ctx = SamplerContext(score=scorer(calls=calls), seed=0, prompt_indices=[0])
    r = s.sample(eng, prompts, params, ctx)
    g = r.generation
    root = g.response_ids[0][g.response_mask[0] > 0].tolist()
    # the root's shift, by hand: ln 20 / ln(40/78) after each 7, 0 elsewhere (the verdict text is all markers here)
    shift = s._last_shift[0][: len(root)]
    assert torch.allclose(shift, torch.tensor(expected_shift(root)), atol=1e-6)
    t_star = max(range(1, len(root)), key=lambda t: (abs(expected_shift(root)[t]), -t))
    pre = r.extras["shared_prefix_len"].tolist()
    assert pre == [0, t_star, t_star, t_star]  # 3 continuations, all from the one branch point
    for b in range(1, 4):
        prompt = g.prompt_ids[b][g.prompt_mask[b] > 0].tolist()
        suffix = g.response_ids[b][g.response_mask[b] > 0].tolist()
        assert prompt == [1, 9] + root[:t_star]  # original context, no feedback, plus the root's prefix
        assert int(g.response_mask[b].sum()) == len(suffix) <= 6 - t_star  # loss on the new suffix only
        assert g.texts[b] == eng.tokenizer.decode(root[:t_star] + suffix)  # scored as prefix + suffix
    # every row scored exactly once (the root before branching, then the 3 continuations)
    assert calls == [1, 3] and r.rewards.shape == (4,) and r.rollouts_spent == 4
    assert r.rewards.tolist() == [1.0 if t.startswith("1") else 0.0 for t in g.texts]
    assert r.extras["reward_correct"].tolist() == r.rewards.tolist()


def test_hdl_spreads_continuations_round_robin_over_branch_points_and_needs_a_model():
    s = SAMPLERS.get("hdl")(8, n_roots=2, n_branch_points=2)
    ent = torch.tensor([0.0, 0.1, 3.0, 0.2, 2.0, 0.0])
    assert s.fork_points(None, [5] * 6, ent, 3) == [2, 4, 2]  # top-2 |shift| positions, cycled
    assert s.fork_points(None, [5], ent[:1], 3) == []  # too short to branch
    with pytest.raises(ValueError, match="rollout=hf"):
        s.sample(FakeEngine({1: 0.5}), [[1, 9]], PARAMS, SamplerContext(score=scorer()))
    with pytest.raises(ValueError, match="verdict"):
        SAMPLERS.get("hdl")(4, feedback="no placeholder")
    with pytest.raises(ValueError, match="n_branch_points"):
        SAMPLERS.get("hdl")(4, n_branch_points=0)


def test_hdl_verdict_follows_the_root_reward():
    # only a feedback with 'z' (id 29 >= 24) carries a marker ("Correct"/"Incorrect" map below 24): the
    # marker-free hindsight context leaves the root's log-probs unchanged, so its shift is exactly 0
    eng = FakeEngine({1: 0.0}, resp_len=6, model=HindsightModel())
    s = SAMPLERS.get("hdl")(2, n_roots=1, feedback="{verdict}", reflection_tokens=0)
    roots = generate_groups(eng, [[1, 9]], [1], _root_with_seven(eng, [[1, 9]]))
    score_rows(SamplerContext(score=scorer()), roots)
    assert roots.rewards.tolist() == [0.0]
    tok = eng.tokenizer
    assert min(tok.encode("incorrect")) < 24 and max(tok.encode("correct")) < 24
    d = s.hindsight_shift(eng, [[1, 9]], roots)
    assert torch.equal(d, torch.zeros_like(d))
    # the same root judged correct under a feedback that carries a marker: the hand-computed shift
    roots.rewards = torch.tensor([1.0])
    root = roots.generation.response_ids[0][roots.generation.response_mask[0] > 0].tolist()
    d1 = SAMPLERS.get("hdl")(2, n_roots=1, feedback="z{verdict}", reflection_tokens=0).hindsight_shift(eng, [[1, 9]], roots)
    assert torch.allclose(d1[0, : len(root)], torch.tensor(expected_shift(root)), atol=1e-6)
    assert d1.abs().sum() >= abs(LN40_78) - 1e-6  # the root holds a 7 before its last token: a non-zero shift
    assert torch.equal(s.hindsight_shift(eng, [[1, 9]], roots), torch.zeros_like(d))  # "correct" has no marker


def test_hdl_hindsight_context_is_feedback_then_the_policys_reflection():
    eng = FakeEngine({1: 0.0}, resp_len=5, model=HindsightModel())
    s = SAMPLERS.get("hdl")(4, n_roots=1, reflection_tokens=4)
    roots = generate_groups(eng, [[1, 9]], [1], PARAMS)
    score_rows(SamplerContext(score=scorer()), roots)
    s._params = PARAMS
    n_calls = len(eng.calls)
    (h,) = s.hindsight_contexts(eng, [[1, 9]], roots)
    assert len(eng.calls) == n_calls + 1 and len(eng.calls[-1]) == 1  # one reflection per root, one engine call
    ask = eng.tokenizer.decode(eng.calls[-1][0])
    # (the fake tokenizer drops ']', its id being the pad id 0)
    assert "[A completed attempt" in ask and roots.generation.texts[0] in ask and "Incorrect." in ask
    text = eng.tokenizer.decode(h)
    assert text.startswith("[Record\nIncorrect.\n\n") and text.endswith("\n")  # h = [f; r]
    assert len(text) > len("[Record\nIncorrect.\n\n\n")  # the reflection is there
    with pytest.raises(ValueError, match="reflection_tokens"):
        SAMPLERS.get("hdl")(4, reflection_tokens=-1)
