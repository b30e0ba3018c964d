"""rlpost eval harness=TASKS: an rlpost checkpoint scored by lm-evaluation-harness on a local task, offline.

The check is independent of lm-eval: the log-likelihood of every answer choice
is recomputed here with plain transformers on the same checkpoint, and lm-eval's
per-document log-likelihoods and its accuracy must equal those numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO

pytest.importorskip("lm_eval")

DOCS = [("What is 1 + 2?", ["3", "4", "12"], 0), ("What is 3 + 4?", ["5", "7", "34"], 1),
        ("What is 2 + 2?", ["4", "22", "5"], 0), ("What is 9 + 1?", ["19", "91", "10"], 2),
        ("What is 5 + 3?", ["8", "53", "2"], 0), ("What is 6 + 6?", ["66", "12", "0"], 1)]


def _task(tmp_path):
    d = tmp_path / "tasks"
    d.mkdir()
    data = tmp_path / "add.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": y}) + "\n" for q, c, y in DOCS))
    (d / "local_add.yaml").write_text(f"""task: local_add
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    return d


def test_harness_scores_a_checkpoint_with_a_local_task_offline(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlpost.run.checkpoint import save_hf
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy

    ck = tmp_path / "final"
    policy, tok = load_policy(ModelConfig(source="tiny"), torch.float32, seed=3)
    save_hf(policy, tok, ck)
    tasks = _task(tmp_path)
    out = tmp_path / "eval"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "rlpost.cli", "eval", "model=tiny", "logger=jsonl",
                        f"eval.checkpoint={ck}", "harness=local_add", f"harness.include={tasks}", "harness.batch_size=3",
                        f"hydra.run.dir={out}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((out / "harness.json").read_text())
    rows = [json.loads(x) for x in (out / "harness_samples.jsonl").read_text().splitlines()]
    assert res["n_samples"]["local_add"]["effective"] == len(DOCS) and len(rows) == len(DOCS)

    # the same numbers from the checkpoint with plain transformers: sum of log p(choice | prompt)
    model = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32).eval()
    tk = AutoTokenizer.from_pretrained(ck)
    correct = []
    for row in sorted(rows, key=lambda r: r["doc_id"]):
        q, choices, label = DOCS[row["doc_id"]]
        ctx = f"Question: {q}\nAnswer:"
        lls = []
        for c in choices:
            whole = tk(ctx + " " + c, add_special_tokens=False)["input_ids"]
            n_ctx = len(tk(ctx, add_special_tokens=False)["input_ids"])
            ids = torch.tensor([whole])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            lls.append(float(sum(logp[i - 1, whole[i]] for i in range(n_ctx, len(whole)))))
        theirs = [float(r[0]) for r in row["response"]]
        assert theirs == pytest.approx(lls, abs=2e-3), (row["doc_id"], theirs, lls)
        assert row["acc"] == float(max(range(len(lls)), key=lls.__getitem__) == label)
        correct.append(row["acc"])
    assert res["results"]["local_add"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
    assert "local_add: acc=" in p.stdout


def test_harness_refuses_unknown_task_and_missing_folder(tmp_path):
    from types import SimpleNamespace

    from rlpost.config.schema import HarnessConfig
    from rlpost.core.errors import ConfigError
    from rlpost.eval.harness import check_tasks, run_harness

    with pytest.raises(ConfigError, match="is not a folder"):
        run_harness(None, None, HarnessConfig(tasks=["local_add"], include=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="eval.harness.tasks is empty"):
        run_harness(None, None, HarnessConfig(tasks=[]))
    # check_tasks reads only the task manager's names (indexing lm-eval's real tasks takes tens of seconds)
    tm = SimpleNamespace(all_tasks=["arc_easy", "gsm8k", "local_add"])
    check_tasks(tm, ["gsm8k", "local_add"])
    with pytest.raises(ConfigError, match="'local_ad' is not an lm-eval task.*Did you mean local_add"):
        check_tasks(tm, ["local_ad"])


def test_harness_shorthand_maps_onto_eval_harness():
    from rlpost.cli import _harness_shorthand

    assert _harness_shorthand(["harness=gsm8k,arc_easy", "harness.limit=5", "model=tiny"]) == [
        "eval.harness.tasks=[gsm8k,arc_easy]", "eval.harness.limit=5", "model=tiny"]
