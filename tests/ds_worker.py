"""Worker for tests/test_deepspeed.py, run under torchrun: DeepSpeed steps on a fixed batch.

Usage: torchrun --nproc_per_node=2 tests/ds_worker.py OUT_DIR
Writes (rank 0) ``zero{2,3}.pt`` (weights after one update), ``resumed.pt`` /
``continued.pt`` / ``fresh_opt.pt`` (second update after resume, uninterrupted, and with a
fresh optimizer) and ``metrics_zero2.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's rlpost, not an installed copy

from conftest import tiny_overrides  # noqa: E402


def make_batch(seed: int = 0, B: int = 8, P: int = 5, R: int = 6):
    """A fixed synthetic rollout batch for the tiny model (ids < 1000, ragged masks)."""
    from rlpost.core.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    resp_mask = torch.ones(B, R)
    for i in range(B):
        resp_mask[i, R - (i % 3):] = 0
    return RolloutBatch(
        prompt_ids=torch.randint(10, 1000, (B, P), generator=g), prompt_mask=torch.ones(B, P, dtype=torch.long),
        response_ids=torch.randint(10, 1000, (B, R), generator=g), response_mask=resp_mask,
        rollout_logprobs=-torch.rand(B, R, generator=g) * resp_mask, group_index=torch.arange(B) // 4,
        prompt_index=torch.arange(B) // 4, policy_version=torch.zeros(B, dtype=torch.long),
        extras={"advantages": torch.randn(B, 1, generator=g).expand(B, R) * resp_mask},
    )


def overrides(engine: str, stage: int = 2):
    return tiny_overrides(f"trainer={engine}", f"trainer.zero_stage={stage}", "trainer.lr=1e-3",
                          "trainer.micro_batch_size=2", "trainer.grad_clip=1.0", "algo.mini_batches=2", "steps=4")


def make_trainer(engine: str, stage: int = 2, run_dir=None, critic: bool = False):
    from rlpost.config.compose import compose_config
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy

    extra = ["algo.critic.enabled=true", "algo.critic.lr=1e-3"] if critic else []
    cfg = compose_config(overrides(engine, stage) + extra)
    policy, _ = load_policy(ModelConfig(source="tiny"), seed=3)
    if engine == "deepspeed":
        from rlpost.trainer.deepspeed_engine import DeepSpeedTrainer

        return DeepSpeedTrainer.from_config(policy, cfg, "cpu", run_dir=run_dir)
    from rlpost.trainer.torch_engine import TorchTrainer

    return TorchTrainer.from_config(policy, cfg, "cpu")


def critic_batch():
    """:func:`make_batch` with value targets (``returns``) and rollout-time ``values`` for a critic update."""
    b = make_batch(2)
    g = torch.Generator().manual_seed(5)
    b.extras["returns"] = torch.randn(b.response_mask.shape, generator=g) * b.response_mask
    b.extras["values"] = torch.zeros_like(b.response_mask)
    return b


def critic_weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.critic.state_dict().items()}


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


def main(out: Path) -> None:
    from rlpost.trainer.deepspeed_engine import init_distributed, is_main_process

    init_distributed()
    batch = make_batch()
    for stage in (2, 3):
        t = make_trainer("deepspeed", stage)
        m = t.policy_update(batch, torch.Generator().manual_seed(0))
        if is_main_process():
            torch.save(weights(t), out / f"zero{stage}.pt")
            torch.save(m, out / f"metrics_zero{stage}.pt")
    # SAO/PPO critic inside its own ZeRO-3 engine: one critic update (weights gathered module by module)
    from rlpost.trainer.deepspeed_engine import gathered_named_parameters

    t = make_trainer("deepspeed", 3, critic=True)
    cm = t.critic_update(critic_batch())
    full = {n: p for n, p in gathered_named_parameters(t.critic)}
    if is_main_process():
        torch.save({"weights": full, "metrics": cm, "engine": type(t.critic_engine).__name__}, out / "critic_zero3.pt")
    # resume: step, checkpoint, step (continued) vs fresh trainer + load + step (resumed)
    t = make_trainer("deepspeed", 2, run_dir=out / "run")
    t.policy_update(batch, torch.Generator().manual_seed(0))
    sd = t.state_dict()
    t.policy_update(make_batch(1), torch.Generator().manual_seed(1))
    if is_main_process():
        torch.save(weights(t), out / "continued.pt")
    t2 = make_trainer("deepspeed", 2, run_dir=out / "run")
    t2.load_state_dict(sd)
    assert t2.version == 2, t2.version
    t2.policy_update(make_batch(1), torch.Generator().manual_seed(1))
    if is_main_process():
        torch.save(weights(t2), out / "resumed.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
