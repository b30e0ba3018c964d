"""TBRM (trajectory Bellman residual, arXiv:2505.15311): the residual loss and gradient by hand, its errors,
and the first-position log-normaliser against a full forward. Moved unchanged from
tests/test_methods_tbrm_sp3o_dppo_sapo.py.
"""

import pytest
import torch

from rlpost.algos.aggregation import aggregate
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss


# ----------------------------------------------------------------------------------------------- TBRM
def _tbrm_input():
    lp = torch.tensor([[-1.0, -1.0, -0.5], [-0.2, -0.4, -9.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.5, -0.5], [-0.2, -0.6, -1.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    r = torch.tensor([1.0, 0.0])
    logz = torch.tensor([2.0, 1.0], requires_grad=True)
    return PolicyLossInput(logprobs=lp, old_logprobs=lp.detach(), advantages=r[:, None] * m, response_mask=m, extras={'ref_logprobs': ref, 'first_log_normaliser': logz})


def test_tbrm_residual_loss_and_gradient_by_hand():
    # beta = 0.5. Row 0: sum log pi/pi_ref = 0.5 + 0.5 + 0 = 1, delta = 0.5 (2 + 1) - 1 = 0.5.
    # Row 1 (2 real tokens): 0 + 0.2 = 0.2, delta = 0.5 (1 + 0.2) - 0 = 0.6 (the padded -9 does not count).
    inp = _tbrm_input()
    loss_mat, met = compute_policy_loss("tbrm", inp, beta=0.5)
    assert float(met["seq_tbrm_residual"]) == pytest.approx((0.5 + 0.6) / 2)
    loss = aggregate("seq-mean-token-sum", loss_mat, inp.response_mask)
    assert float(loss) == pytest.approx((0.25 + 0.36) / 2)  # the mean squared residual over trajectories
    loss.backward()
    # d/d lp_t = 2 delta beta / 2 rows: row 0 -> 0.25 per token, row 1 -> 0.3 on its real tokens, 0 on padding
    assert inp.logprobs.grad.flatten().tolist() == pytest.approx([0.25, 0.25, 0.25, 0.3, 0.3, 0.0])
    # V(s_1) = beta logZ gets the same pull: the residual's baseline is learned through the logits
    assert inp.extras["first_log_normaliser"].grad.tolist() == pytest.approx([0.25, 0.3])


def test_tbrm_errors_name_the_missing_input():
    inp = _tbrm_input()
    inp.extras["first_log_normaliser"] = None
    with pytest.raises(ValueError, match="first_log_normaliser"):
        compute_policy_loss("tbrm", inp, beta=0.5)
    with pytest.raises(ValueError, match="beta must be > 0"):
        compute_policy_loss("tbrm", _tbrm_input(), beta=0.0)


def test_first_position_log_normaliser_matches_the_full_forward():
    from rlpost.algos.tbrm import first_position_log_normaliser
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy

    model = load_policy(ModelConfig(source="tiny"), seed=0)[0]
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        z = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
        got = first_position_log_normaliser(model, ids, mask, temperature=0.7)
    assert got.tolist() == pytest.approx(torch.logsumexp(z / 0.7, -1).tolist(), abs=1e-4)
