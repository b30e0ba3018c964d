"""POPE (selector), HDL (sampler), SEED (advantage estimator): hand-computed values and exact invariants.

POPE: which prompts get an oracle prefix, how long it is, and that only the sampled
suffix is a response token (carries loss). HDL: the hindsight shift of a root, the
branch points at its largest |shift|, suffix-only loss, one scoring per row. SEED:
the loss ``PPO-clip + lambda * sigmoid(beta * Delta) * (l_skill - l_theta)``, its gradient, and the skill context.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fake_engine import CharTok, FakeEngine, scorer
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from rlpost.rollout.base import SamplingParams
from rlpost.samplers import SAMPLERS
from rlpost.samplers.base import SamplerContext, SampleResult, generate_groups, score_rows
from rlpost.run.collect import collect_rollouts
from rlpost.samplers.hdl import context_logprobs
from rlpost.selectors import SELECTORS
from rlpost.selectors.mixture import make_hint_fn

PARAMS = SamplingParams(max_new_tokens=6, seed=3)
V = 40
LN20, LN40_78 = math.log(20.0), math.log(40.0 / 78.0)


class HindsightModel(torch.nn.Module):
    """Fake causal LM over 40 tokens: uniform, except that once a *marker* token (id >= 24) has been
    read, the position after a 7 puts logit ln 39 on token 6 (p(6) = 1/2, every other token 1/78).

    So a context that starts with a marker shifts ``log p(y_t)`` by ``ln 20`` (y_t = 6) or
    ``ln(40/78)`` (else) exactly where ``y_{t-1} = 7``, and by 0 everywhere else.
    """

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, position_ids=None, **_):
        B, T = input_ids.shape
        seen = ((input_ids >= 24) & (attention_mask > 0 if attention_mask is not None else True)).long().cumsum(-1) > 0
        logits = torch.zeros(B, T, V)
        logits[..., 6] = torch.where(seen & (input_ids == 7), torch.tensor(math.log(39.0)), torch.tensor(0.0))

        class O:
            pass

        o = O()
        o.logits = logits
        return o


def expected_shift(resp):
    """Hand value of the marker-induced shift of each response token (the first one follows the prompt's 9)."""
    out = [0.0]
    for prev, y in zip(resp[:-1], resp[1:]):
        out.append((LN20 if y == 6 else LN40_78) if prev == 7 else 0.0)
    return out


# ------------------------------------------------------------------------------------------ POPE
def test_pope_state_machine_prefix_share_and_alternation():
    sel = SELECTORS.get("pope")(4, 2, seed=0, prefix_frac=0.25, prefix_step=0.25, max_prefix=0.6)
    assert sel.hint_fractions([0, 1]) == [0.0, 0.0]  # never seen: unguided first
    sel.update([0, 1], [[0.0] * 4, [0.0, 1.0, 0.0, 0.0]])  # prompt 0 solved 0/4 -> hard; prompt 1 solved once
    assert sel.is_hard(0) and not sel.is_hard(1)
    assert sel.hint_fractions([0, 1]) == [0.25, 0.0]  # only the hard prompt is guided
    assert sel.metrics()["selector/guided_frac"] == 0.5 and sel.metrics()["selector/prefix_mean"] == 0.25
    sel.update([0, 1], [[0.0] * 4, [0.0] * 4])  # guided visit solved nothing: the prefix grows; 1 turns hard
    assert sel.prefix[0] == 0.5 and sel.is_hard(1)
    assert sel.hint_fractions([0, 1]) == [0.0, 0.25]  # 0 alternates back to unguided, 1 gets its first prefix
    sel.update([0, 1], [[0.0] * 4, [1.0] * 4])  # 0 still hard unguided; 1 solved under guidance: its prefix stays
    assert sel.is_hard(0) and sel.prefix.get(1, 0.25) == 0.25
    assert sel.hint_fractions([0]) == [0.5]
    sel.update([0], [[0.0] * 4])  # guided at 0.5, still nothing: 0.5 + 0.25 capped at max_prefix 0.6
    assert sel.prefix[0] == 0.6
    assert sel.hint_fractions([0]) == [0.0]
    sel.update([0], [[1.0, 0, 0, 0]])  # solved without guidance: no longer hard, never guided again
    assert not sel.is_hard(0) and sel.hint_fractions([0]) == [0.0] and sel.hint_fractions([0]) == [0.0]
    # checkpoint round trip: a hard prompt whose last visit was unguided resumes with a guided one
    sel.update([3], [[0.0] * 4])
    s2 = SELECTORS.get("pope")(4, 2, seed=0)
    s2.load_state_dict(sel.state_dict())
    assert s2.prefix == {0: 0.6} and s2.is_hard(3) and s2.hint_fractions([3]) == [0.25]


@pytest.mark.parametrize("bad", [dict(prefix_frac=0.0), dict(prefix_frac=0.8, max_prefix=0.5), dict(prefix_step=-0.1)])
def test_pope_rejects_bad_parameters(bad):
    with pytest.raises(ValueError, match="pope"):
        SELECTORS.get("pope")(4, 2, seed=0, **bad)


def test_pope_guided_rows_condition_on_the_oracle_prefix_and_carry_loss_only_on_the_sampled_suffix():
    # the engine never answers "1..." by itself; the oracle solution "1abcdefgh" (9 chars) starts with the answer
    eng = FakeEngine({100: 0.0, 101: 0.0}, resp_len=6)
    enc, score = (lambda i: [i + 100, 7]), scorer()
    tok = CharTok()
    hint = make_hint_fn([None, None], tok, solution=lambda e: "1abcdefgh")
    sel = SELECTORS.get("pope")(2, 2, seed=0, prefix_frac=0.25)
    out = collect_rollouts(sel, SAMPLERS.get("group")(3), eng, PARAMS, step=0, encode=enc, score=score, hint=hint)
    assert out.rewards.tolist() == [0.0] * 6 and all(len(p) == 2 for p in eng.calls[0])  # unguided first
    out.update_selector(sel)
    out = collect_rollouts(sel, SAMPLERS.get("group")(3), eng, PARAMS, step=1, encode=enc, score=score, hint=hint)
    g = out.result.generation
    # prefix length: round(0.25 * 9) = 2 characters "1a" -> token ids [3, 4], appended to the prompt
    assert all(p[2:] == [3, 4] and len(p) == 4 for p in eng.calls[-1])
    for b in range(g.response_ids.shape[0]):
        prompt = g.prompt_ids[b][g.prompt_mask[b] > 0].tolist()
        resp = g.response_ids[b][g.response_mask[b] > 0].tolist()
        assert prompt[-2:] == [3, 4]  # the oracle prefix is context ...
        assert int(g.response_mask[b].sum()) == len(resp) == 6  # ... and the loss mask covers only the 6 sampled tokens
        assert g.texts[b] == "1a" + tok.decode(resp)  # scored as prefix + completion
    assert out.rewards.tolist() == [1.0] * 6  # guided rollouts earn reward the unguided ones never did
    assert sel.metrics()["selector/guided_frac"] == 1.0 and sel.metrics()["selector/prefix_mean"] == 0.25


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


# ------------------------------------------------------------------------------------------ SEED
def _seed_inp(lp, skill, adv, mask):
    lp = torch.tensor(lp, requires_grad=True)
    return lp, PolicyLossInput(logprobs=lp, old_logprobs=lp.detach().clone(), advantages=torch.tensor(adv), response_mask=torch.tensor(mask), extras={'teacher_logprobs': torch.tensor(skill)})


def test_seed_loss_is_ppo_clip_plus_gated_distillation_hand_values():
    # on-policy (ratio 1): PPO clip's value is -A; the OPD term is lambda * g * Delta, g = sigmoid(beta * Delta)
    lp, x = _seed_inp([[-1.0, -2.0, -0.5]], [[-0.8, -2.4, -9.0]], [[0.5, 0.5, 0.5]], [[1.0, 1.0, 0.0]])
    loss, m = compute_policy_loss("seed", x, opd_coef=0.1, gate_beta=5.0)
    g = [1 / (1 + math.exp(-5 * 0.2)), 1 / (1 + math.exp(-5 * -0.4))]  # Delta = +0.2, -0.4
    # (padding keeps PPO's unmasked -A, as ppo_clip's own matrix does; the OPD term is 0 there; aggregation masks it)
    want = torch.tensor([[-0.5 + 0.1 * g[0] * 0.2, -0.5 + 0.1 * g[1] * -0.4, -0.5]])
    assert torch.allclose(loss.detach(), want, atol=1e-6)
    assert float(m["seed/gate_mean"]) == pytest.approx((g[0] + g[1]) / 2, abs=1e-6)
    assert float(m["seed/skill_shift_mean"]) == pytest.approx(-0.1, abs=1e-6)
    # gradient per token: -A (PPO, ratio 1) - lambda * g (the gated NLL); nothing on padding
    (loss * x.response_mask).sum().backward()
    assert torch.allclose(lp.grad, torch.tensor([[-0.5 - 0.1 * g[0], -0.5 - 0.1 * g[1], 0.0]]), atol=1e-6)


def test_seed_loss_with_opd_coef_zero_is_ppo_clip_and_equal_contexts_give_gate_one_half():
    lp, x = _seed_inp([[-1.0, -2.0]], [[-1.0, -2.0]], [[1.0, -1.0]], [[1.0, 1.0]])
    a, _ = compute_policy_loss("seed", x, opd_coef=0.0)
    b, _ = compute_policy_loss("ppo_clip", x)
    assert torch.equal(a, b)
    _, m = compute_policy_loss("seed", x)
    assert float(m["seed/gate_mean"]) == 0.5 and float(m["seed/opd_term"]) == 0.0
    with pytest.raises(ValueError, match="skill"):
        compute_policy_loss("seed", dataclasses.replace(x, extras={}))


class MarkerTok:
    """Tokenizer stub: any non-empty text is the single marker token 30."""

    def encode(self, text, add_special_tokens=False):
        return [30] if text else []


def test_skill_contexts_put_the_skill_in_front_and_leave_empty_skills_out():
    from rlpost.algos.seed import skill_contexts

    assert skill_contexts(MarkerTok(), [[1, 9], [2]], ["use the rule", ""]) == [[30, 1, 9], [2]]
    # scored by the same kernel, an empty skill changes nothing and a marker gives the hand-computed shift
    m = HindsightModel()
    ctx = skill_contexts(MarkerTok(), [[1, 9], [2]], ["rule", ""])
    lp1 = context_logprobs(m, ctx, [[7, 6, 5], [7, 5]])
    lp0 = context_logprobs(m, [[1, 9], [2]], [[7, 6, 5], [7, 5]])
    assert torch.allclose(lp1[0] - lp0[0], torch.tensor([0.0, LN20, 0.0]), atol=1e-6)
    assert torch.equal(lp1[1], lp0[1])
    with pytest.raises(ValueError, match="skills"):
        skill_contexts(MarkerTok(), [[1]], [])


def test_seed_stage_writes_the_skill_logprobs_as_the_self_teacher(compose, monkeypatch):
    import types

    import rlpost.methods.seed as seed_method
    from rlpost.methods.base import MethodSet

    cfg = compose(["model=tiny", "algo.loss=seed", "algo.loss_params.skill_tokens=12"])
    ms = MethodSet.for_config(cfg)
    assert ms.names == ["seed"] and seed_method.skill_tokens(cfg.algo) == 12
    assert seed_method.skill_tokens(compose(["model=tiny"]).algo) == 0

    class B:
        response_mask = torch.tensor([[1.0, 1.0, 0.0]])
        prompt_index = torch.tensor([0])
        extras: dict = {}

    asked = []

    def fake(batch, qs, engine, logprobs, tok, sp, n):
        asked.append((qs, n))
        return torch.tensor([[-0.5, -1.5, 0.0]]), ["ab", ""]

    monkeypatch.setattr(seed_method, "batch_skill_logprobs", fake)
    run = types.SimpleNamespace(task=types.SimpleNamespace(user_message=lambda e: f"q{e}"), examples=[7], engine=None,
                                logprobs=None, tokenizer=None, sampling_params=lambda step: None, step=1)
    b = B()
    m = ms.prepare(b, run)
    assert asked == [(["q7"], 12)] and torch.equal(b.extras["teacher_logprobs"], torch.tensor([[-0.5, -1.5, 0.0]]))
    assert m["seed/skill_chars_mean"] == 1.0 and m["seed/skill_empty_frac"] == 0.5


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


# ------------------------------------------------------------------------------------------ RIPO
def test_ripo_isometric_bounds_hand_values():
    from rlpost.algos.ripo import isometric_clip_bounds

    old = torch.log(torch.tensor([[0.05, 0.8, 1e-4]]))
    lo, hi = isometric_clip_bounds(old, 0.05, 0.05, 0.5, 10.0)
    # sqrt(0.05 / 0.05) = 1 -> floor 1 - 0.5; sqrt(0.05 / 0.8) = 0.25; sqrt(0.05 / 1e-4) = 22.4 -> caps 0.5 / 9
    assert torch.allclose(lo, torch.tensor([[0.5, 0.25, 0.5]]), atol=1e-5)
    assert torch.allclose(hi, torch.tensor([[1.0, 0.25, 9.0]]), atol=1e-5)
    lo, hi = isometric_clip_bounds(old, 0.05, 0.05, None, None)
    assert torch.allclose(old.exp() * hi ** 2, torch.full((1, 3), 0.05), rtol=1e-4)  # isometric: p eps^2 = delta
    for bad in (dict(delta_low=0.0), dict(ratio_min=1.0), dict(ratio_max=1.0)):
        kw = dict(delta_low=0.05, delta_high=0.05, ratio_min=0.5, ratio_max=10.0) | bad
        with pytest.raises(ValueError, match="ripo"):
            isometric_clip_bounds(old, **kw)


def test_ripo_loss_clips_likely_tokens_tighter_than_rare_ones():
    # two tokens, both ratio 1.5 with A = 1: the likely token (p_old 0.8, eps 0.25) is clipped (no gradient),
    # the rare one (p_old 0.05, eps 1) is not; PPO's single eps 0.2 clips both
    old = torch.log(torch.tensor([[0.8, 0.05]]))
    lp = (old + math.log(1.5)).clone().requires_grad_(True)
    x = PolicyLossInput(logprobs=lp, old_logprobs=old, advantages=torch.ones(1, 2), response_mask=torch.ones(1, 2))
    loss, m = compute_policy_loss("ripo", x)
    assert torch.allclose(loss.detach(), torch.tensor([[-1.25, -1.5]]), atol=1e-5)  # -A * min(r, 1 + eps)
    loss.sum().backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -1.5]]), atol=1e-5)  # d(-r)/dlogp = -r on the unclipped one
    assert float(m["clip_frac_high"]) == 0.5 and float(m["ripo/eps_high_mean"]) == pytest.approx(0.625, abs=1e-5)
    ppo, pm = compute_policy_loss("ppo_clip", x)
    assert float(pm["clip_frac_high"]) == 1.0
