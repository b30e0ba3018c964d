"""POISE: a value baseline from the policy's own hidden states, predicted across rollouts of a prompt.

"Your Language Model is Its Own Critic: Reinforcement Learning with Value Estimation from Actor's
Internal States" (POISE, Choi, Lim et al., arXiv:2605.07579; authors' code
https://github.com/holi-lab/POISE). A lightweight probe predicts the expected verifiable reward of a
prompt from the policy's hidden states of the prompt and of a generated trajectory plus token-entropy
statistics, and is fitted online alongside the policy. To keep the policy gradient unbiased although
the features depend on a trajectory, rollout ``i``'s baseline is predicted from the *other* rollouts
of its prompt (cross-rollout construction): ``A_i = r_i - b_i``, ``b_i = mean_{j != i} V(phi_j)``.

The paper's text beyond the abstract was not read here; this module follows the authors' released
code (``src/poise/core.py``, ``estimator.py``, ``domain_estimator_bank.py``, the Qwen3-4B configs and
``scripts/train/_poise.sh``), which settles what the abstract leaves open:

* **features** (``feature_builder_config_qwen3_4b.json``): the mean of the last 10 prompt tokens'
  hidden states and the mean of the last 10 response tokens' hidden states, both at
  ``hidden_states[19]`` of Qwen3-4B's 36 layers (here ``round(layer_frac * num_layers)``,
  ``layer_frac = 0.53``), and mean token entropies (the authors' response, reasoning and answer
  means; our tasks have no ``<think>`` block, so only the response mean: our reduction);
* **probe** (``estimator_fit_config_qwen3_4b.json``, ``fit_estimator``): PCA of the prompt part to 32
  and of the response part to 64 dimensions, standardisation of the concatenated features, ridge
  regression with ``alpha = 100`` and an intercept, predictions clipped to ``[0, 1]``; refitted in
  closed form on a FIFO buffer of the most recent rows (4096 for math) after each step, not trained
  by gradient steps (so it has no optimizer: its state is the buffer and the fitted weights, saved in
  the run's checkpoint with the rest of the algorithm state);
* **target** (``target_mode = other_rollout_correctness``): the probe's target for the features of
  rollout ``j`` is the mean reward of the other rollouts of its prompt (their outcome, independent of
  rollout ``j``'s own), so the probe learns the prompt's value and not rollout ``j``'s outcome;
* **baseline**: ``b_i`` is the mean of the *pre-update* probe's predictions of the other rollouts
  (``compute_group_targets_and_cross_baselines``); the probe is refitted after the advantages are
  formed, so no rollout's reward reaches its own baseline;
* **bootstrap** (``_poise.sh``: 16 steps from scratch with 2 rollouts per prompt): until the probe is
  first fitted the baseline is the leave-one-out mean reward of the other rollouts (RLOO).

Departures: the features come from one extra no-grad forward of the policy over the batch (the
authors capture them in the actor's own forward pass); one probe for all prompts (the authors keep
one per domain: math, code, other). With two rollouts per prompt (the authors' setting) the
cross-rollout baseline of rollout 1 is the prediction from rollout 2 and vice versa.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, _broadcast
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.core.registry import param
from rlpost.models.logprobs import backbone_and_head, build_inputs, eval_mode

_PAPER = ("Your Language Model is Its Own Critic: Reinforcement Learning with Value Estimation from Actor's "
          "Internal States (POISE, arXiv:2605.07579); authors' code https://github.com/holi-lab/POISE")


@dataclass(frozen=True)
class PoiseParams:
    """POISE's probe and cross-rollout baseline (defaults: the authors' released Qwen3-4B configuration)."""

    layer_frac: float = param(0.53, "hidden layer read, as a fraction of the depth (authors: layer 19 of 36)")
    pool_tokens: int = param(10, "mean over the last n prompt / response tokens (authors: last_n_mean, n = 10)")
    prompt_pca_dim: int = param(32, "PCA dimensions of the prompt hidden state (authors: 32)")
    response_pca_dim: int = param(64, "PCA dimensions of the response hidden state (authors: 64)")
    ridge_alpha: float = param(100.0, "ridge penalty on the standardised features (authors: 100)")
    buffer_rows: int = param(4096, "most recent rows the probe is refitted on (authors, math domain: 4096)")
    bootstrap_steps: int = param(16, "steps with the RLOO baseline before the first fit (authors: 16)")


def cross_rollout_baseline(pred: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64 ``b_i = mean_{j != i, same group} pred_j`` (POISE's cross-rollout baseline).

    ``b_i`` never reads ``pred_i``. Raises:
        ValueError: a group with a single row (no other rollout to predict from).
    """
    p = pred.double()
    gi = group_index.long()
    n = int(gi.max()) + 1 if gi.numel() else 0
    s = torch.zeros(n, dtype=torch.float64).index_add_(0, gi, p)
    c = torch.zeros(n, dtype=torch.float64).index_add_(0, gi, torch.ones_like(p))
    if bool((c[gi] < 2).any()):
        raise ValueError("poise needs at least 2 rollouts per prompt (the baseline of a rollout is predicted from "
                         "another rollout of its prompt): set algo.n_samples_per_prompt >= 2")
    return (s[gi] - p) / (c[gi] - 1)


