"""SPEC-RL (sampler=spec_rl): speculative acceptance is exact, and drafts save generated tokens."""

import itertools

import pytest
import torch

from rlpost.rollout.base import SamplingParams
from rlpost.rollout.hf import HFRolloutEngine
from rlpost.samplers import SAMPLERS, SamplerContext
from rlpost.samplers.speculative import response_distributions, speculative_verify

# chi-square 99.9% quantiles (scipy.stats.chi2.ppf(0.999, df))
CHI2_999 = {3: 16.27, 20: 45.31}


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = probs * n
    return float(((counts - exp) ** 2 / exp.clamp(min=1e-12)).sum())


def test_verify_hand_computed():
    # p = [0.5, 0.5], q = [0.9, 0.1]; draft token 0 is accepted with prob 0.5/0.9 = 0.556
    p = torch.tensor([[[0.5, 0.5]]])
    q = torch.tensor([[[0.9, 0.1]]])
    d = torch.tensor([[0]])
    n, nxt = speculative_verify(p, q, d, torch.tensor([1]), torch.tensor([[0.5]]), torch.tensor([0.3]))
    assert n.tolist() == [1] and nxt.tolist() == [-1]  # 0.5 < 0.556: accepted
    n, nxt = speculative_verify(p, q, d, torch.tensor([1]), torch.tensor([[0.6]]), torch.tensor([0.3]))
    # rejected; residual max(0, p - q) = [0, 0.4] -> token 1 whatever the uniform
    assert n.tolist() == [0] and nxt.tolist() == [1]
    # draft token 1: p/q = 5 -> always accepted; a row of length 0 accepts nothing and rejects nothing
    n, nxt = speculative_verify(p, q, torch.tensor([[1]]), torch.tensor([1]), torch.tensor([[0.999]]), torch.tensor([0.3]))
    assert n.tolist() == [1] and nxt.tolist() == [-1]
    n, nxt = speculative_verify(p, q, d, torch.tensor([0]), torch.tensor([[0.999]]), torch.tensor([0.3]))
    assert n.tolist() == [0] and nxt.tolist() == [-1]
    with pytest.raises(ValueError, match="lenience"):
        speculative_verify(p, q, d, torch.tensor([1]), torch.tensor([[0.5]]), torch.tensor([0.3]), lenience=0)


def test_verify_output_is_distributed_as_target():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q = torch.tensor([0.4, 0.3, 0.2, 0.1])
    N = 20000
    draft = torch.multinomial(q, N, replacement=True, generator=g)[:, None]
    P, Q = p.expand(N, 1, 4), q.expand(N, 1, 4)
    ua = torch.rand(N, 1, generator=g, dtype=torch.float64)
    ur = torch.rand(N, generator=g, dtype=torch.float64)
    n, nxt = speculative_verify(P, Q, draft, torch.ones(N, dtype=torch.long), ua, ur)
    out = torch.where(n == 1, draft[:, 0], nxt)
    counts = torch.bincount(out, minlength=4).double()
    assert chi2(counts, p.double()) < CHI2_999[3]
    # acceptance rate = sum min(p, q) = 0.1 + 0.2 + 0.2 + 0.1
    assert abs(float((n == 1).double().mean()) - 0.6) < 0.02
    # the test has power: accepting every draft (huge lenience) returns q, far from p
    n2, _ = speculative_verify(P, Q, draft, torch.ones(N, dtype=torch.long), ua, ur, lenience=1e9)
    assert bool((n2 == 1).all())
    assert chi2(torch.bincount(draft[:, 0], minlength=4).double(), p.double()) > 100 * CHI2_999[3]


class _Tok:
    """Minimal tokenizer for a 5-token vocabulary (0 = EOS)."""

    eos_token_id = 0
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) == 0))


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=5, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      eos_token_id=0, pad_token_id=0, bos_token_id=1)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a sharper random model, so the two policies differ clearly
        m.lm_head.weight.mul_(5.0)
    return m


def _exact_two_token(model, prompt):
    """Probability of every response of a 2-token budget: [0] or [a, b] (a != 0)."""
    outcomes = [(0,)] + [(a, b) for a, b in itertools.product(range(1, 5), range(5))]
    pid = torch.tensor([prompt])
    pm = torch.ones_like(pid)
    probs = []
    for o in outcomes:
        r = torch.tensor([list(o) + [0] * (2 - len(o))])
        d = response_distributions(model, pid, pm, r, torch.ones_like(r).float())
        pr = float(d[0, 0, o[0]]) * (float(d[0, 1, o[1]]) if len(o) == 2 else 1.0)
        probs.append(pr)
    return outcomes, torch.tensor(probs, dtype=torch.float64)


