"""Evaluation statistics, evaluate() with a scripted engine, and rlpost compare."""

from __future__ import annotations

import json
from itertools import combinations
from math import comb
from typing import List

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rlpost.config.schema import EvalConfig, TaskConfig
from rlpost.core.errors import ConfigError, DataError
from rlpost.eval import aggregate, bootstrap_ci, evaluate, maj_at_k, paired_bootstrap, pass_at_k, scalar_metrics
from rlpost.eval.compare import compare, compare_methods, load_run
from rlpost.rollout.base import GenerationResult, RolloutEngine, SamplingParams
from rlpost.tasks import build_task


# ---------------------------------------------------------------- pass@k
@pytest.mark.parametrize("n,c,k", [(5, 2, 1), (5, 2, 2), (5, 2, 3), (5, 2, 4), (10, 3, 5), (10, 0, 3), (4, 4, 2), (20, 1, 20)])
def test_pass_at_k_matches_closed_form(n, c, k):
    closed = 1.0 - comb(n - c, k) / comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)


def test_pass_at_k_equals_enumeration_over_subsets():
    # 6 samples, correct at positions 1 and 4: pass@3 = fraction of 3-subsets with a correct sample
    correct = [0, 1, 0, 0, 1, 0]
    subsets = list(combinations(range(6), 3))
    frac = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
    assert frac == pytest.approx(0.8)
    assert pass_at_k(6, 2, 3) == pytest.approx(frac)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 = c / n
    assert pass_at_k(1000, 500, 50) == pytest.approx(1.0)  # no overflow


def test_pass_at_k_rejects_bad_budgets():
    with pytest.raises(ConfigError, match="eval.n_samples"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ConfigError):
        pass_at_k(4, 5, 1)


def test_maj_at_k():
    answers = ["7", "7", "3", None, "7"]
    correct = [1, 1, 0, 0, 1]
    assert maj_at_k(answers, correct, 5) == 1.0
    assert maj_at_k(["3", "3", "7", "7"], [0, 0, 1, 1], 4) == 0.0  # tie -> first seen ("3")
    assert maj_at_k([None, None], [0, 0], 2) == 0.0
    # k=1 over a random subset equals the mean correctness in expectation
    est = maj_at_k(["a", "b", "b", "b"], [1, 0, 0, 0], 1, rng=np.random.default_rng(0), draws=4000)
    assert est == pytest.approx(0.25, abs=0.03)


def test_bootstrap_ci_contains_mean_and_shrinks_with_n():
    rng = np.random.default_rng(1)
    small = bootstrap_ci(rng.binomial(1, 0.3, 50), seed=0)
    large = bootstrap_ci(rng.binomial(1, 0.3, 2000), seed=0)
    assert small["ci_low"] <= small["mean"] <= small["ci_high"]
    assert (large["ci_high"] - large["ci_low"]) < (small["ci_high"] - small["ci_low"]) / 3
    # binomial standard error sqrt(p(1-p)/n) at n=2000 is about 0.0102; the 95% CI spans about 4 of them
    assert large["ci_high"] - large["ci_low"] == pytest.approx(4 * np.sqrt(0.3 * 0.7 / 2000), rel=0.2)
    one = bootstrap_ci([1.0])
    assert one["ci_low"] == one["ci_high"] == 1.0


def test_paired_bootstrap_detects_real_and_null_differences():
    rng = np.random.default_rng(0)
    base = rng.binomial(1, 0.5, size=(3, 300)).astype(float)
    better = np.maximum(base, rng.binomial(1, 0.3, size=base.shape))  # strictly improves ~15% of problems
    st = paired_bootstrap(better - base, seed=0)
    assert st["significant"] == 1.0 and st["ci_low"] > 0 and st["p_value"] < 0.01
    same = paired_bootstrap(np.zeros((3, 300)), seed=0)
    assert same["significant"] == 0.0 and same["mean"] == 0.0 and same["p_value"] == 1.0
    noise = paired_bootstrap(rng.binomial(1, 0.5, (2, 40)) - rng.binomial(1, 0.5, (2, 40)), seed=0)
    assert noise["ci_low"] < 0 < noise["ci_high"] and noise["significant"] == 0.0
    strat = paired_bootstrap([np.ones((2, 5)), np.zeros((2, 50))], seed=0)
    assert strat["mean"] == 0.5  # benchmark-balanced, not pooled (pooled would be 10/110)
    with pytest.raises(ConfigError):
        paired_bootstrap([np.ones((2, 5)), np.ones((3, 5))])


