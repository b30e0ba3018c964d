"""BroRL's rollout scaling at a fixed rollout budget: fewer prompts, larger groups.

Usage::

    python scripts/bench_brorl.py --budget 32 --steps 2 --configs 8x4 4x8 2x16 1x32

BroRL ("BroRL: Scaling Reinforcement Learning via Broadened Exploration",
arXiv:2510.01180) is ``sampler=group`` with the group size ``N`` in the hundreds
(``recipes/brorl.yaml``). Its efficiency claims are that, at the same budget,
large-``N`` groups leave fewer samples to be filtered out by dynamic sampling
(groups whose rewards are all equal carry no group-relative advantage) and
make generation more compute-bound. This script measures both at this
machine's scale: for each ``PROMPTSxN`` configuration with ``PROMPTS * N =
budget``, the real ``hf`` engine generates ``steps`` batches for SmolLM2-135M on
the default task (no training: the policy is the same for every configuration,
so the comparison is of the sampling shape alone; step ``s`` draws the first
``PROMPTS`` prompts of one seeded shuffle, shared by all configurations), and
prints rollout seconds, decoded tokens and tokens/s, the share of groups and of
rows with all-equal rewards, and the mean reward. Seconds are noisy on a shared
machine; compare them as ratios within one run.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's rlpost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=32, help="rollouts per step, every configuration")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=["8x4", "4x8", "2x16", "1x32"], help="PROMPTSxN")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import Run
    from rlpost.samplers import SAMPLERS, SamplerContext
    from rlpost.samplers.base import group_reward_stats

    shapes = [tuple(int(x) for x in c.split("x")) for c in args.configs]
    bad = [f"{p}x{n}" for p, n in shapes if p * n != args.budget]
    if bad:
        raise SystemExit(f"configurations {bad} do not spend --budget {args.budget} rollouts per step")
    cfg = compose_config([f"model={args.model}", f"rollout.max_new_tokens={args.max_new_tokens}", "logger=none",
                          f"seed={args.seed}", f"rollout.batch_size={args.budget}"])
    run = Run(cfg, Path(tempfile.mkdtemp(prefix="bench_brorl_")))
    order = list(range(len(run.train_examples)))
    random.Random(args.seed).shuffle(order)
    per_step = max(p for p, _ in shapes)
    print(f"# {args.budget} rollouts per step x {args.steps} steps, model={args.model}, "
          f"max_new_tokens={args.max_new_tokens}, seed={args.seed}, torch threads={torch.get_num_threads()}")
    print("| prompts x N | rollout s | decoded tokens | tokens/s | zero-var groups | rows in zero-var groups | mean reward |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for p, n in shapes:
        secs, toks, zg, ng, zr, rew = 0.0, 0, 0, 0, 0, []
        for s in range(args.steps):
            idx = order[s * per_step: s * per_step + p]
            prompts = [run.prompt_ids(i) for i in idx]
            sp = run.sampling_params(s + 1)
            t0 = time.perf_counter()
            res = SAMPLERS.get("group")(n).sample(run.engine, prompts, sp, SamplerContext(step=s + 1, prompt_indices=idx))
            secs += time.perf_counter() - t0
            gen = res.generation
            toks += gen.num_tokens
            r = run.reward_fn(gen.texts, [run.train_examples[idx[g]] for g in res.group_index.tolist()],
                              gen.response_mask.sum(-1))[0].float()
            cnt, _, var = group_reward_stats(r, res.group_index, p)
            zero = var <= 1e-12
            zg += int(zero.sum())
            ng += p
            zr += int(cnt[zero].sum())
            rew.append(float(r.mean()))
        print(f"| {p} x {n} | {secs:.1f} | {toks} | {toks / max(secs, 1e-9):.1f} | {zg}/{ng} | "
              f"{zr / (args.budget * args.steps):.2f} | {sum(rew) / len(rew):.3f} |", flush=True)


if __name__ == "__main__":
    main()
