"""Per-prompt baselines used by algorithm presets.

One small stateful tracker (a per-prompt Beta posterior) that single-rollout
estimators read through ``AdvantageInput.baseline_rewards``. Reward shaping
(DAPO's overlong punishment, length penalties) is not here: the reward function
(:mod:`rlpost.rewards`) owns it.
"""

from __future__ import annotations

from typing import Dict, Iterable, List

import torch


class BetaBaselineTracker:
    """Per-prompt success estimate from a discounted Beta posterior.

    For a prompt with Bernoulli-like reward ``r`` in [0, 1] the posterior is
    ``Beta(alpha, beta)``; after each observation ``alpha <- rho * alpha + r`` and
    ``beta <- rho * beta + (1 - r)`` (``rho`` < 1 forgets old evidence as the policy
    changes). The baseline is the posterior mean ``alpha / (alpha + beta)``. This
    is the group-free baseline that single-rollout methods (MSSR,
    arXiv:2512.18215; SPO, arXiv:2509.13232) use instead of a group mean.
    Rewards outside [0, 1] are clipped into it.

    Args:
        prior_alpha, prior_beta: the prior (1, 1 = uniform: baseline 0.5).
        rho: discount of past evidence per update, in (0, 1].
    """

    def __init__(self, prior_alpha: float = 1.0, prior_beta: float = 1.0, rho: float = 0.9) -> None:
        if not 0.0 < rho <= 1.0:
            raise ValueError(f"rho must be in (0, 1], got {rho}")
        self.prior = (float(prior_alpha), float(prior_beta))
        self.rho = float(rho)
        self.state: Dict[int, List[float]] = {}

    def baseline(self, prompt_index: Iterable[int]) -> torch.Tensor:
        """``[B]`` posterior means for the prompts (the prior mean for unseen ones)."""
        out = []
        for p in prompt_index:
            a, b = self.state.get(int(p), list(self.prior))
            out.append(a / (a + b))
        return torch.tensor(out, dtype=torch.float32)

    def update(self, prompt_index: Iterable[int], rewards: Iterable[float]) -> None:
        """Fold one reward per entry into its prompt's posterior (call after :meth:`baseline`)."""
        for p, r in zip(prompt_index, rewards):
            r = min(max(float(r), 0.0), 1.0)
            a, b = self.state.get(int(p), list(self.prior))
            self.state[int(p)] = [self.rho * a + r, self.rho * b + (1.0 - r)]

    def state_dict(self) -> Dict[str, object]:
        """Serializable state (for checkpoints)."""
        return {"prior": list(self.prior), "rho": self.rho, "state": {str(k): list(v) for k, v in self.state.items()}}

    def load_state_dict(self, sd: Dict[str, object]) -> None:
        """Restore :meth:`state_dict` output."""
        self.prior = tuple(sd["prior"])  # type: ignore[assignment]
        self.rho = float(sd["rho"])  # type: ignore[arg-type]
        self.state = {int(k): list(v) for k, v in dict(sd["state"]).items()}  # type: ignore[arg-type]
