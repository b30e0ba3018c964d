"""XRPO's in-context seeding (sampler=xrpo_icl, arXiv:2510.06672): which prompts are seeded, the prompt built,
how many exemplars, what the loss trains on, the exemplar file's errors, and a real tiny-model step."""

from __future__ import annotations

import json
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_overrides
from fake_engine import FakeEngine, scorer
from rlpost.core.errors import ConfigError
from rlpost.rollout.base import SamplingParams
from rlpost.samplers import SAMPLERS, SamplerContext
from rlpost.samplers.base import build_sampler
from rlpost.samplers.xrpo_icl import (FOOTER, HEADER, load_exemplars, probe_count, resolve_exemplar_file, retrieve,
                                      seeded_question, similarity, trigrams)
from rlpost.tasks.base import Example

PARAMS = SamplingParams(max_new_tokens=6, seed=5)
MARK = 11  # the fake task writes one token 11 per exemplar into a seeded prompt (the engine samples 1, 3..9)


def write_bank(tmp_path, rows, name="bank.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


BANK = [{"task": "fake", "question": "Calculate 1 + 2.", "solution": "1 + 2 = 3"},
        {"task": "fake", "question": "Calculate 10 + 20.", "solution": "10 + 20 = 30"},
        {"task": "fake", "question": "Name a colour.", "solution": "red"}]


class FakeTask:
    """Renders example i as ``[100 + i, 7]``; a seeded question (HEADER in front) as ``[300 + i, 7] + [MARK] * K``."""

    def __init__(self, name="fake"):
        self.cfg = SimpleNamespace(name=name)
        self.rendered = []

    def render_prompt(self, example, tokenizer):
        self.rendered.append(example.question)
        if example.question.startswith(HEADER):
            return [300 + example.index, 7] + [MARK] * example.question.count("Problem: ")
        return [100 + example.index, 7]


def examples():
    return [Example(index=i, question=q, answer="") for i, q in
            enumerate(["Calculate 1 + 3.", "Calculate 2 + 2.", "Calculate 10 + 30."])]


def make(tmp_path, n=4, task=None, **kw):
    kw.setdefault("template", "user_turn")  # the fake task has no user message: exemplars in the user turn
    s = SAMPLERS.get("xrpo_icl")(n, exemplar_file=write_bank(tmp_path, BANK), **kw)
    s.attach(task=task or FakeTask(), examples=examples())
    return s


# ----------------------------------------------------------------- pieces by hand
def test_probe_count_splits_each_prompts_rollouts_by_hand():
    assert [probe_count(c, 0.5) for c in (0, 1, 2, 3, 4, 8)] == [0, 1, 1, 2, 2, 4]
    assert probe_count(8, 0.25) == 2 and probe_count(8, 0.99) == 7 and probe_count(8, 0.01) == 1


def test_trigram_similarity_and_retrieval_by_hand():
    assert trigrams("ab  CD") == Counter({"ab ": 1, "b c": 1, " cd": 1})
    assert similarity(trigrams("aaaa"), trigrams("aaa")) == pytest.approx(1.0)  # {aaa: 2} vs {aaa: 1}
    # "abcd" = {abc, bcd}; "abc" = {abc}: cos = 1 / sqrt(2 * 1)
    assert similarity(trigrams("abcd"), trigrams("abc")) == pytest.approx(1 / math.sqrt(2))
    bank = [{"question": q, "solution": "s"} for q in ("abc", "abd", "xyz", "bcd")]
    # similarities to "abcd": 0.7071, 0, 0, 0.7071; the best two in prompt order (most similar last, ties to the earlier)
    assert retrieve("abcd", bank, 2) == [3, 0]
    assert retrieve("abcd", bank, 3) == [1, 3, 0]
    # the prompt's own question is never an exemplar (it would give the answer away)
    assert retrieve("ABC ", bank, 1) == [1]  # "abc" itself left out; the rest all score 0: the earliest
    assert 0 not in retrieve("abc", bank, 4) and len(retrieve("abc", bank, 9)) == 3


def test_seeded_question_text_by_hand():
    ex = [{"question": "Calculate 1 + 2.", "solution": "1 + 2 = 3"}, {"question": " Name a colour. ", "solution": "red, blue"}]
    assert seeded_question("Calculate 5 + 6.", ex, 4) == (
        "Here are solved examples of similar problems.\n\n"
        "Problem: Calculate 1 + 2.\nSolution: 1 + \n\n"
        "Problem: Name a colour.\nSolution: red,\n\n"
        "Now solve this problem.\nCalculate 5 + 6.")
    assert seeded_question("q", [], 10) == HEADER + FOOTER + "q"


# ----------------------------------------------------------------- the sampler on a fake engine
def test_only_prompts_whose_probes_all_failed_are_seeded_with_k_exemplars(tmp_path):
    # prompt 0 and 2 always fail, prompt 1 always succeeds; a seeded prompt (300 + i) always succeeds
    eng = FakeEngine({100: 0.0, 101: 1.0, 102: 0.0, 300: 1.0, 302: 1.0})
    task = FakeTask()
    s = make(tmp_path, 4, task=task, grow_corpus=False)
    prompts = [[100, 7], [101, 7], [102, 7]]
    out = s.sample(eng, prompts, PARAMS, SamplerContext(score=scorer(), prompt_indices=[0, 1, 2]))
    # call 0: 2 probes each; call 1: the other 2 each, prompts 0 and 2 seeded with K = 2 exemplars
    assert eng.calls[0] == [[100, 7]] * 2 + [[101, 7]] * 2 + [[102, 7]] * 2
    assert eng.calls[1] == [[300, 7, MARK, MARK]] * 2 + [[101, 7]] * 2 + [[302, 7, MARK, MARK]] * 2
    # the seeded question of prompt 0 ("Calculate 1 + 3."): its two nearest exemplars, the nearest last
    q0 = next(q for q in task.rendered if q.startswith(HEADER) and q.endswith("Calculate 1 + 3."))
    assert q0 == seeded_question("Calculate 1 + 3.", [BANK[1], BANK[0]], 800)
    assert out.group_index.tolist() == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2] and out.rollouts_spent == 12
    assert out.extras["icl_seeded"].tolist() == [0] * 6 + [1, 1, 0, 0, 1, 1]
    assert out.rewards.tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1]
    assert out.metrics == {"sampler/icl_prompts_seeded": 2.0, "sampler/icl_rows_seeded": 4.0,
                           "sampler/icl_prompts_revived": 2.0, "sampler/icl_seeded_solved_rate": 1.0,
                           "sampler/icl_no_exemplar": 0.0, "sampler/icl_corpus_grown": 0.0,
                           "sampler/icl_corpus_size_mean": 3.0}
    # what is trained: the response tokens only; the exemplar tokens sit in the prompt (prompt mask), never in the loss
    g = out.generation
    assert g.response_mask.sum(-1).tolist() == [6.0] * 12
    seeded = out.extras["icl_seeded"] > 0
    assert (g.prompt_ids[seeded] == MARK).sum(-1).tolist() == [2] * 4
    assert bool((g.prompt_mask[seeded].sum(-1) == 4).all()) and bool((g.prompt_mask[~seeded].sum(-1) == 2).all())
    assert not bool((g.response_ids[g.response_mask > 0] == MARK).any())


