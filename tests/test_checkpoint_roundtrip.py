"""A checkpoint written by ``Run.checkpoint`` and read by ``Run.restore`` into a fresh run restores every
field the next step depends on: the policy weights, the optimizer's moments and step counts, the
trainer's counters (optimizer steps = policy version, updates) and the mini-batch shuffling generator.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_overrides


def _flat_opt_state(opt) -> dict:
    return {(i, k): v for i, s in opt.state_dict()["state"].items() for k, v in s.items()}


@pytest.mark.usefixtures("one_thread")
def test_restore_brings_back_weights_optimizer_counters_and_generator(compose, tmp_path):
    from rlpost.run.runner import Run

    cfg = compose(tiny_overrides("steps=2", "eval.at_end=false", "trainer.lr=1e-2", "algo.mini_batches=2",
                                 "algo.entropy_coef=0.1"))  # no reward on the random tiny model: entropy moves it
    run = Run(cfg, tmp_path / "a")
    try:
        run.train_step()
        ckpt = run.checkpoint()
        assert ckpt is not None
        want_version, want_updates = run.trainer.version, run.trainer.updates
        assert want_version == 2 and want_updates == 1  # two mini-batches: two optimizer steps in one update
        want_opt = _flat_opt_state(run.trainer.opt)
        want_rng = run.update_rng.get_state()
        want_w = {k: v.detach().clone() for k, v in run.trainer.policy.state_dict().items()}
    finally:
        run.close()

    fresh = Run(cfg, tmp_path / "b")
    try:
        # a fresh run differs in every field the checkpoint must bring back
        assert fresh.trainer.version == 0 and not _flat_opt_state(fresh.trainer.opt)
        assert not torch.equal(fresh.update_rng.get_state(), want_rng)
        fresh.restore(ckpt)
        assert fresh.step == 1
        assert fresh.trainer.version == want_version
        assert fresh.trainer.updates == want_updates
        got_opt = _flat_opt_state(fresh.trainer.opt)
        assert set(got_opt) == set(want_opt) and want_opt
        for k, v in want_opt.items():
            assert torch.equal(torch.as_tensor(got_opt[k]), torch.as_tensor(v)), k
        assert torch.equal(fresh.update_rng.get_state(), want_rng)
        for k, v in fresh.trainer.policy.state_dict().items():
            assert torch.equal(v, want_w[k]), k
    finally:
        fresh.close()
