"""``sampler=hdl``: branch points where the outcome feedback shifts the root's token log-likelihoods most (HDL).

Hindsight-Divergence Localization (HDL, "Hindsight-Divergence Localization"
branch-point rollouts for group-relative RLVR; the abstract is the only text we
could read: no arXiv full text or code was found, see
:class:`HindsightDivergenceSampler` for what was chosen). HDL generates a few
complete *root* trajectories, gets their outcome feedback, and re-scores each
root with the feedback in context. The positions whose token log-likelihoods
shift most in hindsight become branch points; the rest of the training group
is filled with continuations sampled from those prefixes under the *original*
task context. A continuation reuses its root's prefix and contributes policy
updates only through its newly generated suffix.

The shared-prefix machinery is :class:`rlpost.samplers.tree.TreeSampler`'s: a
continuation is prompted with prompt + root prefix, its response (and so its
``response_mask``, the loss mask) is only the suffix it generated, its text is
prefix + suffix for the verifier, and ``extras['shared_prefix_len']`` records the
prefix length. Only the fork-point score and the number of continuations per
point differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from rlpost.registry import param
from rlpost.samplers.base import SAMPLERS, SampleResult, pad_id_of, score_rows, select_rows
from rlpost.samplers.tree import TreeSampler, default_roots

#: the default hindsight feedback, put in front of the task context (``{verdict}``: correct / incorrect)
DEFAULT_FEEDBACK = "Feedback on the answer below: it is {verdict}.\n"


@torch.no_grad()
def context_logprobs(model: torch.nn.Module, prompts: Sequence[List[int]], responses: Sequence[List[int]],
                     pad_id: int = 0, chunk: int = 4) -> List[torch.Tensor]:
    """Log-probs (nats, temperature 1) of each ``responses[i]`` given ``prompts[i]`` under ``model``.

    One no-grad forward per ``chunk`` rows (prompts left-padded, responses
    right-padded, as :func:`rlpost.models.logprobs.build_inputs`). Used to score
    the same sampled tokens under two contexts (HDL's hindsight feedback, SEED's
    hindsight skill).

    Args:
        model: a causal LM returning ``.logits`` ``[B, T, V]``.
        prompts: token ids of each row's context.
        responses: token ids of each row's response (may be empty).
        pad_id: padding id.
    Returns:
        one float32 CPU tensor of length ``len(responses[i])`` per row.
    Raises:
        ValueError: ``prompts`` and ``responses`` differ in length, or a prompt is empty.
    """
    from rlpost.models.logprobs import build_inputs, eval_mode
    from rlpost.rollout.hf import left_pad

    if len(prompts) != len(responses):
        raise ValueError(f"context_logprobs: {len(prompts)} prompts but {len(responses)} responses")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("context_logprobs: every row needs a non-empty context (the first token is predicted from it)")
    out: List[torch.Tensor] = [torch.zeros(0) for _ in prompts]
    dev = next(model.parameters()).device
    with eval_mode(model):
        for s in range(0, len(prompts), chunk):
            rows = [i for i in range(s, min(s + chunk, len(prompts))) if len(responses[i]) > 0]
            if not rows:
                continue
            p_ids, p_mask = left_pad([list(prompts[i]) for i in rows], pad_id)
            R = max(len(responses[i]) for i in rows)
            r_ids = torch.full((len(rows), R), pad_id, dtype=torch.long)
            r_mask = torch.zeros(len(rows), R, dtype=torch.long)
            for k, i in enumerate(rows):
                r_ids[k, : len(responses[i])] = torch.tensor(list(responses[i]), dtype=torch.long)
                r_mask[k, : len(responses[i])] = 1
            ids, attn, pos = build_inputs(p_ids, p_mask, r_ids, r_mask)
            P = p_ids.shape[1]
            logits = model(input_ids=ids.to(dev), attention_mask=attn.to(dev), position_ids=pos.to(dev)).logits
            lp = torch.log_softmax(logits[:, P - 1 : P + R - 1].float(), -1).cpu()
            lp = lp.gather(-1, r_ids.unsqueeze(-1)).squeeze(-1)
            for k, i in enumerate(rows):
                out[i] = lp[k, : len(responses[i])].clone()
    return out


@dataclass(frozen=True)
class HdlSamplerParams:
    """Parameters of :class:`HindsightDivergenceSampler` (HDL branch-point rollouts)."""

    n_roots: Optional[int] = param(None, "complete root trajectories per prompt (default: ``n_samples // 4``, at least 2 when ``n_samples >= 4``).")
    n_branch_points: int = param(2, "branch points per root: its positions of largest hindsight shift.")
    min_prefix: int = param(1, "earliest branch position (tokens of shared prefix).")
    feedback: str = param(DEFAULT_FEEDBACK, "hindsight text put in front of the task context when re-scoring a root; {verdict} becomes 'correct' or 'incorrect'.")
    threshold: float = param(0.5, "reward at or above which a root's verdict is 'correct'.")


@SAMPLERS.register(
    "hdl",
    paper="Hindsight-Divergence Localization (HDL) branch-point rollouts for group-relative RLVR (abstract only; "
    "no arXiv id or code found)",
    description="Root rollouts re-scored with their outcome feedback in context; continuations branch from the "
    "positions of largest hindsight log-likelihood shift, loss on the new suffix only.",
    params=HdlSamplerParams,
)
class HindsightDivergenceSampler(TreeSampler):
    """HDL: ``n_roots`` roots per prompt, the rest of the group continued from hindsight branch points.

    1. ``n_roots`` complete roots per prompt are sampled and scored (the step's
       scorer, once per row).
    2. Each root's response ``y`` is re-scored under the rollout engine's model
       twice, at temperature 1: with the plain context ``x`` and with the hindsight
       context ``f + x``, ``f`` = ``feedback`` with ``{verdict}`` = ``correct`` when
       the root's reward is ``>= threshold`` else ``incorrect``. The shift is
       ``d_t = log p(y_t | f, x, y_<t) - log p(y_t | x, y_<t)``.
    3. The ``n_branch_points`` positions ``t >= min_prefix`` with the largest
       ``|d_t|`` (ties: earlier first) are the root's branch points.
    4. The ``n_samples - n_roots`` continuations of the group are spread evenly
       over the roots and, within a root, round-robin over its branch points
       (so ``(n_samples - n_roots) / (n_roots * n_branch_points)``
       continuations per point when it divides). A continuation is prompted with
       ``x + y_<t`` (the original context, no feedback), generates ``y'_t...``
       with budget ``max_new_tokens - t``, is scored as ``y_<t + y'`` and carries
       loss only on ``y'`` (its ``response_mask`` covers the suffix alone).

    Rows: the roots first, then the continuations; ``extras['shared_prefix_len']``
    is 0 for roots and ``t`` for a continuation. The sampler scores every row
    itself (``SampleResult.rewards`` set), the roots before branching.

    Where the paper leaves it open (we had the abstract only): the feedback text
    and where it goes (here a line in front of the rendered prompt, so it works
    with any chat template; the verdict only, no reference answer), the size of
    the shift (absolute value, so a token made likelier or less likely in
    hindsight both count), the number of branch points and how continuations are
    spread over them, and the default root count (the ``tree`` sampler's).

    Args:
        n_samples: rows per prompt (roots + continuations), the group size.
        n_roots, n_branch_points, min_prefix, feedback, threshold: see the params.

    Raises:
        ValueError: ``n_branch_points < 1``, ``feedback`` without ``{verdict}``,
            ``n_roots >= n_samples``, or (in :meth:`sample`) an engine without a
            torch model (``rollout=vllm``) or a tokenizer.
    """

    def __init__(self, n_samples: int, *, n_roots: Optional[int] = None, n_branch_points: int = 2, min_prefix: int = 1,
                 feedback: str = DEFAULT_FEEDBACK, threshold: float = 0.5) -> None:
        super().__init__(n_samples, n_roots=n_roots if n_roots else default_roots(n_samples), fork_unit="token",
                         min_prefix=min_prefix, prune_lookahead=0, entropy="model")
        if int(n_branch_points) < 1:
            raise ValueError(f"hdl: n_branch_points={n_branch_points} must be >= 1")
        if "{verdict}" not in feedback:
            raise ValueError("hdl: feedback must contain '{verdict}' (where 'correct' / 'incorrect' goes)")
        self.n_branch_points = int(n_branch_points)
        self.feedback = str(feedback)
        self.threshold = float(threshold)
        self._root_scored: Optional[SampleResult] = None

    def hindsight_shift(self, engine, prompts: List[List[int]], roots: SampleResult) -> torch.Tensor:
        """``[B_roots, R]`` shift ``log p(y_t | f, x, y_<t) - log p(y_t | x, y_<t)`` (0 on padding).

        ``roots.rewards`` must be set (the verdict of each root).
        """
        model, tok = getattr(engine, "model", None), getattr(engine, "tokenizer", None)
        if not isinstance(model, torch.nn.Module) or tok is None:
            raise ValueError("sampler=hdl re-scores roots with the policy model: it needs an engine with a torch model "
                             "and a tokenizer (rollout=hf)")
        g = roots.generation
        fb = {v: list(tok.encode(self.feedback.format(verdict=v), add_special_tokens=False))
              for v in ("correct", "incorrect")}
        resp, plain, hind = [], [], []
        for r in range(g.response_ids.shape[0]):
            x = list(prompts[int(roots.group_index[r])])
            resp.append(g.response_ids[r][g.response_mask[r] > 0].tolist())
            plain.append(x)
            hind.append(fb["correct" if float(roots.rewards[r]) >= self.threshold else "incorrect"] + x)
        pad = pad_id_of(engine)
        lp0 = context_logprobs(model, plain, resp, pad)
        lp1 = context_logprobs(model, hind, resp, pad)
        out = torch.zeros(g.response_ids.shape, dtype=torch.float32)
        for r in range(len(resp)):
            idx = (g.response_mask[r] > 0).nonzero().flatten()
            out[r, idx] = lp1[r] - lp0[r]
        return out

    def fork_scores(self, engine, prompts, roots, ctx):  # noqa: D102 - scores the roots, then |hindsight shift|
        score_rows(ctx, roots)
        self._root_scored = roots
        d = self.hindsight_shift(engine, prompts, roots)
        self._last_shift = d
        return d.abs()

    def fork_points(self, engine, ids: List[int], ent: torch.Tensor, k: int) -> List[int]:
        """``k`` branch positions of one root: its ``n_branch_points`` largest-shift positions, round-robin.

        Positions range over ``[min_prefix, len(ids) - 1]``; a root too short for
        any yields ``[]`` (its continuations become fresh samples).
        """
        top = super().fork_points(engine, ids, ent, self.n_branch_points)
        return [top[j % len(top)] for j in range(k)] if top else []

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        self._root_scored = None
        res = super().sample(engine, prompts, params, ctx)
        roots = self._root_scored
        if roots is None:  # no continuations (n_samples == n_roots): tree returned the roots unscored
            score_rows(ctx, res)
            return res
        nr = roots.generation.response_ids.shape[0]
        B = res.generation.response_ids.shape[0]
        if B > nr:  # score the continuations (prefix + suffix) once each
            rows = list(range(nr, B))
            sub = SampleResult(select_rows(res.generation, rows), res.group_index[nr:], 0,
                               {"shared_prefix_len": res.extras["shared_prefix_len"][nr:]})
            score_rows(ctx, sub)
            res.rewards = torch.cat([roots.rewards, sub.rewards])
            for k in set(roots.extras) | set(sub.extras):
                if k.startswith("reward_") or k == "format_ok":
                    res.extras[k] = torch.cat([roots.extras[k], sub.extras[k]])
        else:
            res.rewards = roots.rewards
            res.extras.update({k: v for k, v in roots.extras.items() if k.startswith("reward_") or k == "format_ok"})
        d = self._last_shift
        m = roots.generation.response_mask
        res.metrics["sampler/hindsight_shift_abs_mean"] = float((d.abs() * m).sum() / m.sum().clamp(min=1))
        return res
