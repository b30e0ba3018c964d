#!/usr/bin/env python
"""Compare the update's log-prob kernel with another implementation on a real batch.

Loads the model of the config (default ``model=smollm2-135m``), samples 8 prompts x 4
responses of up to 32 tokens with the HF engine, and computes log-probs, entropy,
a GRPO-like loss and its gradient with (a) :func:`rlpost.models.logprobs.response_logprobs`
and (b) the dense reference (full logits, log-softmax) or, with ``--other FILE``, the
``response_logprobs`` of another copy of logprobs.py (e.g. a previous version).
Prints the largest absolute differences.

    python scripts/check_logprob_kernel.py [--other OLD_logprobs.py] [overrides...]
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

import sys  # noqa: E402
from pathlib import Path as _P  # noqa: E402

sys.path.insert(0, str(_P(__file__).resolve().parents[1]))  # this checkout's rlpost, not an installed copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", default=None, help="path of another logprobs.py to compare with")
    args, overrides = ap.parse_known_args()
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import response_logprobs
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine
    from rlpost.tasks import build_task

    cfg = compose_config(["precision=fp32", *overrides])
    model, tok = load_policy(cfg.model, torch.float32, seed=0)
    task = build_task(cfg.task)
    ex = task.train_examples()[:8]
    prompts = [task.render_prompt(e, tok) for e in ex]
    prompts = [p for p in prompts for _ in range(4)]
    gen = HFRolloutEngine(model, tok, 64).generate(prompts, SamplingParams(max_new_tokens=32, temperature=1.0, seed=1))
    attn = (gen.response_mask > 0).long()
    m = gen.response_mask.float()
    adv = torch.randn(m.shape[0], 1).expand_as(m)

    if args.other:
        spec = importlib.util.spec_from_file_location("other_logprobs", args.other)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        other = lambda: mod.response_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.response_ids, attn,  # noqa: E731
                                              temperature=gen.temperatures, with_entropy=True)
    else:
        def other():
            ids = torch.cat([gen.prompt_ids, gen.response_ids], 1)
            a = torch.cat([gen.prompt_mask, attn], 1)
            pos = (a.cumsum(-1) - 1).clamp(min=0)
            P, R = gen.prompt_ids.shape[1], gen.response_ids.shape[1]
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=a, position_ids=pos).logits[:, P - 1 : P + R - 1].float(), -1)
            return logp.gather(-1, gen.response_ids[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    new = lambda: response_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.response_ids, attn,  # noqa: E731
                                    temperature=gen.temperatures, with_entropy=True)
    res = {}
    model.train()
    for name, fn in (("other", other), ("new", new)):
        model.zero_grad()
        lp, ent = fn()
        loss = -(torch.exp(lp - lp.detach()) * adv * m).sum() / m.sum()
        loss.backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        res[name] = (lp.detach() * m, ent.detach() * m, loss.detach(), g)
    (a0, e0, l0, g0), (a1, e1, l1, g1) = res["other"], res["new"]
    print(f"tokens {int(m.sum())}  rows {m.shape[0]}")
    print(f"max |dlogprob| {float((a1 - a0).abs().max()):.3e}  max |dentropy| {float((e1 - e0).abs().max()):.3e}  "
          f"|dloss| {abs(float(l1 - l0)):.3e}")
    print(f"grad: max |d| {float((g1 - g0).abs().max()):.3e}  rel L2 {float((g1 - g0).norm() / g0.norm()):.3e}  "
          f"norm {float(g0.norm()):.4f}")
    print(f"rollout vs new log-probs: max |d| {float(((gen.rollout_logprobs - a1).abs() * m).max()):.3e}")


if __name__ == "__main__":
    main()
