"""Sampler rules on a fake engine with known per-prompt success rates."""

import dataclasses

import torch
import pytest

from fake_engine import EntropyModel, FakeEngine, correct, scorer
from rlpost.rollout.base import SamplingParams
from rlpost.samplers import SAMPLERS, SamplerContext
from rlpost.core.apportion import apportion
from rlpost.samplers.adaptive import DarsSampler, PilotCommitSampler
from rlpost.samplers.base import group_reward_stats


def ctx_for(prompts, step=0, indices=None):
    return SamplerContext(score=scorer(), step=step, seed=0, prompt_indices=indices)


PARAMS = SamplingParams(max_new_tokens=6, seed=5)
SEED_WITH_SEVEN = 1


def make(name, n=8, **kw):
    return SAMPLERS.get(name)(n, **kw)


def test_group_and_single_counts_and_allocation():
    eng = FakeEngine({10: 0.5, 11: 0.5})
    prompts = [[10, 5], [11, 5]]
    r = make("group", 4).sample(eng, prompts, PARAMS, SamplerContext())
    assert r.group_index.tolist() == [0] * 4 + [1] * 4 and r.rollouts_spent == 8
    r = make("group", 4).sample(eng, prompts, PARAMS, SamplerContext(rollout_counts=[3, 1]))
    assert r.group_index.tolist() == [0, 0, 0, 1]
    r = make("single", 4).sample(eng, prompts, PARAMS, SamplerContext())
    assert r.group_index.tolist() == [0, 1]


def test_apportion_sums_and_caps():
    assert apportion([1, 1, 2], 8) == [2, 2, 4]
    assert sum(apportion([0.3, 0.3, 0.4], 7)) == 7
    assert apportion([1, 100], 10, cap=[10, 3]) == [7, 3]
    assert apportion([0, 0], 5) == [0, 0]
    # largest remainder: shares 1.64 / 2.36 round to 2 / 2 (the larger weight does not take the leftover)
    assert apportion([1 / 0.6, 1 / 0.42], 4) == [2, 2]
    assert apportion([0.5, 0.3, 0.2], 4) == [2, 1, 1]  # 2.0 / 1.2 / 0.8
    assert apportion([1, 1, 1], 2) == [1, 1, 0]  # ties go to the lower index
    assert apportion([5, 1, 1], 9, cap=[2, 10, 10]) == [2, 4, 3]


def test_vigor_tops_up_high_variance_prompts_within_budget():
    eng = FakeEngine({1: 0.0, 2: 0.5, 3: 1.0, 4: 0.5})
    prompts = [[1], [2], [3], [4]]
    s = make("vigor", 8, n_init=2, increment=2)
    r = s.sample(eng, prompts, PARAMS, ctx_for(prompts))
    cnt = torch.bincount(r.group_index, minlength=4)
    assert r.rollouts_spent == int(cnt.sum()) <= 8 * 4
    # all-wrong / all-right prompts never show variance -> fewer rollouts than the p=0.5 ones
    assert cnt[1] + cnt[3] > cnt[0] + cnt[2]
    assert r.rewards is not None and r.rewards.shape[0] == r.group_index.shape[0]


def test_dars_gives_hard_prompts_more_rollouts():
    eng = FakeEngine({1: 0.1, 2: 0.9})
    prompts = [[1], [2]]
    s = DarsSampler(4, hard_threshold=0.5, stages=2, max_total=16)
    r = s.sample(eng, prompts, PARAMS, ctx_for(prompts))
    cnt = torch.bincount(r.group_index, minlength=2)
    assert cnt[1] == 4  # easy prompt: no extra stage
    assert cnt[0] > 4 and cnt[0] <= 16
    # equal-treatment schedule: an all-wrong group of 4 targets ceil(4 / (2 sqrt(a(1-a)))) with a = 0.1
    assert s.target_total(4, 0) == 7


