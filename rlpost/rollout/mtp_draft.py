"""MTP-style draft heads trained with Bebop's end-to-end total-variation loss, and the hf verify loop that uses them.

Bebop ("Breaking Entropy Bounds: Accelerating RL Training via MTP with Rejection Sampling", Li,
Jiang, Xu et al., arXiv:2606.12370) speeds RL rollouts up with multi-token-prediction (MTP) heads
as speculative drafters, verified by probabilistic rejection sampling. Under rejection sampling
(accept draft ``x ~ q`` with ``min(1, p(x)/q(x))``) the chance that one draft token is accepted is
``sum_v min(p(v), q(v)) = 1 - TV(p, q)``; the chance that the first ``k`` drafts of a round are all
accepted is the product of those terms along the drafted path. Bebop trains the MTP heads on that
multi-step acceptance directly (the "end-to-end TV loss") rather than on cross-entropy or KL.

What is here:

* :func:`tv_acceptance` / :func:`multi_step_acceptance`: the per-step acceptance ``1 - TV`` and
  its running product over the draft depth.
* :func:`e2e_tv_loss`: ``1 - (1/K) sum_k prod_{j<=k} (1 - TV_j)``, one minus the expected number of
  accepted draft tokens per round divided by the depth ``K`` (our normalisation; the paper's exact
  weighting of the depths and its fused kernel were not available to us, so this is our reading of
  "directly optimises the multi-step rejection-sampling acceptance rate"). Gradients flow through
  every factor: a head that is wrong at depth 1 is also pushed by the depths after it.
* :class:`MTPDraftHead`: a DeepSeek-V3-style MTP module ("DeepSeek-V3 Technical Report",
  arXiv:2412.19437, section 2.2) kept small: ``h' = h + MLP(W [norm(h_t); norm(E x_{t+1})])``,
  logits through the policy's own (frozen) output head; from the policy's last hidden state at
  position ``t`` and the embedding of token ``t+1`` it predicts token ``t+2``. Depth ``k > 1``
  chains the head on its own output hidden state (the way vLLM reuses one MTP layer for several
  speculative tokens). The block (one residual MLP, no attention) is our choice for a CPU-sized
  test; the paper's heads are full transformer layers.
* :func:`train_mtp_head`: fits a head to a policy on given token sequences with :func:`e2e_tv_loss`
  (or cross-entropy to the policy's next-next token, for comparison); the policy is frozen.
* :class:`MTPSpeculativeEngine`: the hf self-speculative verify loop of
  :mod:`rlpost.rollout.self_spec` with the head as drafter (``rollout.speculative.drafter=mtp_head``
  is not a config option: a head must be trained for the policy first; tests and benchmarks build
  the engine directly).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from rlpost.rollout.base import SamplingParams
from rlpost.rollout.self_spec import SelfSpeculativeEngine, _crop_to, next_draft_len, speculative_accept


def tv_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Single-step rejection-sampling acceptance ``sum_v min(p, q) = 1 - TV(p, q)``.

    Args:
        p: target probabilities ``[..., V]`` (rows sum to 1).
        q: draft probabilities ``[..., V]``.
    Returns:
        ``[...]`` acceptance probabilities in ``[0, 1]``.
    Raises:
        ValueError: shapes differ.
    """
    if p.shape != q.shape:
        raise ValueError(f"p {tuple(p.shape)} and q {tuple(q.shape)} must have the same shape")
    return torch.minimum(p, q).sum(-1)


