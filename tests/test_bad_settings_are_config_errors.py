"""Out-of-range settings of this session's components stop at config time with a ConfigError naming the setting.

Each case was found by trying the components as a newcomer would: before the fix each one either passed
``rlpost config`` and crashed later with a raw ValueError, or named the wrong fix.
"""

import pytest

from rlpost.config.compose import compose_config, validate_config
from rlpost.core.errors import ConfigError

CASES = [
    (["algo=datpo", "algo.adv_params.anneal_steps=-1"], "anneal_steps=-1 must be >= 0"),
    (["algo=datpo", "algo.adv_params.sibling_diversity_coef=-1"], "sibling_diversity_coef=-1"),
    (["algo=nat", "algo.loss_params.keep_prob=0"], "keep_prob must be in (0, 1]"),
    (["algo=nat", "algo.loss_params.keep_prob=1.5"], "keep_prob must be in (0, 1]"),
    (["algo=drift", "algo.adv_params.beta=0"], "beta must be > 0"),
    (["algo=drift", "algo.adv_params.gamma=1.5"], "gamma must be in [0, 1]"),
    (["algo=capo", "algo.loss_params.top_k=0"], "top_k must be >= 1"),
    (["sampler=lens", "model.lora.rank=4"], "model.lora.rank=0"),
    (["algo=mopd", "task=arithmetic_mix"], "model.teachers.<domain>="),
    (["algo=t5", "algo.critic.num_heads=0"], "num_heads=0 must be >= 1"),
    (["launcher=ray", "launcher.num_rollout_workers=auto", "launcher.provisioning.train_s=10",
      "launcher.provisioning.publish_every=1", "launcher.provisioning.worker_rollouts_per_s=abc"], "launcher.provisioning"),
    (["algo=t5", "algo.adv_params.lams=[1,2]"], "every GAE lambda must be in [0, 1]"),
    (["algo=t5", "algo.adv_params.qualification_threshold=2"], "no critic would ever qualify"),
    (["algo=t5", "algo.adv_params.mixer_hidden=-1"], "mixer_hidden=-1 must be >= 0"),
    (["algo=mopd", "task=arithmetic_mix", "model.teachers.basic_arithmetic=tiny", "model.teachers.chain_sum=tiny",
      "algo.adv_params.gap_clamp_low=5", "algo.adv_params.gap_clamp_high=1"], "0 < low <= high"),
    # an env preset sets its own sampler: naming another one beside it is refused (it was silently replaced)
    (["env=calculator", "sampler=empo2"], "Fix: sampler.name=empo2"),
    (["env=agentflow", "sampler=group"], "replaces the requested sampler=group"),
    # ... also when a recipe composes the env, and when an algorithm's rule asked for the sampler
    (["+recipe=agent_multiply_grpo", "sampler=trace_tree"], "+recipe=agent_multiply_grpo (through the env preset"),
    (["algo=hapo", "env=calculator"], "algo=hapo does not run on env episodes"),
    # NaN passes `x >= 0` checks: refused for every declared parameter
    (["algo=grpo", "algo.loss_params.eps_high=nan"], "eps_high=nan is not a number"),
    (["algo=t5", "algo.adv_params.signal_retention_coef=nan"], "signal_retention_coef=nan is not a number"),
    (["trainer.num_procs=0"], "trainer.num_procs=0 must be >= 1"),
    (["launcher=ray", "launcher.num_rollout_workers=auto", "executor=async", "executor.max_staleness=3",
      "launcher.provisioning.train_s=10", "launcher.provisioning.worker_rollouts_per_s=2",
      "launcher.provisioning.max_workers=0"], "max_workers=0 must be an integer >= 1, or null"),
    # a sampler whose decoding hook keeps state in this process, with rollouts decoded elsewhere
    (["sampler=neighbor_mixing", "launcher=ray"], "launcher=ray decodes in Ray workers"),
    (["sampler=m3po", "trainer=deepspeed", "trainer.num_procs=2"], "trainer.num_procs=2 splits the rows"),
    (["sampler=adaptive_temperature", "trainer=deepspeed", "trainer.num_procs=2"], "token entropies"),
    # a sampler's constructor range checks run at config time (rlpost.samplers.check_config builds it once)
    (["sampler=m3po", "sampler.params.mix_lambda=2"], "mix_lambda=2 must be in [0, 1]"),
    (["sampler=empo2", "sampler.params.off_policy_prob=1.5"], "off_policy_prob=1.5"),
    (["sampler=agentflow", "sampler.params.tools=[calculater]"], "calculater"),
    (["sampler=datpo", "sampler.params.ngram=0"], "ngram=0 must be >= 1"),
    (["sampler=scope"], "prm_model_path"),
]


@pytest.mark.parametrize("overrides,message", CASES, ids=[" ".join(c[0][:2]) for c in CASES])
def test_bad_setting_is_a_config_error_that_names_it(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate_config(compose_config(["model=tiny", *overrides]))
    assert message in str(e.value)
    if "routes each prompt" in str(e.value):  # the routed-teacher case offers only the routed fix
        assert "model.teacher=" not in str(e.value)


def test_an_env_with_its_sampler_named_as_a_key_composes():
    cfg = compose_config(["model=tiny", "env=calculator", "sampler.name=empo2"])
    validate_config(cfg)
    assert cfg.sampler.name == "empo2" and cfg.sampler.params.env == "tools"  # the env's episode settings kept


def test_a_type_error_keeps_its_own_message():
    """The range-check handler must not swallow OmegaConf's type errors (a ValueError subclass)."""
    with pytest.raises(ConfigError, match="could not be converted to Integer"):
        validate_config(compose_config(["model=tiny", "algo=capo", "algo.loss_params.top_k=abc"]))


def test_pot_temperature_zero_is_refused_before_any_problem():
    from rlpost.eval.pot import PolicyOfThoughts as PoT

    kw = dict(iterations=1, group_size=2, temperature=0.0, lora_rank=8, lora_alpha=16.0, target_modules=["q_proj"],
              lr=1e-4, ppo_epochs=1, clip_eps=0.3, kl_coef=0.02, std_eps=1e-6, adv_clip=None, check_restored=True)
    with pytest.raises(ConfigError, match="temperature=0.0"):
        PoT(**kw)
