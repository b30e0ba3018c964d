"""A²TGPO's information-gain passes: the policy's probability of the reference answer before each turn.

"A²TGPO: Agentic Turn-Group Policy Optimization with Adaptive Turn-level Clipping"
(arXiv:2605.06200), IG as in "Information Gain-based Policy Optimization" (IGPO,
arXiv:2510.14967, authors' code GuoqingWang1/IGPO). For every episode row with ``K >= 2`` model
turns and every turn ``k``, one teacher-forced, no-grad pass of the current policy (the
``algo_inputs`` stage, before the update) scores ``prefix + answer`` placed right after the
context that preceded turn ``k`` (prompt, earlier turns, environment text, which ends at the
assistant header of turn ``k``); ``P_k = exp(mean log-prob of the answer tokens)``. Then
``IG_k = P_{k+1} - P_k`` (``ig_type=prob_diff``, IGPO's default; ``log_prob_diff``: the
difference of mean log-probs), normalised per (prompt group, turn index)
(:func:`rlpost.algos.a2tgpo.turn_group_normalise`) and written as
``batch.extras['turn_info_gain']`` ``[B, R]`` on turn ``k``'s tokens for the estimator
(``a2tgpo``) and the loss (``a2tgpo_clip``). Single-turn rows need no pass (their IG is empty).

Our choices where the papers leave it open: the answer is ``str(example answer)`` after
``answer_prefix`` ("The answer is"; IGPO puts its own answer tags there), the two are tokenised
apart and only the answer's tokens are scored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from rlpost.algos.a2tgpo import TURN_IG_KEY, turn_group_normalise
from rlpost.algos.turns import turn_spans
from rlpost.core.batch import RolloutBatch
from rlpost.core.errors import ConfigError
from rlpost.core.registry import as_dict, param, resolve_params
from rlpost.methods.base import METHODS, Method, Needs, RunServices


@dataclass(frozen=True)
class InfoGainParams:
    """How the reference answer is scored (``algo.info_gain``; our choices, see the module docstring)."""

    answer_prefix: str = param("The answer is", "text placed before the reference answer (not scored)")
    ig_type: str = param("prob_diff", "prob_diff: IG = P_{k+1} - P_k with P = exp(mean answer log-prob) (IGPO's "
                                      "default); log_prob_diff: the difference of the mean log-probs")
    eps: float = param(1e-6, "added to the (group, turn) std of the IG")


def info_gain(per_turn: List[float], ig_type: str) -> List[float]:
    """``IG_k`` for ``k = 0 .. K-2`` from the per-turn mean answer log-probs ``[m_0 .. m_{K-1}]``.

    ``prob_diff``: ``exp(m_{k+1}) - exp(m_k)``; ``log_prob_diff``: ``m_{k+1} - m_k``.
    """
    f = math.exp if ig_type == "prob_diff" else (lambda x: x)
    return [f(per_turn[k + 1]) - f(per_turn[k]) for k in range(len(per_turn) - 1)]


def gt_passes(batch: Any, spans: List[List[tuple]], ans_ids: List[List[int]], prefix_ids: List[int]) -> Any:
    """The no-grad scoring batch: one row per (episode, turn) of the episodes with >= 2 turns.

    Row ``(i, k)``: the prompt of row ``i``; response = ``response_ids[i, :start_k] + prefix_ids +
    ans_ids[i]``, ``response_mask`` 1 on the answer tokens only, ``extras['response_attn']`` 1 on
    every real token.

    Returns:
        ``(RolloutBatch, [(i, k)])`` or ``(None, [])`` when no row has two turns.
    """

    items, resp = [], []
    for i, sp in enumerate(spans):
        if len(sp) < 2 or not ans_ids[i]:
            continue
        for k, (s, _) in enumerate(sp):
            items.append((i, k))
            resp.append(batch.response_ids[i, :s].tolist() + prefix_ids + ans_ids[i])
    if not items:
        return None, []
    L = max(len(r) for r in resp)
    N = len(items)
    rid = torch.zeros(N, L, dtype=torch.long)
    rmask = torch.zeros(N, L)
    attn = torch.zeros(N, L)
    for j, ((i, _), r) in enumerate(zip(items, resp)):
        rid[j, : len(r)] = torch.tensor(r, dtype=torch.long)
        attn[j, : len(r)] = 1.0
        rmask[j, len(r) - len(ans_ids[i]): len(r)] = 1.0
    rows = torch.tensor([i for i, _ in items], dtype=torch.long)
    extras = {"response_attn": attn}  # no per-token temperatures: the trainer's rollout temperature
    sb = RolloutBatch(prompt_ids=batch.prompt_ids[rows], prompt_mask=batch.prompt_mask[rows], response_ids=rid,
                      response_mask=rmask, rollout_logprobs=torch.zeros(N, L), group_index=batch.group_index[rows],
                      prompt_index=batch.prompt_index[rows], extras=extras)
    return sb, items


@METHODS.register("a2tgpo", paper="A2TGPO (arXiv:2605.06200)")
class InfoGain(Method):
    """Per-turn information gain of the reference answer (for ``a2tgpo`` / ``a2tgpo_clip``)."""

    name = "a2tgpo"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.p: Optional[InfoGainParams] = None

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return str(cfg.algo.adv_estimator) == "a2tgpo" or str(cfg.algo.loss) == "a2tgpo_clip"

    def validate(self) -> None:

        self.p = resolve_params(InfoGainParams, as_dict(self.cfg.algo.get("info_gain", None)),
                                key="algo.info_gain", owner="A2TGPO's information gain")
        if self.p.ig_type not in ("prob_diff", "log_prob_diff"):
            raise ConfigError(f"algo.info_gain.ig_type={self.p.ig_type!r}: valid choices are prob_diff, log_prob_diff")
        if str(self.cfg.algo.loss) == "a2tgpo_clip" and str(self.cfg.algo.adv_estimator) != "a2tgpo":
            raise ConfigError("algo.loss=a2tgpo_clip scales the clip by the information gain the a2tgpo estimator's "
                              "method computes; set algo.adv_estimator=a2tgpo too (or use algo=a2tgpo)")

    def needs(self) -> Needs:
        return Needs(provides=(TURN_IG_KEY,))

    def describe(self) -> str:
        return "per-turn information gain of the reference answer (one no-grad pass per turn)"

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        p = self.p or InfoGainParams()
        tok = run.tokenizer
        mask = batch.response_mask
        spans = [turn_spans(mask[i]) for i in range(mask.shape[0])]
        prefix_ids = list(tok.encode(p.answer_prefix, add_special_tokens=False)) if p.answer_prefix else []
        ans_ids = [list(tok.encode(" " + str(a), add_special_tokens=False)) if a is not None else []
                   for a in batch.answers]
        out = torch.zeros(mask.shape)
        sb, items = gt_passes(batch, spans, ans_ids, prefix_ids)
        raw: List[List[float]] = [[] for _ in spans]
        if sb is not None:
            lp = run.rows_pass(sb, lambda b: run.logprobs(b)[0]).float()
            m = sb.response_mask
            mean_lp = ((lp * m).sum(1) / m.sum(1).clamp(min=1)).tolist()
            per: Dict[int, List[float]] = {}
            for (i, _), v in zip(items, mean_lp):
                per.setdefault(i, []).append(v)
            for i, vals in per.items():
                raw[i] = info_gain(vals, p.ig_type)
        norm = turn_group_normalise(raw, batch.group_index, p.eps)
        for i, sp in enumerate(spans):
            for k, n in enumerate(norm[i]):
                s, e = sp[k]
                out[i, s:e] = n
        batch.extras[TURN_IG_KEY] = out
        flat = [v for r in raw for v in r]
        return {"a2tgpo/ig_mean": float(sum(flat) / len(flat)) if flat else 0.0,
                "a2tgpo/ig_turns": float(len(flat)), "a2tgpo/passes": float(len(items))}
