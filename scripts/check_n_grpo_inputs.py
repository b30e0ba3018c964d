#!/usr/bin/env python
"""N-GRPO's round trip on the real model: the trainer's log-probs on the rollout's mixed input embeddings.

Loads the model of the config (default ``model=smollm2-135m``), samples 2 chat prompts x 4
responses of up to 40 tokens with ``sampler=neighbor_mixing`` (mix_top_k 2, cosine) through the
hf engine at each ``--rates`` value, and prints how far the trainer's log-probs
(:func:`rlpost.models.logprobs.response_logprobs`) are from the rollout's, (a) inside
:func:`rlpost.methods.n_grpo.mixed_inputs` (the run's passes) and (b) on the token ids alone (what
a trainer without the mixed inputs would score).

    python scripts/check_n_grpo_inputs.py [--rates 0.1 1.0] [overrides...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's rlpost, not an installed copy

QUESTIONS = ["What is 17 + 25?", "Name a prime above 50."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.1, 1.0], help="mix_rate values to sample at")
    args, overrides = ap.parse_known_args()

    from rlpost.config.compose import compose_config
    from rlpost.methods.n_grpo import mixed_inputs
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import response_logprobs
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine
    from rlpost.samplers.base import SamplerContext
    from rlpost.samplers.neighbor_mixing import NeighborMixingSampler

    cfg = compose_config(["model=smollm2-135m", *overrides])
    model, tok = load_policy(cfg.model, seed=0)
    engine = HFRolloutEngine(model, tok, batch_size=8, share_weights=True)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for q in QUESTIONS]
    for rate in args.rates:
        s = NeighborMixingSampler(4, mix_top_k=2, mix_rate=rate, neighbor_metric="cosine", stop_mixing_at="</think>")
        res = s.sample(engine, prompts, SamplingParams(max_new_tokens=40, seed=5), SamplerContext(step=1))
        g = res.generation
        m, attn = g.response_mask, (g.response_mask > 0).long()
        with torch.no_grad():
            with mixed_inputs(model, SimpleNamespace(response_ids=g.response_ids, extras=res.extras)):
                mixed, _ = response_logprobs(model, g.prompt_ids, g.prompt_mask, g.response_ids, attn)
            plain, _ = response_logprobs(model, g.prompt_ids, g.prompt_mask, g.response_ids, attn)
        n = m.sum()
        for name, lp in (("mixed inputs", mixed), ("token ids only", plain)):
            d = ((lp - g.rollout_logprobs) * m).abs()
            print(f"mix_rate={rate:<4} mixed positions {res.metrics['sampler/nm_mixed_fraction']:.3f}  "
                  f"{name:<14} |trainer - rollout log-prob| mean {float(d.sum() / n):.2e}  max {float(d.max()):.2e} nats")


if __name__ == "__main__":
    main()
