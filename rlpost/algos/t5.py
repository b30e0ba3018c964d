"""T^5's twin-critic advantages: per-critic GAE, the conditional-moment saddle point, signal retention.

Paper: "T^5: Twin-Critic Training for Token-Level Thoughts in Reinforcement Mid-Training" (Nan Qiao,
Yebin Yang, Weinong Wang et al., arXiv:2609.32791). Only the abstract was readable here (no full text,
no code in the search index): one generated trajectory per prompt; after a warm-up and a held-out
qualification the critics give two advantage estimates; they are combined with action-dependent
weights learned by a conditional-moment saddle-point objective that drives the average advantage at
each prefix toward zero; a signal-retention constraint keeps the correction from erasing the signal.

Every formula below is **our reading** of that description:

* critic ``k`` (value head ``k`` of ``algo.critic.num_heads``) gives ``A^k = GAE(gamma, lams[k])``
  with its own values; its regression target is its own GAE return, so the twins differ by their
  targets (default head 0 Monte-Carlo, ``lam=1``; head 1 bootstrapped, ``lam=0.95``);
* mixing weights ``w(s_t, a_t) = softmax(g_phi(x_t))`` over the N critics, ``x_t`` = the critics'
  advantages and values at t, the sampled token's log-prob under the pre-update policy and the
  relative position ``t / L`` (:func:`mixer_features`); ``A_w = sum_k w_k A^k``;
* the conditional moment ``E[A_w | s_t] = 0`` as the saddle point (the standard adversarial form of
  a conditional moment restriction) ``min_phi max_psi  L = mean_t[f_psi(z_t) A_w - f_psi(z_t)^2 / 2]
  + c * relu(kappa - S)^2``; the prefix test function ``f_psi`` sees only prefix features ``z_t``
  (the critics' values and ``t / L``, never the action), and its inner maximum is
  ``mean_t[E[A_w | s_t]^2] / 2``; ``f`` generalises across positions, so no prefix is re-sampled;
* signal retention ``S = sum_t A_w A_ref / sum_t A_ref^2`` with ``A_ref`` the critics' plain mean:
  the share of the unmixed signal the mix keeps; the penalty ``c relu(kappa - S)^2`` is active only
  when ``S < kappa``;
* one saddle step = one simultaneous gradient step of both players (plain SGD: the mixer descends,
  the test function ascends), :func:`saddle_step`;
* qualification: each critic's explained variance of the Monte-Carlo returns on the step's batch,
  whose values were computed before the critic saw it (held out); :func:`explained_variance`.

All tensors are ``[B, R]`` response positions (``[B, R, N]`` per critic) with a 0/1 mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput, discounted_gae, outcome_token_rewards
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.utils import masked_mean, masked_whiten
from rlpost.core.registry import param

PAPER = "T^5: Twin-Critic Training for Token-Level Thoughts in Reinforcement Mid-Training (arXiv:2609.32791)"


@dataclass(frozen=True)
class T5Params:
    """T^5's parameters; the abstract gives none of them, so every default is our reading."""

    gamma: float = param(1.0, "discount per token (our reading: 1, LLM PPO practice)")
    lams: List[float] = param(factory=lambda: [1.0, 0.95],
                              doc="GAE lambda of each critic, one per value head (algo.critic.num_heads); "
                                  "our reading: a Monte-Carlo critic (1) and a bootstrapped one (0.95)")
    qualification_threshold: float = param(0.0, "every critic's held-out explained variance of the returns must "
                                                "reach this before its advantages are used (our reading)")
    mixer_hidden: int = param(16, "hidden width of the mixing network and the prefix test function (0: linear)")
    mixer_lr: float = param(0.05, "SGD step of both saddle-point players")
    saddle_steps: int = param(4, "simultaneous descent-ascent steps per RL step")
    retention_target: float = param(0.5, "kappa: the share of the critics' mean advantage the mix must keep")
    signal_retention_coef: float = param(1.0, "c: weight of the penalty c * relu(kappa - S)^2")
    whiten: bool = param(False, "whiten the mixed advantage over the batch (off: keep its centring)")

    def __post_init__(self) -> None:
        """Range checks (a ``ValueError`` here is reported as a ConfigError naming ``algo.adv_params``)."""
        if not 0.0 <= float(self.gamma) <= 1.0:
            raise ValueError(f"gamma={self.gamma} must be in [0, 1]")
        bad = [x for x in self.lams if not 0.0 <= float(x) <= 1.0]
        if bad:
            raise ValueError(f"lams={list(self.lams)}: every GAE lambda must be in [0, 1] (got {bad})")
        for name in ("mixer_hidden", "saddle_steps"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if not float(self.mixer_lr) > 0:
            raise ValueError(f"mixer_lr={self.mixer_lr} must be > 0")
        if not 0.0 <= float(self.retention_target) <= 1.0:
            raise ValueError(f"retention_target={self.retention_target} must be in [0, 1]")
        if float(self.signal_retention_coef) < 0:
            raise ValueError(f"signal_retention_coef={self.signal_retention_coef} must be >= 0")
        if float(self.qualification_threshold) > 1.0:
            raise ValueError(f"qualification_threshold={self.qualification_threshold}: an explained variance is at most "
                             f"1, so no critic would ever qualify (<= 1)")


def head_values(values: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, R, n]`` critic values: ``values`` itself, or one head ``[B, R]`` repeated for every critic.

    Raises:
        ValueError: a ``[B, R, N]`` input with ``N != n``.
    """
    if values.dim() == 2:
        return values.unsqueeze(-1).expand(*values.shape, n)
    if values.shape[-1] != n:
        raise ValueError(f"t5 has {n} critic lambdas (algo.adv_params.lams) but the critic has {values.shape[-1]} "
                         f"value heads; set algo.critic.num_heads={n}")
    return values


@ADV_ESTIMATORS.register("t5", paper=PAPER, params=T5Params, needs_critic=True, uses_token_rewards=True,
                         multi_head_critic=True,
                         zero_variance=('single rollout (T^5): the batch-mean return until the critics qualify, then a'
                                        ' learned mix of critic advantages'))
def t5_advantage(inp: AdvantageInput, *, gamma: float, lams: List[float], whiten: bool,
                 qualification_threshold: float, mixer_hidden: int, mixer_lr: float, saddle_steps: int,
                 retention_target: float, signal_retention_coef: float) -> AdvantageOutput:
    """Each critic's GAE advantage and return, and the pre-qualification fallback.

    Returns ``advantages`` = the fallback used until the critics qualify: the Monte-Carlo return-to-go
    minus its batch mean over response tokens (a critic-free single-rollout baseline, our reading);
    ``returns`` ``[B, R, N]``, head ``k``'s GAE(gamma, lams[k]) targets; extras ``t5_head_advantages``
    ``[B, R, N]`` and ``t5_mc_returns`` ``[B, R]`` (the return-to-go, for the qualification check).
    The ``t5`` method (:mod:`rlpost.methods.t5`) replaces the advantages by the learned mix and reads
    the gate and mixing parameters (``qualification_threshold`` ... ``signal_retention_coef``, unused here).

    Raises:
        ValueError: no critic values, or a value-head count that differs from ``len(lams)``.
    """
    if inp.values is None:
        raise ValueError("t5 needs critic values (inp.values): algo.critic.enabled=true with num_heads=len(lams)")
    lams = [float(x) for x in lams]
    vals = head_values(inp.values, len(lams))
    tr = outcome_token_rewards(inp)
    m = inp.response_mask
    advs, rets = [], []
    for k, lam in enumerate(lams):
        a, r = discounted_gae(tr, vals[..., k], m, gamma, lam)
        advs.append(a)
        rets.append(r)
    _, mc = discounted_gae(tr, torch.zeros_like(m, dtype=torch.float64), m, gamma, 1.0)
    fallback = (mc - masked_mean(mc, m.double())) * m
    if whiten:
        fallback = masked_whiten(fallback, m)
    return AdvantageOutput(advantages=fallback.float(), returns=torch.stack(rets, -1).float(),
                           extras={"t5_head_advantages": torch.stack(advs, -1).float(), "t5_mc_returns": mc.float()})


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(G - V) / Var(G)`` over the mask's positions (population variances); NaN if ``Var(G) = 0``.

    Args:
        returns: ``[B, R]`` targets ``G``; values: ``[B, R]`` one critic's ``V``; mask: ``[B, R]``.
    """
    m = mask.double()
    g, v = returns.double(), values.double()
    var_g = masked_mean((g - masked_mean(g, m)) ** 2, m)
    if float(var_g) <= 1e-12:
        return float("nan")
    e = g - v
    return float(1.0 - masked_mean((e - masked_mean(e, m)) ** 2, m) / var_g)


def relative_position(mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` ``t / L`` of each response token (``L`` the row's number of masked tokens; 0 off the mask)."""
    m = (mask > 0).to(torch.float32)
    idx = torch.cumsum(m, -1) - 1
    return idx.clamp(min=0) / m.sum(-1, keepdim=True).clamp(min=1) * m


def mixer_features(head_adv: torch.Tensor, values: torch.Tensor, old_logprobs: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """The mixing network's state-action inputs ``[B, R, 2N + 2]``: ``A^1..A^N, V^1..V^N, log pi_old(a_t|s_t), t/L``.

    Args:
        head_adv: ``[B, R, N]``; values: ``[B, R, N]`` (or ``[B, R]``); old_logprobs: ``[B, R]``; mask: ``[B, R]``.
    """
    n = head_adv.shape[-1]
    v = head_values(values, n).float()
    lp = old_logprobs.float().clamp(min=-20.0).unsqueeze(-1)
    return torch.cat([head_adv.float(), v, lp, relative_position(mask).unsqueeze(-1)], -1)


def prefix_features(values: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """The test function's prefix-only inputs ``[B, R, N + 1]``: ``V^1..V^N, t/L`` (nothing of the action)."""
    return torch.cat([head_values(values, n).float(), relative_position(mask).unsqueeze(-1)], -1)


def _mlp(n_in: int, n_out: int, hidden: int, gen: torch.Generator) -> torch.nn.Sequential:
    """A tanh MLP (or one linear layer for ``hidden=0``) whose output layer starts at 0."""
    layers: List[torch.nn.Module] = []
    if hidden > 0:
        first = torch.nn.Linear(n_in, hidden)
        with torch.no_grad():
            first.weight.copy_(torch.randn(first.weight.shape, generator=gen) / n_in ** 0.5)
            first.bias.zero_()
        layers += [first, torch.nn.Tanh()]
        n_in = hidden
    last = torch.nn.Linear(n_in, n_out)
    torch.nn.init.zeros_(last.weight)
    torch.nn.init.zeros_(last.bias)
    return torch.nn.Sequential(*layers, last)


class TwinMixer(torch.nn.Module):
    """The two saddle-point players of T^5 (our reading): the mixer ``g_phi`` and the prefix test function ``f_psi``.

    ``weights(x)`` ``[..., N]`` = softmax of the mixer's N logits over the critics (uniform at
    initialisation: the plain mean of the critics); ``test(z)`` ``[...]`` = the prefix test function
    (0 at initialisation). Float32, on the CPU.

    Args:
        n_critics: N >= 2; hidden: width of both MLPs (0: linear); seed: initialisation seed.
    Raises:
        ValueError: ``n_critics < 2``.
    """

    def __init__(self, n_critics: int, hidden: int = 16, seed: int = 0) -> None:
        super().__init__()
        if n_critics < 2:
            raise ValueError(f"T^5 mixes at least 2 critics, got {n_critics}")
        g = torch.Generator().manual_seed(int(seed))
        self.n = int(n_critics)
        self.mixer = _mlp(2 * self.n + 2, self.n, int(hidden), g)
        self.test_fn = _mlp(self.n + 1, 1, int(hidden), g)

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """Mixing weights ``[..., N]`` (rows sum to 1) from state-action features ``x`` ``[..., 2N + 2]``."""
        return torch.softmax(self.mixer(x), -1)

    def test(self, z: torch.Tensor) -> torch.Tensor:
        """The test function ``f(z)`` ``[...]`` of prefix features ``z`` ``[..., N + 1]``."""
        return self.test_fn(z).squeeze(-1)


def mix_advantages(weights: torch.Tensor, head_adv: torch.Tensor) -> torch.Tensor:
    """``A_w = sum_k w_k A^k`` ``[B, R]`` from weights and per-critic advantages ``[B, R, N]``."""
    return (weights * head_adv).sum(-1)


def saddle_objective(weights: torch.Tensor, f: torch.Tensor, head_adv: torch.Tensor, mask: torch.Tensor,
                     retention_target: float, coef: float) -> Tuple[torch.Tensor, Dict[str, float]]:
    """T^5's saddle-point objective (our reading), minimised by the mixer and maximised by ``f``.

    ``L = sum_t m_t (f_t A_w,t - f_t^2 / 2) / sum_t m_t + coef * relu(kappa - S)^2`` with
    ``S = sum_t m_t A_w,t A_ref,t / sum_t m_t A_ref,t^2``, ``A_ref = mean_k A^k`` (no penalty when
    ``sum m A_ref^2 = 0``).

    Args:
        weights: ``[B, R, N]``; f: ``[B, R]``; head_adv: ``[B, R, N]``; mask: ``[B, R]``;
        retention_target: kappa; coef: c.
    Returns:
        ``(L scalar, metrics)``: ``moment`` (the first term), ``signal_retention`` (S) and
        ``retention_active`` (1 when ``S < kappa``).
    """
    m = mask.float()
    a_w = mix_advantages(weights, head_adv)
    moment = (m * (f * a_w - 0.5 * f ** 2)).sum() / m.sum().clamp(min=1)
    a_ref = head_adv.mean(-1)
    den = (m * a_ref ** 2).sum()
    if float(den) > 0:
        s = (m * a_w * a_ref).sum() / den
        pen = coef * torch.relu(retention_target - s) ** 2
        s_val = float(s.detach())
        active = float(s_val < retention_target)
    else:
        pen, s_val, active = torch.zeros((), dtype=moment.dtype), float("nan"), 0.0
    return moment + pen, {"moment": float(moment.detach()), "signal_retention": s_val, "retention_active": active}


def saddle_step(mix: TwinMixer, x: torch.Tensor, z: torch.Tensor, head_adv: torch.Tensor, mask: torch.Tensor,
                lr: float, retention_target: float, coef: float) -> Dict[str, float]:
    """One simultaneous gradient step of both players: ``phi -= lr dL/dphi``, ``psi += lr dL/dpsi``.

    Both gradients are taken at the current parameters (plain SGD, no momentum).

    Args:
        mix: the players (updated in place); x: ``[B, R, 2N + 2]`` :func:`mixer_features`;
        z: ``[B, R, N + 1]`` :func:`prefix_features`; head_adv: ``[B, R, N]``; mask: ``[B, R]``.
    Returns:
        the objective's metrics before the step (:func:`saddle_objective`).
    """
    phi, psi = list(mix.mixer.parameters()), list(mix.test_fn.parameters())
    loss, met = saddle_objective(mix.weights(x), mix.test(z), head_adv.float(), mask, retention_target, coef)
    grads = torch.autograd.grad(loss, phi + psi, allow_unused=True)
    with torch.no_grad():
        for p, g in zip(phi, grads[: len(phi)]):
            if g is not None:
                p.sub_(lr * g)
        for p, g in zip(psi, grads[len(phi):]):
            if g is not None:
                p.add_(lr * g)
    return met


def mixed_advantages(mix: TwinMixer, x: torch.Tensor, head_adv: torch.Tensor, mask: torch.Tensor,
                     whiten: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(A_w [B, R], weights [B, R, N])`` of the current mixer, detached; 0 off the mask."""
    with torch.no_grad():
        w = mix.weights(x)
        a = mix_advantages(w, head_adv.float()) * mask
        if whiten:
            a = masked_whiten(a, mask) * mask
    return a.float(), w


def run_saddle(mix: TwinMixer, x: torch.Tensor, z: torch.Tensor, head_adv: torch.Tensor, mask: torch.Tensor,
               steps: int, lr: float, retention_target: float, coef: float) -> Optional[Dict[str, float]]:
    """``steps`` :func:`saddle_step` calls; the last step's metrics (None for ``steps=0``)."""
    met = None
    for _ in range(int(steps)):
        met = saddle_step(mix, x, z, head_adv, mask, lr, retention_target, coef)
    return met
