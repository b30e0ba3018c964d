"""scripts/gpu_check.py parts dp and lora in --dry-run: the same code on CPU (hf engine, toy Qwen3, gloo)."""

import json
import os
import subprocess
import sys

from conftest import REPO


def test_gpu_check_dp_and_lora_dry_runs_pass_on_cpu(tmp_path):
    """Both parts run in subprocesses; every check PASSes with real figures behind it.

    dp: 2 torch.distributed.run ranks, rows token-exact against one engine with the same per-row seeds, 4 rows per rank.
    lora: only lora_B moved (base exactly frozen), the pushed engine matches the merged weights, and the
    KL reference with adapters disabled equals a separately built base model.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    recs = {}
    for part in ("dp", "lora"):
        out = tmp_path / f"{part}.json"
        p = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--part", part, "--json", str(out)],
                           cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        recs.update({r["check"]: r for r in json.loads(out.read_text())})
    assert sorted(recs) == ["dp_rollouts", "lora_kl_reference", "lora_push_parity", "lora_update"]
    assert all(r["pass"] for r in recs.values()), [r["detail"] for r in recs.values() if not r["pass"]]
    dp = recs["dp_rollouts"]
    assert dp["ranks"] == 2 and dp["rows_equal"] == dp["rows"] == 8
    assert len(dp["tokens_per_s_per_rank"]) == 2 and dp["tokens_per_s"] > 0
    push = recs["lora_push_parity"]
    assert push["gap"] <= 1e-3 and push["stale"] >= 3 * push["gap"] and push["stale"] > 0.01
    assert recs["lora_kl_reference"]["ref_vs_base"] <= 1e-5 and recs["lora_kl_reference"]["policy_vs_ref"] > 1e-3
