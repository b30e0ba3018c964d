"""Bebop's e2e TV loss against cross-entropy for an MTP draft head on a frozen policy (CPU, tiny model).

    python scripts/bench_mtp_head.py [--model tiny|smollm2-135m] [--depth 3] [--steps 300] [--seeds 3]
                                     [--save PATH [--save-loss tv|ce]]

Trains the same :class:`rlpost.rollout.mtp_draft.MTPDraftHead` twice per seed (loss=tv and loss=ce) on
the policy's own samples, and prints the per-depth acceptance ``1 - TV`` and the expected accepted drafts
per round on held-out samples. Prints figures only; nothing is asserted.

``--save PATH`` writes seed 0's head of ``--save-loss`` (default tv) as a head file
(:func:`rlpost.rollout.mtp_draft.save_mtp_head`) for ``rollout=hf_mtp
rollout.speculative.mtp_head_path=PATH``. Its training sequences start from random tokens, not
the task's prompts; a training run with ``rollout=hf_mtp`` fits (and saves) a head on the task's
own prompts instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.rollout.mtp_draft import MTPDraftHead, acceptance_of_head, mtp_training_pairs, save_mtp_head, train_mtp_head

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--len", type=int, default=24)
    ap.add_argument("--save", default=None, help="write seed 0's head of --save-loss here (a head file)")
    ap.add_argument("--save-loss", default="tv", choices=["tv", "ce"])
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = compose_config([f"model={a.model}", "logger=none", "precision=fp32"])
    policy, tok = load_policy(cfg.model)
    policy.requires_grad_(False).eval()
    g = torch.Generator().manual_seed(0)
    V = policy.config.vocab_size

    def samples(n, seed):
        torch.manual_seed(seed)
        start = torch.randint(0, V, (n, 1), generator=g)
        with torch.no_grad():
            return policy.generate(start, attention_mask=torch.ones_like(start), do_sample=True, max_new_tokens=a.len - 1,
                                   min_new_tokens=a.len - 1, pad_token_id=0)

    train, test = samples(a.rows, 0), samples(a.rows, 1)
    tr, te = mtp_training_pairs(policy, train, a.depth), mtp_training_pairs(policy, test, a.depth)
    print(f"model={a.model} depth={a.depth} steps={a.steps} train pairs={tr[0].shape[0]} test pairs={te[0].shape[0]}")
    print("| seed | loss | " + " | ".join(f"1-TV d{k + 1}" for k in range(a.depth)) + " | E[accepted]/round |")
    print("|---|---|" + "---:|" * (a.depth + 1))
    for s in range(a.seeds):
        for loss in ("untrained", "ce", "tv"):
            torch.manual_seed(100 + s)
            head = MTPDraftHead(policy)
            if loss != "untrained":
                train_mtp_head(head, *tr, steps=a.steps, lr=3e-3, loss=loss)
            r = acceptance_of_head(head, *te)
            print(f"| {s} | {loss} | " + " | ".join(f"{r[f'accept_d{k + 1}']:.3f}" for k in range(a.depth))
                  + f" | {r['expected_accepted']:.3f} |")
            if a.save and s == 0 and loss == a.save_loss:
                meta = {**r, "loss": loss, "depth": a.depth, "steps": a.steps, "lr": 3e-3, "model": a.model}
                print(f"saved {save_mtp_head(a.save, head, meta)} (rollout.speculative.mtp_head_path={a.save})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