def test_a_prompt_with_some_solved_probes_is_not_seeded_unless_max_solve_rate_allows(tmp_path):
    eng = FakeEngine({100: 0.5, 300: 1.0})
    ctx = SamplerContext(score=scorer(lambda idx, texts: [1.0, 0.0] + [0.0] * (len(texts) - 2)), prompt_indices=[0])
    out = make(tmp_path, 4, grow_corpus=False).sample(eng, [[100, 7]], PARAMS, ctx)  # probes: 1 solved, 1 failed
    assert out.metrics["sampler/icl_prompts_seeded"] == 0.0 and eng.calls[1] == [[100, 7]] * 2
    eng = FakeEngine({100: 0.5, 300: 1.0})
    out = make(tmp_path, 4, grow_corpus=False, max_solve_rate=0.5).sample(eng, [[100, 7]], PARAMS, ctx)
    assert out.metrics["sampler/icl_prompts_seeded"] == 1.0 and eng.calls[1] == [[300, 7, MARK, MARK]] * 2


def test_train_on_original_gives_the_loss_the_prompt_without_exemplars(tmp_path):
    eng = FakeEngine({100: 0.0, 300: 1.0})
    out = make(tmp_path, 4, train_on="original").sample(eng, [[100, 7]], PARAMS,
                                                         SamplerContext(score=scorer(), prompt_indices=[0]))
    g = out.generation
    assert out.extras["icl_seeded"].tolist() == [0, 0, 1, 1] and out.rewards.tolist() == [0, 0, 1, 1]
    assert g.prompt_ids.tolist() == [[100, 7]] * 4 and g.prompt_mask.tolist() == [[1, 1]] * 4
    assert g.rollout_logprobs[2:].sum().item() == pytest.approx(-0.5 * 12)  # the engine's seeded-context log-probs kept


