"""Speed changes of the trainer keep its numbers: fused AdamW against the multi-tensor AdamW.

Tolerance: 1e-7 absolute on weights after three optimizer steps (fp32; weights of scale 0.02,
steps of scale lr = 1e-3; the two kernels round the same formula in a different order).
"""

import torch


def test_fused_adamw_matches_foreach_adamw(compose):
    from conftest import tiny_overrides

    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides("precision=fp32", "trainer.lr=1e-3", "trainer.weight_decay=0.01"))
    weights = {}
    for fused in (False, True):
        model, _ = load_policy(ModelConfig(source="tiny"), seed=1)
        TorchTrainer.fused_adamw = fused
        try:
            tr = TorchTrainer.from_config(model, cfg)
        finally:
            TorchTrainer.fused_adamw = True
        assert tr.opt.defaults.get("fused") is (True if fused else None)
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            for p in tr.policy.parameters():
                p.grad = torch.randn(p.shape, generator=g) * 1e-2
            tr.opt.step()
            tr.opt.zero_grad(set_to_none=True)
        weights[fused] = torch.cat([p.detach().flatten() for p in tr.policy.parameters()])
    moved = (weights[True] - torch.cat([p.detach().flatten() for p in load_policy(ModelConfig(source="tiny"), seed=1)[0].parameters()])).abs().max()
    assert moved > 1e-3  # the steps did change the weights
    assert (weights[True] - weights[False]).abs().max() < 1e-7
