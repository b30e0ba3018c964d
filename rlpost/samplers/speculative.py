"""``sampler=spec_rl``: the previous epoch's rollouts of a prompt as speculative drafts.

SPEC-RL ("SPEC-RL: Accelerating On-Policy Reinforcement Learning via Speculative
Rollouts", Liu et al., arXiv:2509.23232) observes that the rollouts of one prompt in
consecutive epochs overlap heavily, treats the old rollout as a draft and the
current policy as the verifier, keeps the accepted part and generates on from the
first rejected token.

This implementation uses the exact acceptance rule of speculative sampling
(Leviathan et al., "Fast Inference from Transformers via Speculative Decoding",
arXiv:2211.17192; Chen et al., arXiv:2302.01318): draft token ``x_t`` is accepted
with probability ``min(1, p(x_t) / q(x_t))`` where ``p`` is the current policy's
sampling distribution and ``q`` the one the draft was drawn from; at the first
rejection a token is drawn from the residual ``max(0, p - q) / sum(max(0, p - q))``
and the engine generates the rest. Every returned response is then distributed
exactly as a fresh sample from the current policy (tested statistically in
``tests/test_spec_rl.py``).

Choices the paper leaves open (ours):

* The residual needs the *whole* draft distribution ``q`` at the rejected position,
  so the cache keeps ``q`` (float32, after temperature / top-k / top-p) for every
  draft position; it is computed with one no-grad forward pass over the step's
  rollouts under the weights that generated them. Its size is bounded by
  ``max_cache_mb`` (oldest prompts evicted first; eviction never looks at a
  draft's content, so it cannot bias the samples).
* Each draft is used once: a draft reused twice would make two rollouts of a step
  dependent. A prompt's ``j``-th rollout is verified against its ``j``-th draft;
  every rollout of the step (not only those the driver keeps) replaces the cache
  entry, since keeping drafts by their reward would bias the proposal.
* The paper's lenience (accepting with ``min(1, lenience * p / q)``) is offered;
  any value other than 1 gives up exactness for longer accepted prefixes.
* A continuation is generated in one engine call for all rows with the largest
  remaining budget and each row is cut to its own budget (cutting a sample at
  ``L`` tokens is a sample with limit ``L``); the tokens beyond a row's budget are
  counted in ``sampler/generated_tokens``.
* Accepted and residual tokens get ``log p`` (the current policy) as their
  rollout log-prob: that is the distribution they are marginally drawn from.

Needs ``rollout=hf`` (the verifier reads full next-token distributions of the
engine's model).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from rlpost.core.registry import param
from rlpost.models.logprobs import build_inputs, eval_mode
from rlpost.models.sampling import apply_top_k_top_p
from rlpost.rollout.base import GenerationResult
from rlpost.rollout.hf import left_pad, sample_inverse_cdf
from rlpost.samplers.base import SAMPLERS, SampleResult, Sampler, concat_generations, pad_id_of, step_params


# ---------------------------------------------------------------- pure functions
def speculative_verify(
    p: torch.Tensor,
    q: torch.Tensor,
    draft: torch.Tensor,
    lengths: torch.Tensor,
    u_accept: torch.Tensor,
    u_resample: torch.Tensor,
    lenience: float = 1.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Speculative acceptance of drafts, token by token, with residual resampling.

    Args:
        p: ``[B, L, V]`` target (current policy) probabilities at each draft position.
        q: ``[B, L, V]`` draft probabilities at the same positions (the distribution
            each draft token was drawn from).
        draft: ``[B, L]`` long draft tokens (anything past ``lengths`` is ignored).
        lengths: ``[B]`` long draft length of each row (0 allowed).
        u_accept: ``[B, L]`` uniforms in [0, 1) for the accept tests.
        u_resample: ``[B]`` uniforms in [0, 1) for the residual draw.
        lenience: accept with ``min(1, lenience * p / q)``; 1 is exact speculative sampling.

    Returns:
        ``(n_accepted [B] long, next_token [B] long)``: the accepted prefix length
        (``lengths`` when nothing was rejected) and the token drawn from the residual
        ``max(0, p - q)`` at the first rejected position (``-1`` when nothing was
        rejected). Where the residual has no mass (p == q up to rounding) the token
        is drawn from ``p``.

    Raises:
        ValueError: shapes disagree or ``lenience <= 0``.
    """
    if p.shape != q.shape or p.shape[:2] != draft.shape:
        raise ValueError(f"p {tuple(p.shape)}, q {tuple(q.shape)} and draft {tuple(draft.shape)} disagree")
    if lenience <= 0:
        raise ValueError(f"lenience must be > 0, got {lenience}")
    B, L = draft.shape
    if L == 0:
        return lengths.clone().long(), torch.full((B,), -1, dtype=torch.long)
    idx = draft.clamp(min=0)[..., None]
    pt = p.gather(-1, idx).squeeze(-1).double()
    qt = q.gather(-1, idx).squeeze(-1).double()
    ratio = torch.where(qt > 0, lenience * pt / qt.clamp(min=1e-300), torch.ones_like(pt))
    accept = u_accept.double() < ratio.clamp(max=1.0)
    valid = torch.arange(L)[None, :] < lengths[:, None]
    rejected = valid & ~accept
    any_rej = rejected.any(-1)
    first = torch.where(any_rej, rejected.double().argmax(-1), lengths.long())
    nxt = torch.full((B,), -1, dtype=torch.long)
    rows = torch.nonzero(any_rej).flatten()
    if len(rows):
        k = first[rows]
        pk, qk = p[rows, k].double(), q[rows, k].double()
        resid = (pk - qk).clamp(min=0)
        empty = resid.sum(-1) <= 1e-12
        resid = torch.where(empty[:, None], pk, resid)
        nxt[rows] = sample_inverse_cdf(resid, u=u_resample[rows])
    return first.long(), nxt


