"""Rollout seconds and policy forwards of self-speculative rollouts against the plain hf engine.

Usage::

    python scripts/bench_self_spec.py --repeats 2 --max-new-tokens 48

SmolLM2-135M-Instruct, ``--prompts`` x ``--n`` rollouts (default 4 x 4; ``--prompts 1 --n 1`` is the
single-row tail the method targets), one thread. Each repeat generates the same prompts
with fresh seeds through the plain engine (``rollout=hf``) and through
:class:`rlpost.rollout.self_spec.SelfSpeculativeEngine` in each configuration of ``--configs``
(``drafter:switch_batch``). Prints seconds, tokens generated, policy forward calls (prefill
included), drafter forward calls and the accept rate. Compare as ratios within a run: the machine
may be shared. Speculative sampling is exact, so the token counts differ only by sampling noise.
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
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--configs", nargs="+", default=["int8:4", "int8:16", "fp8_sim:4"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4, help="rollouts per prompt")
    args = ap.parse_args()
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine
    from rlpost.rollout.precision import rollout_converter
    from rlpost.rollout.self_spec import SelfSpeculativeEngine

    torch.set_num_threads(1)
    cfg = compose_config(["model=smollm2-135m"])
    model, tok = load_policy(cfg.model)
    rng = random.Random(0)
    prompts = []
    for _ in range(args.prompts):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        msgs = [{"role": "system", "content": cfg.task.system_prompt}, {"role": "user", "content": f"What is {a} + {b}?"}]
        p = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        prompts.append(list(p["input_ids"]) if hasattr(p, "keys") else list(p))
    rows = [p for p in prompts for _ in range(args.n)]
    calls = {"n": 0}
    model.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    plain = HFRolloutEngine(model, tok, batch_size=64)
    engines = {}
    for c in args.configs:
        d, sb = c.split(":")
        engines[c] = SelfSpeculativeEngine(HFRolloutEngine(model, tok, batch_size=64), rollout_converter(d),
                                           switch_batch=int(sb))
    print(f"# {args.prompts} prompts x {args.n} rollouts x {args.max_new_tokens} tokens, SmolLM2-135M, one thread")
    print("| repeat | engine | rollout s | tokens | policy forwards | drafter forwards | accept rate | speculated rows |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for rep in range(args.repeats):
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, seed=100 + rep, temperature=1.0)
        calls["n"] = 0
        t0 = time.perf_counter()
        g = plain.generate(rows, sp)
        print(f"| {rep} | rollout=hf | {time.perf_counter() - t0:.1f} | {g.num_tokens} | {calls['n']} | - | - | - |", flush=True)
        for name, eng in engines.items():
            t0 = time.perf_counter()
            g = eng.generate(rows, sp)
            dt = time.perf_counter() - t0
            m = eng.pop_metrics()
            print(f"| {rep} | self_spec {name} | {dt:.1f} | {g.num_tokens} | {m['spec/target_forwards']:.0f} | "
                  f"{m['spec/draft_forwards']:.0f} | {m['spec/accept_rate']:.2f} | {m['spec/spec_rows']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