def test_the_corpus_grows_from_solved_probes_and_is_saved(tmp_path):
    eng = FakeEngine({100: 0.0, 101: 1.0, 102: 0.0, 300: 1.0, 302: 1.0})
    s = make(tmp_path, 4, num_exemplars=1)
    out = s.sample(eng, [[100, 7], [101, 7], [102, 7]], PARAMS, SamplerContext(score=scorer(), prompt_indices=[0, 1, 2]))
    # prompt 1's first solved probe is now an exemplar (once), and the nearest one for "Calculate 1 + 3."
    assert [e["question"] for e in s.grown] == ["Calculate 2 + 2."] and out.metrics["sampler/icl_corpus_grown"] == 1.0
    assert out.metrics["sampler/icl_corpus_size_mean"] == 4.0
    assert s.grown[0]["solution"].startswith("1") and retrieve("Calculate 2 + 2", s.corpus, 1) == [3]
    assert not s.add_solved("calculate 2 +  2.", "again")  # one exemplar per question
    state = s.state_dict()
    t = make(tmp_path, 4)
    t.load_state_dict(state)
    assert t.corpus == s.corpus
    cap = make(tmp_path, 4, max_corpus=2)
    for q in ("a b c", "d e f", "g h i"):
        assert cap.add_solved(q, "x")
    assert [e["question"] for e in cap.grown] == ["d e f", "g h i"] and len(cap.corpus) == 5


def test_no_usable_exemplar_leaves_the_prompt_zero_shot(tmp_path):
    s = SAMPLERS.get("xrpo_icl")(4, exemplar_file=write_bank(tmp_path, [BANK[0]]), grow_corpus=False)
    s.attach(task=FakeTask(), examples=[Example(index=0, question="Calculate 1 + 2.", answer="3")])
    eng = FakeEngine({100: 0.0})
    out = s.sample(eng, [[100, 7]], PARAMS, SamplerContext(score=scorer(), prompt_indices=[0]))
    assert eng.calls[1] == [[100, 7]] * 2 and out.metrics["sampler/icl_no_exemplar"] == 1.0


def test_the_selectors_rollout_counts_are_honoured(tmp_path):
    eng = FakeEngine({100: 0.0, 101: 0.0, 300: 1.0, 301: 1.0})
    ctx = SamplerContext(score=scorer(), prompt_indices=[0, 1], rollout_counts=[6, 1])
    out = make(tmp_path, 4, grow_corpus=False).sample(eng, [[100, 7], [101, 7]], PARAMS, ctx)
    # prompt 0: 3 probes then 3 seeded; prompt 1: its one rollout is a probe (nothing left to seed)
    assert eng.calls[0] == [[100, 7]] * 3 + [[101, 7]] and eng.calls[1] == [[300, 7, MARK, MARK]] * 3
    assert out.rollouts_spent == 7 and out.metrics["sampler/icl_prompts_seeded"] == 1.0


