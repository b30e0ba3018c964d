"""Mixture-of-experts routing replay: the trainer routes each token to the experts the rollout used.

In RL on MoE models the experts a token is routed to can differ between the rollout
engine and the trainer (numerics, a policy update between rollout and an
off-policy mini-batch), which makes the token-level importance ratio unstable.
Routing Replay ("Stabilizing Reinforcement Learning with LLMs: Formulation and
Practices", Zheng et al., arXiv:2512.01374) records each token's routed experts
during the rollout and replays them in the trainer's forward passes: the expert
*choice* is the rollout's, the gating weights are the current router's
probabilities of those experts (renormalised when the model normalises its top-k),
so the router still gets gradients. The predictive variant, PR2 ("PR2: Predictive
Routing Replay for MoE-Based LLM Reinforcement Learning", Dong et al.,
arXiv:2606.00395), is not implemented here.

Works with transformers' top-k routers of Qwen3-MoE and OLMoE (modules with
``weight [E, H]``, ``top_k``, ``norm_topk_prob``, whose forward maps ``[N, H]`` to
``(logits, scores, indices)``).

Route layout: ``routes [B, P + R, n_layers, k]`` long for a rollout batch laid
out as the trainer sees it (left-padded prompt of width ``P``, then the response
of width ``R``); ``-1`` where no route was recorded (padding, and the last
response token, which the engine never feeds back). A position with ``-1`` is
routed by the trainer's own router.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F


def moe_routers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The top-k router modules of ``model`` in forward (layer) order."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "weight")]


class RoutingReplay:
    """Records or replays the expert choices of every router of ``model``.

    Patches each router's ``forward`` (instance attribute; the class is untouched).
    Outside :meth:`record` / :meth:`replay` the routers behave exactly as before.

    Args:
        model: a transformers MoE causal LM (Qwen3-MoE, OLMoE).
    Raises:
        ValueError: ``model`` has no top-k routers.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no top-k MoE routers; routing replay needs an MoE model")
        self.k = int(self.routers[0].top_k)
        self.recording = False
        self.calls: List[List[torch.Tensor]] = [[] for _ in self.routers]
        self._routes: Optional[torch.Tensor] = None
        for layer, r in enumerate(self.routers):
            r.forward = self._make_forward(r, layer)

    @property
    def n_layers(self) -> int:
        """Number of routed layers."""
        return len(self.routers)

    def _make_forward(self, router: torch.nn.Module, layer: int):
        def forward(hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            h = hidden_states.reshape(-1, router.weight.shape[1])
            logits = F.linear(h, router.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            own = torch.topk(probs, router.top_k, dim=-1).indices
            idx = own
            if self._routes is not None:
                rep = self._routes[:, layer].to(own.device).long()
                if rep.shape != own.shape:
                    raise ValueError(f"replayed routes {tuple(rep.shape)} do not match the forward's tokens {tuple(own.shape)}")
                idx = torch.where((rep < 0).any(-1, keepdim=True), own, rep)
            vals = probs.gather(-1, idx)
            if getattr(router, "norm_topk_prob", False):
                vals = vals / vals.sum(-1, keepdim=True)
            if self.recording:
                self.calls[layer].append(idx.detach().cpu())
            return logits, vals.to(logits.dtype), idx

        return forward

    @contextlib.contextmanager
    def record(self) -> Iterator["RoutingReplay"]:
        """Within the block, every router call appends its ``[N, k]`` expert indices to :attr:`calls`."""
        self.calls = [[] for _ in self.routers]
        self.recording = True
        try:
            yield self
        finally:
            self.recording = False

    @contextlib.contextmanager
    def replay(self, routes: torch.Tensor) -> Iterator["RoutingReplay"]:
        """Within the block, a forward over ``N`` tokens routes them to ``routes`` ``[N, n_layers, k]``.

        ``N`` is the forward's flattened token count (``batch * seq``, row-major),
        i.e. ``routes_of_batch[b, p]`` flattened; rows with a ``-1`` use the
        router's own top-k.

        Raises:
            ValueError: (inside the forward) a token count that differs from ``routes``.
        """
        if routes.dim() != 3 or routes.shape[1:] != (self.n_layers, self.k):
            raise ValueError(f"routes must be [N, {self.n_layers}, {self.k}], got {tuple(routes.shape)}")
        self._routes = routes
        try:
            yield self
        finally:
            self._routes = None


def generate_with_routes(engine: Any, replayer: RoutingReplay, prompts: List[List[int]], params: Any):
    """Generate with the hf engine and record each token's routed experts.

    Args:
        engine: a :class:`rlpost.rollout.hf.HFRolloutEngine` whose model is ``replayer``'s.
        prompts, params: as :meth:`HFRolloutEngine.generate`.
    Returns:
        ``(GenerationResult, routes [B, P + R, n_layers, k] long)`` (see the module docstring).
    """
    engine.forward_log = []
    try:
        with replayer.record():
            gen = engine.generate(prompts, params)
        log = engine.forward_log
    finally:
        engine.forward_log = None
    B, P = gen.prompt_ids.shape
    R = gen.response_ids.shape[1]
    routes = torch.full((B, P + R, replayer.n_layers, replayer.k), -1, dtype=torch.long)
    for c, entry in enumerate(log):
        kind, off = entry[0], entry[1]
        for layer in range(replayer.n_layers):
            idx = replayer.calls[layer][c]
            if kind == "prefill":
                first, inverse, pb = entry[2], entry[3], entry[4]
                per = idx.view(len(first), pb, replayer.k)
                for j, u in enumerate(inverse.tolist()):
                    routes[off + j, P - pb : P, layer] = per[u]
            else:
                rows, t = entry[2], entry[3]
                routes[off + rows, P + t, layer] = idx.view(len(rows), replayer.k)
    return gen, routes


def routes_mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of positions (both recorded, ``>= 0``) whose *sets* of experts differ in ``a`` and ``b`` ``[..., k]``."""
    ok = (a >= 0).all(-1) & (b >= 0).all(-1)
    if not bool(ok.any()):
        return 0.0
    diff = (a.sort(-1).values != b.sort(-1).values).any(-1)
    return float(diff[ok].double().mean())
