"""Rollout seconds of sampler=spec_rl against sampler=group in one process, alternating.

Usage::

    python scripts/bench_spec_rl_time.py --repeats 3 --noise 0.0

SmolLM2-135M-Instruct, 4 prompts x 4 rollouts x 32 tokens. Step 1 fills SPEC-RL's
draft cache; then each repeat times ``group.sample`` and ``spec_rl.sample`` on the
same prompts (fresh seeds). ``--noise`` adds Gaussian noise of that relative size to
every weight between the epochs (0: the policy did not move, the best case for
drafts). Prints seconds, tokens the engine decoded, and SPEC-RL's accept rate;
compare the two as ratios within a run (the machine may be shared).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--noise", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine
    from rlpost.samplers import SAMPLERS, SamplerContext

    torch.set_num_threads(1)
    cfg = compose_config(["model=smollm2-135m"])
    model, tok = load_policy(cfg.model)
    rng = random.Random(0)
    prompts = []
    for _ in range(4):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        msgs = [{"role": "system", "content": cfg.task.system_prompt}, {"role": "user", "content": f"What is {a} + {b}?"}]
        p = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        prompts.append(list(p["input_ids"]) if hasattr(p, "keys") else list(p))
    eng = HFRolloutEngine(model, tok)
    group, spec = SAMPLERS.get("group")(4), SAMPLERS.get("spec_rl")(4)
    idx = [0, 1, 2, 3]
    spec.sample(eng, prompts, SamplingParams(max_new_tokens=args.max_new_tokens, seed=1), SamplerContext(step=1, prompt_indices=idx))
    if args.noise > 0:
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for prm in model.parameters():
                prm.add_(args.noise * prm.abs().mean() * torch.randn(prm.shape, generator=g))
    print(f"# 4 prompts x 4 rollouts x {args.max_new_tokens} tokens, weight noise {args.noise}, one thread")
    print("| repeat | group s | group decoded | spec_rl s | spec_rl decoded | accept rate | rows with no decoding |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rep in range(args.repeats):
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, seed=100 + rep)
        t0 = time.perf_counter()
        r = group.sample(eng, prompts, sp, SamplerContext(step=2 + rep, prompt_indices=idx))
        tg = time.perf_counter() - t0
        t0 = time.perf_counter()
        s = spec.sample(eng, prompts, sp, SamplerContext(step=2 + rep, prompt_indices=idx))
        ts = time.perf_counter() - t0
        m = s.metrics
        print(f"| {rep} | {tg:.1f} | {r.generation.num_tokens} | {ts:.1f} | {m['sampler/generated_tokens']:.0f} | "
              f"{m['sampler/accept_rate']:.2f} | {m['sampler/full_reuse']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
