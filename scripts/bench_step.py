#!/usr/bin/env python
"""Benchmark one RL step of the default config, stage by stage.

Prints seconds per stage, rollout tokens/s and the update's achieved FLOP/s
(6 x parameters x tokens / update seconds, tokens = prompt + response tokens
the update processed), for each precision given.

    python scripts/bench_step.py                       # fp32 and bf16, default config
    python scripts/bench_step.py --precisions fp32 --steps 2 model=tiny
    python scripts/bench_step.py --decode --precisions fp32    # decode steps vs the per-token floor
    python scripts/bench_step.py --compile-decode              # eager vs torch.compile'd decoding

Extra arguments are Hydra overrides applied to every run. The first step
includes warm-up effects; with --steps N the figures of the last step are shown
together with the mean over steps 2..N.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

import sys  # noqa: E402
from pathlib import Path as _P  # noqa: E402

sys.path.insert(0, str(_P(__file__).resolve().parents[1]))  # this checkout's rlpost, not an installed copy


def bench(precision: str, steps: int, overrides: list[str]) -> dict:
    from rlpost.config.compose import compose_config
    from rlpost.run.runner import Run

    cfg = compose_config([f"precision={precision}", "logger=none", f"steps={steps}", *overrides])
    with tempfile.TemporaryDirectory() as d:
        run = Run(cfg, Path(d))
        n_params = sum(p.numel() for p in run.trainer.policy.parameters())
        rows = []
        try:
            for _ in range(steps):
                m = run.train_step()
                # tokens the update's forward passes processed (prompt + response, unpadded)
                rows.append(m)
        finally:
            run.close()
    last = rows[-1]
    tail = rows[1:] if len(rows) > 1 else rows
    upd = statistics.mean(r["time/update_s"] for r in tail)
    toks = last["bench/update_tokens"]
    return {
        "precision": precision,
        "params_M": n_params / 1e6,
        "rollout_s": statistics.mean(r["time/rollout_s"] for r in tail),
        "reward_s": statistics.mean(r["time/reward_s"] for r in tail),
        "update_s": upd,
        "step_s": statistics.mean(r["time/step_s"] for r in tail),
        "rollout_tok_s": statistics.mean(r["throughput/rollout_tokens_per_s"] for r in tail),
        "update_tokens": toks,
        "update_gflops": 6 * n_params * toks / upd / 1e9,
        "peak_rss_mb": last["memory/peak_rss_mb"],
    }


def matmul_gflops(n: int = 2048, reps: int = 10) -> dict:
    """Achieved GFLOP/s of an ``n x n`` matmul in fp32 and bf16 (2 n^3 FLOPs each)."""
    import time

    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        for _ in range(2):
            a @ b
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        out[name] = 2 * n**3 * reps / (time.perf_counter() - t) / 1e9
    return out


def decode_floor(rows: int = 32, new_tokens: int = 32, overrides: list | None = None, reps: int = 3) -> dict:
    """The HF engine's seconds per decode step against the per-token floor, real model.

    Floor of one decode step over ``r`` rows = max(weight bytes / memory bandwidth,
    2 x parameters x r / matmul rate), with the bandwidth from summing a 512 MiB
    buffer and the rate from a decode-shaped (``r x 576 @ 576 x 8192``) matmul of the
    rollout dtype. The engine is timed per decoder forward (a hook), prefill apart.
    Runs ``reps`` rounds, each generating once with the in-place KV cache (the
    default) and once with transformers' ``torch.cat`` cache, interleaved; reports
    the median round of each (keys prefixed ``cat_cache_`` for the latter).
    """
    import time

    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.rollout.base import SamplingParams
    from rlpost.tasks import build_task

    cfg = compose_config(["logger=none", *(overrides or [])])
    policy, tok = load_policy(cfg.model, torch.float32, seed=0)
    eng = build_engine(EngineConfig.of(cfg), policy, tok, torch.device("cpu"))
    task = build_task(cfg.task)
    prompts = [task.render_prompt(e, tok) for e in task.train_examples()[:rows]]
    n_params = sum(p.numel() for p in eng.model.parameters())
    wbytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    buf = torch.ones(128 * 2**20)
    buf.sum()
    t = time.perf_counter()
    for _ in range(3):
        buf.sum()
    bw = 3 * buf.numel() * 4 / (time.perf_counter() - t)
    dt = next(eng.model.parameters()).dtype
    a, b = torch.randn(rows, 576).to(dt), torch.randn(576, 8192).to(dt)
    a @ b
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    rate = 2 * rows * 576 * 8192 * 20 / (time.perf_counter() - t)
    calls = []
    base = eng.model.base_model
    t_last = [0.0]
    h1 = base.register_forward_pre_hook(lambda m, a, kw: t_last.__setitem__(0, time.perf_counter()), with_kwargs=True)
    h2 = base.register_forward_hook(
        lambda m, a, kw, o: calls.append((kw["input_ids"].shape[0], kw["input_ids"].shape[1], time.perf_counter() - t_last[0])),
        with_kwargs=True)
    eng.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))  # warm-up
    # A/B, interleaved: the in-place KV cache (default) against transformers' torch.cat cache
    runs: dict = {True: [], False: []}
    for _ in range(reps):
        for prealloc in (False, True):
            eng.prealloc_cache = prealloc
            calls.clear()
            t = time.perf_counter()
            g = eng.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0))
            total = time.perf_counter() - t
            dec = [c for c in calls if c[1] == 1]
            runs[prealloc].append((total, sum(c[2] for c in calls if c[1] > 1), sum(c[2] for c in dec), dec, g.num_tokens))
    h1.remove()
    h2.remove()
    out = {"rollout_dtype": str(dt).replace("torch.", ""), "rows": rows, "bandwidth_GBs": bw / 1e9,
           "matmul_GFLOPs": rate / 1e9, "weight_MB": wbytes / 1e6}
    for prealloc, tag in ((True, ""), (False, "cat_cache_")):
        med = sorted(runs[prealloc], key=lambda r: r[0])[len(runs[prealloc]) // 2]
        total, prefill, decoder, dec, ntok = med
        out.update({f"{tag}tokens": ntok, f"{tag}total_s": total, f"{tag}prefill_s": prefill,
                    f"{tag}decode_steps": len(dec), f"{tag}decoder_s": decoder,
                    f"{tag}floor_s": sum(max(wbytes / bw, 2 * n_params * r / rate) for r, _, _ in dec)})
    return out


def decode_compile_ab(rows: int = 32, new_tokens: int = 32, overrides: list | None = None, reps: int = 2) -> dict:
    """The HF engine's generation with the decoder eager against ``torch.compile``-d, real model.

    The engine's model is wrapped in ``torch.compile(dynamic=True)`` (inductor; on CPU it emits
    C++/OpenMP kernels that fuse the element-wise work around the matmuls). The batch shrinks as
    rows finish and the KV cache grows by a position per step, so the shapes are marked dynamic
    rather than recompiled per step. The compiled arm runs with transformers' own KV cache (the
    in-place cache's views of one buffer make inductor fail in torch 2.13). Reports the compile (first generation) seconds, the median
    of ``reps`` interleaved generations each way, and whether the sampled tokens are identical
    and the largest rollout log-prob difference (same seeds).
    """
    import time

    import torch._dynamo

    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.rollout.base import SamplingParams
    from rlpost.tasks import build_task

    cfg = compose_config(["logger=none", *(overrides or [])])
    policy, tok = load_policy(cfg.model, torch.float32, seed=0)
    eng = build_engine(EngineConfig.of(cfg), policy, tok, torch.device("cpu"))
    task = build_task(cfg.task)
    prompts = [task.render_prompt(e, tok) for e in task.train_examples()[:rows]]
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0)
    eager = eng.model
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    compiled = torch.compile(eager, dynamic=True)

    def gen(model):
        eng.model = model
        # inductor's AOT autograd fails on the in-place cache's views of one buffer as graph inputs
        # (torch 2.13: "Expected !size_bytes_is_heap_allocated_"), so the compiled arm decodes with
        # transformers' own cache; the eager arm keeps the engine's default (in-place) cache
        eng.prealloc_cache = model is eager
        t = time.perf_counter()
        g = eng.generate(prompts, sp)
        return time.perf_counter() - t, g

    eng.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))  # eager warm-up
    compile_s, _ = gen(compiled)
    times: dict = {"eager": [], "compiled": []}
    outs = {}
    for _ in range(reps):
        for name, model in (("eager", eager), ("compiled", compiled)):
            dt, outs[name] = gen(model)
            times[name].append(dt)
    eng.model = eager
    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {"rows": rows, "tokens": outs["eager"].num_tokens, "compile_first_s": compile_s, "eager_s": e,
            "compiled_s": c, "eager_over_compiled": e / c,
            "same_tokens": bool(torch.equal(outs["eager"].response_ids, outs["compiled"].response_ids)),
            "max_logprob_diff": float((outs["eager"].rollout_logprobs - outs["compiled"].rollout_logprobs).abs().max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--matmul", action="store_true", help="only the 2048^2 matmul GFLOP/s in fp32 and bf16")
    ap.add_argument("--decode", action="store_true", help="HF engine decode steps vs the per-token floor")
    ap.add_argument("--compile-decode", action="store_true",
                    help="HF engine generation, eager vs torch.compile(dynamic=True), interleaved")
    args, overrides = ap.parse_known_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    if args.matmul:
        print(" ".join(f"{k}: {v:.0f} GFLOP/s" for k, v in matmul_gflops().items()))
        return
    if args.compile_decode:
        r = decode_compile_ab(overrides=overrides)
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
        return
    if args.decode:
        for p in args.precisions.split(","):
            r = decode_floor(overrides=[f"precision={p}", *overrides])
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
            for tag, label in (("", "in-place KV cache"), ("cat_cache_", "torch.cat KV cache")):
                print(f"  {label}: decoder forwards {r[tag + 'decoder_s']:.2f} s vs floor {r[tag + 'floor_s']:.2f} s "
                      f"({r[tag + 'floor_s'] / r[tag + 'decoder_s']:.0%} of the floor's speed); sampling and Python: "
                      f"{r[tag + 'total_s'] - r[tag + 'decoder_s'] - r[tag + 'prefill_s']:.2f} s; "
                      f"{r[tag + 'tokens'] / r[tag + 'total_s']:.0f} tokens/s")
            print(f"  decoder time, torch.cat cache / in-place cache: {r['cat_cache_decoder_s'] / r['decoder_s']:.2f}x")
        return
    results = [bench(p, args.steps, overrides) for p in args.precisions.split(",")]
    cols = ["precision", "rollout_s", "reward_s", "update_s", "step_s", "rollout_tok_s", "update_tokens", "update_gflops", "peak_rss_mb"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