# ---------------------------------------------------------------- evaluate()
class ScriptedEngine(RolloutEngine):
    """Answers with ``answer_fn(prompt_ids, call_number)``; records the sampling params it got."""

    def __init__(self, answer_fn):
        self.answer_fn = answer_fn
        self.calls: List[SamplingParams] = []
        self.count = 0

    def generate(self, prompts, params):
        self.calls.append(params)
        texts = []
        for p in prompts:
            texts.append(self.answer_fn(p, self.count))
            self.count += 1
        B, R = len(prompts), 4
        mask = torch.ones(B, R)
        mask[:, 3] = 0
        return GenerationResult(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1), torch.zeros(B, R, dtype=torch.long),
                                mask, torch.zeros(B, R), torch.ones(B, R), torch.tensor([i % 2 == 0 for i in range(B)]), texts)

    def sync_weights(self, policy):
        pass


class IdTokenizer:
    """Encodes a prompt as the index of its question so the engine knows which problem it sees."""

    chat_template = None

    def __init__(self, task):
        self.lookup = {f"{e.question}\n{task.cfg.instruction}".strip() + "\n": i for i, e in enumerate(task.eval_examples())}

    def __call__(self, text, **kw):  # prompt text is encoded as plain text (split_special_tokens=True)
        return {"input_ids": [self.lookup[text]]}


def arith_task(n=20):
    return build_task(OmegaConf.structured(TaskConfig(train_size=10, eval_size=n, answer_format="tags")))


def test_evaluate_greedy_accuracy_and_records():
    task = arith_task()
    golds = [e.answer for e in task.eval_examples()]
    # right on even problems, wrong on odd ones
    eng = ScriptedEngine(lambda p, i: f"<answer>{golds[p[0]] if p[0] % 2 == 0 else 'x'}</answer>")
    res = evaluate(eng, IdTokenizer(task), task, EvalConfig(limit=10, max_new_tokens=32, batch_size=4), seed=3)
    assert res["n"] == 10 and res["accuracy"] == 0.5
    assert res["accuracy_ci_low"] < 0.5 < res["accuracy_ci_high"]
    assert res["response_length_mean"] == 3.0 and res["truncated_frac"] == pytest.approx(0.5)  # odd rows of chunks 4, 4, 2
    assert all(p.greedy and p.max_new_tokens == 32 for p in eng.calls) and len(eng.calls) == 3
    assert [r["correct"] for r in res["records"]] == [1.0, 0.0] * 5
    assert res["records"][0]["extracted"] == str(golds[0]) and res["records"][0]["gold"] == golds[0]
    m = scalar_metrics(res)
    assert m["eval/arithmetic/accuracy"] == 0.5 and "eval/arithmetic/records" not in m
    json.dumps(res)  # the whole result is JSON-serialisable (eval.json)


