"""Every algo preset runs two steps end to end on model=tiny, and is documented."""

import json
import math

import pytest
import yaml

from preset_configs import preset_config  # noqa: E402  (tests/preset_configs.py)
from rlpost.config.compose import compose_config, conf_dir, group_choices

PRESETS = group_choices("algo")


def component_overrides(name: str) -> list:
    """What the preset's estimator and loss declare a smoke run needs (``example_inputs`` overrides: e.g. a routed
    teacher per domain on a two-domain task)."""
    import torch

    from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES

    algo = preset_config(name).algo
    out = []
    for reg, key in ((ADV_ESTIMATORS, algo.adv_estimator), (POLICY_LOSSES, algo.loss)):
        out += [o for o in reg.example(str(key), torch.zeros(1, 1), torch.Generator())["overrides"] if o not in out]
    return out


def teacher_and_component_overrides(name: str) -> list:
    """The components' declared overrides, and a tiny ``model.teacher`` for a distillation preset that routes to no
    per-domain teachers (``model.teachers``)."""
    out = component_overrides(name)
    if uses_teacher_preset(name) and not any(o.startswith("model.teachers.") for o in out):
        out.append("model.teacher=tiny")
    return out


def uses_teacher_preset(name: str) -> bool:
    """Distillation presets need ``model.teacher`` (a tiny teacher here)."""
    from rlpost.algos.validate import uses_teacher

    return uses_teacher(preset_config(name).algo)


def episode_overrides(name: str) -> list:
    """Presets whose estimator matches turns across episodes (tag ``needs_episodes``) run on ``env=calculator``."""
    from rlpost.algos.registries import ADV_ESTIMATORS

    adv = str(preset_config(name).algo.adv_estimator)
    return ["env=calculator"] if ADV_ESTIMATORS.tag(adv, "needs_episodes", False) else []


def test_every_preset_names_its_paper_and_only_registered_parts():
    import rlpost.algos  # noqa: F401
    from rlpost.algos.registries import ADV_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES

    assert len(PRESETS) >= 24
    for name in PRESETS:
        raw = yaml.safe_load((conf_dir() / "algo" / f"{name}.yaml").read_text())
        assert raw["name"] == name
        # a reader can follow it: an arXiv paper, unless neither its loss nor its estimator has one
        cited = "arXiv:" in POLICY_LOSSES.entry(raw["loss"]).paper + ADV_ESTIMATORS.entry(raw["adv_estimator"]).paper
        assert "arXiv:" in raw["paper"] or not cited, (name, raw["paper"])
        assert raw["adv_estimator"] in ADV_ESTIMATORS and raw["loss"] in POLICY_LOSSES
        assert raw["loss_agg"] in LOSS_AGGS


@pytest.mark.parametrize("name", PRESETS)
def test_preset_two_steps_on_tiny(name, tmp_path):
    from rlpost.run.runner import train

    cfg = compose_config([
        f"algo={name}", "model=tiny", "steps=2", "logger=jsonl", "rollout.max_new_tokens=6",
        "selector.prompts_per_step=1", "eval.at_end=false", "checkpoint.every=0", "trainer.lr=1e-4",
        "eval.limit=4",  # the held-out evaluation at the start runs, on 4 problems (200 cost 3 s of each 4-s run)
    ] + teacher_and_component_overrides(name) + episode_overrides(name))
    train(cfg, tmp_path)
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines() if l.strip()]
    rows = [r for r in rows if "reward/mean" in r]
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["adv/mean"]), (name, r["adv/mean"])
        if r.get("actor/frozen_for_critic_warmup"):  # SAO's critic warm-up: no policy update this step
            assert "loss/policy" not in r, (name, sorted(r))
            continue
        for k in ("loss/policy", "actor/grad_norm", "actor/ratio_max", "actor/ratio_mean"):
            assert k in r, (name, k, sorted(r))  # every preset logs them (a missing key used to pass)
            assert math.isfinite(r[k]), (name, k, r[k])
        # one on-policy optimizer step per batch: trainer and rollout-time weights are equal, ratio is 1
        if cfg.algo.ppo_epochs * cfg.algo.mini_batches == 1:
            assert abs(r["actor/ratio_max"] - 1.0) < 1e-4, (name, r["actor/ratio_max"])
            assert abs(r["actor/ratio_mean"] - 1.0) < 1e-4
