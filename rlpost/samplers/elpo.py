"""``sampler=elpo``: ELPO's binary-search rollout tree that locates a failed rollout's first irrecoverable step.

Paper: "Learning from the Irrecoverable: Error-Localized Policy Optimization for Tool-Integrated LLM
Reasoning" (ELPO, Liang, Zhu, Ge et al., arXiv:2602.09598; "code will be released": none found).
What was readable here: the abstract and a third-party summary of the method (no equations, no
constants). Followed from them:

* Binary Error Localization: for a failed trajectory of ``K`` steps, an anchor step in the middle is
  chosen, the prefix up to it is kept and several continuations are sampled from it; when any of them
  succeeds the prefix is *recoverable* and the search goes on in the later half, otherwise in the
  earlier half; ``O(log K)`` probes find the first irrecoverable step.
* The search runs under a fixed rollout budget and localizes one informative failed trajectory per
  group, chosen by an "entropy gap".

Our reading, where the summary stops (declared in :class:`ElpoSamplerParams` as well):

* the budget is part of the group: ``algo.n_samples_per_prompt = n`` rollouts per prompt in all,
  ``n - budget`` sampled first (``budget`` 0, the default: half the group), up to ``budget`` spent on probes (``branch`` continuations per probe,
  at most ``max_depth`` probes), and whatever the search leaves unspent drawn as plain rollouts, so a
  group always has ``n`` rows and the rollouts per step equal GRPO's;
* steps are the shared step segmentation's spans (:func:`rlpost.tasks.steps.segment_steps`; lines or
  sentences, as SCOPE's sampler), only single-turn rollouts (multi-turn episodes are left out);
* the search keeps ``lo`` (steps in the longest prefix known recoverable; the empty prefix, the prompt,
  is taken as recoverable) and ``hi`` (steps in the shortest prefix known irrecoverable; the whole
  failed rollout, ``K``), probes ``mid = (lo + hi) // 2`` while ``hi - lo > 1`` and probes are left,
  and locates the error at step ``lo + 1`` (1-based): exactly the first irrecoverable step when the
  search finished, else the start of the interval ``(lo, hi]`` that holds it;
* "entropy gap" of a failed rollout: the largest minus the smallest step-mean surprisal
  ``-log pi`` of its sampled tokens (the engine's rollout log-probs), over its steps; the failed row
  with the largest gap and at least 2 steps is localized (ties: the earlier row);
* a continuation row is prompted with prompt + prefix and its response is the suffix it generated
  (the tree sampler's convention, ``extras['shared_prefix_len']``); the verifier scores the whole
  text; continuations train like every other row of the group.

The tree goes to the estimator ``algo.adv_estimator=elpo`` (:mod:`rlpost.algos.elpo`) through
extras (never row pointers, so filtering rows keeps it valid): ``elpo_role`` (0 plain, 1 the
localized rollout, 2 a continuation), ``elpo_anchor`` (a continuation's anchor step ``j``: its
prefix holds ``j`` steps; the localized rollout's ``lo``), ``elpo_error_mask`` ``[B, R]`` (1 on the
localized rollout's tokens from step ``lo + 1`` on, and on every token of a continuation from an
irrecoverable prefix), read by the loss ``elpo_clip``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from rlpost.core.registry import Choice, param
from rlpost.rollout.base import GenerationResult
from rlpost.samplers.base import (
    SAMPLERS,
    SampleResult,
    Sampler,
    generate_groups,
    merge_results,
    pad_id_of,
    score_rows,
    step_params,
)
from rlpost.tasks.steps import SEGMENTERS, policy_step_positions, segment_steps

PAPER = ("Learning from the Irrecoverable: Error-Localized Policy Optimization for Tool-Integrated LLM "
         "Reasoning (ELPO, arXiv:2602.09598)")

#: ``extras['elpo_role']`` values
ROLE_PLAIN, ROLE_LOCALIZED, ROLE_CONTINUATION = 0, 1, 2


class Select(Choice):
    """Which failed rollout of a group is localized."""

    entropy_gap = "entropy_gap"
    first = "first"


@dataclass(frozen=True)
class ElpoSamplerParams:
    """ELPO's binary-search tree; the paper gives no constant here, so every default is our choice."""

    budget: int = param(0, "rollouts of each group reserved for the search, out of algo.n_samples_per_prompt = n "
                        "(0: half the group, n // 2; n - budget sampled first; what the search leaves unspent is "
                        "drawn as plain rollouts)")
    branch: int = param(2, "continuations sampled from each probed prefix; the prefix is recoverable when any "
                        "reaches fail_below")
    max_depth: int = param(3, "most probes (binary-search levels) per localized rollout")
    segment: str = param("sentence", "step segmentation rule (rlpost list step_segment): newline | step_k | sentence")
    fail_below: float = param(1.0, "a rollout whose reward is below this has failed (the default task's correct "
                              "answer scores 1)")
    select: Select = param(Select.entropy_gap, "entropy_gap: the failed rollout with the largest spread of "
                           "step-mean surprisal (our reading of the paper's entropy gap); first: the earliest")


