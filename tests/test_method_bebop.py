"""Bebop's e2e TV loss and MTP draft heads: acceptance by hand and by simulation, a TV-trained head, and
exact speculative samples. Moved unchanged from tests/test_rollout_mtp_vllm_spec_mipu.py.
"""

import pytest
import torch

from rlpost.rollout.base import SamplingParams
from rlpost.rollout.hf import HFRolloutEngine
from spec_helpers import _exact_dist, _perturb, _tiny_llama, _Tok, response_chi2

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- Bebop e2e TV loss
def test_tv_acceptance_and_e2e_loss_hand_computed():
    from rlpost.rollout.mtp_draft import e2e_tv_loss, multi_step_acceptance, tv_acceptance

    p = torch.tensor([[[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[0.2, 0.3, 0.5], [0.5, 0.5, 0.0]]])
    # 1 - TV = sum min(p, q): 0.2 + 0.3 + 0.2 = 0.7 and 0.5
    torch.testing.assert_close(tv_acceptance(p, q), torch.tensor([[0.7, 0.5]]))
    torch.testing.assert_close(multi_step_acceptance(p, q), torch.tensor([[0.7, 0.35]]))
    torch.testing.assert_close(e2e_tv_loss(p, q), torch.tensor(1 - (0.7 + 0.35) / 2))
    assert float(e2e_tv_loss(p, p)) == pytest.approx(0.0, abs=1e-7)
    # a masked-out position does not count
    p2, q2 = torch.cat([p, p]), torch.cat([q, p])
    torch.testing.assert_close(e2e_tv_loss(p2, q2, torch.tensor([1.0, 0.0])), torch.tensor(0.475))
    with pytest.raises(ValueError, match=r"\[N, K, V\]"):
        e2e_tv_loss(p[0], q[0])


def test_multi_step_acceptance_matches_simulated_rejection_sampling():
    """The product of (1 - TV) terms is the chance that rejection sampling accepts both drafts."""
    from rlpost.rollout.mtp_draft import multi_step_acceptance

    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.3, 0.5], [0.4, 0.4, 0.2]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    N = 200_000
    both = torch.ones(N, dtype=torch.bool)
    for k in range(2):
        x = torch.multinomial(q[k], N, replacement=True, generator=g)
        u = torch.rand(N, generator=g, dtype=torch.float64)
        both &= u < (p[k, x] / q[k, x]).clamp(max=1.0)
    expect = float(multi_step_acceptance(p, q)[-1])  # (0.2+0.3+0.2) * (0.1+0.4+0.2) = 0.49
    assert expect == pytest.approx(0.49)
    assert float(both.double().mean()) == pytest.approx(expect, abs=0.005)


def test_tv_trained_mtp_head_raises_acceptance():
    from rlpost.rollout.mtp_draft import MTPDraftHead, acceptance_of_head, mtp_training_pairs, train_mtp_head

    model = _tiny_llama(3).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 5, (16, 10), generator=g)
    h, toks, p = mtp_training_pairs(model, ids, depth=2)
    assert h.shape == (16 * 7, 16) and toks.shape == (16 * 7, 2) and p.shape == (16 * 7, 2, 5)
    torch.manual_seed(0)
    head = MTPDraftHead(model)
    before = acceptance_of_head(head, h, toks, p)
    hist = train_mtp_head(head, h, toks, p, steps=150, lr=1e-2, loss="tv")
    after = acceptance_of_head(head, h, toks, p)
    assert hist[-1] < hist[0]
    assert after["expected_accepted"] > before["expected_accepted"] + 0.1, (before, after)
    # the loss reported is 1 - expected_accepted / K on the training pairs
    assert hist[-1] == pytest.approx(1 - after["expected_accepted"] / 2, abs=0.02)
    assert not any(q.grad is not None and q.grad.abs().sum() > 0 for q in model.parameters())  # policy frozen


def test_mtp_head_speculative_rollouts_are_exact_samples_of_the_policy():
    """Whole 3-token responses drafted by an MTP head: chi-square against the policy's exact distribution."""
    from rlpost.rollout.mtp_draft import MTPDraftHead, MTPSpeculativeEngine, mtp_training_pairs, train_mtp_head

    model = _tiny_llama(0).requires_grad_(False)
    torch.manual_seed(1)
    head = MTPDraftHead(model)
    ids = torch.randint(1, 5, (8, 8), generator=torch.Generator().manual_seed(1))
    train_mtp_head(head, *mtp_training_pairs(model, ids, depth=2), steps=40, lr=1e-2)
    target = HFRolloutEngine(model, _Tok(), batch_size=4096)
    N, T, prompt = 400, 3, [1, 2, 3]
    eng = MTPSpeculativeEngine(target, head, switch_batch=N, draft_len=2, max_draft_len=3)
    gen = eng.generate([prompt] * N, SamplingParams(max_new_tokens=T, seed=11))
    m = eng.pop_metrics()
    assert m["spec/spec_rows"] == N and m["spec/draft_tokens"] > 0
    assert 0.05 < m["spec/accept_rate"] < 1.0, m
    keys, p_exact = _exact_dist(model, prompt, T)
    stat, bound, against = response_chi2(gen, keys, p_exact)
    assert stat < bound, (stat, bound)
    # power: a perturbed policy's distribution is rejected by the same statistic
    import copy

    _, q_exact = _exact_dist(_perturb(0.3)(copy.deepcopy(model)), prompt, T)
    assert against(q_exact) > bound
    # reported log-probs are the policy's
    with torch.no_grad():
        lp0 = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double(), -1)
    assert torch.allclose(gen.rollout_logprobs[:, 0].double(), lp0[gen.response_ids[:, 0]], atol=1e-4)
