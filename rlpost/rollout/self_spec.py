"""Self-speculative decoding for rollouts: a quantised copy of the policy drafts, the policy verifies.

EfficientRollout ("EfficientRollout: System-Aware Self-Speculative Decoding for RL Rollouts",
Kim, Lee, Oh et al., arXiv:2606.18967) accelerates the rollout phase with three parts, all here:

* **Self-drafter.** The drafter is the current policy converted to low precision (any of the
  simulated rollout copies of :mod:`rlpost.rollout.precision`: ``int8``, ``fp8_sim``, ``fp4_sim``,
  HiF4...), rebuilt from the trainer's weights at every :meth:`sync_weights`, so it follows the
  evolving policy with no drafter training.
* **System-aware toggle.** Speculation pays only when decoding is memory-bound: when few rows are
  still running (the long-tail rows of a rollout batch). A batch decodes autoregressively while
  more than ``switch_batch`` rows are live and switches to speculation for the rest.
* **Acceptance-aware draft length** (:func:`next_draft_len`).

``drafter: mtp_head`` (``rollout=hf_mtp``) swaps the quantised copy for a Bebop MTP draft head
fitted once before RL (:mod:`rlpost.rollout.mtp_draft`; the same toggle, draft-length rule and
acceptance step); its ``mtp_head_*`` keys live in :data:`SPEC_DEFAULTS` with the others.

Exactness. Every emitted token is distributed as the policy's own next-token distribution
(after temperature, top-k and top-p): drafts are accepted with probability ``min(1, p/q)`` and
the first rejection is replaced by a draw from the normalised residual ``max(0, p - q)``; a fully
accepted draft gets a bonus token from ``p`` (speculative sampling, "Fast Inference from
Transformers via Speculative Decoding", arXiv:2211.17192; "Accelerating Large Language Model
Decoding with Speculative Sampling", arXiv:2302.01318). ``tests/test_method_self_spec.py`` checks whole
responses of a tiny model with a chi-square test. The reported rollout log-probs are the policy's
(``log p``), as the plain engine reports them.

Choices the paper leaves open (or that we could not read), all ours: the toggle is a row-count
threshold (``switch_batch``, default 4) rather than a measured roofline; the speculative phase
runs each remaining row on its own (batch of one, its own KV caches for policy and drafter, which
are cropped back after a rejection), since the phase only runs for a handful of rows; at the switch
each remaining row's prefix is prefilled once more into its own caches; the draft length follows
transformers' assisted-generation heuristic (+2 after a fully accepted draft, -1 otherwise,
within ``[min_draft_len, max_draft_len]``), one length per engine carried across calls. Greedy
calls (evaluation) decode autoregressively. Randomness: row ``i`` of a seeded call draws every
uniform from its own generator seeded ``seed + row_offset + i``, so rows do not depend on each
other, but the tokens differ from the plain engine's at the same seed (only the distribution is
the same).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch

from rlpost.core.errors import ConfigError
from rlpost.models.logprobs import eval_mode
from rlpost.models.lora import is_lora, merged_model
from rlpost.models.sampling import apply_top_k_top_p
from rlpost.rollout.base import GenerationResult, RolloutEngine, SamplingParams, concat_generations
from rlpost.rollout.hf import _get_cache, cache_kw, left_pad, sample_inverse_cdf
from rlpost.rollout.precision import ROLLOUT_CONVERTERS

#: keys of ``rollout.speculative`` and their defaults (one owner: this module)
SPEC_DEFAULTS: Dict[str, Any] = {
    "drafter": "int8",
    "switch_batch": 4,
    "draft_len": 4,
    "min_draft_len": 1,
    "max_draft_len": 8,
    "adaptive": True,
    # drafter=mtp_head only (Bebop, arXiv:2606.12370; rlpost.rollout.mtp_draft): the head is fitted once
    # before RL and then kept fixed
    "mtp_head_path": None,  # a saved head (torch file); null: reuse <run_dir>/mtp_head.pt, else fit one at start
    "mtp_head_loss": "tv",  # tv: Bebop's end-to-end TV loss; ce: cross-entropy to the policy (comparison)
    "mtp_head_depth": 2,  # draft depths the fit chains the head over
    "mtp_head_steps": 50,  # full-batch Adam steps of the fit (each a pass over [positions, depth, vocab] logits)
    "mtp_head_lr": 3e-3,
    "mtp_head_prompts": 8,  # training prompts (one sampled response each) the fit learns the policy on
}

#: the drafter that is a trained MTP head rather than a quantised copy of the policy
MTP_DRAFTER = "mtp_head"
#: keys of ``rollout.speculative`` that only ``drafter=mtp_head`` reads
MTP_KEYS = tuple(k for k in SPEC_DEFAULTS if k.startswith("mtp_head_"))
MTP_LOSSES = ("tv", "ce")


def next_draft_len(cur: int, accepted: int, drafted: int, lo: int, hi: int) -> int:
    """The draft length of the next speculation round from this round's outcome.

    transformers' assisted-generation heuristic (our choice; the paper adapts the length to the
    measured acceptance rate without a formula we could read): ``cur + 2`` when all ``drafted``
    tokens were accepted, ``cur - 1`` otherwise, clipped to ``[lo, hi]``.

    Args:
        cur: this round's draft length (tokens).
        accepted: draft tokens accepted this round (``0 <= accepted <= drafted``).
        drafted: draft tokens proposed this round (may be < ``cur`` when the draft hit EOS or
            the length limit).
    Returns:
        The next length (int in ``[lo, hi]``).
    Raises:
        ValueError: ``lo < 1``, ``hi < lo`` or ``accepted`` outside ``[0, drafted]``.
    """
    if lo < 1 or hi < lo:
        raise ValueError(f"draft length bounds must satisfy 1 <= min <= max, got [{lo}, {hi}]")
    if not 0 <= accepted <= drafted:
        raise ValueError(f"accepted={accepted} must lie in [0, drafted={drafted}]")
    nxt = cur + 2 if accepted == drafted and drafted > 0 else cur - 1
    return int(min(hi, max(lo, nxt)))


def spec_config(params: Any) -> Dict[str, Any]:
    """``rollout.speculative`` checked and completed with :data:`SPEC_DEFAULTS`.

    ``drafter`` is a simulated rollout precision (a quantised copy of the policy drafts) or
    ``mtp_head`` (a Bebop MTP draft head, :mod:`rlpost.rollout.mtp_draft`, configured by the
    ``mtp_head_*`` keys).

    Raises:
        ConfigError: an unknown key, ``switch_batch < 0``, bad draft-length bounds, an unknown
            drafter, an ``mtp_head_*`` key with another drafter, or a bad ``mtp_head_*`` value
            (loss not tv|ce, depth/prompts < 1, steps < 0, lr <= 0).
    """

    given = dict(params or {})
    bad = sorted(set(given) - set(SPEC_DEFAULTS))
    if bad:
        raise ConfigError(f"rollout.speculative has unknown key(s) {bad}; valid: {', '.join(SPEC_DEFAULTS)}")
    c = {**SPEC_DEFAULTS, **given}
    c["drafter"] = str(c["drafter"])
    if c["drafter"] != MTP_DRAFTER and c["drafter"] not in ROLLOUT_CONVERTERS:
        raise ConfigError(f"rollout.speculative.drafter={c['drafter']!r} is neither a simulated rollout precision nor "
                          f"{MTP_DRAFTER}; valid: {', '.join(ROLLOUT_CONVERTERS)}, {MTP_DRAFTER}")
    if c["drafter"] == MTP_DRAFTER:
        _check_mtp_keys(c)
    else:
        stray = sorted(k for k in given if k in MTP_KEYS)
        if stray:
            raise ConfigError(f"rollout.speculative {stray} only apply to drafter={MTP_DRAFTER}, but drafter="
                              f"{c['drafter']!r}. Fix: drop them, or set rollout.speculative.drafter={MTP_DRAFTER} "
                              f"(rollout=hf_mtp)")
    for k in ("switch_batch", "draft_len", "min_draft_len", "max_draft_len"):
        c[k] = int(c[k])
    if c["switch_batch"] < 0:
        raise ConfigError(f"rollout.speculative.switch_batch must be >= 0 (0: never speculate), got {c['switch_batch']}")
    if not 1 <= c["min_draft_len"] <= c["draft_len"] <= c["max_draft_len"]:
        raise ConfigError("rollout.speculative needs 1 <= min_draft_len <= draft_len <= max_draft_len, got "
                          f"{c['min_draft_len']}, {c['draft_len']}, {c['max_draft_len']}")
    c["adaptive"] = bool(c["adaptive"])
    return c


def _check_mtp_keys(c: Dict[str, Any]) -> None:
    """Check and normalise the ``mtp_head_*`` values of ``c`` in place (see :func:`spec_config`)."""
    p = c["mtp_head_path"]
    c["mtp_head_path"] = None if p is None or str(p).strip() in ("", "null", "none", "None") else str(p)
    c["mtp_head_loss"] = str(c["mtp_head_loss"])
    if c["mtp_head_loss"] not in MTP_LOSSES:
        raise ConfigError(f"rollout.speculative.mtp_head_loss={c['mtp_head_loss']!r} is not a head loss; valid: "
                          f"tv (Bebop's end-to-end TV loss), ce (cross-entropy)")
    for k, lo in (("mtp_head_depth", 1), ("mtp_head_prompts", 1), ("mtp_head_steps", 0)):
        c[k] = int(c[k])
        if c[k] < lo:
            raise ConfigError(f"rollout.speculative.{k} must be >= {lo}, got {c[k]}")
    c["mtp_head_lr"] = float(c["mtp_head_lr"])
    if not c["mtp_head_lr"] > 0:
        raise ConfigError(f"rollout.speculative.mtp_head_lr must be > 0, got {c['mtp_head_lr']}")


class SelfSpeculativeEngine(RolloutEngine):
    """``rollout.speculative``: the hf engine with a quantised self-drafter (EfficientRollout, arXiv:2606.18967).

    Args:
        target: the plain :class:`rlpost.rollout.hf.HFRolloutEngine` of the policy (its ``model``
            is what verifies; greedy calls go straight to it).
        drafter_convert: ``fn(module) -> module`` that makes the drafter from a copy of the
            policy (:func:`rlpost.rollout.precision.rollout_converter`); rebuilt at every sync.
        switch_batch: speculate once at most this many rows of a batch are still running
            (0: never; >= batch size: from the first token).
        draft_len, min_draft_len, max_draft_len: initial draft length and its bounds.
        adaptive: adapt the draft length (:func:`next_draft_len`); off: fixed ``draft_len``.

    After every :meth:`generate`, :meth:`pop_metrics` returns (and resets) ``spec/...`` counters:
    ``target_forwards`` (policy forward calls, prefill included), ``draft_forwards``,
    ``draft_tokens``, ``accepted_tokens``, ``accept_rate``, ``spec_rows`` (rows that reached the
    speculative phase), ``spec_tokens`` (tokens emitted there), ``draft_len`` (current length).

    Raises:
        ValueError: (from :meth:`generate`) a temperature hook (per-token temperature needs the
            policy's logits before each draw, which speculation does not have), an empty prompt
            list or a non-positive temperature.
    """

    def __init__(self, target: Any, drafter_convert: Any, switch_batch: int = 4, draft_len: int = 4,
                 min_draft_len: int = 1, max_draft_len: int = 8, adaptive: bool = True) -> None:
        self.target = target
        self.drafter_convert = drafter_convert
        self.switch_batch = int(switch_batch)
        self.draft_len = int(draft_len)
        self.min_draft_len, self.max_draft_len = int(min_draft_len), int(max_draft_len)
        self.adaptive = bool(adaptive)
        self.tokenizer = target.tokenizer
        self.pad_id = target.pad_id
        self.eos_ids = target.eos_ids
        self.device = target.device
        self.batch_size = target.batch_size
        self.forward_log = None
        self.drafter = self._make_drafter(target.model)
        self._m = self._zero()

    # ------------------------------------------------------------ plumbing
    @property
    def model(self) -> torch.nn.Module:
        """The policy module that verifies (the plain engine's)."""
        return self.target.model

    @staticmethod
    def _zero() -> Dict[str, float]:
        return {k: 0.0 for k in ("target_forwards", "draft_forwards", "draft_tokens", "accepted_tokens",
                                 "spec_rows", "spec_tokens", "ar_tokens")}

    def _make_drafter(self, model: torch.nn.Module) -> torch.nn.Module:
        import copy

        m = merged_model(model) if is_lora(model) else copy.deepcopy(model)
        m = self.drafter_convert(m.float())
        m.requires_grad_(False)
        return m.eval()

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Refresh the policy copy (plain engine) and rebuild the drafter from the new weights."""
        self.target.sync_weights(policy)
        self.drafter = self._make_drafter(policy)

    def pop_metrics(self) -> Dict[str, float]:
        """``spec/...`` counters since the last call (see the class docstring); resets them."""
        m, self._m = self._m, self._zero()
        out = {f"spec/{k}": float(v) for k, v in m.items()}
        out["spec/accept_rate"] = m["accepted_tokens"] / m["draft_tokens"] if m["draft_tokens"] else 0.0
        out["spec/draft_len"] = float(self.draft_len)
        return out

    def close(self) -> None:  # noqa: D102
        self.target.close()

    # ------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompts: List[List[int]], params: SamplingParams) -> GenerationResult:
        """One response per prompt; see :class:`rlpost.rollout.base.GenerationResult` for shapes."""
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        if params.greedy:
            return self.target.generate(prompts, params)
        if params.temperature <= 0:
            raise ValueError("temperature must be > 0 for sampling (use greedy decoding for argmax)")
        if params.temperature_hook is not None:
            raise ValueError("rollout.speculative cannot sample with a per-token temperature hook "
                             "(sampler=adaptive_temperature); drop one of the two")
        if params.decode_hook is not None:
            raise ValueError("rollout.speculative cannot run a per-step decode hook (sampler=neighbor_mixing): "
                             "draft and target would be fed different inputs; drop one of the two")
        base = None if params.seed is None else int(params.seed) + int(params.row_offset)
        parts = []
        for i in range(0, len(prompts), self.batch_size):
            chunk = prompts[i : i + self.batch_size]
            gens = []
            for j in range(len(chunk)):
                g = torch.Generator()
                if base is None:
                    g.seed()
                else:
                    g.manual_seed((base + i + j) % (1 << 63))
                gens.append(g)
            parts.append(self._generate_batch(chunk, params, gens))
        return concat_generations(parts, self.pad_id)

    def _dist(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """``[..., V]`` logits -> the sampling distribution (temperature, top-k, top-p)."""
        shp = logits.shape
        z = apply_top_k_top_p(logits.float().reshape(-1, shp[-1]) / float(params.temperature), params.top_k, params.top_p)
        return torch.softmax(z, -1).reshape(shp)

    def _draw(self, probs: torch.Tensor, gen: torch.Generator) -> int:
        u = torch.rand(1, generator=gen, dtype=torch.float64)
        return int(sample_inverse_cdf(probs[None], u=u)[0])

    def _ends(self, tok: int, history: List[int], params: SamplingParams) -> bool:
        if tok in self.eos_ids:
            return True
        if params.stop:
            tail = self.tokenizer.decode(history[-16:], skip_special_tokens=True)
            return any(s in tail for s in params.stop)
        return False

    def _generate_batch(self, prompts: List[List[int]], params: SamplingParams,
                        gens: List[torch.Generator]) -> GenerationResult:
        model, B, Tn = self.model, len(prompts), int(params.max_new_tokens)
        out_ids: List[List[int]] = [[] for _ in range(B)]
        out_lp: List[List[float]] = [[] for _ in range(B)]
        finished = [False] * B
        with eval_mode(model):
            live = list(range(B))
            if len(live) > self.switch_batch:  # autoregressive phase: the batch is compute-bound
                ids, mask = left_pad(prompts, self.pad_id)
                ids, mask = ids.to(self.device), mask.to(self.device)
                pos = (mask.cumsum(-1) - 1).clamp(min=0)
                o = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
                self._m["target_forwards"] += 1
                past, logits, next_pos = _get_cache(o), o.logits[:, -1, :].cpu(), pos[:, -1] + 1
                rows = torch.arange(B)
                for t in range(Tn):
                    probs = self._dist(logits, params)
                    toks = torch.zeros(len(rows), dtype=torch.long)
                    done = torch.zeros(len(rows), dtype=torch.bool)
                    for j, r in enumerate(rows.tolist()):
                        tok = self._draw(probs[j], gens[r])
                        toks[j] = tok
                        out_ids[r].append(tok)
                        out_lp[r].append(math.log(max(float(probs[j, tok]), 1e-45)))
                        self._m["ar_tokens"] += 1
                        if self._ends(tok, out_ids[r], params) or len(out_ids[r]) >= Tn:
                            finished[r] = self._ends(tok, out_ids[r], params)
                            done[j] = True
                    keep = torch.nonzero(~done).flatten()
                    rows, toks, next_pos = rows[keep], toks[keep], next_pos[keep.to(next_pos.device)]
                    if len(rows) == 0 or len(rows) <= self.switch_batch:
                        break
                    kd = keep.to(self.device)
                    past.batch_select_indices(kd)
                    mask = torch.cat([mask[kd], torch.ones(len(rows), 1, dtype=mask.dtype, device=self.device)], 1)
                    o = model(input_ids=toks[:, None].to(self.device), attention_mask=mask,
                              position_ids=next_pos[:, None], use_cache=True, **{cache_kw(): past})
                    self._m["target_forwards"] += 1
                    past, logits, next_pos = _get_cache(o), o.logits[:, -1, :].cpu(), next_pos + 1
                live = rows.tolist()
                del past
            for r in live:  # speculative phase: few rows left, decoding is memory-bound
                self._m["spec_rows"] += 1
                finished[r] = self._speculate_row(prompts[r], out_ids[r], out_lp[r], params, gens[r], Tn)
        R = max(1, max(len(x) for x in out_ids))
        resp = torch.full((B, R), self.pad_id, dtype=torch.long)
        lp = torch.zeros(B, R)
        rmask = torch.zeros(B, R)
        for b in range(B):
            n = len(out_ids[b])
            if n:
                resp[b, :n] = torch.tensor(out_ids[b])
                lp[b, :n] = torch.tensor(out_lp[b])
                rmask[b, :n] = 1.0
        p_ids, p_mask = left_pad(prompts, self.pad_id)
        texts = [self.tokenizer.decode(out_ids[b], skip_special_tokens=True) for b in range(B)]
        return GenerationResult(prompt_ids=p_ids, prompt_mask=p_mask, response_ids=resp, response_mask=rmask,
                                rollout_logprobs=lp, temperatures=rmask * float(params.temperature),
                                finished=torch.tensor(finished, dtype=torch.bool), texts=texts)

    def _forward(self, m: torch.nn.Module, toks: List[int], cache: Any) -> tuple:
        x = torch.tensor([toks], dtype=torch.long, device=self.device)
        o = m(input_ids=x, use_cache=True, **{cache_kw(): cache})
        return o.logits[0].cpu(), _get_cache(o)

    def _speculate_row(self, prompt: List[int], ids: List[int], lps: List[float], params: SamplingParams,
                       gen: torch.Generator, Tn: int) -> bool:
        """Finish one row by draft-and-verify rounds; appends to ``ids`` / ``lps``; returns finished."""
        from transformers.cache_utils import DynamicCache

        if ids and ids[-1] in self.eos_ids:
            return True
        seq = list(prompt) + list(ids)
        tc, dc = DynamicCache(config=self.model.config), DynamicCache(config=self.drafter.config)
        # policy cache holds seq[:-1]; its next input is seq[-1:] (+ the draft)
        if len(seq) > 1:
            _, tc = self._forward(self.model, seq[:-1], tc)
            self._m["target_forwards"] += 1
        d_len = 0  # tokens of seq in the drafter cache
        while len(ids) < Tn:
            gamma = max(1, min(self.draft_len, Tn - len(ids)))  # the last token may come from the bonus draw
            draft: List[int] = []
            qs: List[torch.Tensor] = []
            for _ in range(gamma):  # drafter proposes gamma tokens (stops early at EOS)
                logits, dc = self._forward(self.drafter, (seq + draft)[d_len:], dc)
                d_len = len(seq) + len(draft)
                self._m["draft_forwards"] += 1
                q = self._dist(logits[-1], params)
                tok = self._draw(q, gen)
                draft.append(tok)
                qs.append(q)
                if tok in self.eos_ids:
                    break
            g = len(draft)
            plog, tc = self._forward(self.model, [seq[-1]] + draft, tc)  # policy scores all g + 1 positions
            self._m["target_forwards"] += 1
            p = self._dist(plog, params)  # [g + 1, V]
            n_acc, nxt = speculative_accept(p, qs, draft, gen, self._draw)
            self._m["draft_tokens"] += g
            self._m["accepted_tokens"] += n_acc
            if self.adaptive:
                self.draft_len = next_draft_len(self.draft_len, n_acc, g, self.min_draft_len, self.max_draft_len)
            new = draft[:n_acc] + [nxt]
            rows_p = list(range(n_acc)) + [n_acc]
            ended = False
            for tok, k in zip(new, rows_p):
                ids.append(tok)
                lps.append(math.log(max(float(p[k, tok]), 1e-45)))
                self._m["spec_tokens"] += 1
                if self._ends(tok, ids, params):
                    ended = True
                    break
                if len(ids) >= Tn:
                    break
            if ended:
                return True
            if len(ids) >= Tn:
                return False
            base = len(seq)
            seq.extend(new)
            # the policy cache holds (old seq) + draft; keep old seq + accepted draft = seq[:-1]
            _crop_to(tc, base + n_acc)
            d_len = min(d_len, base + n_acc)
            _crop_to(dc, d_len)
        return False


def speculative_accept(p: torch.Tensor, qs: List[torch.Tensor], draft: List[int], gen: torch.Generator,
                       draw: Any) -> tuple:
    """Speculative-sampling acceptance of one draft round (arXiv:2211.17192 / arXiv:2302.01318).

    Args:
        p: the policy's sampling distributions ``[g + 1, V]`` at the draft positions and one past.
        qs: the drafter's distributions, one ``[V]`` per draft token (``g`` of them).
        draft: the ``g`` drafted token ids (``draft[k] ~ qs[k]``).
        gen: the row's generator (uniforms for the accept tests).
        draw: ``fn(probs [V], gen) -> int`` (unnormalised probabilities allowed).
    Returns:
        ``(n_acc, nxt)``: drafts accepted (each with probability ``min(1, p/q)``, in order, up to
        the first rejection) and the next token: a draw from the normalised residual
        ``max(0, p - q)`` at the first rejection, or a bonus draw from ``p[g]`` when all were
        accepted. The emitted tokens are exact samples of ``p`` whatever ``q`` is.
    """
    g = len(draft)
    for k in range(g):
        pk, qk = float(p[k, draft[k]]), float(qs[k][draft[k]])
        u = float(torch.rand(1, generator=gen, dtype=torch.float64))
        if qk > 0 and u < min(1.0, pk / qk):
            continue
        resid = (p[k].double() - qs[k].double()).clamp(min=0)
        if float(resid.sum()) <= 1e-12:
            resid = p[k].double()
        return k, draw(resid, gen)
    return g, draw(p[g], gen)


def _crop_to(cache: Any, keep: int) -> None:
    """Drop the cached positions past ``keep`` (a negative ``crop`` removes, in every transformers version)."""
    n = int(cache.get_seq_length())
    if n > keep:
        cache.crop(keep - n)


def speculative_settings(rollout: Any, model: Any = None) -> Optional[Dict[str, Any]]:
    """The checked ``rollout.speculative`` settings, or None when unset or when vLLM speculates itself.

    Args:
        rollout: ``cfg.rollout``.
        model: ``cfg.model`` (its ``routing_replay``), or None.
    Raises:
        ConfigError: ``rollout.speculative`` with an engine other than hf or vllm (vllm's keys are
            checked by :func:`rlpost.rollout.vllm_spec.vllm_spec_settings`, and None is returned:
            vLLM speculates inside its own engine), with MoE routing replay (routes are recorded per
            plain decode forward), or bad speculative settings (:func:`spec_config`).
    """
    spec = rollout.get("speculative", None) if hasattr(rollout, "get") else getattr(rollout, "speculative", None)
    if not spec:
        return None
    if str(rollout.engine) == "vllm":
        from rlpost.rollout.vllm_spec import vllm_spec_settings

        vllm_spec_settings(spec)  # vLLM speculates inside its engine (rlpost.rollout.vllm_spec): no hf wrapper
        return None
    c = spec_config(spec)
    if str(rollout.engine) != "hf":
        raise ConfigError(f"rollout.speculative is implemented for rollout=hf and rollout=vllm, not "
                          f"rollout.engine={rollout.engine!r}; drop rollout.speculative")
    if str(getattr(model, "routing_replay", "off") or "off") != "off":
        raise ConfigError("rollout.speculative cannot be combined with model.routing_replay (routes are "
                          "recorded per plain decode forward); set one of them off")
    return c


def check_speculative(cfg: Any) -> Optional[Dict[str, Any]]:
    """:func:`speculative_settings` of a whole run config, plus the launcher's constraint (a
    ``rollout`` group check of :data:`rlpost.config.compose.GROUP_CHECKS`).

    Raises:
        ConfigError: as :func:`speculative_settings`; ``drafter=mtp_head`` without
            ``mtp_head_path`` under ``launcher=ray`` (the workers cannot fit a head).
    """
    c = speculative_settings(cfg.rollout, cfg.model)
    launcher = cfg.get("launcher", None) if hasattr(cfg, "get") else None
    if c is not None and c["drafter"] == MTP_DRAFTER and c["mtp_head_path"] is None and launcher is not None \
            and str(launcher.get("name", "none")) == "ray":
        raise ConfigError("rollout.speculative.drafter=mtp_head with launcher=ray: the Ray rollout workers cannot fit "
                          "a head (they have no training prompts). Fix: fit one first (a launcher=none run writes "
                          "<run_dir>/mtp_head.pt, or scripts/bench_mtp_head.py --save PATH) and set "
                          "rollout.speculative.mtp_head_path to it")
    return c
