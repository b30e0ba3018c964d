"""Worker for tests/test_data_parallel.py: two RL steps of one config, run in-process or under torchrun.

Usage: torchrun --nproc_per_node=2 tests/dp_worker.py OUT_DIR [OVERRIDE ...]   (trainer=deepspeed, sharded
rollouts; the overrides replace the default config's, e.g. ``algo=t5`` for a two-head critic)
Writes (rank 0) ``OUT_DIR/result.pt``: per step the batch's prompt indices, response ids
and mask, rewards, advantages, old/ref log-probs and the logged metrics; the policy weights
after the last step; the rows each rank generated.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's rlpost, not an installed copy

from conftest import tiny_overrides  # noqa: E402

# REINFORCE++ (batch whitening, KL in the reward: old and reference log-prob passes), two
# mini-batches, a per-token length penalty and a stop string (the random model's responses end
# at 1 to 12 tokens) so rewards differ between rows, 5 prompts (uneven
# over two ranks: 3 + 2 groups).
OVERRIDES = ["algo=reinforce_pp", "algo.mini_batches=2", "task.reward.length_penalty=0.02",
             "selector.prompts_per_step=5", "trainer.lr=1e-3", "trainer.micro_batch_size=4", "steps=2",
             "eval.at_end=false", "checkpoint.every=0", "rollout.stop=[k]"]


def run(out: Path, engine: str, overrides=None) -> dict:
    """Two steps with ``trainer=<engine>``; returns what the test compares (``values`` too with a critic)."""
    from rlpost.config.compose import compose_config
    from rlpost.run.runner import Run

    cfg = compose_config(tiny_overrides(*(OVERRIDES if overrides is None else overrides), f"trainer={engine}"))
    r = Run(cfg, out / f"run_{engine}")
    steps = []
    try:
        for _ in range(2):
            c = r.collect(r.step + 1, r.trainer.version, r.step)
            m = r.learn(c)
            b = c.batch
            steps.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in {
                "prompt_index": b.prompt_index, "response_ids": b.response_ids, "response_mask": b.response_mask,
                "rewards": b.rewards, "advantages": b.extras["advantages"], "old_logprobs": b.extras["old_logprobs"],
                "ref_logprobs": b.extras.get("ref_logprobs"), "values": b.extras.get("values"), "metrics": m}.items()})
        from rlpost.distributed import all_gather_object

        return {"steps": steps, "shard": r.shard, "rows_per_rank": all_gather_object(getattr(r.engine, "rows_generated", -1)),
                "weights": {k: v.detach().clone() for k, v in r.trainer.policy.state_dict().items()}}
    finally:
        r.close()


if __name__ == "__main__":
    import torch.distributed as dist

    out_dir = Path(sys.argv[1])
    res = run(out_dir, "deepspeed", sys.argv[2:] or None)
    if dist.get_rank() == 0:
        torch.save(res, out_dir / "result.pt")
