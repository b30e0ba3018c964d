"""The bandit rollout scheduler: noise-aware top-k and arm features by hand, selection, replay and learning.
Moved unchanged from tests/test_rollout_self_spec_otr_hif4.py.
"""

import pytest
import torch

from rlpost.rollout.base import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- bandit scheduler
def test_noise_aware_topk_hand_computed():
    from rlpost.samplers.bandit import noise_aware_topk

    s = torch.tensor([0.9, 0.8, 0.7, 0.1])
    r = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # plain top-2 would be {0, 1} (all correct, no signal); the worst-reward arm 3 is kept instead of 1
    assert noise_aware_topk(s, r, 2) == [0, 3]
    assert noise_aware_topk(s, r, 3) == [0, 1, 3]
    assert noise_aware_topk(s, torch.ones(4), 2) == [0, 1]  # no variance to protect: by score
    assert noise_aware_topk(s, r, 9) == [0, 1, 2, 3]


def test_arm_features_hand_computed():
    from rlpost.rollout.base import GenerationResult
    from rlpost.samplers.bandit import arm_features

    gen = GenerationResult(prompt_ids=torch.zeros(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.long),
                           response_ids=torch.zeros(2, 2, dtype=torch.long),
                           response_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
                           rollout_logprobs=torch.tensor([[-1.0, -3.0], [-0.5, 0.0]]), temperatures=torch.ones(2, 2),
                           finished=torch.tensor([True, False]), texts=["", ""])
    x = arm_features(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), gen, 4, torch.tensor([0.0, 5.0]))
    # mean 0.5, std 0.5 -> A = +-1 (up to the 1e-6); lengths 2/4, 1/4; mean log-probs -2, -0.5; ages 0, 0.5
    want = torch.tensor([[1.0, 1.0, 1.0, 0.5, 1.0, -2.0, 0.0, 0.5], [0.0, -1.0, 1.0, 0.25, 0.0, -0.5, 0.5, 0.5]])
    assert torch.allclose(x, want, atol=1e-5)


def test_bandit_scheduler_selects_replays_and_learns():
    from fake_engine import FakeEngine, scorer

    from rlpost.samplers import SAMPLERS, SamplerContext

    eng = FakeEngine({3: 0.5, 4: 0.5})
    sc = scorer()
    s = SAMPLERS.get("bandit_scheduler")(4, select_ratio=0.5, min_keep=2, buffer_size=6, max_age=8,
                                         exploration_coef=0.5, hidden=8, lr=0.05)
    prompts = [[3, 1], [4, 1]]
    replayed = 0
    for step in range(1, 5):
        r = s.sample(eng, prompts, SamplingParams(max_new_tokens=6, seed=step),
                     SamplerContext(score=sc, step=step, prompt_indices=[10, 11]))
        assert r.rollouts_spent == 8
        for g in range(2):  # k = round(0.5 * 4) = 2 slots per group
            assert int((r.group_index == g).sum()) == 2
        m = r.metrics
        assert m["sampler/buffer_rows"] <= 6
        # every fresh row left out was scored and recorded
        assert sum(len(v) for _, v in r.dropped) == m["sampler/pruned"]
        assert m["sampler/pruned"] == 8 - (4 - m["sampler/replayed"])
        replayed += m["sampler/replayed"]
        if step > 1:
            assert "sampler/gain" in m and m["sampler/value_loss"] >= 0
        # groups with mixed candidates keep both a correct and a wrong row
        for g in range(2):
            rr = r.rewards[r.group_index == g]
            assert rr.numel() == 2
    assert replayed > 0  # historical rollouts re-entered as arms
    t = SAMPLERS.get("bandit_scheduler")(4, select_ratio=0.5, min_keep=2, buffer_size=6, max_age=8,
                                         exploration_coef=0.5, hidden=8, lr=0.05)
    t.load_state_dict(s.state_dict())
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(t.scores(x), s.scores(x))
    with pytest.raises(ValueError, match="select_ratio"):
        SAMPLERS.get("bandit_scheduler")(4, select_ratio=0.0, min_keep=2, buffer_size=6, max_age=8,
                                         exploration_coef=0.5, hidden=8, lr=0.05)
