"""Pruning samplers: fewer rollouts (or fewer rollout tokens) reach the update.

* ``sampler=d3s``: D3S sample-level down-sampling ("Learning More with Less: A
  Dynamic Dual-Level Down-Sampling Framework for Efficient Policy Optimization",
  Wang et al., arXiv:2509.22115): of each group's ``n`` scored rollouts keep the
  ``k`` whose group-normalised advantages have the largest variance; ``k / n``
  follows a curriculum from aggressive to none. The paper's token level (keep
  tokens with the largest ``|A_t| * H_t``) is :func:`d3s_token_mask`.
* ``sampler=arrol``: online rollout pruning ("Prune as You Generate: Online
  Rollout Pruning for Faster and Better RLVR", Xu et al., arXiv:2603.24840): all
  ``n`` rollouts of a prompt are generated to ``prune_at`` tokens, a quality head
  trained online predicts each partial rollout's success from the policy's hidden
  states, and only ``k`` rollouts, chosen to balance predicted successes and
  failures, are generated to the end.

Neither ever removes a whole group: every prompt keeps at least ``min_keep`` rows
(2, so a group-relative advantage exists). D3S's left-out rows were scored, and
their rewards go to the selector through :attr:`SampleResult.dropped`; arrol's
pruned rows were never finished or scored, and are counted in ``sampler/pruned_unscored``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from rlpost.core.registry import param
from rlpost.models.logprobs import eval_mode
from rlpost.rollout.hf import left_pad
from rlpost.samplers.base import (
    SAMPLERS,
    SampleResult,
    Sampler,
    concat_generations,
    generate_groups,
    pad_id_of,
    score_rows,
    select_rows,
    step_params,
)
from rlpost.samplers.speculative import _row


# ---------------------------------------------------------------- D3S
def max_variance_subset(values: torch.Tensor, k: int) -> List[int]:
    """Indices of the ``k`` entries of ``values`` ``[n]`` whose (population) variance is largest.

    A maximum-variance subset of fixed size always consists of some of the
    largest and the rest of the smallest values (moving an inner point outward
    never lowers the variance), so the ``k + 1`` top/bottom splits are tried and
    the best is returned, ties to fewer top values. ``k >= n`` returns all.
    Indices are sorted.

    Raises:
        ValueError: ``k < 0``.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    n = values.shape[0]
    if k >= n:
        return list(range(n))
    order = torch.argsort(values.double(), stable=True).tolist()
    best, best_var = None, -1.0
    for top in range(k + 1):
        idx = order[: k - top] + (order[n - top :] if top else [])
        v = float(values.double()[idx].var(unbiased=False)) if len(idx) > 1 else 0.0
        if v > best_var + 1e-12:
            best, best_var = idx, v
    return sorted(best)


def d3s_keep_ratio(step: int, start: float, end: float, steps: int) -> float:
    """The D3S curriculum: ``start`` at step 0, linearly to ``end`` at ``steps`` (then ``end``)."""
    if steps <= 0:
        return end
    f = min(1.0, max(0.0, step / steps))
    return start + (end - start) * f


def d3s_token_mask(advantages: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, keep_ratio: float,
                   scope: str = "batch") -> torch.Tensor:
    """D3S token level: keep the ``keep_ratio`` share of tokens with the largest ``|A_t| * H_t``.

    Args:
        advantages: ``[B, R]`` token advantages; entropy: ``[B, R]`` policy entropy
            (nats) at each token; mask: ``[B, R]`` 1 on response tokens (the loss mask).
        keep_ratio: in (0, 1].
        scope: ``"batch"``: the ``ceil(keep_ratio * n)`` best of all ``n`` masked
            tokens of the batch (the paper selects "across groups"; with a
            sequence-level advantage such as GRPO's, only a pooled ranking lets
            ``|A|`` matter, since it is constant within a row); ``"row"``: each row
            keeps ``ceil(keep_ratio * n_row)`` of its own tokens. Ties are broken by
            position (``torch.topk`` on the scores, which is deterministic on CPU).
    Returns:
        ``[B, R]`` float 0/1 loss mask, a subset of ``mask``.
    Raises:
        ValueError: ``keep_ratio`` outside (0, 1] or an unknown ``scope``.
    """
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    if scope not in ("batch", "row"):
        raise ValueError(f"scope must be 'batch' or 'row', got {scope!r}")
    score = (advantages.abs().float() * entropy.float()).masked_fill(mask <= 0, float("-inf"))
    out = torch.zeros(mask.shape, dtype=torch.float32)
    if scope == "batch":
        n = int((mask > 0).sum())
        k = int(math.ceil(keep_ratio * n))
        if k:
            out.view(-1)[torch.topk(score.reshape(-1), k).indices] = 1.0
        return out
    n = (mask > 0).sum(-1)
    for b in range(mask.shape[0]):
        k = int(math.ceil(keep_ratio * int(n[b])))
        if k:
            out[b, torch.topk(score[b], k).indices] = 1.0
    return out