@ADV_ESTIMATORS.register("poise", paper=_PAPER, params=PoiseParams, needs_group=True, needs_probe=True)
def poise_advantage(inp: AdvantageInput, *, layer_frac: float, pool_tokens: int, prompt_pca_dim: int,
                    response_pca_dim: int, ridge_alpha: float, buffer_rows: int,
                    bootstrap_steps: int) -> AdvantageOutput:
    """POISE's advantage ``A_i = r_i - mean_{j != i} V(phi_j)`` over the rollouts of each prompt (module docstring).

    The probe parameters are read by the runner's probe stage (:class:`PoiseProbe`); here only
    ``inp.probe_values`` ``[B]`` matter: the pre-update probe's prediction from each row's own
    features. NaN anywhere (the probe is not fitted yet) or None: the bootstrap baseline, the
    other rollouts' mean reward (RLOO). No normalisation (the authors' advantage is ``r - b``).
    Shapes: ``[B]`` -> ``[B, R]`` (0 outside ``response_mask``).

    Raises:
        ValueError: a prompt with a single rollout.
    """
    r = inp.rewards.double()
    v = inp.probe_values
    pred = r if v is None or not bool(torch.isfinite(v).all()) else v.double()
    b = cross_rollout_baseline(pred, inp.group_index)
    return AdvantageOutput(advantages=_broadcast(r - b, inp.response_mask))


