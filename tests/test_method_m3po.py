"""M3PO (arXiv:2512.01485): the cross-path attention and hybrid thinking embedding by hand (Eqs. 2-6), the
thinking phase (paths that exit neither mix nor act as peers), config errors, and the round trip: the trainer's
log-probs on the recorded hybrid inputs equal the rollout's."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlpost.rollout.base import SamplingParams
from rlpost.samplers.base import SamplerContext, generate_groups
from rlpost.samplers.m3po import M3POSampler, cross_path_attention, hybrid_mixtures

# Three paths of one group, vocabulary of 4, embedding table of 3 rows in 2-d.
#   p_1 = (1, 0, 0, 0), p_2 = (.6, .8, 0, 0), p_3 = (0, 1, 0, 0): all of norm 1, so
#   S_12 = .6, S_13 = 0, S_23 = .8 (Eq. 3). With T = .5 (Eq. 5), e^1.2 = 3.320117, e^1.6 = 4.953032:
#   A_12 = 3.320117 / 4.320117 = .768521   A_13 = 1 / 4.320117 = .231479
#   A_21 = 3.320117 / 8.273149 = .401311   A_23 = 4.953032 / 8.273149 = .598689
#   A_31 = 1 / 5.953032 = .167982          A_32 = 4.953032 / 5.953032 = .832018
# Tokens x = (0, 1, 2), e_0 = (1, 0), e_1 = (0, 1), e_2 = (1, 1), lambda = .2 (Eq. 2, c_i of Eq. 6):
#   h_1 = .8 e_0 + .2 (A_12 e_1 + A_13 e_2) = (.8 + .2 * .231479, .2 * 1)        = (.846296, .2)
#   h_2 = .8 e_1 + .2 (A_21 e_0 + A_23 e_2) = (.2 * 1, .8 + .2 * .598689)        = (.2, .919738)
#   h_3 = .8 e_2 + .2 (A_31 e_0 + A_32 e_1) = (.8 + .2 * .167982, .8 + .2 * .832018) = (.833596, .966404)
P = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.6, 0.8, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
A_HAND = torch.tensor([[0.0, 0.768521, 0.231479], [0.401311, 0.0, 0.598689], [0.167982, 0.832018, 0.0]])
H_HAND = torch.tensor([[0.846296, 0.2], [0.2, 0.919738], [0.833596, 0.966404]])
E = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [3.0, -1.0], [0.5, 0.5], [-2.0, 2.0]])


def test_cross_path_attention_by_hand():
    A = cross_path_attention(P, 0.5)
    assert torch.allclose(A, A_HAND, atol=1e-5)
    assert torch.allclose(A.sum(-1), torch.ones(3))
    # a single path has no peer; T <= 0 is refused
    assert cross_path_attention(P[:1], 0.5).tolist() == [[0.0]]
    with pytest.raises(ValueError, match="temperature"):
        cross_path_attention(P, 0.0)


def test_hybrid_thinking_embedding_by_hand():
    from rlpost.samplers.input_mixing import mixed_embedding

    ids, w = hybrid_mixtures(P, torch.tensor([0, 1, 2]), 0.2, 0.5)
    assert ids.tolist() == [[0, 1, 2], [1, 0, 2], [2, 0, 1]]  # own token first, then the peers in group order
    assert torch.allclose(w[:, 0], torch.full((3,), 0.8)) and torch.allclose(w.sum(-1), torch.ones(3))
    emb = torch.nn.Embedding.from_pretrained(E)
    assert torch.allclose(mixed_embedding(emb, ids, w), H_HAND, atol=1e-5)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding.from_pretrained(E)

    def get_input_embeddings(self):
        return self.emb


def _engine(eos=(5,)):
    # id 4 decodes to "#", every other id to "a"
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "".join("#" if i == 4 else "a" for i in ids))
    return SimpleNamespace(model=_Model(), tokenizer=tok, eos_ids=set(eos), batch_size=64)


def _sampler(**kw):
    p = dict(mix_lambda=0.2, attn_temperature=0.5, think_end="")
    p.update(kw)
    return M3POSampler(3, **p)


def test_hook_feeds_the_hand_computed_mixtures_within_each_group():
    # rows 0-2: one group (the hand case); row 3: a group of one, which has no peer and is fed its own token
    hook, record = _sampler().decode_hook(_engine(), [3, 1])
    logp = torch.cat([P, torch.tensor([[0.0, 0.0, 1.0, 0.0]])]).log()
    tok = torch.tensor([0, 1, 2, 3])
    out_tok, embeds = hook(logp, tok, torch.arange(4), 0)
    assert out_tok.tolist() == [0, 1, 2, 3]  # the recorded tokens are the sampled ones
    assert torch.allclose(embeds[:3], H_HAND, atol=1e-5) and torch.equal(embeds[3], E[3])
    assert sorted(record) == [(0, 0), (1, 0), (2, 0)]
    ids, w = record[(1, 0)]
    assert ids.tolist() == [1, 0, 2] and torch.allclose(w, torch.tensor([0.8, 0.2 * 0.401311, 0.2 * 0.598689]))


def test_paths_leave_the_collaboration_when_they_stop_thinking():
    hook, record = _sampler(think_end="##").decode_hook(_engine(), [3])
    logp = P.log()
    rows = torch.arange(3)
    hook(logp, torch.tensor([4, 1, 2]), rows, 0)  # row 0 writes one "#": still thinking, all three mix
    assert sorted(record) == [(0, 0), (1, 0), (2, 0)]
    # t = 1: row 0 completes "##" and exits: it is fed its own token; rows 1 and 2 mix with each other only
    _, embeds = hook(logp, torch.tensor([4, 1, 2]), rows, 1)
    assert torch.equal(embeds[0], E[4])
    assert torch.allclose(embeds[1], 0.8 * E[1] + 0.2 * E[2]) and torch.allclose(embeds[2], 0.8 * E[2] + 0.2 * E[1])
    ids, w = record[(1, 1)]
    assert ids.tolist() == [1, 2, 1] and torch.allclose(w, torch.tensor([0.8, 0.2, 0.0]))  # padded to the group size
    # t = 2: row 1 ends (EOS 5); row 2 has no thinking peer left: nothing mixes
    assert hook(logp, torch.tensor([0, 5, 2]), rows, 2)[1] is None
    assert (0, 1) not in record and not any(t == 2 for (_, t) in record)


def test_lambda_zero_never_mixes():
    hook, record = _sampler(mix_lambda=0.0).decode_hook(_engine(), [3])
    assert hook(P.log(), torch.tensor([0, 1, 2]), torch.arange(3), 0)[1] is None and record == {}


def test_sampler_rejects_bad_parameters():
    with pytest.raises(ValueError, match="mix_lambda"):
        _sampler(mix_lambda=1.5)
    with pytest.raises(ValueError, match="attn_temperature"):
        _sampler(attn_temperature=0.0)


def test_groups_stay_whole_in_each_engine_call():
    from rlpost.core.errors import ConfigError

    s = _sampler()
    assert s._calls(SimpleNamespace(batch_size=8), [3, 3, 0, 2, 4]) == [[0, 1, 3], [4]]  # 3 + 3 + 2 rows fit in 8
    assert s._calls(SimpleNamespace(batch_size=8, inner=object()), [3, 3]) == [[0], [1]]  # data-parallel: one each
    with pytest.raises(ConfigError, match="rollout.batch_size"):
        s._calls(SimpleNamespace(batch_size=4), [3, 5])
    with pytest.raises(ConfigError, match="rollout=hf"):
        s.sample(SimpleNamespace(model=None), [[1]], SamplingParams(), SamplerContext(step=1))


@pytest.fixture(scope="module")
def tiny():
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout.hf import HFRolloutEngine

    model, tok = load_policy(ModelConfig(source="tiny"), seed=0)
    return model, tok


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]


def _trainer_logprobs(model, gen, extras, share_prefix):
    from rlpost.methods.base import METHODS
    from rlpost.models.logprobs import response_logprobs

    attn = (gen.response_mask > 0).long()
    method = METHODS.get("m3po")(cfg=None)  # the run's method: its Method.logprob_context around the pass
    with method.logprob_context(model, SimpleNamespace(response_ids=gen.response_ids, extras=extras)):
        return response_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.response_ids, attn,
                                 share_prefix=share_prefix)[0]


def test_trainer_scores_the_hybrid_inputs_as_the_rollout_did(tiny):
    from rlpost.rollout.hf import HFRolloutEngine

    model, tok = tiny
    engine = HFRolloutEngine(model, tok, batch_size=8, share_weights=True)  # 3 groups of 4: two engine calls
    s = M3POSampler(4, mix_lambda=0.3, attn_temperature=0.1, think_end="")
    res = s.sample(engine, PROMPTS, SamplingParams(max_new_tokens=10, seed=3), SamplerContext(step=1))
    gen, m = res.generation, res.generation.response_mask
    mixed = res.extras["m3po_mixed"]
    assert res.group_index.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert res.metrics["sampler/m3po_mixed_fraction"] > 0.5 and float((mixed * (1 - m)).sum()) == 0
    w = sum(res.extras[f"m3po_w{j}"] for j in range(4))
    assert torch.allclose(w, mixed, atol=1e-5) and torch.allclose(res.extras["m3po_w0"], 0.7 * mixed, atol=1e-6)
    # every weighted peer id is a token another path of the same group sampled at the same step
    for (r, t) in mixed.nonzero().tolist():
        g = r // 4
        peers = {int(gen.response_ids[q, t]) for q in range(4 * g, 4 * g + 4) if q != r}
        assert {int(res.extras[f"m3po_id{j}"][r, t]) for j in (1, 2, 3) if res.extras[f"m3po_w{j}"][r, t] > 0} <= peers
    with torch.no_grad():
        for share in (True, False):
            lp = _trainer_logprobs(model, gen, res.extras, share)
            assert float(((lp - gen.rollout_logprobs) * m).abs().max()) < 1e-4
        plain = _trainer_logprobs(model, gen, {}, True)  # on the token ids alone the successors of mixed steps differ
    assert float(((plain - gen.rollout_logprobs) * m).abs().max()) > 1e-2
    # the update's gradient reaches the embedding rows of the peers' tokens
    model.zero_grad()
    (_trainer_logprobs(model, gen, res.extras, True) * m).sum().backward()
    g = model.get_input_embeddings().weight.grad
    assert g is not None and float(g[res.extras["m3po_id1"][mixed > 0]].abs().sum()) > 0
    model.zero_grad()


def test_lambda_zero_is_plain_group_sampling_over_several_calls(tiny):
    from rlpost.rollout.hf import HFRolloutEngine

    model, tok = tiny
    p = SamplingParams(max_new_tokens=8, seed=11)
    s = M3POSampler(2, mix_lambda=0.0, attn_temperature=0.1, think_end="####")
    small = HFRolloutEngine(model, tok, batch_size=4, share_weights=True)  # groups of 2 -> calls [0, 1], [2]
    res = s.sample(small, PROMPTS, p, SamplerContext(step=1))
    ref = generate_groups(HFRolloutEngine(model, tok, batch_size=64, share_weights=True), PROMPTS, [2, 2, 2], p)
    assert torch.equal(res.generation.response_ids, ref.generation.response_ids)
    assert float(res.extras["m3po_mixed"].sum()) == 0 and res.metrics["sampler/m3po_mixed_fraction"] == 0.0


def test_config_errors():
    from rlpost.config.compose import compose_config, validate_config
    from rlpost.core.errors import ConfigError

    validate_config(compose_config(["+recipe=m3po", "model=tiny"]))
    with pytest.raises(ConfigError, match="rollout=hf"):
        validate_config(compose_config(["+recipe=m3po", "model=tiny", "rollout=vllm"]))
    with pytest.raises(ConfigError, match="rollout=hf"):
        validate_config(compose_config(["+recipe=m3po", "model=tiny", "rollout=hf_self_spec"]))
    with pytest.raises(ConfigError, match="mix_lamda"):
        validate_config(compose_config(["+recipe=m3po", "model=tiny", "+sampler.params.mix_lamda=0.2"]))


def test_recipe_one_step(tmp_path):
    import json

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["+recipe=m3po", "model=tiny", "steps=1", "logger=jsonl", "selector.prompts_per_step=2",
                          "algo.n_samples_per_prompt=4", "rollout.max_new_tokens=8", "eval.at_end=false",
                          "eval.at_start=false", "checkpoint.every=0"])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r = [r for r in rows if "reward/mean" in r][0]
    assert math.isfinite(r["loss/policy"]) and r["sampler/m3po_mixed_fraction"] > 0.5
    assert 0.25 <= r["sampler/m3po_top_peer_attention"] <= 1.0
