"""End-to-end behaviour of the runner on the tiny model (and the real one, marked slow)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides

VOLATILE = ("time/", "throughput/", "memory/")


def _metrics(run_dir: Path):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stable(rec):
    return {k: v for k, v in rec.items() if not k.startswith(VOLATILE)}


def _train(compose, tmp_path, *extra, name="run"):
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides(*extra))
    run_dir = tmp_path / name
    train(cfg, run_dir)
    return run_dir


@pytest.mark.parametrize("algo", ["grpo", "ppo", "sao"])
def test_each_core_algo_runs_two_steps_on_tiny(compose, tmp_path, algo):
    run_dir = _train(compose, tmp_path, f"algo={algo}", "steps=2", "algo.critic.warmup_steps=1")
    recs = _metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2]
    for key in ("reward/mean", "response/length_mean", "time/step_s", "time/rollout_s", "time/update_s",
                "throughput/rollout_tokens_per_s", "memory/peak_rss_mb"):
        assert key in recs[-1]
    assert "loss/policy" in recs[-1] and "actor/clip_frac" in recs[-1]
    assert "eval/accuracy" in recs[-1]
    assert (run_dir / "final" / "config.json").exists()
    assert (run_dir / "checkpoints" / "step_000002" / "policy" / "config.json").exists()
    assert (run_dir / "config.yaml").exists() and (run_dir / "eval.json").exists()
    assert ("critic/value_loss" in recs[-1]) == (algo != "grpo")  # a critic only for the critic-based preset


def test_rollout_logprobs_match_trainer_logprobs_fp32():
    """Same weights, fp32: what the engine reports equals what the trainer computes."""
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import response_logprobs
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine

    model, tok = load_policy(ModelConfig(source="tiny"), seed=3)
    eng = HFRolloutEngine(model, tok, batch_size=8)
    prompts = [tok("What is 2+2?")["input_ids"], tok("Hi")["input_ids"], tok("Name a color please")["input_ids"]]
    for temp, top_k in [(1.0, 0), (0.7, 0)]:
        gen = eng.generate(prompts * 2, SamplingParams(max_new_tokens=10, temperature=temp, top_k=top_k, seed=5))
        with torch.no_grad():
            lp, _ = response_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.response_ids,
                                      (gen.response_mask > 0).long(), temperature=gen.temperatures, chunk_size=4)
        m = gen.response_mask
        assert m.sum() > 0
        diff = ((lp - gen.rollout_logprobs).abs() * m).max().item()
        assert diff < 1e-4, diff


def test_shared_prefix_forward_equals_full_forward_in_values_and_gradients():
    """A group's prompt computed once (KV cache indexed out to its rows) = every row computed in full."""
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import response_logprobs

    model, tok = load_policy(ModelConfig(source="tiny"), seed=4)
    model.train()
    g = torch.Generator().manual_seed(0)
    # 2 distinct prompts (one left-padded) x 3 samples, responses of unequal length
    prompts = torch.randint(5, 500, (2, 7), generator=g)
    pmask = torch.ones(2, 7, dtype=torch.long)
    prompts[1, :2], pmask[1, :2] = 0, 0
    prompts, pmask = prompts.repeat_interleave(3, 0), pmask.repeat_interleave(3, 0)
    resp = torch.randint(5, 500, (6, 5), generator=g)
    rattn = torch.ones(6, 5, dtype=torch.long)
    rattn[2, 3:], resp[2, 3:] = 0, 0
    out = {}
    for share in (False, True):
        model.zero_grad()
        lp, ent = response_logprobs(model, prompts, pmask, resp, rattn, with_entropy=True, chunk_size=2,
                                    share_prefix=share)
        ((lp + 0.1 * ent) * rattn).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        out[share] = (lp.detach() * rattn, ent.detach() * rattn, grads)
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5)
    assert torch.allclose(out[True][1], out[False][1], atol=1e-5)
    assert torch.allclose(out[True][2], out[False][2], atol=1e-5, rtol=1e-4)
    assert out[False][2].abs().sum() > 0


