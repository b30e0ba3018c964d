"""P3O, the batch-adaptive ESS objective (arXiv:2605.12380), by hand, and its micro-batch invariance.
Moved unchanged from tests/test_losses_fipo_holderpo_p3o_erc.py.
"""

import math

import pytest
import torch

from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from loss_split import grad_of, make, split_invariance  # noqa: E402  (tests/loss_split.py)




# --- the batch-adaptive ESS objective, P3O (arXiv:2605.12380) -------------------------------------

def test_p3o_ess_caps_the_weight_and_sets_the_kl_strength_by_hand():
    # w = [1, 2, 0.5, 1]: (sum w)^2 / (n sum w^2) = 4.5^2 / (4 * 6.25) = 0.81
    x = make([[1.0, 2.0], [0.5, 1.0]], [[1.0, 1.0], [-1.0, -1.0]])
    loss, g, met = grad_of("p3o", x)
    ess = 0.81
    assert float(met["ess"]) == pytest.approx(ess, abs=1e-6)
    # PG: -A min(r, ESS); KL: (1 - ESS)(1 - 1/r) on d/d log pi of log r + 1/r - 1
    pg = [[-ess, -ess], [0.5, ess]]
    kl = [[0.0, 0.5], [-1.0, 0.0]]
    want = torch.tensor(pg) + (1 - ess) * torch.tensor(kl)
    assert torch.allclose(g, want, atol=1e-5)
    kl_val = [[0.0, math.log(2) + 0.5 - 1], [math.log(0.5) + 2 - 1, 0.0]]
    assert torch.allclose(loss, torch.tensor(pg) + (1 - ess) * torch.tensor(kl_val), atol=1e-5)
    assert float(met["clip_frac"]) == pytest.approx(0.75)  # r = 1, 2, 1 exceed ESS = 0.81; r = 0.5 does not


def test_p3o_on_policy_is_plain_reinforce():
    x = make([[1.0, 1.0, 1.0]], [[1.0, -2.0, 0.5]])
    _, g, met = grad_of("p3o", x)
    assert float(met["ess"]) == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(g, torch.tensor([[-1.0, 2.0, -0.5]]), atol=1e-6)
    assert float(met["clip_frac"]) == 0.0


def test_p3o_ess_is_over_the_whole_mini_batch_not_the_micro_batch():
    from rlpost.algos.losses import batch_view  # noqa: F401  (the loss reads PolicyLossInput.batch)

    whole = make([[1.0, 2.0], [0.5, 1.0]], [[1.0, 1.0], [-1.0, -1.0]])
    part = make([[1.0, 2.0]], [[1.0, 1.0]])
    part.batch = PolicyLossInput(logprobs=whole.logprobs.detach(), old_logprobs=whole.old_logprobs,
                                 advantages=whole.advantages, response_mask=whole.response_mask)
    part.rows = torch.tensor([0])
    _, g, met = grad_of("p3o", part)
    assert float(met["ess"]) == pytest.approx(0.81, abs=1e-6)  # alone, row 0 would give 9 / 10 = 0.9
    assert torch.allclose(g, torch.tensor([[-0.81, -0.81 + 0.19 * 0.5]]), atol=1e-5)


# --- micro-batch invariance ----------------------------------------------------------------------

@pytest.mark.parametrize("name,agg,params", [
    ("p3o", "token-mean", {}),
])
def test_micro_batch_split_gives_the_whole_batch_loss_and_gradient(name, agg, params):
    split_invariance(name, agg, **params)
