"""Named papers' headline parameter values, the clip shorthand, and the messages of misspelt or badly typed
parameters of each component kind (moved unchanged from tests/test_params.py, whose registry-wide tests name no
method)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import rlpost.algos  # noqa: F401  (registers)
import rlpost.samplers  # noqa: F401
import rlpost.selectors  # noqa: F401
from rlpost.algos.validate import loss_kwargs
from rlpost.cli import app
from rlpost.config.compose import compose_config, validate_config
from rlpost.core.errors import ConfigError
from rlpost.core.registry import defaults_of
from test_params import REGISTRIES  # noqa: E402


PAPER_VALUES = {
    ("loss", "gspo"): {"eps_low": 3e-4, "eps_high": 4e-4},  # GSPO arXiv:2507.18071
    ("loss", "gmpo"): {"eps_low": 0.4, "eps_high": 0.4},  # GMPO arXiv:2507.20673
    ("loss", "ppo_clip"): {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None},  # PPO arXiv:1707.06347
    ("loss", "cispo"): {"eps_low": 1.0},  # CISPO arXiv:2506.13585: no lower bound
    ("loss", "sapo"): {"tau_pos": 1.0, "tau_neg": 1.05},  # SAPO arXiv:2511.20347
    ("loss", "clip_cov"): {"clip_cov_ratio": 2e-4, "cov_lb": 1.0, "cov_ub": 5.0, "eps_low": 0.2, "eps_high": 0.2},  # arXiv:2505.22617 + release
    ("loss", "kl_cov"): {"kl_cov_ratio": 2e-3, "kl_coef": 1.0},  # arXiv:2505.22617
    ("adv_estimator", "grpo"): {"norm_by_std": True},  # DeepSeekMath arXiv:2402.03300
    ("adv_estimator", "gpg"): {"norm_by_std": False},  # GPG arXiv:2504.02546: F_norm = 1
    ("adv_estimator", "gae"): {"gamma": 1.0, "lam": 0.95},  # InstructGPT PPO
    ("correction", "tis"): {"cap": 2.0},
}


@pytest.mark.parametrize("key", sorted(PAPER_VALUES))
def test_headline_paper_values(key):
    kind, name = key
    d = defaults_of(REGISTRIES[kind].params_of(name))
    for k, v in PAPER_VALUES[key].items():
        assert d[k] == v, (key, k)


def test_naming_gspo_alone_gives_the_papers_clip_and_cispo_its_own_bounds():
    cfg = compose_config(["algo.loss=gspo", "model=tiny"])
    validate_config(cfg)
    assert loss_kwargs(cfg.algo) == {"eps_low": 3e-4, "eps_high": 4e-4}
    cfg = compose_config(["algo.loss=cispo", "model=tiny"])
    assert loss_kwargs(cfg.algo) == {"eps_low": 1.0, "eps_high": 4.0}
    # DAPO's clip-higher is a ppo_clip parameter set by the preset; the rest stays PPO's
    cfg = compose_config(["algo=dapo", "model=tiny"])
    assert loss_kwargs(cfg.algo) == {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": None}


def test_algo_clip_is_shorthand_for_a_loss_that_declares_the_field():
    cfg = compose_config(["algo.loss=gspo", "algo.clip.eps_high=5e-4", "model=tiny"])
    assert loss_kwargs(cfg.algo) == {"eps_low": 3e-4, "eps_high": 5e-4}
    cfg = compose_config(["algo=sapo", "algo.clip.eps_high=0.3", "model=tiny"])
    with pytest.raises(ConfigError, match="algo.loss=sapo has no eps_high.*tau_pos, tau_neg"):
        validate_config(cfg)
    cfg = compose_config(["algo=dapo", "algo.clip.eps_high=0.3", "model=tiny"])
    with pytest.raises(ConfigError, match="set the same parameter"):
        validate_config(cfg)


MISSPELT = [
    ("loss", ["algo.loss=gspo", "+algo.loss_params.epss=1"], "eps_low (default 0.0003), eps_high (default 0.0004)"),
    ("adv_estimator", ["+algo.adv_params.norm_std=false"], "Did you mean 'norm_by_std'?"),
    ("correction", ["precision.correction=tis", "+precision.correction_params.capp=3"], "Did you mean 'cap'?"),
    ("selector", ["selector=dynamic_filter", "+selector.params.oversampel=2"], "Valid keys: oversample (default 1.5), max_rounds"),
    ("sampler", ["sampler=tree", "+sampler.params.n_rootz=2"], "Did you mean 'n_roots'?"),
]


@pytest.mark.parametrize("kind,args,needle", MISSPELT, ids=[m[0] for m in MISSPELT])
def test_misspelt_parameter_of_each_kind_exits_2_naming_the_valid_keys(kind, args, needle):
    res = CliRunner().invoke(app, ["config", "model=tiny", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "unknown parameter" in res.output
    assert "Traceback" not in res.output


def test_misspelt_kinds_cover_every_component_registry():
    assert {m[0] for m in MISSPELT} == set(REGISTRIES)


@pytest.mark.parametrize("args,needle", [
    (["algo.kl.estimator=k4"], "Invalid choice algo.kl.estimator='k4'. Valid choices: k1, k2, k3, k3_clamped."),
    (["algo.loss_agg=token_mean"], "Did you mean 'token-mean'?"),
    (["+algo.loss_params.ratio_level=seq", "algo.loss=gapo"], "valid choices are token, sequence"),
    (["algo.loss=gspo", "algo.loss_params.eps_low=wide"], "could not be converted to Float"),
])
def test_bad_choices_and_types_exit_2(args, needle):
    res = CliRunner().invoke(app, ["config", "model=tiny", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output


def test_a_preset_that_drops_a_default_keeps_its_effect():
    """hapo.yaml restates no temperature: the adaptive_temperature sampler it composes with carries HAPO's 0.05."""
    from rlpost.samplers import build_sampler

    cfg = compose_config(["algo=hapo", "model=tiny"])
    assert cfg.sampler.name == "adaptive_temperature"
    assert build_sampler(cfg.sampler, cfg.algo.n_samples_per_prompt).tau == 0.05


def test_config_prints_the_effective_parameters_below_the_yaml():
    res = CliRunner().invoke(app, ["config", "model=tiny", "algo.loss=gspo", "precision.correction=tis"])
    assert res.exit_code == 0, res.output
    assert "#   algo.loss=gspo: eps_low=0.0003, eps_high=0.0004" in res.output
    assert "#   precision.correction=tis: cap=2.0" in res.output
