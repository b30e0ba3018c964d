"""Turn-by-turn policy updates on multi-turn episodes (``algo.turn_updates``): last turn first.

One mechanism, two papers. Instead of one policy update on the whole episode, the step's update
runs once per **turn index** ``k`` with the loss mask restricted to the model tokens of turn
``k`` (every episode's k-th run of mask-1 tokens, :func:`rlpost.algos.turns.turn_spans`), in
reverse execution order ``k = K-1, ..., 0`` (``order=reverse``). Each turn's update starts from
the weights the later turns' updates left; before it, the pre-update log-probs of its tokens are
recomputed under those weights (``refresh_old_logprobs``), so turn ``k``'s importance ratio is
taken against the policy it is actually updated from.

- SeeUPO ("SeeUPO: Sequence-Level Agentic-RL with Convergence Guarantees", arXiv:2602.06554,
  ``algo=seeupo``): turns as sequentially updated agents (backward induction), a sequence-level
  loss (GSPO), Dr.-GRPO-centred advantages re-normalised over each turn's batch and clamped
  (``adv_norm=batch``), and the mirror correction ``carry_ratio``: turn ``k``'s advantage is
  multiplied by the accumulated, clipped sequence-level ratio ``pi_new / pi_before`` of the
  turns already updated in this step (authors' code, modelscope/AgentEvolver branch ``seeupo``).
- RTPO ("Reverse-Turn Policy Optimization", abstract only, no arXiv id found): its update half
  is the same reverse turn order (with ``carry_ratio=false``, ``adv_norm=none`` and a token-level
  clipped loss); it has no preset, because its sparse reverse-tree sampler cannot be read from the
  abstract (docs/ALGORITHMS.md, "Seed methods left out").

On a single-turn row there is one turn, so the update is the plain update (with the pre-update
log-probs recomputed, which on-policy equals the recorded ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from rlpost.algos.turns import turn_spans
from rlpost.core.errors import ConfigError
from rlpost.core.registry import as_dict, param, resolve_params
from rlpost.methods.base import METHODS, Method, Needs, RunServices


@dataclass(frozen=True)
class TurnUpdateParams:
    """``algo.turn_updates``: the per-turn update schedule (defaults: SeeUPO's, arXiv:2602.06554)."""

    order: str = param("reverse", "reverse (last turn first: SeeUPO, RTPO) or forward (first turn first: the ablation)")
    refresh_old_logprobs: bool = param(True, "recompute each turn's pre-update log-probs under the weights the "
                                             "earlier turn updates left (SeeUPO's code recomputes them per turn)")
    carry_ratio: bool = param(True, "SeeUPO's mirror correction: multiply turn k's advantage by the accumulated "
                                    "clipped sequence-level ratio of the turns already updated this step")
    ratio_clip_low: float = param(0.2, "the carried ratio is clipped to [1 - ratio_clip_low, 1 + ratio_clip_high] "
                                       "(SeeUPO: adv_clip_ratio_low 0.2)")
    ratio_clip_high: float = param(0.2, "upper clip of the carried ratio (SeeUPO: adv_clip_ratio_high 0.2)")
    adv_norm: str = param("batch", "none, or batch: each turn's per-episode advantages re-normalised over the "
                                   "episodes that reached that turn, (a - mean) / std, then clamped (SeeUPO's special_norm)")
    adv_clamp: float = param(3.0, "|advantage| bound after adv_norm=batch (SeeUPO: 3)")


def turn_settings(cfg: Any) -> Optional[TurnUpdateParams]:
    """The checked ``algo.turn_updates`` of ``cfg`` (None when unset).

    Raises:
        ConfigError: an unknown key, a bad ``order`` / ``adv_norm``, clip bounds outside [0, 1),
            ``adv_clamp <= 0``, or a setup the per-turn loop does not support (several
            processes, a launcher, ``trainer.engine`` other than torch, an update gate).
    """
    spec = cfg.algo.get("turn_updates", None) if hasattr(cfg.algo, "get") else getattr(cfg.algo, "turn_updates", None)
    if not spec:
        return None

    p = resolve_params(TurnUpdateParams, as_dict(spec), key="algo.turn_updates", owner="turn-by-turn updates")
    if p.order not in ("reverse", "forward"):
        raise ConfigError(f"algo.turn_updates.order={p.order!r}: valid choices are reverse, forward")
    if p.adv_norm not in ("none", "batch"):
        raise ConfigError(f"algo.turn_updates.adv_norm={p.adv_norm!r}: valid choices are none, batch")
    for k in ("ratio_clip_low", "ratio_clip_high"):
        v = float(getattr(p, k))
        if not 0.0 <= v < 1.0:
            raise ConfigError(f"algo.turn_updates.{k}={v} must be in [0, 1) (the carried ratio stays positive)")
    if p.adv_clamp <= 0:
        raise ConfigError(f"algo.turn_updates.adv_clamp={p.adv_clamp} must be > 0")
    if str(cfg.trainer.engine) != "torch":
        raise ConfigError("algo.turn_updates runs the torch trainer's update once per turn; use trainer=torch")
    if int(cfg.trainer.num_procs) > 1 or str(cfg.launcher.name) != "none":
        raise ConfigError("algo.turn_updates masks the batch per turn in one process; use trainer.num_procs=1 "
                          "and launcher=none")
    if cfg.algo.get("update_gate", None):
        raise ConfigError("algo.turn_updates and algo.update_gate both replace the policy update; set one of them")
    return p


def turn_index_map(mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` long: the turn index ``k`` (0-based) of each mask-1 token, -1 elsewhere.

    Turns are the maximal runs of mask-1 tokens of a row (:func:`rlpost.algos.turns.turn_spans`).
    """
    out = torch.full(mask.shape, -1, dtype=torch.long)
    for i in range(mask.shape[0]):
        for k, (s, e) in enumerate(turn_spans(mask[i])):
            out[i, s:e] = k
    return out


def batch_normalised(adv: torch.Tensor, tmask: torch.Tensor, clamp: float) -> torch.Tensor:
    """Turn advantages re-normalised over the episodes that have this turn (SeeUPO's batch norm).

    Args:
        adv: ``[B, R]`` advantages; tmask: ``[B, R]`` 0/1, the turn's tokens.
        clamp: bound of the result's magnitude.
    Returns:
        ``[B, R]``: on each row with the turn, ``clip((a_i - mean a) / std a, -clamp, clamp)`` on its
        tokens, where ``a_i`` is the row's mean advantage over the turn's tokens and mean / std
        (Bessel-corrected) are over those rows; only centred when std <= 1e-6 or one row; 0 elsewhere.
    """
    n = tmask.sum(1)
    rows = n > 0
    out = torch.zeros_like(adv)
    if not bool(rows.any()):
        return out
    a = (adv * tmask).sum(1)[rows] / n[rows]
    a = a - a.mean()
    if a.numel() > 1 and float(a.std()) > 1e-6:
        a = a / a.std()
    a = a.clamp(-clamp, clamp)
    out[rows] = a[:, None].to(adv.dtype) * tmask[rows]
    return out


def sequence_ratio(new_lp: torch.Tensor, old_lp: torch.Tensor, tmask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``[B]`` clipped sequence-level ratio of each row's turn tokens (GSPO's length-normalised ratio).

    ``s_i = clip(exp(clip(mean_t (new - old), -10, 10)), 1 - low, 1 + high)`` over the row's tokens
    of ``tmask``; 1 on a row without any.
    """
    n = tmask.sum(1)
    lr = ((new_lp - old_lp) * tmask).sum(1) / n.clamp(min=1)
    s = torch.exp(lr.clamp(-10.0, 10.0)).clamp(1.0 - low, 1.0 + high)
    return torch.where(n > 0, s, torch.ones_like(s))


@METHODS.register("turn_updates", paper="SeeUPO (arXiv:2602.06554); RTPO (Reverse-Turn Policy Optimization)")
class TurnUpdates(Method):
    """Run the policy update once per turn index, last turn first (``algo.turn_updates``)."""

    name = "turn_updates"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.p: Optional[TurnUpdateParams] = None

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(cfg.algo.get("turn_updates", None))

    def validate(self) -> None:
        self.p = turn_settings(self.cfg)

    def needs(self) -> Needs:
        return Needs(old_logprobs=True)

    def describe(self) -> str:
        return f"one policy update per turn ({self.p.order if self.p else 'reverse'} order)"

    def wrap_update(self, update: Callable[[], Dict[str, Any]], run: RunServices, batch: Any) -> Optional[Dict[str, Any]]:
        """Call ``update()`` once per turn index with ``batch`` restricted to that turn's tokens.

        Per turn ``k`` (in ``order``): ``batch.response_mask`` = the original mask on turn ``k``'s
        tokens only; ``extras['old_logprobs']`` = the current policy's log-probs when
        ``refresh_old_logprobs``; ``extras['advantages']`` = the original ones, re-normalised over
        the turn's rows (``adv_norm=batch``) and times the carried ratio ``rho`` [B]
        (``carry_ratio``). After the update, ``rho_i <- clip(rho_i * s_i, 1 - low, 1 + high)`` on the
        rows with turn ``k``, ``s_i`` the clipped sequence ratio of the new over the pre-update
        log-probs of the turn (:func:`sequence_ratio`). Everything is restored afterwards.

        Returns:
            metrics: the mean over the turn updates of each numeric metric, plus
            ``turns/updates`` (updates run) and ``turns/carried_ratio_mean`` (rows' final rho).
        """
        p = self.p or turn_settings(self.cfg)
        mask0 = batch.response_mask
        adv0 = batch.extras["advantages"]
        old0 = batch.extras.get("old_logprobs")
        tidx = turn_index_map(mask0.cpu()).to(mask0.device)
        K = int(tidx.max()) + 1 if tidx.numel() else 0
        order = list(range(K - 1, -1, -1)) if p.order == "reverse" else list(range(K))
        rho = torch.ones(mask0.shape[0], dtype=torch.float32, device=mask0.device)
        runs: List[Dict[str, Any]] = []

        def current_lp() -> torch.Tensor:
            return run.rows_pass(batch, lambda b: run.logprobs(b)[0]).float()

        try:
            for k in order:
                tm = (tidx == k).to(mask0.dtype)
                rows = tm.sum(1) > 0
                if not bool(rows.any()):
                    continue
                batch.response_mask = mask0 * tm
                before = current_lp() if (p.refresh_old_logprobs or p.carry_ratio) else None
                if p.refresh_old_logprobs:
                    batch.extras["old_logprobs"] = before
                a = batch_normalised(adv0, tm, p.adv_clamp) if p.adv_norm == "batch" else adv0 * tm
                if p.carry_ratio:
                    a = a * rho[:, None].to(a.dtype)
                batch.extras["advantages"] = a
                runs.append(update())
                if p.carry_ratio:
                    s = sequence_ratio(current_lp(), before, tm.float(), p.ratio_clip_low, p.ratio_clip_high)
                    rho = torch.where(rows, (rho * s).clamp(1.0 - p.ratio_clip_low, 1.0 + p.ratio_clip_high), rho)
        finally:
            batch.response_mask = mask0
            batch.extras["advantages"] = adv0
            if old0 is not None:
                batch.extras["old_logprobs"] = old0
            else:
                batch.extras.pop("old_logprobs", None)
        out: Dict[str, Any] = {}
        for key in {k for r in runs for k in r}:
            vals = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
            if vals:
                out[key] = float(sum(vals) / len(vals))
            else:
                out[key] = runs[-1].get(key)
        out["turns/updates"] = float(len(runs))
        out["turns/carried_ratio_mean"] = float(rho.mean())
        return out
