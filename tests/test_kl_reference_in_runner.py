"""The runner's KL inputs: the reference log-probs come from the initial policy, and KL-in-reward's k1
is ``log pi_old - log pi_ref`` (not the other way round), checked on the second step of a real tiny run,
when the policy has moved away from the reference.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_overrides


def _logprobs(model, batch, temperature: float) -> torch.Tensor:
    from rlpost.models.logprobs import response_logprobs

    with torch.no_grad():
        lp, _ = response_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                  (batch.response_mask > 0).long(), temperature=temperature)
    return lp * batch.response_mask


def _two_steps(compose, tmp_path, *extra):
    """Run steps 1 and 2; returns ``(run, initial policy copy, step-2 collected, step-2 metrics)``."""
    from rlpost.run.runner import Run

    cfg = compose(tiny_overrides("steps=2", "eval.at_end=false", "trainer.lr=1e-2", "rollout.temperature=1.0",
                                 "algo.entropy_coef=0.1", *extra))  # no reward on the random tiny model: entropy moves it
    run = Run(cfg, tmp_path / "run")
    initial = copy.deepcopy(run.trainer.policy).eval()
    run.train_step()
    c = run.collect(2, run.trainer.version, 1)
    m = run.learn(c)
    return run, initial, c, m


@pytest.mark.usefixtures("one_thread")
def test_reference_logprobs_are_the_initial_policys(compose, tmp_path):
    run, initial, c, _ = _two_steps(compose, tmp_path, "algo.kl.coef=0.1", "algo.kl.in_reward=false")
    try:
        b = c.batch
        want = _logprobs(initial, b, 1.0)
        # the policy moved: at step 2 the rollouts' own log-probs are not the reference's
        assert float(((b.rollout_logprobs - want).abs() * b.response_mask).max()) > 1e-3
        assert torch.allclose(b.extras["ref_logprobs"] * b.response_mask, want, atol=1e-4)
    finally:
        run.close()


@pytest.mark.usefixtures("one_thread")
def test_kl_in_reward_k1_is_old_minus_reference(compose, tmp_path):
    run, _, c, m = _two_steps(compose, tmp_path, "algo.kl.coef=0.1", "algo.kl.in_reward=true",
                              "algo.kl.estimator=k1", "algo.adv_estimator=reinforce_pp")
    try:
        b = c.batch
        mask = b.response_mask
        diff = (b.extras["old_logprobs"] - b.extras["ref_logprobs"]) * mask
        want = float(diff.sum() / mask.sum())
        assert abs(want) > 1e-4  # the policy moved, so the sign is visible
        assert m["actor/kl_ref"] == pytest.approx(want, rel=1e-4, abs=1e-6)
    finally:
        run.close()
