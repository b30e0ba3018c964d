"""Issue 17 (value-based and single-rollout methods, the predictive divergence mask) on hand-computed tensors.

TBRM (trajectory Bellman residual, arXiv:2505.15311), SP3O's sparse critic supervision and the predictive
divergence direction for DPPO's trust region: values, which tokens receive gradient, round trips against
a full forward pass or a realised gradient step.
"""

import math

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
    return PolicyLossInput(logprobs=lp, old_logprobs=lp.detach(), advantages=r[:, None] * m, response_mask=m,
                           ref_logprobs=ref, first_log_normaliser=logz)


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
    assert inp.first_log_normaliser.grad.tolist() == pytest.approx([0.25, 0.3])


def test_tbrm_errors_name_the_missing_input():
    inp = _tbrm_input()
    inp.first_log_normaliser = None
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


# ----------------------------------------------------------------------------------------------- SP3O
def test_sp3o_even_states_first_last_and_between_counted_over_loss_tokens():
    from rlpost.algos.sp3o import sparse_state_mask

    m = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0],      # L = 7: positions 0, 3, 6
                      [1, 0, 1, 1, 0, 1, 1, 0],      # loss tokens at 0 2 3 5 6 (L = 5): their 0th, 2nd, 4th
                      [1, 1, 0, 0, 0, 0, 0, 0],      # L = 2 <= 3: both
                      [0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    got = sparse_state_mask(m, 3, "even")
    assert got.tolist() == [[1, 0, 0, 1, 0, 0, 1, 0], [1, 0, 0, 1, 0, 0, 1, 0],
                            [1, 1, 0, 0, 0, 0, 0, 0], [0] * 8]
    assert sparse_state_mask(m[:1], 1, "even").tolist() == [[1, 0, 0, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="state_spacing"):
        sparse_state_mask(m, 3, "random")


def test_sp3o_stratified_draws_one_state_per_stratum_reproducibly():
    from rlpost.algos.sp3o import sparse_state_mask

    m = torch.ones(64, 9)
    a = sparse_state_mask(m, 3, "stratified", torch.Generator().manual_seed(5))
    b = sparse_state_mask(m, 3, "stratified", torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    for lo in (0, 3, 6):  # strata [0, 3), [3, 6), [6, 9): exactly one state in each, every row
        assert a[:, lo:lo + 3].sum(-1).tolist() == [1.0] * 64
    assert len({tuple(r.nonzero().flatten().tolist()) for r in a}) > 1  # not the same positions every row


def test_sp3o_critic_gradient_comes_only_from_the_supervised_states(compose):
    import copy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import tiny_overrides
    from ds_worker import make_batch

    from rlpost.algos.sp3o import sparse_state_mask
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    policy = load_policy(ModelConfig(source="tiny"), seed=3)[0]
    cfg = compose(tiny_overrides("algo=sp3o", "trainer.grad_clip=0", "trainer.micro_batch_size=3"))
    grads = []

    def run(returns):
        t = TorchTrainer(copy.deepcopy(policy), cfg, "cpu")

        def capture(opt, params, clip):
            grads.append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]).clone())
            opt.zero_grad(set_to_none=True)
            return 0.0

        t._finite_step = capture
        b = make_batch(B=6, R=8)
        b.extras["returns"] = returns
        b.extras["values"] = torch.zeros(6, 8)
        t.critic_update(b)
        return b

    g = torch.Generator().manual_seed(0)
    ret = torch.randn(6, 8, generator=g)
    b = run(ret)
    keep = sparse_state_mask(b.response_mask, 3, "even")
    assert int(keep.sum()) == 18  # 3 states in each of the 6 rows (every row has >= 6 tokens)
    run(ret + 5.0 * (1 - keep))  # other targets: the same critic gradient
    assert torch.allclose(grads[0], grads[1])
    run(ret + 5.0 * keep)  # a supervised target moved: a different gradient
    assert not torch.allclose(grads[0], grads[2])