def test_evaluate_pass_at_k_from_samples():
    task = arith_task(6)
    golds = [e.answer for e in task.eval_examples()]
    n = 4

    # sampled call: sample j of problem p is right iff j < p (problem p has min(p, 4) correct of 4)
    def answer(p, i):
        if i < 6:
            return "<answer>x</answer>"
        j = (i - 6) % n
        return f"<answer>{golds[p[0]] if j < p[0] else 'w' + str(j)}</answer>"

    eng = ScriptedEngine(answer)
    res = evaluate(eng, IdTokenizer(task), task, EvalConfig(limit=6, n_samples=n, ks=[1, 2, 4], temperature=0.7), seed=0)
    assert res["accuracy"] == 0.0
    assert not eng.calls[1].greedy and eng.calls[1].temperature == 0.7
    cs = [min(p, n) for p in range(6)]
    assert res["pass@1"] == pytest.approx(np.mean([c / n for c in cs]))
    assert res["pass@2"] == pytest.approx(np.mean([1 - comb(n - c, 2) / comb(n, 2) for c in cs]))
    assert res["pass@4"] == pytest.approx(np.mean([float(c > 0) for c in cs]))
    assert res["mean@4"] == pytest.approx(res["pass@1"])
    # maj@4: wrong answers are all distinct and the gold comes first, so it wins (alone or by the
    # first-seen tie-break) whenever it appears at all: problems 1..5
    assert res["maj@4"] == pytest.approx(5 / 6)
    assert res["records"][3]["sample_correct"] == [1.0, 1.0, 1.0, 0.0]
    with pytest.raises(ConfigError, match="eval.n_samples"):
        evaluate(eng, IdTokenizer(task), task, EvalConfig(limit=2, n_samples=2, ks=[4]))


def test_aggregate_is_benchmark_balanced():
    r1 = {"task": "a", "n": 2, "records": [{"correct": 1.0}, {"correct": 1.0}]}
    r2 = {"task": "b", "n": 8, "records": [{"correct": 0.0}] * 8}
    agg = aggregate({"a": r1, "b": r2}, n_boot=200)
    assert agg["macro_accuracy"] == 0.5 and agg["micro_accuracy"] == pytest.approx(0.2) and agg["n"] == 10.0


# ---------------------------------------------------------------- compare
def write_run(d, seed, correct, task="gsm8k", questions=None):
    d.mkdir(parents=True)
    recs = [{"index": i, "question": (questions or {}).get(i, f"q{i}"), "correct": float(c)} for i, c in enumerate(correct)]
    (d / "eval.json").write_text(json.dumps({"task": task, "seed": seed, "n": len(recs), "accuracy": float(np.mean(correct)), "records": recs}))


def test_compare_paired_runs_significant_and_not(tmp_path):
    rng = np.random.default_rng(0)
    base = {s: rng.binomial(1, 0.4, 200) for s in range(3)}
    for s in range(3):
        write_run(tmp_path / "A" / f"s{s}", s, base[s])
        write_run(tmp_path / "B" / f"s{s}", s, np.maximum(base[s], rng.binomial(1, 0.4, 200)))
    text, results = compare([str(tmp_path / "A"), str(tmp_path / "B")], n_boot=500)
    ab = results[0]["tasks"]["gsm8k"]
    assert results[0]["seeds"] == [0, 1, 2] and ab["n_problems"] == 200 and ab["n_seeds"] == 3
    assert ab["diff"] > 0.15 and ab["significant"] and ab["ci_low"] > 0
    assert "significant: the 95% CI excludes 0" in text
    # identical runs: exactly zero difference, reported as not significant
    write_run(tmp_path / "A2" / "s0", 0, base[0])
    write_run(tmp_path / "A3" / "s0", 0, base[0])
    text2, res2 = compare([str(tmp_path / "A2"), str(tmp_path / "A3")])
    assert res2[0]["overall"]["diff"] == 0.0 and not res2[0]["overall"]["significant"]
    assert "not significant" in text2 and "one seed only" in text2