def test_prompt_entropy_matches_full_logits_on_unpadded_prompts():
    """Chunked, left-padded, batched prefill = the entropy of model(ids).logits of each prompt alone."""
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import prompt_entropy

    model, tok = load_policy(ModelConfig(source="tiny"), seed=3)
    model.train()
    prompts = [tok("What is 2+2?")["input_ids"], tok("Hi")["input_ids"], tok("Name a color please, any one you like best today")["input_ids"]]
    assert len({len(p) for p in prompts}) == 3
    want = []
    with torch.no_grad():
        for p in prompts:
            logp = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
            want.append(float(-(logp.exp() * logp).sum(-1).mean()))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for bs, chunk in [(2, 3), (16, 64), (1, 1)]:
        got = prompt_entropy(model, prompts, pad, batch_size=bs, chunk_size=chunk)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-5), (bs, chunk)
    V = model.get_output_embeddings().weight.shape[0]
    assert all(0.0 < e <= math.log(V) + 1e-4 for e in want)
    assert model.training  # the training flag is restored
    with pytest.raises(ValueError):
        prompt_entropy(model, [[]], pad)


def test_hive_prunes_by_the_policy_prompt_entropy_on_tiny(compose, tmp_path, monkeypatch):
    """The runner attaches Run.prompt_entropy; HIVE checks its whole pool with it and prunes stale prompts.

    8 prompts, 4 per step, pool 2 x 4 = all 8, entropy_threshold 0 (any change is stale), SFT so the
    weights move every step. Step 1: nothing has history. Step 2: the 4 prompts of step 1 were
    recorded with the step-0 weights; the update changed their entropy, so all 4 are pruned and
    the 4 others are chosen. Step 3: the same for the prompts of step 2.
    """
    from rlpost.run.runner import Run

    calls = []
    real = Run.prompt_entropy

    def spy(self, indices):
        out = real(self, indices)
        calls.append((list(indices), out))
        return out

    monkeypatch.setattr(Run, "prompt_entropy", spy)
    common = ("selector=hive", "algo=sft", "steps=3", "task.train_size=8", "eval.at_end=false", "trainer.lr=1e-3",
              "+selector.params.pool_multiplier=2")
    run_dir = _train(compose, tmp_path, *common, "+selector.params.entropy_threshold=0.0", name="prune")
    recs = _metrics(run_dir)
    assert [sorted(c[0]) for c in calls] == [list(range(8))] * 3  # once per step, on the whole pool
    assert [r["selector/entropy_checked"] for r in recs] == [8.0, 8.0, 8.0]
    assert [r["selector/pruned_stale"] for r in recs] == [0.0, 4.0, 4.0]
    assert [r["rollout/prompts_skipped"] for r in recs] == [0.0, 4.0, 4.0]
    assert len(calls) == len(recs) == 3
    for (_, e), r in zip(calls, recs):
        assert r["selector/prompt_entropy_mean"] == pytest.approx(sum(e) / len(e))
    assert calls[1][1] != calls[0][1]  # computed with the updated weights, not the initial ones

    calls.clear()
    run_dir = _train(compose, tmp_path, *common, "+selector.params.entropy_threshold=1e9", name="keep")
    recs = _metrics(run_dir)
    assert len(calls) == 3
    assert [r["selector/pruned_stale"] for r in recs] == [0.0, 0.0, 0.0]
    assert [r["selector/seen"] for r in recs] == [0.0, 4.0, 8.0]


