"""MIPU: accept a policy update only when the inference policy it syncs to improves (``algo.update_gate``).

"The Mirage of Optimizing Training Policies: Monotonic Inference Policies as the Real Objective for
LLM Reinforcement Learning" (Liang, Tang, Ma et al., arXiv:2606.29526; project page
https://anitaleungxx.github.io/MIPU/). The rollout engine's policy ``mu`` (the inference policy:
here rlpost's low-precision rollout copy, ``precision.rollout_dtype`` int8 / fp8_sim / fp4_sim...)
differs from the trainer's ``pi`` even with the same weights, so a step that improves ``pi``'s
surrogate need not improve ``mu``, the policy actually sampled from and deployed. The paper's
objective is Monotonic Inference Policy Improvement (MIPI); its update rule, MIPU, has two steps:
build a sampler-referenced candidate update, then sync the candidate to the inference side and
accept it only when an inference-side gap proxy says ``mu`` improves.

What we could read is the abstract and the project page's summary: the proxy's formula, its
threshold and what happens after a rejection are not in it. Our reading, every part our choice:

* **Candidate**: the preset's ordinary update with the truncated importance-sampling correction
  against the sampler's log-probs (``precision.correction=tis``): the surrogate is referenced to
  ``mu_old``, the policy that drew the batch.
* **Gap proxy** (:func:`inference_gap_proxy`): on the step's own batch, with ``mu_old`` the recorded
  rollout log-probs and ``mu_new`` the synced candidate's inference log-probs of the same tokens,
  the importance-sampled surrogate gain of the inference policy
  ``gain = token-mean[(mu_new / mu_old - 1) * A]`` (the first-order term of the policy-improvement
  identity, ``J(mu_new) - J(mu_old) ~ E_{mu_old}[(mu_new/mu_old - 1) A]``), and the k3 estimate of
  ``KL(mu_old || mu_new)`` (``r - 1 - log r``), the term monotonic-improvement bounds subtract.
* **Accept** when ``gain >= min_gain`` and (when ``max_kl`` is set) ``kl <= max_kl``; **reject**:
  restore the weights, the optimizer state and the learning-rate schedule exactly as they were
  before the step and re-sync the inference copy (the step's batch is spent; the next step
  samples afresh).

Costs one extra forward of the inference copy over the batch per step plus a copy of the
weights and optimizer state (kept on the trainer's device). Works with ``trainer=torch`` and
``rollout=hf`` (the inference copy is the hf engine's converted model); refused for vLLM (no
teacher-forced log-probs path is wired), DeepSpeed (sharded optimizer state) and the asynchronous
executor (the engine is updated by its producer).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional

import torch

from rlpost.core.errors import ConfigError
from rlpost.models.logprobs import eval_mode, response_logprobs

#: keys of ``algo.update_gate`` and their defaults (one owner: this module)
GATE_DEFAULTS: Dict[str, Any] = {"name": "mipu", "min_gain": 0.0, "max_kl": None}


def inference_gap_proxy(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor) -> Dict[str, float]:
    """MIPU's inference-side gap proxy (our reading, see the module docstring).

    Args:
        new_logprobs: ``[B, R]`` log-probs (nats) of the batch's tokens under the synced candidate's
            inference policy ``mu_new``.
        old_logprobs: ``[B, R]`` the sampler's log-probs ``mu_old`` recorded at rollout.
        advantages: ``[B, R]`` per-token advantages.
        mask: ``[B, R]`` 1 on response tokens.
    Returns:
        ``{"gain": token-mean[(r - 1) A], "kl": token-mean[r - 1 - log r], "ratio_mean": token-mean[r]}``
        with ``r = exp(new - old)``; token-mean over ``mask``.
    Raises:
        ValueError: shapes differ or the mask is empty.
    """
    shapes = {tuple(t.shape) for t in (new_logprobs, old_logprobs, advantages, mask)}
    if len(shapes) != 1:
        raise ValueError(f"inference_gap_proxy needs equal [B, R] shapes, got {sorted(shapes)}")
    m = mask.double()
    n = float(m.sum())
    if n <= 0:
        raise ValueError("inference_gap_proxy: the mask selects no token")
    log_r = (new_logprobs.double() - old_logprobs.double()) * m
    r = log_r.exp()
    return {"gain": float(((r - 1) * advantages.double() * m).sum() / n),
            "kl": float(((r - 1 - log_r) * m).sum() / n),
            "ratio_mean": float((r * m).sum() / n)}


def gate_settings(spec: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """``algo.update_gate`` checked and completed with :data:`GATE_DEFAULTS` (None: off).

    Raises:
        ConfigError: an unknown key or gate name, or ``max_kl <= 0``.
    """
    if not spec:
        return None
    given = dict(spec)
    bad = sorted(set(given) - set(GATE_DEFAULTS))
    if bad:
        raise ConfigError(f"algo.update_gate has unknown key(s) {bad}; valid: {', '.join(GATE_DEFAULTS)}")
    c = {**GATE_DEFAULTS, **given}
    if c["name"] != "mipu":
        raise ConfigError(f"algo.update_gate.name={c['name']!r} is unknown; valid: mipu (or null: off)")
    c["min_gain"] = float(c["min_gain"])
    if c["max_kl"] is not None:
        c["max_kl"] = float(c["max_kl"])
        if c["max_kl"] <= 0:
            raise ConfigError(f"algo.update_gate.max_kl must be > 0 (or null: off), got {c['max_kl']}")
    return c


def check_update_gate(cfg: Any) -> Optional[Dict[str, Any]]:
    """The checked gate settings of ``cfg`` (None when ``algo.update_gate`` is unset).

    Raises:
        ConfigError: bad settings (:func:`gate_settings`), or a combination MIPU does not support:
            ``rollout=vllm``, ``trainer=deepspeed``, ``executor=async``, several processes or a launcher.
    """
    spec = cfg.algo.get("update_gate") if hasattr(cfg.algo, "get") else getattr(cfg.algo, "update_gate", None)
    c = gate_settings(spec)
    if c is None:
        return None
    if str(cfg.rollout.engine) != "hf":
        raise ConfigError("algo.update_gate=mipu scores candidates with the hf engine's inference copy; "
                          "use rollout=hf (no vLLM teacher-forced scoring is wired)")
    if str(cfg.trainer.engine) != "torch":
        raise ConfigError("algo.update_gate=mipu restores the optimizer state of trainer=torch only; use trainer=torch")
    if str(cfg.executor.name) == "async":
        raise ConfigError("algo.update_gate=mipu syncs the candidate itself; use executor=sync")
    if int(cfg.trainer.num_procs) > 1 or str(cfg.launcher.name) != "none":
        raise ConfigError("algo.update_gate=mipu runs in one process with its own hf engine; use "
                          "trainer.num_procs=1 and launcher=none")
    return c


def inference_logprobs(engine: Any, batch: Any, temperature: float = 1.0) -> torch.Tensor:
    """``[B, R]`` log-probs of ``batch``'s response tokens under the hf engine's inference copy (no gradient)."""

    model = engine.model
    dev = next(model.parameters()).device
    attn = (batch.response_mask > 0).long()
    with torch.no_grad(), eval_mode(model):
        lp = response_logprobs(model, batch.prompt_ids.to(dev), batch.prompt_mask.to(dev), batch.response_ids.to(dev),
                               attn.to(dev), temperature)
    lp = lp[0] if isinstance(lp, tuple) else lp
    return lp.float().cpu() * batch.response_mask


class MIPUGate:
    """Candidate update -> sync -> inference-side gap proxy -> accept or roll back (MIPU, arXiv:2606.29526).

    Args:
        min_gain: accept when the proxy's gain is at least this (0: the inference policy must not
            get worse by the proxy).
        max_kl: also reject when the inference-side KL estimate exceeds it (None: off).
        temperature: the sampling temperature the batch was drawn at (log-probs are scored at it).
    """

    def __init__(self, min_gain: float = 0.0, max_kl: Optional[float] = None, temperature: float = 1.0,
                 name: str = "mipu") -> None:
        self.min_gain, self.max_kl, self.temperature = float(min_gain), max_kl, float(temperature)
        self.accepted = 0
        self.rejected = 0

    def update(self, update: Callable[[], Dict[str, float]], engine: Any, batch: Any, policy: torch.nn.Module,
               snapshot: Callable[[], Any], restore: Callable[[Any], None]) -> Dict[str, float]:
        """One MIPU step on ``batch``; returns the update's metrics plus ``mipu/*``.

        Args:
            update: runs the policy update on ``batch`` and returns its metrics.
            engine: the hf rollout engine (its inference copy scores the candidate).
            policy: the trainer's policy (pushed to the engine).
            snapshot, restore: the trainer's exact state (weights, optimizer, schedule) and its restore.
        Returns:
            ``mipu/accepted`` (1/0), ``mipu/gain``, ``mipu/kl``, ``mipu/ratio_mean``,
            ``mipu/accept_rate`` (running share of accepted candidates). After a rejection the
            trainer holds exactly its pre-step weights, optimizer state and schedule, and ``engine``
            has been re-synced to them.
        """
        snap = snapshot()
        metrics = dict(update())
        engine.sync_weights(policy)
        new_lp = inference_logprobs(engine, batch, self.temperature)
        proxy = inference_gap_proxy(new_lp, batch.rollout_logprobs.float(), batch.extras["advantages"].float(),
                                    batch.response_mask)
        ok = proxy["gain"] >= self.min_gain and (self.max_kl is None or proxy["kl"] <= self.max_kl)
        if ok:
            self.accepted += 1
        else:
            self.rejected += 1
            restore(snap)
            engine.sync_weights(policy)
        metrics.update({f"mipu/{k}": v for k, v in proxy.items()})
        metrics["mipu/accepted"] = 1.0 if ok else 0.0
        metrics["mipu/accept_rate"] = self.accepted / (self.accepted + self.rejected)
        return metrics
