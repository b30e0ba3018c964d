#!/usr/bin/env python
"""Rollout seconds, tokens/s, weight-push seconds and peak memory of rollout=hf and rollout=vllm, interleaved.

Usage::

    python scripts/bench_rollout_engines.py                       # the default run's rollout: 8 prompts x 8, its token limit
    python scripts/bench_rollout_engines.py --rows 64 --tokens 128  # a larger batch
    python scripts/bench_rollout_engines.py --rounds 3 --reps 3 -o precision=bf16

Each (engine, round) is its own process, so each engine gets the thread settings it runs with in
training and its own peak RSS: both run in-process with the trainer's torch threads (all cores,
``--threads`` to change), rollout=vllm through ``rlpost.rollout.vllm.cpu_threads_kept`` as in a
run. Rounds alternate hf, vllm, hf, vllm, ... so a change in machine load hits both. In a process:
the engine is built (timed), one warm-up rollout, then ``--reps`` times: a rollout of the task's
training prompts (the default task's chat-rendered prompts, ``n`` samples each, temperature 1,
seeded) and a weight push of the trainer's policy after a small perturbation (what every RL step
pays: rollout=hf shares fp32 weights and pushes nothing, a bf16 copy is re-cast; rollout=vllm
reloads the weights into its engine).

Prints one row per engine: median rollout seconds (min-max over every rep of every round),
generated tokens/s, median push seconds, rollout + push per step, engine build seconds, peak RSS of
the process. Timings on a shared machine are noisy: compare the two as a ratio from one run, and
say what else ran (`uptime` is printed first).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def one(engine: str, rows: int, tokens: int, reps: int, threads: int, overrides) -> dict:
    """Build ``engine`` and time ``reps`` rollouts and pushes in this process; returns the figures as a dict."""
    import torch

    torch.set_num_threads(threads)
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.rollout.base import SamplingParams
    from rlpost.tasks.base import build_task

    cfg = compose_config([f"rollout={engine}", f"rollout.batch_size={rows}", *overrides])
    n = int(cfg.algo.n_samples_per_prompt)
    task = build_task(cfg.task)
    model, tok = load_policy(cfg.model)
    prompts = [task.render_prompt(ex, tok) for ex in task.train_examples()[: max(1, rows // n)]]
    prompts = [p for p in prompts for _ in range(n)][:rows]
    t0 = time.perf_counter()
    eng = build_engine(EngineConfig.of(cfg), model, tok, torch.device("cpu"))
    build_s = time.perf_counter() - t0
    sp = lambda i: SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=1000 + i)  # noqa: E731
    eng.generate(prompts, sp(0))  # warm-up
    gen_s, push_s, toks = [], [], []
    for i in range(reps):
        t0 = time.perf_counter()
        g = eng.generate(prompts, sp(i + 1))
        gen_s.append(time.perf_counter() - t0)
        toks.append(int(g.response_mask.sum()))
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0 + 1e-4)
        t0 = time.perf_counter()
        eng.sync_weights(model)
        push_s.append(time.perf_counter() - t0)
    eng.close()
    return {"engine": engine, "gen_s": gen_s, "push_s": push_s, "tokens": toks, "build_s": build_s,
            "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "threads": torch.get_num_threads(),
            "rows": len(prompts), "max_new_tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=None, help="rows per rollout (default: the default run's prompts x n)")
    ap.add_argument("--tokens", type=int, default=None, help="max new tokens (default: the default run's)")
    ap.add_argument("--rounds", type=int, default=2, help="processes per engine, alternating")
    ap.add_argument("--reps", type=int, default=3, help="timed rollouts + pushes per process")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--engines", nargs="*", default=["hf", "vllm"])
    ap.add_argument("-o", "--overrides", nargs="*", default=[])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(a.one, a.rows, a.tokens, a.reps, a.threads, a.overrides)), flush=True)
        return
    from rlpost.config.compose import compose_config

    cfg = compose_config(list(a.overrides))
    rows = a.rows or int(cfg.selector.prompts_per_step) * int(cfg.algo.n_samples_per_prompt)
    tokens = a.tokens or int(cfg.rollout.max_new_tokens)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, load: {os.getloadavg()[0]:.2f}, {rows} rows x up to {tokens} tokens, "
          f"{a.threads} threads, {a.rounds} rounds x {a.reps} reps, overrides {a.overrides}", flush=True)
    res = {e: [] for e in a.engines}
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false"}
    for _ in range(a.rounds):
        for e in a.engines:
            cmd = [sys.executable, __file__, "--one", e, "--rows", str(rows), "--tokens", str(tokens),
                   "--reps", str(a.reps), "--threads", str(a.threads), "-o", *a.overrides]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not line:
                print(f"{e}: failed ({(p.stderr.strip().splitlines() or ['?'])[-1]})", flush=True)
                continue
            res[e].append(json.loads(line[0][7:]))
    print(f"{'engine':8s} {'rollout s (min-max)':>22s} {'tokens/s':>9s} {'push s':>7s} {'step s':>7s} "
          f"{'build s':>8s} {'peak RSS GiB':>13s}")
    for e, runs in res.items():
        if not runs:
            continue
        g = [x for r in runs for x in r["gen_s"]]
        p = [x for r in runs for x in r["push_s"]]
        tps = [t / s for r in runs for t, s in zip(r["tokens"], r["gen_s"])]
        print(f"{e:8s} {statistics.median(g):8.2f} ({min(g):.2f}-{max(g):.2f}) {statistics.median(tps):9.0f} "
              f"{statistics.median(p):7.2f} {statistics.median(g) + statistics.median(p):7.2f} "
              f"{statistics.median(r['build_s'] for r in runs):8.1f} {max(r['rss_gib'] for r in runs):13.2f}")


if __name__ == "__main__":
    main()
