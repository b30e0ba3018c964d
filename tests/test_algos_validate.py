"""Config-time validation of algorithm combinations, and every valid combination runs."""

import itertools

import pytest
import torch
from omegaconf import OmegaConf

from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.algos.aggregation import aggregate
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from rlpost.algos.registries import ADV_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES
from rlpost.algos.validate import loss_overrides, validate_algo, validate_correction
from rlpost.config.schema import AlgoConfig
from rlpost.core.errors import ConfigError
from teacher_inputs import teacher_inputs  # noqa: E402  (tests/teacher_inputs.py)


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


def _batch(B=6, R=5, G=3):
    torch.manual_seed(0)
    mask = torch.ones(B, R)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    return (
        torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0]),
        mask,
        torch.arange(B) // (B // G) if G else torch.arange(B),
    )


@pytest.mark.parametrize("adv,loss", list(itertools.product(ADV_ESTIMATORS.names(), POLICY_LOSSES.names())))
def test_every_valid_combination_runs_under_every_aggregation(adv, loss):
    """estimator x loss x aggregation: validation passes (with what the estimator needs) and the
    pure pipeline gives finite losses and gradients."""
    needs_critic = ADV_ESTIMATORS.tag(adv, "needs_critic")
    n = 3
    cfg = algo(adv_estimator=adv, loss=loss, n_samples_per_prompt=n, **{"critic.enabled": bool(needs_critic)})
    if adv == "max_at_k":  # max@k needs k + 1 samples per group (leave-one-out baseline): k = 2 fits n = 3
        OmegaConf.update(cfg, "adv_params", {"k": 2}, merge=True)
    validate_algo(cfg)
    rewards, mask, gi = _batch()
    B, R = mask.shape
    out = compute_advantages(
        adv,
        AdvantageInput(rewards=rewards, response_mask=mask, group_index=torch.arange(B) // n,
                       values=torch.rand(B, R) if needs_critic else None, entropy=torch.rand(B, R),
                       baseline_rewards=torch.full((B,), 0.5), answer_ids=torch.arange(B) % 2,
                       teacher_logprobs=-torch.rand(B, R), rollout_logprobs=-torch.rand(B, R),
                       reference_rewards=torch.rand(B, 8), privileged_shifts=torch.randn(B, R, 2),
                       response_ids=torch.zeros(B, R, dtype=torch.long),
                       extras={"vps_progress": torch.rand(B, R), "vps_segment": (torch.arange(R) // 2 + 1).expand(B, R),
                               "oprl_step_rewards": torch.rand(B, R),  # grpo_vps / oprl: their methods' step inputs
                               "oprl_segment": (torch.arange(R) // 2 + 1).expand(B, R)}),
        **dict(cfg.adv_params),
    )
    lm = mask if out.loss_mask is None else out.loss_mask
    for agg in LOSS_AGGS.names():
        lp = (torch.randn(B, R) - 1.0).requires_grad_(True)
        inp = PolicyLossInput(logprobs=lp, old_logprobs=lp.detach() + 0.05 * torch.randn(B, R), advantages=out.advantages, response_mask=lm, entropy=torch.rand(B, R), group_index=torch.arange(B) // n, extras={**teacher_inputs(loss, lp), 'segment_ids': (torch.arange(R) // 2).expand(B, R)})
        loss_mat, met = compute_policy_loss(loss, inp, **loss_overrides(cfg))
        total = aggregate(agg, loss_mat, lm, norm_const=R)
        total.backward()
        grad = lp.grad if inp.extras.get("support_logprobs") is None else inp.extras["support_logprobs"].grad  # distillation: the support's
        assert torch.isfinite(total) and torch.isfinite(grad).all(), (adv, loss, agg)
        assert all(torch.isfinite(v) for v in met.values())


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