def test_pilot_commit_skips_uninformative_prompts():
    eng = FakeEngine({1: 0.0, 2: 0.5, 3: 1.0})
    prompts = [[1], [2], [3]]
    s = PilotCommitSampler(8, pilot_n=4, skip_threshold=0.1)
    r = s.sample(eng, prompts, PARAMS, ctx_for(prompts))
    present = set(r.group_index.tolist())
    assert present == {1}
    assert r.rollouts_spent == 24  # whole budget: pilot 12 + commit 12
    assert r.metrics["sampler/prompts_skipped"] == 2
    # Jeffreys posterior variance: 2/4 successes is more informative than 0/4
    info = PilotCommitSampler.informativeness(torch.tensor([0.0, 2.0]).numpy(), torch.tensor([4.0, 4.0]).numpy())
    assert info[0] == pytest.approx(0.5 * 4.5 / (5 * 6)) and info[1] > info[0]


def test_ar3po_stops_early_and_reuses_cached_correct_response():
    eng = FakeEngine({1: 1.0, 2: 0.0})
    prompts = [[1], [2]]
    s = make("ar3po", 8, n_stage=2)
    r = s.sample(eng, prompts, PARAMS, ctx_for(prompts, step=0, indices=[7, 9]))
    cnt = torch.bincount(r.group_index, minlength=2)
    assert cnt[0] == 2 and cnt[1] == 8  # solved prompt stops after one stage
    assert 7 in s.cache and 9 not in s.cache
    # Prompt 9 becomes solvable once, then impossible: the cached answer is reused.
    eng.p[2] = 1.0
    s.sample(eng, prompts, PARAMS, ctx_for(prompts, step=1, indices=[7, 9]))
    eng.p[2] = 0.0
    r = s.sample(eng, prompts, PARAMS, ctx_for(prompts, step=2, indices=[7, 9]))
    rows = (r.group_index == 1).nonzero().flatten().tolist()
    assert r.rewards[rows].sum() == 1.0 and r.metrics["sampler/reused"] == 1
    assert r.extras["replay_age"][rows].tolist().count(1.0) == 1
    assert r.generation.texts[rows[-1]].startswith("1")
    st = s.state_dict()
    s2 = make("ar3po", 8)
    s2.load_state_dict(st)
    assert s2.cache.keys() == s.cache.keys()


def test_tree_branches_share_prefix_and_carry_loss_only_on_suffix():
    eng = FakeEngine({1: 0.5}, resp_len=6, model=EntropyModel())
    prompts = [[1, 9]]
    s = make("tree", 4, n_roots=1, entropy="model")
    # seed 1: the root holds a 7, after which EntropyModel is uniform (the fork point checked below)
    r = s.sample(eng, prompts, dataclasses.replace(PARAMS, seed=SEED_WITH_SEVEN), ctx_for(prompts))
    g = r.generation
    assert r.rollouts_spent == 4 and g.response_ids.shape[0] == 4
    root = g.response_ids[0][g.response_mask[0] > 0].tolist()
    pre = r.extras["shared_prefix_len"].tolist()
    assert pre[0] == 0 and all(t >= 1 for t in pre[1:])
    for b in range(1, 4):
        t = pre[b]
        prompt = g.prompt_ids[b][g.prompt_mask[b] > 0].tolist()
        # the branch is prompted with prompt + the root's first t tokens, exactly
        assert prompt == [1, 9] + root[:t]
        # loss only on its own suffix: response holds the suffix tokens only
        suffix = g.response_ids[b][g.response_mask[b] > 0].tolist()
        assert int(g.response_mask[b].sum()) == len(suffix) <= 6 - t
        assert g.texts[b] == eng.tokenizer.decode(root[:t] + suffix)
    # fork points are where the model is uncertain: right after a 7 in the root
    sevens = [i + 1 for i, x in enumerate(root[:-1]) if x == 7]
    assert sevens, root  # the fake engine's root has an uncertain point to fork at
    assert pre[1] in sevens


def test_tree_default_roots():
    from rlpost.samplers.tree import default_roots

    assert [default_roots(n) for n in (2, 3, 4, 8, 12, 16)] == [1, 1, 2, 2, 3, 4]
    assert make("tree", 4).n_roots == 2 and make("tree", 4, n_roots=1).n_roots == 1


def test_tree_prunes_branches_identical_to_root():
    eng = FakeEngine({1: 1.0}, resp_len=4)
    s = make("tree", 4, n_roots=1, entropy="surprisal", prune_lookahead=1)
    r = s.sample(eng, [[1]], PARAMS, ctx_for([[1]]))
    assert r.rollouts_spent == 4
    assert r.group_index.shape[0] == 4 - int(r.metrics["sampler/branches_pruned"])


