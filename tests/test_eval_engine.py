"""evaluate() through the real HF rollout engine (tiny model), and periodic eval while training on GSM8K."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SHARED_DATA, tiny_overrides

needs_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"shared benchmark data not found at {SHARED_DATA}")
GSM8K = [f"task.path={SHARED_DATA / 'gsm8k' / 'test.jsonl'}", f"task.train_path={SHARED_DATA / 'gsm8k' / 'train.jsonl'}"]


@needs_data
def test_evaluate_with_hf_engine_on_gsm8k(compose):
    from rlpost.config.schema import ModelConfig
    from rlpost.eval import evaluate
    from rlpost.models.loader import load_policy
    from rlpost.rollout.hf import HFRolloutEngine
    from rlpost.tasks import build_task

    cfg = compose(tiny_overrides("task=gsm8k", *GSM8K, "eval.limit=3", "eval.max_new_tokens=8", "eval.n_samples=2",
                                 "eval.ks=[1,2]", "eval.n_boot=100"))
    model, tok = load_policy(ModelConfig(source="tiny"), seed=0)
    engine = HFRolloutEngine(model, tok, batch_size=4, share_weights=True)
    task = build_task(cfg.task)
    res = evaluate(engine, tok, task, cfg.eval, seed=0)
    again = evaluate(engine, tok, task, cfg.eval, seed=0)
    assert res["n"] == 3 and [r["gold"] for r in res["records"]] == ["18", "3", "70000"]
    assert all(1 <= r["length"] <= 8 for r in res["records"])
    assert res["response_length_mean"] == pytest.approx(sum(r["length"] for r in res["records"]) / 3)
    assert [r["response"] for r in res["records"]] == [r["response"] for r in again["records"]]  # greedy is deterministic
    assert all(len(r["sample_correct"]) == 2 for r in res["records"])
    for key in ("pass@1", "pass@2", "maj@2", "mean@2"):
        assert 0.0 <= res[f"{key}_ci_low"] <= res[key] <= res[f"{key}_ci_high"] <= 1.0
    assert res["pass@2"] >= res["pass@1"]
    # the prompt went through the chat template with the boxed instruction
    ids = task.render_prompt(task.eval_examples()[0], tok)
    text = tok.decode(ids)
    assert "Janet" in text and "\\boxed{}" in text and text.rstrip().endswith("assistant")


@needs_data
def test_training_on_gsm8k_logs_periodic_eval(compose, tmp_path):
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("task=gsm8k", *GSM8K, "steps=2", "eval.every=1", "eval.limit=4", "eval.n_boot=100",
                                 "checkpoint.every=0"))
    train(cfg, tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [m for m in lines if "eval/gsm8k/accuracy" in m]
    assert len(evals) >= 2  # after step 1 (eval.every=1) and at the end
    assert all(0.0 <= m["eval/gsm8k/accuracy"] <= 1.0 for m in evals)
    final = json.loads((Path(tmp_path) / "eval.json").read_text())
    assert final["task"] == "gsm8k" and final["n"] == 4 and len(final["records"]) == 4


@needs_data
def test_evaluation_uses_trainings_stop_strings(compose):
    """evaluate(rollout_cfg=cfg.rollout) stops where training's rollouts stop (rollout.stop); it ignored them."""
    from omegaconf import OmegaConf

    from rlpost.config.schema import ModelConfig
    from rlpost.eval import evaluate
    from rlpost.models.loader import load_policy
    from rlpost.rollout.hf import HFRolloutEngine
    from rlpost.tasks import build_task

    cfg = compose(tiny_overrides("task=gsm8k", *GSM8K, "eval.limit=2", "eval.max_new_tokens=12", "eval.n_boot=10"))
    model, tok = load_policy(ModelConfig(source="tiny"), seed=0)
    engine = HFRolloutEngine(model, tok, batch_size=4, share_weights=True)
    task = build_task(cfg.task)
    free = evaluate(engine, tok, task, cfg.eval, seed=0, rollout_cfg=cfg.rollout)
    text = free["records"][0]["response"]
    assert free["records"][0]["length"] == 12 and len(text) >= 6, text
    stop = text[2:5]  # a stop string training would honour, inside the unstopped greedy response
    rollout = OmegaConf.merge(cfg.rollout, {"stop": [stop]})
    stopped = evaluate(engine, tok, task, cfg.eval, seed=0, rollout_cfg=rollout)
    r = stopped["records"][0]
    assert r["length"] < 12, (stop, r["response"])
    assert text.startswith(r["response"].split(stop)[0])
