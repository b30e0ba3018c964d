"""BroRL is a setting of sampler=group: its recipe and its baseline arm spend the same rollouts per step."""

import rlpost.experiments.recipes as R


def test_brorl_arms_share_the_rollout_budget(compose):
    rec = R.load_recipe("brorl")
    bro = compose(["+recipe=brorl", "logger=none"])
    base = compose(["+recipe=brorl", "logger=none", *rec.card.cpu.baseline])
    assert bro.sampler.name == base.sampler.name == "group"
    budget = lambda c: c.selector.prompts_per_step * c.algo.n_samples_per_prompt  # noqa: E731
    assert budget(bro) == budget(base) == 16
    assert bro.algo.n_samples_per_prompt == 4 * base.algo.n_samples_per_prompt  # broader groups, fewer prompts
