"""Throughput of rlpost's model rewards on this machine: rows scored per second.

    python scripts/bench_reward_models.py --rm DIR [--rows 64] [--serve] [--local-judge]

Rows are the default task's prompts with answers written ``a + b = c`` (the policy's style).
Each line: the reward kind, its batch setting, rows, seconds (best of ``--reps``), rows/s.
``rm`` is timed batched (``batch_size=32``) and one row per forward (``batch_size=1``, what
batching avoids); ``prm`` scores every sentence of each row; ``judge`` starts a local
``vllm serve`` of SmolLM2-135M-Instruct (CPU backend, fp32) and sends the rows with 8 requests
in flight; ``local_judge`` generates with the HF engine in-process. Run it alone: the numbers
depend on what else the cores are doing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def _rows(n: int):
    from rlpost.config.compose import compose_config
    from rlpost.rewards.train_rm import task_pairs
    from rlpost.tasks import build_task

    task = build_task(compose_config(["model=smollm2-135m"]).task)
    pairs = task_pairs(task, n, seed=1)
    exs = [task.train_examples()[i % len(task.train_examples())] for i in range(n)]
    resp = [p["chosen"] if i % 2 else p["rejected"] + ". So the result is this." for i, p in enumerate(pairs)]
    return task, exs, resp


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rm", required=True, help="reward-model directory (rlpost train-rm)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--serve", action="store_true", help="also time the judge over a local vllm serve")
    ap.add_argument("--local-judge", action="store_true", help="also time the in-process HF judge")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    from rlpost.rewards.models import REWARD_MODELS

    task, exs, resp = _rows(a.rows)
    print(f"# {a.rows} rows, {a.threads} threads, {a.dtype}")
    print(f"{'kind':<12} {'setting':<22} {'rows':>5} {'s':>8} {'rows/s':>8}")

    def run(kind, setting, obj, n=a.rows):
        obj.task, obj.name = task, kind
        obj.check()
        obj.attach(None, dtype, "cpu")
        obj.score(resp[:2], exs[:2], {})  # warm-up
        s = _best(lambda: (obj.begin_step(), obj.score(resp[:n], exs[:n], {})), a.reps)
        print(f"{kind:<12} {setting:<22} {n:>5} {s:>8.2f} {n / s:>8.1f}", flush=True)
        obj.close()

    cls = REWARD_MODELS.get("rm")
    run("rm", "batch_size=32", cls(model_path=a.rm, normalize="none", batch_size=32, max_length=1024))
    run("rm", "batch_size=1 (per row)", cls(model_path=a.rm, normalize="none", batch_size=1, max_length=1024))
    prm = REWARD_MODELS.get("prm")
    run("prm", "batch_size=16 sentence", prm(model_path=a.rm, segment="sentence", transform="sigmoid", outcome="none",
                                              batch_size=16, max_length=1024))
    d = str(Path.home() / ".cache" / "rlpost" / "smollm2-135m-instruct")
    if a.local_judge:
        lj = REWARD_MODELS.get("local_judge")
        run("local_judge", "batch_size=16", lj(**{**REWARD_MODELS.kwargs("local_judge"), "model_path": d}), n=min(a.rows, 32))
    if a.serve:
        from rlpost.rewards.serve import VllmServer

        with VllmServer(d, dtype="float32", kv_cache_gib=1) as srv:
            j = REWARD_MODELS.get("judge")
            run("judge", "vllm serve, 8 in flight",
                j(**{**REWARD_MODELS.kwargs("judge"), "base_url": srv.base_url, "model": "judge"}))


if __name__ == "__main__":
    main()
