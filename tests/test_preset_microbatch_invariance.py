"""Micro-batch invariance of every algorithm preset as composed (its estimator settings, loss, aggregation,
entropy and clip settings, its methods' forward passes): one update's gradient on a fixed batch of 8 ragged
rows is the same with ``trainer.micro_batch_size`` 1 and 8, on-policy and off-policy, up to fp32 noise.

Measured on this code: every preset within 3e-6 relative (fp32 rounding of different matmul shapes); the
bound 1e-4 still catches a split-dependent statistic, which moved the gradient by ~1e-3 relative.

Generic: names no method. What a preset's components need (a routed teacher per domain, a teacher's record) is
their registration's ``example_inputs``; what its methods record from the old policy (an anchor's top-K support,
entropy statistics, the old entropy) comes from their own ``after_old_logprobs`` hooks, run as in a step.
"""

from __future__ import annotations

import copy
import functools
import random
import sys
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_overrides, update_with_gradient  # noqa: E402
from ds_worker import make_batch  # noqa: E402

from rlpost.config.paths import group_choices  # noqa: E402

_MODEL: dict = {}


@functools.lru_cache(maxsize=None)
def _preset_config(preset: str):
    """``algo=preset`` on the tiny model in fp32, composed once per preset (Hydra's compose was 87% of this file's
    time), plus what its components declare they need (``example_inputs`` overrides, e.g. a routed teacher per
    domain) and an environment for an estimator that matches turns across episodes (tag ``needs_episodes``;
    refused on single-turn rows). The estimator and loss are read from the preset's YAML."""
    from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
    from rlpost.config.compose import compose_config, conf_dir

    raw = yaml.safe_load((conf_dir() / "algo" / f"{preset}.yaml").read_text())
    extra = []
    for reg, key in ((ADV_ESTIMATORS, raw["adv_estimator"]), (POLICY_LOSSES, raw["loss"])):
        extra += [o for o in reg.example(key, torch.zeros(1, 1), torch.Generator())["overrides"] if o not in extra]
    if ADV_ESTIMATORS.tag(raw["adv_estimator"], "needs_episodes", False):
        extra.append("env=calculator")
    return compose_config(tiny_overrides(f"algo={preset}", "precision=fp32", *extra))


def _config(preset: str, mb: int):
    """The preset's composed config with micro-batches of ``mb`` rows (a copy)."""
    cfg = copy.deepcopy(_preset_config(preset))
    OmegaConf.update(cfg, "trainer.micro_batch_size", mb)
    return cfg


def _run_services(cfg, t):
    """The part of the run a method's ``after_old_logprobs`` hook reads: the trainer's no-grad passes."""
    from types import SimpleNamespace

    return SimpleNamespace(cfg=cfg, forward_pass=t.forward_pass, policy=t.policy, rows_pass=lambda b, fn: fn(b),
                           logprobs=lambda b, which="policy", with_entropy=False: t.compute_logprobs(b, which, with_entropy))


def _update(preset: str, mb: int, off_policy: bool):
    """``(metrics, flat gradient)`` of one update of ``algo=preset`` with micro-batches of ``mb`` rows."""
    from rlpost.algos.registries import POLICY_LOSSES
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = _config(preset, mb)
    if "m" not in _MODEL:
        _MODEL["m"] = load_policy(ModelConfig(source="tiny"), seed=3)[0]
    t = TorchTrainer.from_config(copy.deepcopy(_MODEL["m"]), cfg, "cpu")
    b = make_batch(B=8)
    b.response_mask[5] = 0  # an empty response: it counts in no denominator
    lp, _ = t.compute_logprobs(b)
    g = torch.Generator().manual_seed(1)
    b.rollout_logprobs = lp * b.response_mask
    if off_policy:
        b.extras["old_logprobs"] = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * b.response_mask
        b.rollout_logprobs = (lp + 0.2 * torch.randn(lp.shape, generator=g)) * b.response_mask
    b.extras["segment_ids"] = (torch.arange(lp.shape[1]) // 3).expand(lp.shape).clone()
    if t.has_ref:
        b.extras["ref_logprobs"] = t.compute_logprobs(b, "ref")[0]
    # what the run's stages record for the loss (a self-teacher, a routed teacher's weights, a top-K support)
    ex = POLICY_LOSSES.example(str(cfg.algo.loss), lp, torch.Generator().manual_seed(2))["batch_extras"]
    b.extras.update({k: v * b.response_mask if v.is_floating_point() and v.shape == lp.shape else v
                     for k, v in ex.items() if not (k == "ref_logprobs" and t.has_ref)})
    # the preset's methods record what they read from the old policy (an anchor's support, entropy statistics)
    t.methods.after_old_logprobs(b, _run_services(cfg, t))
    torch.manual_seed(0)  # losses that draw tokens at random draw the same ones
    return update_with_gradient(t, b)


#: every preset off-policy (old, rollout and current log-probs all differ: ratios away from 1, clips that bind),
#: and a fixed-seed sample of 16 on-policy (ratio 1 exactly): the on-policy case is the off-policy one with the
#: perturbations at zero, so a full second grid bought no catch (docs/TESTING.md, "What changed the time")
_PRESETS = group_choices("algo")
CASES = ([pytest.param(p, True, id=f"{p}-off_policy") for p in _PRESETS]
         + [pytest.param(p, False, id=f"{p}-on_policy") for p in sorted(random.Random(0).sample(_PRESETS, 16))])


@pytest.mark.parametrize("preset,off_policy", CASES)
def test_preset_gradient_does_not_depend_on_micro_batch_size(preset, off_policy):
    _, g1 = _update(preset, 1, off_policy)
    _, g8 = _update(preset, 8, off_policy)
    assert g8.norm() > 0, preset
    rel = float((g1 - g8).norm() / g8.norm())
    assert rel < 1e-4, f"algo={preset}: micro_batch_size 1 vs 8 gradients differ by {rel:.2e} relative"