def test_spec_rl_rollouts_are_fresh_samples_of_the_current_policy():
    """Drafts from policy A verified under policy B give B's distribution of whole responses (tiny Llama, 5-token vocab)."""
    model = _tiny_llama(0)
    eng = HFRolloutEngine(model, _Tok(), batch_size=4096)
    prompt = [1, 2, 3]
    N = 2000
    s = SAMPLERS.get("spec_rl")(N)
    params = SamplingParams(max_new_tokens=2, seed=11)
    first = s.sample(eng, [prompt], params, SamplerContext(step=1, prompt_indices=[7]))
    assert first.metrics["sampler/draft_rows"] == 0 and first.metrics["sampler/generated_tokens"] == first.generation.num_tokens
    outcomes, q_exact = _exact_two_token(model, prompt)
    with torch.no_grad():  # the policy update between the epochs
        g = torch.Generator().manual_seed(3)
        for prm in model.parameters():
            prm.add_(0.05 * torch.randn(prm.shape, generator=g))
    _, p_exact = _exact_two_token(model, prompt)
    tv = 0.5 * float((p_exact - q_exact).abs().sum())
    assert tv > 0.1, tv  # the update changed the response distribution markedly
    second = s.sample(eng, [prompt], SamplingParams(max_new_tokens=2, seed=12), SamplerContext(step=2, prompt_indices=[7]))
    g2 = second.generation
    index = {o: k for k, o in enumerate(outcomes)}
    counts = torch.zeros(len(outcomes), dtype=torch.float64)
    for b in range(N):
        ids = tuple(g2.response_ids[b][g2.response_mask[b] > 0].tolist())
        counts[index[ids]] += 1
    keep = p_exact * N >= 5  # chi-square cells with enough expected counts; pool the rest
    c = torch.cat([counts[keep], counts[~keep].sum()[None]])
    pe = torch.cat([p_exact[keep], p_exact[~keep].sum()[None]])
    df = int(keep.sum())
    assert chi2(c, pe) < max(CHI2_999.get(df, 0), 2.0 * df + 6.0 * df ** 0.5), (chi2(c, pe), df)
    emp_tv = 0.5 * float((counts / N - p_exact).abs().sum())
    assert emp_tv < 0.05, emp_tv
    # the same test rejects the previous policy's distribution
    assert chi2(c, torch.cat([q_exact[keep], q_exact[~keep].sum()[None]])) > 5 * (2.0 * df + 6.0 * df ** 0.5)
    m = second.metrics
    assert m["sampler/draft_rows"] == N and m["sampler/accepted_tokens"] > 0.5 * m["sampler/draft_tokens"]
    # saved tokens: the engine decoded fewer tokens than the responses hold
    assert m["sampler/generated_tokens"] < g2.num_tokens - 0.3 * m["sampler/draft_tokens"]
    assert m["sampler/full_reuse"] > 0
    # rollout log-probs of the returned tokens are the current policy's
    pid = torch.tensor([prompt] * 8)
    d = response_distributions(model, pid, torch.ones_like(pid), g2.response_ids[:8], g2.response_mask[:8])
    lp = torch.log(d.gather(-1, g2.response_ids[:8, :, None]).squeeze(-1))
    msk = g2.response_mask[:8] > 0
    assert torch.allclose(lp[msk], g2.rollout_logprobs[:8][msk], atol=1e-4)


def test_spec_rl_params_and_engine_errors():
    from rlpost.core.errors import ConfigError
    from rlpost.samplers.base import build_sampler
    from omegaconf import OmegaConf

    with pytest.raises(ConfigError, match="lenience"):
        build_sampler(OmegaConf.create({"name": "spec_rl", "params": {"lenience": 0}}), 4)
    with pytest.raises(ConfigError, match="lenienc"):
        build_sampler(OmegaConf.create({"name": "spec_rl", "params": {"leniency": 1.0}}), 4)

    class NoModel:
        pass

    with pytest.raises(ValueError, match="rollout=hf"):
        SAMPLERS.get("spec_rl")(2).sample(NoModel(), [[1]], SamplingParams(), SamplerContext())


def test_spec_rl_cache_bound_and_state_round_trip():
    model = _tiny_llama(1)
    eng = HFRolloutEngine(model, _Tok())
    s = SAMPLERS.get("spec_rl")(4, max_cache_mb=1e-9)
    s.sample(eng, [[1, 2], [2, 3]], SamplingParams(max_new_tokens=3, seed=1), SamplerContext(step=1, prompt_indices=[0, 1]))
    assert len(s.cache) == 0  # nothing fits in the bound
    s = SAMPLERS.get("spec_rl")(4)
    s.sample(eng, [[1, 2], [2, 3]], SamplingParams(max_new_tokens=3, seed=1), SamplerContext(step=1, prompt_indices=[0, 1]))
    assert sorted(s.cache) == [0, 1] and len(s.cache[0]["drafts"]) == 4
    t = SAMPLERS.get("spec_rl")(4)
    t.load_state_dict(s.state_dict())
    assert sorted(t.cache) == [0, 1] and torch.equal(t.cache[1]["drafts"][2][1], s.cache[1]["drafts"][2][1])
