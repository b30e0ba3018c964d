"""Pruning samplers (D3S, arrol): subsets, curricula, and no group dropped unrecorded."""

import dataclasses

import pytest
import torch

from fake_engine import FakeEngine, scorer
from rlpost.rollout.base import SamplingParams
from rlpost.samplers import SAMPLERS, SamplerContext
from rlpost.samplers.prune import d3s_keep_ratio, d3s_token_mask, max_variance_subset

PARAMS = SamplingParams(max_new_tokens=6, seed=5)


def test_max_variance_subset_hand_computed():
    v = torch.tensor([0.0, 1.0, 2.0, 10.0, 3.0])
    # k=2: the two extremes 0 and 10 (variance 25)
    assert max_variance_subset(v, 2) == [0, 3]
    # k=3: {0, 1, 10} var 19.56 vs {0, 3, 10} var 17.56 -> bottom two + top one
    assert max_variance_subset(v, 3) == [0, 1, 3]
    assert max_variance_subset(v, 9) == [0, 1, 2, 3, 4]
    # brute force agrees on random inputs
    import itertools

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randn(7, generator=g)
        for k in (2, 3, 4):
            best = max(itertools.combinations(range(7), k), key=lambda c: float(x[list(c)].var(unbiased=False)))
            got = max_variance_subset(x, k)
            assert abs(float(x[got].var(unbiased=False)) - float(x[list(best)].var(unbiased=False))) < 1e-9
    with pytest.raises(ValueError):
        max_variance_subset(v, -1)


def test_d3s_schedule_and_token_mask():
    assert d3s_keep_ratio(0, 0.5, 1.0, 100) == 0.5
    assert d3s_keep_ratio(50, 0.5, 1.0, 100) == 0.75
    assert d3s_keep_ratio(500, 0.5, 1.0, 100) == 1.0
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, -2.0, 0.0]])
    ent = torch.tensor([[0.1, 0.9, 0.5, 0.2], [0.3, 0.1, 0.2, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    m = d3s_token_mask(adv, ent, mask, 0.5, scope="row")
    # row 0: 3 tokens -> keep ceil(1.5)=2 with |A|H 0.9, 0.5; row 1: |A|H = 0.6, 0.2, 0.4, 0 -> keep 0.6, 0.4
    assert m.tolist() == [[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]]
    with pytest.raises(ValueError):
        d3s_token_mask(adv, ent, mask, 0.0)


def test_d3s_keeps_max_variance_rows_and_records_the_rest():
    eng = FakeEngine({10: 0.5, 11: 0.0, 12: 1.0})
    prompts = [[10, 5], [11, 5], [12, 5]]
    s = SAMPLERS.get("d3s")(8, keep_start=0.5, keep_end=1.0, schedule_steps=100, min_keep=2)
    r = s.sample(eng, prompts, PARAMS, SamplerContext(score=scorer(), step=0))
    assert r.rollouts_spent == 24
    # every group survives with 4 rows; nothing hidden: kept + dropped = all 8 rewards of each group
    for g in range(3):
        assert int((r.group_index == g).sum()) == 4
        left = [x for p, xs in r.dropped if p == g for x in xs]
        assert len(left) == 4
    assert r.metrics["sampler/pruned"] == 12
    # the mixed group keeps a balanced 2/2 split when it has both outcomes (maximum variance)
    kept0 = r.rewards[r.group_index == 0]
    dropped0 = [x for p, xs in r.dropped if p == 0 for x in xs]
    allr = kept0.tolist() + dropped0
    if 0 < sum(allr) < 8 and min(sum(allr), 8 - sum(allr)) >= 2:
        assert sorted(kept0.tolist()) == [0.0, 0.0, 1.0, 1.0]


def test_driver_gives_the_selector_the_pruned_rewards():
    from rlpost.run.collect import collect_rollouts
    from rlpost.selectors import SELECTORS

    eng = FakeEngine({k: 0.5 for k in range(100)})
    sel = SELECTORS.get("uniform")(20, prompts_per_step=3, seed=0)
    s = SAMPLERS.get("d3s")(8, keep_start=0.25, keep_end=0.25, schedule_steps=0, min_keep=2)
    out = collect_rollouts(sel, s, eng, PARAMS, step=1, encode=lambda i: [i, 5], score=scorer())
    assert out.result.group_index.shape[0] == 3 * 2  # 2 rows per group reach the batch
    assert len(out.observed) == 3 and all(len(r) == 8 for _, r in out.observed)  # all 8 rewards observed


class _Tok:
    eos_token_id = 0
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) == 0))


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=64, eos_token_id=0, pad_token_id=0, bos_token_id=1)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def test_arrol_prunes_after_prefix_keeps_groups_and_learns_the_head():
    from rlpost.rollout.hf import HFRolloutEngine

    eng = HFRolloutEngine(_tiny_llama(), _Tok())
    # success: the response starts with token 1 (decided inside the prefix, so the head can learn it)
    sc = scorer(lambda idx, texts: [1.0 if t.startswith("1") else 0.0 for t in texts])
    s = SAMPLERS.get("arrol")(8, keep_ratio=0.5, prune_at=2, head_lr=0.2, head_epochs=50, min_keep=2,
                              correct_threshold=0.5)
    prompts = [[2, 3], [3, 4], [4, 5], [5, 2]]
    total_gen = 0
    for step in range(1, 6):
        r = s.sample(eng, prompts, SamplingParams(max_new_tokens=10, seed=step), SamplerContext(score=sc, step=step))
        assert r.rollouts_spent == 32 and r.metrics["sampler/pruned_unscored"] == 16
        for g in range(4):  # no group lost
            assert int((r.group_index == g).sum()) == 4
        # kept rows are whole responses: the prefix then the continuation, loss on all of it
        assert int(r.generation.response_mask.sum(-1).max()) > 2
        total_gen += r.metrics["sampler/generated_tokens"]
    # pruned rows stopped at 2 tokens: fewer decoded tokens than 32 full rollouts per step would take
    assert total_gen < 5 * 32 * 10 * 0.75
    # the head separates successes from failures on fresh partial rollouts
    from rlpost.samplers.prune import prefix_features

    pre = [[1, 3], [1, 4], [2, 3], [3, 3], [1, 5], [4, 4]]
    pr = s.predict(prefix_features(eng.model, [[2, 3]] * 6, pre, 0))
    good, bad = pr[[0, 1, 4]], pr[[2, 3, 5]]
    assert float(good.min()) > float(bad.max()), pr
    t = SAMPLERS.get("arrol")(8)
    t.load_state_dict(s.state_dict())
    assert torch.allclose(t.predict(prefix_features(eng.model, [[2, 3]] * 6, pre, 0)), pr)


def test_pruning_params_are_checked():
    from omegaconf import OmegaConf

    from rlpost.core.errors import ConfigError
    from rlpost.samplers.base import build_sampler

    for name, bad in (("d3s", {"keep_start": 0}), ("d3s", {"min_keep": 0}), ("arrol", {"keep_ratio": 1.5}),
                      ("arrol", {"prune_at": 0}), ("arrol", {"prune_after": 3})):
        with pytest.raises(ConfigError):
            build_sampler(OmegaConf.create({"name": name, "params": bad}), 4)
