"""The HF rollout engine's private copy of the policy (share_weights=False, e.g. the async executor)."""

from __future__ import annotations

import warnings

from rlpost.config.schema import ModelConfig
from rlpost.models.loader import load_policy
from rlpost.rollout.hf import HFRolloutEngine


def test_private_copy_drops_gradient_checkpointing_without_a_library_warning():
    with warnings.catch_warnings():
        # transformers' is_gradient_checkpointing / gradient_checkpointing_enable|disable raised FutureWarnings
        warnings.simplefilter("error", FutureWarning)
        model, tok = load_policy(ModelConfig(source="tiny", gradient_checkpointing=True), seed=0)
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        engine = HFRolloutEngine(model, tok, batch_size=2, share_weights=False)
    assert engine.model is not model
    assert not any(getattr(m, "gradient_checkpointing", False) for m in engine.model.modules())
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())  # the policy keeps it
    assert not any(p.requires_grad for p in engine.model.parameters())
