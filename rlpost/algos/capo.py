"""CAPO: curvature-aware token masking from a last-layer model of the coming update (``algo=capo``).

"Stabilizing Policy Gradients for Sample-Efficient Reinforcement Learning in LLM Reasoning" (Melo,
Abate, Gal; arXiv:2510.00819), whose algorithm is Curvature-Aware Policy Optimization (CAPO); the
authors' code is https://github.com/luckeciano/stable-pg-llm. CAPO predicts, per response token, what
the coming optimizer step would do to the objective and to the policy if it were driven by that
token alone, and drops the token from the update when either prediction is too large.

The model of the step (what we read in the authors' code; the paper's text was read only through its
abstract and summaries, so where they differ, this follows the code):

* Last layer only, linear logits on a top-k support. For a response token with final hidden state
  ``h`` (the LM head's input), sampled token ``a``, advantage ``A`` and the current policy's top-k
  token ids ``ids`` (``k = top_k``, 50 in the authors' runs: the sampler's top-k), ``pi`` is the
  softmax of the top-k logits (renormalised on the support) and ``e_a`` the one-hot of ``a`` on it
  (all zeros when ``a`` is outside it). The gradient of ``A log pi(a)`` with respect to the LM-head
  rows of ``ids`` is ``g = A (e_a - pi) h^T`` ``[k, H]``.
* An Adam model of the LM-head step ("optimizer model", the code's sparse Adam model). A shadow
  Adam state ``(m, v, t)`` keyed by vocabulary row, separate from the trainer's optimizer, gives the
  step direction ``d = m_hat / (sqrt(v_hat) + eps)`` from the prospective moments
  ``m' = beta1 m + (1 - beta1) g``, ``v' = beta2 v + (1 - beta2) g^2`` bias-corrected at ``t + 1``.
  While the shadow state is empty (the first optimizer step) ``d = g`` (plain SGD), as in the code.
  After every optimizer step the shadow state takes one Adam moment update with, for every row that
  appears in a kept token's support, the mean of that row's per-token gradients ``g`` over the
  mini-batch's kept tokens (rows not seen that step keep their moments; ``t`` always advances).
* With the logit change per unit step ``u = d h`` ``[k]``, ``s = (e_a - pi) . u`` and the top-k
  Fisher ``F = diag(pi) - pi pi^T``:

  - predicted objective change ``m_H = lr <g, d> + lr^2 / 2 * A (s^2 - u^T F u)``;
  - predicted (empirical-Fisher) KL ``m_F = lr^2 / 2 * s^2``;

  with ``lr`` the trainer's learning rate for the coming step.
* The token mask: keep a token iff ``-tau_update < m_H < tau_update`` (``symmetric``; otherwise
  ``0 <= m_H < tau_update``) and ``m_F < tau_kl``; a threshold of 0 turns its test off. Defaults
  ``tau_update = 5e-4``, ``tau_kl = 1e-3``, symmetric: the authors' Dr. GRPO + Adam configuration
  (``hessian_token_mask_tau``, ``fisher_token_mask_tau``, ``hessian_symmetric_clipping``). The kept
  tokens' surrogate is the usual PPO clipped one; masked tokens contribute neither loss nor gradient
  but stay in the aggregation's denominator (the code multiplies the completion mask by the CAPO
  mask inside a sum divided by a constant).

Our choices where the code and this framework differ:

* Temperature: the trainer's log-probs are of ``softmax(z / T)``; the linear model uses the feature
  ``h / T`` in place of ``h`` (the code's forward applies no temperature), so ``pi`` and ``g`` are
  those of the distribution the tokens were drawn from.
* The Adam moments are the shadow state above, never the trainer's optimizer state: that matches the
  code, and the real moments would not fit the model anyway, because SmolLM2 and ``model=tiny`` tie
  the LM head to the input embeddings (the real moments mix in the embedding gradient) and the real
  gradient is the aggregated loss's (scaled by the aggregation's denominator and the clip), not the
  per-token ``g``. The shadow uses the trainer's AdamW ``betas`` and eps 1e-8 (torch's default, the
  trainer's), no weight decay (the code's ``optim_model_type: adam``).
* The code computes the shadow update once per optimizer step from the step's whole batch (gathered
  across processes); here it is the optimizer step's mini-batch, summed over its micro-batches, so
  neither the mask (per token, from the state fixed before the step) nor the update depends on
  ``trainer.micro_batch_size``. The shadow state is this process's own: ``trainer.engine=torch`` only.
* The code's sentence- and batch-level masks and its sequential masking are not implemented (their
  thresholds are 0, i.e. off, in the token-level configurations this preset follows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from rlpost.algos.losses import Metrics, PolicyLossInput, _clip_metrics, _ppo_core, _ratio
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.utils import masked_mean
from rlpost.core.errors import ConfigError
from rlpost.core.registry import param
from rlpost.models.logprobs import _chunk_logprobs, packed_response_states

_CAPO_PAPER = ("Stabilizing Policy Gradients for Sample-Efficient Reinforcement Learning in LLM Reasoning "
               "(CAPO, arXiv:2510.00819; code https://github.com/luckeciano/stable-pg-llm)")

#: key of the shadow Adam state in the trainer's ``loss_state``: ``{"ids" [U] long sorted, "m" [U, H],
#: "v" [U, H], "t" int}`` (saved with a checkpoint)
STATE_KEY = "capo/shadow_adam"
#: key of the running per-row gradient sums of the optimizer step in progress (cleared after the step)
PENDING_KEY = "capo/pending"
#: Adam's epsilon of the shadow model (torch's AdamW default, which the trainer uses)
ADAM_EPS = 1e-8


@dataclass(frozen=True)
class CAPOParams:
    """CAPO's token mask (arXiv:2510.00819, values from the authors' Dr. GRPO + Adam configuration) and PPO's clip."""

    eps_low: float = param(0.2, "lower clip: ratio floor 1 - eps_low for A < 0 (the authors' runs: TRL's 0.2)")
    eps_high: float = param(0.2, "upper clip: ratio cap 1 + eps_high for A > 0 (the authors' runs: TRL's 0.2)")
    top_k: int = param(50, "support of the last-layer model: the current policy's top-k tokens per position (authors: 50)")
    tau_update: float = param(5e-4, "mask a token whose predicted objective change |m_H| >= tau_update (0: off; authors: 5e-4)")
    tau_kl: float = param(1e-3, "mask a token whose predicted Fisher KL m_F >= tau_kl (0: off; authors: 1e-3)")
    symmetric: bool = param(True, "test -tau < m_H < tau (true, the authors'), else 0 <= m_H < tau")

    def __post_init__(self) -> None:
        if int(self.top_k) < 1:
            raise ValueError(f"capo: top_k must be >= 1 token, got {self.top_k}")
        if float(self.tau_update) < 0 or float(self.tau_kl) < 0:
            raise ValueError(f"capo: tau_update={self.tau_update} and tau_kl={self.tau_kl} must be >= 0 (0 turns a test off)")


