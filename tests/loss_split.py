"""The micro-batch split check of a policy loss with given parameters: a 4-row batch's loss and gradient equal the
sums over two 2-row micro-batches with the mini-batch denominator (moved unchanged from the bundle file
tests/test_losses_fipo_holderpo_p3o_erc.py; every loss with its defaults is checked in tests/test_algo_properties.py),
and the hand-made inputs of the per-loss tests (:func:`make`, :func:`grad_of`)."""

import torch

from rlpost.algos.aggregation import aggregate
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss


def split_invariance(name, agg, **params):
    """Loss and gradient of a 4-row batch equal the sums over two 2-row micro-batches (same denominator)."""
    from rlpost.algos.aggregation import agg_count

    torch.manual_seed(3)
    lp0 = torch.randn(4, 6) * 0.3 - 1.0
    old = lp0 + torch.randn(4, 6) * 0.3
    A = torch.tensor([1.0, -1.0, 0.5, -2.0])[:, None].expand(4, 6).clone()
    m = torch.ones(4, 6)
    m[1, 4:] = 0
    m[3, 2:] = 0
    denom = agg_count(agg, m)

    # the detached whole mini-batch, which the trainer passes with every micro-batch (losses with batch statistics)
    full = PolicyLossInput(logprobs=lp0, old_logprobs=old, advantages=A, response_mask=m)

    def run(rows):
        lp = lp0.clone().requires_grad_(True)
        x = PolicyLossInput(logprobs=lp[rows], old_logprobs=old[rows], advantages=A[rows], response_mask=m[rows],
                            step=7,
                            batch=full, rows=torch.arange(4)[rows])
        loss_mat, _ = compute_policy_loss(name, x, **params)
        loss = aggregate(agg, loss_mat, m[rows], denom=denom)
        loss.backward()
        return loss.detach(), lp.grad

    whole, g = run(slice(0, 4))
    a, ga = run(slice(0, 2))
    b, gb = run(slice(2, 4))
    assert g.abs().sum() > 0
    assert torch.isclose(whole, a + b, atol=1e-6)
    assert torch.allclose(g, ga + gb, atol=1e-6)



def make(ratios, adv, mask=None, step=None, dtype=torch.float32, **fields):
    """A :class:`PolicyLossInput` in ``dtype`` with old log-probs 0 and current log-probs ``log(ratio)`` as a leaf
    with grad (shapes as given: ``[B, R]`` or ``[R]``); the mask is all ones unless given; ``fields`` are further
    fields of the input (``group_index``, ``extras``, ...)."""
    r = torch.tensor(ratios, dtype=dtype)
    lp = torch.log(r).clone().requires_grad_(True)
    A = torch.tensor(adv, dtype=dtype)
    m = torch.ones_like(r) if mask is None else torch.tensor(mask, dtype=dtype)
    return PolicyLossInput(logprobs=lp, old_logprobs=torch.zeros_like(r), advantages=A, response_mask=m, step=step,
                           **fields)


def grad_of(name, x, **p):
    """``(loss matrix, d(sum of masked loss)/d logprobs, metrics)`` of loss ``name`` on input ``x``."""
    loss, met = compute_policy_loss(name, x, **p)
    (loss * x.response_mask).sum().backward()
    return loss.detach(), x.logprobs.grad.clone(), met
