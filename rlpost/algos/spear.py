"""SPEAR's tensor parts ("Learn the Ropes, Then Trust the Wins: Self-imitation with Progressive
Exploration for Agentic Reinforcement Learning", SPEAR, arXiv:2509.22601; authors' code
TencentYoutuResearch/SPEAR, ``verl-agent``).

SPEAR is GRPO (the authors' Dr.BoT settings) plus a curriculum of two parts, both followed here
from the authors' code:

1. a tool-call bonus (skill-level exploration, strong early): episode ``i`` with ``n_i`` tool calls
   gets ``b_i = min(cap, per_call n_i) (cos(pi s / T) + 1) / 2`` added to its reward at RL step
   ``s <= T``, 0 after (``agent_system/reward_manager/episode.py``, ``use_toolcall_reward=cosine``;
   per_call 0.1, cap 1, ``T = max_toolcall_steps`` 200 in their ALFWorld/WebShop SPEAR scripts);
2. self-imitation on a replay buffer (action-level exploration, strong late): rows with a positive
   advantage are stored; once the buffer holds enough rows above the recalibrated baseline their
   advantages are recomputed against the median of the recent groups' mean returns, the
   non-negative ones replayed in an extra update whose loss is scaled by
   ``coef (1 - cos(pi s / T_sil)) / 2`` for ``s <= T_sil`` (then ``coef``), with Clip-Cov's token
   selection at the wider replay settings (ratio 0.02, covariance bounds 2 and 60). The buffer
   lives in :mod:`rlpost.methods.spear`.

:func:`spear_advantage` is the on-policy estimator (GRPO on reward + bonus; no std division, as
the authors' ``norm_adv_by_std_in_grpo=False``; minus the invalid-action penalty); :func:`spear_clip_cov_loss`
the loss of both updates; :func:`replay_advantages`, :func:`replay_scale`, :func:`tool_call_bonus` the
formulas the method applies.

Dr.BoT's filters and the invalid-action penalty (on in the authors' SPEAR scripts), as their code:

- response filters (``agent_system/reward_manager/episode.py`` flags, applied in
  ``verl/trainer/ppo/ray_trainer_hybrid.py`` by zeroing the flagged response's loss mask): a response
  is *overlong* when its length reaches the response budget (``>= data.max_response_length``; here
  ``rollout.max_new_tokens``), *repetitive* when one 20-gram of its token ids occurs 10 times or more
  (:func:`has_repeated_ngrams`), *unreadable* when its text (special tokens kept) holds one of the
  mojibake strings :data:`UNREADABLE_STRINGS`, *incomplete* when it holds no action (their test: no
  ``<action>...</action>`` after the last ``</think>``, ALFWorld/WebShop's format; **our reading** for
  rlpost, :func:`is_incomplete`: no ``<tool_call>`` tag and no answer the task extracts). In verl-agent
  a response is one model turn (every step of an episode is its own sample); here each flagged turn
  of a row loses its loss tokens (the row keeps its others).
- the rollout filter (``RayPPOTrainer._filter_rollout``, ``rollout_filter_type=std``,
  ``rollout_filter_ratio`` 0.75): the ``int(ratio * groups)`` prompt groups with the largest
  population std of their returns (reward + tool bonus, before the penalty) are kept, then a random
  largest-power-of-2 subset of their rows (:func:`std_rollout_filter`); ratio 1 keeps everything.
- the invalid-action penalty (``apply_invalid_action_penalty``, coefficient 0.1): a response whose
  action the environment rejects loses 0.1 of its score before the advantage (and the replay
  buffer's return). Their validity is the environment's projection (ALFWorld: an ``<action>`` block,
  ``<think>`` tags, no CJK text); **our reading**: a turn is invalid when it is incomplete (above) or
  the environment reports it void (``extras['turn_void']``, a malformed tool call). On a row of
  several turns turn ``k``'s tokens get the score ``R + b - c inv_k`` and the group baseline is the
  mean of the rows' ``R + b - c (invalid turns / turns)`` (our reading; on single-turn rows, the
  authors' rows, both are exact).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from rlpost.algos.advantages import AdvantageInput, AdvantageOutput
from rlpost.algos.losses import EXTRA_INPUTS, Metrics, PolicyLossInput, clip_cov_loss
from rlpost.algos.registries import ADV_ESTIMATORS, POLICY_LOSSES
from rlpost.algos.utils import group_all_equal, group_stats
from rlpost.core.registry import param

PAPER = ("Learn the Ropes, Then Trust the Wins: Self-imitation with Progressive Exploration for Agentic "
         "Reinforcement Learning (SPEAR, arXiv:2509.22601)")

#: the per-row tool-call bonus the SPEAR method writes before the advantages
TOOL_BONUS_KEY = "spear_tool_bonus"
#: the per-row loss scale of a replayed (self-imitation) row; absent on the on-policy update
REPLAY_KEY = "sil_replay_coef"
EXTRA_INPUTS.setdefault(REPLAY_KEY, "[B] loss scale of each replayed self-imitation row (absent or 0: an on-policy "
                                    "row); algo=spear's replay buffer")


#: per-token invalid-action flags ``[B, R]`` (1 on every token of an invalid turn), written by the SPEAR method
INVALID_KEY = "spear_invalid"
#: per-row share of invalid turns ``[B]``
INVALID_FRAC_KEY = "spear_invalid_frac"

#: the strings whose presence marks a decoded response unreadable (authors' ``episode.py``, verbatim)
UNREADABLE_STRINGS = ("\ufffd", "\xef\xbf\xbd", "\xef\xbc\ufffd", "\xef\xbc\u0178",
                      "\xef\xbf\xbd\xef\xbf\xbd", "\xef\xbf\xbd" * 4, "\u0120\xef\xbf\xbd")


def has_repeated_ngrams(ids: Sequence[int], n: int = 20, threshold: int = 10) -> bool:
    """Dr.BoT's repetition test (SPEAR, arXiv:2509.22601; authors' ``has_repeated_ngrams``).

    Args:
        ids: one response's token ids.
        n: n-gram length (authors: 20); threshold: occurrences that flag it (authors: 10).
    Returns:
        whether some n-gram of consecutive ids occurs ``threshold`` times or more (overlaps count).
    """
    ids = [int(x) for x in ids]
    counts = Counter(tuple(ids[i: i + n]) for i in range(len(ids) - n + 1))
    return any(c >= threshold for c in counts.values())


def is_unreadable(text: str) -> bool:
    """Whether ``text`` holds one of :data:`UNREADABLE_STRINGS` (Dr.BoT's unreadable-BPE filter)."""
    return any(u in text for u in UNREADABLE_STRINGS)


def is_incomplete(text: str, extract_answer: Callable[[str], Optional[str]]) -> bool:
    """Whether a turn holds no action: no ``<tool_call>`` tag and no answer ``extract_answer`` finds.

    Our reading of Dr.BoT's incomplete-response test (the authors': no ``<action>`` block after the
    last ``</think>``) for rlpost's tool calls and final answers.
    """
    return "<tool_call>" not in text and extract_answer(text) is None


def std_rollout_filter(scores: torch.Tensor, group_index: torch.Tensor, ratio: float,
                       gen: torch.Generator) -> torch.Tensor:
    """SPEAR's std rollout filter (arXiv:2509.22601; authors' ``_filter_rollout``, type ``std``).

    Keeps the ``max(1, int(ratio * G))`` groups (of ``G``) with the largest population std of ``scores``
    (ties: the earlier group first, as Python's stable sort), then a uniformly random subset of
    their rows of the largest power of 2 not above their count (all of them when that count is 1:
    the authors' code would keep none).

    Args:
        scores: ``[B]`` each row's return (reward + tool bonus).
        group_index: ``[B]`` group ids.
        ratio: share of groups kept, in (0, 1]; 1 keeps every row (no subset either).
        gen: the generator of the random subset.
    Returns:
        ``[N]`` long, the kept rows in increasing order.
    Raises:
        ValueError: ``ratio`` outside (0, 1].
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"spear: rollout_filter_ratio must be in (0, 1], got {ratio}")
    B = int(scores.shape[0])
    if ratio == 1:
        return torch.arange(B)
    groups = list(dict.fromkeys(int(g) for g in group_index.tolist()))
    k = max(1, int(float(ratio) * float(len(groups))))  # the authors assert k > 0; here one group is kept
    std = {g: float(scores[group_index == g].double().std(unbiased=False)) for g in groups}
    kept = set(sorted(groups, key=lambda g: std[g], reverse=True)[:k])
    rows = torch.tensor([i for i in range(B) if int(group_index[i]) in kept], dtype=torch.long)
    n = len(rows)
    m = n if n <= 1 else 1 << (n.bit_length() - 1)
    pick = torch.randperm(n, generator=gen)[:m]
    return rows[pick].sort().values


def tool_call_bonus(tool_calls: torch.Tensor, step: int, *, per_call: float, cap: float, steps: int) -> torch.Tensor:
    """SPEAR's cosine-decayed tool-call reward (arXiv:2509.22601, authors' ``episode.py``).

    Args:
        tool_calls: ``[B]`` tool calls of each episode.
        step: the RL step (1-based).
        per_call: reward per call; cap: its maximum; steps: ``T``, the step after which it is 0.
    Returns:
        ``[B]`` float32 ``min(cap, per_call n) (cos(pi step / T) + 1) / 2`` for ``step <= T``, else 0.
    """
    if steps <= 0 or step > steps:
        return torch.zeros(tool_calls.shape, dtype=torch.float32)
    decay = (math.cos(step / steps * math.pi) + 1.0) / 2.0
    return (torch.clamp(per_call * tool_calls.float(), max=cap) * max(decay, 0.0)).float()


def replay_scale(step: int, *, coef: float, steps: int) -> float:
    """The replay loss's weight at RL step ``step``: ``coef (1 - cos(pi step / T)) / 2`` for ``step <= T``,
    then ``coef`` (SPEAR, arXiv:2509.22601, authors' ``dp_actor.py``; ``T = steps``, 0: always ``coef``)."""
    if steps <= 0 or step > steps:
        return float(coef)
    return float(coef) * (1.0 - math.cos(step / steps * math.pi)) / 2.0


def replay_advantages(returns: torch.Tensor, baseline: float, std: float, norm_by_std: bool,
                      eps: float = 1e-6) -> torch.Tensor:
    """Recalibrated advantages of replayed rows (SPEAR's advantage recalibration, arXiv:2509.22601).

    Args:
        returns: ``[N]`` each stored row's return (reward + tool bonus at its own step).
        baseline: the median of the recent groups' mean returns (authors' ``reward_mean_50p``).
        std: the median of their within-group stds (used when ``norm_by_std``).
    Returns:
        ``[N]`` float64 ``R - baseline`` (divided by ``std + eps`` when ``norm_by_std``).
    """
    a = returns.double() - float(baseline)
    return a / (float(std) + eps) if norm_by_std else a


@dataclass(frozen=True)
class SpearParams:
    """SPEAR's estimator and curriculum (arXiv:2509.22601; authors' ALFWorld/WebShop SPEAR scripts)."""

    norm_by_std: bool = param(False, "divide by the group std (the authors' scripts: norm_adv_by_std_in_grpo false)")
    eps: float = param(1e-6, "added to the group std when norm_by_std")
    tool_bonus_per_call: float = param(0.1, "tool-call reward per call (authors: 0.1)")
    tool_bonus_cap: float = param(1.0, "largest tool-call reward of an episode (authors: 1)")
    tool_bonus_steps: int = param(200, "RL steps of the cosine-decayed tool-call reward, 0 off (authors: 200)")
    buffer_size: int = param(2048, "replayed rows per replay update at most (authors: 2048)")
    tolerate_steps: int = param(5, "buffer keeps rows at most this many steps older than the newest, capped at 10 "
                                   "(authors: 5)")
    baseline_buffer_size: int = param(10240, "group means kept for the recalibrated baseline (authors: 10240)")
    replay_coef: float = param(1.0, "weight of the replay loss once ramped up, 0 off (authors: 1)")
    replay_ramp_steps: int = param(100, "RL steps of the replay weight's cosine ramp from 0 (authors: 100)")
    filter_overlong: bool = param(True, "Dr.BoT: no loss on a turn of rollout.max_new_tokens tokens or more (authors: on)")
    filter_incomplete: bool = param(True, "Dr.BoT: no loss on a turn without a tool call or an answer (authors: on)")
    filter_repetitive: bool = param(True, "Dr.BoT: no loss on a turn with a repeated token n-gram (authors: on)")
    filter_unreadable: bool = param(True, "Dr.BoT: no loss on a turn whose text holds mojibake (authors: on)")
    repetition_ngram: int = param(20, "n of the repetition filter's n-grams (authors: 20)")
    repetition_count: int = param(10, "occurrences of one n-gram that flag a turn repetitive (authors: 10)")
    rollout_filter_ratio: float = param(0.75, "share of prompt groups kept, largest return std first, then a "
                                              "power-of-2 subset of their rows; 1 off (authors: 0.75)")
    invalid_action_penalty: float = param(0.1, "subtracted from an invalid turn's score, 0 off (authors: 0.1)")


@ADV_ESTIMATORS.register("spear", paper=PAPER, params=SpearParams, needs_group=True, needs_self_imitation=True)
def spear_advantage(inp: AdvantageInput, *, norm_by_std: bool, eps: float, tool_bonus_per_call: float,
                    tool_bonus_cap: float, tool_bonus_steps: int, buffer_size: int, tolerate_steps: int,
                    baseline_buffer_size: int, replay_coef: float, replay_ramp_steps: int, filter_overlong: bool,
                    filter_incomplete: bool, filter_repetitive: bool, filter_unreadable: bool, repetition_ngram: int,
                    repetition_count: int, rollout_filter_ratio: float,
                    invalid_action_penalty: float) -> AdvantageOutput:
    """GRPO's group-relative advantage of reward + tool-call bonus - invalid-action penalty (SPEAR's on-policy half).

    ``v_i = R_i + b_i - c f_i`` with ``b = extras['spear_tool_bonus']`` and ``f = extras['spear_invalid_frac']``
    (the row's share of invalid turns; absent: 0), ``c = invalid_action_penalty``;
    ``A_{i,t} = (v_i - mean_g(v)) - c (inv_{i,t} - f_i)`` with ``inv = extras['spear_invalid']`` ``[B, R]``
    (1 on the tokens of an invalid turn): the turn's score ``R + b - c inv`` minus the group mean. Both
    terms are divided by ``std_g(v) + eps`` when ``norm_by_std``; the first is 0 in a group whose ``v`` are all equal.
    A single-turn row gets ``(R + b - c inv) - mean_g``, the authors' exactly. The buffer, schedule and
    filter parameters are the method's (:mod:`rlpost.methods.spear`).

    Args:
        inp: rewards ``[B]``, response_mask ``[B, R]``, group_index ``[B]``, extras.
    Returns:
        AdvantageOutput with ``advantages [B, R]`` float32.
    """
    ex = inp.extras or {}
    b = ex.get(TOOL_BONUS_KEY)
    r = inp.rewards.double() + (b.double() if b is not None else 0.0)
    c = float(invalid_action_penalty)
    frac, inv = ex.get(INVALID_FRAC_KEY), ex.get(INVALID_KEY)
    if c and frac is not None and inv is not None:
        r = r - c * frac.double()
        tok = -c * (inv.double()[:, : inp.response_mask.shape[1]] - frac.double()[:, None])
    else:
        tok = torch.zeros(inp.response_mask.shape, dtype=torch.float64)
    mean, std, _ = group_stats(r, inp.group_index)
    a = r - mean
    if norm_by_std:
        a = a / (std + eps)
        tok = tok / (std + eps)[:, None]
    a = torch.where(group_all_equal(r, inp.group_index), torch.zeros_like(a), a)
    return AdvantageOutput(advantages=((a[:, None] + tok) * inp.response_mask.double()).float(), returns=None)


@dataclass(frozen=True)
class SpearClipCovParams:
    """Clip-Cov of SPEAR's two updates (arXiv:2509.22601; authors' ALFWorld SPEAR script)."""

    clip_cov_ratio: float = param(2e-4, "on-policy rows: share of tokens whose loss is zeroed (Clip-Cov paper: 2e-4)")
    cov_lb: float = param(1.0, "on-policy rows: lower covariance bound (Clip-Cov paper: 1)")
    cov_ub: float = param(5.0, "on-policy rows: upper covariance bound (Clip-Cov paper: 5)")
    replay_clip_cov_ratio: float = param(0.02, "replayed rows: share of tokens whose loss is zeroed (authors: 0.02)")
    replay_cov_lb: float = param(2.0, "replayed rows: lower covariance bound (authors: 2)")
    replay_cov_ub: float = param(60.0, "replayed rows: upper covariance bound (authors: 60)")
    eps_low: float = param(0.2, "ratio floor 1 - eps_low (authors: 0.2)")
    eps_high: float = param(0.28, "ratio ceiling 1 + eps_high (authors: 0.28)")


@POLICY_LOSSES.register("spear_clip_cov", paper=PAPER, params=SpearClipCovParams, batch_statistics=True,
                        extras=(REPLAY_KEY,), optional_extras=(REPLAY_KEY,),
                        clip_frac_counts="the covariance-selected tokens whose gradient is cut, besides the ratio clip")
def spear_clip_cov_loss(inp: PolicyLossInput, *, clip_cov_ratio: float, cov_lb: float, cov_ub: float,
                        replay_clip_cov_ratio: float, replay_cov_lb: float, replay_cov_ub: float,
                        eps_low: float, eps_high: float) -> Tuple[torch.Tensor, Metrics]:
    """Clip-Cov (:func:`rlpost.algos.losses.clip_cov_loss`) with SPEAR's replay settings on replayed rows.

    A micro-batch whose ``extras['sil_replay_coef']`` (``[B]``) is present and positive is a replay
    update (the method replays a buffer in its own update, never mixed with on-policy rows): its
    tokens use the replay ratio and covariance bounds and its loss is multiplied by the row's
    coefficient. Otherwise this is ``clip_cov`` with the on-policy settings.

    Returns:
        ``(loss_mat [B, R], metrics)``; metrics add ``replay_rows`` (the share of replayed rows).
    """
    c = inp.extras.get(REPLAY_KEY)
    replay = c is not None and bool((c > 0).any())
    if replay:
        loss, metrics = clip_cov_loss(inp, clip_cov_ratio=replay_clip_cov_ratio, cov_lb=replay_cov_lb,
                                      cov_ub=replay_cov_ub, eps_low=eps_low, eps_high=eps_high)
        loss = loss * c.to(loss)[:, None]
    else:
        loss, metrics = clip_cov_loss(inp, clip_cov_ratio=clip_cov_ratio, cov_lb=cov_lb, cov_ub=cov_ub,
                                      eps_low=eps_low, eps_high=eps_high)
    metrics["replay_rows"] = torch.tensor(1.0 if replay else 0.0)
    return loss, metrics