# ----------------------------------------------------------------------------- shadow Adam state
def shadow_moments(state: Optional[Dict[str, Any]], ids: torch.Tensor, hidden: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The shadow Adam moments ``(m, v)`` of vocabulary rows ``ids``, zeros for rows never updated.

    Args:
        state: the shadow state (:data:`STATE_KEY`) or None.
        ids: long tensor of any shape ``S``.
        hidden: ``H``, the row width.
    Returns:
        ``(m, v)``, each ``S + [H]`` float32 on ``ids``' device.
    """
    shape = (*ids.shape, hidden)
    m = torch.zeros(shape, dtype=torch.float32, device=ids.device)
    v = torch.zeros_like(m)
    if not state or state["ids"].numel() == 0:
        return m, v
    keys = state["ids"].to(ids.device)
    flat = ids.reshape(-1)
    pos = torch.searchsorted(keys, flat).clamp(max=keys.numel() - 1)
    hit = keys[pos] == flat
    m.view(-1, hidden)[hit] = state["m"].to(ids.device)[pos[hit]]
    v.view(-1, hidden)[hit] = state["v"].to(ids.device)[pos[hit]]
    return m, v


def adam_direction(g: torch.Tensor, ids: torch.Tensor, state: Optional[Dict[str, Any]], beta1: float, beta2: float,
                   eps: float = ADAM_EPS) -> torch.Tensor:
    """The shadow optimizer's step direction for gradient ``g`` on rows ``ids``, without changing the state.

    ``m' = beta1 m + (1 - beta1) g``, ``v' = beta2 v + (1 - beta2) g^2``,
    ``d = (m' / (1 - beta1^(t+1))) / (sqrt(v' / (1 - beta2^(t+1))) + eps)``; ``d = g`` while the
    state has taken no update (``t == 0``), as the authors' code does.

    Args:
        g: ``[..., H]`` gradient rows (ascent direction of ``A log pi``).
        ids: ``g.shape[:-1]`` long vocabulary rows.
        state: the shadow state or None.
        beta1, beta2, eps: Adam's constants.
    Returns:
        ``d`` shaped like ``g``.
    """
    if not state or int(state["t"]) == 0:
        return g
    m, v = shadow_moments(state, ids, g.shape[-1])
    t1 = int(state["t"]) + 1
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    return (m / (1.0 - beta1 ** t1)) / ((v / (1.0 - beta2 ** t1)).sqrt() + eps)


def capo_terms(feat: torch.Tensor, support_ids: torch.Tensor, support_probs: torch.Tensor, onehot: torch.Tensor,
               adv: torch.Tensor, state: Optional[Dict[str, Any]], lr: float, beta1: float, beta2: float,
               eps: float = ADAM_EPS) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token predicted objective change ``m_H`` and Fisher KL ``m_F`` of CAPO's last-layer model.

    Args:
        feat: ``[N, H]`` the LM head's input per token divided by the sampling temperature.
        support_ids: ``[N, K]`` long, the top-k token ids of each position.
        support_probs: ``[N, K]`` the policy renormalised on that support (rows sum to 1).
        onehot: ``[N, K]`` 1 where the support id is the sampled token (a row may be all 0).
        adv: ``[N]`` advantages.
        state: the shadow Adam state or None (:func:`adam_direction`).
        lr: learning rate of the coming step.
        beta1, beta2, eps: the shadow Adam's constants.
    Returns:
        ``(m_H [N], m_F [N], g [N, K, H])``: ``m_H = lr <g, d> + lr^2/2 A ((v.u)^2 - u^T F u)``,
        ``m_F = lr^2/2 (v.u)^2`` with ``v = e_a - pi``, ``g = A v h^T``, ``d`` the Adam direction of
        ``g`` and ``u = d h``; ``g`` is returned for the shadow state's update. float32, no grad.
    """
    feat, pi, e, A = feat.float(), support_probs.float(), onehot.float(), adv.float()
    vv = e - pi  # [N, K]
    g = A[:, None, None] * vv[..., None] * feat[:, None, :]  # [N, K, H]
    d = adam_direction(g, support_ids, state, beta1, beta2, eps)
    gd = (g * d).sum((-1, -2))  # [N]
    u = (d * feat[:, None, :]).sum(-1)  # [N, K]: logit change per unit step
    s = (vv * u).sum(-1)
    uFu = (pi * u * u).sum(-1) - (pi * u).sum(-1) ** 2
    m_h = lr * gd + 0.5 * lr * lr * A * (s * s - uFu)
    m_f = 0.5 * lr * lr * s * s
    return m_h, m_f, g


