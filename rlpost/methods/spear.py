"""SPEAR's curriculum around the update: the tool-call bonus and the self-imitation replay buffer.

"Learn the Ropes, Then Trust the Wins: Self-imitation with Progressive Exploration for Agentic
Reinforcement Learning" (SPEAR, arXiv:2509.22601). Followed from the authors' code
(TencentYoutuResearch/SPEAR, ``verl-agent/verl/trainer/ppo/ray_trainer_hybrid.py``,
``TrajectoryBufferBatch``; ``verl/workers/actor/dp_actor.py``) where it is more specific than
the paper:

- ``prepare`` (before the advantages): each episode's tool-call bonus
  (:func:`rlpost.algos.spear.tool_call_bonus`, from ``extras['episode_tool_calls']``; 0 on
  single-turn rows) into ``extras['spear_tool_bonus']``;
- ``wrap_update``: (1) when the buffer holds more than ``1.5 buffer_size`` rows whose return
  exceeds the baseline ``p50`` (the median of the recorded group mean returns), the replay batch
  is built and the buffer emptied: every stored row's advantage is recalibrated to ``R - p50``
  (:func:`rlpost.algos.spear.replay_advantages`), rows with a negative one dropped, and a random
  ``min(largest power of 2 <= n, buffer_size)`` of them kept; (2) the on-policy update;
  (3) the replay update (the trainer's own update on the replay batch, one more optimizer step,
  ``extras['sil_replay_coef']`` = :func:`rlpost.algos.spear.replay_scale` of the step, skipped
  while it is 0); (4) the step's rows with a positive advantage join the buffer, after rows more
  than ``min(tolerate_steps, 10)`` steps older than the newest stored step are dropped, and each
  prompt group's mean and std of the return join the baseline history (oldest steps dropped past
  ``baseline_buffer_size`` values).
  Replayed rows keep the pre-update log-probs of their own step (``Needs.old_logprobs``) as the
  ratio's denominator, as the authors' stored ``old_log_probs``.
- ``state_dict``: the buffer rows and the baseline history, saved with every checkpoint.

- ``prepare`` also applies Dr.BoT's filters and the invalid-action penalty's flags, in the authors'
  order (``ray_trainer_hybrid.py``: response filters, then the std rollout filter, then the
  advantage with the penalty): (1) each model turn of a row (:func:`rlpost.algos.turns.turn_spans`
  of the response mask) that is overlong, incomplete, repetitive or unreadable
  (:mod:`rlpost.algos.spear`) loses its loss tokens; (2) each turn that is incomplete or that the
  environment reported void (``extras['turn_void']``) is invalid: ``extras['spear_invalid']``
  ``[B, R]`` and ``extras['spear_invalid_frac']`` ``[B]`` for the estimator; (3) the std rollout
  filter (:func:`rlpost.algos.spear.std_rollout_filter`, on reward + bonus) drops the other rows
  from the batch itself (every later stage, the buffer included, sees only the kept rows; the
  logged ``reward/mean`` is then the kept rows').
  A stored row's return is reward + bonus - ``invalid_action_penalty`` x its share of invalid turns
  (the authors' buffer stores the penalised score).

The extra optimizer step also advances the learning-rate schedule once more on a replay step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch

from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.spear import (INVALID_FRAC_KEY, INVALID_KEY, REPLAY_KEY, TOOL_BONUS_KEY, has_repeated_ngrams,
                                is_incomplete, is_unreadable, replay_advantages, replay_scale, std_rollout_filter,
                                tool_call_bonus)
from rlpost.algos.turns import turn_spans
from rlpost.algos.validate import adv_overrides
from rlpost.core.batch import RolloutBatch
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method, Needs, RunServices

#: the stored row's return (reward + bonus), kept with the row
RETURN_KEY = "spear_return"


def _median(xs: List[float]) -> float:
    """The 50th percentile with linear interpolation (numpy's default, as the authors' ``np.percentile``)."""
    s = sorted(xs)
    if not s:
        raise ValueError("median of no values")
    pos = (len(s) - 1) * 0.5
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _power_of_two_at_most(n: int) -> int:
    """The largest power of 2 ``<= n``; 0 for ``n <= 1`` (the authors' ``nearest_lower_power_of_2``)."""
    return 0 if n <= 1 else 1 << (n.bit_length() - 1)


def shrink_in_place(batch: RolloutBatch, keep: torch.Tensor) -> None:
    """Make ``batch`` its sub-batch of rows ``keep`` (``[N]`` long), in place (later stages hold the same object)."""
    sub = batch.select(keep)
    for f in dataclasses.fields(batch):
        setattr(batch, f.name, getattr(sub, f.name))


def turn_flags(ids: torch.Tensor, text: str, plain_text: str, void: bool, *, max_new_tokens: int,
               extract_answer: Any, ngram: int, count: int) -> Dict[str, bool]:
    """Dr.BoT's flags of one model turn (SPEAR, arXiv:2509.22601; authors' ``episode.py``).

    Args:
        ids: ``[L]`` the turn's token ids.
        text: the turn decoded with its special tokens (the authors' ``response_str``).
        plain_text: the turn decoded without them (the text the task's ``extract_answer`` reads).
        void: the environment reported the turn void (a malformed tool call).
        max_new_tokens: the per-turn token budget (overlong at ``L >= max_new_tokens``).
        extract_answer: the task's answer extraction; ngram, count: the repetition test.
    Returns:
        ``{"overlong", "incomplete", "repetitive", "unreadable", "invalid"}`` booleans; invalid = incomplete or void.
    """
    incomplete = is_incomplete(plain_text, extract_answer)
    return {"overlong": int(ids.numel()) >= int(max_new_tokens), "incomplete": incomplete,
            "repetitive": has_repeated_ngrams(ids.tolist(), ngram, count), "unreadable": is_unreadable(text),
            "invalid": incomplete or bool(void)}


def _to_dict(b: RolloutBatch) -> Dict[str, Any]:
    return {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}


class ReplayBuffer:
    """SPEAR's trajectory buffer and baseline history (arXiv:2509.22601; authors' ``TrajectoryBufferBatch``).

    Args:
        buffer_size: replayed rows per replay at most; a replay starts above ``1.5 buffer_size`` ready rows.
        tolerate_steps: the largest age of a stored row relative to the newest stored step (capped at 10).
        baseline_buffer_size: group means kept (whole steps are dropped, oldest first).
        norm_by_std: recalibrated advantages divided by the median group std.
    """

    def __init__(self, buffer_size: int, tolerate_steps: int, baseline_buffer_size: int, norm_by_std: bool) -> None:
        self.buffer_size = int(buffer_size)
        self.tolerate = min(int(tolerate_steps), 10)
        self.baseline_size = int(baseline_buffer_size)
        self.norm_by_std = bool(norm_by_std)
        self.entries: List[Tuple[int, RolloutBatch]] = []  # (step, rows with extras RETURN_KEY, old_logprobs)
        self.means: List[Tuple[int, List[float]]] = []  # (step, each group's mean return)
        self.stds: List[Tuple[int, List[float]]] = []

    def baseline(self) -> Optional[Tuple[float, float]]:
        """``(p50 of the recorded group means, p50 of the group stds)``, None before any step."""
        m = [x for _, xs in self.means for x in xs]
        s = [x for _, xs in self.stds for x in xs]
        return (_median(m), _median(s)) if m else None

    def ready_rows(self) -> int:
        """Stored rows whose return exceeds the baseline (all rows above their step's mean without history)."""
        base = self.baseline()
        n = 0
        for _, b in self.entries:
            r = b.extras[RETURN_KEY].double()
            n += int((r > (base[0] if base is not None else r.mean())).sum())
        return n

    def is_ready(self) -> bool:
        """More than ``1.5 buffer_size`` ready rows (the authors' ``is_full_capacity``)."""
        return self.ready_rows() > 1.5 * self.buffer_size

    def add(self, batch: RolloutBatch, returns: torch.Tensor, step: int) -> int:
        """Record step ``step``: its group statistics, then its positive-advantage rows; returns rows stored.

        Args:
            batch: the step's batch with ``extras['advantages']`` and ``['old_logprobs']``.
            returns: ``[B]`` reward + bonus of its rows.
        """
        if self.entries:  # rows too old relative to the newest stored step (before this one joins)
            newest = self.entries[-1][0]
            self.entries = [(s, b) for s, b in self.entries if abs(s - newest) <= self.tolerate]
        g = batch.group_index
        means, stds = [], []
        for gid in torch.unique(g).tolist():
            r = returns[g == gid].double()
            means.append(float(r.mean()))
            stds.append(float(r.std(unbiased=False)))
        while sum(len(x) for _, x in self.means) > self.baseline_size and self.means:
            self.means.pop(0)
            self.stds.pop(0)
        self.means.append((step, means))
        self.stds.append((step, stds))
        adv = (batch.extras["advantages"] * batch.response_mask).sum(-1)
        keep = torch.nonzero(adv > 0).flatten()
        if keep.numel() == 0:
            return 0
        rows = batch.select(keep)
        rows.extras = {k: v for k, v in rows.extras.items() if k != "advantages"}
        rows.extras[RETURN_KEY] = returns[keep].float()
        self.entries.append((step, rows))
        return int(keep.numel())

    def take(self, gen: torch.Generator, pad_id: int = 0) -> Optional[RolloutBatch]:
        """The replay batch (recalibrated advantages, negatives dropped, a power-of-2 random subset); empties the buffer.

        Returns:
            the batch with ``extras['advantages']`` ``[N, R]``, or None when no row is left.
        """
        if not self.entries:
            return None
        base = self.baseline()
        allb = RolloutBatch.concat([b for _, b in self.entries], pad_token_id=pad_id)
        self.entries = []
        r = allb.extras[RETURN_KEY]
        a = replay_advantages(r, base[0], base[1], self.norm_by_std) if base else r.double() - r.double().mean()
        ok = torch.nonzero(a >= 0).flatten()
        n = min(_power_of_two_at_most(int(ok.numel())), self.buffer_size)
        if n == 0:
            return None
        pick = ok[torch.randperm(ok.numel(), generator=gen)[:n]].sort().values
        out = allb.select(pick)
        out.extras["advantages"] = (a[pick][:, None] * out.response_mask.double()).float()
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {"entries": [(s, _to_dict(b)) for s, b in self.entries], "means": self.means, "stds": self.stds}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.entries = [(int(s), RolloutBatch(**d)) for s, d in sd.get("entries", [])]
        self.means = [(int(s), list(x)) for s, x in sd.get("means", [])]
        self.stds = [(int(s), list(x)) for s, x in sd.get("stds", [])]


@METHODS.register("spear", paper="SPEAR (arXiv:2509.22601)")
class SelfImitation(Method):
    """SPEAR's tool-call bonus and self-imitation replay (see the module docstring).

    Raises:
        ConfigError: (``validate``) a negative size, step count or coefficient, ``buffer_size < 1``,
            ``repetition_ngram`` / ``repetition_count < 1``, or a ``rollout_filter_ratio`` outside (0, 1].
    """

    name = "spear"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        adv = str(cfg.algo.adv_estimator)
        self.p = dict(ADV_ESTIMATORS.kwargs(adv, adv_overrides(cfg.algo), "algo.adv_params"))
        self.buffer = ReplayBuffer(self.p["buffer_size"], self.p["tolerate_steps"], self.p["baseline_buffer_size"],
                                   self.p["norm_by_std"])

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "needs_self_imitation", False))

    def validate(self) -> None:
        p = self.p
        if int(p["buffer_size"]) < 1:
            raise ConfigError(f"algo.adv_params.buffer_size must be >= 1, got {p['buffer_size']}")
        for k in ("tolerate_steps", "baseline_buffer_size", "tool_bonus_steps", "replay_ramp_steps", "replay_coef",
                  "tool_bonus_per_call", "tool_bonus_cap", "invalid_action_penalty"):
            if float(p[k]) < 0:
                raise ConfigError(f"algo.adv_params.{k} must be >= 0, got {p[k]}")
        for k in ("repetition_ngram", "repetition_count"):
            if int(p[k]) < 1:
                raise ConfigError(f"algo.adv_params.{k} must be >= 1, got {p[k]}")
        ratio = float(p["rollout_filter_ratio"])
        if not 0 < ratio <= 1:
            raise ConfigError(f"algo.adv_params.rollout_filter_ratio={ratio} must be in (0, 1] (the share of prompt "
                              f"groups kept). Fix: 0.75 (the authors') or 1 (off).")

    def needs(self) -> Needs:
        return Needs(old_logprobs=True, provides=(TOOL_BONUS_KEY, REPLAY_KEY, INVALID_KEY, INVALID_FRAC_KEY))

    def describe(self) -> str:
        return "tool-call bonus; self-imitation replay buffer (SPEAR)"

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        calls = batch.extras.get("episode_tool_calls")
        if calls is None:
            calls = torch.zeros(len(batch))
        b = tool_call_bonus(calls, int(run.step), per_call=float(self.p["tool_bonus_per_call"]),
                            cap=float(self.p["tool_bonus_cap"]), steps=int(self.p["tool_bonus_steps"]))
        batch.extras[TOOL_BONUS_KEY] = b
        out = {"spear/tool_bonus_mean": float(b.mean()) if len(b) else 0.0}
        out.update(self.filter_turns(batch, run))
        out.update(self.filter_rollouts(batch, int(run.step)))
        return out

    def filter_turns(self, batch: Any, run: RunServices) -> Dict[str, float]:
        """Dr.BoT's response filters (mask zeroed on flagged turns) and the invalid-turn flags (see the module docstring).

        Writes ``extras['spear_invalid']`` ``[B, R]`` and ``extras['spear_invalid_frac']`` ``[B]``; returns the
        counts of flagged turns (``spear/filtered_<kind>``) and ``spear/invalid_turn_frac``. When the filters would
        leave the batch without any loss token they are not applied this step (``spear/filters_skipped`` 1; our
        choice: the authors' code would make an optimizer step on an all-zero loss, which still moves Adam's
        weights by its moments).
        """
        p, tok, task = self.p, run.tokenizer, run.task
        on = {k: bool(p[f"filter_{k}"]) for k in ("overlong", "incomplete", "repetitive", "unreadable")}
        need_flags = any(on.values()) or float(p["invalid_action_penalty"]) > 0
        B, R = batch.response_mask.shape
        inv, frac = torch.zeros(B, R), torch.zeros(B)
        counts = {k: 0.0 for k in on}
        n_turns = n_invalid = 0
        void = batch.extras.get("turn_void")
        extract = task.extract_answer if task is not None else (lambda _t: None)
        mask = batch.response_mask.clone()
        for i in range(B if need_flags else 0):
            spans = turn_spans(batch.response_mask[i])
            bad = 0
            for s, e in spans:
                ids = batch.response_ids[i, s:e]
                f = turn_flags(ids, tok.decode(ids.tolist(), skip_special_tokens=False),
                               tok.decode(ids.tolist(), skip_special_tokens=True),
                               bool(void is not None and void[i, s:e].any()),
                               max_new_tokens=int(self.cfg.rollout.max_new_tokens), extract_answer=extract,
                               ngram=int(p["repetition_ngram"]), count=int(p["repetition_count"]))
                if f["invalid"]:
                    inv[i, s:e] = 1.0
                    bad += 1
                hit = [k for k in on if on[k] and f[k]]
                for k in hit:
                    counts[k] += 1.0
                if hit:
                    mask[i, s:e] = 0.0
            frac[i] = bad / len(spans) if spans else 0.0
            n_turns, n_invalid = n_turns + len(spans), n_invalid + bad
        skipped = bool(batch.response_mask.sum() > 0 and mask.sum() == 0)
        if not skipped:  # our choice: filters that would leave no loss token in the batch are skipped this step
            batch.response_mask = mask
        batch.extras[INVALID_KEY], batch.extras[INVALID_FRAC_KEY] = inv, frac
        out = {f"spear/filtered_{k}": v for k, v in counts.items()}
        out["spear/filters_skipped"] = float(skipped)
        out["spear/invalid_turn_frac"] = n_invalid / n_turns if n_turns else 0.0
        return out

    def filter_rollouts(self, batch: Any, step: int) -> Dict[str, float]:
        """SPEAR's std rollout filter on reward + bonus; keeps the batch's chosen rows in place (module docstring)."""
        ratio = float(self.p["rollout_filter_ratio"])
        n0 = len(batch)
        if ratio >= 1:
            return {"spear/rollout_rows_kept_frac": 1.0}
        gen = torch.Generator().manual_seed(int(self.cfg.seed) * 1_000_003 + step + 500_009)
        scores = batch.rewards.double() + batch.extras[TOOL_BONUS_KEY].double()
        keep = std_rollout_filter(scores, batch.group_index, ratio, gen)
        shrink_in_place(batch, keep)
        return {"spear/rollout_rows_kept_frac": len(batch) / max(1, n0)}

    def wrap_update(self, update: Any, run: RunServices, batch: Any) -> Optional[Dict[str, Any]]:
        step = int(run.step)
        gen = torch.Generator().manual_seed(int(self.cfg.seed) * 1_000_003 + step)
        replay = None
        if self.buffer.is_ready():
            pad = run.tokenizer.pad_token_id if run.tokenizer is not None and run.tokenizer.pad_token_id is not None else 0
            replay = self.buffer.take(gen, pad)
        out = dict(update())
        coef = replay_scale(step, coef=float(self.p["replay_coef"]), steps=int(self.p["replay_ramp_steps"]))
        out["spear/replay_rows"] = 0.0
        if replay is not None and coef > 0:
            replay.extras[REPLAY_KEY] = torch.full((len(replay),), coef)
            m = run.policy_update(replay, gen)
            out.update({f"spear/replay_{k.split('/')[-1]}": v for k, v in m.items()})
            out["spear/replay_rows"] = float(len(replay))
        out["spear/replay_coef"] = coef
        bonus = batch.extras.get(TOOL_BONUS_KEY)
        returns = batch.rewards.float() + (bonus.float() if bonus is not None else 0.0)
        frac = batch.extras.get(INVALID_FRAC_KEY)
        if frac is not None:  # the authors' buffer stores the penalised score
            returns = returns - float(self.p["invalid_action_penalty"]) * frac.float()
        out["spear/buffer_added"] = float(self.buffer.add(batch, returns, step))
        out["spear/buffer_rows"] = float(sum(len(b) for _, b in self.buffer.entries))
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {"buffer": self.buffer.state_dict()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if "buffer" in sd:
            self.buffer.load_state_dict(sd["buffer"])
