"""The FP8 GPU recipe names vLLM's FP8 and fits its node. Moved unchanged from
tests/test_rollout_mtp_vllm_spec_mipu.py.
"""

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- the FP8 GPU recipe
def test_fp8_gpu_recipe_names_vllm_fp8_and_fits_its_node(compose, tmp_path):
    """recipes/fp8_rollout_qwen3_8b: vLLM quantization=fp8 with the bf16 trainer; fits 8 x 80 GiB by rlpost's budget."""
    import sys
    from pathlib import Path

    from rlpost.run.memory import check, shape_from_config
    from rlpost.experiments.recipes import parse_card
    from rlpost.rollout.fp8_stack import online_fp8_name, vllm_features
    from rlpost.rollout.vllm import engine_kwargs
    from rlpost.rollout.base import EngineConfig

    cfg = compose(["+recipe=fp8_rollout_qwen3_8b", "trainer.num_procs=8", "logger=none"])
    assert (cfg.model.name, cfg.rollout.engine, cfg.precision.trainer_dtype, cfg.precision.rollout_dtype,
            cfg.precision.correction) == ("qwen3-8b", "vllm", "bf16", "fp8", "tis")
    (tmp_path / "config.json").write_text("{}")
    kw = engine_kwargs(EngineConfig.of(cfg), str(tmp_path))
    online = online_fp8_name(vllm_features()[0])
    assert online in ("fp8", "fp8_per_tensor") and kw["quantization"] == online and kw["dtype"] == "bfloat16"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from gpu_check import hf_config

    check(cfg, shape_from_config(hf_config("qwen3-8b").to_dict()), 80 * 1024**3, world_size=8)  # raises if not
    # the CPU recipe points at it, and gpu_check's fp8 arm composes it on the toy model
    import yaml

    card = parse_card(yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "fp8_rollout.yaml").read_text())["card"])
    assert card.gpu_recipe == "fp8_rollout_qwen3_8b"
    toy = compose(["model=tiny", "logger=none", "algo=grpo", "algo.kl.coef=0", "+recipe=fp8_rollout_qwen3_8b",
                   "model=tiny", "trainer=torch", "model.gradient_checkpointing=false", "precision=rollout_fp8",
                   "rollout=vllm"])
    assert toy.model.name == "tiny" and engine_kwargs(EngineConfig.of(toy), str(tmp_path))["quantization"] == online
