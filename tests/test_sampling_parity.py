"""Sampling-distribution parity: with top-k / top-p the trainer computes the log-probs of the
distribution the rollout engine drew from (importance ratio 1 on the sampling weights)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_overrides


@pytest.mark.parametrize("trunc", [("rollout.top_k=5",), ("rollout.top_p=0.9",),
                                   ("rollout.top_k=5", "rollout.top_p=0.9", "rollout.temperature=0.7")])
def test_trainer_logprobs_equal_hf_rollout_logprobs_under_truncation(compose, trunc):
    from rlpost.core.batch import RolloutBatch
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides(*trunc))
    r = cfg.rollout
    model, tok = load_policy(ModelConfig(source="tiny"), seed=3)
    eng = HFRolloutEngine(model, tok, batch_size=8)
    prompts = [tok("What is 2+2?")["input_ids"], tok("Hi")["input_ids"], tok("Name a color please")["input_ids"]] * 2
    gen = eng.generate(prompts, SamplingParams(max_new_tokens=10, temperature=float(r.temperature),
                                               top_k=int(r.top_k), top_p=float(r.top_p), seed=5))
    B = gen.response_ids.shape[0]
    batch = RolloutBatch(
        prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, response_ids=gen.response_ids,
        response_mask=gen.response_mask, rollout_logprobs=gen.rollout_logprobs, group_index=torch.arange(B),
        prompt_index=torch.arange(B), extras={"temperatures": gen.temperatures},
    )
    t = TorchTrainer.from_config(model, cfg, "cpu")
    lp, ent = t.compute_logprobs(batch, with_entropy=True)
    m = gen.response_mask > 0
    assert m.sum() > 10
    ratio = torch.exp(lp - gen.rollout_logprobs)[m]
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-4), (ratio.min(), ratio.max())
    assert torch.isfinite(ent[m]).all()
    # the untruncated distribution (what the trainer computed before) is measurably different
    import dataclasses

    t.sampling = dataclasses.replace(t.sampling, top_k=0, top_p=1.0)
    full, _ = t.compute_logprobs(batch)
    assert float(torch.exp(full - gen.rollout_logprobs)[m].min()) < 0.99
