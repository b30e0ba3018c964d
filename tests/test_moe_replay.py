"""Routing replay on a tiny random Qwen3-MoE built from transformers' config."""

import pytest
import torch

from rlpost.models.logprobs import build_inputs
from rlpost.models.moe_replay import RoutingReplay, generate_with_routes, routes_mismatch
from rlpost.rollout.base import SamplingParams
from rlpost.rollout.hf import HFRolloutEngine


class _Tok:
    eos_token_id = 0
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) == 0))


def tiny_moe(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=16, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64,
                         eos_token_id=0, pad_token_id=0, bos_token_id=1, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(seed)
    m = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for r in m.modules():
            if type(r).__name__.endswith("TopKRouter"):
                r.weight.normal_(0, 0.5)
    return m


def trainer_forward(model, rr, gen, routes=None):
    """The trainer's full-sequence forward over prompt + response; returns (log-probs [B, R], routes used [B, P+R, L, k])."""
    ids, attn, pos = build_inputs(gen.prompt_ids, gen.prompt_mask, gen.response_ids, gen.response_mask)
    B, T = ids.shape
    ctx = rr.replay(routes.reshape(B * T, rr.n_layers, rr.k)) if routes is not None else torch.no_grad()
    with torch.no_grad(), rr.record(), ctx:
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    used = torch.stack([rr.calls[layer][0].view(B, T, rr.k) for layer in range(rr.n_layers)], dim=2)
    P = gen.prompt_ids.shape[1]
    lp = torch.log_softmax(logits[:, P - 1 : -1].float(), -1).gather(-1, gen.response_ids[..., None]).squeeze(-1)
    return lp, used


def _setup():
    model = tiny_moe()
    rr = RoutingReplay(model)
    eng = HFRolloutEngine(model, _Tok(), batch_size=5)  # two engine batches: offsets are exercised
    prompts = [[1, 2, 3], [4, 5], [1, 2, 3], [6, 7, 8, 9], [3, 3], [5, 1, 2], [2, 2, 2]]
    gen, routes = generate_with_routes(eng, rr, prompts, SamplingParams(max_new_tokens=8, seed=3))
    return model, rr, gen, routes


def test_recorded_routes_are_the_trainers_when_weights_agree():
    model, rr, gen, routes = _setup()
    assert routes.shape == (7, gen.prompt_ids.shape[1] + gen.response_ids.shape[1], 2, 2)
    # every real prompt token and every response token but the last was routed during the rollout
    P = gen.prompt_ids.shape[1]
    rec = (routes >= 0).all(-1).all(-1)
    assert bool(rec[:, :P][gen.prompt_mask > 0].all())
    n_resp = gen.response_mask.sum(-1).long()
    for b in range(7):
        assert bool(rec[b, P : P + int(n_resp[b]) - 1].all())
    lp, used = trainer_forward(model, rr, gen)
    assert routes_mismatch(routes, used) == 0.0  # the KV-cache rollout and the full forward route alike
    m = gen.response_mask > 0
    assert torch.allclose(lp[m], gen.rollout_logprobs[m], atol=1e-4)


def test_replay_makes_trainer_routes_identical_after_a_perturbation():
    model, rr, gen, routes = _setup()
    with torch.no_grad():  # the policy moved between the rollout and this (off-policy) update
        g = torch.Generator().manual_seed(1)
        for r in rr.routers:
            r.weight.add_(0.5 * torch.randn(r.weight.shape, generator=g))
    lp0, own = trainer_forward(model, rr, gen)
    lp1, replayed = trainer_forward(model, rr, gen, routes)
    assert routes_mismatch(routes, own) > 0.1  # without replay the experts differ
    assert routes_mismatch(routes, replayed) == 0.0  # with replay they are the rollout's, position by position
    rec = (routes >= 0).all(-1)
    assert torch.equal(replayed[rec], routes[rec])
    m = gen.response_mask > 0
    # replay brings the trainer's log-probs back towards the rollout's
    assert float((lp1 - gen.rollout_logprobs)[m].abs().mean()) < float((lp0 - gen.rollout_logprobs)[m].abs().mean())


def test_replay_keeps_router_gradients_and_checks_shapes():
    model, rr, gen, routes = _setup()
    ids, attn, pos = build_inputs(gen.prompt_ids, gen.prompt_mask, gen.response_ids, gen.response_mask)
    B, T = ids.shape
    with rr.replay(routes.reshape(B * T, 2, 2)):
        model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.sum().backward()
    assert all(r.weight.grad is not None and float(r.weight.grad.abs().sum()) > 0 for r in rr.routers)
    with pytest.raises(ValueError, match="routes must be"):
        with rr.replay(routes):
            pass
    with pytest.raises(ValueError, match="do not match"):
        with rr.replay(routes.reshape(B * T, 2, 2)[:5]), torch.no_grad():
            model(input_ids=ids, attention_mask=attn, position_ids=pos)
    from transformers import LlamaConfig, LlamaForCausalLM

    with pytest.raises(ValueError, match="no top-k MoE routers"):
        RoutingReplay(LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                                   num_attention_heads=2, num_key_value_heads=2)))
