"""``sampler=trace_tree``: TRACE's tree rollout allocation over ReAct turn prefixes.

"TRACE: A Unified Rollout Budget Allocation Framework for Efficient Agentic Reinforcement
Learning" (Zou et al., arXiv:2606.11119; the method is "Tree Rollout Allocation for Contrastive
Exploration"). Each thought-action-observation turn of a multi-turn episode is a tree node. Under a
fixed rollout budget the sampler spends rollouts on *anchors*, prompt roots and intermediate turn
prefixes, whose descendants are most likely to hold both a success and a failure (mixed terminal
rewards, the contrast a group-relative update learns from). One shared predictor estimates the
conditional success probability of an anchor from its prefix history and guides the allocation in
two stages: a global root allocation over the step's prompts, then a local prefix expansion.

Read from the abstract and the authors' summary (the full text and any code could not be opened
from here). Everything the text would fix is named below and called **our reading**:

* **mixed-reward value** of an anchor with success probability ``p`` whose descendants already hold
  ``s`` successes and ``f`` failures, after ``k`` more independent continuations
  (:func:`mixed_probability`): ``1`` if ``s > 0`` and ``f > 0``; ``1 - p^k`` if only successes are
  known; ``1 - (1-p)^k`` if only failures; ``1 - p^k - (1-p)^k`` if none;
* **allocation** (:func:`allocate`): greedy by marginal gain of that value, one rollout at a time
  (ties: the earlier anchor); when no anchor gains (all already mixed), the root with the fewest rows;
* **stage 1** (global root allocation): ``R = max(P * min_roots, round(root_share * B))`` of the
  budget ``B`` go to the ``P`` prompt roots, ``min_roots`` each and the rest greedily by the
  no-outcome value; the root episodes run to their ends and are scored;
* **stage 2** (local prefix expansion, one wave): the other ``B - R`` rollouts go greedily to the
  anchors of stage 1: every prompt root (a fresh episode) and every prefix of a root episode just
  before a model turn that follows an environment answer (a continuation: a deep copy of the
  episode state there, as ARPO's branches, so it shares the prefix token ids exactly), each with its
  known descendant outcomes. Total rows per step = ``B`` exactly;
* **success predictor** (:class:`PrefixSuccessPredictor`): the paper's predictor is a learned model
  over prefix histories; here a logistic regression on declared prefix features
  (``features``; :data:`FEATURES`), trained online on the run's own ``(prefix features, final
  success)`` pairs, every prefix of every episode of the step, a few full-batch gradient steps of
  the mean binary cross-entropy per step, and saved in the sampler's checkpoint state. It starts at
  the prompt's smoothed success rate (weight 1 on ``prompt_rate``, 0 elsewhere);
* success = row reward ``>= success_threshold``;
* **advantages**: the group of a row is its prompt, so GRPO-style estimators normalise over all the
  leaves of a root (variable group sizes); every row keeps the loss on its whole response (a prefix
  shared by continuations is trained once per row, ARPO's soft attribution). ``extras['branch_parent']``
  / ``extras['branch_prefix_len']`` record the tree, and shared prefixes match id for id, so
  ``algo=rtmc`` / ``algo=hgpo`` read the tree as they read ARPO's.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import contextlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rlpost.core.registry import param
from rlpost.rollout.hf import left_pad
from rlpost.samplers.base import SAMPLERS, score_rows
from rlpost.samplers.episode import EpisodeSampler, EpisodeSamplerParams, _Episode

_PAPER = ("TRACE: A Unified Rollout Budget Allocation Framework for Efficient Agentic Reinforcement Learning "
          "(Tree Rollout Allocation for Contrastive Exploration, arXiv:2606.11119)")

#: prefix features the predictor may read (``features``), each a float of the prefix history:
#: ``bias`` 1; ``prompt_rate`` logit of the prompt's smoothed root success rate ``(s + 1) / (n + 2)``
#: over earlier steps; ``depth`` model turns so far / ``max_turns``; ``tool_calls`` / ``tool_errors``
#: so far / ``max_turns`` (errors include timeouts); ``prefix_tokens`` response tokens so far /
#: ``max_total_tokens``.
FEATURES = ("bias", "prompt_rate", "depth", "tool_calls", "tool_errors", "prefix_tokens")


def mixed_probability(p: float, k: int, successes: int = 0, failures: int = 0) -> float:
    """Probability that an anchor's descendants hold both a success and a failure after ``k`` more rollouts.

    Args:
        p: success probability of one continuation from the anchor (in [0, 1]).
        k: new continuations (>= 0), independent Bernoulli(p) outcomes.
        successes, failures: descendant outcomes already known (>= 0).
    Returns:
        ``1`` if both are known; ``1 - p^k`` with only successes; ``1 - (1-p)^k`` with only failures;
        ``1 - p^k - (1-p)^k`` with none (0 for ``k <= 1``). TRACE (arXiv:2606.11119): the
        mixed-terminal-reward likelihood of an anchor, its form our reading.
    Raises:
        ValueError: ``p`` outside [0, 1] or a negative count.
    """
    if not 0.0 <= p <= 1.0 or k < 0 or successes < 0 or failures < 0:
        raise ValueError(f"mixed_probability needs p in [0, 1] and counts >= 0, got p={p}, k={k}, "
                         f"successes={successes}, failures={failures}")
    if successes and failures:
        return 1.0
    if successes:
        return 1.0 - p ** k
    if failures:
        return 1.0 - (1.0 - p) ** k
    return max(0.0, 1.0 - p ** k - (1.0 - p) ** k)


def allocate(probs: Sequence[float], budget: int, successes: Optional[Sequence[int]] = None,
             failures: Optional[Sequence[int]] = None, start: Optional[Sequence[int]] = None,
             fallback: Optional[Sequence[int]] = None) -> List[int]:
    """Greedy allocation of ``budget`` rollouts over anchors by marginal mixed-reward value.

    Each rollout goes to ``argmax_a M(p_a, k_a + 1, s_a, f_a) - M(p_a, k_a, s_a, f_a)``
    (:func:`mixed_probability`; ties: the lower index), ``k_a`` starting at ``start[a]``. When no
    anchor gains (every one already mixed or ``p`` in {0, 1}) the rollout goes to the anchor of
    ``fallback`` (indices; default all) with the fewest rows ``s_a + f_a + k_a`` (ties: lower index).
    TRACE (arXiv:2606.11119): budget to the anchors most likely to yield mixed terminal rewards; the
    greedy marginal rule is our reading.

    Args:
        probs: ``[A]`` success probability of each anchor.
        budget: rollouts to place (>= 0).
        successes, failures: ``[A]`` known descendant outcomes (default 0).
        start: ``[A]`` rollouts already placed at each anchor and counted in ``k`` (default 0).
        fallback: anchor indices eligible when nothing gains (the prompt roots).
    Returns:
        ``[A]`` new rollouts per anchor (not counting ``start``), summing to ``budget`` exactly.
    Raises:
        ValueError: no anchors for a positive budget, a negative budget, mismatched lengths, or an
            empty / out-of-range ``fallback``.
    """
    A = len(probs)
    s = list(successes) if successes is not None else [0] * A
    f = list(failures) if failures is not None else [0] * A
    k0 = list(start) if start is not None else [0] * A
    if budget < 0 or len(s) != A or len(f) != A or len(k0) != A:
        raise ValueError(f"allocate: budget {budget} must be >= 0 and every list must have {A} entries")
    if budget and not A:
        raise ValueError("allocate: a positive budget needs at least one anchor")
    fb = list(range(A)) if fallback is None else [int(i) for i in fallback]
    if budget and (not fb or any(not 0 <= i < A for i in fb)):
        raise ValueError(f"allocate: fallback {fb} must name anchors in [0, {A})")
    new = [0] * A
    for _ in range(int(budget)):
        best, gain = -1, 0.0
        for a in range(A):
            k = k0[a] + new[a]
            g = mixed_probability(probs[a], k + 1, s[a], f[a]) - mixed_probability(probs[a], k, s[a], f[a])
            if g > gain + 1e-12:
                best, gain = a, g
        if best < 0:
            best = min(fb, key=lambda a: (s[a] + f[a] + k0[a] + new[a], a))
        new[best] += 1
    return new


class PrefixSuccessPredictor:
    """Logistic success predictor on declared prefix features, trained online (TRACE's shared predictor).

    ``p(x) = sigmoid(w . x)``, ``x`` a ``[F]`` feature vector (:data:`FEATURES`, in the order of
    ``features``). :meth:`update` takes ``epochs`` full-batch gradient steps of
    ``mean_i BCE(p(x_i), y_i) + l2 / 2 * |w|^2`` with step ``lr``:
    ``w <- w - lr * (X^T (sigmoid(X w) - y) / N + l2 * w)``. TRACE (arXiv:2606.11119) trains a
    shared, generalisable predictor of the conditional success probability from prefix histories;
    a logistic model on these features is our reading (small enough for CPU runs).

    Args:
        features: names from :data:`FEATURES` (no repeats).
        lr: gradient step (> 0). epochs: steps per update (>= 0). l2: weight decay (>= 0).
    Raises:
        ValueError: an unknown or repeated feature, or a bad lr / epochs / l2 (each naming the fix).
    """

    def __init__(self, features: Sequence[str], lr: float, epochs: int, l2: float = 0.0) -> None:
        feats = [str(x) for x in features]
        bad = [x for x in feats if x not in FEATURES]
        if bad or len(set(feats)) != len(feats) or not feats:
            raise ValueError(f"features {feats}: each must be one of {list(FEATURES)}, once, and at least one given")
        if not float(lr) > 0 or int(epochs) < 0 or float(l2) < 0:
            raise ValueError(f"predictor_lr ({lr}) must be > 0, predictor_epochs ({epochs}) >= 0, predictor_l2 ({l2}) >= 0")
        self.features, self.lr, self.epochs, self.l2 = feats, float(lr), int(epochs), float(l2)
        # our reading: start at the prompt's smoothed success rate (or 1/2 without that feature)
        self.w = torch.tensor([1.0 if x == "prompt_rate" else 0.0 for x in feats], dtype=torch.float64)

    def predict(self, X: torch.Tensor) -> torch.Tensor:
        """``[N]`` success probabilities of ``[N, F]`` features ``X``."""
        return torch.sigmoid(X.double() @ self.w)

    def loss(self, X: torch.Tensor, y: torch.Tensor) -> float:
        """Mean binary cross-entropy (nats) of ``[N, F]`` ``X`` against ``[N]`` labels in {0, 1}."""
        p = self.predict(X).clamp(1e-12, 1 - 1e-12)
        y = y.double()
        return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())

    def update(self, X: torch.Tensor, y: torch.Tensor) -> float:
        """``epochs`` gradient steps on ``(X [N, F], y [N])``; returns the loss before them (nan when N = 0)."""
        if X.shape[0] == 0:
            return float("nan")
        X, y = X.double(), y.double()
        before = self.loss(X, y)
        for _ in range(self.epochs):
            grad = X.T @ (torch.sigmoid(X @ self.w) - y) / X.shape[0] + self.l2 * self.w
            self.w = self.w - self.lr * grad
        return before

    def state_dict(self) -> Dict[str, Any]:
        """The weights, keyed by feature name."""
        return {"features": list(self.features), "w": self.w.tolist()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: the checkpoint's features differ from this run's ``features``.
        """
        if list(state["features"]) != self.features:
            raise ValueError(f"trace_tree checkpoint predicts from features {state['features']}, this run from "
                             f"{self.features}. Fix: resume with sampler.params.features={state['features']}.")
        self.w = torch.tensor(state["w"], dtype=torch.float64)


@dataclasses.dataclass(frozen=True)
class TraceTreeParams(EpisodeSamplerParams):
    """Parameters of :class:`TraceTreeSampler`: the episode's, plus TRACE's allocation and predictor."""

    root_share: float = param(0.5, "share of the step's rollout budget spent at prompt roots in stage 1, in (0, 1] (our reading)")
    min_roots: int = param(1, "root episodes every prompt gets in stage 1 (>= 1)")
    success_threshold: float = param(1.0, "a row counts as a success when its reward >= this")
    features: List[str] = param(factory=lambda: list(FEATURES),
                                doc="predictor features, a list from bias, prompt_rate, depth, tool_calls, tool_errors, prefix_tokens (our reading)")
    predictor_lr: float = param(0.5, "gradient step of the logistic success predictor (> 0)")
    predictor_epochs: int = param(5, "full-batch gradient steps of the predictor per RL step (>= 0; 0 = frozen)")
    predictor_l2: float = param(0.0, "weight decay of the predictor (>= 0)")


@SAMPLERS.register(
    "trace_tree",
    paper=_PAPER,
    description="Multi-turn episodes whose rollout budget goes to prompt roots and turn prefixes most likely to give mixed rewards.",
    params=TraceTreeParams,
    episodes=True,
)
class TraceTreeSampler(EpisodeSampler):
    """TRACE's two-stage tree rollout allocation on multi-turn episodes (see the module docstring).

    One step: the budget ``B = sum(counts)`` (``prompts x algo.n_samples_per_prompt``) rows.
    Stage 1 runs the root episodes allocated by :func:`allocate` over the prompts' predicted root
    success probabilities and scores them; stage 2 runs ``B - R`` more rollouts, fresh roots or
    continuations from turn prefixes of stage-1 episodes, allocated by :func:`allocate` with the
    known outcomes. Then the predictor takes its gradient steps on every ``(prefix, success)`` pair
    of the step and the prompts' root success counts are updated. The sampler scores every row itself.

    Shapes: ``extras['branch_parent']`` ``[B]`` long (row of the episode a continuation copied, -1
    for roots); ``extras['branch_prefix_len']`` ``[B]`` long (response tokens shared with it);
    ``extras['trace_p']`` ``[B]`` float predicted success of the row's anchor; metrics
    ``trace/...``.

    Args:
        n_samples: rollouts per prompt of the budget (>= 2).
        root_share, min_roots, success_threshold, features, predictor_lr, predictor_epochs,
        predictor_l2: :class:`TraceTreeParams`; the episode parameters as :class:`EpisodeSampler`.
    Raises:
        ValueError (a ConfigError through ``build_sampler``): ``n_samples < 2``, ``branching`` set
        (TRACE is its own branching), a bad share / count / feature / predictor setting, or a budget
        smaller than ``prompts x min_roots`` at sampling time.
    """

    uses_rollout_counts = False  # the total budget is reallocated across prompts

    def __init__(self, n_samples: int = 1, *, root_share: float, min_roots: int, success_threshold: float,
                 features: Any, predictor_lr: float, predictor_epochs: int, predictor_l2: float, **episode: Any) -> None:
        super().__init__(n_samples, **episode)
        if self.branching != "none":
            raise ValueError(f"sampler=trace_tree allocates its own tree, so branching={self.branching} would "
                             f"double it. Fix: sampler.params.branching=none (or sampler=episode for ARPO/AEPO).")
        if int(n_samples) < 2:
            raise ValueError(f"sampler=trace_tree needs a budget of >= 2 rollouts per prompt to build contrast, got "
                             f"algo.n_samples_per_prompt={n_samples}. Fix: algo.n_samples_per_prompt=4 (or more).")
        if not 0.0 < float(root_share) <= 1.0 or int(min_roots) < 1 or int(min_roots) > int(n_samples):
            raise ValueError(f"root_share ({root_share}) must be in (0, 1] and min_roots ({min_roots}) in "
                             f"[1, n_samples={n_samples}]. Fix: e.g. root_share=0.5, min_roots=1.")
        feats = [str(x) for x in features]
        self.root_share, self.min_roots = float(root_share), int(min_roots)
        self.success_threshold = float(success_threshold)
        self.predictor = PrefixSuccessPredictor(feats, predictor_lr, predictor_epochs, predictor_l2)
        self.prompt_stats: Dict[int, List[int]] = {}  # dataset index -> [root successes, root episodes]
        self._collect = False  # record prefix counters (both stages) in round()
        self._snap: Optional[List[Tuple[_Episode, _Episode]]] = None  # stage 1: (episode, its state before a turn)

    # ------------------------------------------------------------------ features
    def _prompt_key(self, ctx: Any, pos: int) -> int:
        return int(ctx.prompt_indices[pos]) if ctx.prompt_indices is not None else -1 - pos

    def prompt_rate_logit(self, key: int) -> float:
        """Logit of the prompt's smoothed root success rate ``(s + 1) / (n + 2)`` over earlier steps."""
        s, n = self.prompt_stats.get(int(key), [0, 0])
        r = (s + 1.0) / (n + 2.0)
        return math.log(r / (1.0 - r))

    def feature_vector(self, counters: Tuple[int, int, int, int], rate_logit: float) -> List[float]:
        """``[F]`` features of a prefix: ``counters`` = (model turns, tool calls, tool errors, response tokens)."""
        turns, calls, errors, toks = counters
        val = {"bias": 1.0, "prompt_rate": rate_logit, "depth": turns / self.max_turns,
               "tool_calls": calls / self.max_turns, "tool_errors": errors / self.max_turns,
               "prefix_tokens": toks / self.max_total_tokens}
        return [float(val[x]) for x in self.predictor.features]

    @staticmethod
    def _counters(e: _Episode) -> Tuple[int, int, int, int]:
        return (e.turns, e.tool_calls, e.tool_errors + e.tool_timeouts, len(e.ids))

    def round(self, engine, live, params, tok, eos_ids, eps=None, budget=None, rng=None, stats=None) -> None:
        """:meth:`EpisodeSampler.round`, recording while sampling each episode's prefix before its turn
        (its counters for the predictor; in stage 1 also a deep copy, the anchor of a continuation,
        when the turn follows an environment answer)."""
        if self._collect:
            for e in live:
                if self._snap is not None and e.after_tool and e.turns < self.max_turns:
                    self._snap.append((e, copy.deepcopy(e)))  # before the counters: a continuation records them itself
                e.trace_prefixes = list(getattr(e, "trace_prefixes", [])) + [self._counters(e)]
        super().round(engine, live, params, tok, eos_ids, eps, budget, rng, stats)

    # ------------------------------------------------------------------ sampling
    def _score_part(self, ctx: Any, eps: List[_Episode], engine: Any, prompts: Any) -> None:
        """Score ``eps`` once (the verifier, plus episode-level environment rewards); store per episode."""
        res = self._assemble(eps, [e.pos for e in eps], engine, prompts, left_pad)
        score_rows(ctx, res)
        if "turn_rewards" in res.extras and not (self.env_reward_at == "turn" and self.env_reward_weight):
            raise ValueError("sampler=trace_tree does not carry process-reward token rewards. Fix: sampler=episode, "
                             "or drop the process reward model.")
        if self.env_reward_weight and self.env_reward_at == "episode":
            env_r = self.env_reward_weight * torch.tensor([e.env_reward for e in eps], dtype=torch.float32)
            res.rewards = res.rewards + env_r
            res.extras["reward_env"] = env_r
        keys = [k for k, v in res.extras.items() if (k.startswith("reward_") or k == "format_ok") and v.dim() == 1]
        for i, e in enumerate(eps):
            e.trace_reward = float(res.rewards[i])
            e.trace_parts = {k: float(res.extras[k][i]) for k in keys}

    def _run_all(self, engine, eps, params, ctx, tok, eos_ids, call):
        rng = random.Random(0)
        stats = {"root": [], "tool": [], "branches": 0}
        return self._run(engine, eps, params, ctx, tok, eos_ids, [0] * (1 + max(e.pos for e in eps)), rng, stats, call)

    def _succ(self, e: _Episode) -> bool:
        return e.trace_reward >= self.success_threshold

    def _feat(self, e: _Episode, rates: List[float], counters: Optional[Tuple[int, int, int, int]] = None) -> List[float]:
        return self.feature_vector(counters or self._counters(e), rates[e.pos])

    def sample(self, engine, prompts, params, ctx):
        """Run TRACE's two stages and return ``B`` scored rows; see the class docstring.

        Raises:
            ValueError: no tokenizer, no scorer, or a budget below ``prompts x min_roots``.
        """
        tok = getattr(engine, "tokenizer", None)
        if tok is None:
            raise ValueError("sampler=trace_tree needs a rollout engine with a tokenizer (rollout=hf or vllm)")
        if ctx.score is None:
            raise ValueError("sampler=trace_tree scores its root episodes before expanding them and needs "
                             "SamplerContext.score (the run's reward function)")
        eos_ids = set(getattr(engine, "eos_ids", None) or [tok.eos_token_id])
        P = len(prompts)
        counts = self.counts(P, ctx)
        if max(counts, default=0) <= 1:  # evaluation (one greedy episode per problem): plain episodes, nothing learned
            return super().sample(engine, prompts, params, ctx)
        B = int(sum(counts))
        if B < P * self.min_roots:
            raise ValueError(f"sampler=trace_tree: budget {B} rollouts < {P} prompts x min_roots={self.min_roots}. "
                             f"Fix: more rollouts per prompt or sampler.params.min_roots=1.")
        keys = [self._prompt_key(ctx, i) for i in range(P)]
        rates = [self.prompt_rate_logit(k) for k in keys]
        root_x = torch.tensor([self.feature_vector((0, 0, 0, 0), r) for r in rates], dtype=torch.float64)
        p_root = self.predictor.predict(root_x).tolist()
        R = min(B, max(P * self.min_roots, int(round(self.root_share * B))))
        run = (engine, prompts, params, ctx, tok, eos_ids)
        session = getattr(engine, "session", None)
        self._collect, self._snap = True, []
        try:
            with (session() if session is not None else contextlib.nullcontext()):
                eps1, snaps, call = self._stage_roots(run, p_root, R)
                eps2, anchors_p = self._stage_prefixes(run, eps1, snaps, p_root, rates, B - R, call)
        finally:
            self._collect, self._snap = False, None
        for e in eps1:
            e.trace_src = None
        eps = sorted(eps1 + eps2, key=lambda e: e.pos)  # rows grouped by prompt (stable: stage order kept)
        assert len(eps) == B, "trace_tree budget accounting"
        res = self._rows(eps, engine, prompts)
        loss = self._learn(eps, keys, rates)
        r = res.rewards
        mixed = [bool((r[res.group_index == i] >= self.success_threshold).any()
                      and (r[res.group_index == i] < self.success_threshold).any()) for i in range(P)]
        n_cont = sum(e.parent >= 0 for e in eps)
        res.metrics.update({
            "trace/root_rollouts": float(B - n_cont), "trace/prefix_rollouts": float(n_cont),
            "trace/anchors": float(len(anchors_p)), "trace/mixed_group_frac": float(sum(mixed) / max(1, P)),
            "trace/p_root_mean": float(sum(p_root) / max(1, P)), "trace/predictor_loss": loss,
        })
        self._write_transcript(ctx, eps, res)
        return res

    def _stage_roots(self, run: Tuple[Any, ...], p_root: List[float], R: int):
        """Stage 1: ``R`` root episodes allocated globally over the prompts' predicted success ``p_root``
        (``min_roots`` each first), run and scored. Returns ``(episodes, snapshots, call)``: the turn
        prefixes recorded while sampling (the anchors of stage 2) and the engine call counter."""
        engine, prompts, params, ctx, tok, eos_ids = run
        P = len(prompts)
        n_root = [self.min_roots + a for a in allocate(p_root, R - P * self.min_roots, start=[self.min_roots] * P)]
        eps1 = [self._new_episode(ctx, pos, prompts[pos], tok) for pos in range(P) for _ in range(n_root[pos])]
        for e in eps1:
            e.can_branch, e.trace_p = False, p_root[e.pos]
        call = self._run_all(engine, eps1, params, ctx, tok, eos_ids, 0)
        self._mark_void(eps1)
        self._score_part(ctx, eps1, engine, prompts)
        snaps, self._snap = self._snap, None
        return eps1, snaps, call

    def _stage_prefixes(self, run: Tuple[Any, ...], eps1: List[_Episode], snaps: List[Tuple[_Episode, _Episode]],
                        p_root: List[float], rates: List[float], budget: int, call: int):
        """Stage 2: ``budget`` more rollouts, fresh roots or continuations of stage-1 turn prefixes,
        allocated by :func:`allocate` over the anchors' predicted success with the known stage-1
        outcomes. Returns ``(episodes, anchor probabilities)`` (the ``P`` roots, then the prefixes)."""
        engine, prompts, params, ctx, tok, eos_ids = run
        P = len(prompts)
        anchors_p = list(p_root)
        s_known = [sum(self._succ(e) for e in eps1 if e.pos == i) for i in range(P)]
        f_known = [sum(1 for e in eps1 if e.pos == i) - s_known[i] for i in range(P)]
        if snaps:
            px = torch.tensor([self._feat(src, rates, self._counters(snap)) for src, snap in snaps], dtype=torch.float64)
            anchors_p += self.predictor.predict(px).tolist()
            s_known += [int(self._succ(src)) for src, _ in snaps]
            f_known += [1 - int(self._succ(src)) for src, _ in snaps]
        new = allocate(anchors_p, budget, s_known, f_known, fallback=list(range(P)))
        eps2: List[_Episode] = []
        for i in range(P):
            for _ in range(new[i]):
                e = self._new_episode(ctx, i, prompts[i], tok)
                e.can_branch, e.trace_p, e.trace_src = False, anchors_p[i], None
                eps2.append(e)
        for j, (src, snap) in enumerate(snaps):
            for _ in range(new[P + j]):
                e = copy.deepcopy(snap)
                e.can_branch, e.trace_p, e.trace_src, e.prefix_len = False, anchors_p[P + j], src, len(snap.ids)
                eps2.append(e)
        if eps2:
            self._run_all(engine, eps2, params, ctx, tok, eos_ids, call)
            self._mark_void(eps2)
            self._score_part(ctx, eps2, engine, prompts)
        return eps2, anchors_p

    def _rows(self, eps: List[_Episode], engine: Any, prompts: Any):
        """The ``B`` rows of the step from the scored episodes (rewards, reward parts, tree extras)."""
        row_of = {id(e): r for r, e in enumerate(eps)}
        for e in eps:
            e.parent = row_of[id(e.trace_src)] if e.trace_src is not None else -1
        res = self._assemble(eps, [e.pos for e in eps], engine, prompts, left_pad)
        res.rewards = torch.tensor([e.trace_reward for e in eps], dtype=torch.float32)
        for k in sorted(set().union(*(e.trace_parts.keys() for e in eps))):
            res.extras[k] = torch.tensor([e.trace_parts.get(k, 0.0) for e in eps], dtype=torch.float32)
        if self.void_turn_filter:
            void = torch.tensor([e.void for e in eps], dtype=torch.bool)
            res.generation.response_mask[void] = 0.0
            res.metrics["episode/void_filtered_frac"] = float(void.float().mean())
        res.extras["branch_parent"] = torch.tensor([e.parent for e in eps], dtype=torch.long)
        res.extras["branch_prefix_len"] = torch.tensor([e.prefix_len for e in eps], dtype=torch.long)
        res.extras["trace_p"] = torch.tensor([e.trace_p for e in eps], dtype=torch.float32)
        return res

    def _learn(self, eps: List[_Episode], keys: List[int], rates: List[float]) -> float:
        """The predictor's gradient steps on every ``(prefix, success)`` pair of the step; the prompts'
        root success counts from root episodes. Returns the predictor loss."""
        X, y = [], []
        for e in eps:
            for c in getattr(e, "trace_prefixes", []):
                X.append(self._feat(e, rates, c))
                y.append(float(self._succ(e)))
        loss = self.predictor.update(torch.tensor(X, dtype=torch.float64).reshape(len(X), len(self.predictor.features)),
                                     torch.tensor(y))
        for e in eps:
            if e.trace_src is None and e.prefix_len == 0:
                st = self.prompt_stats.setdefault(keys[e.pos], [0, 0])
                st[0] += int(self._succ(e))
                st[1] += 1
        return loss

    def _mark_void(self, eps: List[_Episode]) -> None:
        if self.void_turn_filter and self.task is not None:
            for e in eps:  # a final turn without an answer is void too (SimpleTIR), as sampler=episode
                if e.finished and self.task.extract_answer(e.final_text) is None:
                    e.void = True

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> Dict[str, Any]:
        """The predictor's weights and the prompts' root success counts."""
        return {"predictor": self.predictor.state_dict(),
                "prompt_stats": {int(k): list(v) for k, v in self.prompt_stats.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (an empty state, a fresh run's, leaves the sampler as built)."""
        if not state:
            return
        self.predictor.load_state_dict(state["predictor"])
        self.prompt_stats = {int(k): [int(v[0]), int(v[1])] for k, v in state.get("prompt_stats", {}).items()}