def multi_step_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Probability that the first ``k`` drafts of a round are all accepted, for every ``k``.

    Args:
        p, q: target / draft probabilities ``[..., K, V]`` at draft depths ``1..K`` along one path.
    Returns:
        ``[..., K]``: ``prod_{j<=k} (1 - TV(p_j, q_j))`` (Bebop, arXiv:2606.12370).
    """
    return torch.cumprod(tv_acceptance(p, q), dim=-1)


def e2e_tv_loss(p: torch.Tensor, q: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bebop's end-to-end TV loss (our normalisation): ``1 - mean_k prod_{j<=k} (1 - TV_j)``.

    Args:
        p: target probabilities ``[N, K, V]`` (detached by the caller: the policy is not trained).
        q: draft-head probabilities ``[N, K, V]`` (carry the gradient).
        mask: ``[N]`` 1 for positions that count (None: all).
    Returns:
        Scalar loss in ``[0, 1]``: one minus the expected accepted draft tokens per round over
        ``K``, averaged over counted positions.
    Raises:
        ValueError: ``p``/``q`` not 3-D or of different shapes, or a mask of the wrong length.
    """
    if p.dim() != 3 or p.shape != q.shape:
        raise ValueError(f"p and q must both be [N, K, V], got {tuple(p.shape)} and {tuple(q.shape)}")
    per = 1.0 - multi_step_acceptance(p, q).mean(-1)  # [N]
    if mask is None:
        return per.mean()
    if mask.shape != per.shape:
        raise ValueError(f"mask must be [N]={tuple(per.shape)}, got {tuple(mask.shape)}")
    m = mask.to(per.dtype)
    return (per * m).sum() / m.sum().clamp(min=1.0)