def test_param_perturb_restores_weights_exactly_and_perturbs_during_generation():
    lin = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    seen = []

    class Eng(FakeEngine):
        def generate(self, prompts, params):
            seen.append(lin[0].weight.detach().clone())
            return super().generate(prompts, params)

    eng = Eng({1: 0.5}, model=lin)
    s = make("param_perturb", 4, n_policies=2, sigma=0.1)
    r = s.sample(eng, [[1], [1]], PARAMS, ctx_for([[1], [1]]))
    assert r.rollouts_spent == 8
    for k, v in lin.state_dict().items():
        assert torch.equal(v, before[k])
    assert torch.equal(seen[0], before["0.weight"]) and not torch.equal(seen[1], before["0.weight"])
    assert r.extras["param_sample"].tolist().count(1) == 4
    w = make("param_perturb", 4, n_policies=2, grouping="within").sample(eng, [[1], [1]], PARAMS, ctx_for([[1], [1]]))
    assert sorted(set(w.group_index.tolist())) == [0, 1, 2, 3]
    assert w.positions().tolist().count(1) == 4


def test_reward_samplers_need_a_scorer():
    with pytest.raises(ValueError):
        make("vigor", 4).sample(FakeEngine({1: 0.5}), [[1]], PARAMS, SamplerContext())


def test_group_reward_stats():
    cnt, mean, var = group_reward_stats(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]), 2)
    assert cnt.tolist() == [2, 2] and mean.tolist() == [0.5, 1.0] and var.tolist() == [0.25, 0.0]


class EchoEngine(FakeEngine):
    """FakeEngine whose second response token names the prompt: token ``10 + prompt[0] % 6``
    (letters g..l, which the random tokens 4..9 = a..f never produce)."""

    def generate(self, prompts, params):
        g = super().generate(prompts, params)
        for b, pr in enumerate(prompts):
            if int(g.response_mask[b].sum()) >= 2:
                g.response_ids[b, 1] = 10 + int(pr[0]) % 6
        g.texts = [self.tokenizer.decode(r[m > 0].tolist()) for r, m in zip(g.response_ids, g.response_mask)]
        return g


@pytest.mark.parametrize(
    "name,kw",
    [("group", {}), ("vigor", {"n_init": 2, "increment": 2}), ("dars", {}), ("pilot_commit", {}),
     ("ar3po", {"n_stage": 2}), ("tree", {"n_roots": 2, "entropy": "surprisal"})],
)
def test_every_row_keeps_its_prompt_reward_and_text_through_the_driver(name, kw):
    # multi-round samplers merge several engine calls: after the merge, each row's reward must
    # be the verifier's score of that row's own text, and its prompt the one that produced it
    from rlpost.run.collect import collect_rollouts
    from rlpost.selectors import SELECTORS

    p = {100 + i: q for i, q in enumerate([0.0, 0.3, 0.5, 0.8, 1.0, 0.5])}
    eng = EchoEngine(p)
    sel = SELECTORS.get("uniform")(6, 6, seed=0)
    scored = []

    score = scorer(calls=scored)

    for step in range(3):
        scored.clear()
        out = collect_rollouts(sel, make(name, 4, **kw), eng, PARAMS, step=step, encode=lambda i: [100 + i, 7], score=score)
        # every generated row is scored exactly once (tree's pruned branches are never scored)
        assert sum(scored) == out.metrics["rollout/spent"] - out.metrics.get("sampler/branches_pruned", 0)
        g = out.result.generation
        assert out.rewards.tolist() == [correct(t) for t in g.texts]
        # a text (tree: root prefix + branch suffix) holds only the letter its own prompt repeats
        echoes = [(set(t) & set("ghijkl"), chr(ord("g") + (100 + int(i)) % 6)) for i, t in zip(out.row_prompt_index, g.texts)]
        assert all(found <= {want} for found, want in echoes) and any(found for found, _ in echoes)
        for r in range(g.response_ids.shape[0]):  # prompt rows start with the prompt they are labelled with
            assert int(g.prompt_ids[r][g.prompt_mask[r] > 0][0]) == 100 + int(out.row_prompt_index[r])
        assert out.metrics["rollout/spent"] >= len(set(out.result.group_index.tolist()))
        out.update_selector(sel)


