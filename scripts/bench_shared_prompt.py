#!/usr/bin/env python
"""The update's shared-prompt forward against the plain one: DualKV's token reduction, measured.

"DualKV: Shared-Prompt Flash Attention for Efficient RL Training with Large Rollouts and Long
Contexts" (arXiv:2605.15422) observes that under causal masking the N responses of a GRPO group
see identical prompt hidden states at every layer, so the prompt can be processed once: the
token count of a group drops from N(P+R) to P+NR, a factor rho = N(P+R)/(P+NR), for every
per-token operation (norms, projections, MLP), exactly. rlpost's update forward already does
this (:func:`rlpost.models.logprobs._shared_prefix_hidden`, ``share_prefix=True``, the default):
the decoder runs once per distinct prompt with a KV cache, the cache is indexed out to the N
rows and the responses run on top. What DualKV adds beyond it is a fused CUDA attention kernel
that reads the shared prompt KV once; here the index copies it per row (memory N*P per layer)
and attention itself is the stock kernel.

For each group size N this script builds G groups of N rows (random token ids: timing does not
depend on content), P prompt and R response tokens, and times a forward + backward of
``sum(logprob * advantage)`` through :func:`rlpost.models.logprobs.response_logprobs` with
``share_prefix`` on and off, interleaved (A B A B ...), reporting medians, their ratio, rho,
and the exactness check (largest log-prob difference, relative gradient difference).

    python scripts/bench_shared_prompt.py                                  # SmolLM2-135M, N = 4 8 16
    python scripts/bench_shared_prompt.py --groups 1 --group-sizes 8 --prompt-len 256 model=tiny

Extra arguments are config overrides (``model=...``). Prints one row per N; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's rlpost, not an installed copy


def rho(n: int, p: int, r: int) -> float:
    """DualKV's token reduction N(P+R) / (P+NR) for one group (arXiv:2605.15422, Sec. 1)."""
    return n * (p + r) / (p + n * r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group-sizes", type=int, nargs="+", default=[4, 8, 16], help="N, rows per prompt")
    ap.add_argument("--groups", type=int, default=2, help="distinct prompts per batch")
    ap.add_argument("--prompt-len", type=int, default=128, help="P, prompt tokens")
    ap.add_argument("--response-len", type=int, default=32, help="R, response tokens")
    ap.add_argument("--reps", type=int, default=5, help="timed forward+backward passes per arm (after one warm-up)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args, overrides = ap.parse_known_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import response_logprobs

    cfg = compose_config(["precision=fp32", *(overrides or ["model=smollm2-135m"])])
    model, _tok = load_policy(cfg.model, torch.float32, seed=0)
    model.train()
    vocab = int(model.get_output_embeddings().weight.shape[0])
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for n in args.group_sizes:
        g = torch.Generator().manual_seed(n)
        B, P, R = args.groups * n, args.prompt_len, args.response_len
        prompts = torch.randint(0, vocab, (args.groups, P), generator=g).repeat_interleave(n, 0)
        p_mask = torch.ones(B, P, dtype=torch.long)
        resp = torch.randint(0, vocab, (B, R), generator=g)
        r_attn = torch.ones(B, R, dtype=torch.long)
        adv = torch.randn(B, 1, generator=g)

        def step(share: bool):
            model.zero_grad(set_to_none=True)
            lp, _ = response_logprobs(model, prompts, p_mask, resp, r_attn, share_prefix=share)
            (lp * adv).sum().backward()
            return lp.detach(), [p.grad.detach().clone() for p in params[:4]] + [params[-1].grad.detach().clone()]

        lp_s, gr_s = step(True)  # warm-up of both arms, and the exactness check
        lp_f, gr_f = step(False)
        dlp = float((lp_s - lp_f).abs().max())
        dgr = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(gr_s, gr_f))
        times = {True: [], False: []}
        for _ in range(args.reps):
            for share in (True, False):
                t0 = time.perf_counter()
                step(share)
                times[share].append(time.perf_counter() - t0)
        t_s, t_f = statistics.median(times[True]), statistics.median(times[False])
        row = {"N": n, "groups": args.groups, "P": P, "R": R, "rho": rho(n, P, R),
               "shared_s": t_s, "full_s": t_f, "speedup": t_f / t_s,
               "max_abs_logprob_diff": dlp, "max_rel_grad_diff": dgr}
        rows.append(row)
        print(f"N={n:3d} G={args.groups} P={P} R={R}: rho {row['rho']:.2f}, fwd+bwd shared {t_s:.3f} s, "
              f"full {t_f:.3f} s, speedup {row['speedup']:.2f}x; max |dlogprob| {dlp:.2e}, "
              f"max rel grad diff {dgr:.2e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