# --------------------------------------------------------------------------- the search, pure
class ErrorSearch:
    """Binary search for the first irrecoverable step of one failed trajectory of ``K`` steps.

    State: ``lo`` steps are known recoverable (0 at the start: the prompt), ``hi`` steps known
    irrecoverable (``K``: the failed rollout itself). :meth:`next_probe` gives the anchor
    ``mid = (lo + hi) // 2`` (a prefix of ``mid`` steps) while ``hi - lo > 1`` and fewer than
    ``max_probes`` probes were made; :meth:`observe` moves ``lo`` (recoverable) or ``hi`` up/down.
    :attr:`error_step` is ``lo + 1`` (1-based).

    Raises:
        ValueError: ``K < 1`` or ``max_probes < 0``.
    """

    def __init__(self, K: int, max_probes: int) -> None:
        if int(K) < 1 or int(max_probes) < 0:
            raise ValueError(f"ErrorSearch needs K >= 1 and max_probes >= 0, got {K}, {max_probes}")
        self.lo, self.hi, self.max_probes = 0, int(K), int(max_probes)
        self.probes: List[int] = []
        self.outcomes: List[bool] = []

    def next_probe(self) -> Optional[int]:
        """The next anchor (steps in the probed prefix, in ``1 .. K-1``), or None when the search is over."""
        if self.hi - self.lo <= 1 or len(self.probes) >= self.max_probes:
            return None
        return (self.lo + self.hi) // 2

    def observe(self, anchor: int, recoverable: bool) -> None:
        """Record the probe of ``anchor``: recoverable -> ``lo = anchor``, else ``hi = anchor``."""
        self.probes.append(int(anchor))
        self.outcomes.append(bool(recoverable))
        if recoverable:
            self.lo = int(anchor)
        else:
            self.hi = int(anchor)

    @property
    def done(self) -> bool:
        """Whether the first irrecoverable step is pinned down (``hi == lo + 1``)."""
        return self.hi - self.lo <= 1

    @property
    def error_step(self) -> int:
        """The located step, 1-based: ``lo + 1`` (the first irrecoverable step once :attr:`done`)."""
        return self.lo + 1


def binary_search(K: int, recoverable: Callable[[int], bool], max_probes: int) -> ErrorSearch:
    """Run :class:`ErrorSearch` to its end with a verifier ``recoverable(j)`` of the ``j``-step prefix.

    Returns:
        the finished search (``probes``, ``outcomes``, ``lo``, ``hi``, ``error_step``).
    """
    s = ErrorSearch(K, max_probes)
    while (j := s.next_probe()) is not None:
        s.observe(j, bool(recoverable(j)))
    return s


