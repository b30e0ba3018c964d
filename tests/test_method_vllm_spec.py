"""vLLM speculative-decoding wiring: settings, config and engine kwargs. Moved unchanged from
tests/test_rollout_mtp_vllm_spec_mipu.py.
"""

import json

import pytest

from rlpost.core.errors import ConfigError

from conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- vLLM speculative_config
def test_vllm_spec_settings_and_config():
    from rlpost.rollout.vllm_spec import mtp_layers, vllm_spec_settings, vllm_speculative_config

    assert vllm_spec_settings(None) is None and vllm_spec_settings({"method": None}) is None
    with pytest.raises(ConfigError, match="rollout=hf"):
        vllm_spec_settings({"method": "mtp", "switch_batch": 2})
    with pytest.raises(ConfigError, match="unknown"):
        vllm_spec_settings({"method": "eagle9"})
    with pytest.raises(ConfigError, match=">= 1"):
        vllm_spec_settings({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match="needs rollout.speculative.model"):
        vllm_spec_settings({"method": "draft_model"})
    with pytest.raises(ConfigError, match="ngram only"):
        vllm_spec_settings({"method": "mtp", "prompt_lookup_max": 3})
    with pytest.raises(ConfigError, match="prompt_lookup_min <= prompt_lookup_max"):
        vllm_spec_settings({"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3})

    assert mtp_layers({"num_hidden_layers": 2}) == 0
    assert mtp_layers({"num_nextn_predict_layers": 1}) == 1
    assert mtp_layers({"text_config": {"mtp_num_hidden_layers": 2}}) == 2
    c = vllm_spec_settings({"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="multi-token-prediction heads"):
        vllm_speculative_config(c, {"num_hidden_layers": 2}, "/init", checkpoint="/ckpt")
    assert vllm_speculative_config(c, {"num_nextn_predict_layers": 1}, "/init", checkpoint="/ckpt") == {
        "method": "mtp", "num_speculative_tokens": 2, "model": "/ckpt"}  # MTP layers load from the checkpoint
    c = vllm_spec_settings({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    assert vllm_speculative_config(c, {}, "/init") == {"method": "ngram", "num_speculative_tokens": 4,
                                                       "prompt_lookup_max": 4}
    c = vllm_spec_settings({"method": "self", "num_speculative_tokens": 3, "quantization": "fp8"})
    assert vllm_speculative_config(c, {}, "/init") == {"method": "draft_model", "num_speculative_tokens": 3,
                                                       "model": "/init", "quantization": "fp8"}


def test_vllm_engine_kwargs_speculative(compose, tmp_path):
    """rollout=vllm_mtp on the tiny model (no MTP heads) stops with a ConfigError; with heads it is passed on."""
    from rlpost.rollout.fp8_stack import online_fp8_name, vllm_features
    from rlpost.rollout.self_spec import check_speculative
    from rlpost.rollout.vllm import engine_kwargs
    from rlpost.rollout.base import EngineConfig

    cfg = compose(tiny_overrides("rollout=vllm_mtp", "precision=bf16"))
    assert check_speculative(cfg) is None  # vLLM speculates inside its own engine: no hf wrapper
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match="method=mtp needs a model with multi-token-prediction heads"):
        engine_kwargs(EngineConfig.of(cfg), str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_nextn_predict_layers": 1}))
    cfg.model.path = "/ckpt/deepseek"
    kw = engine_kwargs(EngineConfig.of(cfg), str(tmp_path))
    assert kw["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2, "model": "/ckpt/deepseek"}
    cfg = compose(tiny_overrides("rollout=vllm_self_spec", "precision=bf16"))
    kw = engine_kwargs(EngineConfig.of(cfg), str(tmp_path))
    online = online_fp8_name(vllm_features()[0])  # the drafter is the bf16 checkpoint: vLLM's online fp8
    assert kw["speculative_config"] == {"method": "draft_model", "num_speculative_tokens": 3,
                                        "model": str(tmp_path), "quantization": online}
    assert "speculative_config" not in engine_kwargs(compose(tiny_overrides("rollout=vllm", "precision=bf16")),
                                                     str(tmp_path))
    bad = compose(tiny_overrides("rollout=hf_self_spec", "rollout.engine=vllm", "precision=bf16"))
    with pytest.raises(ConfigError, match="rollout=hf"):
        check_speculative(bad)
