"""Shared helpers of the speculative-rollout tests: a tiny random Llama, its exact response distribution, a
perturbed draft, and a chi-square test of sampled responses against it (moved unchanged from the bundle file
tests/test_rollout_self_spec_otr_hif4.py, split into tests/test_method_self_spec.py and siblings)."""

import torch


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = probs * n
    return float(((counts - exp) ** 2 / exp.clamp(min=1e-12)).sum())


def response_chi2(gen, keys, p_exact):
    """Chi-square of generated whole responses against an exact response distribution.

    Counts each row of ``gen`` (``response_ids`` / ``response_mask`` ``[N, T]``) in the bin of
    ``keys`` (tuples of token ids, aligned with ``p_exact`` ``[K]``); bins with expected count
    < 5 are pooled into one. Returns ``(stat, bound, pool)``: the statistic, a bound above the
    99.9% chi-square quantile for its degrees of freedom, and ``pool(q)`` mapping another exact
    distribution ``q`` ``[K]`` onto the same bins (for the power check ``chi2(counts, pool(q))``).
    """
    n = gen.response_ids.shape[0]
    index = {k: i for i, k in enumerate(keys)}
    counts = torch.zeros(len(keys), dtype=torch.float64)
    for b in range(n):
        counts[index[tuple(gen.response_ids[b][gen.response_mask[b] > 0].tolist())]] += 1
    keep = p_exact * n >= 5

    def pool(q):
        return torch.cat([q[keep], q[~keep].sum()[None]])

    df = int(keep.sum())
    bound = 2.0 * df + 6.0 * df ** 0.5  # above the 99.9% chi-square quantile for these df
    c = pool(counts)
    return chi2(c, pool(p_exact)), bound, lambda q: chi2(c, pool(q))


class _Tok:
    """Minimal tokenizer for a 5-token vocabulary (0 = EOS)."""

    eos_token_id = 0
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) == 0))


def _tiny_llama(seed: int, sharpen: float = 3.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=5, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      eos_token_id=0, pad_token_id=0, bos_token_id=1)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(sharpen)
    return m


def _perturb(scale: float):
    """A drafter 'quantiser' that moves every weight: a drafter clearly unlike the policy."""

    def convert(m):
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g))
        return m

    return convert


@torch.no_grad()
def _exact_dist(model, prompt, T):
    """Probability of every response of a T-token budget (EOS=0 ends a response)."""
    outs = {}

    def rec(prefix, prob):
        if len(prefix) == T or (prefix and prefix[-1] == 0):
            outs[tuple(prefix)] = prob
            return
        logits = model(input_ids=torch.tensor([prompt + prefix])).logits[0, -1]
        p = torch.softmax(logits.double(), -1)
        for a in range(5):
            rec(prefix + [a], prob * float(p[a]))

    rec([], 1.0)
    keys = sorted(outs)
    return keys, torch.tensor([outs[k] for k in keys], dtype=torch.float64)


