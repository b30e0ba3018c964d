"""After a training step, a rollout engine that keeps its own copy of the weights holds the updated ones.

With ``precision.rollout_dtype=bf16`` the hf engine samples from a bf16 copy of the fp32 policy, so
the step's ``sync`` stage is what moves the update into the rollouts. The copy must equal the
policy *after* the optimizer step, rounded to bf16 (``Tensor.to(bfloat16)``), and must differ from
the initial weights (the step changed them).
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_overrides


@pytest.mark.usefixtures("one_thread")
def test_the_rollout_copy_holds_the_weights_after_the_optimizer_step(compose, tmp_path):
    from rlpost.run.runner import Run

    cfg = compose(tiny_overrides("steps=1", "eval.at_end=false", "precision.rollout_dtype=bf16", "trainer.lr=1e-2",
                                 "algo.entropy_coef=0.1"))  # the random tiny model earns no reward: the entropy bonus moves it
    run = Run(cfg, tmp_path / "run")
    try:
        assert run.engine.model is not run.trainer.policy  # a private copy, not the trainer's module
        before = {k: v.detach().clone() for k, v in run.trainer.policy.state_dict().items()}
        metrics = run.train_step()
        after = run.trainer.policy.state_dict()
        moved = [k for k in after if not torch.equal(after[k], before[k])]
        assert moved, f"the step did not change the policy: {metrics}"
        copy = run.engine.model.state_dict()
        for k in moved:
            assert copy[k].dtype == torch.bfloat16
            assert torch.equal(copy[k], after[k].to(torch.bfloat16)), f"{k}: the rollout copy is not the updated policy"
    finally:
        run.close()