def capo_keep(m_h: torch.Tensor, m_f: torch.Tensor, tau_update: float, tau_kl: float, symmetric: bool) -> torch.Tensor:
    """``[...]`` float 0/1: 1 where CAPO keeps the token (see the module docstring); a tau of 0 is no test."""
    keep = torch.ones_like(m_h, dtype=torch.bool)
    if tau_update > 0:
        keep &= (m_h < tau_update) & ((m_h > -tau_update) if symmetric else (m_h >= 0))
    if tau_kl > 0:
        keep &= m_f < tau_kl
    return keep.float()


def accumulate_rows(pending: Dict[str, Any], ids: torch.Tensor, g: torch.Tensor, keep: torch.Tensor) -> None:
    """Add the kept tokens' per-row gradients ``g`` to the running sums in ``pending``, in place.

    Args:
        pending: dict with ``ids`` ``[U]`` (sorted vocabulary rows), ``sums`` ``[U, H]`` and ``counts``
            ``[U]`` (occurrences summed), created on first use.
        ids: ``[N, K]`` support ids; g: ``[N, K, H]``; keep: ``[N]`` 0/1.
    """
    sel = keep > 0
    rows, gr = ids[sel].reshape(-1), g[sel].reshape(-1, g.shape[-1]).float()
    if "ids" in pending:
        rows = torch.cat([pending["ids"].to(rows.device), rows])
        gr = torch.cat([pending["sums"].to(gr.device), gr])
        cnt = torch.cat([pending["counts"].to(rows.device), torch.ones(int(sel.sum()) * ids.shape[-1], device=rows.device)])
    else:
        cnt = torch.ones(rows.numel(), device=rows.device)
    uniq, inv = torch.unique(rows, return_inverse=True)  # sorted
    pending["ids"] = uniq
    pending["sums"] = torch.zeros(uniq.numel(), g.shape[-1], device=gr.device).index_add_(0, inv, gr)
    pending["counts"] = torch.zeros(uniq.numel(), device=cnt.device).index_add_(0, inv, cnt)


