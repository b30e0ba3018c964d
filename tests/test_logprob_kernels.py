"""The update's log-prob kernel against the plain dense computation: values, entropy, gradients.

Reference: ``model(prompt + response).logits`` at every position, log-softmax over the
vocabulary, gathered at the response tokens (what a reader would write first). The
kernel runs the LM head only on real response tokens (packed), shares each group's
prompt, skips the temperature pass at T=1 and builds the entropy without gradient
unless asked. Tolerance: 1e-5 absolute on log-probs and entropy, 1e-5 abs + 1e-4 rel on
gradients (fp32; differences are float summation order only).
"""

import pytest
import torch


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(5, 500, (2, 7), generator=g)
    pmask = torch.ones(2, 7, dtype=torch.long)
    prompts[1, :2], pmask[1, :2] = 0, 0  # left padding
    prompts, pmask = prompts.repeat_interleave(3, 0), pmask.repeat_interleave(3, 0)
    resp = torch.randint(5, 500, (6, 6), generator=g)
    rattn = torch.ones(6, 6, dtype=torch.long)
    rattn[2, 3:], resp[2, 3:] = 0, 0  # right padding
    rattn[4, 1:], resp[4, 1:] = 0, 0
    return prompts, pmask, resp, rattn


def dense_reference(model, prompts, pmask, resp, rattn, temperature):
    ids = torch.cat([prompts, resp], 1)
    attn = torch.cat([pmask, rattn], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
    P, R = prompts.shape[1], resp.shape[1]
    z = logits[:, P - 1 : P + R - 1] / temperature[..., None]
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, resp[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


@pytest.mark.parametrize("temp_kind", ["one", "scalar", "per_token"])
@pytest.mark.parametrize("chunk", [1, 64])
def test_kernel_equals_dense_reference(temp_kind, chunk):
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import response_logprobs

    model, _ = load_policy(ModelConfig(source="tiny"), seed=4)
    model.train()
    prompts, pmask, resp, rattn = _batch()
    T = {"one": torch.ones(6, 6), "scalar": torch.full((6, 6), 0.7),
         "per_token": torch.rand(6, 6, generator=torch.Generator().manual_seed(1)) + 0.5}[temp_kind]
    temperature = 0.7 if temp_kind == "scalar" else T
    m = rattn.float()
    res = {}
    for name in ("ref", "kernel"):
        model.zero_grad()
        if name == "ref":
            lp, ent = dense_reference(model, prompts, pmask, resp, rattn, T)
        else:
            lp, ent = response_logprobs(model, prompts, pmask, resp, rattn, temperature=temperature,
                                        chunk_size=chunk, entropy_grad=True)
        # a loss with both a log-prob term and an entropy bonus, so both gradients are compared
        loss = ((lp * torch.linspace(-1, 1, 36).view(6, 6) + 0.1 * ent) * m).sum() / m.sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        res[name] = (lp.detach() * m, ent.detach() * m, loss.detach(), grads)
    (lp0, e0, l0, g0), (lp1, e1, l1, g1) = res["ref"], res["kernel"]
    assert (lp1 - lp0).abs().max() < 1e-5
    # entropies sit near log(V) = 10.8 nats here, where fp32's spacing is 1e-6; the kernel sums the
    # vocabulary in another order than the dense reference, so a few ulps apart (1.1e-5 measured on one CPU)
    assert (e1 - e0).abs().max() < 1e-5 * max(1.0, float(e0.abs().max()) / 4)
    assert abs(float(l1 - l0)) < 1e-5
    assert torch.allclose(g1, g0, atol=1e-5, rtol=1e-4) and g0.abs().sum() > 0
    # padding positions are exactly zero
    lp_raw, _ = response_logprobs(model, prompts, pmask, resp, rattn, temperature=temperature, chunk_size=chunk)
    assert float(lp_raw.detach()[rattn == 0].abs().sum()) == 0.0


@pytest.mark.parametrize("temp_kind", ["one", "per_token"])
@pytest.mark.parametrize("chunk", [1, 64])
def test_fused_head_equals_autograd_graph(temp_kind, chunk):
    """The in-place log-prob head (``fused_head``) = autograd's graph of the same formula.

    chunk 1: several chunks, logits recomputed in backward; chunk 64: one chunk, logits kept.
    Tolerance: 1e-6 on log-probs and entropy, 1e-6 abs + 1e-5 rel on gradients (fp32; the
    backward evaluates the formula autograd does, ``g * (onehot - exp(z - lse))``).
    """
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import response_logprobs

    model, _ = load_policy(ModelConfig(source="tiny"), seed=6)
    model.train()
    prompts, pmask, resp, rattn = _batch(2)
    T = 1.0 if temp_kind == "one" else torch.rand(6, 6, generator=torch.Generator().manual_seed(2)) + 0.5
    m = rattn.float()
    res = {}
    for fused in (False, True):
        model.zero_grad()
        lp, ent = response_logprobs(model, prompts, pmask, resp, rattn, temperature=T, chunk_size=chunk,
                                    with_entropy=True, fused_head=fused)
        loss = (torch.exp(lp) * torch.linspace(-1, 1, 36).view(6, 6) * m).sum() / m.sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        res[fused] = (lp.detach(), ent, grads)
    (lp0, e0, g0), (lp1, e1, g1) = res[False], res[True]
    assert (lp1 - lp0).abs().max() < 1e-6 and (e1 - e0).abs().max() < 1e-6
    assert torch.allclose(g1, g0, atol=1e-6, rtol=1e-5) and g0.abs().sum() > 0
    assert float(lp1[rattn == 0].abs().sum()) == 0.0


def test_entropy_without_grad_adds_no_gradient_and_same_values():
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import response_logprobs

    model, _ = load_policy(ModelConfig(source="tiny"), seed=4)
    prompts, pmask, resp, rattn = _batch(1)
    lp_a, ent_a = response_logprobs(model, prompts, pmask, resp, rattn, with_entropy=True)
    lp_b, ent_b = response_logprobs(model, prompts, pmask, resp, rattn, entropy_grad=True)
    assert not ent_a.requires_grad and ent_b.requires_grad and lp_a.requires_grad
    assert torch.equal(ent_a, ent_b.detach()) and torch.equal(lp_a.detach(), lp_b.detach())
    _, none = response_logprobs(model, prompts, pmask, resp, rattn)
    assert none is None


def test_trainer_entropy_only_when_needed(compose):
    """entropy_coef -> with grad; needs_entropy loss -> constant; metric every trainer.entropy_every updates."""
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    model, _ = load_policy(ModelConfig(source="tiny"), seed=0)
    from conftest import tiny_overrides

    cfg = compose(tiny_overrides("trainer.entropy_every=2", "precision=fp32"))
    tr = TorchTrainer.from_config(model, cfg)
    tr.updates = 0
    assert tr._entropy_need() == (True, False)  # metric update
    tr.updates = 1
    assert tr._entropy_need() == (False, False)  # between metric updates: no entropy at all
    cfg.algo.entropy_coef = 0.01
    assert tr._entropy_need() == (True, True)
    cfg.algo.entropy_coef = 0.0
    cfg.algo.loss = "hapo"
    assert tr._entropy_need() == (True, False)


def test_hf_engine_dropping_finished_rows_changes_no_output_and_saves_rows():
    """Compacted decoding = the plain batched loop (same seed): tokens, log-probs, masks; fewer rows run.

    The work is counted as rows passed through the decoder (a forward hook), not timed.
    """
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.models.logprobs import response_logprobs
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine

    model, tok = load_policy(ModelConfig(source="tiny"), seed=3)
    prompts = [tok("What is 2+2?")["input_ids"], tok("Hi")["input_ids"], tok("Name a color")["input_ids"]] * 3
    res, counts = {}, {}
    for compact in (False, True):
        counts[compact] = 0

        def count(mod, args, kwargs, out, c=compact):
            ids = kwargs.get("input_ids")
            counts[c] += 0 if ids is None else ids.shape[0]

        hk = model.base_model.register_forward_hook(count, with_kwargs=True)
        eng = HFRolloutEngine(model, tok, batch_size=16, compact=compact)
        eng.eos_ids = set(range(0, model.config.vocab_size, 9))  # rows end at different steps
        res[compact] = eng.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.3, seed=7, stop=["blue"]))
        hk.remove()
    a, b = res[False], res[True]
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.finished, b.finished) and a.texts == b.texts
    assert (a.rollout_logprobs - b.rollout_logprobs).abs().max() < 1e-5
    lens = b.response_mask.sum(-1)
    assert lens.min() < lens.max(), "rows should finish at different steps for this test to bite"
    assert counts[True] < counts[False]
    # the engine's log-probs are those the trainer computes for the same tokens (fp32, same weights)
    with torch.no_grad():
        lp, _ = response_logprobs(model, b.prompt_ids, b.prompt_mask, b.response_ids, (b.response_mask > 0).long(),
                                  temperature=b.temperatures)
    assert ((lp - b.rollout_logprobs).abs() * b.response_mask).max() < 1e-4


