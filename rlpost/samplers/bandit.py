"""Contextual rollout bandits: a neural scheduler picks which rollouts (fresh or replayed) a step trains on.

"Contextual Rollout Bandits for Reinforcement Learning with Verifiable Rewards" (CBS; Lu, Wang,
Chai et al., arXiv:2602.08499). Every rollout is an arm with a context vector (:func:`arm_features`);
a small neural network predicts each arm's value, and the arms of a group compete for the group's
``k`` training slots. An arm's reward is the performance gain its step produced: the change in the
mean reward of fresh rollouts between consecutive steps (:meth:`BanditSchedulerSampler.sample`
assigns it to the arms the previous step trained on). Historical rollouts stay in a replay buffer
and re-enter as arms when their prompt is drawn again, so the scheduler decides between fresh and
reused data within one framework.

Choices the abstract leaves open (all ours, the full paper was not available to read):

* arm context: reward, group-normalised advantage and its magnitude, response length / budget,
  finished flag, mean rollout log-prob per token, age in steps (0 fresh), group reward std;
* value model: a 2-layer MLP (``hidden`` units, tanh) trained online by Adam on squared error,
  with a NeuralLinUCB bonus ``exploration_coef * sqrt(phi^T A^-1 phi)`` on its hidden layer
  ``phi`` (``A = I + sum phi phi^T`` over rewarded arms);
* noise-aware selection within a group: ``k = max(min_keep, round(select_ratio * n))`` of the
  group's fresh + replayed arms by UCB score, but when the candidates hold both a best and a worst
  reward the kept set holds both (so a group-relative advantage never loses its signal to a
  noisy score);
* replay: per dataset prompt, the fresh rollouts a step did *not* keep wait in a FIFO buffer of at
  most ``buffer_size`` rows in all (oldest dropped first) and at most ``max_age`` steps;
  replayed rows keep their original rollout log-probs (off-policy by their age: pair with an
  importance correction, e.g. ``precision.correction=tis``).

Rows left out of the batch were scored; their rewards go to :attr:`SampleResult.dropped`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from rlpost.core.registry import param
from rlpost.rollout.base import GenerationResult, concat_generations
from rlpost.samplers.base import (SAMPLERS, SampleResult, Sampler, generate_groups, pad_id_of, score_rows,
                                  select_rows, step_params)

N_FEATURES = 8


def arm_features(rewards: torch.Tensor, group: torch.Tensor, gen: GenerationResult, max_new_tokens: int,
                 age: torch.Tensor) -> torch.Tensor:
    """``[B, 8]`` context of each arm (rollout).

    Columns: reward; ``A = (r - mean_g) / (std_g + 1e-6)`` over the arm's candidate group;
    ``|A|``; response length / ``max_new_tokens``; finished (0/1); mean rollout log-prob per
    response token (nats); ``age / 10`` (steps since generation); the group's reward std.

    Args:
        rewards: ``[B]`` float; group: ``[B]`` long group ids; gen: the arms' generation rows;
        max_new_tokens: the length budget (> 0); age: ``[B]`` float steps.
    """
    r = rewards.double()
    adv = torch.zeros_like(r)
    gstd = torch.zeros_like(r)
    for g in torch.unique(group).tolist():
        idx = torch.nonzero(group == g).flatten()
        mu, sd = r[idx].mean(), r[idx].std(unbiased=False)
        adv[idx] = (r[idx] - mu) / (sd + 1e-6)
        gstd[idx] = sd
    n = gen.response_mask.sum(-1).double()
    lp = (gen.rollout_logprobs.double() * gen.response_mask.double()).sum(-1) / n.clamp(min=1)
    return torch.stack([r, adv, adv.abs(), n / max(1, int(max_new_tokens)), gen.finished.double(), lp,
                        age.double() / 10.0, gstd], -1).float()


def noise_aware_topk(scores: torch.Tensor, rewards: torch.Tensor, k: int) -> List[int]:
    """Indices of the ``k`` highest ``scores``, keeping one best- and one worst-reward arm when rewards differ.

    Args:
        scores: ``[n]`` UCB scores of one group's candidate arms; rewards: ``[n]``; k: slots (>= 1).
    Returns:
        Sorted list of ``min(k, n)`` indices. When ``k >= 2`` and ``max(rewards) > min(rewards)``,
        it contains the highest-scored arm among those with the maximal reward and the
        highest-scored among those with the minimal reward; the other slots go by score.
    """
    n = scores.shape[0]
    k = min(int(k), n)
    order = torch.argsort(scores, descending=True, stable=True).tolist()
    keep: List[int] = []
    if k >= 2 and float(rewards.max()) > float(rewards.min()):
        hi = [i for i in order if float(rewards[i]) == float(rewards.max())][0]
        lo = [i for i in order if float(rewards[i]) == float(rewards.min())][0]
        keep = [hi, lo]
    for i in order:
        if len(keep) >= k:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


class ArmValueNet(torch.nn.Module):
    """The scheduler's value model: ``x [B, 8] -> (value [B], phi [B, hidden])`` (2-layer tanh MLP)."""

    def __init__(self, hidden: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.l1 = torch.nn.Linear(N_FEATURES, hidden)
        self.l2 = torch.nn.Linear(hidden, 1)
        with torch.no_grad():
            for lin in (self.l1, self.l2):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / math.sqrt(lin.weight.shape[1]))
                lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        phi = torch.tanh(self.l1(x))
        return self.l2(phi).squeeze(-1), phi


