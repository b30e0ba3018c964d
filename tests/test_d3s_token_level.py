"""D3S token level wired into the loss: the mask, what it records, and which tokens get gradient."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_overrides, update_with_gradient  # noqa: E402
from ds_worker import make_batch  # noqa: E402

from rlpost.samplers.base import SAMPLERS  # noqa: E402
from rlpost.samplers.prune import apply_loss_token_mask, d3s_token_mask  # noqa: E402


def test_batch_scope_ranks_tokens_across_rows():
    # GRPO-style advantages: constant within a row, so only a pooled ranking lets |A| matter
    adv = torch.tensor([[2.0, 2.0, 2.0], [0.5, 0.5, 0.5]])
    ent = torch.tensor([[0.1, 0.3, 0.2], [1.0, 0.9, 0.1]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # |A|H = [[0.2, 0.6, 0.4], [0.5, 0.45, masked]]; 5 tokens, keep ceil(0.6 * 5) = 3: 0.6, 0.5, 0.45
    assert d3s_token_mask(adv, ent, mask, 0.6).tolist() == [[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    # per row: row 0 keeps ceil(1.8) = 2 (0.6, 0.4), row 1 keeps ceil(1.2) = 2 (0.5, 0.45)
    assert d3s_token_mask(adv, ent, mask, 0.6, scope="row").tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    assert d3s_token_mask(adv, ent, mask, 1.0).tolist() == mask.tolist()
    with pytest.raises(ValueError, match="scope"):
        d3s_token_mask(adv, ent, mask, 0.5, scope="group")


def _sampler(**kw):
    p = dict(keep_start=1.0, keep_end=1.0, schedule_steps=10, min_keep=2, token_keep_start=0.5, token_keep_end=1.0)
    p.update(kw)
    return SAMPLERS.get("d3s")(4, **p)


def test_apply_records_dropped_tokens_and_follows_the_curriculum():
    b = make_batch(B=4, R=6)
    b.extras["advantages"] = torch.tensor([1.0, -1.0, 0.5, 0.0])[:, None].expand(4, 6) * b.response_mask
    ent = torch.arange(24, dtype=torch.float32).view(4, 6) / 24
    before = b.response_mask.clone()
    s = _sampler()
    assert s.token_level and not _sampler(token_keep_start=1.0).token_level
    m = apply_loss_token_mask(s, b, ent, step=0)
    n = int(before.sum())
    assert m["sampler/tokens_dropped"] == n - int(b.response_mask.sum())
    assert int(b.response_mask.sum()) == -(-n // 2)  # ceil(0.5 n)
    assert torch.equal(b.extras["d3s_token_dropped"], before - b.response_mask)  # every token left out is recorded
    assert torch.equal(b.extras["response_attn"], before.long())  # ... and still attended to by the forward
    assert bool((b.response_mask <= before).all())  # a subset of the loss mask
    assert float(b.response_mask[3].sum()) == 0.0  # zero advantage: |A| H = 0, the first to go
    b2 = make_batch(B=4, R=6)
    b2.extras["advantages"] = b.extras["advantages"]
    m = apply_loss_token_mask(s, b2, ent, step=5)  # halfway: 0.75 of the tokens
    assert m["sampler/token_keep_ratio"] == pytest.approx(-(-3 * n // 4) / n)
    b3 = make_batch(B=4, R=6)
    b3.extras["advantages"] = b.extras["advantages"]
    assert apply_loss_token_mask(_sampler(token_keep_start=1.0), b3, ent, 0) == {}
    assert torch.equal(b3.response_mask, before) and "d3s_token_dropped" not in b3.extras
    with pytest.raises(ValueError, match="token_keep_start"):
        _sampler(token_keep_start=0.0)


def _grad(compose, batch):
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides("trainer.grad_clip=0", "algo.kl.coef=0", "algo.entropy_coef=0"))
    t = TorchTrainer.from_config(load_policy(ModelConfig(source="tiny"), seed=3)[0], cfg, "cpu")
    return update_with_gradient(t, copy.deepcopy(batch))[1]


def test_dropped_tokens_get_no_gradient(compose):
    b = make_batch(B=4, R=6)
    b.rollout_logprobs = b.rollout_logprobs * 0  # the loss only needs the ratio's denominator to be fixed
    b.extras["advantages"] = torch.tensor([1.0, -1.0, 0.5, 2.0])[:, None].expand(4, 6) * b.response_mask
    g = torch.Generator().manual_seed(0)
    apply_loss_token_mask(_sampler(), b, torch.rand(4, 6, generator=g), step=0)
    dropped = b.extras["d3s_token_dropped"] > 0
    kept = b.response_mask > 0
    assert int(dropped.sum()) > 0 and int(kept.sum()) > 0
    g0 = _grad(compose, b)
    # the forward still reads the dropped tokens: kept tokens' log-probs are those of the unmasked batch
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    t = TorchTrainer.from_config(load_policy(ModelConfig(source="tiny"), seed=3)[0], compose(tiny_overrides()), "cpu")
    full = copy.deepcopy(b)
    full.response_mask = b.extras["response_attn"].float()
    del full.extras["response_attn"]
    assert torch.allclose(t.compute_logprobs(b)[0][kept], t.compute_logprobs(full)[0][kept], atol=1e-6)
    # any advantage on a dropped token changes nothing ...
    b1 = copy.deepcopy(b)
    b1.extras["advantages"] = b.extras["advantages"].clone()
    b1.extras["advantages"][dropped] = 100.0
    assert torch.allclose(_grad(compose, b1), g0, atol=1e-7)
    # ... while one on a kept token does
    b2 = copy.deepcopy(b)
    b2.extras["advantages"] = b.extras["advantages"].clone()
    b2.extras["advantages"][kept] *= 3.0
    assert not torch.allclose(_grad(compose, b2), g0, atol=1e-5)


def test_run_applies_the_token_level(compose, tmp_path):
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("sampler=d3s", "sampler.params.token_keep_start=0.5", "sampler.params.schedule_steps=4",
                                 "steps=2"))
    train(cfg, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "sampler/token_keep_ratio" in r]
    assert len(rows) == 2
    # steps count from 1: 0.5 + 0.5 * 1/4 = 0.625, then 0.75 (up to the ceil of one token)
    assert rows[0]["sampler/token_keep_ratio"] == pytest.approx(0.625, abs=0.02)
    assert rows[1]["sampler/token_keep_ratio"] == pytest.approx(0.75, abs=0.02)
    assert rows[0]["sampler/tokens_dropped"] > 0