@dataclass(frozen=True)
class D3SSamplerParams:
    """Parameters of :class:`D3SSampler` (D3S sample-level down-sampling)."""

    keep_start: float = param(0.5, "share of each group's rollouts kept at step 0 (aggressive).")
    keep_end: float = param(1.0, "share kept once the curriculum is over (1 = no down-sampling).")
    schedule_steps: int = param(100, "steps over which the kept share goes linearly from keep_start to keep_end.")
    min_keep: int = param(2, "rollouts every group keeps at least (a group-relative advantage needs 2).")
    token_keep_start: float = param(0.5, "token level: share of the batch's response tokens in the loss at step 0 "
                                         "(largest |advantage| x entropy); 1 (with token_keep_end 1) = token level off.")
    token_keep_end: float = param(1.0, "token level: share kept once the curriculum (schedule_steps) is over.")
    token_scope: str = param("batch", "token level ranks tokens over the whole batch ('batch') or within each row ('row').")


@SAMPLERS.register(
    "d3s",
    paper="Learning More with Less: A Dynamic Dual-Level Down-Sampling Framework for Efficient Policy Optimization (D3S, arXiv:2509.22115)",
    description="n rollouts per prompt, then each group keeps the subset with the largest advantage variance (curriculum).",
    params=D3SSamplerParams,
)
class D3SSampler(Sampler):
    """Sample-level D3S: keep the rollouts whose advantages vary most.

    Each prompt gets ``n`` rollouts, all scored. With ``A_i = (r_i - mean) / (std + 1e-6)``
    over the full group, the group keeps ``k = max(min_keep, round(ratio * n))``
    rollouts chosen by :func:`max_variance_subset` on ``A``; ``ratio`` follows
    :func:`d3s_keep_ratio` over ``ctx.step``. The paper selects "to maximise
    Var(A)"; whether A is normalised over the full or the kept group is left open:
    we select on the full group's A and let the algorithm's estimator recompute
    advantages on the kept rows (so an all-equal group stays all-equal). It saves
    update compute, not rollout tokens. The left-out rows' rewards go to
    :attr:`SampleResult.dropped`.

    Token level (on when ``token_keep_start`` or ``token_keep_end`` < 1): after the
    advantages are computed, :meth:`loss_token_mask` keeps the share
    ``d3s_keep_ratio(step, token_keep_start, token_keep_end, schedule_steps)`` of the
    batch's loss tokens with the largest ``|A_t| * H_t`` (:func:`d3s_token_mask`),
    ``H_t`` being the entropy of the policy *before* the update at each response
    token (the rollout policy's entropy; the paper does not say which policy's,
    and only this one exists before the update). The runner multiplies the loss
    mask by it, so the dropped tokens get no gradient and leave the token-mean
    denominators; it records them in ``extras['d3s_token_dropped']`` ``[B, R]``.
    Both levels share one curriculum length; the paper's shares and schedule were
    not checked (the recipe says so).

    Metrics: ``sampler/keep_ratio``, ``sampler/pruned`` (rows left out), and from
    the token level ``sampler/token_keep_ratio`` and ``sampler/tokens_dropped``.

    Raises:
        ValueError: a share outside (0, 1], ``min_keep < 1`` or an unknown ``token_scope``.
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int, *, keep_start: float, keep_end: float, schedule_steps: int, min_keep: int,
                 token_keep_start: float = 0.5, token_keep_end: float = 1.0, token_scope: str = "batch") -> None:
        super().__init__(n_samples)
        for name, v in (("keep_start", keep_start), ("keep_end", keep_end), ("token_keep_start", token_keep_start),
                        ("token_keep_end", token_keep_end)):
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        if min_keep < 1:
            raise ValueError(f"min_keep must be >= 1, got {min_keep}")
        if token_scope not in ("batch", "row"):
            raise ValueError(f"token_scope must be 'batch' or 'row', got {token_scope!r}")
        self.keep_start, self.keep_end = float(keep_start), float(keep_end)
        self.schedule_steps, self.min_keep = int(schedule_steps), int(min_keep)
        self.token_keep_start, self.token_keep_end = float(token_keep_start), float(token_keep_end)
        self.token_scope = token_scope

    @property
    def token_level(self) -> bool:
        """Whether the token level is on (some step keeps less than every token)."""
        return self.token_keep_start < 1.0 or self.token_keep_end < 1.0

    def loss_token_mask(self, advantages: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor,
                        step: int) -> Optional[torch.Tensor]:
        """The token-level loss mask ``[B, R]`` for ``step`` (None when the token level is off).

        Args:
            advantages, entropy, mask: ``[B, R]`` as :func:`d3s_token_mask`.
        """
        if not self.token_level:
            return None
        ratio = d3s_keep_ratio(step, self.token_keep_start, self.token_keep_end, self.schedule_steps)
        return d3s_token_mask(advantages, entropy, mask, ratio, self.token_scope)

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        res = generate_groups(engine, prompts, self.counts(len(prompts), ctx), step_params(params, ctx, 0))
        score_rows(ctx, res)
        ratio = d3s_keep_ratio(ctx.step, self.keep_start, self.keep_end, self.schedule_steps)
        keep: List[int] = []
        dropped = []
        for g in sorted(set(res.group_index.tolist())):
            rows = torch.nonzero(res.group_index == g).flatten()
            r = res.rewards[rows].double()
            adv = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
            k = max(min(self.min_keep, len(rows)), int(round(ratio * len(rows))))
            sel = max_variance_subset(adv, k)
            keep.extend(int(rows[i]) for i in sel)
            out = [float(r[i]) for i in range(len(rows)) if i not in set(sel)]
            if out:
                dropped.append((int(g), out))
        keep.sort()
        kept = SampleResult(
            generation=select_rows(res.generation, keep), group_index=res.group_index[keep],
            rollouts_spent=res.rollouts_spent, extras={k: v[keep] for k, v in res.extras.items()},
            rewards=res.rewards[keep], dropped=dropped,
        )
        kept.metrics = {"sampler/keep_ratio": ratio, "sampler/pruned": float(len(res.group_index) - len(keep))}
        return kept


# ---------------------------------------------------------------- arrol
@torch.no_grad()
def prefix_features(model: torch.nn.Module, prompts: List[List[int]], prefixes: List[List[int]], pad: int,
                    chunk: int = 16) -> torch.Tensor:
    """``[B, H]`` mean last-layer hidden state of the policy over each partial rollout's tokens.

    The quality head's input (our choice; the paper's head reads the policy's
    hidden states of the partial rollout). Rows with an empty prefix use the last
    prompt position.
    """

    dev = next(model.parameters()).device
    feats = []
    with eval_mode(model):
        for s in range(0, len(prompts), chunk):
            seqs = [p + x for p, x in zip(prompts[s : s + chunk], prefixes[s : s + chunk])]
            ids, m = left_pad(seqs, pad)
            pos = (m.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=ids.to(dev), attention_mask=m.to(dev), position_ids=pos.to(dev), output_hidden_states=True)
            h = out.hidden_states[-1].float().cpu()
            T = ids.shape[1]
            for b, x in enumerate(prefixes[s : s + chunk]):
                n = max(1, len(x))
                feats.append(h[b, T - n :].mean(0))
    return torch.stack(feats)


@dataclass(frozen=True)
class ArrolSamplerParams:
    """Parameters of :class:`ArrolSampler` (online rollout pruning with a learned quality head)."""

    keep_ratio: float = param(0.5, "share of each prompt's rollouts generated to the end (the rest are pruned at prune_at).")
    prune_at: int = param(8, "tokens generated before the pruning decision.")
    head_lr: float = param(0.1, "learning rate of the quality head (logistic regression, Adam).")
    head_epochs: int = param(20, "passes over each step's labelled partial rollouts.")
    min_keep: int = param(2, "rollouts every group keeps at least.")
    correct_threshold: float = param(0.5, "reward counted as success (the head's label).")


@SAMPLERS.register(
    "arrol",
    paper="Prune as You Generate: Online Rollout Pruning for Faster and Better RLVR (arrol, arXiv:2603.24840)",
    description="Generate every rollout to prune_at tokens, keep a success-balanced subset by a learned head, finish only those.",
    params=ArrolSamplerParams,
)
class ArrolSampler(Sampler):
    """Online rollout pruning.

    1. ``n`` rollouts per prompt are generated to ``prune_at`` tokens.
    2. The quality head ``s = sigmoid(w . f + b)`` on :func:`prefix_features`
       predicts each partial rollout's success.
    3. Each prompt keeps ``k = max(min_keep, round(keep_ratio * n))`` rollouts:
       the ``ceil(k/2)`` with the highest and the ``floor(k/2)`` with the lowest
       predicted success (our reading of "steering the survivors to be
       correctness-balanced"; before the head has seen a label it keeps the
       first ``k``). Rollouts that already ended are preferred by nothing: they
       compete like the others.
    4. Kept rollouts are continued from their prefix to ``max_new_tokens`` in one
       engine call and scored; the head takes ``head_epochs`` Adam steps of
       binary cross-entropy on (features, reward >= correct_threshold) of the
       kept rows (pruned rows have no label).

    Saves the tokens pruned rollouts would have generated after ``prune_at``.
    Metrics: ``sampler/pruned_unscored`` (rows cut at ``prune_at``, never scored), ``sampler/generated_tokens``,
    ``sampler/head_acc`` (head accuracy on this step's kept rows, before its update).

    Raises:
        ValueError: bad parameters, or (at sampling) an engine without a model.
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int, *, keep_ratio: float, prune_at: int, head_lr: float, head_epochs: int,
                 min_keep: int, correct_threshold: float) -> None:
        super().__init__(n_samples)
        if not 0 < keep_ratio <= 1:
            raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
        if prune_at < 1 or min_keep < 1:
            raise ValueError("prune_at and min_keep must be >= 1")
        self.keep_ratio, self.prune_at, self.head_lr = float(keep_ratio), int(prune_at), float(head_lr)
        self.head_epochs, self.min_keep, self.thr = int(head_epochs), int(min_keep), float(correct_threshold)
        self.head: Optional[torch.nn.Linear] = None
        self.labelled = 0

    def predict(self, f: torch.Tensor) -> torch.Tensor:
        """``[B]`` predicted success probability of features ``f`` ``[B, H]`` (0.5 before any label)."""
        if self.head is None or self.labelled == 0:
            return torch.full((f.shape[0],), 0.5)
        with torch.no_grad():
            return torch.sigmoid(self.head(f).squeeze(-1))

    def fit(self, f: torch.Tensor, y: torch.Tensor) -> None:
        """Adam steps of binary cross-entropy of the head on features ``f`` ``[B, H]`` and 0/1 labels ``y`` ``[B]``."""
        if self.head is None:
            self.head = torch.nn.Linear(f.shape[1], 1)
            torch.nn.init.zeros_(self.head.weight)
            torch.nn.init.zeros_(self.head.bias)
        opt = torch.optim.Adam(self.head.parameters(), lr=self.head_lr)
        for _ in range(self.head_epochs):
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(self.head(f).squeeze(-1), y.float())
            loss.backward()
            opt.step()
        self.labelled += int(y.numel())

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class

        model, tok = getattr(engine, "model", None), getattr(engine, "tokenizer", None)
        if model is None or tok is None:
            raise ValueError("sampler=arrol reads the policy's hidden states: use rollout=hf")
        pad = pad_id_of(engine)
        counts = self.counts(len(prompts), ctx)
        p0 = dataclasses.replace(step_params(params, ctx, 0), max_new_tokens=min(self.prune_at, params.max_new_tokens))
        first = generate_groups(engine, prompts, counts, p0)
        gen, gi = first.generation, first.group_index
        prefixes = [gen.response_ids[b][gen.response_mask[b] > 0].tolist() for b in range(len(gi))]
        rows_prompt = [prompts[int(g)] for g in gi]
        feats = prefix_features(model, rows_prompt, prefixes, pad)
        pred = self.predict(feats)
        keep: List[int] = []
        for g in sorted(set(gi.tolist())):
            rows = torch.nonzero(gi == g).flatten().tolist()
            k = max(min(self.min_keep, len(rows)), int(round(self.keep_ratio * len(rows))))
            if self.labelled == 0:
                keep.extend(rows[:k])
                continue
            order = sorted(rows, key=lambda r: (float(pred[r]), r))
            hi = math.ceil(k / 2)
            keep.extend(order[len(order) - hi :] + order[: k - hi])
        keep.sort()
        R = int(params.max_new_tokens)
        pieces: Dict[int, Any] = {}
        cont = [r for r in keep if not bool(gen.finished[r]) and len(prefixes[r]) < R]
        generated = gen.num_tokens
        if cont:
            pc = step_params(params, ctx, 1)
            pc = dataclasses.replace(pc, max_new_tokens=R - min(self.prune_at, R))
            g2 = engine.generate([rows_prompt[r] + prefixes[r] for r in cont], pc)
            generated += g2.num_tokens
            for b, r in enumerate(cont):
                m = gen.response_mask[r] > 0
                pieces[r] = _row(g2, b, prefixes[r], gen.rollout_logprobs[r][m].tolist(), rows_prompt[r], pad, tok, None)
        for r in keep:
            if r not in pieces:
                pieces[r] = select_rows(gen, [r])
        out_gen = concat_generations([pieces[r] for r in keep], pad)
        res = SampleResult(generation=out_gen, group_index=gi[keep], rollouts_spent=len(gi))
        score_rows(ctx, res)
        y = (res.rewards >= self.thr).float()
        kf = feats[keep]
        acc = float(((self.predict(kf) >= 0.5).float() == y).float().mean()) if self.labelled else float("nan")
        self.fit(kf, y)
        res.metrics = {"sampler/pruned_unscored": float(len(gi) - len(keep)), "sampler/generated_tokens": float(generated)}
        if not math.isnan(acc):
            res.metrics["sampler/head_acc"] = acc
        return res

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102 - the quality head
        return {"head": None if self.head is None else {k: v.clone() for k, v in self.head.state_dict().items()},
                "labelled": self.labelled}

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # noqa: D102
        h = state.get("head")
        self.labelled = int(state.get("labelled", 0))
        if h is not None:
            self.head = torch.nn.Linear(h["weight"].shape[1], 1)
            self.head.load_state_dict(h)


