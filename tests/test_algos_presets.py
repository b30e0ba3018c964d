"""Every algo preset runs two steps end to end on model=tiny, and is documented."""

import json
import math

import pytest
import yaml

from rlpost.config.compose import compose_config, conf_dir, group_choices

PRESETS = group_choices("algo")


#: presets that route each prompt to its domain's teacher (model.teachers): a two-domain task, a tiny teacher each
ROUTED_TEACHERS = {"mopd": ["task=arithmetic_mix", "model.teachers.basic_arithmetic=tiny",
                            "model.teachers.chain_sum=tiny"]}


def uses_teacher_preset(name: str) -> bool:
    """Distillation presets need ``model.teacher`` (a tiny teacher here)."""
    from rlpost.algos.validate import uses_teacher

    return uses_teacher(compose_config([f"algo={name}"]).algo)


def episode_overrides(name: str) -> list:
    """Presets whose estimator matches turns across episodes (tag ``needs_episodes``) run on ``env=calculator``."""
    from rlpost.algos.registries import ADV_ESTIMATORS

    adv = str(compose_config([f"algo={name}"]).algo.adv_estimator)
    return ["env=calculator"] if ADV_ESTIMATORS.tag(adv, "needs_episodes", False) else []


def test_every_preset_names_its_paper_and_only_registered_parts():
    import rlpost.algos  # noqa: F401
    from rlpost.algos.registries import ADV_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES

    assert len(PRESETS) >= 24
    for name in PRESETS:
        raw = yaml.safe_load((conf_dir() / "algo" / f"{name}.yaml").read_text())
        assert raw["name"] == name
        assert "arXiv:" in raw["paper"] or name == "sft", (name, raw["paper"])  # a reader can follow it
        assert raw["adv_estimator"] in ADV_ESTIMATORS and raw["loss"] in POLICY_LOSSES
        assert raw["loss_agg"] in LOSS_AGGS


@pytest.mark.parametrize("name", PRESETS)
def test_preset_two_steps_on_tiny(name, tmp_path):
    from rlpost.run.runner import train

    cfg = compose_config([
        f"algo={name}", "model=tiny", "steps=2", "logger=jsonl", "rollout.max_new_tokens=6",
        "selector.prompts_per_step=1", "eval.at_end=false", "checkpoint.every=0", "trainer.lr=1e-4",
    ] + (ROUTED_TEACHERS.get(name) or (["model.teacher=tiny"] if uses_teacher_preset(name) else []))
      + episode_overrides(name))
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
