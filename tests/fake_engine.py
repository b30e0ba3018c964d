"""A tiny deterministic rollout engine for sampler/selector tests (no model)."""

from __future__ import annotations

from typing import Dict, List

import torch

from rlpost.rollout.base import GenerationResult, RolloutEngine, SamplingParams
from rlpost.rollout.hf import left_pad


class CharTok:
    """Token id k <-> character chr(ord('a') + k - 3); 0 pad, 1 eos, 2 '.'."""

    def decode(self, ids, skip_special_tokens=True):
        out = []
        for t in ids:
            t = int(t)
            if t in (0, 1):
                continue
            out.append("." if t == 2 else "1" if t == 3 else chr(ord("a") + t - 4))
        return "".join(out)

    def encode(self, text, add_special_tokens=False):
        return [3 if c == "1" else 2 if c == "." else ord(c) - ord("a") + 4 for c in text]


class FakeEngine(RolloutEngine):
    """Prompt ``[k, ...]`` answers correctly ("1...") with probability ``p[k]``.

    Responses have length ``resp_len`` (first token 3 = correct, else a letter),
    then EOS. Log-probs are ``-0.5`` per token. Records every generate call.
    """

    def __init__(self, p: Dict[int, float], resp_len: int = 6, model: torch.nn.Module | None = None):
        self.p = p
        self.resp_len = resp_len
        self.pad_id = 0
        self.tokenizer = CharTok()
        self.calls: List[List[List[int]]] = []
        self.model = model

    def generate(self, prompts, params: SamplingParams) -> GenerationResult:
        self.calls.append([list(x) for x in prompts])
        g = torch.Generator().manual_seed(int(params.seed or 0) + 31 * len(self.calls))
        B = len(prompts)
        L = min(self.resp_len, params.max_new_tokens)
        resp = torch.zeros(B, L, dtype=torch.long)
        mask = torch.zeros(B, L)
        for b, pr in enumerate(prompts):
            ok = torch.rand(1, generator=g).item() < self.p.get(pr[0], 0.0)
            toks = [3 if ok else 4] + torch.randint(4, 10, (max(0, L - 2),), generator=g).tolist() + [1]
            toks = toks[:L]
            resp[b, : len(toks)] = torch.tensor(toks)
            mask[b, : len(toks)] = 1
        ids, pmask = left_pad(prompts, 0)
        return GenerationResult(
            prompt_ids=ids, prompt_mask=pmask, response_ids=resp, response_mask=mask,
            rollout_logprobs=-0.5 * mask, temperatures=mask.clone(), finished=torch.ones(B, dtype=torch.bool),
            texts=[self.tokenizer.decode(r[m > 0].tolist()) for r, m in zip(resp, mask)],
        )

    def sync_weights(self, policy):
        pass


def correct(text: str) -> float:
    """Reward of the fake task: 1 when the response starts with '1'."""
    return 1.0 if text.startswith("1") else 0.0


def scorer(fn=None, calls=None):
    """The driver's scorer contract (``(indices, texts, lengths) -> Rewards``) around ``fn(indices, texts) -> floats``.

    ``fn`` defaults to :func:`correct` of each text; every call appends its
    number of texts to ``calls`` when given (to count scorings).
    """
    from rlpost.rewards import Rewards

    fn = fn or (lambda idx, texts: [correct(t) for t in texts])

    def score(idx, texts, lengths):
        assert len(idx) == len(texts) == len(lengths)
        if calls is not None:
            calls.append(len(texts))
        total = torch.tensor([float(x) for x in fn(list(idx), list(texts))], dtype=torch.float32)
        z = torch.zeros_like(total)
        return Rewards(total, {"correct": total, "format": z, "overlong": z, "length": z}, {}, z)

    return score


class EntropyModel(torch.nn.Module):
    """Fake causal LM whose next-token distribution is peaked except after token 7."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, position_ids=None, **_):
        B, T = input_ids.shape
        logits = torch.full((B, T, 12), -10.0)
        logits[..., 5] = 10.0
        logits[input_ids == 7] = 0.0  # uniform after a 7

        class O:
            pass

        o = O()
        o.logits = logits
        return o
