"""The per-GPU memory budget (rlpost.run.memory) against hand-computed numbers for Qwen3-8B's shape."""

from __future__ import annotations

import pytest

from conftest import tiny_overrides  # noqa: F401  (conftest sets up the config dir)

GiB = 1024 ** 3

# Qwen/Qwen3-8B config.json (the fields the budget reads)
QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                max_position_embeddings=40960, tie_word_embeddings=False)


def test_qwen3_8b_parameter_count_and_kv_bytes_by_hand():
    from rlpost.run.memory import shape_from_config

    s = shape_from_config(QWEN3_8B)
    # per layer: q 4096*4096 + k,v 2*4096*1024 + o 4096*4096 + MLP 3*4096*12288 + 2 RMSNorms 2*4096 + q/k norms 2*128
    per_layer = 16_777_216 + 8_388_608 + 16_777_216 + 150_994_944 + 8_192 + 256
    assert per_layer == 192_946_432
    embed = 151_936 * 4096
    assert s.params == 36 * per_layer + 2 * embed + 4096 == 8_190_735_360  # untied head, final norm
    assert s.kv_bytes_per_token(2) == 2 * 36 * 8 * 128 * 2 == 147_456  # 144 KiB per token in bf16


def test_zero3_sao_vllm_budget_items_by_hand(compose):
    from rlpost.run.memory import estimate, shape_from_config

    s = shape_from_config(QWEN3_8B)
    P = 8_190_735_360
    cfg = compose(["algo=sao", "model=qwen3-8b", "rollout=vllm", "trainer=deepspeed", "precision=bf16",
                   "trainer.zero_stage=3", "trainer.num_procs=8", "rollout.gpu_memory_utilization=0.3",
                   "model.gradient_checkpointing=true", "trainer.micro_batch_size=4",
                   "logger=none"])
    b = estimate(cfg, s, 80 * GiB)
    it = b.items
    assert it["policy weights (fp32)"] == 4 * P // 8 == 4_095_367_680
    assert it["ZeRO-3 full-weight policy copy"] == 4 * P
    assert it["policy gradients (fp32)"] == 4 * P // 8
    assert it["policy AdamW state (fp32 m, v)"] == 8 * P // 8
    C = P - 151_936 * 4096 + 4096 + 1  # critic: backbone without the LM head, plus a scalar head
    assert it["critic weights (fp32)"] == 4 * C // 8 and it["critic AdamW state"] == 8 * C // 8
    assert b.vllm_share == int(0.3 * 80 * GiB)
    # vLLM needs bf16 weights + one 4096-token sequence of KV cache + 2 GiB overhead
    assert b.vllm_need == 2 * P + 4096 * 147_456 + 2 * GiB
    resident = 4 * P // 8 + 4 * P + 8 * P // 8 + 4 * C // 8 + 8 * C // 8
    assert b.rollout_peak == resident + int(0.3 * 80 * GiB) + 2 * GiB
    assert b.problems() == []  # 8 x 80 GB fits at ZeRO-3 with a 0.3 share


def test_offload_and_stage_partitioning(compose):
    from rlpost.run.memory import estimate, shape_from_config

    s = shape_from_config(QWEN3_8B)
    P = s.params
    base = ["model=qwen3-8b", "trainer=deepspeed", "precision=bf16", "trainer.num_procs=4", "logger=none"]
    st1 = estimate(compose(base + ["trainer.zero_stage=1"]), s, 80 * GiB).items
    st2 = estimate(compose(base + ["trainer.zero_stage=2"]), s, 80 * GiB).items
    off = estimate(compose(base + ["trainer.zero_stage=2", "trainer.offload_optimizer=true"]), s, 80 * GiB).items
    assert st1["policy AdamW state (fp32 m, v)"] == 8 * P // 4 and st1["policy gradients (fp32)"] == 4 * P
    assert st2["policy gradients (fp32)"] == 4 * P // 4 and st2["policy weights (fp32)"] == 4 * P
    assert off["policy AdamW state (fp32 m, v)"] == 0


def test_does_not_fit_names_the_cheapest_fix(compose):
    from rlpost.core.errors import ConfigError
    from rlpost.run.memory import check, cheapest_fix, estimate, shape_from_config

    s = shape_from_config(QWEN3_8B)
    # the flagship command with fp32 asked for, on one 80 GB GPU: fp32 everything, no sharding
    cfg = compose(["algo=sao", "model=qwen3-8b", "rollout=vllm", "trainer=deepspeed", "logger=none", "precision=fp32"])
    with pytest.raises(ConfigError, match=r"does not fit in GPU memory.*Fix: .*precision=bf16"):
        check(cfg, s, 80 * GiB)
    # on 8 GPUs the fix is ZeRO-3 and bf16, not more GPUs; re-estimating with it applied fits
    fix = cheapest_fix(cfg, s, 80 * GiB, world_size=8)
    assert "trainer.zero_stage=3" in fix and "GPUs" not in fix
    fixed = compose(["algo=sao", "model=qwen3-8b", "rollout=vllm", "trainer=deepspeed", "logger=none",
                     "precision=fp32", "trainer.num_procs=8", *fix.split()])
    assert estimate(fixed, s, 80 * GiB).problems() == []
    # a vLLM share too small for its own weights is named as such
    small = compose(["model=qwen3-8b", "rollout=vllm", "precision=bf16", "rollout.gpu_memory_utilization=0.1",
                     "logger=none"])
    assert any("vLLM needs" in p for p in estimate(small, s, 80 * GiB).problems())


def test_preflight_skips_cpu_and_tiny(compose):
    import torch

    from rlpost.run.memory import preflight

    assert preflight(compose(tiny_overrides()), torch.device("cpu")) is None


def test_gpu_check_dry_run_runs_on_cpu(tmp_path):
    """scripts/gpu_check.py --dry-run: plan, estimates and every part-hf check on a toy Qwen3, all PASS on CPU."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO

    out = tmp_path / "gc.json"
    p = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--json", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "would use" in p.stdout and "Fix: " in p.stdout  # plan + flagship budget with its fix
    recs = json.loads(out.read_text())
    assert [r["check"] for r in recs] == ["hf_engine_generate", "torch_trainer_update", "weight_push_parity",
                                         "sao_critic", "deepspeed_zero2"]
    assert all(r["pass"] for r in recs)
    parity = recs[2]
    assert parity["after"] <= 0.05 and parity["before"] >= 5 * parity["after"]  # the push really moved the engine


@pytest.mark.parametrize("recipe,shape", [("sao_qwen3_8b", QWEN3_8B),
                                          ("grpo_qwen2.5_7b", dict(model_type="qwen2", hidden_size=3584,
                                                                   intermediate_size=18944, num_hidden_layers=28,
                                                                   num_attention_heads=28, num_key_value_heads=4,
                                                                   vocab_size=152064, max_position_embeddings=32768,
                                                                   tie_word_embeddings=False))])
def test_gpu_recipes_fit_one_8x80gb_node_and_the_bare_preset_does_not(compose, recipe, shape):
    from rlpost.run.memory import estimate, shape_from_config

    s = shape_from_config(shape)
    cfg = compose([f"+recipe={recipe}", "logger=none"])
    assert cfg.precision.name == "bf16" and cfg.rollout.max_model_len == 4096 and cfg.trainer.zero_stage == 3
    assert estimate(cfg, s, 80 * GiB, world_size=8).problems() == []
    bare = compose([f"algo={cfg.algo.name}", f"model={cfg.model.name}", "rollout=vllm", "trainer=deepspeed",
                    "logger=none"])
    assert estimate(bare, s, 80 * GiB, world_size=8).problems() != []
