"""GAE(gamma, lambda) against a recursion worked out by hand, with gamma and lambda both below 1.

Row 0: three tokens, outcome reward 1 on the last, values 0.5, 0.2, 0.4.
Row 1: two tokens and one padding position, outcome reward 2, values 0.1, 0.3.
With gamma = 0.9 and lambda = 0.8 (gamma * lambda = 0.72):

    row 0: delta = (0.9*0.2 - 0.5, 0.9*0.4 - 0.2, 1 - 0.4) = (-0.32, 0.16, 0.6)
           A_2 = 0.6, A_1 = 0.16 + 0.72*0.6 = 0.592, A_0 = -0.32 + 0.72*0.592 = 0.10624
    row 1: delta = (0.9*0.3 - 0.1, 2 - 0.3) = (0.17, 1.7)
           A_1 = 1.7, A_0 = 0.17 + 0.72*1.7 = 1.394
    returns = A + V on the response tokens, 0 on padding.
"""

from __future__ import annotations

import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages, discounted_gae

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
VALUES = torch.tensor([[0.5, 0.2, 0.4], [0.1, 0.3, 0.0]])
WANT_A = torch.tensor([[0.10624, 0.592, 0.6], [1.394, 1.7, 0.0]], dtype=torch.float64)
WANT_RET = torch.tensor([[0.60624, 0.792, 1.0], [1.494, 2.0, 0.0]], dtype=torch.float64)


def test_discounted_gae_matches_the_hand_recursion():
    tr = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    adv, ret = discounted_gae(tr, VALUES, MASK, gamma=0.9, lam=0.8)
    assert torch.allclose(adv, WANT_A, atol=1e-9)
    assert torch.allclose(ret, WANT_RET, atol=1e-9)


def test_gae_estimator_puts_the_outcome_on_the_last_token_and_uses_gamma_and_lambda():
    inp = AdvantageInput(rewards=torch.tensor([1.0, 2.0]), response_mask=MASK, group_index=torch.tensor([0, 1]),
                         values=VALUES)
    out = compute_advantages("gae", inp, gamma=0.9, lam=0.8, whiten=False)
    assert torch.allclose(out.advantages.double(), WANT_A, atol=1e-6)
    assert torch.allclose(out.returns.double(), WANT_RET, atol=1e-6)
    # lambda = 1: Monte-Carlo return minus the value, A_t = gamma^(T-1-t) R - V_t
    out1 = compute_advantages("gae", inp, gamma=0.9, lam=1.0, whiten=False)
    want1 = torch.tensor([[0.81 - 0.5, 0.9 - 0.2, 1.0 - 0.4], [1.8 - 0.1, 2.0 - 0.3, 0.0]], dtype=torch.float64)
    assert torch.allclose(out1.advantages.double(), want1, atol=1e-6)
