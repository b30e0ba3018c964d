"""Data-parallel rollouts (rlpost/distributed.py): two processes equal one, and each generates half.

One torchrun launch of tests/dp_worker.py runs two RL steps of REINFORCE++ (batch whitening,
KL in the reward, two mini-batches) on two CPU processes with gloo (``trainer=deepspeed``,
rollouts, scoring and the old/reference log-prob passes split by groups and gathered); the
same config runs here in one process with ``trainer=torch``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from dp_worker import run

    out = tmp_path_factory.mktemp("dp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_port()}",
           str(HERE / "dp_worker.py"), str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    two = torch.load(out / "result.pt", weights_only=False)
    one = run(out, "torch")
    return one, two


# T^5's two value heads ([B, R, 2] critic values) through the gathered critic pass; a length penalty and a stop
# string give rewards that differ between rows, as above
T5 = ["algo=t5", "task.reward.length_penalty=0.02", "selector.prompts_per_step=3", "trainer.micro_batch_size=4",
      "steps=2", "eval.at_end=false", "checkpoint.every=0", "rollout.stop=[k]"]


def test_a_two_head_critic_gathers_the_same_values_as_one_process(tmp_path):
    """gather_rows kept only [B, R]: T^5 under trainer.num_procs=2 stopped with a shape mismatch at step 1."""
    from dp_worker import run

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_port()}",
           str(HERE / "dp_worker.py"), str(tmp_path), *T5]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    two = torch.load(tmp_path / "result.pt", weights_only=False)
    one = run(tmp_path, "torch", T5)
    s1, s2 = one["steps"][0], two["steps"][0]  # step 1: both start from the same weights and critic
    assert s2["values"].shape == (len(s2["rewards"]), s2["response_mask"].shape[1], 2)
    assert torch.equal(s1["response_ids"], s2["response_ids"]) and torch.equal(s1["rewards"], s2["rewards"])
    torch.testing.assert_close(s1["values"], s2["values"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s1["advantages"], s2["advantages"], atol=1e-5, rtol=1e-5)


def test_gather_rows_keeps_trailing_dimensions():
    from rlpost.distributed import gather_rows

    local = torch.arange(12, dtype=torch.float32).reshape(2, 3, 2)  # rows 0 and 2 of a [3, 4, 2] tensor
    full = gather_rows(local, [0, 2], 3, 4)
    assert full.shape == (3, 4, 2)
    assert full[0, :3].tolist() == [[0, 1], [2, 3], [4, 5]] and full[2, :3].tolist() == [[6, 7], [8, 9], [10, 11]]
    assert full[1].abs().sum() == 0 and full[:, 3].abs().sum() == 0  # other rows and the padded column stay 0
    assert gather_rows(None, [], 2, 3).shape == (2, 3)  # no rank had rows: [B, width]


def test_two_processes_shard_rollouts_and_each_generates_its_share(results):
    one, two = results
    assert two["shard"] is True and one["shard"] is False
    # 5 prompts x 4 samples per step, groups never split: 3 groups (12 rows) + 2 groups (8 rows), 2 steps
    assert two["rows_per_rank"] == [24, 16]


def test_two_processes_give_the_same_prompts_rewards_and_weights_as_one(results):
    one, two = results
    for s1, s2 in zip(one["steps"], two["steps"]):
        assert torch.equal(s1["prompt_index"], s2["prompt_index"])
        assert torch.equal(s1["response_ids"], s2["response_ids"])
        assert torch.equal(s1["response_mask"], s2["response_mask"])
        assert torch.equal(s1["rewards"], s2["rewards"])
        assert len(set(s1["rewards"].tolist())) > 2  # rewards differ between rows: a real learning signal
        for k in ("old_logprobs", "ref_logprobs", "advantages"):  # gathered passes and batch whitening
            torch.testing.assert_close(s1[k], s2[k], atol=1e-5, rtol=1e-5)
        for k in ("reward/mean", "response/length_mean", "adv/mean", "actor/kl_ref"):
            assert s1["metrics"][k] == pytest.approx(s2["metrics"][k], abs=1e-6)
        assert s1["metrics"]["loss/policy"] == pytest.approx(s2["metrics"]["loss/policy"], abs=1e-5)
        assert s1["metrics"]["actor/grad_norm"] == pytest.approx(s2["metrics"]["actor/grad_norm"], rel=1e-4)
    w1, w2 = one["weights"], two["weights"]
    moved = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    assert moved < 2e-5
    # the weights did move (the comparison is not between two untouched models)
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy

    w0 = load_policy(ModelConfig(source="tiny"), seed=0)[0].state_dict()
    assert max(float((w0[k] - w1[k]).abs().max()) for k in w1) > 1e-4


def test_rows_split_by_groups_with_uneven_counts():
    from rlpost.distributed import local_run_rows, runs, sharded_rows, split_units

    assert runs([5, 5, 7, 7, 7, 5]) == [(0, 2), (2, 5), (5, 6)]
    assert split_units(5, 2) == [(0, 3), (3, 5)]
    assert split_units(1, 3) == [(0, 1), (1, 1), (1, 1)]
    keys = [0, 0, 1, 1, 2, 2]
    assert [local_run_rows(keys, r, 2) for r in range(2)] == [(0, 4), (4, 6)]
    assert [local_run_rows([0, 0], r, 3) for r in range(3)] == [(0, 2), (2, 2), (2, 2)]
    gi = torch.tensor([1, 0, 1, 2, 0, 2])  # rows of a group need not be adjacent
    assert sharded_rows(gi, 0, 2) == [0, 1, 2, 4] and sharded_rows(gi, 1, 2) == [3, 5]


def test_rows_sample_the_same_tokens_whatever_call_they_are_in():
    """Row i of a call draws from stream seed + row_offset + i: a split call equals the whole call."""
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine

    model, tok = load_policy(ModelConfig(source="tiny"), seed=0)
    eng = HFRolloutEngine(model, tok, batch_size=3)
    prompts = [[11, 12, 13]] * 2 + [[40, 41]] * 2 + [[7, 8, 9, 10]] * 2
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=123)
    whole = eng.generate(prompts, sp)
    a = eng.generate(prompts[:2], sp)
    b = eng.generate(prompts[2:], SamplingParams(max_new_tokens=6, temperature=1.0, seed=123, row_offset=2))
    assert torch.equal(whole.response_ids[:2, : a.response_ids.shape[1]], a.response_ids)
    assert torch.equal(whole.response_ids[2:, : b.response_ids.shape[1]], b.response_ids)
    assert not torch.equal(whole.response_ids[0], whole.response_ids[1])  # a group's samples differ


def test_shard_rollouts_setting_and_what_prevents_it(compose, monkeypatch):
    from types import SimpleNamespace

    import rlpost.run.runner as runner_mod  # the runner's own binding of world_size
    from conftest import tiny_overrides
    from rlpost.core.errors import ConfigError
    from rlpost.run.runner import Run

    def decide(*over, world=2):
        monkeypatch.setattr(runner_mod, "world_size", lambda: world)
        return Run._rollout_sharding(SimpleNamespace(cfg=compose(tiny_overrides("trainer=deepspeed", *over))))

    assert decide() is True
    assert decide(world=1) is False
    assert decide("trainer.shard_rollouts=false") is False
    assert decide("executor=async") is False  # default (null): off where unsupported
    with pytest.raises(ConfigError, match="executor=async"):
        decide("executor=async", "trainer.shard_rollouts=true")
