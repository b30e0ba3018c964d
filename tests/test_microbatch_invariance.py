"""Micro-batch invariance through the trainer: the gradient and the logged loss of every registered loss, every
aggregation, every turn-reading loss on multi-turn rows and every sampler that records forward inputs do not
depend on ``trainer.micro_batch_size`` (statistics over "the batch" are over the whole mini-batch).

Generic: names no method; what a loss or sampler needs beyond the fixed batch is its registration's
``example_inputs`` (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_overrides, update_with_gradient  # noqa: E402
from ds_worker import make_batch  # noqa: E402

from rlpost.algos.registries import LOSS_AGGS, POLICY_LOSSES  # noqa: E402
from rlpost.config.schema import AlgoConfig  # noqa: E402
from rlpost.samplers import SAMPLERS  # noqa: E402

B = 8
_CACHE: dict = {}
MICRO = (1, 3, B)
#: the default loss of algo (AlgoConfig.loss), the one each aggregation and each sampler's record runs under
DEFAULT_LOSS = AlgoConfig().loss


@functools.lru_cache(maxsize=None)
def _config(loss: str, agg: str, sampler: str):
    """The composed config of one case, once for its three micro-batch sizes (Hydra's compose dominated the time);
    with the overrides the loss declares it needs (``example_inputs``: e.g. the one estimator it runs with)."""
    from rlpost.config.compose import compose_config

    own = POLICY_LOSSES.example(loss, torch.zeros(B, 6), torch.Generator().manual_seed(0))["overrides"]
    return compose_config(tiny_overrides(f"algo.loss={loss}", f"algo.loss_agg={agg}", "trainer.grad_clip=0",
                                         "algo.kl.coef=0", "algo.entropy_coef=0", *own,
                                         *([f"sampler={sampler}"] if sampler else [])))


def _run(compose, loss: str, agg: str, mb: int, multi_turn: bool = False, sampler: str = ""):
    """One policy_update on a fixed batch; returns (logged metrics, flat gradient before the step).

    ``multi_turn``: the masks get holes (environment tokens), so most rows hold two or three turns.
    ``sampler``: a sampler whose record the trainer reads (its declared ``example_inputs`` batch extras, e.g. mixed
    input embeddings); the rest of what the loss reads is its own declared example (``POLICY_LOSSES.example``)."""
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    g = torch.Generator().manual_seed(1)
    cfg = copy.deepcopy(_config(loss, agg, sampler))
    OmegaConf.update(cfg, "trainer.micro_batch_size", mb)
    if "model" not in _CACHE:
        _CACHE["model"] = load_policy(ModelConfig(source="tiny"), seed=3)[0]
    t = TorchTrainer.from_config(copy.deepcopy(_CACHE["model"]), cfg, "cpu")
    b = make_batch(B=B)
    # ragged masks including an empty response (its row counts in no denominator)
    b.response_mask[5] = 0
    if multi_turn:  # turn 1 | environment token | turn 2 (| environment token | turn 3)
        b.response_mask[:, 2] = 0
        b.response_mask[::2, 4] = 0
    if sampler:  # a third of the positions carry the sampler's recorded mixtures (masked to the response)
        rec = SAMPLERS.example(sampler, torch.zeros(b.response_mask.shape), torch.Generator().manual_seed(5))
        b.extras.update({k: v * b.response_mask if v.is_floating_point() else v
                         for k, v in rec["batch_extras"].items()})
    lp, _ = t.compute_logprobs(b)
    b.extras["old_logprobs"] = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * b.response_mask
    b.rollout_logprobs = (lp + 0.2 * torch.randn(lp.shape, generator=g)) * b.response_mask
    b.extras["segment_ids"] = (torch.arange(lp.shape[1]) // 3).expand(lp.shape).clone()  # subsentences
    ex = POLICY_LOSSES.example(loss, lp, torch.Generator().manual_seed(2))["batch_extras"]
    b.extras.update({k: v * b.response_mask if v.is_floating_point() and v.shape == lp.shape else v
                     for k, v in ex.items()})  # what the run's stages record for this loss (a reference, a teacher)
    torch.manual_seed(0)  # losses that draw tokens at random draw the same ones
    return update_with_gradient(t, b)


def _cases():
    """Every loss under seq-mean-token-sum (where the logged loss was most wrong) and every aggregation under the
    default loss: a loss's loss matrix does not depend on the aggregation, and the aggregation is applied by the
    trainer alike for every loss, so the cross product adds no catch (tests/test_algo_properties.py checks each
    loss's micro-batch sum and each aggregation's on the pure functions too)."""
    out = [pytest.param(loss, "seq-mean-token-sum", id=f"{loss}-seq-mean-token-sum") for loss in POLICY_LOSSES.names()]
    out += [pytest.param(DEFAULT_LOSS, agg, id=f"default-{agg}") for agg in LOSS_AGGS.names() if agg != "seq-mean-token-sum"]
    return out


@pytest.mark.parametrize("loss,agg", _cases())
def test_gradient_and_logged_loss_do_not_depend_on_micro_batch_size(compose, loss, agg):
    runs = {mb: _run(compose, loss, agg, mb) for mb in MICRO}
    m_full, g_full = runs[B]
    assert g_full.norm() > 0
    for mb in MICRO[:-1]:
        m, g = runs[mb]
        # absolute tolerance on the gradient's own scale: SPPO's eta = 1000 makes float32 noise ~1e-4 absolute, and
        # on AVX-512 CPUs fp32 matmuls block by batch size, so near-zero entries differ by up to 1.1e-5 of the largest
        # gradient between micro-batch sizes (measured on every loss); an aggregation bug moves entries by ~10%
        # (an entropy-clipped loss under seq-mean-token-sum measured 8.2e-5 off against 7.2e-5 on one AMD EPYC:
        # float32 summation order)
        atol = 1e-4 * max(1.0, float(g_full.abs().max()))
        assert torch.allclose(g, g_full, rtol=1e-4, atol=atol), (mb, (g - g_full).abs().max(), g_full.abs().max())
        for k, v in m_full.items():
            if k in ("actor/lr", "bench/update_forward_frac"):  # the work a split does, not the update
                continue
            assert m[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (mb, k, m[k], v)


def _assert_same_as_full_batch(runs):
    """Each micro-batch size's gradient and logged metrics equal the full batch's (``runs[B]``)."""
    m_full, g_full = runs[B]
    for mb in MICRO[:-1]:
        m, g = runs[mb]
        atol = 1e-4 * max(1.0, float(g_full.abs().max()))
        assert torch.allclose(g, g_full, rtol=1e-4, atol=atol), (mb, (g - g_full).abs().max())
        for k, v in m_full.items():
            if k not in ("actor/lr", "bench/update_forward_frac"):
                assert m[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (mb, k, m[k], v)


#: losses that read a row's turns (a ratio per turn or per sequence; tag sequence_level)
TURN_LOSSES = [e.name for e in POLICY_LOSSES if e.tags.get("sequence_level")]


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("loss", TURN_LOSSES)
def test_turn_and_sequence_ratio_losses_on_multi_turn_rows(compose, loss, agg):
    """A per-turn or per-sequence ratio (tag ``sequence_level``) on rows of two and three turns: the same gradient
    and logged loss with micro-batches of 1, 3 and 8 rows."""
    runs = {mb: _run(compose, loss, agg, mb, multi_turn=True) for mb in MICRO}
    _, g_full = runs[B]
    assert g_full.norm() > 0
    _assert_same_as_full_batch(runs)


#: samplers that record inputs the trainer's forward reads (declared ``example_inputs`` batch extras)
RECORDING_SAMPLERS = [e.name for e in SAMPLERS if e.example_inputs is not None]


@pytest.mark.parametrize("sampler", RECORDING_SAMPLERS)
def test_sampler_records_enter_every_micro_batch(compose, sampler):
    """A sampler's recorded inputs (mixed input embeddings) enter every micro-batch's forward (the gradient moves)
    and the gradient and logged loss do not depend on the micro-batch size."""
    runs = {mb: _run(compose, DEFAULT_LOSS, "token-mean", mb, sampler=sampler) for mb in MICRO}
    _, g_full = runs[B]
    _, g_plain = _run(compose, DEFAULT_LOSS, "token-mean", B)
    assert float((g_full - g_plain).abs().max()) > 1e-3 * float(g_full.abs().max())
    _assert_same_as_full_batch(runs)