class _RMSNorm(torch.nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class MTPDraftHead(torch.nn.Module):
    """One MTP module on a frozen policy: ``(h_t, x_{t+1}) -> (h'_{t+1}, logits for x_{t+2})``.

    Args:
        policy: a Hugging Face causal LM; its input embedding and output head are used (frozen,
            not copied: they stay the policy's after a weight sync).
        hidden: width of the block's MLP (default: 2 x the model width).
    Shapes: ``h`` ``[..., D]``, ``tok`` ``[...]`` (long) -> ``h'`` ``[..., D]``, logits ``[..., V]``.
    """

    def __init__(self, policy: torch.nn.Module, hidden: Optional[int] = None) -> None:
        super().__init__()
        d = int(policy.config.hidden_size)
        self._policy = [policy]  # not a submodule: its weights are neither trained nor saved here
        self.norm_h, self.norm_e = _RMSNorm(d), _RMSNorm(d)
        self.proj = torch.nn.Linear(2 * d, d, bias=False)
        hd = int(hidden or 2 * d)
        self.up, self.down = torch.nn.Linear(d, hd), torch.nn.Linear(hd, d)
        self.out_norm = _RMSNorm(d)
        with torch.no_grad():  # start as "h' = h": depth 1 begins from the policy's own next-token guess
            self.proj.weight.zero_()
            self.proj.weight[:, :d] = torch.eye(d)
            self.down.weight.mul_(0.1)

    @property
    def policy(self) -> torch.nn.Module:
        return self._policy[0]

    def forward(self, h: torch.Tensor, tok: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """One MTP step (see the class docstring)."""
        e = self.policy.get_input_embeddings()(tok).to(h.dtype)
        z = self.proj(torch.cat([self.norm_h(h), self.norm_e(e)], -1))
        z = z + self.down(F.silu(self.up(z)))
        final_norm = getattr(getattr(self.policy, "model", None), "norm", None)
        hz = final_norm(z) if final_norm is not None else self.out_norm(z)
        return z, self.policy.get_output_embeddings()(hz)

    def chain(self, h: torch.Tensor, toks: torch.Tensor) -> torch.Tensor:
        """Logits of depths ``1..K``: ``h`` ``[N, D]``, ``toks`` ``[N, K]`` (the tokens fed at each depth) -> ``[N, K, V]``."""
        out = []
        for k in range(toks.shape[1]):
            h, lg = self(h, toks[:, k])
            out.append(lg)
        return torch.stack(out, 1)


def mtp_training_pairs(policy: torch.nn.Module, ids: torch.Tensor, depth: int,
                       temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs and targets for training a head on sequences ``ids`` ``[B, T]`` (no padding).

    For every start ``t`` with ``t + depth + 1 <= T - 1``: the policy's last hidden state at ``t``
    (``[N, D]``), the tokens ``x_{t+1..t+depth}`` fed to the chained head (``[N, depth]``), and the
    policy's sampling distributions for ``x_{t+2..t+depth+1}`` (``[N, depth, V]``, at
    ``temperature``). The sequences should be the policy's own samples (teacher forcing on the
    drafted path as rejection sampling would see it when every draft is accepted).

    Raises:
        ValueError: sequences too short for ``depth``.
    """
    B, T = ids.shape
    n_start = T - depth - 1
    if n_start < 1:
        raise ValueError(f"sequences of {T} tokens are too short for depth {depth}")
    with torch.no_grad():
        o = policy(input_ids=ids, output_hidden_states=True)
        h = o.hidden_states[-1]  # [B, T, D]: the last hidden state (after the final norm in HF Llama/Qwen)
        p = torch.softmax(o.logits.float() / temperature, -1)  # [B, T, V]
    hs, toks, ps = [], [], []
    for t in range(n_start):
        hs.append(h[:, t])
        toks.append(ids[:, t + 1 : t + 1 + depth])
        ps.append(p[:, t + 1 : t + 1 + depth])
    return torch.cat(hs), torch.cat(toks), torch.cat(ps)


def train_mtp_head(head: MTPDraftHead, h: torch.Tensor, toks: torch.Tensor, p: torch.Tensor, steps: int = 200,
                   lr: float = 3e-3, loss: str = "tv", temperature: float = 1.0) -> List[float]:
    """Fit ``head`` (the policy frozen) on pairs from :func:`mtp_training_pairs`.

    Args:
        loss: ``"tv"`` (:func:`e2e_tv_loss`) or ``"ce"`` (cross-entropy of the head's distribution to
            the policy's, summed over depths: the conventional MTP objective Bebop compares with).
    Returns:
        The loss after each Adam step (floats).
    Raises:
        ValueError: an unknown ``loss``.
    """
    if loss not in ("tv", "ce"):
        raise ValueError(f"loss must be 'tv' or 'ce', got {loss!r}")
    opt = torch.optim.Adam([q for q in head.parameters() if q.requires_grad], lr=lr)
    hist = []
    for _ in range(steps):
        logq = torch.log_softmax(head.chain(h, toks).float() / temperature, -1)
        if loss == "tv":
            val = e2e_tv_loss(p, logq.exp())
        else:
            val = -(p * logq).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        val.backward()
        opt.step()
        hist.append(float(val.detach()))
    return hist


class MTPSpeculativeEngine(SelfSpeculativeEngine):
    """The hf self-speculative verify loop with an :class:`MTPDraftHead` as the drafter.

    Every draft round: the head drafts ``gamma`` tokens from the policy's hidden state at the
    position that produced the row's last token (chained on its own hidden state), the policy
    scores them in one forward (with ``output_hidden_states``), and :func:`speculative_accept`
    keeps the accepted prefix plus one residual / bonus token; the next round starts from the
    verify forward's hidden state at the last emitted position, so drafting costs no extra policy
    forward. Exact for any head (speculative sampling); the head only changes how many drafts are
    accepted. Phases, toggle, draft-length adaptation and counters as in
    :class:`~rlpost.rollout.self_spec.SelfSpeculativeEngine` (``draft_forwards`` counts head steps).

    Args:
        target: the plain hf engine of the policy.
        head: a head trained for this policy (its embedding and output head are the policy's).
        switch_batch, draft_len, min_draft_len, max_draft_len, adaptive: see the parent class.
    """

    def __init__(self, target: Any, head: MTPDraftHead, **kw: Any) -> None:
        self.head = head.eval()
        super().__init__(target, drafter_convert=None, **kw)

    def _make_drafter(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.head  # the head reads the policy's own embedding / output head; nothing to rebuild

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Refresh the plain engine's copy; the head keeps its weights (trained before RL, as in Bebop)."""
        self.target.sync_weights(policy)

    def _fwd_h(self, toks: List[int], cache: Any) -> Tuple[torch.Tensor, torch.Tensor, Any]:
        from rlpost.rollout.hf import _CACHE_KW, _get_cache

        x = torch.tensor([toks], dtype=torch.long, device=self.device)
        o = self.model(input_ids=x, use_cache=True, output_hidden_states=True, **{_CACHE_KW: cache})
        return o.logits[0].cpu(), o.hidden_states[-1][0], _get_cache(o)

    def _speculate_row(self, prompt: List[int], ids: List[int], lps: List[float], params: SamplingParams,
                       gen: torch.Generator, Tn: int) -> bool:
        from transformers.cache_utils import DynamicCache

        if ids and ids[-1] in self.eos_ids:
            return True
        seq = list(prompt) + list(ids)
        tc = DynamicCache(config=self.model.config)
        h_last: Optional[torch.Tensor] = None  # policy hidden state at the position that produced seq[-1]
        if len(seq) > 1:
            _, hs, tc = self._fwd_h(seq[:-1], tc)
            self._m["target_forwards"] += 1
            h_last = hs[-1]
        while len(ids) < Tn:
            gamma = max(1, min(self.draft_len, Tn - len(ids)))
            draft: List[int] = []
            qs: List[torch.Tensor] = []
            if h_last is not None:  # a 1-token prompt has no hidden state yet: the first round only verifies
                h, tok = h_last[None], torch.tensor([seq[-1]], device=self.device)
                for _ in range(gamma):
                    h, lg = self.head(h, tok)
                    self._m["draft_forwards"] += 1
                    q = self._dist(lg[0].cpu(), params)
                    t = self._draw(q, gen)
                    draft.append(t)
                    qs.append(q)
                    if t in self.eos_ids:
                        break
                    tok = torch.tensor([t], device=self.device)
            g = len(draft)
            plog, hs, tc = self._fwd_h([seq[-1]] + draft, tc)
            self._m["target_forwards"] += 1
            p = self._dist(plog, params)
            n_acc, nxt = speculative_accept(p, qs, draft, gen, self._draw)
            self._m["draft_tokens"] += g
            self._m["accepted_tokens"] += n_acc
            if self.adaptive and g:
                self.draft_len = next_draft_len(self.draft_len, n_acc, g, self.min_draft_len, self.max_draft_len)
            new = draft[:n_acc] + [nxt]
            for k, tok in enumerate(new):
                ids.append(tok)
                lps.append(math.log(max(float(p[k, tok]), 1e-45)))
                self._m["spec_tokens"] += 1
                if self._ends(tok, ids, params):
                    return True
                if len(ids) >= Tn:
                    return False
            base = len(seq)
            seq.extend(new)
            _crop_to(tc, base + n_acc)  # the policy cache keeps seq[:-1]
            h_last = hs[n_acc]  # the verify position whose output drew seq[-1]
        return False


def acceptance_of_head(head: MTPDraftHead, h: torch.Tensor, toks: torch.Tensor, p: torch.Tensor,
                       temperature: float = 1.0) -> Dict[str, float]:
    """Mean ``1 - TV`` at each depth and the expected accepted drafts per round of ``K`` (no gradient).

    Returns:
        ``{"accept_d1": ..., "accept_dK": ..., "expected_accepted": sum_k mean prod_{j<=k}(1 - TV_j)}``.
    """
    with torch.no_grad():
        q = torch.softmax(head.chain(h, toks).float() / temperature, -1)
        a = tv_acceptance(p, q).mean(0)
        m = multi_step_acceptance(p, q).mean(0)
    out = {f"accept_d{k + 1}": float(a[k]) for k in range(a.shape[0])}
    out["expected_accepted"] = float(m.sum())
    return out