def apply_loss_token_mask(sampler: Any, batch: Any, entropy: torch.Tensor, step: int) -> Dict[str, float]:
    """Apply a sampler's token-level loss mask (D3S) to ``batch`` in place; returns the metrics.

    ``batch.response_mask`` (the loss mask) is multiplied by
    ``sampler.loss_token_mask(advantages, entropy, response_mask, step)``; the
    tokens it removes are recorded in ``batch.extras['d3s_token_dropped']`` ``[B, R]``
    (1 where a response token was in the loss and is not any more). The trainer's
    forward must still attend to them: ``extras['response_attn']`` is set to the
    mask before (unless a sampler already set it), since the trainer otherwise
    derives attention from the loss mask.

    Args:
        sampler: has ``loss_token_mask`` (:class:`D3SSampler`).
        batch: a :class:`rlpost.core.batch.RolloutBatch` with ``extras['advantages']``.
        entropy: ``[B, R]`` policy entropy at each response token (nats).
    Returns:
        ``{"sampler/token_keep_ratio", "sampler/tokens_dropped"}`` (empty when the mask is off).
    """
    before = (batch.response_mask > 0).float()
    keep = sampler.loss_token_mask(batch.extras["advantages"].cpu(), entropy.cpu(), before.cpu(), step)
    if keep is None:
        return {}
    keep = keep.to(batch.response_mask.device)
    if "response_attn" not in batch.extras:  # the forward still reads every token: only the loss drops some
        batch.extras["response_attn"] = before.long()
    batch.response_mask = batch.response_mask * keep
    dropped = before * (1.0 - keep)
    batch.extras["d3s_token_dropped"] = dropped
    n = float(before.sum())
    return {"sampler/token_keep_ratio": float(keep.sum()) / max(n, 1.0), "sampler/tokens_dropped": float(dropped.sum())}
