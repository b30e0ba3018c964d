"""XRPO's novelty-aware advantage sharpening and rollout allocator by hand, and its recipe on ``model=tiny``.
Moved unchanged from tests/test_methods_r2vpo_xrpo_rapid_cscr.py.
"""

import json
import math

import pytest
import torch


from conftest import train_rows  # noqa: E402  (tests/conftest.py)


# --- XRPO, novelty-aware advantage sharpening and the rollout allocator (arXiv:2510.06672) ------

def xrpo_input(rewards, seq_logliks, group=None):
    from rlpost.algos.advantages import AdvantageInput

    B = len(rewards)
    lp = torch.tensor(seq_logliks, dtype=torch.float32)[:, None].expand(B, 2).clone()  # 2 tokens, mean = s_i
    return AdvantageInput(rewards=torch.tensor(rewards), response_mask=torch.ones(B, 2),
                          group_index=torch.zeros(B, dtype=torch.long) if group is None else torch.tensor(group),
                          rollout_logprobs=lp)


def test_xrpo_sharpens_only_correct_unlikely_responses_by_hand():
    from rlpost.algos.advantages import compute_advantages

    # rewards (1, 1, 0, 0): GRPO A = +-0.5 / sqrt(1/3) = +-0.8660; s = (-1, -2, -1.5, -1.5), s_bar = -1.5
    # eta = (e^0.5, e^-0.5, 1, 1): response 0 (likely, correct) no bonus; response 1 (unlikely, correct)
    # bonus min(1 - e^-0.5, 0.866) = 0.3935; incorrect ones keep -0.866 even though eta = 1
    out = compute_advantages("xrpo", xrpo_input([1.0, 1.0, 0.0, 0.0], [-1.0, -2.0, -1.5, -1.5]))
    a = out.advantages[:, 0]
    z = 0.5 / (1 / 3) ** 0.5
    assert torch.allclose(a, torch.tensor([z, z + 1 - math.exp(-0.5), -z, -z]),
                          atol=1e-5)
    assert torch.equal(out.advantages[:, 0], out.advantages[:, 1])  # broadcast to every token
    # kappa caps the bonus at kappa * A: 0.25 * 0.866 = 0.2165
    a2 = compute_advantages("xrpo", xrpo_input([1.0, 1.0, 0.0, 0.0], [-1.0, -2.0, -1.5, -1.5]),
                            novelty_clip=0.25).advantages[:, 0]
    assert float(a2[1]) == pytest.approx(1.25 * z, abs=1e-5)
    # a group of equal rewards stays 0 whatever the likelihoods; groups are separate
    a3 = compute_advantages("xrpo", xrpo_input([1.0, 1.0, 1.0, 0.0], [-1.0, -3.0, -1.0, -1.0],
                                               group=[0, 0, 1, 1])).advantages[:, 0]
    assert a3[0] == 0 and a3[1] == 0
    assert float(a3[2]) == pytest.approx(0.5 / 0.5 ** 0.5, abs=1e-5)  # eta = 1 within group 1: plain GRPO
    with pytest.raises(ValueError, match="log-probs"):
        from rlpost.algos.advantages import AdvantageInput
        compute_advantages("xrpo", AdvantageInput(rewards=torch.ones(2), response_mask=torch.ones(2, 1),
                                                  group_index=torch.zeros(2, dtype=torch.long)))


def test_t_quantile_matches_the_table():
    from rlpost.selectors.xrpo_allocator import t_quantile

    for df, want in [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (5, 2.5706), (6, 2.4469), (7, 2.3646),
                     (10, 2.2281), (30, 2.0423)]:
        assert t_quantile(0.975, df) == pytest.approx(want, abs=1e-4), df


def test_xrpo_allocator_gives_rollouts_where_uncertainty_shrinks_most_by_hand():
    from rlpost.selectors import build_selector
    from types import SimpleNamespace

    sel = build_selector(SimpleNamespace(name="xrpo", prompts_per_step=2, params={"explore_coef": 0.0}),
                         num_prompts=4, seed=0, n_samples=3)
    # prompt 0: rewards (0, 1, 0, 1), std 0.577; prompt 1: always solved, std 0
    sel.update([0, 1], [[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert sel.rollout_counts([0, 1]) == [4, 2]  # both extra rollouts to the varied prompt
    # prompt 2 never seen (prior std 0.5): h(n) per unit std = t_{.975,n-1} / sqrt n = 8.985, 2.484, 1.591
    # first extra: prompt 0 (6.50 x 0.577 = 3.75 > 6.50 x 0.5 = 3.25); second: prompt 2 (3.25 > 0.893 x 0.577)
    assert sel.rollout_counts([0, 2]) == [3, 3]
    sd = sel.state_dict()
    again = build_selector(SimpleNamespace(name="xrpo", prompts_per_step=2, params={"explore_coef": 0.0}),
                           num_prompts=4, seed=5, n_samples=3)
    again.load_state_dict(sd)
    assert again.rollout_counts([0, 2]) == [3, 3] and again.reward_std(1) == 0.0


def test_xrpo_recipe_trains_on_tiny(tmp_path):
    rows = train_rows(tmp_path, ["algo=xrpo", "selector=xrpo", "steps=1"])
    assert rows and "selector/rollouts_max" in rows[0]
