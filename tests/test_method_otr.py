"""OTR (one-token rollout): candidates and loss by hand, and an update that raises the reference token's
likelihood. Moved unchanged from tests/test_rollout_self_spec_otr_hif4.py.
"""

import pytest
import torch
from spec_helpers import _tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- OTR
def test_otr_candidates_hand_computed():
    from rlpost.algos.otr import otr_candidates

    # position 0: all mass on token 2 (the target); position 1: all mass on token 0 (target 1)
    logits = torch.tensor([[-1e4, -1e4, 0.0], [0.0, -1e4, -1e4]])
    ids, rew = otr_candidates(logits, torch.tensor([2, 1]), k=4, kappa=1.3, beta=-0.25)
    assert ids.tolist() == [[2, 2, 2, 2], [0, 0, 0, 0]]
    assert rew.tolist() == [[1.0, 1.0, 1.0, 1.0], [-0.25, -0.25, -0.25, -0.25]]
    with pytest.raises(ValueError, match="targets"):
        otr_candidates(logits, torch.tensor([2]), k=4, kappa=1.0, beta=0.0)


def test_otr_loss_hand_computed_and_expectation():
    from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
    from rlpost.algos.otr import otr_candidates

    lp = torch.log(torch.tensor([[[0.5, 0.25]]]))
    rew = torch.tensor([[[1.0, -0.1]]])
    z = torch.zeros(1, 1)
    inp = PolicyLossInput(logprobs=torch.log(torch.tensor([[0.5]])), old_logprobs=torch.log(torch.tensor([[0.5]])), advantages=z, response_mask=torch.ones(1, 1), extras={'support_logprobs': lp, 'support_rewards': rew})
    loss, m = compute_policy_loss("otr", inp)
    # -(1 * log 0.5 + (-0.1) * log 0.25) / 2
    assert abs(float(loss[0, 0]) - (-(torch.log(torch.tensor(0.5)) - 0.1 * torch.log(torch.tensor(0.25))) / 2)) < 1e-6
    assert abs(m["otr_hit_rate"] - 0.5) < 1e-6 and abs(m["nll"] - 0.6931) < 1e-3
    with pytest.raises(ValueError, match="support"):
        compute_policy_loss("otr", PolicyLossInput(logprobs=z, old_logprobs=z, advantages=z, response_mask=torch.ones(1, 1)))
    # Monte Carlo: with kappa = 1 and beta = 0 the per-position loss converges to -p(x) log p(x)
    logits = torch.tensor([[0.3, -0.2, 1.1, 0.0]])
    p = torch.softmax(logits, -1)[0]
    ids, rw = otr_candidates(logits, torch.tensor([1]), k=40000, kappa=1.0, beta=0.0,
                             generator=torch.Generator().manual_seed(0))
    lps = torch.log_softmax(logits, -1)[0][ids]
    mc = float(-(rw * lps).mean())
    exact = float(-p[1] * torch.log(p[1]))
    assert abs(mc - exact) < 0.01, (mc, exact)


def test_otr_update_raises_reference_token_likelihood():
    """One SGD step on the OTR loss through a tiny Llama raises log pi of the reference tokens."""
    import contextlib
    import types

    from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
    from rlpost.algos.otr import otr_forward

    model = _tiny_llama(2, sharpen=1.0).train()
    fwd = types.SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext, model=model)
    mb = types.SimpleNamespace(prompt_ids=torch.tensor([[1, 2], [3, 4]]), prompt_mask=torch.ones(2, 2, dtype=torch.long),
                               response_ids=torch.tensor([[3, 3, 0], [2, 0, 0]]),
                               response_mask=torch.tensor([[1.0, 1, 1], [1, 1, 0]]), extras={})
    params = {"k": 256, "kappa": 1.3, "beta": -0.1}
    lp0, _, sup = otr_forward(fwd, mb, False, False, params, seed=0)
    assert sup["support_logprobs"].shape == (2, 3, 256) and float(sup["support_rewards"][1, 2].abs().sum()) == 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    m = mb.response_mask
    inp = PolicyLossInput(logprobs=lp0, old_logprobs=lp0.detach(), advantages=torch.zeros_like(m), response_mask=m, extras=sup)
    loss, _ = compute_policy_loss("otr", inp, **params)
    ((loss * m).sum() / m.sum()).backward()
    opt.step()
    with torch.no_grad():
        lp1, _, _ = otr_forward(fwd, mb, False, False, params, seed=1)
    assert float((lp1 - lp0.detach())[m > 0].mean()) > 0.01