def shadow_update(state: Optional[Dict[str, Any]], pending: Optional[Dict[str, Any]], beta1: float, beta2: float,
                  hidden: int) -> Dict[str, Any]:
    """One Adam moment update of the shadow state with the mean gradient of each pending row; ``t += 1``.

    Rows absent from ``pending`` keep their moments (the code's sparse update).

    Returns:
        the new state (``ids`` sorted, ``m``, ``v`` ``[U, H]``, ``t``), on the CPU.
    """
    if not state:
        state = {"ids": torch.zeros(0, dtype=torch.long), "m": torch.zeros(0, hidden), "v": torch.zeros(0, hidden), "t": 0}
    ids, m, v = state["ids"].cpu(), state["m"].cpu(), state["v"].cpu()
    if pending and "ids" in pending and pending["ids"].numel():
        rows = pending["ids"].cpu()
        mean = pending["sums"].cpu() / pending["counts"].cpu().clamp(min=1)[:, None]
        all_ids = torch.unique(torch.cat([ids, rows]))
        m2 = torch.zeros(all_ids.numel(), hidden)
        v2 = torch.zeros_like(m2)
        if ids.numel():
            at = torch.searchsorted(all_ids, ids)
            m2[at], v2[at] = m, v
        at = torch.searchsorted(all_ids, rows)
        m2[at] = beta1 * m2[at] + (1.0 - beta1) * mean
        v2[at] = beta2 * v2[at] + (1.0 - beta2) * mean * mean
        ids, m, v = all_ids, m2, v2
    return {"ids": ids, "m": m, "v": v, "t": int(state["t"]) + 1}


def capo_after_step(state: Dict[str, Any], metrics: Any, **params: Any) -> None:
    """The trainer's hook after each optimizer step (tag ``after_step``): apply the step's pending rows."""
    pending = state.pop(PENDING_KEY, None)
    if pending is None:
        return
    state[STATE_KEY] = shadow_update(state.get(STATE_KEY), pending, pending["beta1"], pending["beta2"], pending["hidden"])


