"""Selector rules on synthetic reward streams (prompt i succeeds with a known probability)."""

import numpy as np
import pytest
import torch

from fake_engine import FakeEngine, correct, scorer
from rlpost.rollout.base import SamplingParams
from rlpost.samplers import SAMPLERS
from rlpost.run.collect import collect_rollouts
from rlpost.selectors import SELECTORS, build_selector
from rlpost.selectors.base import Role, append_history, pack_state, success_rate, unpack_state
from rlpost.selectors.mixture import Hint, fit_irt_difficulty, make_hint_fn


def stream(sel, p, steps, n=8, seed=0):
    """Run ``sel`` for ``steps`` on Bernoulli(p[i]) rewards; return selection counts."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(len(p))
    for t in range(steps):
        idx = sel.select(t)
        assert len(idx) == sel.prompts_per_step or (sel.plays(Role.FILTER) and len(idx) > sel.prompts_per_step)
        counts[idx] += 1
        sel.update(idx, [(rng.random(n) < p[i]).astype(float).tolist() for i in idx])
    return counts


# 40 prompts: 10 never solved, 10 always solved, 10 near 0.5, 10 at 0.9
P = np.array([0.0] * 10 + [1.0] * 10 + [0.5] * 10 + [0.9] * 10)
MID = slice(20, 30)


def share_mid(counts):
    return counts[MID].sum() / counts.sum()


def test_uniform_baseline_share():
    c = stream(SELECTORS.get("uniform")(40, 8, seed=1), P, 50)
    assert share_mid(c) == pytest.approx(0.25, abs=0.02)


@pytest.mark.parametrize("name,least", [("vade", 0.4), ("bots", 0.4), ("cures", 0.33), ("dps", 0.4), ("hive", 0.4), ("cdas", 0.4)])
def test_informative_selectors_concentrate_on_mid_success_prompts(name, least):
    sel = SELECTORS.get(name)(40, 8, seed=1)
    c = stream(sel, P, 60)
    # uniform gives 0.25; every learning-edge selector must do clearly better
    # (cures only re-weights by sqrt(m(1-m)) and keeps a floor, so its margin is smaller)
    assert share_mid(c) > least, (name, share_mid(c))


def test_vade_thompson_score_and_decay():
    sel = SELECTORS.get("vade")(3, 1, seed=0, slow_decay=0.5, fast_decay=1.0)
    sel.update([0], [[1.0, 1.0, 1.0, 1.0]])
    assert sel.alpha[0] == pytest.approx(1 + 0.5 * 0 + 4) and sel.beta[0] == pytest.approx(1.0)
    sel.update([1], [[0.0]])
    assert sel.alpha[0] == pytest.approx(1 + 0.5 * 4)  # slow decay toward the prior
    st = sel.state_dict()
    a = [sel.select(5) for _ in range(5)]
    sel.load_state_dict(st)
    assert [sel.select(5) for _ in range(5)] == a  # resume selects the same prompts


@pytest.mark.parametrize("name", sorted(SELECTORS.names()))
def test_every_selector_resumes_identically(name):
    mk = lambda: build_selector(type("C", (), {"name": name, "prompts_per_step": 4, "params": {}})(), 30, 3)  # noqa: E731
    a, b = mk(), mk()
    p = np.linspace(0, 1, 30)
    stream(a, p, 5)
    b.load_state_dict(a.state_dict())
    rng = np.random.default_rng(9)
    for t in range(5, 9):
        ia, ib = a.select(t), b.select(t)
        assert ia == ib
        r = [(rng.random(4) < p[i]).astype(float).tolist() for i in ia]
        a.update(ia, r)
        b.update(ib, r)


def test_greso_skips_prompts_with_zero_variance_streaks():
    sel = SELECTORS.get("greso")(40, 8, seed=0, p_easy=0.3, p_hard=0.3, step_size=0.0)
    stream(sel, P, 30)
    assert sel.streak[:20].min() >= 1 and sel.streak[20:30].max() <= 2
    c = stream(sel, P, 40)
    assert share_mid(c) > 0.35
    assert sel.keep_probability(0) == pytest.approx(0.3 ** sel.streak[0])
    assert sel.keep_probability(25) <= 1.0


def test_greso_adapts_exploration_toward_target():
    sel = SELECTORS.get("greso")(10, 4, seed=0, p_easy=0.5, target_easy=0.0, step_size=0.1)
    sel.update([0, 1, 2, 3], [[1, 1], [1, 1], [0, 1], [0, 1]])
    assert sel.p["easy"] == pytest.approx(0.4) and sel.p["hard"] == pytest.approx(0.6)


def test_dps_learns_transitions_and_predicts_partial():
    sel = SELECTORS.get("dps")(3, 1, seed=0, explore=0.0, obs_noise=0.0)
    for _ in range(5):
        sel.update([0, 1, 2], [[0, 0], [0, 1], [1, 1]])
    T = sel.transition
    assert T[1, 1] > T[1, 0] and T[0, 0] > T[0, 1]
    assert sel.select(0) == [1]


def test_cdas_competence_tracks_accuracy_and_symmetric_pick():
    sel = SELECTORS.get("cdas")(40, 8, seed=0)
    stream(sel, P, 40)
    D = sel.difficulty
    assert D[:10].mean() > D[20:30].mean() > D[10:20].mean()
    idx = sel.select(99)
    assert sum(D[i] >= sel.theta for i in idx) == 4


def test_cures_allocates_more_rollouts_to_mid_prompts():
    sel = build_selector(type("C", (), {"name": "cures", "prompts_per_step": 2, "params": {}})(), 4, 0, n_samples=8)
    for _ in range(5):
        sel.update([0, 1], [[1.0] * 8, [1.0, 0.0] * 4])
    c = sel.rollout_counts([0, 1])
    assert sum(c) == 16 and c[1] > c[0] >= 2


def test_bots_implicit_evidence_moves_unselected_prompts():
    sel = SELECTORS.get("bots")(3, 1, seed=0, implicit_weight=1.0, decay=1.0)
    sel.update([0, 1], [[0.0, 1.0], [0.0, 1.0]])
    before = sel.mean[1]
    tot = sel.alpha[1] + sel.beta[1]
    sel.update([0], [[1.0] * 8])  # prompt 0 improves a lot
    assert sel.mean[1] > before and sel.alpha[1] + sel.beta[1] == pytest.approx(tot)
    assert sel.mean[2] == pytest.approx(0.5)  # never seen: untouched


def test_hive_prunes_prompts_with_stale_history():
    ent = {i: 1.0 for i in range(6)}
    sel = SELECTORS.get("hive")(6, 2, seed=0, pool_multiplier=3, entropy_threshold=0.1)
    sel.attach(prompt_entropy=lambda idx: [ent[i] for i in idx])
    for _ in range(3):
        idx = sel.select(0)
        sel.update(idx, [[0.0, 1.0] if i < 2 else [1.0, 1.0] for i in idx])
    ent[0] = 0.5  # the policy became confident on prompt 0: its history is stale
    hist0 = 0 in sel.hist
    idx = sel.select(1)
    assert hist0 and sel.pruned >= 1 and 0 not in sel.hist


def test_history_bookkeeping_helpers():
    assert success_rate([1.0, 0.4, 0.5, 0.0], threshold=0.5) == 0.5  # 1.0 and 0.5 count
    assert success_rate([0.2, 0.9, 0.9], threshold=0.9) == pytest.approx(2 / 3)
    assert success_rate([], threshold=0.5) == 0.0
    store = {}
    for v in (0.1, 0.2, 0.3, 0.4):
        append_history(store, 3, v, window=2)
    append_history(store, np.int64(5), [0.3, 1.0, 8.0])  # no window: everything is kept
    append_history(store, 5, [0.1, 0.5, 8.0])
    assert store == {3: [0.3, 0.4], 5: [[0.3, 1.0, 8.0], [0.1, 0.5, 8.0]]}
    assert all(type(k) is int for k in store)
    packed = pack_state(store)
    assert packed == {"3": [0.3, 0.4], "5": [[0.3, 1.0, 8.0], [0.1, 0.5, 8.0]]}
    packed["3"].append(9.9)  # a copy: the live history is untouched
    assert store[3] == [0.3, 0.4]
    arr = unpack_state([[1, 0], [0, 2]], like=np.zeros((1, 1), dtype=np.int64))
    assert arr.dtype == np.int64 and arr.tolist() == [[1, 0], [0, 2]]
    assert unpack_state({"7": 0.5}, like={}) == {7: 0.5}
    with pytest.raises(TypeError):
        pack_state([1, 2])


@pytest.mark.parametrize("name", SELECTORS.names())
def test_state_dict_round_trip_continues_identically(name, tmp_path):
    """A selector restored from a saved state (torch.save, as in checkpoints) makes the same choices."""
    ent = {i: 1.0 + 0.05 * i for i in range(20)}
    rng = np.random.default_rng(0)

    def make(seed):
        sel = SELECTORS.get(name)(20, 4, seed=seed)
        sel.attach(prompt_entropy=lambda idx: [ent[i] for i in idx])
        return sel

    def rewards(idx):
        return [(rng.random(4) < P[2 * i]).astype(float).tolist() for i in idx]

    a = make(seed=1)
    for t in range(5):
        idx = a.select(t)
        a.update(idx, rewards(idx))
    torch.save(a.state_dict(), tmp_path / "sel.pt")
    b = make(seed=2)
    b.load_state_dict(torch.load(tmp_path / "sel.pt", weights_only=False))
    for t in range(5, 10):
        ent[t] *= 1.5  # HIVE: some prompt entropies move
        ia, ib = a.select(t), b.select(t)
        assert ia == ib, (t, ia, ib)
        r = rewards(ia)
        a.update(ia, r)
        b.update(ib, r)
    assert a.metrics() == b.metrics()


def test_hive_entropy_pruning_rule_on_synthetic_entropies():
    """Stale iff |e - e_old| > entropy_threshold * |e_old| (strict); pruned prompts come back as unseen."""
    ent = {0: 1.0, 1: 2.0, 2: 0.5, 3: 4.0}
    calls = []

    def prompt_entropy(idx):
        calls.append(list(idx))
        return [ent[i] for i in idx]

    sel = SELECTORS.get("hive")(4, 2, seed=0, pool_multiplier=2, entropy_threshold=0.125)
    sel.attach(prompt_entropy=prompt_entropy)
    sel.select(0)
    assert sorted(calls[-1]) == [0, 1, 2, 3]  # the pool (2 x 2 prompts) is checked
    sel.update([0, 1, 2, 3], [[1.0, 0.0]] * 4)  # history and entropy recorded for all four
    assert sel.entropy_at == ent and sel.pruned == 0
    # relative changes (dyadic, so exact): 1/16 < 1/8 keep; 1/8 == 1/8 keep (strict >); 1/4 and 3/16 > 1/8 prune
    ent.update({0: 1.0625, 1: 2.25, 2: 0.375, 3: 4.75})
    picked = sel.select(1)
    assert sorted(picked) == [0, 1]
    assert sel.pruned == 2 and sel.skipped == 2
    assert sorted(sel.hist) == [0, 1] and sorted(sel.entropy_at) == [0, 1]
    m = sel.metrics()
    assert m["selector/pruned_stale"] == 2.0 and m["selector/entropy_checked"] == 4.0
    assert m["selector/prompt_entropy_mean"] == pytest.approx((1.0625 + 2.25 + 0.375 + 4.75) / 4)
    sel.update(picked, [[1.0, 0.0]] * 2)
    assert sel.entropy_at == {0: 1.0625, 1: 2.25}  # re-anchored at the entropy they were selected with
    # unchanged entropies: nothing is stale, and the cleared prompts 2, 3 rank first again (unseen)
    assert sorted(sel.select(2)) == [2, 3] and sel.pruned == 0


def test_hive_without_entropy_function_runs_stage_one_only():
    sel = SELECTORS.get("hive")(4, 2, seed=0, pool_multiplier=2, entropy_threshold=0.0)
    sel.update([0, 1], [[1.0, 1.0], [0.0, 0.0]])  # solved / unsolved: utility 0.25 < unseen 0.5
    assert sorted(sel.select(0)) == [2, 3] and sel.pruned == 0
    assert "selector/entropy_checked" not in sel.metrics()


def test_domain_mixture_keeps_effective_ratio_on_target():
    labels = ["a"] * 20 + ["b"] * 20
    p = np.array([0.97] * 20 + [0.5] * 20)  # domain a rarely gives mixed groups
    sel = SELECTORS.get("domain_mixture")(40, 10, seed=0, domains=labels, ema=0.7)
    c = stream(sel, p, 40, n=4)
    assert c[:20].sum() > 1.5 * c[20:].sum()  # over-sample the low-signal domain
    assert sel.realised["a"] == pytest.approx(0.5, abs=0.2)
    m = sel.metrics()
    assert m["selector/quota_a"] + m["selector/quota_b"] == 10 and m["selector/quota_a"] > m["selector/quota_b"]
    assert m["selector/effective_a"] < m["selector/effective_b"]


def test_seele_irt_fit_and_hint_rule():
    b = fit_irt_difficulty([0.0, 0.5, 1.0], [0.05, 0.5, 0.95], [50, 50, 50], slope=6.0, prior_mean=0.0, prior_sd=10.0)
    assert b == pytest.approx(0.5, abs=0.03)
    sel = SELECTORS.get("seele")(4, 2, seed=0, target=0.5, slope=6.0, prior_b=0.3)
    assert sel.hint_fractions([0])[0] == pytest.approx(0.3)
    sel.update([0], [[0.0] * 8])  # failed with the 0.3 hint: needs more
    h = sel.hint_fractions([0])[0]
    assert h > 0.3
    sel.update([0], [[1.0] * 8])
    assert sel.hint_fractions([0])[0] < h
    sel.hint_fractions([1, 2])  # unseen prompts: the prior's hint; the metric is this step's mean
    assert sel.metrics()["selector/hint_mean"] == pytest.approx(0.3)


PARAMS = SamplingParams(max_new_tokens=6, seed=3)


def driver_env(p):
    eng = FakeEngine({i + 100: pi for i, pi in enumerate(p)})
    return eng, (lambda i: [i + 100, 7]), scorer()


def test_dynamic_filter_never_returns_zero_variance_group_while_candidates_remain():
    p = [0.0] * 12 + [0.5] * 4 + [1.0] * 14
    eng, enc, score = driver_env(p)
    sel = SELECTORS.get("dynamic_filter")(30, 4, seed=0, oversample=1.5, max_rounds=30)
    sam = SAMPLERS.get("group")(6)
    for step in range(6):
        out = collect_rollouts(sel, sam, eng, PARAMS, step=step, encode=enc, score=score)
        assert len(out.prompt_indices) == 4
        for g in out.result.group_index.unique():
            r = out.rewards[out.result.group_index == g]
            assert r.max() > r.min()
        assert out.metrics["rollout/batch_zero_var_frac"] == 0.0
        assert out.metrics["rollout/spent"] >= 24 and out.metrics["rollout/prompts_skipped"] >= 0
        assert all(12 <= i < 16 for i in out.prompt_indices)
        assert len(out.observed) * 6 == out.metrics["rollout/spent"]
        out.update_selector(sel)


def test_driver_metrics_and_row_prompt_index_for_uniform():
    p = [0.0, 0.5, 1.0, 0.5]
    eng, enc, score = driver_env(p)
    sel = SELECTORS.get("uniform")(4, 4, seed=0)
    out = collect_rollouts(sel, SAMPLERS.get("group")(8), eng, PARAMS, step=0, encode=enc, score=score)
    m = out.metrics
    assert m["rollout/spent"] == 32 and m["rollout/batch_prompts"] == 4
    assert m["rollout/zero_var_frac"] == pytest.approx(0.5)
    assert m["rollout/effective_batch"] == 16
    rows = out.row_prompt_index
    assert all(eng.calls[0][r][0] - 100 == int(rows[r]) for r in range(32))


def test_cures_counts_reach_the_sampler_through_the_driver():
    eng, enc, score = driver_env([0.5] * 4)
    sel = SELECTORS.get("cures")(4, 2, seed=0, n_samples=4)
    sel.alpha[:] = [1, 1, 50, 50]
    sel.beta[:] = [50, 1, 1, 50]
    out = collect_rollouts(sel, SAMPLERS.get("group")(4), eng, PARAMS, step=0, encode=enc, score=score)
    counts = torch.bincount(out.result.positions()).tolist()
    assert sum(counts) == 8 and counts == sel.rollout_counts(out.prompt_indices)


def _five_char_hint(i, f):
    # fraction 0.5 -> 5 tokens; the text starts with the fake task's correct answer "1"
    k = int(10 * f)
    return Hint([3] + [99] * (k - 1), "1" + "x" * (k - 1))


@pytest.mark.parametrize("sampler", ["group", "vigor"])
def test_seele_hints_are_appended_to_prompts_and_scored_with_the_completion(sampler):
    # the engine never answers correctly on its own, and every hint begins with the
    # correct answer: a completion is scored as hint + completion, so all rewards are 1
    # (they were 0 when only the completion was scored), both when the driver scores and
    # when the sampler scores inside its rounds (vigor)
    eng, enc, score = driver_env([0.0] * 4)
    sel = SELECTORS.get("seele")(4, 2, seed=0, prior_b=0.5)
    sam = SAMPLERS.get("group")(2) if sampler == "group" else SAMPLERS.get("vigor")(4, n_init=2, increment=2)
    out = collect_rollouts(sel, sam, eng, PARAMS, step=0, encode=enc, score=score, hint=_five_char_hint)
    assert all(c[-5:] == [3] + [99] * 4 and len(c) == 7 for call in eng.calls for c in call)
    assert out.rewards.tolist() == [1.0] * len(out.rewards)
    assert all(t.startswith("1xxxx") for t in out.result.generation.texts)
    assert not any(t[5:].startswith("1") for t in out.result.generation.texts)  # the completions alone are wrong


def test_make_hint_fn_cuts_the_worked_solution_by_characters():
    from rlpost.tasks.base import Example

    ex = [Example(index=0, question="Calculate 58 + 3.", answer="61", meta={})]
    tok = __import__("fake_engine").CharTok()
    fn = make_hint_fn(ex, tok, solution=lambda e: "abcdefghij")
    assert fn(0, 0.0) == Hint([], "")
    h = fn(0, 0.34)
    assert h.text == "abc" and tok.decode(h.ids) == "abc"
    assert make_hint_fn(ex, tok)(0, 1.0).text == "61"  # no worked solution: the bare answer


def test_popo_replays_mixed_groups_instead_of_zero_variance_ones():
    p = [0.5] * 4 + [1.0] * 4
    eng, enc, score = driver_env(p)
    sel = SELECTORS.get("popo")(8, 4, seed=0)
    sam = SAMPLERS.get("group")(6)
    replayed = 0
    for step in range(6):
        out = collect_rollouts(sel, sam, eng, PARAMS, step=step, encode=enc, score=score)
        gi = out.result.group_index
        zero = sum(1 for g in gi.unique() if out.rewards[gi == g].max() == out.rewards[gi == g].min())
        replayed += sel.replayed
        if step >= 2:
            assert zero == 0 or len(sel.buffer) == 0
        assert out.metrics["rollout/spent"] == 24  # no extra rollouts
        ages = out.result.extras["replay_age"]
        assert ages.shape[0] == gi.shape[0]
        # replayed rows answer the prompt they are labelled with
        for r in range(gi.shape[0]):
            assert out.result.generation.prompt_ids[r][-2].item() - 100 == int(out.row_prompt_index[r])
        out.update_selector(sel)
    assert replayed > 0


def test_dynamic_filter_falls_back_when_every_round_is_filtered():
    eng, enc, score = driver_env([0.0] * 10)
    sel = SELECTORS.get("dynamic_filter")(10, 2, seed=0, max_rounds=3)
    out = collect_rollouts(sel, SAMPLERS.get("group")(4), eng, PARAMS, step=0, encode=enc, score=score)
    assert out.metrics["rollout/filter_exhausted"] == 1.0 and len(out.prompt_indices) == 2
    assert out.metrics["rollout/rounds"] == 3 and out.metrics["rollout/spent"] == 3 * 3 * 4


def test_selector_config_errors_and_domain_targets():
    from types import SimpleNamespace

    from rlpost.core.errors import ConfigError
    from rlpost.selectors.base import build_selector
    from rlpost.tasks.base import Example

    with pytest.raises(ConfigError, match="takes no parameters"):
        build_selector(SimpleNamespace(name="uniform", params={"foo": 1}, prompts_per_step=2), 8, 0)
    with pytest.raises(ConfigError, match="target must be in"):
        build_selector(SimpleNamespace(name="seele", params={"target": 1.5}, prompts_per_step=2), 8, 0)
    ex = [Example(index=i, question="q", answer="1", meta={"domain": "ab"[i % 2]}) for i in range(8)]
    sel = SELECTORS.get("domain_mixture")(8, 2, seed=0, targets={"chainsum": 1})
    with pytest.raises(ConfigError, match=r"\['chainsum'\].*\['a', 'b'\]"):
        sel.attach(examples=ex)
    # explicit domains win over the examples' labels
    sel = SELECTORS.get("domain_mixture")(8, 2, seed=0, domains=["x"] * 4 + ["y"] * 4)
    sel.attach(examples=ex)
    assert sel.labels == ["x"] * 4 + ["y"] * 4


def test_driver_refuses_an_empty_selection():
    eng, enc, score = driver_env([0.5] * 4)
    sel = SELECTORS.get("uniform")(4, 2, seed=0)
    sel.select = lambda step: []
    with pytest.raises(ValueError, match="chose no prompts"):
        collect_rollouts(sel, SAMPLERS.get("group")(2), eng, PARAMS, step=0, encode=enc, score=score)
