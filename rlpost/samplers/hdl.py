"""``sampler=hdl``: branch points where hindsight shifts the root's token log-likelihoods most (HDL).

"Where the Model Changes Its Mind: Hindsight-Divergence Localization for Efficient
Reinforcement Learning with Verifiable Rewards" (Chen, Fu, Venkataraman, Jiao,
arXiv:2609.36864; no code released). HDL generates a few complete *root*
trajectories per problem, gets their verifier feedback ``f``, lets the rollout
policy write a hindsight reflection ``r`` on each, and re-scores each root's
sampled tokens with and without the hindsight context ``h = [f; r]`` (eq. 1):
``s_i = |log pi_old(y_i | x, h, y_<i) - log pi_old(y_i | x, y_<i)|`` (eq. 2). The
highest-scoring positions of a root are its branch points; the rest of the
group is filled with continuations sampled under the *original* context
``x, y_<i`` (eq. 3). A continuation's loss covers only its new suffix; roots and
continuations form one GRPO group.

The shared-prefix machinery is :class:`rlpost.samplers.tree.TreeSampler`'s: a
continuation is prompted with prompt + root prefix, its response (and so its
``response_mask``, the loss mask) is only the suffix it generated, its text is
prefix + suffix for the verifier, and ``extras['shared_prefix_len']`` records the
prefix length. Only the fork-point score and the allocation differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from rlpost.core.registry import param
from rlpost.models.logprobs import build_inputs, eval_mode
from rlpost.rollout.hf import left_pad
from rlpost.samplers.base import SAMPLERS, SampleResult, pad_id_of, score_rows, select_rows
from rlpost.samplers.tree import TreeSampler

#: the verifier feedback ``f`` of a root (``{verdict}``: Correct / Incorrect); the paper's math feedback is the verdict
#: plus, for a wrong root, the predicted and reference answers, which a sampler does not see
DEFAULT_FEEDBACK = "[Record]\n{verdict}.\n"
#: the reflection request (our wording of the fields of the paper's Appendix B.1 prompt)
REFLECTION_TEMPLATE = (
    "{problem}\n\n[A completed attempt]\n{root}\n\n{feedback}\n"
    "In your own words, summarise the approach this attempt took and why, given the record, it ended as it did; "
    "if it went wrong, say what the right approach would have been. Do not quote the attempt. "
    "Answer as: OUTCOME: SUCCESS or FAILURE, then SUMMARY: <summary>."
)


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
    """Parameters of :class:`HindsightDivergenceSampler` (HDL, arXiv:2609.36864; defaults from its Sec. 4.1)."""

    n_roots: int = param(2, "complete root trajectories per prompt (paper: M = 2 of G = 16).")
    n_branch_points: int = param(2, "branch points per root: its positions of largest hindsight-divergence score (paper: 2).")
    min_prefix: int = param(1, "earliest branch position (tokens of shared prefix).")
    reflection_tokens: int = param(96, "length budget of the policy's hindsight reflection (paper: a 60-120 token summary); 0 = feedback only.")
    feedback: str = param(DEFAULT_FEEDBACK, "verifier feedback f of a root; {verdict} becomes 'Correct' or 'Incorrect'.")
    threshold: float = param(0.5, "reward at or above which a root's verdict is 'Correct'.")


@SAMPLERS.register(
    "hdl",
    paper="Where the Model Changes Its Mind: Hindsight-Divergence Localization for Efficient Reinforcement Learning "
    "with Verifiable Rewards (HDL, arXiv:2609.36864)",
    description="Root rollouts re-scored with their feedback and a hindsight reflection in context; continuations "
    "branch from the positions of largest |log-likelihood shift|, loss on the new suffix only.",
    params=HdlSamplerParams,
)
class HindsightDivergenceSampler(TreeSampler):
    """HDL: ``n_roots`` roots per prompt, the rest of the group continued from hindsight branch points.

    1. ``n_roots`` complete roots per prompt are sampled and scored (the step's
       scorer, once per row).
    2. Hindsight context ``h = [f; r]`` per root: ``f`` = ``feedback`` with
       ``{verdict}`` = ``Correct`` when the root's reward is ``>= threshold`` else
       ``Incorrect``; ``r`` = a reflection the rollout engine (the policy that
       sampled the roots) writes from :data:`REFLECTION_TEMPLATE` (problem = the
       decoded prompt, root, ``f``), ``reflection_tokens`` tokens at the step's
       sampling settings (``reflection_tokens=0``: ``h = f``).
    3. Each root's response ``y`` is re-scored by the engine's model at
       temperature 1 with context ``x`` and with ``x, h`` (the paper's eq. 1
       order: the hindsight text after the task, before the response). The
       hindsight-divergence score is ``s_i = |log p(y_i | x, h, y_<i) - log p(y_i
       | x, y_<i)|`` (eq. 2).
    4. The ``n_branch_points`` positions ``i >= min_prefix`` with the largest
       ``s_i`` (ties: earlier first) are the root's branch points.
    5. The ``n_samples - n_roots`` continuations are spread evenly over the
       roots and, within a root, round-robin over its branch points, the best
       point first (the paper's default 2 roots x 2 points at G = 16 gives 7 per
       root, 4 + 3; which point gets 4 the paper does not say: here the
       best). A continuation is prompted with ``x + y_<i`` (original context, no
       ``h``), samples ``y'_i...`` with budget ``max_new_tokens - i``, is scored
       as ``y_<i + y'`` and carries loss only on ``y'`` (its ``response_mask``
       covers the suffix alone).

    Rows: the roots first, then the continuations; ``extras['shared_prefix_len']``
    is 0 for roots and ``i`` for a continuation. The sampler scores every row
    itself (``SampleResult.rewards`` set), the roots before branching. Metrics:
    ``sampler/hindsight_shift_abs_mean`` (mean ``s_i`` over root tokens),
    ``sampler/branch_score_mean`` (mean ``s_i`` at the chosen points).

    Where the paper is silent or we simplify: with a chat template, ``h``
    follows the rendered prompt and so opens the assistant turn; the feedback
    is the verdict only (the paper's math feedback adds the predicted and
    reference answers of a wrong root, which the sampler does not see); the
    reflection prompt is our wording of the paper's Appendix B.1 fields; the
    paper trains with Dr. GRPO (no std normalisation), token-mean loss and clip
    0.2 / 0.28, which the recipe sets and the sampler does not impose.

    Args:
        n_samples: rows per prompt (roots + continuations), the group size.
        n_roots, n_branch_points, min_prefix, reflection_tokens, feedback,
        threshold: see :class:`HdlSamplerParams`.

    Raises:
        ValueError: ``n_branch_points < 1``, ``reflection_tokens < 0``, ``feedback``
            without ``{verdict}``, ``n_roots >= n_samples``, or (in :meth:`sample`)
            an engine without a torch model (``rollout=vllm``) or a tokenizer.
    """

    def __init__(self, n_samples: int, *, n_roots: int = 2, n_branch_points: int = 2, min_prefix: int = 1,
                 reflection_tokens: int = 96, feedback: str = DEFAULT_FEEDBACK, threshold: float = 0.5) -> None:
        super().__init__(n_samples, n_roots=n_roots, fork_unit="token", min_prefix=min_prefix, prune_lookahead=0,
                         entropy="model")
        if int(n_branch_points) < 1:
            raise ValueError(f"hdl: n_branch_points={n_branch_points} must be >= 1")
        if int(reflection_tokens) < 0:
            raise ValueError(f"hdl: reflection_tokens={reflection_tokens} must be >= 0")
        if "{verdict}" not in feedback:
            raise ValueError("hdl: feedback must contain '{verdict}' (where 'Correct' / 'Incorrect' goes)")
        self.n_branch_points = int(n_branch_points)
        self.reflection_tokens = int(reflection_tokens)
        self.feedback = str(feedback)
        self.threshold = float(threshold)
        self._root_scored: Optional[SampleResult] = None
        self._params: Any = None
        self._forks: List[float] = []

    def hindsight_contexts(self, engine, prompts: List[List[int]], roots: SampleResult) -> List[List[int]]:
        """Token ids of ``h = [f; r]`` for each root (``roots.rewards`` must be set).

        The reflections come from one engine call over all roots (skipped when
        ``reflection_tokens == 0``).
        """
        import dataclasses

        tok = engine.tokenizer
        g = roots.generation
        fb = [self.feedback.format(verdict="Correct" if float(roots.rewards[r]) >= self.threshold else "Incorrect")
              for r in range(g.response_ids.shape[0])]
        if self.reflection_tokens <= 0 or self._params is None:
            return [list(tok.encode(f, add_special_tokens=False)) for f in fb]
        asks = []
        for r in range(g.response_ids.shape[0]):
            problem = tok.decode(list(prompts[int(roots.group_index[r])]), skip_special_tokens=True)
            text = REFLECTION_TEMPLATE.format(problem=problem, root=g.texts[r], feedback=fb[r])
            if getattr(tok, "chat_template", None):
                asks.append(list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                         tokenize=True, return_dict=False)))
            else:
                asks.append(list(tok.encode(text + "\n", add_special_tokens=False)))
        p = dataclasses.replace(self._params, max_new_tokens=self.reflection_tokens, temperature_hook=None)
        refl = engine.generate(asks, p).texts
        return [list(tok.encode(f + "\n" + t.strip() + "\n", add_special_tokens=False)) for f, t in zip(fb, refl)]

    def hindsight_shift(self, engine, prompts: List[List[int]], roots: SampleResult) -> torch.Tensor:
        """``[B_roots, R]`` signed shift ``log p(y_t | x, h, y_<t) - log p(y_t | x, y_<t)`` (0 on padding).

        ``roots.rewards`` must be set (the verdict of each root); the score of eq. 2 is its absolute value.
        """
        model, tok = getattr(engine, "model", None), getattr(engine, "tokenizer", None)
        if not isinstance(model, torch.nn.Module) or tok is None:
            raise ValueError("sampler=hdl re-scores roots with the policy model: it needs an engine with a torch model "
                             "and a tokenizer (rollout=hf)")
        g = roots.generation
        hs = self.hindsight_contexts(engine, prompts, roots)
        resp, plain, hind = [], [], []
        for r in range(g.response_ids.shape[0]):
            x = list(prompts[int(roots.group_index[r])])
            resp.append(g.response_ids[r][g.response_mask[r] > 0].tolist())
            plain.append(x)
            hind.append(x + hs[r])
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
        self._forks.extend(float(ent[t]) for t in top)
        return [top[j % len(top)] for j in range(k)] if top else []

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        self._root_scored, self._params, self._forks = None, params, []
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
        res.metrics["sampler/branch_score_mean"] = float(sum(self._forks) / len(self._forks)) if self._forks else 0.0
        return res
