"""HAPO (arXiv:2509.16591): the adaptive-temperature sampler that owns the per-token temperature, and the preset's
composition with it. Moved here from the generic sampler and pipeline files, which name no method."""

import pytest
import torch

from conftest import tiny_overrides
from fake_engine import FakeEngine
from rlpost.rollout.base import SamplingParams
from rlpost.samplers import SAMPLERS, SamplerContext


def make(name, n=8, **kw):
    return SAMPLERS.get(name)(n, **kw)


def test_adaptive_temperature_uses_hook_and_learns_stats():
    class Eng(FakeEngine):
        def generate(self, prompts, params):
            out = super().generate(prompts, params)
            T = []
            for t in range(out.response_ids.shape[1]):
                logits = torch.randn(len(prompts), 12, generator=torch.Generator().manual_seed(t)) * (1 + t)
                T.append(params.temperature_hook(logits, t))
            out.temperatures = torch.stack(T, 1) * out.response_mask
            return out

    eng = Eng({1: 0.5})
    s = make("adaptive_temperature", 4, tau=0.2)
    r1 = s.sample(eng, [[1]], SamplingParams(max_new_tokens=6, temperature=1.0, seed=1), SamplerContext())
    m = r1.generation.response_mask > 0
    assert torch.allclose(r1.generation.temperatures[m], torch.ones(int(m.sum())))  # no stats yet
    assert s.stats is not None
    r2 = s.sample(eng, [[1]], SamplingParams(max_new_tokens=6, temperature=1.0, seed=1), SamplerContext())
    t2 = r2.generation.temperatures[r2.generation.response_mask > 0]
    assert t2.min() < 1.0 < t2.max() and t2.min() >= 0.8 - 1e-6 and t2.max() <= 1.2 + 1e-6


def test_hapo_preset_composes_with_the_sampler_that_owns_per_token_temperature(compose):
    from rlpost.methods.hapo import check_sampler
    from rlpost.core.errors import ConfigError

    cfg = compose(tiny_overrides("algo=hapo"))
    assert cfg.sampler.name == "adaptive_temperature" and "temperature_tau" not in cfg.algo.loss_params
    check_sampler(cfg.algo, cfg.sampler.name)
    assert compose(tiny_overrides()).sampler.name == "group"  # the default preset keeps the default sampler
    bad = compose(tiny_overrides("algo=hapo", "sampler=tree"))  # a named sampler is kept, then refused
    with pytest.raises(ConfigError, match="sampler=adaptive_temperature"):
        check_sampler(bad.algo, bad.sampler.name)