def step_cuts(tokenizer: Any, text: str, n_tokens: int, rule: str) -> List[int]:
    """Token cuts of a response's steps: ``cuts[j]`` = response tokens in the prefix of ``j`` steps.

    ``cuts[0] = 0``; ``cuts[j]`` is one past the token that holds step ``j``'s last character (the
    policy tokenizer's offsets, :func:`policy_step_positions`), clamped to ``n_tokens``; a step that
    ends inside the previous cut's token is merged into it (cuts strictly increase).

    Returns:
        ``[0, c_1, .., c_K]`` for the ``K`` (merged) steps; ``[0]`` when the rule finds no step.
    """
    spans = segment_steps(text, rule)
    if not spans or n_tokens <= 0:
        return [0]
    pos = policy_step_positions(tokenizer, text, spans)
    cuts = [0]
    for p in pos:
        c = min(int(p) + 1, int(n_tokens))
        if c > cuts[-1]:
            cuts.append(c)
    if cuts[-1] < n_tokens:  # text after the last step (an EOS, spaces) belongs to the last step
        cuts[-1] = int(n_tokens)
    return cuts


def entropy_gap(surprisal: Sequence[float], cuts: Sequence[int]) -> float:
    """Largest minus smallest step-mean surprisal (nats) over the steps ``[cuts[j-1], cuts[j])``; 0 for < 2 steps."""
    means = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if b > a:
            means.append(sum(float(x) for x in surprisal[a:b]) / (b - a))
    return max(means) - min(means) if len(means) >= 2 else 0.0


# --------------------------------------------------------------------------- the sampler
@SAMPLERS.register("elpo", paper=PAPER, params=ElpoSamplerParams,
                   description="binary-search rollout tree from a failed rollout's prefixes to its first irrecoverable step")