def test_hf_engine_preallocated_kv_cache_gives_the_same_samples():
    """The in-place KV cache (``prealloc_cache``) = transformers' default cache: same tokens, masks, texts.

    Rows finish at different steps, so the dropped-row path (``batch_select_indices``) and the
    expansion of shared prompts to their group run too; a capacity smaller than the sequence
    exercises growing by doubling. Tolerance: 1e-6 on rollout log-probs (same keys and values;
    only the attention kernel's reading of a strided view may differ in summation order).
    """
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout.base import SamplingParams
    from rlpost.rollout.hf import HFRolloutEngine, preallocated_cache

    model, tok = load_policy(ModelConfig(source="tiny"), seed=5)
    prompts = [tok("What is 2+2?")["input_ids"], tok("Hi")["input_ids"], tok("Name a color")["input_ids"]] * 2
    res = {}
    for prealloc in (False, True):
        eng = HFRolloutEngine(model, tok, batch_size=16, prealloc_cache=prealloc)
        eng.eos_ids = set(range(0, model.config.vocab_size, 11))
        res[prealloc] = eng.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.2, seed=3))
    a, b = res[False], res[True]
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    assert a.texts == b.texts and torch.equal(a.finished, b.finished)
    assert (a.rollout_logprobs - b.rollout_logprobs).abs().max() < 1e-6
    lens = b.response_mask.sum(-1)
    assert lens.min() < lens.max()
    # the layer itself: in-place writes past a too-small capacity, then row selection
    cache = preallocated_cache(model, capacity=2)
    assert cache is not None and type(cache.layers[0]).__name__ == "PreallocatedLayer"
    k = torch.arange(2 * 1 * 5 * 3, dtype=torch.float32).view(2, 1, 5, 3)
    layer = cache.layers[0]
    layer.update(k[:, :, :3], -k[:, :, :3])
    keys, vals = layer.update(k[:, :, 3:], -k[:, :, 3:])
    assert torch.equal(keys, k) and torch.equal(vals, -k) and layer.get_seq_length() == 5
    layer.batch_select_indices(torch.tensor([1, 1, 0]))
    assert torch.equal(layer.keys, k[[1, 1, 0]]) and layer.get_seq_length() == 5


def test_bf16_rollout_copy_refreshes_in_place_to_the_cast_weights(compose):
    """sync_weights of a dtype-cast copy = a fresh cast of the updated policy, without a rebuild."""
    from conftest import tiny_overrides

    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine
    cfg = compose(tiny_overrides("precision=bf16"))
    policy, tok = load_policy(cfg.model, torch.float32, seed=0)
    eng = build_engine(EngineConfig.of(cfg), policy, tok, torch.device("cpu"))
    copy_before = eng.model
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    eng.sync_weights(policy)
    assert eng.model is copy_before  # refreshed in place
    fresh = {k: v.to(torch.bfloat16) for k, v in policy.state_dict().items()}
    for k, v in eng.model.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, fresh[k]), k


def test_eval_mode_restores_the_mode_also_when_the_block_raises():
    from rlpost.models.logprobs import eval_mode

    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    m.train()
    with eval_mode(m) as got:
        assert got is m and not m.training and not m[1].training
    assert m.training and m[1].training
    with pytest.raises(RuntimeError):
        with eval_mode(m):
            raise RuntimeError("scoring pass failed")
    assert m.training
    m.eval()
    with eval_mode(m):
        pass
    assert not m.training