def test_compare_rejects_unmatched_runs(tmp_path):
    write_run(tmp_path / "A" / "r", 0, [1, 0, 1])
    write_run(tmp_path / "B" / "r", 1, [1, 1, 1])
    with pytest.raises(DataError, match="share no seed"):
        compare([str(tmp_path / "A"), str(tmp_path / "B")])
    write_run(tmp_path / "C" / "r", 0, [1, 1, 1], questions={1: "another question"})
    with pytest.raises(DataError, match="different questions"):
        compare([str(tmp_path / "A"), str(tmp_path / "C")])
    with pytest.raises(DataError, match="no run with eval.json"):
        compare([str(tmp_path / "A"), str(tmp_path / "nothing")])
    with pytest.raises(DataError, match="at least two"):
        compare([str(tmp_path / "A")])
    with pytest.raises(DataError, match="pass@4"):
        load_run(tmp_path / "A" / "r", metric="pass@4")


def test_compare_matches_common_problems_and_seeds(tmp_path):
    write_run(tmp_path / "A" / "r0", 0, [1, 0, 0, 0])
    write_run(tmp_path / "A" / "r1", 1, [1, 0, 0, 0])
    write_run(tmp_path / "B" / "r0", 0, [1, 1, 1])  # evaluated 3 problems only
    res = compare_methods([load_run(tmp_path / "A" / "r0"), load_run(tmp_path / "A" / "r1")], [load_run(tmp_path / "B" / "r0")],
                          "A", "B", n_boot=200)
    assert res["seeds"] == [0] and res["dropped_seeds"] == [1]
    st = res["tasks"]["gsm8k"]
    assert st["n_problems"] == 3 and st["mean_a"] == pytest.approx(1 / 3) and st["diff"] == pytest.approx(2 / 3)
    assert (st["n_problems_a"], st["n_problems_b"]) == (4, 3)
    from rlpost.eval.compare import format_report

    assert "only the 3 problems evaluated by both are compared (A: 4, B: 3)" in format_report(res)


def test_compare_cli_command(tmp_path):
    from typer.testing import CliRunner

    import rlpost.cli as cli
    import rlpost.eval.compare as cmp

    cmp.register_cli(cli.app)
    write_run(tmp_path / "A" / "r", 0, [0, 1, 0, 1])
    write_run(tmp_path / "B" / "r", 0, [0, 1, 0, 1])
    out = tmp_path / "cmp.json"
    res = CliRunner().invoke(cli.app, ["compare", str(tmp_path / "A"), str(tmp_path / "B"), "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "not significant" in res.output
    assert json.loads(out.read_text())[0]["overall"]["diff"] == 0.0
    bad = CliRunner().invoke(cli.app, ["compare", str(tmp_path / "A"), str(tmp_path / "missing")])
    assert bad.exit_code == DataError.exit_code and "no run with eval.json" in bad.output


def test_eval_tasks_from_presets_with_paths():
    from pathlib import Path

    from rlpost.eval.evaluate import build_eval_tasks, evaluate_tasks

    data = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    if not data.is_dir():
        pytest.skip(f"shared benchmark data not found at {data}")
    tasks = build_eval_tasks([f"aime24:{data / 'aime24' / 'test.jsonl'}", f"amc23:{data / 'amc23' / 'test.jsonl'}"])
    assert list(tasks) == ["aime24", "amc23"]
    golds = {name: [str(e.answer) for e in t.eval_examples()] for name, t in tasks.items()}

    class Tok:
        chat_template = None

        def __call__(self, text, **kw):  # prompt text is encoded as plain text (split_special_tokens=True)
            return {"input_ids": [len(text)]}

    # always answers 27: right on AMC problem 0 only (and on no AIME problem)
    eng = ScriptedEngine(lambda p, i: "so \\boxed{27}")
    out = evaluate_tasks(eng, Tok(), tasks, EvalConfig(limit=5, n_boot=200))
    assert golds["amc23"][0] == "27.0"
    assert out["results"]["amc23"]["accuracy"] == pytest.approx(1 / 5)
    assert out["results"]["aime24"]["accuracy"] == 0.0
    assert out["metrics"]["eval/amc23/accuracy"] == pytest.approx(0.2)
    assert out["metrics"]["eval/aggregate/macro_accuracy"] == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="Valid choices"):
        build_eval_tasks(["gsm8kk"])