class ElpoSampler(Sampler):
    """ELPO's Binary Error Localization under a fixed rollout budget (module docstring).

    One step, per prompt with group size ``n``: ``n - budget`` rollouts (one engine call for all
    prompts), scored; among the failed ones (reward ``< fail_below``) with at least 2 steps one is
    chosen (``select``) and searched (:class:`ErrorSearch`, at most ``min(max_depth, budget // branch)``
    probes); each search level is one engine call for every group's probe (``branch`` continuations of
    prompt + the anchor's prefix, ``max_new_tokens`` minus the prefix), scored; finally the unspent
    budget of every group is drawn as plain rollouts (one call). ``rollouts_spent`` is ``n`` per prompt.

    Rows: the first rollouts, then the continuations level by level, then the plain top-ups; extras
    ``elpo_role``, ``elpo_anchor``, ``elpo_error_mask`` (module docstring) and ``shared_prefix_len``.

    Metrics: ``sampler/elpo_failed`` (failed first rollouts), ``elpo_localized`` (groups searched),
    ``elpo_probes`` (probes made), ``elpo_resolved`` (searches that pinned the step down),
    ``elpo_error_step_mean`` (1-based located step), ``elpo_steps_mean`` (steps of the searched
    rollouts), ``elpo_recoverable_frac`` (probes found recoverable), ``elpo_topup`` (plain top-ups).

    Raises:
        ValueError: (construction) ``budget`` negative or not below ``n``, a budget below ``branch``, ``branch`` or
            ``max_depth`` below 1, an unknown segmentation rule; the build wraps it in a ConfigError
            naming ``sampler.params``. (``sample``) no scorer in the context.
    """

    uses_rollout_counts = False

    def __init__(self, n_samples: int, *, budget: int, branch: int, max_depth: int, segment: str,
                 fail_below: float, select: str) -> None:
        super().__init__(n_samples)
        budget, branch, max_depth = int(budget), int(branch), int(max_depth)
        if branch < 1 or max_depth < 1:
            raise ValueError(f"branch={branch} and max_depth={max_depth} must be >= 1")
        if budget < 0:
            raise ValueError(f"budget={budget} must be >= 0 (0: half the group)")
        budget = budget or n_samples // 2
        if budget >= n_samples:
            raise ValueError(f"budget={budget} must be below algo.n_samples_per_prompt={n_samples} (the search's "
                             f"rollouts come out of the group; at least one rollout is sampled first). Fix: "
                             f"sampler.params.budget=0 (half the group) or a larger algo.n_samples_per_prompt")
        if budget < branch:
            raise ValueError(f"budget={budget} is less than one probe of branch={branch} continuations. Fix: "
                             f"sampler.params.budget >= {branch}, sampler.params.branch={budget}, or a larger "
                             f"algo.n_samples_per_prompt (budget 0 takes half of it)")
        if str(segment) not in SEGMENTERS:
            raise ValueError(f"segment={segment!r} is not a step segmentation rule (choices: {sorted(SEGMENTERS.names())})")
        self.budget, self.branch, self.max_depth = budget, branch, max_depth
        self.segment, self.fail_below = str(segment), float(fail_below)
        self.select = Select(str(getattr(select, "value", select))).value

    @property
    def max_probes(self) -> int:
        """Probes per localized rollout: ``min(max_depth, budget // branch)``."""
        return min(self.max_depth, self.budget // self.branch)

    def choose(self, rows: Sequence[int], cuts: Dict[int, List[int]], surprisal: Dict[int, List[float]]) -> Optional[int]:
        """The failed row of one group to localize (``rows`` in order), among those with >= 2 steps, or None."""
        cands = [i for i in rows if len(cuts[i]) >= 3]
        if not cands:
            return None
        if self.select == Select.first.value:
            return cands[0]
        gaps = [(entropy_gap(surprisal[i], cuts[i]), -k, i) for k, i in enumerate(cands)]
        return max(gaps)[2]

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        P, n, pad = len(prompts), self.n_samples, pad_id_of(engine)
        first = generate_groups(engine, prompts, [n - self.budget] * P, step_params(params, ctx, 0))
        score_rows(ctx, first)
        gen = first.generation
        B0 = len(first.group_index)
        first.extras.update(self._plain_extras(B0, gen.response_ids.shape[1]))
        tok = engine.tokenizer
        failed = [i for i, r in enumerate(first.rewards.tolist()) if r < self.fail_below]
        lens = gen.response_mask.sum(-1).long().tolist()
        cuts: Dict[int, List[int]] = {}
        sur: Dict[int, List[float]] = {}
        searches: Dict[int, Tuple[int, ErrorSearch]] = {}  # prompt position -> (row, search)
        if self.max_probes > 0:
            for i in failed:
                cuts[i] = step_cuts(tok, gen.texts[i], int(lens[i]), self.segment)
                sur[i] = (-gen.rollout_logprobs[i, : int(lens[i])].double()).tolist()
            pos = first.group_index.tolist()
            for p in range(P):
                row = self.choose([i for i in failed if pos[i] == p], cuts, sur)
                if row is not None:
                    searches[p] = (row, ErrorSearch(len(cuts[row]) - 1, self.max_probes))
        parts: List[SampleResult] = [first]
        spent = {p: 0 for p in range(P)}
        call = 1
        n_probes = n_recov = 0
        while True:
            level = [(p, row, s, s.next_probe()) for p, (row, s) in sorted(searches.items())]
            level = [(p, row, s, j) for p, row, s, j in level if j is not None]
            if not level:
                break
            part = self._probe(engine, prompts, params, ctx, call, level, cuts, gen, pad)
            call += 1
            score_rows(ctx, part)
            ok = (part.rewards >= self.fail_below).view(len(level), self.branch).any(-1).tolist()
            for (p, row, s, j), rec in zip(level, ok):
                s.observe(j, bool(rec))
                spent[p] += self.branch
                n_probes += 1
                n_recov += int(rec)
            parts.append(part)
        # the error masks of the localized rows and of continuations from irrecoverable prefixes
        for p, (row, s) in searches.items():
            first.extras["elpo_role"][row] = ROLE_LOCALIZED
            first.extras["elpo_anchor"][row] = s.lo
            first.extras["elpo_error_mask"][row, cuts[row][s.lo]: int(lens[row])] = 1.0
        for part in parts[1:]:
            irr = part.extras["elpo_anchor"] > torch.tensor([searches[int(g)][1].lo for g in part.group_index.tolist()])
            part.extras["elpo_error_mask"] = part.generation.response_mask.float() * irr.float()[:, None]
        topup = [self.budget - spent[p] for p in range(P)]
        if sum(topup):
            more = generate_groups(engine, prompts, topup, step_params(params, ctx, call))
            score_rows(ctx, more)
            more.extras.update(self._plain_extras(len(more.group_index), more.generation.response_ids.shape[1]))
            parts.append(more)
        out = merge_results(parts, pad) if len(parts) > 1 else first
        out.rollouts_spent = P * n
        loc = [s for _, s in searches.values()]
        out.metrics = {
            "sampler/elpo_failed": float(len(failed)),
            "sampler/elpo_localized": float(len(loc)),
            "sampler/elpo_probes": float(n_probes),
            "sampler/elpo_resolved": float(sum(s.done for s in loc)),
            "sampler/elpo_error_step_mean": sum(s.error_step for s in loc) / len(loc) if loc else 0.0,
            "sampler/elpo_steps_mean": sum(len(cuts[r]) - 1 for r, _ in searches.values()) / len(loc) if loc else 0.0,
            "sampler/elpo_recoverable_frac": n_recov / n_probes if n_probes else 0.0,
            "sampler/elpo_topup": float(sum(topup)),
        }
        return out

    @staticmethod
    def _plain_extras(B: int, R: int) -> Dict[str, torch.Tensor]:
        return {"elpo_role": torch.zeros(B, dtype=torch.long), "elpo_anchor": torch.full((B,), -1, dtype=torch.long),
                "elpo_error_mask": torch.zeros(B, R), "shared_prefix_len": torch.zeros(B, dtype=torch.long)}

    def _probe(self, engine: Any, prompts: Sequence[List[int]], params: Any, ctx: Any, call: int,
               level: Sequence[Tuple[int, int, ErrorSearch, int]], cuts: Dict[int, List[int]],
               gen: GenerationResult, pad: int) -> SampleResult:
        """``branch`` continuations of prompt + the ``j``-step prefix for each ``(pos, row, search, j)`` of ``level``."""
        rows, keep, cont_prompts, gi = [], [], [], []
        for p, row, _, j in level:
            c = cuts[row][j]
            for _ in range(self.branch):
                rows.append(row)
                keep.append(c)
                cont_prompts.append(list(prompts[p]) + gen.response_ids[row, :c].tolist())
                gi.append(p)
        limit = int(params.max_new_tokens)
        budget = max(1, limit - min(keep))
        cont = engine.generate(cont_prompts, dataclasses.replace(step_params(params, ctx, call), max_new_tokens=budget))
        for k, c in enumerate(keep):  # a continuation may not push the response past the step's token limit
            room = max(1, limit - c)
            if int(cont.response_mask[k].sum()) > room:
                cont.response_mask[k, room:] = 0
                cont.finished[k] = False
        texts = []
        for k, (row, c) in enumerate(zip(rows, keep)):
            m = int(cont.response_mask[k].sum())
            texts.append(engine.tokenizer.decode(gen.response_ids[row, :c].tolist() + cont.response_ids[k, :m].tolist(),
                                                 skip_special_tokens=True))
        cont.texts = texts
        B, R = len(rows), cont.response_ids.shape[1]
        anchors = [j for _, _, _, j in level for _ in range(self.branch)]
        extras = {"elpo_role": torch.full((B,), ROLE_CONTINUATION, dtype=torch.long),
                  "elpo_anchor": torch.tensor(anchors, dtype=torch.long), "elpo_error_mask": torch.zeros(B, R),
                  "shared_prefix_len": torch.tensor(keep, dtype=torch.long)}
        return SampleResult(generation=cont, group_index=torch.tensor(gi, dtype=torch.long), rollouts_spent=B,
                            extras=extras)
