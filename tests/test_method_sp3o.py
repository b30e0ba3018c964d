"""SP3O's sparse critic supervision: which states are supervised and that the critic's gradient comes only
from them. Moved unchanged from tests/test_methods_tbrm_sp3o_dppo_sapo.py.
"""

import pytest
import torch


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
        t = TorchTrainer.from_config(copy.deepcopy(policy), cfg, "cpu")

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
