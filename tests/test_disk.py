"""Disk use: the start-of-run line with the expected size, and checkpoint.keep_last's default."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from conftest import tiny_overrides


def _bytes(d):
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def test_start_line_predicts_the_run_directory_and_cpu_full_fine_tuning_keeps_one_checkpoint(compose, tmp_path,
                                                                                             caplog):
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("steps=3", "checkpoint.every=1"))
    assert cfg.checkpoint.keep_last is None  # the default: decided by the run
    with caplog.at_level(logging.INFO, logger="rlpost"):
        train(cfg, tmp_path / "run")
    assert cfg.checkpoint.keep_last == 1
    ckpts = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step_000003"]
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run directory: ")]
    assert line.startswith(f"run directory: {tmp_path / 'run'} (expected disk use about ")
    assert "1 checkpoint(s) of" in line and "(checkpoint.keep_last=1)" in line
    ckpt_gb = float(line.split("1 checkpoint(s) of ")[1].split(" GB")[0])
    final_gb = float(line.split("final/ ")[1].split(" GB")[0])
    assert ckpt_gb == pytest.approx(_bytes(ckpts[0]) / 1e9, abs=0.006)  # printed to 0.01 GB
    assert final_gb == pytest.approx(_bytes(tmp_path / "run" / "final") / 1e9, abs=0.006)


def test_estimate_counts_policy_adam_moments_and_tokenizer_exactly(compose, tmp_path):
    from rlpost.run.checkpoint import estimate_disk, save_checkpoint
    from rlpost.run.runner import Run

    run = Run(compose(tiny_overrides("steps=1")), tmp_path / "run")
    try:
        run.trainer.opt.step()  # Adam's moments exist after the first step: make them, as a checkpoint holds them
        for p in run.trainer.policy.parameters():
            p.grad = torch.zeros_like(p)
        run.trainer.opt.step()
        est = estimate_disk(run.trainer, 1, run.tokenizer)
        from rlpost.run.checkpoint import collect_states

        path = save_checkpoint(tmp_path / "run", 1, run.trainer.policy, run.tokenizer, collect_states(run.stateful()))
        assert est["checkpoint"] == pytest.approx(_bytes(path), rel=0.01)
    finally:
        run.close()


def test_keep_last_default_is_two_for_lora_or_a_gpu_and_a_given_value_is_kept(compose):
    from rlpost.run.checkpoint import resolve_keep_last
    from rlpost.core.errors import ConfigError

    assert resolve_keep_last(compose(tiny_overrides()), torch.device("cpu")) == 1
    assert resolve_keep_last(compose(tiny_overrides("model.lora.rank=4")), torch.device("cpu")) == 2
    assert resolve_keep_last(compose(tiny_overrides()), torch.device("cuda")) == 2
    assert resolve_keep_last(compose(tiny_overrides("checkpoint.keep_last=3")), torch.device("cpu")) == 3
    with pytest.raises(ConfigError, match="keep at least 1"):
        resolve_keep_last(compose(tiny_overrides("checkpoint.keep_last=0")), torch.device("cpu"))
