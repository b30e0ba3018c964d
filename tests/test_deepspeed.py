"""trainer=deepspeed: two-process ZeRO-2/ZeRO-3 steps equal trainer=torch's, DeepSpeed checkpoints resume.

One torchrun launch (tests/ds_worker.py) runs every DeepSpeed case on two CPU
processes (gloo); the torch reference runs in this process on the same batch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, tiny_overrides

HERE = Path(__file__).resolve().parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ds_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_port()}",
           str(HERE / "ds_worker.py"), str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def torch_step():
    sys.path.insert(0, str(HERE))
    from ds_worker import make_batch, make_trainer, weights

    # one intra-op thread, as the DeepSpeed ranks (OMP_NUM_THREADS=1): with 2 threads the fp32 reductions run in
    # another order, and Adam's step turns that noise on near-zero gradients into weight gaps up to 1.9e-4
    # (measured with transformers 5.19); with 1 thread the two engines agree exactly
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = make_trainer("torch")
        w0 = weights(t)
        m = t.policy_update(make_batch(), torch.Generator().manual_seed(0))
    finally:
        torch.set_num_threads(n)
    return w0, weights(t), m


@pytest.mark.parametrize("stage", [2, 3])
def test_two_process_zero_step_equals_torch_step(ds_out, torch_step, stage):
    w0, w_torch, m_torch = torch_step
    w_ds = torch.load(ds_out / f"zero{stage}.pt")
    assert w_ds.keys() == w_torch.keys()
    update = max((w_torch[k] - w0[k]).abs().max().item() for k in w0)
    assert update > 1e-4  # the step moved the weights (lr 1e-3, two optimizer steps)
    for k in w_torch:
        torch.testing.assert_close(w_ds[k], w_torch[k], rtol=0, atol=1e-5, msg=k)
    m_ds = torch.load(ds_out / f"metrics_zero{stage}.pt")
    # gradient norm, ratios and mismatch are global quantities: they match across engines
    for key in ("actor/grad_norm", "actor/ratio_mean", "mismatch/logprob_abs_mean", "actor/entropy"):
        assert m_ds[key] == pytest.approx(m_torch[key], rel=1e-4), key


def test_critic_trains_inside_its_own_zero3_engine_like_torch(ds_out):
    """SAO's critic is a DeepSpeed engine (partitioned AdamW state), and its two-process ZeRO-3 update equals
    the torch critic update; the per-module gather returns the full weights."""
    sys.path.insert(0, str(HERE))
    from ds_worker import critic_batch, make_trainer

    t = make_trainer("torch", critic=True)
    w0 = {k: v.detach().clone() for k, v in t.critic.state_dict().items()}
    m_torch = t.critic_update(critic_batch())
    w_torch = {k: v.detach().clone() for k, v in t.critic.state_dict().items()}
    got = torch.load(ds_out / "critic_zero3.pt")
    assert got["engine"] == "DeepSpeedEngine"
    assert got["weights"].keys() == w_torch.keys()
    assert max((w_torch[k] - w0[k]).abs().max().item() for k in w0) > 1e-4  # the update moved the critic
    for k in w_torch:
        torch.testing.assert_close(got["weights"][k], w_torch[k], rtol=0, atol=1e-5, msg=k)
    assert got["metrics"]["critic/value_loss"] == pytest.approx(m_torch["critic/value_loss"], rel=1e-5)


def test_deepspeed_checkpoint_resumes_weights_and_optimizer_state(ds_out):
    cont = torch.load(ds_out / "continued.pt")
    res = torch.load(ds_out / "resumed.pt")
    for k in cont:
        torch.testing.assert_close(res[k], cont[k], rtol=0, atol=1e-7, msg=k)
    assert any((ds_out / "run" / "deepspeed").glob("v*/"))


def test_cli_runs_two_processes_and_resumes(tmp_path):
    """``rlpost train trainer=deepspeed trainer.num_procs=2`` launches torchrun; resume=auto continues."""
    run_dir = tmp_path / "ds_run"

    def cli(steps, *extra):
        args = [sys.executable, "-m", "rlpost.cli", "train", *tiny_overrides(
            "trainer=deepspeed", "trainer.num_procs=2", "trainer.zero_stage=2", f"steps={steps}",
            "checkpoint.every=1", "eval.at_end=false", "trainer.lr=1e-4", *extra), f"hydra.run.dir={run_dir}"]
        p = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=REPO,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-4000:]

    cli(2)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]  # rank 0 alone logs
    assert "mismatch/logprob_abs_mean" in recs[0]
    sd = torch.load(run_dir / "checkpoints" / "step_000002" / "trainer.pt", weights_only=False)
    assert sd["deepspeed"]["world_size"] == 2 and sd["version"] == 2
    cli(3, "resume=auto")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[-1]["rollout/policy_version"] == 2.0  # continued from the checkpoint's version


def test_zero_stage_and_launch_errors_are_clear(compose):
    from rlpost.core.errors import ConfigError
    from rlpost.trainer.deepspeed_engine import build_ds_config
    from rlpost.trainer.torchrun import launch_command, needs_launch

    with pytest.raises(ConfigError, match="zero_stage"):
        bad = compose(tiny_overrides("trainer=deepspeed", "trainer.zero_stage=4"))
        build_ds_config(bad.trainer, bad.precision)
    with pytest.raises(ConfigError, match="trainer=deepspeed"):
        needs_launch(compose(tiny_overrides("trainer.num_procs=2")))
    cfg = compose(tiny_overrides("trainer=deepspeed", "trainer.zero_stage=3", "trainer.offload_optimizer=true"))
    ds = build_ds_config(cfg.trainer, cfg.precision)
    assert ds["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    cmd = launch_command(["a=1", "hydra.run.dir=x"], 2, "/r", 1234)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc_per_node=2"] and cmd[-1] == "hydra.run.dir=/r"
