#!/usr/bin/env python
"""NAT's random prefix cutting: the update's forward + backward on the drawn columns only, against every column.

"Not all tokens are needed (NAT): token efficient reinforcement learning" (arXiv:2603.06619)
trains on a random subset of each response's tokens with Horvitz-Thompson weights. With RPC
(random prefix cutting, ``algo=nat algo.loss_params.selector=rpc``) the subset is a prefix of
each response, so the update's forward can stop after it: the trainer draws the subset once per
mini-batch before the forward (the loss's ``token_draw`` tag) and, with
``trainer.drawn_forward=true`` (the default), runs each micro-batch only up to its last drawn
column, with rows grouped by drawn width and rows without a drawn token left out
(docs/ALGORITHMS.md, "NAT"). ``trainer.drawn_forward=false`` sends every column forward: the
same loss and gradient, without the saving.

Each arm runs in a process of its own (so its peak memory is its own): one policy update on a
synthetic batch of G prompts x N responses (random token ids, response lengths uniform in
``[R/4, R]``, random advantages), with the optimizer step replaced by a capture, so the time is
that of the forward + backward of every micro-batch. Reported per arm: the median update time
over ``--reps`` updates after one warm-up, the peak memory (CUDA: ``max_memory_allocated``
during the timed updates; CPU: the process's peak resident set above its size before the first
update), ``bench/update_forward_frac`` (padded tokens the forward ran, as a share of the full
forward's) and the warm-up update's loss and gradient norm (the two arms must agree).

    python scripts/bench_nat.py                          # model=tiny, on this machine's device
    python scripts/bench_nat.py --model smollm2-135m     # the real model (a GPU run for the lead)
    python scripts/bench_nat.py --selector urs           # URS: nothing to cut, the same time

Extra arguments are config overrides (``precision=bf16``, ``trainer.max_tokens_per_micro_batch=4096``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's rlpost, not an installed copy


def _rss_kib(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in KiB (0 where /proc is absent)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def make_batch(groups: int, n: int, p: int, r: int, vocab: int, seed: int = 0):
    """``groups`` prompts of ``p`` tokens, ``n`` responses each of ``R/4..R`` tokens, random advantages."""
    from rlpost.core.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    B = groups * n
    prompts = torch.randint(0, vocab, (groups, p), generator=g).repeat_interleave(n, 0)
    lens = torch.randint(max(1, r // 4), r + 1, (B,), generator=g)
    rm = (torch.arange(r)[None, :] < lens[:, None]).float()
    return RolloutBatch(
        prompt_ids=prompts, prompt_mask=torch.ones(B, p, dtype=torch.long),
        response_ids=torch.randint(0, vocab, (B, r), generator=g), response_mask=rm,
        rollout_logprobs=-torch.rand(B, r, generator=g) * rm, group_index=torch.arange(B) // n,
        prompt_index=torch.arange(B) // n, policy_version=torch.zeros(B, dtype=torch.long),
        extras={"advantages": torch.randn(B, 1, generator=g).expand(B, r) * rm},
    )


def run_arm(args, overrides) -> dict:
    """One arm in this process: warm-up update, then ``reps`` timed ones; returns its row."""
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = compose_config(["precision=fp32", f"model={args.model}", "algo=nat", f"algo.loss_params.selector={args.selector}",
                          "algo.kl.coef=0", "algo.entropy_coef=0", "trainer.grad_clip=0", "algo.mini_batches=1",
                          "algo.ppo_epochs=1", f"trainer.micro_batch_size={args.micro_batch_size}",
                          f"trainer.drawn_forward={args.arm == 'drawn'}", "trainer.entropy_every=0", *overrides])
    policy, _ = load_policy(cfg.model, torch.float32, seed=0)
    t = TorchTrainer.from_config(policy, cfg, device)
    vocab = int(policy.get_output_embeddings().weight.shape[0])
    batch = make_batch(args.groups, args.group_size, args.prompt_len, args.response_len, vocab)
    grads = {}

    def capture(params):  # the optimizer step left out: the weights stay, every update is the same work
        gs = [p.grad for p in params if p.grad is not None]
        grads["norm"] = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in gs])))
        t.opt.zero_grad(set_to_none=True)
        return grads["norm"]

    t._policy_step = capture

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    base_rss = _rss_kib("VmRSS")
    t.version = 0  # the same draw (seeded by the run seed and the step) in both arms and every repetition
    m0 = t.policy_update(batch)
    warm_norm = grads["norm"]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.reps):
        t.version = 0
        sync()
        t0 = time.perf_counter()
        t.policy_update(batch)
        sync()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device == "cuda"
            else max(0, _rss_kib("VmHWM") - base_rss) / 1024)
    return {"arm": args.arm, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "model": args.model, "selector": args.selector, "update_s": statistics.median(times),
            "peak_mib": peak, "peak_kind": "cuda_max_allocated" if device == "cuda" else "rss_above_start",
            "update_forward_frac": m0.get("bench/update_forward_frac", 1.0),
            "drawn_frac": m0.get("actor/drawn_frac"), "loss": m0.get("loss/policy"), "grad_norm": warm_norm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="model preset (tiny | smollm2-135m | ...)")
    ap.add_argument("--selector", default="rpc", choices=["rpc", "urs"])
    ap.add_argument("--groups", type=int, default=4, help="G, distinct prompts")
    ap.add_argument("--group-size", type=int, default=8, help="N, responses per prompt")
    ap.add_argument("--prompt-len", type=int, default=64, help="P, prompt tokens")
    ap.add_argument("--response-len", type=int, default=256, help="R, the longest response")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="trainer.micro_batch_size")
    ap.add_argument("--reps", type=int, default=3, help="timed updates per arm (after one warm-up)")
    ap.add_argument("--arm", choices=["full", "drawn"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args, overrides = ap.parse_known_args()
    if args.arm:  # a child process: one arm, one JSON line
        print("ROW " + json.dumps(run_arm(args, overrides)), flush=True)
        return
    rows = []
    for arm in ("full", "drawn"):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--arm", arm] + sys.argv[1:]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        line = [x for x in out.stdout.splitlines() if x.startswith("ROW ")]
        if out.returncode != 0 or not line:
            sys.exit(f"arm {arm} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(line[0][4:]))
    full, drawn = rows
    for r in rows:
        print(f"{r['arm']:>5} ({r['device']}, {r['model']}, {r['selector']}): update fwd+bwd {r['update_s']:.3f} s, "
              f"peak {r['peak_mib']:.1f} MiB ({r['peak_kind']}), forward tokens {r['update_forward_frac']:.3f} of full, "
              f"drawn {r['drawn_frac']:.3f}; loss {r['loss']:.6g}, grad norm {r['grad_norm']:.6g}", flush=True)
    print(f"drawn / full: time {drawn['update_s'] / full['update_s']:.3f}, "
          f"peak memory {drawn['peak_mib'] / max(full['peak_mib'], 1e-9):.3f}; "
          f"grad norm rel diff {abs(drawn['grad_norm'] - full['grad_norm']) / max(full['grad_norm'], 1e-30):.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
