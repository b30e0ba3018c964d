"""EMPO² (arXiv:2602.23008), ``sampler=empo2`` + ``algo=empo2``: the memory's write / retrieve rules by hand,
the mode draw and its mix ratio, the off-policy ratio and its PPO-clip loss and gradient by hand, the
low-probability row mask, the sampler on the tiny model (notes in the sampling context, memory-free prompts on
off-policy rows, memory kept across steps and through ``state_dict``, none in held-out evaluation), config
errors, and two training steps on calculator episodes."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from rlpost.rewards.scoring import Rewards
from rlpost.rollout.base import SamplingParams
from rlpost.samplers.base import SamplerContext
from rlpost.samplers.empo2 import (NOTES_HEADER, OFF_POLICY, ON_POLICY, ON_POLICY_MEMORY, EMPO2Sampler, TipMemory,
                                   draw_mode, entry_content, notes_text)
from rlpost.methods.empo2 import low_prob_row_mask, offpolicy_old_logprobs
from tests.conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ memory: write and retrieve by hand
def test_memory_write_and_retrieve_by_hand():
    mem = TipMemory(capacity=3, threshold=0.5, top_k=2)
    assert mem.add(7, "abcd", "tip A", 0.2) and mem.add(7, "abcd", "tip B", 0.9)
    assert not mem.add(7, "abcd", "tip A", 5.0)  # the same content is stored once per slot
    assert mem.add(7, "wxyz", "tip C", 3.0)  # a dissimilar key
    assert mem.add(8, "abcd", "tip D", 9.0)  # another slot (task instance)
    # query "abcd": trigrams {abc, bcd}; key "abcd" cosine 1 (> 0.5), "wxyz" cosine 0; top 2 by score
    assert mem.retrieve(7, "abcd") == ["tip B", "tip A"]
    # query "abcx": {abc, bcx} against {abc, bcd}: cosine 1/2, not > 0.5 -> nothing
    assert mem.retrieve(7, "abcx") == []
    mem.threshold = 0.4
    assert mem.retrieve(7, "abcx") == ["tip B", "tip A"]
    assert mem.retrieve(7, "wxyz") == ["tip C"] and mem.retrieve(9, "abcd") == []
    # ties keep storage order; top_k cuts
    mem.top_k = 1
    assert mem.retrieve(8, "abcd") == ["tip D"]
    # capacity 3 per slot: the oldest goes
    assert mem.add(7, "abcd", "tip E", 0.0)
    assert [e["content"] for e in mem.slots[7]] == ["tip B", "tip C", "tip E"] and mem.size() == 4
    assert notes_text([]) == "" and notes_text(["a", "b"]) == NOTES_HEADER + "a\nb\n"
    assert entry_content(" t ", " act ", 2, 1.0) == "t (turn 2, your action: act; the episode scored 1.0)"


# ------------------------------------------------------------------ modes and the mix ratio
def test_mode_draw_boundaries_and_mix_ratio():
    # the authors' die: < 0.17 off-policy, < 0.25 on-policy with memory, else on-policy
    assert [draw_mode(u, 0.17, 0.08) for u in (0.0, 0.1699, 0.17, 0.2499, 0.25, 0.99)] == [2, 2, 1, 1, 0, 0]
    s = EMPO2Sampler(4, max_turns=2, max_total_tokens=64, transcripts=False)
    n = 4000
    modes = [s.modes(3, SamplerContext(step=t, seed=0)) for t in range(n)]
    assert all(len(set(m)) == 1 for m in modes)  # mode_unit=step: one mode for the whole step
    frac = [sum(m[0] == k for m in modes) / n for k in (ON_POLICY, ON_POLICY_MEMORY, OFF_POLICY)]
    assert frac == pytest.approx([0.75, 0.08, 0.17], abs=0.02)
    assert s.modes(3, SamplerContext(step=5, seed=0)) == modes[5]  # reproducible per (seed, step)
    # ... in every process (a str hash() would change with PYTHONHASHSEED)
    import subprocess
    import sys

    code = ("from rlpost.samplers.empo2 import EMPO2Sampler as S; from rlpost.samplers.base import SamplerContext as C; "
            "s = S(4, max_turns=2, max_total_tokens=64, transcripts=False); "
            "print([s.modes(1, C(step=t, seed=0))[0] for t in range(40)])")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": h}).stdout for h in ("1", "2")}
    assert outs == {f"{[m[0] for m in modes[:40]]}\n"}
    p = EMPO2Sampler(4, max_turns=2, max_total_tokens=64, transcripts=False, mode_unit="prompt")
    many = p.modes(4000, SamplerContext(step=1, seed=0))
    assert len(set(many)) == 3 and sum(m == OFF_POLICY for m in many) / 4000 == pytest.approx(0.17, abs=0.02)


# ------------------------------------------------------------------ the off-policy ratio and loss by hand
def test_offpolicy_old_logprobs_and_ppo_clip_by_hand():
    from rlpost.algos.losses import PolicyLossInput, compute_policy_loss

    old = torch.tensor([[-2.0, -2.0, -0.5], [-2.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])  # trainer, memory-free prompt
    roll = torch.tensor([[-1.0, -3.0, -0.4], [-1.0, -3.0, -0.4], [-1.2, -1.3, 0.0]])  # engine, memory prompt
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    off = torch.tensor([1.0, 1.0, 0.0])
    den = offpolicy_old_logprobs(old, roll, mask, off)
    # off-policy rows take the memory-context log-probs on masked tokens only; the on-policy row is untouched
    assert den.tolist() == [[-1.0, -3.0, -0.5], [-1.0, -3.0, -0.5], [-1.0, -1.0, 0.0]]
    # the update's current log-probs equal the trainer's (first pass): ratio = pi(no memory) / pi(memory)
    lp = old.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0], [1.0, 1.0, 0.0]])
    loss, _ = compute_policy_loss("ppo_clip", PolicyLossInput(lp, den, adv, mask), eps_low=0.2, eps_high=0.3,
                                  dual_clip=10.0)
    r1, r2 = math.exp(-1.0), math.exp(1.0)  # tokens 0 and 1 of the off-policy rows
    # A = +1: -min(r, clip(r, 0.8, 1.3)) -> -r for r = e^-1 (unclipped), -1.3 for r = e^1 (capped)
    # A = -1: -min(-r, -clip(r)) = max(r, clip(r)) -> 0.8 for r = e^-1 (clipped, no gradient), e for r = e^1;
    #         dual clip c = 10 caps the loss at 10 (not reached)
    want = [[-r1, -1.3, 0.0], [0.8, r2, 0.0], [-1.0, -1.0, 0.0]]
    assert torch.allclose(loss * mask, torch.tensor(want), atol=1e-6)
    (loss * mask).sum().backward()
    # d/dlp of -r A = -r A; clipped tokens give 0
    assert torch.allclose(lp.grad, torch.tensor([[-r1, 0.0, 0.0], [0.0, r2, 0.0], [-1.0, -1.0, 0.0]]), atol=1e-6)


def test_low_prob_row_mask_by_hand():
    old = torch.tensor([[-0.1, -6.0, -9.0], [-4.9, -0.2, -30.0], [-5.0, -5.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    # row 0: min over the mask -6 < -5; row 1: -4.9 (the -30 is outside the mask); row 2: -5 is not < -5; row 3 empty
    assert low_prob_row_mask(old, mask, -5.0).tolist() == [True, False, False, False]


def test_method_replaces_offpolicy_denominators_and_masks_rows(compose):
    from rlpost.methods.base import MethodSet

    ms = MethodSet.for_config(compose(tiny_overrides("sampler=empo2", "algo=empo2")))
    assert [m.name for m in ms.methods] == ["empo2"] and ms.needs().old_logprobs
    batch = SimpleNamespace(
        extras={"old_logprobs": torch.tensor([[-1.0, -2.0], [-1.0, -2.0]]), "empo2_offpolicy": torch.tensor([1.0, 0.0])},
        rollout_logprobs=torch.tensor([[-0.5, -7.0], [-0.5, -7.0]]), response_mask=torch.ones(2, 2))
    out = ms.after_old_logprobs(batch, None)
    assert batch.extras["old_logprobs"].tolist() == [[-0.5, -7.0], [-1.0, -2.0]]
    # the off-policy row's memory-context log-prob -7 is below -5: its loss mask goes
    assert batch.response_mask.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    # mean trainer - engine log-prob on the off-policy row: ((-1 + 0.5) + (-2 + 7)) / 2 = 2.25
    assert out["empo2/low_prob_masked_frac"] == 0.5 and out["empo2/offpolicy_logratio_mean"] == pytest.approx(2.25)
    ms2 = MethodSet.for_config(compose(tiny_overrides("sampler=empo2", "sampler.params.low_prob_threshold=null")))
    b2 = SimpleNamespace(extras={"old_logprobs": torch.full((1, 2), -9.0)}, rollout_logprobs=torch.zeros(1, 2),
                         response_mask=torch.ones(1, 2))
    ms2.after_old_logprobs(b2, None)
    assert b2.response_mask.tolist() == [[1.0, 1.0]]  # masking off; no off-policy rows: old log-probs untouched
    assert b2.extras["old_logprobs"].tolist() == [[-9.0, -9.0]]
    assert not MethodSet.for_config(compose(tiny_overrides("sampler=episode", "algo=empo2"))).methods


def test_a_step_whose_every_row_is_masked_warns_once(compose, caplog):
    """On the tiny model every row has a token below -5: the step has no gradient, and the log says so once."""
    from rlpost.methods.base import MethodSet

    ms = MethodSet.for_config(compose(tiny_overrides("sampler=empo2", "algo=empo2")))

    def batch():
        return SimpleNamespace(extras={"old_logprobs": torch.tensor([[-6.0, -1.0], [-1.0, -8.0]])},
                               rollout_logprobs=torch.zeros(2, 2), response_mask=torch.ones(2, 2))

    with caplog.at_level("WARNING", logger="rlpost"):
        b = batch()
        assert ms.after_old_logprobs(b, SimpleNamespace(step=3))["empo2/low_prob_masked_frac"] == 1.0
        ms.after_old_logprobs(batch(), SimpleNamespace(step=4))
    assert b.response_mask.sum() == 0
    warned = [r.getMessage() for r in caplog.records if "masked every row" in r.getMessage()]
    assert len(warned) == 1 and "step 3" in warned[0] and "low_prob_threshold=null" in warned[0]


# ------------------------------------------------------------------ the sampler on the tiny model
@pytest.fixture(scope="module")
def tiny_engine():
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.rollout.hf import HFRolloutEngine

    policy, tk = load_policy(compose_config(tiny_overrides()).model, torch.float32, seed=0)
    return HFRolloutEngine(policy, tk, batch_size=16)


class _EchoEnv:
    instructions = ""

    def reset(self, example):
        return None

    def step(self, text):
        from rlpost.envs.base import EnvStep

        return EnvStep([{"role": "tool", "content": "obs"}], 0.0, False, {"tool_calls": 1})


@pytest.fixture
def echo_env(monkeypatch):
    import rlpost.samplers.episode as episode

    monkeypatch.setattr(episode, "make_env", lambda name, params=None: _EchoEnv())


def _score(rows, texts, lengths):
    r = torch.tensor([float(len(t) % 2 == 0) for t in texts])
    return Rewards(r, {"correct": r})


SP = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, stop=list("aeiou "))
PROMPTS = [[5, 6, 7], [8, 9]]


def _sampler(**kw):
    args = dict(max_turns=2, max_total_tokens=64, transcripts=False, tip_max_tokens=6, similarity_threshold=-1.0)
    args.update(kw)
    return EMPO2Sampler(2, **args)


def _ctx(step):
    return SamplerContext(score=_score, step=step, seed=0, prompt_indices=[3, 7])


def test_memory_across_steps_notes_in_context_and_state_round_trip(tiny_engine, echo_env):
    s = _sampler(off_policy_prob=0.0, memory_on_policy_prob=1.0)  # every step on-policy with memory
    r1 = s.sample(tiny_engine, PROMPTS, SP, _ctx(1))
    assert r1.extras["empo2_mode"].tolist() == [ON_POLICY_MEMORY] * 4 and r1.extras["empo2_notes"].tolist() == [0] * 4
    assert set(s.memory.slots) == {3, 7}  # one slot per task instance, written after the episodes
    n1 = s.memory.size()
    assert n1 == r1.metrics["empo2/entries_written"] > 0
    assert all(e["score"] in (0.0, 1.0) for v in s.memory.slots.values() for e in v)
    r2 = s.sample(tiny_engine, PROMPTS, SP, _ctx(2))
    notes = r2.extras["empo2_notes"].tolist()
    assert all(k > 0 for k in notes) and s.memory.size() > n1  # memory kept and grown
    # on-policy with memory: the row is trained with the notes it was sampled with (longer prompt than step 1's)
    assert r2.generation.prompt_mask.sum(-1).min() > r1.generation.prompt_mask.sum(-1).max()
    # state round trip (plain values): the same retrievals
    t = _sampler()
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t.memory.slots == s.memory.slots
    assert t.memory.retrieve(3, "user: x") == s.memory.retrieve(3, "user: x") != []
    t.load_state_dict({})
    assert t.memory.size() == 0


def test_offpolicy_rows_get_their_memory_free_prompt(tiny_engine, echo_env):
    s = _sampler(off_policy_prob=1.0, memory_on_policy_prob=0.0, intrinsic_weight=1.0)
    r1 = s.sample(tiny_engine, PROMPTS, SP, _ctx(1))
    r2 = s.sample(tiny_engine, PROMPTS, SP, _ctx(2))
    assert r2.extras["empo2_offpolicy"].tolist() == [1.0] * 4 and r2.extras["empo2_notes"].min() > 0
    # the trained prompt is the plain one, id for id (sampling used the notes: the notes count says so)
    for g in (r1.generation, r2.generation):
        for i, p in enumerate([PROMPTS[0]] * 2 + [PROMPTS[1]] * 2):
            assert g.prompt_ids[i][g.prompt_mask[i] > 0].tolist() == p
    # the novelty reward 1 / (count + 1) on memory-mode rows
    k = r2.extras["empo2_notes"]
    assert torch.allclose(r2.extras["reward_intrinsic"], 1.0 / (k + 1.0))
    assert torch.allclose(r2.rewards, r2.extras["reward_correct"] + 1.0 / (k + 1.0))


def test_on_policy_steps_and_evaluation_use_no_memory(tiny_engine, echo_env):
    s = _sampler(off_policy_prob=0.0, memory_on_policy_prob=0.0)
    s.memory.add(3, "user: x", "old tip", 1.0)
    res = s.sample(tiny_engine, PROMPTS, SP, _ctx(1))
    assert res.extras["empo2_notes"].tolist() == [0] * 4 and res.extras["empo2_mode"].tolist() == [ON_POLICY] * 4
    assert s.memory.size() > 1  # tips are written in every mode
    # held-out evaluation (the examples swapped): plain episodes, nothing written
    from rlpost.tasks.base import Example

    s.attach(examples=[Example(i, f"q{i}", None) for i in range(10)])
    s.examples = [Example(i, f"held-out {i}", None) for i in range(10)]
    size = s.memory.size()
    ev = s.sample(tiny_engine, PROMPTS, SP, _ctx(0))
    assert s.memory.size() == size and "empo2_mode" not in ev.extras


# ------------------------------------------------------------------ config errors
def test_config_errors(compose):
    from rlpost.config.compose import validate_config
    from rlpost.core.errors import ConfigError
    from rlpost.methods.base import MethodSet
    from rlpost.samplers.base import build_sampler

    ok = compose(tiny_overrides("sampler=empo2", "algo=empo2"))
    assert ok.sampler.name == "empo2" and ok.algo.loss_params.eps_high == 0.3
    with pytest.raises(ConfigError, match="off_polcy_prob"):
        validate_config(compose(tiny_overrides("sampler=empo2", "+sampler.params.off_polcy_prob=0.2")))
    for over, msg in [("sampler.params.off_policy_prob=0.95", "sum"), ("sampler.params.memory_on_policy_prob=-0.1", "sum"),
                      ("sampler.params.branching=arpo", "branching=none"),
                      ("sampler.params.low_prob_threshold=1.0", "log-prob"),
                      ("sampler.params.tip_max_tokens=0", "tip_max_tokens"),
                      ("sampler.params.top_k=0", "top_k"), ("sampler.params.similarity_threshold=2", "similarity")]:
        cfg = compose(tiny_overrides("sampler=empo2", over))
        with pytest.raises(ConfigError, match=msg):
            build_sampler(cfg.sampler, cfg.algo.n_samples_per_prompt)
    with pytest.raises(ConfigError, match="partial_rollout=false"):
        MethodSet.for_config(compose(tiny_overrides("sampler=empo2", "executor.partial_rollout=true")))


# ------------------------------------------------------------------ training on calculator episodes
def test_two_steps_on_calculator_episodes_tiny(compose, tmp_path):
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("algo=empo2", "sampler=empo2", "task=multiply", "steps=2", "eval.at_end=false",
                                 "eval.every=0", "sampler.params.max_total_tokens=40", "sampler.params.tip_max_tokens=6",
                                 "sampler.params.off_policy_prob=1.0", "sampler.params.memory_on_policy_prob=0",
                                 "sampler.params.similarity_threshold=-1", "task.train_size=4",
                                 "checkpoint.every=1"))
    train(cfg, tmp_path / "t")
    rows = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "empo2/offpolicy_frac" in r]
    assert len(steps) == 2 and all(r["empo2/offpolicy_frac"] == 1.0 for r in steps)
    assert steps[0]["empo2/notes_mean"] == 0 and steps[1]["empo2/notes_mean"] > 0  # step 2 explores with memory
    assert all(math.isfinite(r["empo2/offpolicy_logratio_mean"]) for r in steps[1:])
    assert all("empo2/low_prob_masked_frac" in r for r in steps)
    state = torch.load(sorted((tmp_path / "t" / "checkpoints").glob("step_*"))[-1] / "state.pt", weights_only=False)
    assert sum(len(v) for v in state["sampler"]["memory"]["slots"].values()) == steps[1]["empo2/memory_entries"] > 0
