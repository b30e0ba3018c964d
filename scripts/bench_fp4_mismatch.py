"""Rollout-trainer log-prob gap of the simulated fp4 rollout copies on the real model.

Usage::

    python scripts/bench_fp4_mismatch.py --prompts 16 --max-new-tokens 32

Samples responses with the fp32 policy (SmolLM2-135M-Instruct, seed 0, the default
task's system prompt on 1-2 digit additions), then scores the same tokens with each
rollout converter (``precision.rollout_dtype``) and prints
:func:`rlpost.rollout.precision.mismatch_metrics` against the fp32 trainer: the
gap a rollout at that precision would bring into training.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtypes", nargs="*", default=["fp8_sim", "fp4_sim", "hif4_sim", "fp4_w4a4_sim", "fp4_w4a4_quads_sim",
                                                     "fp4_w4a4_resq_sim", "hif4_w4a4_sim", "hif4_w4a4_resq_sim"])
    ap.add_argument("--trainer-weight-quant", action="store_true",
                    help="also score each copy against a QUADS trainer (precision.trainer_weight_quant: the copy's "
                         "weight quantiser applied to the trainer's decoder weights, activations full precision)")
    args = ap.parse_args()
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import build_inputs
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine
    from rlpost.rollout.precision import mismatch_metrics, rollout_converter

    cfg = compose_config(["model=smollm2-135m"])
    model, tok = load_policy(cfg.model)
    model.eval()
    rng = random.Random(0)
    prompts = []
    for _ in range(args.prompts):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        msgs = [{"role": "system", "content": cfg.task.system_prompt}, {"role": "user", "content": f"What is {a} + {b}?"}]
        prompts.append(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    gen = HFRolloutEngine(model, tok).generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens, seed=0))
    ids, attn, pos = build_inputs(gen.prompt_ids, gen.prompt_mask, gen.response_ids, gen.response_mask)
    P = gen.prompt_ids.shape[1]

    def logprobs(m):
        with torch.no_grad():
            lg = m(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, P - 1 : -1].float()
        return torch.log_softmax(lg, -1).gather(-1, gen.response_ids[..., None]).squeeze(-1)

    ref = logprobs(model)
    print(f"# {args.prompts} prompts x {args.max_new_tokens} tokens, {int(gen.response_mask.sum())} response tokens; "
          "gap of each rollout copy against the fp32 trainer")
    quads_ref = {}
    if args.trainer_weight_quant:
        from rlpost.rollout.quads import attach_weight_fake_quant

        for fmt in ("fp4", "hif4"):
            t = copy.deepcopy(model)
            attach_weight_fake_quant(t, fmt)
            quads_ref[fmt] = logprobs(t)
            del t
    print("| rollout_dtype | mean abs log-prob gap | max | prob corr. | IS ESS share | s (forward) |"
          + (" gap vs QUADS trainer (weights quantised alike) |" if quads_ref else ""))
    print("|---|---:|---:|---:|---:|---:|" + ("---:|" if quads_ref else ""))
    for d in args.dtypes:
        c = rollout_converter(d)(copy.deepcopy(model))
        t0 = time.perf_counter()
        lp = logprobs(c)
        dt = time.perf_counter() - t0
        m = mismatch_metrics(lp, ref, gen.response_mask)
        fmt = d.split("_")[0]
        extra = ""
        if quads_ref:
            extra = (f" {mismatch_metrics(lp, quads_ref[fmt], gen.response_mask)['mismatch/logprob_abs_mean']:.4f} |"
                     if fmt in quads_ref else " - |")
        print(f"| {d} | {m['mismatch/logprob_abs_mean']:.4f} | {m['mismatch/logprob_abs_max']:.3f} | "
              f"{m['mismatch/prob_corr']:.4f} | {m['mismatch/is_ess_frac']:.3f} | {dt:.1f} |{extra}", flush=True)
        del c


if __name__ == "__main__":
    main()