@dataclass(frozen=True)
class BanditSchedulerParams:
    """Parameters of :class:`BanditSchedulerSampler` (CBS, arXiv:2602.08499; values are ours)."""

    select_ratio: float = param(0.5, "share of a group's n slots the scheduler fills (k = max(min_keep, round(ratio * n))).")
    min_keep: int = param(2, "slots every group keeps at least (a group-relative advantage needs 2).")
    buffer_size: int = param(256, "historical rollouts held for replay, over all prompts (0: no replay).")
    max_age: int = param(8, "steps a buffered rollout stays replayable.")
    exploration_coef: float = param(0.5, "NeuralLinUCB bonus weight on the value net's hidden features.")
    hidden: int = param(16, "hidden units of the value net.")
    lr: float = param(0.01, "Adam learning rate of the value net.")


@SAMPLERS.register(
    "bandit_scheduler",
    paper="Contextual Rollout Bandits for Reinforcement Learning with Verifiable Rewards (CBS, arXiv:2602.08499)",
    description="n fresh rollouts + replayed ones of the prompt compete as bandit arms; a neural UCB scheduler keeps k per group.",
    params=BanditSchedulerParams,
)
class BanditSchedulerSampler(Sampler):
    """Neural contextual-bandit rollout scheduler with intra-group selection and replay (see the module docstring).

    Each step: ``n`` fresh rollouts per prompt are generated and scored; the buffered rollouts of
    the same dataset prompt (``ctx.prompt_indices``) join them as candidate arms; every arm gets
    ``value + exploration_coef * sqrt(phi^T A^-1 phi)``; each group keeps
    :func:`noise_aware_topk` of its candidates. Before that, the arms kept at the previous step
    receive the reward ``gain = mean fresh reward now - mean fresh reward then`` and the value net
    takes one Adam step on them.

    Metrics: ``sampler/replayed`` (buffered rows in the batch), ``sampler/pruned`` (fresh rows left
    out), ``sampler/buffer_rows``, ``sampler/gain``, ``sampler/value_loss``, ``sampler/kept``.

    Raises:
        ValueError: ``select_ratio`` outside (0, 1], ``min_keep < 1``, a negative buffer size or
            age, ``hidden < 1`` or ``lr <= 0``; (from :meth:`sample`) no scorer in the context.
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int, *, select_ratio: float, min_keep: int, buffer_size: int, max_age: int,
                 exploration_coef: float, hidden: int, lr: float) -> None:
        super().__init__(n_samples)
        if not 0 < select_ratio <= 1:
            raise ValueError(f"select_ratio must be in (0, 1], got {select_ratio}")
        if min_keep < 1 or buffer_size < 0 or max_age < 0 or hidden < 1 or lr <= 0:
            raise ValueError("bandit_scheduler needs min_keep >= 1, buffer_size >= 0, max_age >= 0, hidden >= 1, lr > 0")
        self.select_ratio, self.min_keep = float(select_ratio), int(min_keep)
        self.buffer_size, self.max_age = int(buffer_size), int(max_age)
        self.exploration_coef = float(exploration_coef)
        self.net = ArmValueNet(int(hidden))
        self.opt = torch.optim.Adam(self.net.parameters(), lr=float(lr))
        self.A = torch.eye(int(hidden), dtype=torch.float64)
        self.pending: Optional[torch.Tensor] = None  # features of the arms the last step trained on
        self.last_perf: Optional[float] = None
        self.buffer: Dict[Any, List[Tuple[GenerationResult, float, int]]] = {}  # prompt key -> (row, reward, step)

    # --------------------------------------------------------------- bandit
    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """``[B]`` UCB scores of arms with context ``x`` ``[B, 8]``."""
        with torch.no_grad():
            v, phi = self.net(x)
            ainv = torch.linalg.inv(self.A)
            p = phi.double()
            bonus = torch.sqrt(((p @ ainv) * p).sum(-1).clamp(min=0)).float()
        return v + self.exploration_coef * bonus

    def update(self, x: torch.Tensor, reward: float) -> float:
        """One Adam step of the value net on arms ``x`` ``[B, 8]`` that all earned ``reward``; returns the loss."""
        if x.shape[0] == 0:
            return 0.0
        v, phi = self.net(x)
        loss = ((v - float(reward)) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        p = phi.detach().double()
        self.A += p.T @ p
        return float(loss)

    def _buffer_rows(self) -> int:
        return sum(len(v) for v in self.buffer.values())

    def _push(self, key: Any, row: GenerationResult, reward: float, step: int) -> None:
        if self.buffer_size <= 0:
            return
        self.buffer.setdefault(key, []).append((row, reward, step))
        while self._buffer_rows() > self.buffer_size:  # drop the oldest row over all prompts
            k_old = min((k for k in self.buffer if self.buffer[k]), key=lambda k: self.buffer[k][0][2])
            self.buffer[k_old].pop(0)
            if not self.buffer[k_old]:
                del self.buffer[k_old]

    # --------------------------------------------------------------- sampling
    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        res = generate_groups(engine, prompts, self.counts(len(prompts), ctx), step_params(params, ctx, 0))
        score_rows(ctx, res)
        metrics: Dict[str, float] = {}
        perf = float(res.rewards.float().mean())
        if self.pending is not None and self.last_perf is not None:  # reward the last step's arms with the gain
            gain = perf - self.last_perf
            metrics["sampler/gain"] = gain
            metrics["sampler/value_loss"] = self.update(self.pending, gain)
        self.last_perf = perf
        keys = list(ctx.prompt_indices) if ctx.prompt_indices is not None else [None] * len(prompts)
        # candidates: fresh rows, then each group's buffered rows (still young enough)
        fresh_n = res.group_index.shape[0]
        gens, rew, grp, age, origin = [res.generation], [res.rewards.float()], [res.group_index], \
            [torch.zeros(fresh_n)], [(-1, i) for i in range(fresh_n)]
        for pos, key in enumerate(keys):
            if key is None or key not in self.buffer:
                continue
            live = [(g, r, s) for g, r, s in self.buffer[key] if ctx.step - s <= self.max_age]
            self.buffer[key] = live
            for j, (g, r, s) in enumerate(live):
                gens.append(g)
                rew.append(torch.tensor([r]))
                grp.append(torch.tensor([pos]))
                age.append(torch.tensor([float(ctx.step - s)]))
                origin.append((pos, j))
        pad = pad_id_of(engine)
        cand = concat_generations(gens, pad) if len(gens) > 1 else gens[0]
        R, G, AGE = torch.cat(rew), torch.cat(grp).long(), torch.cat(age)
        x = arm_features(R, G, cand, int(params.max_new_tokens), AGE)
        s = self.scores(x)
        keep: List[int] = []
        dropped = []
        for g in sorted(set(G.tolist())):
            idx = torch.nonzero(G == g).flatten()
            n_fresh = int((idx < fresh_n).sum())
            k = max(min(self.min_keep, len(idx)), int(round(self.select_ratio * max(1, n_fresh))))
            sel = [int(idx[i]) for i in noise_aware_topk(s[idx], R[idx], k)]
            keep.extend(sel)
            out = [float(R[i]) for i in idx.tolist() if i < fresh_n and i not in set(sel)]
            if out:
                dropped.append((int(g), out))
        keep.sort()
        kept_set = set(keep)
        # buffer bookkeeping: replayed rows used now leave the buffer; unkept fresh rows enter it
        used = {}
        for i in keep:
            if i >= fresh_n:
                pos, j = origin[i]
                used.setdefault(pos, set()).add(j)
        for pos, js in used.items():
            key = keys[pos]
            self.buffer[key] = [b for j, b in enumerate(self.buffer[key]) if j not in js]
            if not self.buffer[key]:
                del self.buffer[key]
        for i in range(fresh_n):
            if i not in kept_set and keys[int(G[i])] is not None:
                self._push(keys[int(G[i])], select_rows(res.generation, [i]), float(R[i]), ctx.step)
        self.pending = x[keep].detach()
        gen = select_rows(cand, keep)
        extras = {}
        for k_, v in res.extras.items():  # fresh-only extras (reward parts) are kept for fresh rows, 0 for replayed
            if v.dim() == 1:
                full = torch.zeros(len(R), dtype=v.dtype)
                full[:fresh_n] = v
                extras[k_] = full[keep]
        out = SampleResult(generation=gen, group_index=G[keep], rollouts_spent=res.rollouts_spent, extras=extras,
                           rewards=R[keep], dropped=dropped)
        n_rep = sum(1 for i in keep if i >= fresh_n)
        metrics.update({"sampler/replayed": float(n_rep), "sampler/pruned": float(fresh_n - (len(keep) - n_rep)),
                        "sampler/buffer_rows": float(self._buffer_rows()), "sampler/kept": float(len(keep))})
        out.metrics = metrics
        return out

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102 - value net, its optimizer, A, pending arms, buffer
        return {"net": self.net.state_dict(), "opt": self.opt.state_dict(), "A": self.A, "pending": self.pending,
                "last_perf": self.last_perf, "buffer": self.buffer}

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # noqa: D102
        self.net.load_state_dict(state["net"])
        self.opt.load_state_dict(state["opt"])
        self.A, self.pending, self.last_perf = state["A"], state["pending"], state["last_perf"]
        self.buffer = state["buffer"]