# ----------------------------------------------------------------- errors
def test_missing_or_malformed_exemplar_files_name_the_file_and_the_fix(tmp_path):
    fix = "make_exemplars.py"
    with pytest.raises(ConfigError, match=r"nope\.jsonl.*does not exist.*Packaged names: arithmetic.*" + fix):
        load_exemplars(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match=r"exemplars/gsm8k\.jsonl.*does not exist"):
        build_sampler(SimpleNamespace(name="xrpo_icl", params={"exemplar_file": "gsm8k"}), 4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "solution": "s"}\n{"question": "q2", \n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2 is not JSON.*" + fix):
        load_exemplars(str(bad))
    bad.write_text('{"question": "q", "answer": "3"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1 needs non-empty string fields 'question' and 'solution'"):
        load_exemplars(str(bad))
    bad.write_text("\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl holds no exemplar"):
        load_exemplars(str(bad))
    # exemplars of another task: refused when the run attaches its task
    s = SAMPLERS.get("xrpo_icl")(4)
    with pytest.raises(ConfigError, match=r"exemplars of task \['arithmetic'\].*task is 'gsm8k'.*task=gsm8k"):
        s.attach(task=FakeTask("gsm8k"), examples=[])
    s.attach(task=FakeTask("arithmetic"), examples=[])


@pytest.mark.parametrize("params,match", [
    ({"num_exemplars": 0}, "num_exemplars=0 must be >= 1"), ({"probe_fraction": 1.0}, "probe_fraction=1.0"),
    ({"max_solve_rate": 1.0}, "max_solve_rate=1.0"), ({"max_corpus": -1}, "max_corpus=-1"),
    ({"train_on": "both"}, "seeded or original"), ({"template": "system"}, "chat_turns or user_turn"), ({"num_exemplar": 2}, "num_exemplar"),
])
def test_bad_params_are_config_errors(params, match):
    with pytest.raises(ConfigError, match=match):
        build_sampler(SimpleNamespace(name="xrpo_icl", params=params), 4)


def test_the_packaged_exemplars_are_verified_answers_of_the_training_split():
    from rlpost.config.compose import compose_config
    from rlpost.tasks.base import build_task

    path, rows = load_exemplars("arithmetic")
    assert path == resolve_exemplar_file("arithmetic") and path.name == "arithmetic.jsonl" and len(rows) == 32
    task = build_task(compose_config(["model=tiny"]).task)
    train = {e.question: e for e in task.train_examples()}
    held_out = {e.question for e in task.eval_examples()}
    for r in rows:
        assert r["task"] == "arithmetic" and r["question"] in train and r["question"] not in held_out
        assert task.score(r["solution"], train[r["question"]]) == 1.0


# ----------------------------------------------------------------- a real step
def test_xrpo_full_recipe_seeds_failed_prompts_on_tiny(compose, tmp_path):
    from rlpost.run.runner import Run

    cfg = compose(["+recipe=xrpo_full", *tiny_overrides("steps=1", "eval.at_end=false")])
    assert (cfg.algo.adv_estimator, cfg.selector.name, cfg.sampler.name) == ("xrpo", "xrpo", "xrpo_icl")
    run = Run(cfg, tmp_path / "run")
    try:
        c = run.collect(1, run.trainer.version, 0)
        m = run.learn(c)
    finally:
        run.close()
    b = c.batch
    seeded = b.extras["icl_seeded"] > 0
    # the random tiny model fails every probe: the prompts seeded are exactly the prompts whose probes all failed
    assert m["sampler/icl_prompts_seeded"] > 0 and bool(seeded.any())
    for g in set(b.group_index[seeded].tolist()):
        probes = (b.group_index == g) & ~seeded
        assert float(b.rewards[probes].max()) < 1.0
    # template=chat_turns: system prompt, two exemplar user/assistant turns from the packaged file, then the problem
    i = int(torch.nonzero(seeded)[0])
    text = run.tokenizer.decode(b.prompt_ids[i][b.prompt_mask[i] > 0])
    _, bank = load_exemplars("arithmetic")
    solutions = {e["solution"] for e in bank}
    turns = text.split("<|im_start|>")
    assert [t.split("\n", 1)[0] for t in turns[1:]] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert all(t.split("\n", 1)[1].split("<|im_end|>")[0] in solutions for t in (turns[3], turns[5]))
    assert turns[6].split("\n", 1)[1].split("<|im_end|>")[0] == run.train_examples[int(b.prompt_index[i])].question
    assert torch.equal(b.response_mask.sum(-1) > 0, torch.ones(len(b.rewards), dtype=torch.bool))
    losses = [v for k, v in m.items() if k.startswith("loss/")]
    assert losses and all(math.isfinite(v) for v in losses)


def test_ids_after_the_rendered_prompt_such_as_a_hint_stay_after_the_seeded_prompt(tmp_path):
    eng = FakeEngine({100: 0.0, 300: 1.0})
    out = make(tmp_path, 2, grow_corpus=False).sample(eng, [[100, 7, 5, 6]], PARAMS,  # [100, 7] rendered, [5, 6] a hint
                                                      SamplerContext(score=scorer(), prompt_indices=[0]))
    assert eng.calls[1] == [[300, 7, MARK, MARK, 5, 6]] and out.rewards.tolist() == [0.0, 1.0]