# ----------------------------------------------------------------------------- the update's forward
def capo_forward(fwd: Any, mb: Any, with_entropy: bool, entropy_grad: bool,
                 params: Dict[str, Any], mini_key: int):
    """The policy update's forward for ``loss=capo``: log-probs plus CAPO's per-token predictions.

    One backbone pass (:func:`rlpost.models.logprobs.packed_response_states`); per chunk of response
    tokens the sampled tokens' log-probs (with grad, the trainer's own formula and truncation) and,
    without grad, the top-k support, :func:`capo_terms` under the shadow state fixed before this
    optimizer step, and the kept tokens' per-row gradients added to the pending sums of the
    mini-batch ``mini_key`` (the sums of another mini-batch, e.g. one whose step was skipped, are
    dropped first).

    Args:
        fwd: the trainer's :class:`rlpost.methods.base.ForwardPass` (device, autocast, the module being
            trained, optimizer betas, the step's learning rate, ``loss_state``).
        mb: micro-batch; ``extras['advantages']`` ``[b, R]``.
        with_entropy, entropy_grad: also return the per-token entropy (with grad when ``entropy_grad``).
        params: the loss's resolved parameters (:class:`CAPOParams`).
        mini_key: an id of the mini-batch (the trainer's per-mini-batch seed).
    Returns:
        ``(logprobs [b, R], entropy or None, loss inputs)``: the dict holds ``predicted_change`` and
        ``predicted_kl`` ``[b, R]`` (``m_H``, ``m_F``; 0 on padding).
    Raises:
        ConfigError: a multi-process engine (the shadow state is per process).
    """
    from torch.utils.checkpoint import checkpoint

    if fwd.multi_process:
        raise ConfigError("algo.loss=capo keeps its shadow Adam state in one process. Fix: trainer.engine=torch.")
    dev = fwd.device
    attn = mb.extras.get("response_attn", (mb.response_mask > 0).long())
    B, R = mb.response_ids.shape
    K = int(params["top_k"])
    beta1, beta2 = (float(b) for b in fwd.betas)
    lr = float(fwd.lr())
    state = fwd.loss_state.get(STATE_KEY)
    pending = fwd.loss_state.get(PENDING_KEY)
    if pending is None or pending.get("key") != mini_key:
        pending = {"key": mini_key}
        fwd.loss_state[PENDING_KEY] = pending
    trunc = fwd.truncation
    with fwd.autocast():
        head, flat_idx, hs, tgt, inv_temp = packed_response_states(
            fwd.model, mb.prompt_ids.to(dev), mb.prompt_mask.to(dev), mb.response_ids.to(dev), attn.to(dev),
            fwd.temperature(mb))
    pending.update(beta1=beta1, beta2=beta2, hidden=int(hs.shape[-1]))
    adv = mb.extras["advantages"].to(dev).float().reshape(-1).index_select(0, flat_idx)
    lmask = mb.response_mask.to(dev).float().reshape(-1).index_select(0, flat_idx)
    want_ent = with_entropy or entropy_grad
    rows = max(1, int(fwd.chunk_size) * B)
    use_ckpt = torch.is_grad_enabled() and hs.shape[0] > rows
    lps, ents, mhs, mfs = [], [], [], []
    for s in range(0, hs.shape[0], rows):
        e = min(hs.shape[0], s + rows)
        it = None if inv_temp is None else inv_temp[s:e]
        args = (head, hs[s:e], tgt[s:e], it, want_ent, entropy_grad, trunc["top_k"], trunc["top_p"])
        with fwd.autocast():
            # recompute each chunk's [n, V] logits in backward when there are several (as response_logprobs does)
            lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if use_ckpt else _chunk_logprobs(*args)
        lps.append(lp)
        ents.append(ent)
        with torch.no_grad():
            h = hs[s:e].detach().float()
            logits = head(hs[s:e].detach()).float()
            if it is not None:
                logits = logits * it[:, None]
                h = h * it[:, None]
            top, ids = torch.topk(logits, min(K, logits.shape[-1]), dim=-1)
            pi = torch.softmax(top, -1)
            onehot = (ids == tgt[s:e, None]).float()
            m_h, m_f, g = capo_terms(h, ids, pi, onehot, adv[s:e], state, lr, beta1, beta2)
            keep = capo_keep(m_h, m_f, float(params["tau_update"]), float(params["tau_kl"]), bool(params["symmetric"]))
            accumulate_rows(pending, ids, g, keep * lmask[s:e])
            mhs.append(m_h)
            mfs.append(m_f)

    def grid(parts):
        flat = torch.cat(parts) if parts else hs.float().sum(-1)
        return torch.zeros(B * R, dtype=torch.float32, device=hs.device).index_copy(0, flat_idx, flat).view(B, R)

    return grid(lps), (grid(ents) if want_ent else None), {"predicted_change": grid(mhs).detach(),
                                                            "predicted_kl": grid(mfs).detach()}