def test_prompt_entropy_under_async_staleness_needs_an_engine_model():
    """executor=async with max_staleness > 0 reads the engine's copy; vLLM has none: a clear ConfigError."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from rlpost.core.errors import ConfigError
    from rlpost.run.runner import Run

    fake = SimpleNamespace(cfg=OmegaConf.create({"executor": {"name": "async", "max_staleness": 1}}), engine=object())
    with pytest.raises(ConfigError, match="rollout.engine=hf"):
        Run.prompt_entropy(fake, [0])


def test_greedy_generation_is_deterministic_and_masks_after_eos():
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine

    model, tok = load_policy(ModelConfig(source="tiny"), seed=1)
    eng = HFRolloutEngine(model, tok)
    p = [tok("abc")["input_ids"], tok("a much longer prompt here")["input_ids"]]
    a = eng.generate(p, SamplingParams(max_new_tokens=8, greedy=True))
    b = eng.generate(p, SamplingParams(max_new_tokens=8, greedy=True))
    assert torch.equal(a.response_ids, b.response_ids)
    # the mask is a prefix: once a row stops it never restarts
    m = a.response_mask
    assert torch.all(m[:, 1:] <= m[:, :-1])


def test_crashing_verifier_does_not_stop_the_run(compose, tmp_path, monkeypatch):
    from rlpost.tasks.reasoning_gym_task import ReasoningGymTask

    calls = {"n": 0}

    def bad_score(self, response, example):
        calls["n"] += 1  # counts only if the verifier ran in the trainer's own process
        raise RuntimeError("verifier bug")

    monkeypatch.setattr(ReasoningGymTask, "score", bad_score)
    run_dir = _train(compose, tmp_path, "steps=2", "eval.at_end=false", "task.reward.timeout_s=2")
    recs = _metrics(run_dir)
    assert len(recs) == 2
    for r in recs:  # both steps ran to the end ...
        assert r["reward/verifier_errors"] == 16  # ... every sample failed ...
        assert r["reward/mean"] == 0.0  # ... and scored 0
        assert math.isfinite(r["loss/policy"])
    assert calls["n"] == 0  # the crashing verifier ran in the isolated worker, never in this process


def _launch(run_dir: Path, steps: int, *extra: str):
    args = [sys.executable, "-m", "rlpost.cli", "train", *tiny_overrides(f"steps={steps}", "checkpoint.every=2",
            "eval.at_end=false", "seed=7", *extra), f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_killed_and_resumed_run_matches_uninterrupted(tmp_path):
    """SIGKILL after the first checkpoint, resume=auto, and compare with a straight run."""
    straight = tmp_path / "straight"
    p = _launch(straight, 6)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-2000:]

    killed = tmp_path / "killed"
    p = _launch(killed, 6)
    deadline = time.time() + 600
    while not (killed / "checkpoints" / "step_000002" / "state.pt").exists():
        assert p.poll() is None, p.stderr.read()[-2000:]
        assert time.time() < deadline
        time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (killed / "DONE").exists()
    p = _launch(killed, 6, "resume=auto")
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-2000:]
    a = [_stable(r) for r in _metrics(straight)]
    b = [_stable(r) for r in _metrics(killed)]
    assert [r["step"] for r in b] == [r["step"] for r in a] == [1, 2, 3, 4, 5, 6]  # zip cannot drop a step
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6), (ra["step"], k)


class _Stopped(Exception):
    """Raised by the patched checkpoint hook to stop a run right after a checkpoint."""


def _stop_after_checkpoint(monkeypatch, step: int) -> None:
    from rlpost.run.runner import Run

    real = Run.checkpoint

    def checkpoint_then_stop(self):
        out = real(self)
        if self.step == step:
            raise _Stopped
        return out

    monkeypatch.setattr(Run, "checkpoint", checkpoint_then_stop)


def _assert_same_metrics(a_dir: Path, b_dir: Path, steps: int) -> None:
    a = [_stable(r) for r in _metrics(a_dir)]
    b = [_stable(r) for r in _metrics(b_dir)]
    assert [r["step"] for r in b] == [r["step"] for r in a] == list(range(1, steps + 1))  # zip cannot drop a step
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-7), (ra["step"], k)


@pytest.mark.parametrize("algo,extra", [
    ("mssr", ("algo.n_samples_per_prompt=1",)),  # per-prompt Beta tracker -> baselines of steps 3-4
    ("hapo", ("sampler=adaptive_temperature",)),  # sampler's entropy statistics of step 2 -> step 3's temperatures
])
def test_algo_state_survives_resume(compose, tmp_path, monkeypatch, algo, extra):
    """Stop after the step-2 checkpoint, resume=auto: the same metrics as an uninterrupted run.

    8 training prompts, 4 per step: steps 3-4 revisit the prompts of steps 1-2,
    so MSSR's baselines there come from the tracker state saved at step 2.
    """
    over = (f"algo={algo}", *extra, "steps=4", "checkpoint.every=2", "eval.at_end=false", "task.train_size=8",
            "seed=3", "trainer.lr=1e-4")
    straight = _train(compose, tmp_path, *over, name="straight")
    _stop_after_checkpoint(monkeypatch, 2)
    with pytest.raises(_Stopped):
        _train(compose, tmp_path, *over, name="stopped")
    monkeypatch.undo()
    ckpt = tmp_path / "stopped" / "checkpoints" / "step_000002" / "state.pt"
    algo_state = torch.load(ckpt, weights_only=False)["algo_state"]
    if algo == "mssr":
        tracked = algo_state["mssr"]["tracker"]["state"]  # the method mssr's own entry
        # one epoch over the 8 prompts, one reward each: alpha + beta = rho (1 + 1) + 1 = 2.8
        assert sorted(int(k) for k in tracked) == list(range(8))
        assert all(a + b == pytest.approx(2.8) for a, b in tracked.values())
    else:  # the per-token temperature's statistics belong to the sampler that owns it
        assert "entropy_stats" not in algo_state
        stats = torch.load(ckpt, weights_only=False)["sampler"]["stats"]
        assert set(stats) == {"pivot", "rms", "scale_pos", "scale_neg"} and stats["rms"] > 0
    _train(compose, tmp_path, *over, "resume=auto", name="stopped")
    _assert_same_metrics(straight, tmp_path / "stopped", 4)


def test_nan_loss_skips_steps_then_stops_with_checkpoint_intact(compose, tmp_path, monkeypatch):
    import rlpost.trainer.torch_engine as te
    from rlpost.core.errors import TrainingDiverged

    real = te.compute_policy_loss

    def nan_loss(name, inp, **kw):
        loss, m = real(name, inp, **kw)
        return loss * float("nan"), m

    monkeypatch.setattr(te, "compute_policy_loss", nan_loss)
    with pytest.raises(TrainingDiverged):
        _train(compose, tmp_path, "steps=8", "checkpoint.every=1", "trainer.max_bad_steps=2", "eval.at_end=false")
    recs = _metrics(tmp_path / "run")
    assert [r["actor/skipped_steps"] for r in recs] == [1.0, 1.0]
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "state.pt").exists()


@pytest.mark.slow
def test_two_steps_end_to_end_on_real_model(compose, tmp_path):
    from rlpost.run.runner import train

    cfg = compose(["logger=wandb", "steps=2", "selector.prompts_per_step=2", "algo.n_samples_per_prompt=4",
                   "rollout.max_new_tokens=24", "eval.limit=8", "eval.max_new_tokens=24", "task.train_size=64", "eval.at_start=false",
                   "task.eval_size=16", "precision=fp32"])  # auto picks bf16 on CPUs with bf16 instructions
    run_dir = tmp_path / "real"
    train(cfg, run_dir)
    recs = _metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[-1]["rollout/logprob_gap"] < 1e-3  # fp32 rollout = trainer weights
    assert recs[-1]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert list((run_dir / "wandb").glob("offline-run-*")), "W&B offline run directory missing"
