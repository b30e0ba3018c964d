"""N-GRPO (arXiv:2606.10768): neighbours and weights by hand, the decode hook's mixing rule, and the round trip:
the trainer's log-probs on the recorded mixed inputs equal the rollout's."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlpost.rollout.base import SamplingParams
from rlpost.samplers.base import SamplerContext, generate_groups
from rlpost.samplers.neighbor_mixing import (NeighborMixingSampler, mixed_embedding, mixing_weights,
                                             neighbour_ids)

# anchor 0 = (1, 0); by hand, k = 3 (anchor + 2):
#   cosine: row 1 (1.6, 0) is 1.0, row 2 (1.35, .35) .968, row 5 (3, 2) .832        -> [0, 1, 2]
#   dot:    row 5 3.0, row 1 1.6, row 2 1.35                                       -> [0, 5, 1]
#   l1:     row 1 .6, row 2 .7, rows 3 and 4 2, row 5 4                            -> [0, 1, 2]
#   l2^2:   row 2 .245, row 1 .36, rows 3 and 4 2, row 5 8                         -> [0, 2, 1]
E = torch.tensor([[1.0, 0.0], [1.6, 0.0], [1.35, 0.35], [0.0, 1.0], [-1.0, 0.0], [3.0, 2.0]])


@pytest.mark.parametrize("metric,expect", [("cosine", [0, 1, 2]), ("dot", [0, 5, 1]), ("l1", [0, 1, 2]),
                                           ("l2", [0, 2, 1])])
def test_neighbours_by_hand(metric, expect):
    assert neighbour_ids(E, torch.tensor([0]), 3, metric).tolist() == [expect]
    assert neighbour_ids(E, torch.tensor([0, 0]), 1, metric).tolist() == [[0], [0]]


def test_neighbours_reject_bad_arguments():
    with pytest.raises(ValueError, match="neighbor_metric"):
        neighbour_ids(E, torch.tensor([0]), 2, "jaccard")
    with pytest.raises(ValueError, match="mix_top_k"):
        neighbour_ids(E, torch.tensor([0]), 0, "cosine")


def test_weights_and_mixture_by_hand():
    p = torch.tensor([[0.5, 0.1, 0.3, 0.1, 0.0, 0.0]])
    logp = p.log()
    w = mixing_weights(logp, torch.tensor([[0, 1, 2]]))
    assert torch.allclose(w, torch.tensor([[0.5, 0.1, 0.3]]) / 0.9)
    assert mixing_weights(logp, torch.tensor([[0, 4]])).tolist() == [[1.0, 0.0]]  # outside top-p: weight 0
    emb = torch.nn.Embedding.from_pretrained(E)
    m = mixed_embedding(emb, torch.tensor([[1, 3]]), torch.tensor([[0.25, 0.75]]))
    assert torch.allclose(m, torch.tensor([[0.4, 0.75]]))  # .25 (1.6, 0) + .75 (0, 1)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding.from_pretrained(E)

    def get_input_embeddings(self):
        return self.emb


def _sampler(**kw):
    p = dict(mix_top_k=2, mix_rate=1.0, neighbor_metric="l2", stop_mixing_at="")
    p.update(kw)
    return NeighborMixingSampler(2, **p)


def test_hook_mixes_until_the_stop_marker():
    # a marker that tokenises to [3, 4]: row 0 writes 3 then 4 at t = 0, 1 and stops mixing from t = 1 on
    engine = SimpleNamespace(model=_Model(), tokenizer=SimpleNamespace(encode=lambda s, add_special_tokens: [3, 4]))
    hook, record = _sampler(stop_mixing_at="</think>").decode_hook(engine, seed=0)
    logp = torch.tensor([[0.6, 0.1, 0.2, 0.05, 0.05, 0.0]]).log().expand(2, -1)
    rows = torch.tensor([0, 1])
    for t, tok in enumerate([[3, 1], [4, 4], [1, 3]]):
        out_tok, embeds = hook(logp, torch.tensor(tok), rows, t)
        assert out_tok.tolist() == tok  # the recorded tokens are the sampled ones
        if t == 0:
            # anchor 0, its nearest in l2 is row 2; weights .6 / .8 and .2 / .8; both rows mix
            assert torch.allclose(embeds, (0.75 * E[0] + 0.25 * E[2]).expand(2, -1))
        if t == 1:  # row 0 completed the marker at t = 1: it feeds its own token, row 1 mixes
            assert torch.allclose(embeds[0], E[4]) and torch.allclose(embeds[1], 0.75 * E[0] + 0.25 * E[2])
    assert sorted(record) == [(0, 0), (1, 0), (1, 1), (1, 2)]
    ids, w = record[(1, 2)]
    assert ids.tolist() == [0, 2] and torch.allclose(w, torch.tensor([0.75, 0.25]))


def test_hook_never_mixes_at_rate_zero_and_draws_by_row_and_position():
    engine = SimpleNamespace(model=_Model(), tokenizer=None)
    hook, record = _sampler(mix_rate=0.0).decode_hook(engine, seed=0)
    logp = torch.full((2, 6), -math.log(6))
    assert hook(logp, torch.tensor([1, 2]), torch.tensor([0, 1]), 0)[1] is None and record == {}
    # rate 0.5: the same (row, t) decides the same whatever the batch holds
    a, rec_a = _sampler(mix_rate=0.5).decode_hook(engine, seed=7)
    b, rec_b = _sampler(mix_rate=0.5).decode_hook(engine, seed=7)
    for t in range(40):
        a(logp[:2], torch.tensor([1, 1]), torch.tensor([0, 1]), t)
        b(logp[:1], torch.tensor([1]), torch.tensor([1]), t)
    ones = sorted(t for (r, t) in rec_a if r == 1)
    assert ones == sorted(t for (r, t) in rec_b) and 5 < len(ones) < 35


def test_sampler_rejects_bad_parameters():
    with pytest.raises(ValueError, match="mix_rate"):
        _sampler(mix_rate=1.5)
    with pytest.raises(ValueError, match="mix_top_k"):
        _sampler(mix_top_k=0)
    with pytest.raises(ValueError, match="neighbor_metric"):
        _sampler(neighbor_metric="jaccard")


def test_engines_without_a_decode_hook_refuse_it():
    from rlpost.core.errors import ConfigError
    from rlpost.rollout.vllm import build_requests

    p = SamplingParams(decode_hook=lambda lp, tok, rows, t: (tok, None))
    with pytest.raises(ValueError, match="decode hook"):
        build_requests([[1, 2]], p)
    with pytest.raises(ConfigError, match="rollout=hf"):
        _sampler().sample(SimpleNamespace(model=None), [[1]], p, SamplerContext(step=1))


@pytest.fixture(scope="module")
def tiny():
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout.hf import HFRolloutEngine

    model, tok = load_policy(ModelConfig(source="tiny"), seed=0)
    return model, HFRolloutEngine(model, tok, batch_size=8, share_weights=True)


PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def _trainer_logprobs(model, gen, extras, share_prefix):
    from rlpost.methods.n_grpo import mixed_inputs
    from rlpost.models.logprobs import response_logprobs

    attn = (gen.response_mask > 0).long()
    with mixed_inputs(model, SimpleNamespace(response_ids=gen.response_ids, extras=extras)):
        return response_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.response_ids, attn,
                                 share_prefix=share_prefix)[0]


def test_trainer_scores_the_mixed_inputs_as_the_rollout_did(tiny):
    model, engine = tiny
    s = NeighborMixingSampler(4, mix_top_k=3, mix_rate=0.5, neighbor_metric="cosine", stop_mixing_at="")
    res = s.sample(engine, PROMPTS, SamplingParams(max_new_tokens=10, seed=3), SamplerContext(step=1))
    gen, m = res.generation, res.generation.response_mask
    mixed = res.extras["nm_mixed"]
    assert 0.2 < res.metrics["sampler/nm_mixed_fraction"] < 0.8 and float((mixed * (1 - m)).sum()) == 0
    assert torch.allclose(res.extras["nm_w0"] + res.extras["nm_w1"] + res.extras["nm_w2"], mixed, atol=1e-5)
    with torch.no_grad():
        for share in (True, False):
            lp = _trainer_logprobs(model, gen, res.extras, share)
            assert float(((lp - gen.rollout_logprobs) * m).abs().max()) < 1e-4
        plain = _trainer_logprobs(model, gen, {}, True)  # scored on the token ids: the mixed steps' successors differ
    assert float(((plain - gen.rollout_logprobs) * m).abs().max()) > 1e-2
    # the update's gradient reaches the embedding rows of the mixture's neighbours
    model.zero_grad()
    (_trainer_logprobs(model, gen, res.extras, True) * m).sum().backward()
    g = model.get_input_embeddings().weight.grad
    nb = res.extras["nm_id1"][mixed > 0]
    assert g is not None and float(g[nb].abs().sum()) > 0
    model.zero_grad()


def test_rate_zero_is_plain_group_sampling(tiny):
    _, engine = tiny
    p = SamplingParams(max_new_tokens=8, seed=11)
    s = NeighborMixingSampler(2, mix_top_k=2, mix_rate=0.0, neighbor_metric="cosine", stop_mixing_at="</think>")
    res = s.sample(engine, PROMPTS, p, SamplerContext(step=1))
    ref = generate_groups(engine, PROMPTS, [2, 2], p)
    assert torch.equal(res.generation.response_ids, ref.generation.response_ids)
    assert float(res.extras["nm_mixed"].sum()) == 0 and res.metrics["sampler/nm_mixed_fraction"] == 0.0


def test_config_needs_the_hf_engine():
    from rlpost.config.compose import compose_config, validate_config
    from rlpost.core.errors import ConfigError

    validate_config(compose_config(["+recipe=n_grpo", "model=tiny"]))
    with pytest.raises(ConfigError, match="rollout=hf"):
        validate_config(compose_config(["+recipe=n_grpo", "model=tiny", "rollout=vllm"]))
    with pytest.raises(ConfigError, match="rollout=hf"):
        validate_config(compose_config(["+recipe=n_grpo", "model=tiny", "rollout=hf_self_spec"]))
    with pytest.raises(ConfigError, match="mix_rat"):
        validate_config(compose_config(["+recipe=n_grpo", "model=tiny", "+sampler.params.mix_rat=0.2"]))


def test_recipe_one_step(tmp_path):
    import json

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["+recipe=n_grpo", "model=tiny", "steps=1", "logger=jsonl", "selector.prompts_per_step=2",
                          "rollout.max_new_tokens=8", "sampler.params.mix_rate=0.5", "eval.at_end=false",
                          "eval.at_start=false", "checkpoint.every=0"])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r = [r for r in rows if "reward/mean" in r][0]
    assert math.isfinite(r["loss/policy"]) and 0 < r["sampler/nm_mixed_fraction"] < 1
