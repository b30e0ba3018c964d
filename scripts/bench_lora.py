#!/usr/bin/env python
"""Full fine-tuning vs LoRA on SmolLM2-135M: peak memory and step time, and LoRA rollout weights.

Each configuration runs in its own process (peak resident memory is a process-wide
high-water mark), a few RL steps of the given config through the real run loop
(:class:`rlpost.run.runner.Run`), with a KL reference (``algo.kl.coef=0.04``) so the
full fine-tuning run holds its reference copy and LoRA uses the base under its
adapters. Then, in the LoRA process, the two ways the hf engine can generate with
an adapter are timed on the same prompts: the PEFT model directly (unmerged: two
extra low-rank matmuls per adapted layer and token, no copy) and a plain copy
holding merged weights (one merge per push).

    python scripts/bench_lora.py                       # SmolLM2-135M, 3 steps, rank 16
    python scripts/bench_lora.py --steps 2 --rank 8 model=tiny
    python scripts/bench_lora.py --update-only         # the update alone on a fixed batch (no rollouts)

Extra arguments are Hydra overrides applied to both runs. Figures are the mean
over steps 2..N (step 1 includes warm-up). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's rlpost, not an installed copy

SMALL = ["logger=none", "eval.at_start=false", "eval.at_end=false", "checkpoint.every=0", "precision=fp32",
         "selector.prompts_per_step=4", "algo.n_samples_per_prompt=4", "rollout.max_new_tokens=64",
         "algo.kl.coef=0.04", "trainer.micro_batch_size=8"]


def child(mode: str, steps: int, rank: int, overrides: list) -> dict:
    """One configuration: ``steps`` RL steps; returns its figures (and the rollout A/B for LoRA)."""
    import torch

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import Run, peak_rss_mb

    lora = [f"model.lora.rank={rank}", f"model.lora.alpha={2 * rank}",
            "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"] if mode == "lora" else []
    cfg = compose_config([*SMALL, f"steps={steps}", *lora, *overrides])
    rows = []
    with tempfile.TemporaryDirectory() as d:
        run = Run(cfg, Path(d))
        trainable = sum(p.numel() for p in run.trainer.policy.parameters() if p.requires_grad)
        opt_state = 0
        try:
            for _ in range(steps):
                rows.append(run.train_step())
            opt_state = sum(t.numel() * t.element_size() for s in run.trainer.opt.state.values()
                            for t in s.values() if torch.is_tensor(t))
            out = {"mode": mode, "trainable_M": trainable / 1e6, "opt_state_MiB": opt_state / 2**20,
                   "ref_copy": run.trainer.ref is not None, "peak_rss_MiB": peak_rss_mb()}
            tail = rows[1:] if len(rows) > 1 else rows
            for k in ("time/rollout_s", "time/update_s", "time/step_s"):
                out[k] = statistics.mean(r[k] for r in tail)
            if mode == "lora":
                out.update(rollout_ab(run))
        finally:
            run.close()
    return out


def child_update(mode: str, steps: int, rank: int, overrides: list) -> dict:
    """The update alone on a fixed synthetic batch (16 rows, 32 prompt + 96 response tokens): ``steps`` x
    (reference log-probs + one policy update); no rollouts, no task scoring."""
    import torch

    from rlpost.core.batch import RolloutBatch
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.run.runner import peak_rss_mb
    from rlpost.trainer.torch_engine import TorchTrainer

    lora = [f"model.lora.rank={rank}", f"model.lora.alpha={2 * rank}",
            "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"] if mode == "lora" else []
    cfg = compose_config([*SMALL, f"steps={steps}", *lora, *overrides])
    policy, _ = load_policy(cfg.model, torch.float32, seed=0)
    t = TorchTrainer.from_config(policy, cfg, "cpu")
    g = torch.Generator().manual_seed(0)
    B, P, R = 16, 32, 96
    mask = torch.ones(B, R)
    b = RolloutBatch(prompt_ids=torch.randint(10, 1000, (B, P), generator=g), prompt_mask=torch.ones(B, P, dtype=torch.long),
                     response_ids=torch.randint(10, 1000, (B, R), generator=g), response_mask=mask,
                     rollout_logprobs=-torch.rand(B, R, generator=g), group_index=torch.arange(B) // 4,
                     prompt_index=torch.arange(B) // 4, policy_version=torch.zeros(B, dtype=torch.long),
                     extras={"advantages": torch.randn(B, 1, generator=g).expand(B, R).contiguous()})
    secs = []
    for _ in range(steps):
        t0 = time.perf_counter()
        b.extras["ref_logprobs"], _ = t.compute_logprobs(b, "ref")
        t.policy_update(b, torch.Generator().manual_seed(0))
        secs.append(time.perf_counter() - t0)
    opt_state = sum(x.numel() * x.element_size() for s in t.opt.state.values() for x in s.values() if torch.is_tensor(x))
    tail = secs[1:] if len(secs) > 1 else secs
    return {"mode": mode, "trainable_M": sum(p.numel() for p in policy.parameters() if p.requires_grad) / 1e6,
            "opt_state_MiB": opt_state / 2**20, "ref_copy": t.ref is not None, "peak_rss_MiB": peak_rss_mb(),
            "time/rollout_s": float("nan"), "time/update_s": statistics.mean(tail), "time/step_s": statistics.mean(tail)}


def rollout_ab(run) -> dict:
    """Seconds to generate the same prompts with the PEFT model directly vs a merged copy (+ its push)."""
    from rlpost.rollout.hf import HFRolloutEngine

    prompts = [run.prompt_ids(i) for i in range(8)]
    params = run.sampling_params(1)
    direct = HFRolloutEngine(run.trainer.policy, run.tokenizer, 64, share_weights=True)
    merged = HFRolloutEngine(run.trainer.policy, run.tokenizer, 64, share_weights=False)
    out = {}
    for name, eng in (("direct", direct), ("merged", merged), ("direct2", direct), ("merged2", merged)):
        t = time.perf_counter()
        if name.startswith("merged"):
            eng.sync_weights(run.trainer.policy)
        t_push = time.perf_counter() - t
        g = eng.generate(prompts, params)
        out[f"gen_{name}_s"] = time.perf_counter() - t
        out[f"push_{name}_s"] = t_push
        out[f"gen_{name}_tokens"] = g.num_tokens
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--update-only", action="store_true",
                    help="time only the update (reference pass + policy update) on a fixed synthetic batch")
    ap.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    args, overrides = ap.parse_known_args()
    if args.child:
        fn = child_update if args.update_only else child
        print("RESULT " + json.dumps(fn(args.child, args.steps, args.rank, overrides)))
        return
    res = []
    for mode in ("full", "lora"):
        cmd = [sys.executable, __file__, "--child", mode, "--steps", str(args.steps), "--rank", str(args.rank),
               *(["--update-only"] if args.update_only else []), *overrides]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        if p.returncode != 0 or not line:
            sys.exit(f"{mode} run failed:\n{p.stderr[-3000:]}")
        res.append(json.loads(line[0][7:]))
    print(f"{'mode':<6}{'trainable M':>12}{'AdamW MiB':>11}{'ref copy':>9}{'peak RSS MiB':>13}"
          f"{'rollout s':>10}{'update s':>9}{'step s':>8}")
    for r in res:
        print(f"{r['mode']:<6}{r['trainable_M']:>12.2f}{r['opt_state_MiB']:>11.1f}{str(r['ref_copy']):>9}"
              f"{r['peak_rss_MiB']:>13.0f}{r['time/rollout_s']:>10.2f}{r['time/update_s']:>9.2f}{r['time/step_s']:>8.2f}")
    f, l = res
    print(f"LoRA / full: peak RSS {l['peak_rss_MiB'] / f['peak_rss_MiB']:.2f}, update time "
          f"{l['time/update_s'] / f['time/update_s']:.2f}, step time {l['time/step_s'] / f['time/step_s']:.2f}")
    if args.update_only:
        return
    print(f"LoRA rollouts, 8 prompts x {SMALL[7].split('=')[1]} tokens (second of two runs each): PEFT model directly "
          f"{l['gen_direct2_s']:.2f} s, merged copy {l['gen_merged2_s']:.2f} s (of which merge+push "
          f"{l['push_merged2_s']:.2f} s)")


if __name__ == "__main__":
    main()