def test_sampler_params_and_allocation_are_checked_at_config_time():
    from types import SimpleNamespace

    from rlpost.core.errors import ConfigError
    from rlpost.run.collect import check_allocation
    from rlpost.samplers.base import build_sampler
    from rlpost.selectors import SELECTORS

    with pytest.raises(ConfigError, match="takes no parameters"):
        build_sampler(SimpleNamespace(name="group", params={"bogus": 1}), 4)
    with pytest.raises(ConfigError, match="n_roots=-1 must be >= 1"):
        build_sampler(SimpleNamespace(name="tree", params={"n_roots": -1}), 4)
    with pytest.raises(ConfigError, match="n_roots must be smaller"):
        build_sampler(SimpleNamespace(name="tree", params={"n_roots": 99}), 4)
    with pytest.raises(ValueError, match="finite"):
        apportion([float("inf"), 1.0], 4)
    cures = SELECTORS.get("cures")(8, 2, seed=0, n_samples=4)
    with pytest.raises(ConfigError, match="sampler=vigor ignores that budget.*sampler=group"):
        check_allocation(cures, make("vigor", 4), "cures", "vigor")
    check_allocation(cures, make("group", 4), "cures", "group")  # honours it
    check_allocation(cures, make("dars", 4), "cures", "dars")
    check_allocation(SELECTORS.get("cures")(8, 2, seed=0, allocate=False), make("vigor", 4), "cures", "vigor")


def test_sampler_metrics_of_several_rounds_average_means_and_sum_counts():
    from rlpost.run.collect import _merge_round_metrics

    m = _merge_round_metrics({"sampler/mean_fork_pos": [20.0, 10.0], "sampler/branches_pruned": [1.0, 2.0],
                              "sampler/temperature_mean": [1.0, 0.5]})
    assert m == {"sampler/mean_fork_pos": 15.0, "sampler/branches_pruned": 3.0, "sampler/temperature_mean": 0.75}


def test_xrpo_icl_seeds_failed_prompts_and_scores_each_row_once_through_the_driver(tmp_path):
    # XRPO's in-context seeding: probes first; the prompts whose probes all failed are rendered again with
    # exemplars (here the fake task renders a seeded example i as [200 + i, 7]) for the rest of their rollouts
    import json
    from types import SimpleNamespace

    from rlpost.run.collect import collect_rollouts
    from rlpost.samplers.xrpo_icl import HEADER
    from rlpost.selectors import SELECTORS
    from rlpost.tasks.base import Example

    bank = tmp_path / "bank.jsonl"
    bank.write_text("".join(json.dumps({"question": f"Add {k} and {k}.", "solution": f"{2 * k}"}) + "\n" for k in range(3)))

    class Task:
        cfg = SimpleNamespace(name="fake")

        def render_prompt(self, ex, tok):
            return [(200 if ex.question.startswith(HEADER) else 100) + ex.index, 7]

    s = make("xrpo_icl", 4, exemplar_file=str(bank))
    s.attach(task=Task(), examples=[Example(index=i, question=f"Add {i} and 9.", answer="") for i in range(4)])
    eng = FakeEngine({100: 0.0, 101: 1.0, 102: 0.0, 103: 1.0, 200: 1.0, 202: 1.0})
    scored = []
    out = collect_rollouts(SELECTORS.get("uniform")(4, 4, seed=0), s, eng, PARAMS, step=0,
                           encode=lambda i: [100 + i, 7], score=scorer(calls=scored))
    g = out.result.generation
    assert sum(scored) == out.metrics["rollout/spent"] == 16 and out.rewards.tolist() == [correct(t) for t in g.texts]
    seeded = out.result.extras["icl_seeded"] > 0
    assert sorted(set(out.row_prompt_index[seeded].tolist())) == [0, 2] and int(seeded.sum()) == 4
    first = g.prompt_ids[torch.arange(len(g.texts)), (g.prompt_mask == 0).sum(-1)]  # each row's first prompt token
    assert torch.equal(first, torch.where(seeded, 200, 100) + out.row_prompt_index)
    assert out.metrics["sampler/icl_prompts_revived"] == 2.0