def other_rollout_targets(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64 probe targets: the mean reward of the other rollouts of each row's prompt
    (the authors' ``other_rollout_correctness``). Raises ValueError for a single-row group."""
    return cross_rollout_baseline(rewards, group_index)


def _last_n_mean(h: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, H]`` mean of ``h`` ``[B, T, H]`` over each row's last ``n`` positions with ``mask > 0``."""
    m = (mask > 0).long()
    rank_from_end = m.flip(-1).cumsum(-1).flip(-1)  # 1 at the last real position, 2 before it, ...
    sel = ((rank_from_end <= n) & (m > 0)).to(h.dtype)
    return (h * sel[..., None]).sum(1) / sel.sum(1, keepdim=True).clamp(min=1)


@torch.no_grad()
def hidden_features(policy: torch.nn.Module, batch: Any, layer_frac: float, pool_tokens: int,
                    device: torch.device, rows_per_pass: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    """The policy's pooled hidden states: ``(prompt [B, H], response [B, H])`` float32 on the CPU.

    One no-grad forward of the decoder (``output_hidden_states``) per ``rows_per_pass`` rows;
    ``hidden_states[round(layer_frac * num_layers)]`` (index 0 = the embeddings), pooled over the
    last ``pool_tokens`` real prompt tokens and the last ``pool_tokens`` response tokens.

    Raises:
        ValueError: ``layer_frac`` outside [0, 1] or ``pool_tokens < 1``.
    """

    if not 0.0 <= layer_frac <= 1.0 or pool_tokens < 1:
        raise ValueError(f"poise: layer_frac must be in [0, 1] and pool_tokens >= 1, got {layer_frac}, {pool_tokens}")
    base, _ = backbone_and_head(policy)
    layer = int(round(layer_frac * int(base.config.num_hidden_layers)))
    P = batch.prompt_ids.shape[1]
    outs_p: List[torch.Tensor] = []
    outs_r: List[torch.Tensor] = []
    with eval_mode(policy):
        for s in range(0, len(batch), rows_per_pass):
            sl = slice(s, s + rows_per_pass)
            rm = batch.response_mask[sl]
            ids, attn, pos = build_inputs(batch.prompt_ids[sl], batch.prompt_mask[sl], batch.response_ids[sl],
                                          (rm > 0).long())
            hs = base(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device),
                      output_hidden_states=True).hidden_states[layer].float()
            outs_p.append(_last_n_mean(hs[:, :P], batch.prompt_mask[sl].to(device), pool_tokens).cpu())
            outs_r.append(_last_n_mean(hs[:, P:], rm.to(device), pool_tokens).cpu())
    return torch.cat(outs_p), torch.cat(outs_r)


def entropy_stats(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` mean token entropy (nats) of each response (the authors' ``output_mean_token_entropy``)."""
    m = (mask > 0).double()
    return ((entropy.double() * m).sum(-1) / m.sum(-1).clamp(min=1))[:, None]


class PoiseProbe:
    """POISE's online value probe: PCA + standardisation + ridge, refitted on recent rows (authors' code).

    Args:
        params: the estimator's :class:`PoiseParams` fields (as a dict or the dataclass).

    Features of a row: ``prompt [H]``, ``response [H]`` hidden states and ``scalars [S]``; the fit
    (all float64): PCA of each hidden part (centred, top ``*_pca_dim`` right singular vectors, at
    most rows - 1 of them), concatenation with the scalars, standardisation (population std; a
    constant column gets scale 1), ridge ``w = (X^T X + alpha I)^{-1} X^T (y - mean y)`` (solved as least
    squares on ``[X; sqrt(alpha) I]``; the minimum-norm solution when singular),
    intercept ``mean y``; predictions clipped to ``[0, 1]``.
    """

    def __init__(self, params: Any) -> None:
        p = params if isinstance(params, dict) else {k: getattr(params, k) for k in PoiseParams.__dataclass_fields__}
        self.prompt_dim = int(p["prompt_pca_dim"])
        self.response_dim = int(p["response_pca_dim"])
        self.alpha = float(p["ridge_alpha"])
        self.buffer_rows = int(p["buffer_rows"])
        self.bootstrap_steps = int(p["bootstrap_steps"])
        if self.alpha < 0 or self.buffer_rows < 2 or self.prompt_dim < 0 or self.response_dim < 0:
            raise ValueError("poise: ridge_alpha >= 0, buffer_rows >= 2 and PCA dimensions >= 0 are required")
        self.rows: Dict[str, Optional[torch.Tensor]] = {"prompt": None, "response": None, "scalars": None,
                                                        "target": None}
        self.steps = 0  # update() calls
        self.fit_state: Optional[Dict[str, torch.Tensor]] = None

    @property
    def fitted(self) -> bool:
        """Whether :meth:`predict` has weights (after ``bootstrap_steps`` updates)."""
        return self.fit_state is not None

    @staticmethod
    def _pca(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        mean = x.mean(0)
        k = min(k, x.shape[0] - 1, x.shape[1])
        if k <= 0:
            return mean, torch.zeros(x.shape[1], 0, dtype=x.dtype)
        _, _, vh = torch.linalg.svd(x - mean, full_matrices=False)
        return mean, vh[:k].T

    def _design(self, prompt: torch.Tensor, response: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        f = self.fit_state
        assert f is not None
        return torch.cat([(prompt.double() - f["p_mean"]) @ f["p_comp"],
                          (response.double() - f["r_mean"]) @ f["r_comp"], scalars.double()], dim=1)

    def predict(self, prompt: torch.Tensor, response: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        """``[B]`` float32 predicted rewards in ``[0, 1]``; all NaN while not fitted."""
        if self.fit_state is None:
            return torch.full((prompt.shape[0],), float("nan"))
        f = self.fit_state
        x = (self._design(prompt, response, scalars) - f["x_mean"]) / f["x_scale"]
        return (x @ f["coef"] + f["intercept"]).clamp(0.0, 1.0).float()

    def update(self, prompt: torch.Tensor, response: torch.Tensor, scalars: torch.Tensor,
               target: torch.Tensor) -> Dict[str, float]:
        """Append one step's rows (oldest dropped past ``buffer_rows``) and refit once past the bootstrap.

        Returns metrics: ``poise/buffer_rows``, ``poise/fitted`` and, after a fit,
        ``poise/train_rmse`` on the buffer.
        """
        new = {"prompt": prompt, "response": response, "scalars": scalars, "target": target}
        for k, v in new.items():
            v = v.detach().double().cpu()
            old = self.rows[k]
            self.rows[k] = (v if old is None else torch.cat([old, v]))[-self.buffer_rows:]
        self.steps += 1
        m = {"poise/buffer_rows": float(self.rows["target"].shape[0])}
        if self.steps >= self.bootstrap_steps and self.rows["target"].shape[0] >= 2:
            self.fit()
            pred = self.predict(self.rows["prompt"], self.rows["response"], self.rows["scalars"]).double()
            m["poise/train_rmse"] = float(((pred - self.rows["target"]) ** 2).mean().sqrt())
        m["poise/fitted"] = float(self.fitted)
        return m

    def fit(self) -> None:
        """Refit PCA, scaler and ridge in closed form on the buffer (the authors' ``fit_estimator``)."""
        P, Rh, S, y = (self.rows[k] for k in ("prompt", "response", "scalars", "target"))
        p_mean, p_comp = self._pca(P, self.prompt_dim)
        r_mean, r_comp = self._pca(Rh, self.response_dim)
        self.fit_state = {"p_mean": p_mean, "p_comp": p_comp, "r_mean": r_mean, "r_comp": r_comp}
        x = self._design(P, Rh, S)
        x_mean, x_scale = x.mean(0), x.std(0, unbiased=False)
        x_scale = torch.where(x_scale > 0, x_scale, torch.ones_like(x_scale))
        xs = (x - x_mean) / x_scale
        y_mean = y.mean()
        d = xs.shape[1]
        if d:  # ridge as least squares on [X; sqrt(alpha) I] w = [y - mean y; 0] (SVD solver: minimum norm if singular)
            a = torch.cat([xs, math.sqrt(self.alpha) * torch.eye(d, dtype=torch.float64)])
            rhs = torch.cat([y - y_mean, torch.zeros(d, dtype=torch.float64)])
            coef = torch.linalg.lstsq(a, rhs[:, None], driver="gelsd").solution[:, 0]
        else:
            coef = torch.zeros(0, dtype=torch.float64)
        self.fit_state.update({"x_mean": x_mean, "x_scale": x_scale, "coef": coef, "intercept": y_mean})

    def state_dict(self) -> Dict[str, Any]:
        """Buffer, step count and fitted weights (tensors; saved in the run's checkpoint)."""
        return {"rows": dict(self.rows), "steps": self.steps,
                "fit_state": None if self.fit_state is None else dict(self.fit_state)}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.rows = dict(sd["rows"])
        self.steps = int(sd["steps"])
        self.fit_state = None if sd["fit_state"] is None else dict(sd["fit_state"])


def probe_step(probe: PoiseProbe, batch: Any, policy: torch.nn.Module, device: Any, logprobs: Any, layer_frac: float,
               pool_tokens: int) -> Dict[str, float]:
    """POISE's input stage: features of every row, pre-update predictions, then the probe's update.

    ``policy`` on ``device`` gives the hidden states, ``logprobs(batch, with_entropy=True)`` the entropy.

    Sets ``batch.extras['probe_values']`` ``[B]`` (NaN while not fitted) from the probe as it was
    before this step, then appends this step's rows with their other-rollout targets and refits.
    Returns ``poise/...`` metrics (``poise/pred_mean``, ``poise/baseline_rmse``: the cross-rollout
    baselines' error against the rewards, when fitted).
    """
    prompt_h, resp_h = hidden_features(policy, batch, layer_frac, pool_tokens, device)
    _, ent = logprobs(batch, with_entropy=True)
    scal = entropy_stats(ent, batch.response_mask)
    pred = probe.predict(prompt_h, resp_h, scal)
    batch.extras["probe_values"] = pred
    m: Dict[str, float] = {"poise/entropy_mean": float(scal.mean())}
    if probe.fitted:
        b = cross_rollout_baseline(pred, batch.group_index)
        m["poise/pred_mean"] = float(pred.mean())
        m["poise/baseline_rmse"] = float(((b - batch.rewards.double()) ** 2).mean().sqrt())
    m.update(probe.update(prompt_h, resp_h, scal, other_rollout_targets(batch.rewards, batch.group_index)))
    return m