# ----------------------------------------------------------------------------- the loss
def _capo_example(logprobs: torch.Tensor, generator: torch.Generator) -> dict:
    """Per-token predicted objective change and Fisher KL (its forward pass computes them in a run)."""
    return {"extras": {"predicted_change": 1e-3 * torch.randn(logprobs.shape, generator=generator),
                       "predicted_kl": 2e-3 * torch.rand(logprobs.shape, generator=generator)}}


@POLICY_LOSSES.register("capo", paper=_CAPO_PAPER, params=CAPOParams, capo_forward=True, after_step=capo_after_step,
                        extras=("predicted_change", "predicted_kl", "loss_state"), example_inputs=_capo_example)
def capo_loss(inp: PolicyLossInput, *, eps_low: float, eps_high: float, top_k: int, tau_update: float, tau_kl: float,
              symmetric: bool) -> Tuple[torch.Tensor, Metrics]:
    """PPO's clipped surrogate on the tokens CAPO keeps; masked tokens get zero loss and zero gradient.

    ``L_t = keep_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))`` with ``keep_t`` from
    :func:`capo_keep` on ``inp.extras["predicted_change"]`` (``m_H``) and ``inp.extras["predicted_kl"]`` (``m_F``), which
    :func:`capo_forward` fills (``top_k`` acts there). The mask is per token, from quantities fixed
    before the step, so it does not depend on the micro-batch split.

    Returns:
        ``(loss_mat [B, R], metrics)``: PPO's clip and ratio metrics plus ``capo/mask_frac`` (share of
        response tokens masked), ``capo/update_mask_frac`` and ``capo/kl_mask_frac`` (share failing
        each test), ``capo/update_abs_mean`` (mean ``|m_H|``) and ``capo/kl_mean`` (mean ``m_F``).
    Raises:
        ValueError: the predictions are missing (the trainer did not run :func:`capo_forward`).
    """
    if inp.extras.get("predicted_change") is None or inp.extras.get("predicted_kl") is None:
        raise ValueError("loss=capo needs predicted_change and predicted_kl from rlpost.algos.capo.capo_forward")
    ratio, log_ratio = _ratio(inp)
    m = inp.response_mask
    mh, mf = inp.extras.get("predicted_change").to(ratio.device), inp.extras.get("predicted_kl").to(ratio.device)
    keep = capo_keep(mh, mf, tau_update, tau_kl, symmetric)
    loss, low, high, extra = _ppo_core(ratio, inp.advantages, eps_low, eps_high, None, m)
    loss = loss * keep
    metrics = _clip_metrics(ratio, log_ratio, low * keep, high * keep, m)
    metrics.update(extra)
    with torch.no_grad():
        metrics["capo/mask_frac"] = masked_mean(1.0 - keep, m)
        metrics["capo/update_mask_frac"] = masked_mean(1.0 - capo_keep(mh, mf, tau_update, 0.0, symmetric), m)
        metrics["capo/kl_mask_frac"] = masked_mean(1.0 - capo_keep(mh, mf, 0.0, tau_kl, symmetric), m)
        metrics["capo/update_abs_mean"] = masked_mean(mh.abs(), m)
        metrics["capo/kl_mean"] = masked_mean(mf, m)
    return loss, metrics
