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
  :mod:`rlpost.rollout.self_spec` with the head as drafter.
* ``rollout=hf_mtp`` (``rollout.speculative.drafter=mtp_head``; :func:`mtp_engine`, called by
  :func:`rlpost.rollout.build_engine`): the way Bebop uses its heads. The head is fitted ONCE,
  before RL, then kept fixed (no online updates; only the policy's own embedding and output
  head, which it reads, follow the training): :func:`fit_mtp_head` samples one response per
  prompt from the plain engine for ``mtp_head_prompts`` training prompts of the run's task
  (:func:`rlpost.tasks.base.task_prompts`, a seeded draw), builds pairs from the positions a rollout drafts from,
  trains with ``mtp_head_loss`` (``tv`` by default), logs the head's acceptance once and saves it
  to ``<run_dir>/mtp_head.pt`` (:func:`save_mtp_head`), which a resumed run reuses;
  ``mtp_head_path`` loads a saved head instead (:func:`load_mtp_head` checks it fits the
  policy's width and vocabulary). The drafts are verified by rejection sampling, so the rollouts
  stay exact samples of the current policy; only the acceptance rate falls as the policy drifts
  from the one the head was fitted to. Choices ours: one response per prompt, full-batch Adam,
  top-k / top-p left out of the fit, the fit on the trainer's (fp32) policy while a bf16 rollout
  copy verifies.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from rlpost.core.errors import ConfigError
from rlpost.core.tracking import log
from rlpost.models.logprobs import eval_mode
from rlpost.rollout.base import SamplingParams
from rlpost.rollout.hf import _get_cache, cache_kw
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

    def bound_to(self, policy: torch.nn.Module) -> "MTPDraftHead":
        """A frozen copy of this head reading ``policy``'s embedding / output head, in its dtype and on its device.

        The copy is made without re-initialising anything (no global RNG draw); ``policy`` must
        have this head's width (:func:`load_mtp_head` checks files).
        """
        import copy

        ref, self._policy = self._policy, []  # keep the policy out of the deep copy
        try:
            h = copy.deepcopy(self)
        finally:
            self._policy = ref
        h._policy = [policy]
        w = policy.get_input_embeddings().weight
        dt = w.dtype if w.is_floating_point() else torch.float32
        return h.to(device=w.device, dtype=dt).requires_grad_(False).eval()

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


def mtp_training_pairs(policy: torch.nn.Module, ids: torch.Tensor, depth: int, temperature: float = 1.0,
                       first: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs and targets for training a head on sequences ``ids`` ``[B, T]`` (no padding).

    For every start ``t`` with ``first <= t`` and ``t + depth + 1 <= T - 1`` (pairs ordered by
    ``t``, then row): the policy's last hidden state at ``t``
    (``[N, D]``), the tokens ``x_{t+1..t+depth}`` fed to the chained head (``[N, depth]``), and the
    policy's sampling distributions for ``x_{t+2..t+depth+1}`` (``[N, depth, V]``, at
    ``temperature``). The sequences should be the policy's own samples (teacher forcing on the
    drafted path as rejection sampling would see it when every draft is accepted).

    ``first = len(prompt) - 2`` keeps the starts a rollout drafts from (the first draft round of a
    response starts from the hidden state that produced the prompt's last token).

    Raises:
        ValueError: sequences too short for ``depth`` (no start at or after ``first``).
    """
    B, T = ids.shape
    n_start = T - depth - 1
    if n_start - max(0, first) < 1:
        raise ValueError(f"sequences of {T} tokens are too short for depth {depth} from position {first}")
    with torch.no_grad():
        o = policy(input_ids=ids, output_hidden_states=True)
        h = o.hidden_states[-1]  # [B, T, D]: the last hidden state (after the final norm in HF Llama/Qwen)
        p = torch.softmax(o.logits.float() / temperature, -1)  # [B, T, V]
    hs, toks, ps = [], [], []
    for t in range(max(0, first), n_start):
        hs.append(h[:, t])
        toks.append(ids[:, t + 1 : t + 1 + depth])
        ps.append(p[:, t + 1 : t + 1 + depth])
    return torch.cat(hs), torch.cat(toks), torch.cat(ps)


def train_mtp_head(head: MTPDraftHead, h: torch.Tensor, toks: torch.Tensor, p: torch.Tensor, steps: int = 200,
                   lr: float = 3e-3, loss: str = "tv", temperature: float = 1.0) -> List[float]:
    """Fit ``head`` (the policy frozen) on pairs from :func:`mtp_training_pairs`.

    Full-batch Adam over all pairs; the policy's parameters get no gradient (their
    ``requires_grad`` flags are switched off for the fit and restored after).

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
    # the head reads the policy's embedding, final norm and output head: keep gradients out of them
    # (a trainer's policy would otherwise carry them into its first update); flags restored after
    frozen = [(q, q.requires_grad) for q in head.policy.parameters()]
    for q, _ in frozen:
        q.requires_grad_(False)
    try:
        for _ in range(steps):
            z = head.chain(h, toks).float()
            logq = torch.log_softmax(z if temperature == 1.0 else z / temperature, -1)  # [N, K, V]: skip a pass at T=1
            if loss == "tv":
                val = e2e_tv_loss(p, logq.exp())
            else:
                val = -(p * logq).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            val.backward()
            opt.step()
            hist.append(float(val.detach()))
    finally:
        for q, flag in frozen:
            q.requires_grad_(flag)
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
        #: the head's fit (or file) summary, reported once as ``mtp_head/...`` by :meth:`pop_metrics`
        self.head_info: Dict[str, float] = {}
        super().__init__(target, drafter_convert=None, **kw)

    def _make_drafter(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.head  # the head reads the policy's own embedding / output head; nothing to rebuild

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Refresh the plain engine's copy; the head keeps its weights (trained before RL, as in Bebop).

        When the engine rebuilt its copy (a quantised rollout precision), the head is pointed at the
        new copy's embedding and output head.
        """
        self.target.sync_weights(policy)
        if self.head.policy is not self.target.model:
            self.head._policy = [self.target.model]

    def pop_metrics(self) -> Dict[str, float]:
        """The parent's ``spec/...`` counters, plus the head's ``mtp_head/...`` summary on the first call."""
        out = super().pop_metrics()
        info, self.head_info = self.head_info, {}
        out.update({f"mtp_head/{k}": float(v) for k, v in info.items()})
        return out

    def _fwd_h(self, toks: List[int], cache: Any) -> Tuple[torch.Tensor, torch.Tensor, Any]:

        x = torch.tensor([toks], dtype=torch.long, device=self.device)
        o = self.model(input_ids=x, use_cache=True, output_hidden_states=True, **{cache_kw(): cache})
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


# --------------------------------------------------------------------------- rollout.speculative.drafter=mtp_head
#: the file a run keeps its fitted head in (``<run_dir>/mtp_head.pt``)
HEAD_FILE = "mtp_head.pt"


def save_mtp_head(path: Any, head: MTPDraftHead, meta: Optional[Dict[str, Any]] = None) -> Path:
    """Write ``head``'s weights and the shape of the policy it reads to ``path`` (atomically).

    The file is a ``torch.save`` dict: ``state_dict`` (the head's own parameters, fp32, on the CPU:
    the policy's embedding and output head are not in it), ``hidden_size`` and ``vocab_size`` of
    the policy, ``mlp_hidden`` (the head's MLP width), and ``meta`` (how it was fitted).

    Returns:
        the path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().float().cpu() for k, v in head.state_dict().items()}
    obj = {"format": "rlpost.mtp_head/1", "state_dict": sd, "hidden_size": int(head.policy.config.hidden_size),
           "vocab_size": int(head.policy.get_output_embeddings().weight.shape[0]),
           "mlp_hidden": int(head.up.out_features), "meta": dict(meta or {})}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # another rank reading the path sees no half-written file
    return path


def load_mtp_head(path: Any, policy: torch.nn.Module) -> Tuple[MTPDraftHead, Dict[str, Any]]:
    """The head saved at ``path`` (by :func:`save_mtp_head`, or a bare ``state_dict``), bound to ``policy``.

    Returns:
        ``(head, meta)``: the head in fp32 on the CPU reading ``policy``, and the file's ``meta``.
    Raises:
        ConfigError: no such file, not a head file, or a head of another width / vocabulary than
            ``policy`` (a head fits one model).
    """

    key = "rollout.speculative.mtp_head_path"
    fix = f"Fix: point {key} at a head saved for this model, or set it to null to fit one at start"
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{key}={str(path)!r}: no such file. {fix}")
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same config problem
        raise ConfigError(f"{key}={str(path)!r} is not a saved MTP head ({type(e).__name__}: {e}). {fix}") from None
    sd = obj.get("state_dict", obj) if isinstance(obj, dict) else None
    if not isinstance(sd, dict) or not all(k in sd for k in ("proj.weight", "up.weight")):
        raise ConfigError(f"{key}={str(path)!r} holds no MTP head weights (proj.weight, up.weight). {fix}")
    D = int(policy.config.hidden_size)
    V = int(policy.get_output_embeddings().weight.shape[0])
    d_file = int(sd["proj.weight"].shape[0])
    v_file = int(obj.get("vocab_size", V))
    if d_file != D or v_file != V:
        raise ConfigError(f"{key}={str(path)!r} is a head for a model of width {d_file} and vocabulary {v_file}; "
                          f"this policy has width {D} and vocabulary {V}. {fix}")
    head = MTPDraftHead(policy, hidden=int(sd["up.weight"].shape[0]))
    try:
        head.load_state_dict(sd)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise ConfigError(f"{key}={str(path)!r} does not fit this policy's head shapes "
                          f"({first[-1].strip() if first else e}). {fix}") from None
    return head, dict(obj.get("meta", {}) if isinstance(obj, dict) else {})


def fit_mtp_head(policy: torch.nn.Module, engine: Any, prompts: List[List[int]], params: SamplingParams,
                 depth: int = 2, steps: int = 100, lr: float = 3e-3, loss: str = "tv",
                 seed: int = 0) -> Tuple[MTPDraftHead, Dict[str, float]]:
    """Bebop's pre-RL head fit: sample the policy's own responses, then train a head on them.

    One response per prompt from ``engine`` (the plain engine, ``params`` seeded); each
    prompt + response (no padding) gives pairs from the positions a rollout drafts from
    (:func:`mtp_training_pairs` with ``first = len(prompt) - 2``); the head (initialised under
    ``torch.manual_seed(seed)``, the caller's global RNG untouched) is fitted full-batch with
    :func:`train_mtp_head`. ``params.temperature`` is the temperature of both distributions;
    top-k / top-p are not applied in the fit (our choice: the loss sees whole distributions).

    Args:
        policy: the policy to fit to (frozen; e.g. the trainer's fp32 module).
        engine: a rollout engine of that policy (draws the responses).
        prompts: token-id prompts (the task's training prompts).
        depth, steps, lr, loss: see :func:`train_mtp_head` (``depth`` = K of the loss).
    Returns:
        ``(head, info)``: the fitted head (fp32, on the policy's device) and floats: ``responses``,
        ``positions`` (pairs fitted on), ``steps``, ``fit_s`` (seconds, sampling included),
        ``loss_first`` / ``loss_last``, ``expected_accepted_untrained`` and, after the fit,
        ``accept_d1..K`` and ``expected_accepted`` (:func:`acceptance_of_head` on the fitted
        pairs: in-sample, an upper guide; the run's ``spec/accept_rate`` is the real figure).
    Raises:
        ValueError: no response long enough for ``depth`` (raise the prompt count or the
            response length, or lower the depth).
    """

    t0 = time.perf_counter()
    gen = engine.generate(prompts, params)
    dev = next(policy.parameters()).device
    hs, ts, ps, used = [], [], [], 0
    with eval_mode(policy):
        for b, prompt in enumerate(prompts):
            resp = gen.response_ids[b][gen.response_mask[b] > 0].tolist()
            ids = torch.tensor([list(prompt) + resp], dtype=torch.long, device=dev)
            first = max(0, len(prompt) - 2)
            if ids.shape[1] - depth - 1 - first < 1:
                continue
            h, t, p = mtp_training_pairs(policy, ids, depth, temperature=float(params.temperature), first=first)
            hs.append(h.float())
            ts.append(t)
            ps.append(p)
            used += 1
    if not used:
        raise ValueError(f"none of the policy's {len(prompts)} sampled responses is long enough to fit a depth-{depth} "
                         f"head; sample more prompts or longer responses, or lower the depth")
    h, t, p = torch.cat(hs), torch.cat(ts), torch.cat(ps)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        head = MTPDraftHead(policy).to(dev)
    before = acceptance_of_head(head, h, t, p, temperature=float(params.temperature))
    hist = train_mtp_head(head, h, t, p, steps=int(steps), lr=float(lr), loss=loss,
                          temperature=float(params.temperature))
    after = acceptance_of_head(head, h, t, p, temperature=float(params.temperature))
    info = {"responses": float(used), "positions": float(h.shape[0]), "steps": float(steps),
            "fit_s": time.perf_counter() - t0, "loss_first": hist[0] if hist else float("nan"),
            "loss_last": hist[-1] if hist else float("nan"),
            "expected_accepted_untrained": before["expected_accepted"], **after}
    return head.eval(), info


def _same_setting(a: Any, b: Any) -> bool:
    """Whether two setting values agree (numbers by value: a file's 50.0 steps equal a config's 50)."""
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)


def mtp_engine(ec: Any, engine: Any, c: Dict[str, Any], policy: Optional[torch.nn.Module] = None,
               run_dir: Any = None, prompts: Optional[Callable[[int], List[List[int]]]] = None) -> MTPSpeculativeEngine:
    """``rollout.speculative.drafter=mtp_head``: an :class:`MTPSpeculativeEngine` with a head fitted once before RL.

    Bebop (arXiv:2606.12370) trains the MTP heads once, before RL, and keeps them fixed while the
    policy trains; the drafts are verified by rejection sampling, so rollouts stay exact samples of
    the current policy and only the acceptance rate falls as the policy drifts. The head comes from,
    in order: ``mtp_head_path``; ``<run_dir>/mtp_head.pt`` (a resumed run, or a rerun in the same
    directory); a fit by :func:`fit_mtp_head` on ``mtp_head_prompts`` training prompts (one
    response each at the run's rollout settings, seeded by ``ec.seed``), saved to
    ``<run_dir>/mtp_head.pt`` by the main process (a reused run-directory head whose file records
    other ``mtp_head_*`` settings than ``c`` is reused all the same, and the differences are
    logged: a resume must not refit). The head's summary is logged once and reported
    by the engine's first :meth:`~MTPSpeculativeEngine.pop_metrics` as ``mtp_head/...``.

    Args:
        ec: the engine's config sections (:class:`rlpost.rollout.base.EngineConfig`: ``rollout.*``
            sampling settings, ``seed``, ``model.name``).
        engine: the plain hf engine (verifies; samples the fit's responses).
        c: checked ``rollout.speculative`` (:func:`rlpost.rollout.self_spec.spec_config`).
        policy: the policy the head is fitted to / checked against (None: ``engine.model``).
        run_dir: where ``mtp_head.pt`` is reused from and saved to (None: nowhere).
        prompts: ``fn(n)`` -> ``n`` training prompts (:func:`rlpost.tasks.base.task_prompts`); None: the head must
            come from a file.
    Raises:
        ConfigError: no head file and no prompts to fit one; a head file that cannot be read or
            does not fit the policy (:func:`load_mtp_head`); responses too short for the depth.
    """

    policy = engine.model if policy is None else policy
    own = Path(run_dir) / HEAD_FILE if run_dir is not None else None
    meta: Dict[str, Any]
    if c["mtp_head_path"] is not None or (own is not None and own.is_file()):
        src = Path(c["mtp_head_path"]) if c["mtp_head_path"] is not None else own
        head, meta = load_mtp_head(src, policy)
        info = {k: float(v) for k, v in meta.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        log.info(f"rollout.speculative.drafter=mtp_head: loaded the head {src} (fitted with loss="
                 f"{meta.get('loss', '?')}, depth {meta.get('depth', '?')}; expected accepted drafts per round on "
                 f"its fit positions {meta.get('expected_accepted', float('nan')):.3f}); kept fixed during RL")
        if c["mtp_head_path"] is None:  # the run directory's own head: say when this config would fit another
            differ = [f"mtp_head_{k}={c[f'mtp_head_{k}']!r} (file: {meta[k]!r})" for k in ("loss", "depth", "steps", "prompts")
                      if k in meta and not _same_setting(meta[k], c[f"mtp_head_{k}"])]
            if differ:
                log.info(f"  (reused, not refitted, although rollout.speculative sets {', '.join(differ)}; delete "
                         f"{src} to fit a new head)")
    else:
        if prompts is None:
            raise ConfigError("rollout.speculative.drafter=mtp_head has no head and nothing to fit one on here (no "
                              "training prompts). Fix: set rollout.speculative.mtp_head_path to a saved head "
                              f"(a training run writes <run_dir>/{HEAD_FILE})")
        r = ec.rollout
        params = SamplingParams(max_new_tokens=int(r.max_new_tokens), temperature=float(r.temperature),
                                top_p=float(r.get("top_p", 1.0)), top_k=int(r.get("top_k", 0)),
                                stop=list(r.get("stop", []) or []), seed=int(ec.seed))
        try:
            head, info = fit_mtp_head(policy, engine, prompts(int(c["mtp_head_prompts"])), params,
                                      depth=c["mtp_head_depth"], steps=c["mtp_head_steps"], lr=c["mtp_head_lr"],
                                      loss=c["mtp_head_loss"], seed=int(ec.seed))
        except ValueError as e:
            raise ConfigError(f"rollout.speculative.drafter=mtp_head: {e} (rollout.speculative.mtp_head_prompts, "
                              f"rollout.max_new_tokens, rollout.speculative.mtp_head_depth)") from None
        meta = {**info, "loss": c["mtp_head_loss"], "depth": c["mtp_head_depth"], "lr": c["mtp_head_lr"],
                "prompts": c["mtp_head_prompts"],
                "model": str(ec.model.get("name", "")) if hasattr(ec.model, "get") else ""}
        where = ""
        if own is not None and int(os.environ.get("RANK", "0")) == 0:
            save_mtp_head(own, head, meta)
            where = f"; saved {own} (reuse: rollout.speculative.mtp_head_path={own})"
        K = c["mtp_head_depth"]
        log.info(f"rollout.speculative.drafter=mtp_head: fitted a depth-{K} head ({c['mtp_head_loss']} loss, "
                 f"{c['mtp_head_steps']} steps, {int(info['positions'])} positions of {int(info['responses'])} sampled "
                 f"responses, {info['fit_s']:.1f} s): 1-TV by depth "
                 + " ".join(f"{info[f'accept_d{k + 1}']:.3f}" for k in range(K))
                 + f", expected accepted drafts per {K}-draft round {info['expected_accepted']:.3f} (untrained "
                 f"{info['expected_accepted_untrained']:.3f}; on its fit positions){where}")
    eng = MTPSpeculativeEngine(engine, head.bound_to(engine.model), switch_batch=c["switch_batch"],
                               draft_len=c["draft_len"], min_draft_len=c["min_draft_len"],
                               max_draft_len=c["max_draft_len"], adaptive=c["adaptive"])
    eng.head_info = info
    return eng
