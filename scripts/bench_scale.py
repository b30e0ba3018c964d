#!/usr/bin/env python
"""Scaling past one process: data-parallel rollouts and token-budget micro-batching.

Usage::

    python scripts/bench_scale.py                         # both parts, default config, 3 steps per setting
    python scripts/bench_scale.py --part dp --steps 3 -o selector.prompts_per_step=4
    python scripts/bench_scale.py --part tokens --model smollm2-135m
    python scripts/bench_scale.py --part ray --steps 3 -o model=tiny rollout.max_new_tokens=48

Part ``dp``: ``rlpost train`` (default config unless ``-o``) with ``trainer=deepspeed``
(ZeRO-2, gloo on CPU) on 1 process, on 2 processes with every rank repeating the
rollouts (``trainer.shard_rollouts=false``, the behaviour before data-parallel
rollouts) and on 2 processes with sharded rollouts (the default). Each setting is
its own process tree (the 2-process ones go through the real torchrun launch).
Columns, medians over the steps after the first (a warm-up): wall seconds per
step, rollout and update wall seconds of rank 0 (``time/rollout_s``,
``time/update_s``), and CPU seconds of the rollout (select, generate, score) and
learn phases summed over every process (``time/rollout_cpu_s``,
``time/learn_cpu_s``; for the unsharded 2-process run rank 0's figure times two,
since both ranks do the same work).

Part ``ray``: ``trainer=torch`` in one process (``launcher=none``) against
``launcher=ray`` with 1 and 2 rollout workers (colocated, 1 CPU each, weights
through the object store; each run starts its own local Ray cluster). Rollout CPU
seconds (``time/rollout_cpu_s``) add the driver's (select, score, dispatch) and the
workers' (``ray/worker_cpu_s``, also shown alone); the weight push is part of the update's seconds and is
also shown alone (``ray/weight_push_s``).

Part ``tokens``: one ``policy_update`` of ``trainer=torch`` on a synthetic batch
with long-tailed response lengths (64 rows; lengths from a log-normal with
median 24 tokens, capped at 256; prompts 20-60 tokens), with micro-batches of 8
sequences and with ``trainer.max_tokens_per_micro_batch`` set to the same bound
on padded tokens (8 x the longest row), so peak activation memory is bounded
alike. Columns: micro-batches, padding fraction (share of the padded
``rows x (prompt + response)`` positions that are padding), update wall and CPU
seconds (medians of 3), and the relative gradient difference between the two.

Timings on a shared machine are noisy: compare the rows of one run as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RAY_SETTINGS = [
    ("1 process, launcher=none", ["trainer=torch"], 1),
    ("launcher=ray, 1 rollout worker", ["trainer=torch", "launcher=ray", "launcher.num_rollout_workers=1"], 1),
    ("launcher=ray, 2 rollout workers", ["trainer=torch", "launcher=ray", "launcher.num_rollout_workers=2"], 1),
]

DP_SETTINGS = [
    ("1 process", ["trainer=deepspeed", "trainer.num_procs=1", "trainer.zero_stage=2"], 1),
    ("2 processes, rollouts repeated", ["trainer=deepspeed", "trainer.num_procs=2", "trainer.zero_stage=2",
                                        "trainer.shard_rollouts=false"], 2),
    ("2 processes, rollouts sharded", ["trainer=deepspeed", "trainer.num_procs=2", "trainer.zero_stage=2"], 1),
]


def run_dp(name, overrides, steps, extra, root, cpu_factor):
    run_dir = Path(root) / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    args = [sys.executable, "-m", "rlpost.cli", "train", *overrides, f"steps={steps}", "eval.at_start=false",
            "eval.at_end=false", "checkpoint.every=0", "logger=jsonl", *extra, f"hydra.run.dir={run_dir}"]
    p = subprocess.run(args, capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if p.returncode != 0:
        return {"name": name, "error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"}
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = recs[1:] or recs
    med = lambda k, f=1.0: statistics.median(r[k] * f for r in steady)  # noqa: E731
    ray = "ray/worker_cpu_s" in steady[0]
    worker_cpu = med("ray/worker_cpu_s") if ray else 0.0
    return {"name": name, "step_s": med("time/step_s"), "rollout_s": med("time/rollout_s"),
            "update_s": med("time/update_s"), "rollout_cpu": med("time/rollout_cpu_s", cpu_factor),  # workers' included
            "learn_cpu": med("time/learn_cpu_s", cpu_factor), "reward": [r["reward/mean"] for r in recs],
            "worker_cpu": worker_cpu, "push_s": statistics.median(r.get("ray/weight_push_s", 0.0) for r in steady)}


def part_dp(a) -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlpost_bench_scale_") as root:
        for name, ov, factor in DP_SETTINGS:
            rows.append(run_dp(name, ov, a.steps, a.overrides, root, factor))
            print(f"done: {name}", file=sys.stderr, flush=True)
    print(f"\n## data-parallel rollouts: steps={a.steps} (first excluded), overrides: {' '.join(a.overrides) or '(default config)'}")
    print("| trainer=deepspeed ZeRO-2 | s/step | rollout s | update s | rollout CPU s (all procs) | learn CPU s (all procs) | reward/mean per step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | error: {r['error']} | | | | | |")
        else:
            print(f"| {r['name']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['update_s']:.2f} | {r['rollout_cpu']:.1f} "
                  f"| {r['learn_cpu']:.1f} | {', '.join(f'{x:.4f}' for x in r['reward'])} |")


def part_ray(a) -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlpost_bench_ray_") as root:
        for name, ov, factor in RAY_SETTINGS:
            rows.append(run_dp(name, ov, a.steps, a.overrides, root, factor))
            print(f"done: {name}", file=sys.stderr, flush=True)
    print(f"\n## Ray rollout workers: steps={a.steps} (first excluded), overrides: {' '.join(a.overrides) or '(default config)'}")
    print("| trainer=torch | s/step | rollout s | update s | rollout CPU s (driver + workers) | of which workers "
          "| learn CPU s | weight push s | reward/mean per step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | error: {r['error']} | | | | | | | |")
        else:
            print(f"| {r['name']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['update_s']:.2f} | {r['rollout_cpu']:.2f} "
                  f"| {r['worker_cpu']:.2f} | {r['learn_cpu']:.2f} | {r['push_s']:.3f} "
                  f"| {', '.join(f'{x:.4f}' for x in r['reward'])} |")


def long_tailed_batch(n: int, vocab: int, seed: int = 0):
    """``n`` rows: prompts of 20-60 tokens, response lengths log-normal (median 24, sigma 1) capped at 256."""
    import torch

    from rlpost.core.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(20, 61, (n,), generator=g)
    rlen = (24 * torch.exp(torch.randn(n, generator=g))).round().clamp(1, 256).long()
    P, R = int(plen.max()), int(rlen.max())
    pm = (torch.arange(P)[None, :] >= (P - plen)[:, None]).long()
    rm = (torch.arange(R)[None, :] < rlen[:, None]).float()
    return RolloutBatch(
        prompt_ids=torch.randint(10, vocab, (n, P), generator=g) * pm, prompt_mask=pm,
        response_ids=torch.randint(10, vocab, (n, R), generator=g), response_mask=rm,
        rollout_logprobs=-torch.rand(n, R, generator=g) * rm, group_index=torch.arange(n) // 8,
        prompt_index=torch.arange(n) // 8, policy_version=torch.zeros(n, dtype=torch.long),
        extras={"advantages": torch.randn(n, 1, generator=g).expand(n, R) * rm},
    ), rlen


def part_tokens(a) -> None:
    import torch

    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    base = [f"model={a.model}", "precision=fp32", "trainer.grad_clip=0", "algo.kl.coef=0", "logger=none",
            "rollout.max_new_tokens=256"]
    cfg0 = compose_config(base)
    policy, _ = load_policy(cfg0.model, torch.float32, seed=0)
    vocab = int(policy.config.vocab_size)
    del policy  # one model in memory at a time: each setting loads its own copy
    batch, rlen = long_tailed_batch(a.rows, vocab)
    width = batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    settings = [("8 sequences per micro-batch", ["trainer.micro_batch_size=8"]),
                (f"max_tokens_per_micro_batch={8 * width}", [f"trainer.max_tokens_per_micro_batch={8 * width}"])]
    out, grads = [], []
    for name, ov in settings:
        t = TorchTrainer.from_config(load_policy(cfg0.model, torch.float32, seed=0)[0], compose_config(base + ov), "cpu")
        captured = {}

        def capture(params, t=t, captured=captured):
            captured["g"] = torch.cat([p.grad.flatten() for p in params if p.grad is not None]).clone()
            t.opt.zero_grad(set_to_none=True)
            return float(captured["g"].norm())

        t._policy_step = capture
        secs, cpus = [], []
        for _ in range(a.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            m = t.policy_update(batch)
            secs.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        n_micro = len(t._split(batch))
        grads.append(captured["g"])
        del t
        out.append((name, n_micro, m["bench/padding_frac"], statistics.median(secs), statistics.median(cpus)))
        print(f"done: {name}", file=sys.stderr, flush=True)
    rel = float((grads[1] - grads[0]).norm() / grads[0].norm())
    q = torch.quantile(rlen.float(), torch.tensor([0.5, 0.9, 1.0])).tolist()
    print(f"\n## token-budget micro-batching: model={a.model}, {a.rows} rows, response length median/p90/max "
          f"{q[0]:.0f}/{q[1]:.0f}/{q[2]:.0f}, padded width {width}, one policy_update, median of {a.repeats}")
    print("| micro-batching | micro-batches | padding fraction | update s | update CPU s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, n, pf, s, c in out:
        print(f"| {name} | {n} | {pf:.3f} | {s:.2f} | {c:.2f} |")
    print(f"relative gradient difference between the two: {rel:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["dp", "tokens", "ray", "all"], default="all")
    ap.add_argument("--steps", type=int, default=3, help="steps per setting of part dp (the first is a warm-up)")
    ap.add_argument("-o", "--overrides", nargs="*", default=[], help="extra Hydra overrides for part dp")
    ap.add_argument("--model", default="smollm2-135m", help="model of part tokens")
    ap.add_argument("--rows", type=int, default=64, help="rows of part tokens' batch")
    ap.add_argument("--repeats", type=int, default=3, help="timed updates per setting of part tokens")
    a = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    if a.part in ("dp", "all"):
        part_dp(a)
    if a.part in ("ray", "all"):
        part_ray(a)
    if a.part in ("tokens", "all"):
        part_tokens(a)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
