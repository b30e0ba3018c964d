"""Mixture-of-experts routing replay: the trainer routes each token to the experts the rollout used.

In RL on MoE models the experts a token is routed to can differ between the rollout
engine and the trainer (numerics, a policy update between rollout and an
off-policy mini-batch), which makes the token-level importance ratio unstable.
Rollout Routing Replay, R3 ("Stabilizing MoE Reinforcement Learning by Aligning
Training and Inference Routers", Ma et al., arXiv:2510.11370; Routing Replay in
"Stabilizing Reinforcement Learning with LLMs: Formulation and Practices", Zheng
et al., arXiv:2512.01374) records each token's routed experts
during the rollout and replays them in the trainer's forward passes: the expert
*choice* is the rollout's, the gating weights are the current router's
probabilities of those experts (renormalised when the model normalises its top-k),
so the router still gets gradients.

The predictive variant, PR2 ("PR2: Predictive Routing Replay for MoE-Based LLM
Reinforcement Learning", Dong et al., arXiv:2606.00395; ``model.routing_replay=pr2``),
gives each router an evolution predictor of its short-horizon drift: the rollout
routes every token by top-k of the *predicted* router distribution (so experts that
are about to become active get the token and its gradient), records that route, and
the trainer replays it. What PR2's abstract fixes: a lightweight predictor per router,
a short horizon, predicted top-k at rollout, replay of the predicted route in training.
What we could not read (its method section is not reachable to us, and no code is
released) and chose: :class:`RouterEvolutionPredictor` (a constant-velocity model of
the router weights fitted online, horizon counted in policy updates).

Wiring (``model.routing_replay``): :func:`attach_routing` wraps the hf engine in a
:class:`RouteRecordingEngine` that stores each generated row's routes in a
:class:`RouteStore` keyed by the row's tokens (:func:`row_key`), and gives the
trainer a :class:`TrainerRouting` whose :meth:`~TrainerRouting.context` wraps each
log-prob forward (old log-probs and update) in :meth:`RoutingReplay.replay`.

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
from rlpost.core.errors import ConfigError


class RouterEvolutionPredictor:
    """PR2's per-router evolution predictor, our reading: a constant-velocity model of each router.

    PR2 ("PR2: Predictive Routing Replay for MoE-Based LLM Reinforcement Learning", Dong et al.,
    arXiv:2606.00395) augments every router with a lightweight predictor of its short-horizon
    evolution and routes rollout tokens by top-k of the predicted distribution. The paper's
    predictor form, input, target and horizon were not available to us; our choices:

    * **State** per router ``l``: a velocity ``v_l`` ``[E, H]`` (float32, the router weight's
      shape), the expected change of the router weight ``W_l`` ``[E, H]`` over one policy update
      (one :meth:`rlpost.trainer.torch_engine.TorchTrainer.policy_update`, all its optimizer steps).
    * **Fit** after every update from the observed change ``D_l = W_l(after) - W_l(before)``:
      ``v_l = D_l`` at the first update, then ``v_l <- ema * v_l + (1 - ema) * D_l`` (the
      least-squares constant velocity of the recent updates, exponentially weighted). A router is
      linear in its input, so predicting its logits' change for every token is predicting ``D_l``.
    * **Prediction**: the router logits ``horizon`` updates ahead, ``z + horizon * h v_l^T`` for
      router input ``h`` ``[N, H]`` and current logits ``z`` ``[N, E]``. The rollout takes the
      top-k experts of that; the gating weights stay the *current* router's probabilities of the
      chosen experts (renormalised as the model does), in the rollout and in the trainer's replay
      alike, so rollout and trainer run the same forward at the same weights.

    Until the first update the predictor has no velocity and the rollout routes as plain replay.

    Args:
        horizon: prediction horizon in policy updates (>= 0; 0: plain routing replay).
        ema: weight of the previous velocity in ``[0, 1)``.
    Raises:
        ValueError: ``horizon < 0`` or ``ema`` outside ``[0, 1)``; (from :meth:`end_update`)
            router shapes that changed since :meth:`begin_update`.
    """

    def __init__(self, horizon: float = 1.0, ema: float = 0.5) -> None:
        if not float(horizon) >= 0:
            raise ValueError(f"PR2 horizon must be >= 0 policy updates, got {horizon}")
        if not 0.0 <= float(ema) < 1.0:
            raise ValueError(f"PR2 ema must lie in [0, 1), got {ema}")
        self.horizon, self.ema = float(horizon), float(ema)
        self.velocity: List[torch.Tensor] = []  # [E, H] float32 per router, empty before the first update
        self.updates = 0
        self._before: Optional[List[torch.Tensor]] = None
        #: ``[changed, total]`` rollout token-layers whose predicted top-k set differs from the current router's
        self.stats = [0, 0]

    def begin_update(self, routers: List[torch.nn.Module]) -> None:
        """Snapshot the router weights before a policy update."""
        self._before = [r.weight.detach().float().cpu().clone() for r in routers]

    def end_update(self, routers: List[torch.nn.Module]) -> None:
        """Fit the velocities to the change since :meth:`begin_update` (no-op without a snapshot)."""
        if self._before is None:
            return
        after = [r.weight.detach().float().cpu() for r in routers]
        if [a.shape for a in after] != [b.shape for b in self._before]:
            raise ValueError("router shapes changed between begin_update and end_update")
        deltas = [a - b for a, b in zip(after, self._before)]
        if not self.velocity:
            self.velocity = deltas
        else:
            self.velocity = [self.ema * v + (1.0 - self.ema) * d for v, d in zip(self.velocity, deltas)]
        self.updates += 1
        self._before = None

    def route(self, layer: int, h: torch.Tensor, logits: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """Top-k experts ``[N, k]`` of the predicted logits of router ``layer``.

        Args:
            h: router inputs ``[N, H]``; logits: the current router's logits ``[N, E]``;
            own: the current router's own top-k ``[N, k]`` (returned as is without a velocity).
        """
        if not self.velocity or self.horizon == 0.0:
            return own
        v = self.velocity[layer].to(device=h.device, dtype=h.dtype)
        pred = torch.topk(logits + self.horizon * F.linear(h, v), own.shape[-1], dim=-1).indices
        with torch.no_grad():
            self.stats[0] += int((pred.sort(-1).values != own.sort(-1).values).any(-1).sum())
            self.stats[1] += int(pred.shape[0])
        return pred

    def state_dict(self) -> dict:
        """Velocities and update count (for checkpoints)."""
        return {"velocity": [v.clone() for v in self.velocity], "updates": self.updates}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.velocity = [torch.as_tensor(v).float() for v in sd.get("velocity", [])]
        self.updates = int(sd.get("updates", 0))


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
        self._enforce = True
        self._predictor: Optional[RouterEvolutionPredictor] = None  # set by record(predictor=...) only
        #: ``[disagreeing, compared]`` token-layer counts since :meth:`reset_stats`: positions with a
        #: replayed route where the router's own top-k set differs from it
        self.stats = [0, 0]
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
                missing = (rep < 0).any(-1, keepdim=True)
                with torch.no_grad():
                    have = ~missing.squeeze(-1)
                    diff = (own.sort(-1).values != rep.sort(-1).values).any(-1) & have
                    self.stats[0] += int(diff.sum())
                    self.stats[1] += int(have.sum())
                if self._enforce:
                    idx = torch.where(missing, own, rep)
            elif self._predictor is not None:  # PR2 rollout: top-k of the predicted router
                idx = self._predictor.route(layer, h, logits, own)
            vals = probs.gather(-1, idx)
            if getattr(router, "norm_topk_prob", False):
                vals = vals / vals.sum(-1, keepdim=True)
            if self.recording:
                self.calls[layer].append(idx.detach().cpu())
            return logits, vals.to(logits.dtype), idx

        return forward

    @contextlib.contextmanager
    def record(self, predictor: Optional[RouterEvolutionPredictor] = None) -> Iterator["RoutingReplay"]:
        """Within the block, every router call appends its ``[N, k]`` expert indices to :attr:`calls`.

        ``predictor`` (PR2, a rollout's forwards): calls without replayed routes take the top-k of
        its predicted router instead of the router's own.
        """
        self.calls = [[] for _ in self.routers]
        self.recording, self._predictor = True, predictor
        try:
            yield self
        finally:
            self.recording, self._predictor = False, None

    def reset_stats(self) -> None:
        """Zero :attr:`stats`."""
        self.stats = [0, 0]

    @contextlib.contextmanager
    def replay(self, routes: torch.Tensor, enforce: bool = True) -> Iterator["RoutingReplay"]:
        """Within the block, a forward over ``N`` tokens routes them to ``routes`` ``[N, n_layers, k]``.

        ``N`` is the forward's flattened token count (``batch * seq``, row-major),
        i.e. ``routes_of_batch[b, p]`` flattened; rows with a ``-1`` use the
        router's own top-k. Either way :attr:`stats` counts the token-layers whose
        own top-k set differs from the given route. ``enforce=False`` only counts
        (the baseline without replay: the router's own choice is used).

        Raises:
            ValueError: (inside the forward) a token count that differs from ``routes``.
        """
        if routes.dim() != 3 or routes.shape[1:] != (self.n_layers, self.k):
            raise ValueError(f"routes must be [N, {self.n_layers}, {self.k}], got {tuple(routes.shape)}")
        self._routes, self._enforce = routes, bool(enforce)
        try:
            yield self
        finally:
            self._routes, self._enforce = None, True


def generate_with_routes(engine: Any, replayer: RoutingReplay, prompts: List[List[int]], params: Any,
                         predictor: Optional[RouterEvolutionPredictor] = None):
    """Generate with the hf engine and record each token's routed experts.

    Args:
        engine: a :class:`rlpost.rollout.hf.HFRolloutEngine` whose model is ``replayer``'s.
        prompts, params: as :meth:`HFRolloutEngine.generate`.
        predictor: PR2's predictor: the tokens are routed (and recorded) by its predicted router.
    Returns:
        ``(GenerationResult, routes [B, P + R, n_layers, k] long)`` (see the module docstring).
    """
    engine.forward_log = []
    try:
        with replayer.record(predictor):
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


# ------------------------------------------------------------ wiring: rollout engine -> trainer
ROUTING_MODES = ("off", "record", "replay", "pr2")


def row_key(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
            response_attn: torch.Tensor) -> Tuple[int, ...]:
    """The token sequence that identifies one rollout row: real prompt tokens, then the response
    up to its last attended position (``[P]``, ``[P]``, ``[R]``, ``[R]`` tensors of one row).

    A causal model's routes at a position depend only on the tokens up to it, so two rows with
    the same key were routed alike by the same weights; the store can key on tokens and
    survive every sampler's row selection, merging and regrouping.
    """
    nz = torch.nonzero(response_attn > 0).flatten()
    n = int(nz[-1]) + 1 if len(nz) else 0
    return tuple(prompt_ids[prompt_mask > 0].tolist()) + (-1,) + tuple(response_ids[:n].tolist())


class RouteStore:
    """Routes recorded at rollout time, keyed by :func:`row_key`.

    Each entry is ``[n_prompt + n_response, n_layers, k]`` int16 (``-1`` where not
    recorded). Holds at most ``capacity`` rows (oldest evicted): enough for the
    batches between a rollout and its update, including an asynchronous executor's
    in-flight ones.
    """

    def __init__(self, capacity: int = 8192) -> None:
        import collections

        self.capacity = int(capacity)
        self._rows: "collections.OrderedDict[Tuple[int, ...], torch.Tensor]" = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, gen: Any, routes: torch.Tensor) -> None:
        """Store every row of ``gen`` (a :class:`GenerationResult`) with its ``routes [B, P + R, L, k]``."""
        P = gen.prompt_ids.shape[1]
        for b in range(gen.prompt_ids.shape[0]):
            key = row_key(gen.prompt_ids[b], gen.prompt_mask[b], gen.response_ids[b], gen.response_mask[b])
            n_resp = len(key) - int((gen.prompt_mask[b] > 0).sum()) - 1
            r = torch.cat([routes[b, :P][gen.prompt_mask[b] > 0], routes[b, P : P + n_resp]])
            self._rows[key] = r.to(torch.int16)
            self._rows.move_to_end(key)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)

    def batch_routes(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                     response_attn: torch.Tensor, n_layers: int, k: int) -> Tuple[torch.Tensor, int]:
        """``(routes [B, P + R, n_layers, k] long, rows found)`` for a trainer micro-batch laid out as
        :func:`rlpost.models.logprobs.build_inputs` lays it out; rows not in the store get ``-1``."""
        B, P = prompt_ids.shape
        R = response_ids.shape[1]
        out = torch.full((B, P + R, n_layers, k), -1, dtype=torch.long)
        found = 0
        for b in range(B):
            pm, ra = prompt_mask[b].cpu(), response_attn[b].cpu()
            r = self._rows.get(row_key(prompt_ids[b].cpu(), pm, response_ids[b].cpu(), ra))
            if r is None:
                continue
            found += 1
            n_p = int((pm > 0).sum())
            cols = torch.cat([torch.nonzero(pm > 0).flatten(), P + torch.arange(r.shape[0] - n_p)])
            out[b, cols] = r.long()
        return out, found


class RouteRecordingEngine:
    """An hf rollout engine that records each generated row's routes into a :class:`RouteStore`.

    Every other attribute is the wrapped engine's. When the engine's module is
    replaced (a non-invertible rollout conversion rebuilds its copy after each
    update) the new module's routers are patched on the next call.

    Args:
        engine: :class:`rlpost.rollout.hf.HFRolloutEngine`.
        store: where routes go.
        replayer: the :class:`RoutingReplay` of ``engine.model`` when it is the
            trainer's module (weights shared; one patch per module), else None.
        predictor: PR2's :class:`RouterEvolutionPredictor` (the trainer's): the recorded routes
            are its predicted top-k; None: the router's own.
    """

    def __init__(self, engine: Any, store: RouteStore, replayer: Optional[RoutingReplay] = None,
                 predictor: Optional[RouterEvolutionPredictor] = None) -> None:
        self.__dict__["_engine"] = engine
        self.__dict__["store"] = store
        self.__dict__["predictor"] = predictor
        self.__dict__["_rr"] = replayer if replayer is not None else RoutingReplay(engine.model)
        self.__dict__["_module"] = engine.model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._engine, name, value)

    def generate(self, prompts: List[List[int]], params: Any):
        """:meth:`HFRolloutEngine.generate`, storing the rows' routes.

        PR2's predicted routes are used for sampled rollouts only: a greedy call (evaluation)
        routes by the current router, so held-out accuracy measures the policy itself.
        """
        if self._engine.model is not self._module:
            self.__dict__["_rr"] = RoutingReplay(self._engine.model)
            self.__dict__["_module"] = self._engine.model
        predictor = None if getattr(params, "greedy", False) else self.predictor
        gen, routes = generate_with_routes(self._engine, self._rr, prompts, params, predictor)
        self.store.put(gen, routes)
        return gen


class TrainerRouting:
    """The trainer side of routing replay: wraps the policy's forwards in :meth:`RoutingReplay.replay`.

    ``mode="replay"`` (R3: "Stabilizing MoE Reinforcement Learning by Aligning
    Training and Inference Routers", Ma et al., arXiv:2510.11370; Routing Replay in
    Zheng et al., arXiv:2512.01374) routes every recorded token-layer to the
    rollout's experts in both the old-log-prob pass and the update forwards;
    ``mode="record"`` leaves the router alone and only measures how often it
    disagrees with the rollout (the baseline's drift).

    Metrics (:meth:`metrics`, since the last call): ``moe/route_mismatch``, share of
    compared token-layers where the trainer's own top-k set differs from the
    rollout's; ``moe/replay_coverage``, share of forwarded rows found in the store.

    ``mode="pr2"`` (PR2, arXiv:2606.00395) replays like ``replay``; the routes it replays
    were chosen at rollout time by :attr:`predictor` (:class:`RouterEvolutionPredictor`,
    refitted by :meth:`begin_update` / :meth:`end_update` around every policy update).
    Extra metrics: ``moe/pr2_predicted_flip``, share of rollout token-layers whose predicted
    top-k set differed from the current router's; ``moe/pr2_velocity_norm``, the Frobenius
    norm of the predicted per-update change, summed over routers.

    Args:
        policy: the trained MoE module; mode: ``record``, ``replay`` or ``pr2``;
        store: the route store (a new one when None);
        predictor: ``pr2``'s predictor (None: one with the default settings); ignored by the other modes.
    Raises:
        ValueError: an unknown mode, a model without top-k routers.
    """

    def __init__(self, policy: torch.nn.Module, mode: str, store: Optional[RouteStore] = None,
                 predictor: Optional[RouterEvolutionPredictor] = None) -> None:
        if mode not in ROUTING_MODES[1:]:
            raise ValueError(f"routing mode must be one of {ROUTING_MODES[1:]}, got {mode!r}")
        self.mode = mode
        self.rr = RoutingReplay(policy)
        self.store = store if store is not None else RouteStore()
        self.rows = [0, 0]  # found, forwarded
        self.predictor = (predictor or RouterEvolutionPredictor()) if mode == "pr2" else None

    def begin_update(self) -> None:
        """Called by the trainer before a policy update (PR2: snapshot the routers)."""
        if self.predictor is not None:
            self.predictor.begin_update(self.rr.routers)

    def end_update(self) -> None:
        """Called by the trainer after a policy update (PR2: refit the predictor)."""
        if self.predictor is not None:
            self.predictor.end_update(self.rr.routers)

    def state_dict(self) -> dict:
        """The predictor's state (empty unless ``pr2``)."""
        return {"pr2": self.predictor.state_dict()} if self.predictor is not None else {}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict`."""
        if self.predictor is not None and "pr2" in sd:
            self.predictor.load_state_dict(sd["pr2"])

    def context(self, prompt_ids, prompt_mask, response_ids, response_attn):
        """The replay context for one forward over these ``[B, P]`` / ``[B, R]`` inputs."""
        routes, found = self.store.batch_routes(prompt_ids, prompt_mask, response_ids, response_attn,
                                                self.rr.n_layers, self.rr.k)
        self.rows[0] += found
        self.rows[1] += routes.shape[0]
        B, T = routes.shape[:2]
        return self.rr.replay(routes.view(B * T, self.rr.n_layers, self.rr.k), enforce=self.mode != "record")

    def metrics(self) -> dict:
        """``moe/route_mismatch`` and ``moe/replay_coverage`` since the last call (then reset)."""
        out = {}
        if self.rr.stats[1]:
            out["moe/route_mismatch"] = self.rr.stats[0] / self.rr.stats[1]
        if self.rows[1]:
            out["moe/replay_coverage"] = self.rows[0] / self.rows[1]
        p = self.predictor
        if p is not None:
            if p.stats[1]:
                out["moe/pr2_predicted_flip"] = p.stats[0] / p.stats[1]
            if p.velocity:
                out["moe/pr2_velocity_norm"] = float(sum(float(v.norm()) for v in p.velocity))
            p.stats = [0, 0]
        self.rr.reset_stats()
        self.rows = [0, 0]
        return out


def check_routing_config(cfg: Any) -> None:
    """``model.routing_replay`` against the engines that must carry it (a ``model`` group check of
    :data:`rlpost.config.compose.GROUP_CHECKS`; :func:`attach_routing` checks the model itself).

    Raises:
        ConfigError: an unknown mode, a non-hf rollout engine, a trainer other than torch
            (DeepSpeed trains a wrapped, under ZeRO-3 partitioned, module whose routers were never
            patched), or gradient checkpointing (its recomputed forward would route on its own).
    """
    mode = str(getattr(cfg.model, "routing_replay", "off") or "off")
    if mode not in ROUTING_MODES:
        raise ConfigError(f"model.routing_replay={mode!r} is not one of {', '.join(ROUTING_MODES)}")
    if mode == "off":
        return
    if cfg.rollout.engine != "hf":
        raise ConfigError(f"model.routing_replay={mode} records routes in the hf engine only; set rollout=hf")
    if str(getattr(cfg.trainer, "engine", "torch")) != "torch":
        raise ConfigError(f"model.routing_replay={mode} needs trainer=torch (the routers of the module it trains "
                          "are the ones patched)")
    if getattr(cfg.model, "gradient_checkpointing", False):
        raise ConfigError(f"model.routing_replay={mode} cannot replay inside recomputed (checkpointed) forwards; "
                          "set model.gradient_checkpointing=false")


def attach_routing(model_cfg: Any, trainer: Any, engine: Any) -> Any:
    """Wire ``model.routing_replay`` into a run: the trainer replays (or measures) and the engine records.

    Returns the engine to use (``engine`` itself when the mode is ``off``). The engine choices it
    needs are config checks (:func:`check_routing_config`), run before anything is built.

    Args:
        model_cfg: ``cfg.model`` (``routing_replay``, ``pr2``).
        trainer: the torch trainer (its ``policy`` is patched; it gets a ``routing`` attribute).
        engine: the hf rollout engine (wrapped to record routes).
    Raises:
        ConfigError: a mode other than off/record/replay/pr2, bad ``model.pr2`` settings, a
            trainer without a policy forward hook (deepspeed), or a model without MoE routers.
    """

    mode = str(getattr(model_cfg, "routing_replay", "off") or "off")
    if mode not in ROUTING_MODES:
        raise ConfigError(f"model.routing_replay={mode!r} is not one of {', '.join(ROUTING_MODES)}")
    if mode == "off":
        return engine
    if not hasattr(trainer, "routing"):
        raise ConfigError(f"model.routing_replay={mode} needs trainer=torch (the routers of the module it trains "
                          "are the ones patched)")
    predictor = None
    if mode == "pr2":
        pr2 = getattr(model_cfg, "pr2", None)
        try:
            predictor = RouterEvolutionPredictor(float(getattr(pr2, "horizon", 1.0)), float(getattr(pr2, "ema", 0.5)))
        except ValueError as e:
            raise ConfigError(f"model.pr2: {e}") from None
    try:
        trainer.routing = TrainerRouting(trainer.policy, mode, predictor=predictor)
        shared = trainer.routing.rr if engine.model is trainer.policy else None
        return RouteRecordingEngine(engine, trainer.routing.store, shared, trainer.routing.predictor)
    except ValueError as e:
        raise ConfigError(f"model.routing_replay={mode}: {e}; use an MoE model (e.g. model=tiny_moe)") from None
