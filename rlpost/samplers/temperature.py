"""``sampler=adaptive_temperature``: HAPO's per-token adaptive temperature during rollout.

This sampler is the one owner of per-token temperature in rlpost (``algo=hapo``
requires it; :func:`rlpost.methods.hapo.check_sampler`). The temperature rule is
:func:`rlpost.algos.hapo.make_temperature_hook` (imported lazily); the sampler
supplies the normalisation statistics it needs: the log-entropy statistics of
the previous step's rollouts, recorded from the very logits the hook sees while
generating (so no extra forward pass), saved in its :meth:`state_dict`.
(:meth:`AdaptiveTemperatureSampler.set_entropy_stats` replaces them, for tests.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from rlpost.algos.hapo import EntropyStats, entropy_hhat, make_temperature_hook
from rlpost.core.registry import param
from rlpost.samplers.base import SAMPLERS, Sampler, generate_groups, step_params


@dataclass(frozen=True)
class AdaptiveTemperatureSamplerParams:
    """Parameters of :class:`AdaptiveTemperatureSampler` (``n_samples`` rollouts per prompt with ``T = T0 (1 + tau * h_hat)`` per token)."""

    tau: float = param(0.05, "relative temperature range in [0, 1) (HAPO's released 0.05).")
    entropy_pivot: float = param(0.5, "quantile of log-entropy used as the centre.")


@SAMPLERS.register(
    "adaptive_temperature",
    paper="HAPO: From Uniform to Heterogeneous: Tailoring Policy Optimization to Every Token's Nature (arXiv:2509.16591)",
    description="Group sampling with HAPO's entropy-driven per-token temperature.",
    params=AdaptiveTemperatureSamplerParams,
    process_local_hooks="the token entropies its temperature hook collects",
)
class AdaptiveTemperatureSampler(Sampler):
    """``n_samples`` rollouts per prompt with ``T = T0 (1 + tau * h_hat)`` per token.

    ``h_hat`` is the normalised log-entropy of the next-token distribution under
    the statistics of the previous step's rollouts (first step: plain ``T0``).
    The statistics come from the token entropies the hook computed while
    sampling, restricted to real response tokens.

    Args:
        tau: relative temperature range in [0, 1) (HAPO's released 0.05).
        entropy_pivot: quantile of log-entropy used as the centre.
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int, *, tau: float, entropy_pivot: float) -> None:
        super().__init__(n_samples)
        self.tau = float(tau)
        self.entropy_pivot = float(entropy_pivot)
        self.stats = None

    def set_entropy_stats(self, stats: Any) -> None:
        """Use ``stats`` (a :class:`rlpost.algos.hapo.EntropyStats`) for the next step."""
        self.stats = stats

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class

        inner = make_temperature_hook(float(params.temperature), self.stats, self.tau)
        chunks: List[List[torch.Tensor]] = []

        def hook(logits: torch.Tensor, t: int) -> torch.Tensor:
            if t == 0:
                chunks.append([])
            logp = torch.log_softmax(logits.float(), -1)
            chunks[-1].append(-(logp.exp() * logp).sum(-1).detach().cpu())
            return inner(logits, t)

        p = dataclasses.replace(step_params(params, ctx, 0), temperature_hook=hook)
        res = generate_groups(engine, prompts, self.counts(len(prompts), ctx), p)
        gen = res.generation
        R = gen.response_mask.shape[1]
        rows = []
        for ch in chunks:
            e = torch.stack(ch, 1)
            rows.append(torch.nn.functional.pad(e, (0, max(0, R - e.shape[1])))[:, :R])
        if rows and sum(r.shape[0] for r in rows) == gen.response_mask.shape[0]:
            ent = torch.cat(rows)
            _, self.stats = entropy_hhat(ent, gen.response_mask, self.entropy_pivot)
            res.metrics["sampler/mean_token_entropy"] = float((ent * gen.response_mask).sum() / gen.response_mask.sum().clamp(min=1))
        m = gen.response_mask > 0
        if m.any():
            res.metrics["sampler/temperature_mean"] = float(gen.temperatures[m].mean())
        return res

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102 - the entropy statistics
        return {"stats": dataclasses.asdict(self.stats) if self.stats is not None else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # noqa: D102

        s = state.get("stats")
        self.stats = EntropyStats(**s) if s else None
