"""AT²PO (arXiv:2601.04767): the ATPO turn-ratio loss, the turn-wise credit over a small tree and the
entropy-guided choice of the branch turn, each by hand from the authors' code's equations; the expansion
on the tiny model (exact prefixes, G rows, the top-scored turn re-sampled); the preset on env=calculator."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput
from rlpost.algos.at2po import at2po_advantage, atpo_loss, build_turn_tree, tree_values, turn_ids, turn_mean
from rlpost.algos.losses import PolicyLossInput, gspo_loss, ppo_clip_loss
from rlpost.samplers.turn_tree import ROOT, TurnTree, expansion_sizes, select_expansion_nodes
from tests.conftest import tiny_overrides

# ----------------------------------------------------------------------------- ATPO loss
# one row: turn 1 = tokens 0-1, environment token 2, turn 2 = tokens 3-5 (5 model tokens in 2 turns)
MASK1 = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 1.0]])
LR1 = torch.tensor([[0.004, 0.008, 0.0, -0.01, 0.0, 0.004]])  # log pi - log pi_old
ADV1 = torch.tensor([[1.0, 1.0, 0.0, -0.5, -0.5, -0.5]])


def _inp(lr=LR1, adv=ADV1, mask=MASK1):
    old = torch.full(mask.shape, -1.0)
    lp = (old + lr).clone().requires_grad_(True)
    return PolicyLossInput(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask), lp


def test_turn_ids_and_turn_mean():
    m = torch.tensor([[1, 1, 0, 1, 0, 1], [0, 1, 1, 1, 0, 0]], dtype=torch.float32)
    assert turn_ids(m).tolist() == [[1, 1, 0, 2, 0, 3], [0, 1, 1, 1, 0, 0]]
    x = torch.tensor([[1.0, 3.0, 9.0, 4.0, 9.0, 5.0], [9.0, 1.0, 2.0, 6.0, 9.0, 9.0]])
    assert turn_mean(x, m).tolist() == [[2.0, 2.0, 0.0, 4.0, 0.0, 5.0], [0.0, 3.0, 3.0, 3.0, 0.0, 0.0]]


def test_atpo_turn_ratio_and_clip_by_hand():
    inp, lp = _inp()
    loss, met = atpo_loss(inp, eps_low=3e-3, eps_high=4e-3)
    # turn 1: s_1 = exp((0.004 + 0.008) / 2) = exp(0.006) = 1.006018 > 1.004 with A = +1 -> clipped: -1.004, no grad
    # turn 2: s_2 = exp((-0.01 + 0 + 0.004) / 3) = exp(-0.002) = 0.998002 inside [0.997, 1.004]: 0.5 * 0.998002
    s2 = math.exp(-0.002)
    assert loss[0, [0, 1]].tolist() == pytest.approx([-1.004, -1.004], abs=1e-6)
    assert loss[0, [3, 4, 5]].tolist() == pytest.approx([0.5 * s2] * 3, abs=1e-6)
    (loss * MASK1).sum().backward()
    # d/dlogp_t of -A sg(s_k) exp(logp_t - sg(logp_t)) = -A s_k on every token of an unclipped turn
    assert lp.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.5 * s2, 0.5 * s2, 0.5 * s2], abs=1e-6)
    assert float(met["clip_frac"]) == pytest.approx(2 / 5) and float(met["clip_frac_high"]) == pytest.approx(2 / 5)
    assert float(met["turn_ratio_mean"]) == pytest.approx((2 * math.exp(0.006) + 3 * s2) / 5, abs=1e-6)
    assert float(met["seq_turns"]) == 2.0


def test_atpo_differs_from_token_and_sequence_ratios():
    # token-level PPO clips token 3 (ratio exp(-0.01) = 0.990 < 0.997 with A < 0); ATPO does not (its turn ratio is 0.998)
    inp, _ = _inp()
    _, met_ppo = ppo_clip_loss(inp, eps_low=3e-3, eps_high=4e-3, dual_clip=None)
    assert float(met_ppo["clip_frac_low"]) == pytest.approx(1 / 5)
    # GSPO's one sequence ratio exp(0.006 / 5) = 1.0012 clips nothing; ATPO clips turn 1
    inp, _ = _inp()
    _, met_gspo = gspo_loss(inp, eps_low=3e-3, eps_high=4e-3)
    assert float(met_gspo["clip_frac"]) == 0.0
    # a single-turn row: ATPO equals GSPO exactly
    m = torch.ones(1, 4)
    lr = torch.tensor([[0.01, -0.02, 0.003, 0.0]])
    a = torch.tensor([[0.7, 0.7, 0.7, 0.7]])
    la, _ = atpo_loss(_inp(lr, a, m)[0], eps_low=3e-3, eps_high=4e-3)
    lg, _ = gspo_loss(_inp(lr, a, m)[0], eps_low=3e-3, eps_high=4e-3)
    assert torch.allclose(la, lg)


def test_atpo_bad_clip_is_an_error():
    with pytest.raises(ValueError, match="eps_low must be in"):
        atpo_loss(_inp()[0], eps_low=0.0, eps_high=4e-3)


# ----------------------------------------------------------------------------- turn-wise credit
# the group's tree: root -> A (row 0's turn 1, H 0.5), C (row 1, H 0.5), E (row 3, H 0.5); A -> B (row 0's
# turn 2, H 1.0), D (row 2's turn 2, H 0.0; row 2 is a branch of row 0 before turn 2, prefix 3 tokens)
MASK_T = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
LP_T = torch.tensor([[-0.5, -0.5, 0.0, -1.0, -1.0], [-0.5, -0.5, -0.5, 0.0, 0.0],
                     [-0.5, -0.5, 0.0, 0.0, 0.0], [-0.5, -0.5, 0.0, 0.0, 0.0]])
REWARDS_T = torch.tensor([1.0, 0.0, 0.0, 1.0])
TREE_X = {"branch_parent": torch.tensor([-1, -1, 0, 0]), "branch_prefix_len": torch.tensor([0, 0, 3, 0])}
W = math.exp(1.0) / (math.exp(1.0) + 1.0)  # softmax weight of B (H 1) against D (H 0): 0.731059
N1 = 0.5 / (0.5 + 1e-6)  # a normalised leaf: (1 - 0.5) / (population std 0.5 + 1e-6)


def _credit(extras=TREE_X, rewards=REWARDS_T, **kw):
    p = dict(node_value="child_softmax", node_advantage="node_value", leaf_norm=True, eps=1e-6)
    p.update(kw)
    inp = AdvantageInput(rewards=rewards, response_mask=MASK_T, group_index=torch.zeros(4, dtype=torch.long),
                         rollout_logprobs=LP_T, extras=dict(extras))
    return at2po_advantage(inp, **p).advantages


def test_tree_from_the_branch_record():
    t = build_turn_tree(MASK_T, -LP_T, [-1, -1, 0, 0], [0, 0, 3, 0])
    # nodes in order: A, B (row 0), C (row 1), D (row 2's new turn), E (row 3: prefix 0 shares nothing)
    assert t.parent == [-1, 0, -1, 0, -1]
    assert t.entropy == pytest.approx([0.5, 1.0, 0.5, 0.0, 0.5])
    assert t.leaf_of_row == [1, 2, 3, 4]
    assert [n for _, _, n in t.spans[2]] == [0, 3]


def test_turn_credit_by_hand():
    a = _credit()
    va = W * N1 - (1 - W) * N1  # V(A) = 0.731059 * 1 + 0.268941 * (-1) = 0.462117
    assert va == pytest.approx(0.462117, abs=1e-5)
    exp = torch.tensor([[va, va, 0, N1, N1], [-N1, -N1, -N1, 0, 0], [va, va, 0, -N1, -N1], [N1, N1, 0, 0, 0]])
    assert torch.allclose(a.double(), exp.double(), atol=1e-5)
    # diff_parent: V(n) - V(parent); the root's value: equal entropies of A, C, E -> the mean (V(A) - 1 + 1) / 3
    root = (va - N1 + N1) / 3
    d = _credit(node_advantage="diff_parent")
    assert float(d[0, 0]) == pytest.approx(va - root, abs=1e-5)     # 0.308078
    assert float(d[0, 3]) == pytest.approx(N1 - va, abs=1e-5)       # 0.537883
    assert float(d[2, 3]) == pytest.approx(-N1 - va, abs=1e-5)      # -1.462117
    assert float(_credit(node_advantage="diff_global")[1, 0]) == pytest.approx(-N1 - root, abs=1e-5)
    # child_mean and leaf_mean: V(A) = (1 - 1) / 2 = 0
    assert float(_credit(node_value="child_mean")[0, 0]) == pytest.approx(0.0, abs=1e-6)
    assert float(_credit(node_value="leaf_mean")[2, 1]) == pytest.approx(0.0, abs=1e-6)
    # without the leaf normalisation the leaves are the raw rewards: V(A) = 0.731059
    assert float(_credit(leaf_norm=False)[0, 0]) == pytest.approx(W, abs=1e-6)


def test_tree_values_softmax_of_a_deeper_tree():
    # root -> n0 (H 0) -> {n1 (H 0), n2 (H log 3)}: weights 1/4, 3/4; leaves 2 and -2 -> V(n0) = 0.5 - 1.5 = -1
    t = SimpleNamespace(parent=[-1, 0, 0], entropy=[0.0, 0.0, math.log(3.0)], leaf_of_row=[1, 2])
    vals, root = tree_values(t, [2.0, -2.0], "child_softmax")
    assert vals == pytest.approx([-1.0, 2.0, -2.0]) and root == pytest.approx(-1.0)


def test_credit_without_a_tree_is_grpo_with_the_population_std():
    a = _credit(extras={})
    # every row its own chain: each turn gets (r - 0.5) / (0.5 + 1e-6)
    for i, r in enumerate(REWARDS_T.tolist()):
        on = MASK_T[i] > 0
        assert torch.allclose(a[i][on], torch.full((int(on.sum()),), N1 if r else -N1), atol=1e-5)
    # a zero-variance group gets exactly 0
    assert float(_credit(rewards=torch.ones(4)).abs().max()) == 0.0


def test_credit_bad_inputs():
    with pytest.raises(ValueError, match="not before it"):
        build_turn_tree(MASK_T, None, [-1, 2, -1, -1], [0, 1, 0, 0])
    with pytest.raises(ValueError, match="another group"):
        inp = AdvantageInput(rewards=REWARDS_T, response_mask=MASK_T, group_index=torch.tensor([0, 0, 1, 1]),
                             extras=dict(TREE_X))
        at2po_advantage(inp, node_value="child_softmax", node_advantage="node_value", leaf_norm=True, eps=1e-6)
    with pytest.raises(ValueError):
        _credit(node_value="max")


# ----------------------------------------------------------------------------- entropy-guided expansion
def test_choice_of_the_branch_turn_by_hand():
    # (node, H, siblings): scores with alpha 0.05: root 0 - 0.1 = -0.1; n1 1.2 - 0.1 = 1.10; n2 1.0 - 0 = 1.0;
    # n3 1.16 - 0.05 = 1.11
    cands = [(ROOT, 0.0, 3), ("n1", 1.2, 3), ("n2", 1.0, 1), ("n3", 1.16, 2)]
    assert select_expansion_nodes(cands, 2, 0.05) == ["n3", "n1"]
    # a larger penalty: n1 1.2 - 0.4 = 0.8, n3 1.16 - 0.2 = 0.96, n2 1.0 -> n2 first
    assert select_expansion_nodes(cands, 2, 0.2) == ["n2", "n3"]
    # more picks than candidates: the sorted list again (the authors' duplication)
    assert select_expansion_nodes(cands, 6, 0.05) == ["n3", "n1", "n2", ROOT, "n3", "n1"]
    assert select_expansion_nodes([], 3, 0.05) == [] and select_expansion_nodes(cands, 0, 0.05) == []
    assert expansion_sizes(12, 2) == [6, 6] and expansion_sizes(3, 2) == [2, 1] and expansion_sizes(1, 2) == [1, 0]
    with pytest.raises(ValueError):
        expansion_sizes(2, 0)


def test_turn_tree_candidates_are_the_non_leaf_turns():
    tree = TurnTree()
    a = SimpleNamespace(pos=0, node_path=[], ids=[])
    b = SimpleNamespace(pos=0, node_path=[], ids=[])
    tree.before_turn(a)                 # node 0: a's turn 1
    tree.after_turn(a, [-1.0, -2.0])    # H 1.5
    tree.before_turn(b)                 # node 1: b's turn 1
    tree.after_turn(b, [-0.5])
    a.ids = [1, 2, 3]
    tree.before_turn(a)                 # node 2: a's turn 2, child of node 0
    tree.after_turn(a, [])
    # a's turn 1 has a child; b's turn 1 and a's turn 2 are leaves; the root has 2 children
    assert tree.candidates(0) == [(ROOT, 0.0, 2), (0, 1.5, 2)]
    assert tree.candidates(1) == []
    c, row, n = tree.branch(2, [b, a])  # re-sample a's turn 2 from the state before it
    assert row == 1 and n == 3 and c.node_path == [0] and c is not a


@pytest.fixture(scope="module")
def tiny_engine():
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.rollout.hf import HFRolloutEngine

    policy, tk = load_policy(compose_config(tiny_overrides()).model, torch.float32, seed=0)
    return HFRolloutEngine(policy, tk, batch_size=8)


def test_expansion_on_the_tiny_model_resamples_the_top_scored_turn(tiny_engine, monkeypatch):
    import rlpost.samplers.episode as episode
    from rlpost.algos.turns import turn_spans
    from rlpost.samplers.base import SamplerContext, SamplingParams
    from tests.test_agents import _EchoEnv

    monkeypatch.setattr(episode, "make_env", lambda name, params=None: _EchoEnv())
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, stop=list("aeiou "))  # random model: short turns
    s = episode.EpisodeSampler(6, max_turns=3, max_total_tokens=400, branching="at2po", initial_rollouts=2,
                               expansion_iterations=2, branch_penalty=0.05)
    res = s.sample(tiny_engine, [[5, 6, 7], [8, 9]], sp, SamplerContext(step=1))
    g, ex = res.generation, res.extras
    assert torch.bincount(res.group_index).tolist() == [6, 6]  # exactly G rows per prompt
    assert res.metrics["episode/branches"] == 8.0  # 2 rounds x 2 branches x 2 prompts
    par, pre = ex["branch_parent"].tolist(), ex["branch_prefix_len"].tolist()
    for i, (p, n) in enumerate(zip(par, pre)):
        if p < 0:
            assert n == 0
            continue
        assert res.group_index[p] == res.group_index[i] and p < i
        for f in ("response_ids", "response_mask", "rollout_logprobs", "temperatures"):  # the prefix, id for id
            assert torch.equal(getattr(g, f)[i, :n], getattr(g, f)[p, :n]), f
        assert n == 0 or g.response_mask[p, n - 1] == 0  # the state before a turn: after environment text
    # round 1 of prompt 0 re-samples the best-scored non-last turn of the two initial episodes
    m, lp = g.response_mask, g.rollout_logprobs
    cands = [((-1, 0), 0.0, 2)]
    for r in (0, 1):
        sp_r = turn_spans(m[r])
        for k, (a, b) in enumerate(sp_r[:-1]):
            cands.append(((r, a), float(-lp[r, a:b].mean()), 2 if k == 0 else 1))
    best = select_expansion_nodes(cands, 2, 0.05)
    got = []
    for i in (2, 3):
        start = pre[i] if par[i] >= 0 else 0
        got.append((par[i], start) if par[i] >= 0 else (-1, 0))
    want = [(r, a) if r >= 0 else (-1, 0) for r, a in best]
    assert got == want


def test_at2po_branching_config_errors(compose):
    from rlpost.core.errors import ConfigError
    from rlpost.config.compose import validate_config

    with pytest.raises(ConfigError, match="unknown parameter"):
        validate_config(compose(tiny_overrides("algo=at2po", "+algo.adv_params.node_valu=child_mean")))
    with pytest.raises(ConfigError, match="unknown parameter"):
        validate_config(compose(tiny_overrides("algo=at2po", "+algo.loss_params.eps=0.1")))
    with pytest.raises((ConfigError, ValueError), match="branching"):
        validate_config(compose(tiny_overrides("algo=at2po", "env=calculator", "sampler.params.branching=tree")))


def test_one_step_on_calculator_episodes_tiny(compose, tmp_path):
    """The preset with the tree expansion trains one step on env=calculator episodes with the tiny model."""
    import json

    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("algo=at2po", "env=calculator", "task=multiply", "sampler.params.branching=at2po",
                                 "steps=1", "eval.at_end=false", "eval.every=0", "sampler.params.max_total_tokens=40",
                                 "checkpoint.every=0"))
    train(cfg, tmp_path / "at2po")
    rows = [json.loads(x) for x in (tmp_path / "at2po" / "metrics.jsonl").read_text().splitlines()]
    m = next(r for r in rows if "episode/branches" in r)
    assert m["episode/branches"] > 0
    assert math.isfinite(m["loss/policy"])
