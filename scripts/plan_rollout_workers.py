#!/usr/bin/env python
"""Print ECHO-2's provisioning rule for a config: how many rollout workers (of which kinds) keep the learner busy.

Composes the config from the overrides (``launcher=ray`` is added when absent), applies
:func:`rlpost.ray_pool.provisioning.plan_from_config` to ``launcher.provisioning`` and prints
``R``, ``T_train``, ``S``, ``kappa``, ``T_bcast``, the required rollouts/s, the workers (and the
cheapest activated kinds), the learner's predicted utilization and, with a broadcast model,
the pipelined relay chain against one-to-many uploads at that pool size. Loads no model.
Paper: "ECHO-2: A Large-Scale Distributed Rollout Framework for Cost-Efficient Reinforcement
Learning" (arXiv:2602.02192); the formulas are our reading (docs/SCALING.md, "ECHO-2").

    python scripts/plan_rollout_workers.py executor=async executor.max_staleness=3 \\
        launcher.provisioning.train_s=40 launcher.provisioning.worker_rollouts_per_s=0.5 \\
        launcher.provisioning.model_bytes=16e9 launcher.provisioning.link_bytes_per_s=1.25e9 \\
        launcher.provisioning.chunks=64
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's rlpost, not an installed copy


def main(argv: list) -> int:
    from rlpost.config.compose import compose_config
    from rlpost.core.errors import ConfigError
    from rlpost.ray_pool import provisioning as P

    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    overrides = list(argv)
    if not any(a.startswith("launcher=") for a in overrides):
        overrides.insert(0, "launcher=ray")
    try:
        cfg = compose_config(overrides)
        plan = P.plan_from_config(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(plan.lines()))
    p = P.check_provisioning(cfg.launcher.get("provisioning"))
    if p["bcast_s"] is None and p["model_bytes"] is not None:
        m, b, n = float(p["model_bytes"]), float(p["link_bytes_per_s"]), plan.n_workers
        print(f"broadcast at {n} workers: relay chain of {p['chunks']} chunks {plan.bcast_s:.4g} s, "
              f"one-to-many from the learner {P.one_to_many_broadcast_s(m, b, n):.4g} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
