"""``sampler=echo``: ECHO's entropy-confidence tree rollouts with online low-confidence pruning.

"ECHO: Entropy-Confidence Hybrid Optimization for Test-Time Reinforcement Learning" (arXiv:2602.02150;
code https://github.com/user683/ECHO, ``verl/workers/rollout/deepconf_branching.py`` and
``vllm_rollout_spmd._generate_sequences_deepconf``). The shared-prefix machinery is
:class:`rlpost.samplers.tree.TreeSampler`'s; this file changes where a root forks, how wide, and
cuts rows whose confidence stays low. Token statistics: :mod:`rlpost.algos.echo`.

Per prompt (the release's order):

1. ``n_roots`` roots are sampled (release: one base completion per prompt).
2. Branch plan of a root: the first position ``t >= min_depth`` with ``H_t >= entropy_high``,
   ``C^G_t <= branch_threshold`` and ``dH_t >= entropy_delta_threshold`` gets width
   ``b = clip(round(b_min + alpha (H_t - H_low)/(H_high - H_low) - beta (C^G_t - tau)/|tau|), b_min, b_max)``;
   ``b - 1`` branches fork there (the root is the first of the ``b``). No such position, or
   ``b <= 1``: no branch.
3. The rest of the group (``n_samples - n_roots - branches``) are fresh samples from the prompt
   (the release's deficit fill).
4. Online pruning of every row (the release's ``should_prune``, scanning tokens in order): cut
   the response after the first position where the running minimum of ``C^G`` falls below
   ``prune_threshold`` (low confidence), or ``C_tail`` declined ``tail_decline_steps`` tokens in a
   row while at most ``tail_threshold`` (tail decline), or ``dH`` rose ``delta_rise_steps`` tokens
   in a row and exceeds ``delta_upper`` (entropy spike). A cut row keeps its tokens up to and
   including that position; its text is re-decoded and scored as it is (the release keeps pruned
   rows in the group; the prune penalty it records is not used by its reward, so not here either).

Where we differ, and why (our reading):

- ``C_t`` is the paper's mean top-k probability (also the release's update-side confidence). The
  release's rollout controller instead uses DeepConf's ``-mean log`` of the top-k probabilities,
  on which its thresholds (``branch_threshold`` 1.2, ``prune_threshold`` 0.4, ``tail_threshold``
  1.0) can never be crossed (that value is at least ``log k = 1.61``; its params dataclass also
  misspells ``group_window``, and the released run scripts set ``deepconf.enable=False``). The
  three thresholds are therefore our choices on the paper's scale (``C_t <= 1/k = 0.2``): 0.15,
  0.02 and 0.1; the windows, entropy bounds, widths and alpha / beta are the release's.
- ``H_t`` is over the whole vocabulary (the paper's definition); the release renormalises over
  vLLM's top-``logprob_top_k`` log-probs.
- A branch resamples the token at its fork (:class:`TreeSampler`'s branch mechanics) instead of
  being forced onto one of the ``b`` most probable tokens.
- A branch row's pruning statistics start at its fork (its prefix was checked on its root), and a
  cut row keeps at least one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from rlpost.algos.echo import (branch_width, entropy_delta, grouped_confidence, token_confidence,
                               token_entropy_from_probs)
from rlpost.core.registry import param
from rlpost.models.logprobs import build_inputs, eval_mode
from rlpost.rollout.base import GenerationResult
from rlpost.samplers.base import SAMPLERS, engine_model
from rlpost.samplers.tree import TreeSampler, _decode


@dataclass(frozen=True)
class EchoSamplerParams:
    """Parameters of :class:`EchoSampler` (ECHO, arXiv:2602.02150; the release's ``deepconf`` defaults unless said)."""

    n_roots: int = param(1, "roots per prompt (release: one base completion per prompt)")
    min_depth: int = param(4, "earliest fork position (release: 4)")
    entropy_high: float = param(3.5, "H_high: a fork needs H_t >= this (nats; release: 3.5)")
    entropy_low: float = param(1.0, "H_low of the width rule (nats; release: 1.0)")
    entropy_window: int = param(4, "W of dH_t = H_t - mean of the W entropies before t (release: 4)")
    entropy_delta_threshold: float = param(0.2, "a fork needs dH_t >= this (release: 0.2)")
    group_window: int = param(4, "W_G of the grouped confidence C^G (release: 4)")
    tail_window: int = param(8, "W_T of the rollout's tail confidence (release: 8)")
    branch_threshold: float = param(0.15, "tau: a fork needs C^G_t <= tau; also the width rule's pivot (our choice on the "
                                    "mean top-k probability scale; release 1.2 on DeepConf's scale)")
    alpha: float = param(2.0, "entropy term of the width rule (release: 2.0)")
    beta: float = param(1.0, "confidence term of the width rule (release: 1.0)")
    min_branches: int = param(1, "b_min (release: 1)")
    max_branches: int = param(4, "b_max (release: 4)")
    prune_threshold: float = param(0.02, "cut a row once min C^G < this (our choice; release 0.4 on DeepConf's scale)")
    tail_decline_steps: int = param(3, "tail-decline rule: consecutive drops of C_tail (release: 3)")
    tail_threshold: float = param(0.1, "tail-decline rule: C_tail at most this (our choice; release 1.0 on DeepConf's scale)")
    delta_rise_steps: int = param(3, "entropy-spike rule: consecutive dH > 0 (release: 3)")
    delta_upper: float = param(0.5, "entropy-spike rule: dH above this (release: 0.5)")
    confidence_top_k: int = param(5, "k of C_t = mean top-k probability (release: 5)")


def token_stats(probs: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(H [T], C [T])`` float64 of one response from its next-token probabilities ``[T, V]``."""
    return token_entropy_from_probs(probs), token_confidence(probs, k)


def plan_branch(H: torch.Tensor, C: torch.Tensor, p: EchoSamplerParams) -> Optional[Tuple[int, int]]:
    """``(position t, width b)`` of a root's fork (step 2 of the module docstring), or None.

    ``H``, ``C``: ``[T]`` the root's token entropy (nats) and confidence. The scan starts at
    ``min(min_depth, T - 1)`` (the release's rule).
    """
    T = int(H.numel())
    if T == 0:
        return None
    cg = grouped_confidence(C, p.group_window)
    dh = entropy_delta(H, p.entropy_window)
    for t in range(min(int(p.min_depth), T - 1), T):
        if H[t] >= p.entropy_high and cg[t] <= p.branch_threshold and dh[t] >= p.entropy_delta_threshold:
            b = branch_width(float(H[t]), float(cg[t]), entropy_low=p.entropy_low, entropy_high=p.entropy_high,
                             branch_threshold=p.branch_threshold, alpha=p.alpha, beta=p.beta,
                             min_branches=p.min_branches, max_branches=p.max_branches)
            return (t, b) if b > 1 else None
    return None


def prune_position(H: torch.Tensor, C: torch.Tensor, p: EchoSamplerParams) -> Optional[Tuple[int, str]]:
    """``(position, reason)`` of the first pruning rule to fire on one row, or None (step 4).

    ``reason`` is ``low_confidence``, ``tail_decline`` or ``entropy_spike``. ``H``, ``C``: ``[T]``.
    ``C_tail`` at ``t`` is the mean of the last ``tail_window`` confidences up to ``t``.
    """
    T = int(H.numel())
    if T == 0:
        return None
    cg = grouped_confidence(C, p.group_window)
    tail = grouped_confidence(C, p.tail_window)
    dh = entropy_delta(H, p.entropy_window)
    run_min = float("inf")
    decl = rise = 0
    for t in range(T):
        run_min = min(run_min, float(cg[t]))
        decl = decl + 1 if t >= 1 and tail[t] < tail[t - 1] else 0
        rise = rise + 1 if dh[t] > 0 else 0
        if run_min < p.prune_threshold:
            return t, "low_confidence"
        if decl >= p.tail_decline_steps and tail[t] <= p.tail_threshold:
            return t, "tail_decline"
        if rise >= p.delta_rise_steps and dh[t] > p.delta_upper:
            return t, "entropy_spike"
    return None


@torch.no_grad()
def generation_stats(model: torch.nn.Module, gen: GenerationResult, k: int, chunk: int = 4) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per row of ``gen``: ``(H [L], C [L])`` over its ``L`` response tokens, temperature 1, ``chunk`` rows per pass."""
    P = gen.prompt_ids.shape[1]
    R = gen.response_ids.shape[1]
    dev = next(model.parameters()).device
    out: List[Tuple[torch.Tensor, torch.Tensor]] = []
    with eval_mode(model):
        for s in range(0, gen.response_ids.shape[0], chunk):
            sl = slice(s, s + chunk)
            ids, attn, pos = build_inputs(gen.prompt_ids[sl], gen.prompt_mask[sl], gen.response_ids[sl], gen.response_mask[sl])
            logits = model(input_ids=ids.to(dev), attention_mask=attn.to(dev), position_ids=pos.to(dev)).logits
            probs = torch.softmax(logits[:, P - 1: P + R - 1].float().cpu(), -1)
            for j in range(probs.shape[0]):
                L = int((gen.response_mask[s + j] > 0).sum())
                out.append(token_stats(probs[j, :L], k))
    return out


@SAMPLERS.register(
    "echo",
    paper="ECHO: Entropy-Confidence Hybrid Optimization for Test-Time Reinforcement Learning (arXiv:2602.02150)",
    description="Tree rollouts forking where entropy is high and grouped confidence low, width from both; rows whose "
    "confidence stays low are cut online.",
    params=EchoSamplerParams,
)
class EchoSampler(TreeSampler):
    """ECHO's tree rollouts (see the module docstring for the rules and where we differ).

    Rows: roots first, then branches and fresh samples (``extras['shared_prefix_len']``: 0 for
    roots and fresh samples, ``t`` for a branch); loss only on a row's own suffix. Metrics:
    ``sampler/echo_branched_roots``, ``sampler/echo_mean_width``, ``sampler/echo_pruned`` (rows
    cut), ``sampler/echo_pruned_tokens``.

    Args:
        n_samples: rows per prompt (the group size).
        n_roots ... confidence_top_k: see :class:`EchoSamplerParams`.

    Raises:
        ValueError: ``n_roots >= n_samples`` (from :class:`TreeSampler`), windows or widths < 1,
            ``min_branches > max_branches``, ``entropy_high <= entropy_low``.
        ConfigError: (in :meth:`sample`) an engine without a torch model (``rollout=vllm``).
    """

    def __init__(self, n_samples: int, *, n_roots: Any, min_depth: Any, entropy_high: Any, entropy_low: Any, entropy_window: Any, entropy_delta_threshold: Any, group_window: Any, tail_window: Any, branch_threshold: Any, alpha: Any, beta: Any, min_branches: Any, max_branches: Any, prune_threshold: Any, tail_decline_steps: Any, tail_threshold: Any, delta_rise_steps: Any, delta_upper: Any, confidence_top_k: Any) -> None:
        given = {k: v for k, v in dict(n_roots=n_roots, min_depth=min_depth, entropy_high=entropy_high, entropy_low=entropy_low, entropy_window=entropy_window, entropy_delta_threshold=entropy_delta_threshold, group_window=group_window, tail_window=tail_window, branch_threshold=branch_threshold, alpha=alpha, beta=beta, min_branches=min_branches, max_branches=max_branches, prune_threshold=prune_threshold, tail_decline_steps=tail_decline_steps, tail_threshold=tail_threshold, delta_rise_steps=delta_rise_steps, delta_upper=delta_upper, confidence_top_k=confidence_top_k).items() if v is not None}
        self.p = EchoSamplerParams(**given)
        p = self.p
        super().__init__(n_samples, n_roots=p.n_roots, fork_unit="token", min_prefix=max(1, p.min_depth),
                         prune_lookahead=0, entropy="model")
        for name in ("entropy_window", "group_window", "tail_window", "min_branches", "confidence_top_k"):
            if int(getattr(p, name)) < 1:
                raise ValueError(f"echo sampler: {name}={getattr(p, name)} must be >= 1")
        if p.min_branches > p.max_branches:
            raise ValueError(f"echo sampler: min_branches={p.min_branches} > max_branches={p.max_branches}")
        if not p.entropy_high > p.entropy_low:
            raise ValueError(f"echo sampler: entropy_high={p.entropy_high} must be > entropy_low={p.entropy_low}")
        self._widths: List[int] = []

    def _model(self, engine) -> torch.nn.Module:
        return engine_model(engine, "sampler=echo needs the policy's next-token distributions (entropy and top-k "
                            "confidence of every position)")

    def fork_scores(self, engine, prompts, roots, ctx):  # noqa: D102 - a width map: b at the planned fork, 0 elsewhere
        gen = roots.generation
        stats = generation_stats(self._model(engine), gen, self.p.confidence_top_k)
        out = torch.zeros(gen.response_ids.shape)
        for r, (H, C) in enumerate(stats):
            plan = plan_branch(H, C, self.p)
            if plan is not None:
                out[r, plan[0]] = float(plan[1])
                self._widths.append(plan[1])
        return out

    def fork_points(self, engine, ids: List[int], ent: torch.Tensor, k: int) -> List[int]:
        """``b - 1`` copies of the planned fork (at most ``k``); the rest of the ``k`` become fresh samples."""
        nz = torch.nonzero(ent[: len(ids)] > 0).flatten().tolist()
        if not nz:
            return []
        t = int(nz[0])
        return [t] * min(int(ent[t]) - 1, k)

    def prune(self, engine, prompts, res) -> Tuple[int, int]:
        """Cut the rows of ``res`` in place (step 4); returns ``(rows cut, tokens removed)``."""
        gen = res.generation
        pre = res.extras.get("shared_prefix_len")
        stats = generation_stats(self._model(engine), gen, self.p.confidence_top_k)
        pad = int(getattr(engine, "pad_id", 0) or 0)
        cut_rows = cut_tokens = 0
        for j, (H, C) in enumerate(stats):
            hit = prune_position(H, C, self.p)
            L = int(H.numel())
            if hit is None or hit[0] + 1 >= L:
                continue
            keep = max(1, hit[0] + 1)
            gen.response_mask[j, keep:] = 0
            gen.response_ids[j, keep:] = pad
            gen.rollout_logprobs[j, keep:] = 0
            gen.finished[j] = False
            t = int(pre[j]) if pre is not None else 0
            prefix: List[int] = []
            if t > 0:
                pr = gen.prompt_ids[j][gen.prompt_mask[j] > 0].tolist()
                prefix = pr[len(pr) - t:]
            gen.texts[j] = _decode(engine, prefix + gen.response_ids[j, :keep].tolist(), gen.texts[j])
            cut_rows += 1
            cut_tokens += L - keep
        return cut_rows, cut_tokens

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        self._model(engine)
        self._widths = []
        res = super().sample(engine, prompts, params, ctx)
        if res.rewards is not None:
            raise RuntimeError("echo sampler: rows were scored before pruning")
        rows, toks = self.prune(engine, prompts, res)
        res.metrics["sampler/echo_branched_roots"] = float(len(self._widths))
        res.metrics["sampler/echo_mean_width"] = float(sum(self._widths) / len(self._widths)) if self._widths else 1.0
        res.metrics["sampler/echo_pruned"] = float(rows)
        res.metrics["sampler/echo_pruned_tokens"] = float(toks)
        return res