@torch.no_grad()
def response_distributions(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk: int = 0,
) -> torch.Tensor:
    """``[B, R, V]`` float32 sampling distribution of ``model`` at each response position.

    The distribution the rollout engine samples response token ``t`` from
    (temperature, then top-k / top-p, as :mod:`rlpost.models.sampling`), given the
    prompt and the response tokens before ``t``. ``chunk`` rows per forward pass
    (0: as many as keep the logits under 2^25 floats). Rows are exact where ``response_mask`` is 1 (and at the position right after,
    which is how a continuation after the last token is verified).
    """

    dev = next(model.parameters()).device
    P, R = prompt_ids.shape[1], response_ids.shape[1]
    outs = []
    if chunk <= 0:
        V = int(getattr(getattr(model, "config", None), "vocab_size", 50000))
        chunk = max(1, 2**25 // max(1, (R + 1) * V))
    with eval_mode(model):
        for s in range(0, prompt_ids.shape[0], chunk):
            sl = slice(s, s + chunk)
            attn_r = torch.ones_like(response_mask[sl]).long()  # causal: later tokens never affect earlier positions
            ids, attn, pos = build_inputs(prompt_ids[sl], prompt_mask[sl], response_ids[sl], attn_r)
            # only the positions that predict response tokens go through the LM head
            logits = model(input_ids=ids.to(dev), attention_mask=attn.to(dev), position_ids=pos.to(dev),
                           logits_to_keep=R + 1).logits
            lg = logits[:, :R].float().cpu() / float(temperature)
            lg = apply_top_k_top_p(lg.reshape(-1, lg.shape[-1]), top_k, top_p).reshape(lg.shape)
            outs.append(torch.softmax(lg, -1))
    return torch.cat(outs)


# ---------------------------------------------------------------- the sampler
@dataclass(frozen=True)
class SpecRLSamplerParams:
    """Parameters of :class:`SpecRLSampler` (previous-epoch rollouts as speculative drafts)."""

    lenience: float = param(1.0, "accept a draft token with min(1, lenience * p/q); 1 = exact (fresh-sample distribution).")
    max_cache_mb: float = param(1024.0, "memory bound of the draft cache (drafts + their distributions), oldest prompts evicted first.")
    max_age: int = param(1000, "oldest usable draft, in RL steps.")


@SAMPLERS.register(
    "spec_rl",
    paper="SPEC-RL: Accelerating On-Policy Reinforcement Learning via Speculative Rollouts (arXiv:2509.23232)",
    description="Previous-epoch rollouts of the same prompt as speculative drafts, verified under the current policy.",
    params=SpecRLSamplerParams,
)
class SpecRLSampler(Sampler):
    """Group sampling that reuses the last epoch's rollouts of each prompt as drafts.

    For prompt ``i`` with cached drafts ``d_1..d_m`` (its rollouts the last time it
    was sampled), rollout ``j <= m`` verifies ``d_j`` under the current policy
    (:func:`speculative_verify`); the accepted prefix plus the residual token is
    kept, and the engine generates only the rest. A fully accepted draft that had
    ended (EOS / stop string) needs no generation at all. Rollouts ``j > m`` and
    prompts without drafts are generated normally. Output: one row per rollout,
    ``n_samples`` (or the selector's count) per prompt, with the prompt as its
    prompt and the whole response carrying loss.

    Metrics: ``sampler/draft_rows``, ``sampler/draft_tokens`` (tokens offered),
    ``sampler/accepted_tokens``, ``sampler/accept_rate`` (accepted / offered),
    ``sampler/full_reuse`` (rows needing no generation), ``sampler/generated_tokens``
    (tokens the engine decoded this step, fresh + continuations, including the
    ones cut off at a row's budget), ``sampler/cache_mb``.

    Args:
        lenience, max_cache_mb, max_age: see :class:`SpecRLSamplerParams`.

    Raises:
        ValueError: (at sampling) an engine without ``model`` / ``tokenizer`` (not ``rollout=hf``).
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int, *, lenience: float, max_cache_mb: float, max_age: int) -> None:
        super().__init__(n_samples)
        if lenience <= 0:
            raise ValueError(f"lenience must be > 0, got {lenience}")
        self.lenience = float(lenience)
        self.max_cache_mb = float(max_cache_mb)
        self.max_age = int(max_age)
        # key -> {"step": int, "drafts": [(ids [L] long, q [L, V] float32, finished bool)]}
        self.cache: "OrderedDict[Any, Dict[str, Any]]" = OrderedDict()

    # -- cache
    def _key(self, ctx, i: int, prompt: List[int]) -> Any:
        if ctx.prompt_indices is not None:
            return int(ctx.prompt_indices[i])
        return tuple(prompt)

    def cache_bytes(self) -> int:
        """Bytes held by the draft cache."""
        return sum(ids.numel() * 8 + q.numel() * 4 for e in self.cache.values() for ids, q, _ in e["drafts"])

    def _evict(self) -> None:
        while self.cache and self.cache_bytes() > self.max_cache_mb * 2**20:
            self.cache.popitem(last=False)

    # -- sampling
    def _verify(self, model: Any, tok: Any, prompts: List[List[int]], rows: list, draft_rows: List[int], params: Any,
                gen: torch.Generator, pad: int, R: int, eos: set) -> tuple:
        """Verify the cached drafts of ``draft_rows`` under the current policy (lenient rejection sampling).

        Returns ``(prefix, prefix log-probs, done, drafted tokens, accepted tokens)``: per row the
        accepted tokens plus the residual token, their log-probs under the policy, and whether the row
        finished without generation.
        """
        prefix: Dict[int, List[int]] = {}  # row -> accepted tokens (+ residual token)
        prefix_lp: Dict[int, List[float]] = {}
        done: Dict[int, bool] = {}  # row -> finished without generation
        n_offered = n_acc_total = 0
        if draft_rows:
            L = min(R, max(len(rows[r][1][0]) for r in draft_rows))
            V = rows[draft_rows[0]][1][1].shape[-1]
            dr = torch.full((len(draft_rows), L), pad, dtype=torch.long)
            qd = torch.zeros(len(draft_rows), L, V)
            lens = torch.zeros(len(draft_rows), dtype=torch.long)
            for b, r in enumerate(draft_rows):
                ids, q, _ = rows[r][1]
                n = min(len(ids), L)
                dr[b, :n], qd[b, :n], lens[b] = ids[:n], q[:n], n
            pid, pm = left_pad([prompts[rows[r][0]] for r in draft_rows], pad)
            rmask = (torch.arange(L)[None, :] < lens[:, None]).float()
            p = response_distributions(model, pid, pm, dr, rmask, params.temperature, params.top_k, params.top_p)
            if p.shape[-1] != V:
                raise ValueError(f"draft vocabulary {V} differs from the policy's {p.shape[-1]}")
            ua = torch.rand(len(draft_rows), L, generator=gen, dtype=torch.float64)
            ur = torch.rand(len(draft_rows), generator=gen, dtype=torch.float64)
            n_acc, nxt = speculative_verify(p, qd, dr, lens, ua, ur, self.lenience)
            n_offered = int(lens.sum())
            n_acc_total = int(n_acc.sum())
            for b, r in enumerate(draft_rows):
                k = int(n_acc[b])
                ids = dr[b, :k].tolist()
                lps = torch.log(p[b, torch.arange(k), dr[b, :k]].clamp(min=1e-30)).tolist()
                if int(nxt[b]) >= 0:
                    ids.append(int(nxt[b]))
                    lps.append(float(torch.log(p[b, k, int(nxt[b])].clamp(min=1e-30))))
                    fin = ids[-1] in eos or self._stop_hit(tok, ids, params.stop)
                else:
                    fin = bool(rows[r][1][2]) and k == len(rows[r][1][0])  # the whole ended draft accepted
                prefix[r], prefix_lp[r] = ids, lps
                done[r] = fin or len(ids) >= R
        return prefix, prefix_lp, done, n_offered, n_acc_total

    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        model = getattr(engine, "model", None)
        tok = getattr(engine, "tokenizer", None)
        if model is None or tok is None:
            raise ValueError("sampler=spec_rl verifies drafts with the engine's model: use rollout=hf")
        if params.greedy or params.temperature_hook is not None:
            raise ValueError("sampler=spec_rl needs plain sampling (no greedy decoding, no per-token temperature hook)")
        params = step_params(params, ctx, 0)
        gen = torch.Generator()
        gen.manual_seed(int(params.seed if params.seed is not None else torch.randint(0, 2**31, ()).item()) + 424243)
        pad = pad_id_of(engine)
        R = int(params.max_new_tokens)
        eos = set(getattr(engine, "eos_ids", {tok.eos_token_id}))
        counts = self.counts(len(prompts), ctx)
        keys = [self._key(ctx, i, p) for i, p in enumerate(prompts)]

        # 1. which rows verify a draft
        rows: List[Tuple[int, Optional[Tuple[torch.Tensor, torch.Tensor, bool]]]] = []
        for i, c in enumerate(counts):
            e = self.cache.get(keys[i])
            usable = e is not None and 0 < ctx.step - e["step"] <= self.max_age
            for j in range(c):
                d = e["drafts"][j] if usable and j < len(e["drafts"]) else None
                rows.append((i, d))
        draft_rows = [r for r, (_, d) in enumerate(rows) if d is not None and len(d[0]) > 0]

        # 2. verify drafts under the current policy
        prefix, prefix_lp, done, n_offered, n_acc_total = self._verify(model, tok, prompts, rows, draft_rows, params,
                                                                       gen, pad, R, eos)

        # 3. generate fresh rows and continuations
        fresh = [r for r in range(len(rows)) if r not in prefix]
        cont = [r for r in prefix if not done[r]]
        pieces: Dict[int, GenerationResult] = {}
        generated = 0
        if fresh:
            g = engine.generate([prompts[rows[r][0]] for r in fresh], params)
            generated += g.num_tokens
            for b, r in enumerate(fresh):
                pieces[r] = _row(g, b, [], [], prompts[rows[r][0]], pad, tok, None)
        if cont:
            budget = {r: R - len(prefix[r]) for r in cont}
            cp = dataclasses.replace(params, max_new_tokens=max(budget.values()),
                                     seed=None if params.seed is None else int(params.seed) + 7_000_003)
            g = engine.generate([prompts[rows[r][0]] + prefix[r] for r in cont], cp)
            generated += g.num_tokens
            for b, r in enumerate(cont):
                pieces[r] = _row(g, b, prefix[r], prefix_lp[r], prompts[rows[r][0]], pad, tok, budget[r])
        for r in prefix:
            if done[r]:
                pieces[r] = _prefix_only_row(prompts[rows[r][0]], prefix[r], prefix_lp[r], pad, tok, True, params)
        out_gen = concat_generations([pieces[r] for r in range(len(rows))], pad)
        gi = torch.tensor([i for i, _ in rows], dtype=torch.long)

        # 4. the step's rollouts become the drafts of the next visit
        q_new = response_distributions(model, out_gen.prompt_ids, out_gen.prompt_mask, out_gen.response_ids,
                                       out_gen.response_mask, params.temperature, params.top_k, params.top_p)
        by_prompt: Dict[int, List[Tuple[torch.Tensor, torch.Tensor, bool]]] = {}
        for r, (i, _) in enumerate(rows):
            n = int(out_gen.response_mask[r].sum())
            by_prompt.setdefault(i, []).append(
                (out_gen.response_ids[r, :n].clone(), q_new[r, :n].clone(), bool(out_gen.finished[r])))
        for i, ds in by_prompt.items():
            self.cache.pop(keys[i], None)
            self.cache[keys[i]] = {"step": int(ctx.step), "drafts": ds}
        self._evict()
        n_full = sum(1 for r in prefix if done[r])
        metrics = {
            "sampler/draft_rows": float(len(draft_rows)),
            "sampler/draft_tokens": float(n_offered),
            "sampler/accepted_tokens": float(n_acc_total),
            "sampler/accept_rate": float(n_acc_total / n_offered) if n_offered else 0.0,
            "sampler/full_reuse": float(n_full),
            "sampler/generated_tokens": float(generated),
            "sampler/cache_mb": self.cache_bytes() / 2**20,
        }
        return SampleResult(generation=out_gen, group_index=gi, rollouts_spent=len(rows), metrics=metrics)

    @staticmethod
    def _stop_hit(tok: Any, ids: List[int], stop: List[str]) -> bool:
        if not stop:
            return False
        tail = tok.decode(ids[-16:], skip_special_tokens=True)
        return any(s in tail for s in stop)

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102 - the draft cache (drafts and their distributions)
        return {"cache": [(k, e) for k, e in self.cache.items()]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # noqa: D102
        self.cache = OrderedDict((k if not isinstance(k, list) else tuple(k), e) for k, e in state.get("cache", []))


def _row(g: GenerationResult, b: int, pre: List[int], pre_lp: List[float], prompt: List[int], pad: int,
         tok: Any, budget: Optional[int]) -> GenerationResult:
    """One row: ``prompt`` as its prompt, ``pre`` + row ``b`` of ``g`` (cut to ``budget``) as its response."""
    m = g.response_mask[b] > 0
    ids = g.response_ids[b][m].tolist()
    lps = g.rollout_logprobs[b][m].tolist()
    temps = g.temperatures[b][m].tolist()
    fin = bool(g.finished[b])
    if budget is not None and len(ids) > budget:
        ids, lps, temps, fin = ids[:budget], lps[:budget], temps[:budget], False
    T0 = temps[0] if temps else 1.0
    full = pre + ids
    text = tok.decode(full, skip_special_tokens=True) if (pre or budget is not None) else g.texts[b]
    return _make_row(prompt, full, pre_lp + lps, [T0] * len(pre) + temps, fin, text, pad)


def _prefix_only_row(prompt: List[int], ids: List[int], lps: List[float], pad: int, tok: Any, fin: bool,
                     params: Any) -> GenerationResult:
    return _make_row(prompt, ids, lps, [float(params.temperature)] * len(ids), fin,
                     tok.decode(ids, skip_special_tokens=True), pad)


def _make_row(prompt: List[int], ids: List[int], lps: List[float], temps: List[float], fin: bool, text: str,
              pad: int) -> GenerationResult:
    pid, pm = left_pad([prompt], pad)
    L = max(1, len(ids))
    resp = torch.full((1, L), pad, dtype=torch.long)
    mask = torch.zeros(1, L)
    lp = torch.zeros(1, L)
    tt = torch.zeros(1, L)
    if ids:
        resp[0, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[0, : len(ids)] = 1.0
        lp[0, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
        tt[0, : len(ids)] = torch.tensor(temps, dtype=torch.float32)
    return GenerationResult(pid, pm, resp, mask, lp, tt, torch.tensor([fin]), [text])
