"""Config-time validation of algorithm combinations by hand (a sample of every estimator x loss x aggregation
combination runs in tests/test_algo_properties.py)."""

import pytest
from omegaconf import OmegaConf

from rlpost.algos.validate import validate_algo, validate_correction
from rlpost.config.schema import AlgoConfig
from rlpost.core.errors import ConfigError


def algo(**kw):
    cfg = OmegaConf.structured(AlgoConfig)
    for k, v in kw.items():
        OmegaConf.update(cfg, k, v, merge=True)
    return cfg


def test_gae_without_critic_fails_clearly():
    with pytest.raises(ConfigError, match="algo.critic.enabled"):
        validate_algo(algo(adv_estimator="gae"))
    validate_algo(algo(adv_estimator="gae", **{"critic.enabled": True}))


def test_group_baseline_needs_a_group():
    with pytest.raises(ConfigError, match="n_samples_per_prompt >= 2"):
        validate_algo(algo(adv_estimator="rloo", n_samples_per_prompt=1))
    with pytest.raises(ConfigError, match="odd"):
        validate_algo(algo(adv_estimator="mc_grpo", n_samples_per_prompt=4))
    validate_algo(algo(adv_estimator="mc_grpo", n_samples_per_prompt=5))
    validate_algo(algo(adv_estimator="mssr", n_samples_per_prompt=1))


def test_kl_in_reward_needs_an_estimator_that_reads_token_rewards():
    with pytest.raises(ConfigError, match="in_reward"):
        validate_algo(algo(adv_estimator="grpo", **{"kl.coef": 0.1, "kl.in_reward": True}))
    validate_algo(algo(adv_estimator="reinforce_pp", **{"kl.coef": 0.1, "kl.in_reward": True}))


def test_unknown_names_and_params_list_choices():
    with pytest.raises(ConfigError, match="Valid choices"):
        validate_algo(algo(loss="ppo_clipp"))
    # a closed choice is an enum of the schema: the structured config itself rejects it
    from omegaconf.errors import ValidationError

    with pytest.raises(ValidationError, match="expected one of .*token-mean"):
        validate_algo(algo(loss_agg="mean"))
    with pytest.raises(ConfigError, match="tau_pos"):
        validate_algo(algo(loss="sapo", loss_params={"tau": 1.0}))
    with pytest.raises(ConfigError, match="norm_by_std"):
        validate_algo(algo(adv_estimator="grpo", adv_params={"norm_std": False}))
    validate_algo(algo(adv_estimator="grpo", adv_params={"overlong_buffer": 4, "max_len": 16}))


def test_trainer_keys_of_loss_params_are_accepted_for_any_loss_and_range_checked():
    # A-3PO's proximal policy and VCPO's lr scaling are read by the trainer, whatever the loss
    for loss in ("ppo_clip", "decoupled_ppo", "cispo"):
        validate_algo(algo(loss=loss, loss_params={"proximal": "a3po", "vcpo_lr": True, "vcpo_power": 0.5,
                                                   "vcpo_min_scale": 0.2}))
    with pytest.raises(ConfigError, match="proximal='a3p0'.*recompute, a3po"):
        validate_algo(algo(loss_params={"proximal": "a3p0"}))
    with pytest.raises(ConfigError, match="vcpo_power"):
        validate_algo(algo(loss_params={"vcpo_lr": True, "vcpo_power": 0.0}))
    with pytest.raises(ConfigError, match="vcpo_min_scale"):
        validate_algo(algo(loss_params={"vcpo_lr": True, "vcpo_min_scale": 1.5}))


def test_min_variance_baseline_only_for_group_baseline_estimators():
    for adv in ("grpo", "rloo", "gpg", "opo", "reinforce_pp_baseline"):
        validate_algo(algo(adv_estimator=adv, adv_params={"baseline": "min_variance"}))
    with pytest.raises(ConfigError, match="baseline=min_variance is not a choice of algo.adv_estimator=mc_grpo"):
        validate_algo(algo(adv_estimator="mc_grpo", n_samples_per_prompt=5, adv_params={"baseline": "min_variance"}))
    with pytest.raises(ConfigError, match="grpo, .*rloo"):  # the message names the estimators that take it
        validate_algo(algo(adv_estimator="hapo", adv_params={"baseline": "min_variance"}))
    with pytest.raises(ConfigError, match="valid choices are mean, min_variance"):
        validate_algo(algo(adv_estimator="grpo", adv_params={"baseline": "minvar"}))


def test_ranges_and_gpg_trust_region():
    with pytest.raises(ConfigError, match="dual_clip"):
        validate_algo(algo(**{"clip.dual_clip": 0.5}))
    with pytest.raises(ConfigError, match="eps_low"):
        validate_algo(algo(**{"clip.eps_low": 1.5}))
    with pytest.raises(ConfigError, match="ppo_epochs=1"):
        validate_algo(algo(loss="gpg", ppo_epochs=2))


def test_correction_validation():
    validate_correction("tis", {"cap": 3.0})
    with pytest.raises(ConfigError, match="Valid choices"):
        validate_correction("tiss", {})
    with pytest.raises(ConfigError, match="cap"):
        validate_correction("mis", {"cap": 3.0})


def test_config_level_error_through_compose():
    from rlpost.config.compose import compose_config, validate_config

    cfg = compose_config(["algo=grpo", "algo.adv_estimator=gae", "model=tiny"])
    with pytest.raises(ConfigError, match="critic"):
        validate_config(cfg)


def test_offpolicy_keys_have_one_owner_and_the_old_spelling_warns_once(compose, caplog):
    """algo.offpolicy owns proximal / vcpo_*; algo.loss_params.<key> is an alias that warns once."""
    import logging

    import rlpost.algos.validate as v

    new = v.trainer_loss_params(compose(["model=tiny", "+algo.offpolicy.proximal=a3po"]).algo)
    assert str(new.proximal) == "a3po" and new.vcpo_lr is False  # the other keys keep their declared defaults
    v._WARNED.discard("proximal")
    with caplog.at_level(logging.WARNING, logger="rlpost"):
        old_cfg = compose(["model=tiny", "+algo.loss_params.proximal=a3po"]).algo
        old = v.trainer_loss_params(old_cfg)
        v.trainer_loss_params(old_cfg)
    assert str(old.proximal) == "a3po"
    said = [r.getMessage() for r in caplog.records if "old spelling" in r.getMessage()]
    assert len(said) == 1 and "algo.offpolicy.proximal=a3po" in said[0]
    assert "proximal" not in v.loss_kwargs(old_cfg)  # never handed to the loss
    with pytest.raises(ConfigError, match="set it once"):
        v.trainer_loss_params(compose(["model=tiny", "+algo.loss_params.proximal=a3po",
                                       "+algo.offpolicy.proximal=recompute"]).algo)
    with pytest.raises(ConfigError, match="algo.offpolicy"):
        v.trainer_loss_params(compose(["model=tiny", "+algo.offpolicy.proximl=a3po"]).algo)
