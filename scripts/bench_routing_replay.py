"""MoE routing replay against no replay on a tiny Qwen3-MoE: route drift and the training-inference gap.

Usage::

    python scripts/bench_routing_replay.py --steps 4 --mini-batches 4 --lr 1e-3

For each mode (``record``: routes recorded, the trainer routes on its own;
``replay``: the trainer's forwards use the rollout's experts; ``pr2``: the rollout
routes by PR2's predicted router, the trainer replays that), the same seeded
tiny random Qwen3-MoE (``model=tiny_moe``) runs ``steps`` rounds of: generate
``prompts x n`` rollouts with the ``hf`` engine, then one ``policy_update`` over
``mini_batches`` mini-batches (every mini-batch after the first is off-policy,
the case routing replay is for). The task reward of a random model is always 0,
so the advantages are fixed random numbers (seeded, the same in both modes): the
point is how far the weights move the routes, not what they learn. Prints per
mode the means over steps of ``moe/route_mismatch`` (share of token-layers whose
trainer top-k set differs from the rollout's), ``rollout/logprob_gap`` (mean
``|trainer log-prob - rollout log-prob|`` in the update forwards) and
``actor/ratio_max`` (largest importance ratio against the old log-probs, which are
computed once before the update as the runner does), and
``post-update mismatch``: after the update, the share of the batch's token-layers
whose recorded route differs from the updated routers' own top-k (the staleness
PR2's predictor aims at: its routes are predicted for the router one update ahead).
With ``--advantages fixed`` every step reuses one advantage vector per row
position, so the routers drift in a steady direction (the case PR2's predictor
models); ``random`` draws new ones each step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's rlpost


def run(mode: str, args) -> dict:
    import torch

    from rlpost.core.batch import RolloutBatch
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.models.moe_replay import attach_routing
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.rollout.base import SamplingParams
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose_config(["model=tiny_moe", f"model.routing_replay={mode}", f"algo.mini_batches={args.mini_batches}",
                          f"trainer.lr={args.lr}", "trainer.grad_clip=0", "algo.kl.coef=0", "precision=fp32",
                          f"trainer.micro_batch_size={args.prompts * args.n}", f"seed={args.seed}"])
    policy, tok = load_policy(cfg.model, seed=args.seed)
    t = TorchTrainer.from_config(policy, cfg, "cpu")
    eng = attach_routing(cfg.model, t, build_engine(EngineConfig.of(cfg), t.policy, tok, torch.device("cpu")))
    g = torch.Generator().manual_seed(args.seed)
    fixed = torch.randn(args.prompts * args.n, 1, generator=torch.Generator().manual_seed(args.seed + 1))
    out = {"moe/route_mismatch": [], "rollout/logprob_gap": [], "actor/ratio_max": [], "post": []}
    for step in range(args.steps):
        prompts = [[int(x) for x in torch.randint(10, 1000, (6,), generator=g)] for _ in range(args.prompts)]
        rows = [p for p in prompts for _ in range(args.n)]
        gen = eng.generate(rows, SamplingParams(max_new_tokens=args.max_new_tokens, seed=args.seed * 1000 + step))
        B, R = gen.response_ids.shape
        a = fixed if args.advantages == "fixed" else torch.randn(B, 1, generator=g)
        adv = a.expand(B, R) * gen.response_mask
        batch = RolloutBatch(
            prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, response_ids=gen.response_ids,
            response_mask=gen.response_mask, rollout_logprobs=gen.rollout_logprobs,
            group_index=torch.arange(B) // args.n, prompt_index=torch.arange(B) // args.n,
            policy_version=torch.zeros(B, dtype=torch.long), extras={"advantages": adv},
        )
        batch.extras["old_logprobs"] = t.compute_logprobs(batch)[0]  # as the runner does: the ratio moves off 1
        t.routing.metrics()  # that pass's stats are not the update's
        m = t.policy_update(batch, torch.Generator().manual_seed(step))
        rr, was = t.routing.rr, t.routing.mode
        t.routing.mode = "record"  # the updated routers route on their own; stats count disagreements
        rr.reset_stats()
        t.compute_logprobs(batch)
        m["post"] = rr.stats[0] / max(rr.stats[1], 1)
        t.routing.mode = was
        rr.reset_stats()
        t.routing.rows = [0, 0]
        for k in out:
            out[k].append(float(m.get(k, float("nan"))))
    return {k: sum(v) / len(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--mini-batches", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--advantages", choices=("random", "fixed"), default="random")
    ap.add_argument("--modes", nargs="+", default=["record", "replay", "pr2"])
    args = ap.parse_args()
    print(f"# tiny Qwen3-MoE (8 experts, top-2, 2 layers), {args.steps} steps x {args.prompts} prompts x n={args.n}, "
          f"{args.mini_batches} mini-batches, lr={args.lr}, {args.max_new_tokens} new tokens, seed={args.seed}, "
          f"{args.advantages} advantages")
    print("| model.routing_replay | moe/route_mismatch | post-update mismatch | rollout/logprob_gap | actor/ratio_max |")
    print("|---|---:|---:|---:|---:|")
    for mode in args.modes:
        r = run(mode, args)
        print(f"| {mode} | {r['moe/route_mismatch']:.3f} | {r['post']:.3f} | {r['rollout/logprob_gap']:.4f} | "
              f"{r['actor/ratio_max']:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
