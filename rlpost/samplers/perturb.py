"""``sampler=param_perturb``: exploration in parameter space (3PO).

Rollouts are drawn from several policies whose weights are Gaussian
perturbations of the current ones. The engine's weights (``engine.model``) are
perturbed in place for each parameter sample and restored bit-exactly afterwards
(a copy of each touched tensor is kept during the call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from rlpost.core.registry import Choice, param
from rlpost.samplers.base import SAMPLERS, SampleResult, Sampler, generate_groups, merge_results, pad_id_of, step_params


def perturbable(model: torch.nn.Module, targets: str = "linear") -> List[torch.nn.Parameter]:
    """Parameters that ``param_perturb`` adds noise to.

    ``targets='linear'``: weight matrices of ``nn.Linear`` layers except the LM
    head (the usual choice for weight noise; embeddings and norms stay exact).
    ``targets='all'``: every floating-point parameter.

    Raises:
        ValueError: unknown ``targets``.
    """
    if targets == "all":
        return [p for p in model.parameters() if p.is_floating_point()]
    if targets != "linear":
        raise ValueError("param_perturb targets must be 'linear' or 'all'")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out = []
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod is not head:
            out.append(mod.weight)
    return out


class Grouping(Choice):
    """How 3PO groups rollouts of several parameter samples."""

    across = "across"
    within = "within"


class PerturbTargets(Choice):
    """Which weights a parameter perturbation touches."""

    linear = "linear"
    all = "all"


@dataclass(frozen=True)
class ParamPerturbSamplerParams:
    """Parameters of :class:`ParamPerturbSampler` (Parameter-space exploration: ``n_policies`` perturbed copies share the group budget)."""

    n_policies: int = param(2, "parameter samples per step.")
    sigma: float = param(0.01, "relative noise scale.")
    include_base: bool = param(True, "sample 0 is the unperturbed policy.")
    grouping: Grouping = param(Grouping.across, "across: one group spans the parameter samples; within: one group per sample")
    targets: PerturbTargets = param(PerturbTargets.linear, "which weights get noise: linear layers or all (see :func:`perturbable`)")


@SAMPLERS.register(
    "param_perturb",
    paper="Parameter Exploration for RLVR via Variational Learning (3PO, arXiv:2608.09805)",
    description="Rollouts from several Gaussian weight perturbations of the policy.",
    params=ParamPerturbSamplerParams,
)
class ParamPerturbSampler(Sampler):
    """Parameter-space exploration: ``n_policies`` perturbed copies share the group budget.

    For parameter sample ``k`` every target tensor ``W`` becomes ``W + sigma *
    std(W) * eps`` with ``eps ~ N(0, 1)`` drawn from a generator seeded by the
    step seed and ``k`` (relative scale per tensor: our choice, so one
    ``sigma`` fits all layers). Sample ``k = 0`` is the unperturbed policy when
    ``include_base``. Each prompt's ``n_samples`` rollouts are split as evenly as
    possible over the samples. ``grouping=across`` keeps all of a prompt's
    rollouts in one group (baseline across parameter samples); ``within`` makes
    one group per (prompt, parameter sample), so the returned ``group_index``
    is ``prompt * n_policies + k`` and ``SampleResult.prompt_position`` holds the
    prompt position.

    Rollout log-probs are those of the perturbed policy that drew the token, so
    importance-ratio corrections against ``rollout_logprobs`` see the gap.

    Args:
        n_policies: parameter samples per step.
        sigma: relative noise scale.
        include_base: sample 0 is the unperturbed policy.
        grouping: ``across`` | ``within``.
        targets: ``linear`` | ``all`` (see :func:`perturbable`).

    Raises:
        ValueError: bad ``grouping``; (in sample) the engine exposes no ``model``.
    """

    def __init__(
        self,
        n_samples: int,
        *,
        n_policies: int,
        sigma: float,
        include_base: bool,
        grouping: str,
        targets: str,
    ) -> None:
        super().__init__(n_samples)
        if grouping not in ("across", "within"):
            raise ValueError("param_perturb grouping must be 'across' or 'within'")
        self.n_policies = max(1, int(n_policies))
        self.sigma = float(sigma)
        self.include_base = bool(include_base)
        self.grouping = grouping
        self.targets = targets

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        model = getattr(engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise ValueError("param_perturb needs an engine with a torch `.model` (rollout=hf)")
        P = len(prompts)
        K = min(self.n_policies, self.n_samples)
        per = [self.n_samples // K + (1 if k < self.n_samples % K else 0) for k in range(K)]
        tensors = perturbable(model, self.targets)
        parts: List[SampleResult] = []
        for k in range(K):
            saved = None
            if not (k == 0 and self.include_base) and self.sigma > 0:
                g = torch.Generator(device="cpu")
                g.manual_seed((int(ctx.seed) * 7919 + 104729 * (int(ctx.step) + 1) + k) % (2**62))
                saved = [t.detach().clone() for t in tensors]
                with torch.no_grad():
                    for t in tensors:
                        eps = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.device, t.dtype)
                        t.add_(eps * (self.sigma * t.detach().float().std().item()))
            try:
                res = generate_groups(engine, prompts, [per[k]] * P, step_params(params, ctx, k))
            finally:
                if saved is not None:
                    with torch.no_grad():
                        for t, s in zip(tensors, saved):
                            t.copy_(s)
            res.extras["param_sample"] = torch.full((res.group_index.shape[0],), k, dtype=torch.long)
            if self.grouping == "within":
                res.prompt_position = res.group_index.clone()
                res.group_index = res.group_index * K + k
            parts.append(res)
        out = merge_results(parts, pad_id_of(engine))
        out.metrics = {"sampler/param_samples": float(K)}
        return out
