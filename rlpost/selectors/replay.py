"""Replay selectors: ``selector=popo`` (prioritized replay of mixed-reward groups instead of re-rollout, POPO)
and ``selector=rerule`` (hard-case groups of early steps appended to later batches, ReRULE)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from rlpost.core.batch import pad_cat
from rlpost.core.registry import param
from rlpost.samplers.base import SampleResult, concat_generations, select_rows
from rlpost.selectors.base import Role, SELECTORS, UniformSelector, is_zero_variance


@dataclass(frozen=True)
class PopoSelectorParams:
    """Parameters of :class:`PopoSelector` (Prioritized group replay)."""

    buffer_size: int = param(64, "groups kept.")
    max_age: int = param(8, "oldest replayable group, in steps.")
    recency_tau: float = param(4.0, "recency scale of the priority, in steps.")
    max_replays: int = param(2, "times one buffered group may be reused.")


@SELECTORS.register(
    "popo",
    paper="RLVR without Ineffective Samples: Group Prioritized Off-Policy Optimization for LLM Reasoning (POPO, arXiv:2606.01281)",
    description="Uniform prompts; zero-variance groups are swapped for buffered mixed-reward groups by priority.",
    params=PopoSelectorParams,
)
class PopoSelector(UniformSelector):
    """Prioritized group replay.

    Prompts are drawn like ``uniform``. After scoring (:meth:`postprocess`, run
    by the rollout driver), every group whose rewards are all equal is replaced
    by a buffered *effective* group (mixed rewards) of another prompt, chosen by
    priority ``quality * exp(-age / recency_tau)`` with ``quality`` the group's
    reward standard deviation and ``age`` the steps since it was generated;
    groups older than ``max_age`` are evicted. Each buffered group is replayed at
    most ``max_replays`` times. Fresh effective groups enter the buffer (capacity
    ``buffer_size``, lowest priority evicted). No extra rollouts are spent.

    Replayed rows keep their behaviour-policy ``rollout_logprobs``;
    ``extras['replay_age']`` (0 for fresh rows) lets the algorithm apply
    POPO's decoupled importance correction (behaviour vs proximal policy),
    which belongs to the loss side (``precision.correction`` / algo).

    Args:
        buffer_size: groups kept.
        max_age: oldest replayable group, in steps.
        recency_tau: recency scale of the priority, in steps.
        max_replays: times one buffered group may be reused.
    """

    roles = frozenset({Role.REPLAY})

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        seed: int = 0,
        *,
        buffer_size: int,
        max_age: int,
        recency_tau: float,
        max_replays: int,
    ) -> None:
        super().__init__(num_prompts, prompts_per_step, seed)
        self.buffer_size, self.max_age = int(buffer_size), int(max_age)
        self.recency_tau, self.max_replays = float(recency_tau), int(max_replays)
        self.buffer: List[Dict[str, Any]] = []
        self.replayed = 0

    def priority(self, entry: Dict[str, Any], step: int) -> float:
        """Replay priority of a buffered group at ``step``."""
        return entry["quality"] * math.exp(-(step - entry["step"]) / self.recency_tau)

    def postprocess(self, out: Any, step: int) -> Any:  # noqa: D102 - see class

        res, rw = out.result, out.rewards
        self.replayed = 0
        if rw is None:
            return out
        self.buffer = [e for e in self.buffer if step - e["step"] <= self.max_age and e["uses"] < self.max_replays]
        groups: Dict[int, List[int]] = {}
        for r, g in enumerate(res.group_index.tolist()):
            groups.setdefault(g, []).append(r)
        pos = res.positions()
        in_batch = {out.prompt_indices[int(pos[rows[0]])] for rows in groups.values()}
        fresh_effective = []
        pieces, gi, pp, rewards, age = [], [], [], [], []
        # per-row extras that travel with replayed groups (reward components, shared prefix lengths)
        row_keys = sorted(k for k, v in res.extras.items() if v.dim() == 1 and k != "replay_age")
        row_extras: List[Dict[str, torch.Tensor]] = []
        new_prompts = list(out.prompt_indices)
        for g, rows in sorted(groups.items()):
            r = rw[rows].tolist()
            use = None
            if is_zero_variance(r):
                cands = [e for e in self.buffer if e["prompt"] not in in_batch]
                if cands:
                    use = max(cands, key=lambda e: self.priority(e, step))
            if use is None:
                pieces.append(select_rows(res.generation, rows))
                gi += [g] * len(rows)
                pp += [int(pos[x]) for x in rows]
                rewards += r
                age += [0.0] * len(rows)
                row_extras.append({k: res.extras[k][rows] for k in row_keys})
                if not is_zero_variance(r):
                    fresh_effective.append((out.prompt_indices[int(pos[rows[0]])], rows, r))
            else:
                use["uses"] += 1
                in_batch.add(use["prompt"])
                new_prompts.append(use["prompt"])
                n = len(use["rewards"])
                pieces.append(use["gen"])
                gi += [g] * n
                pp += [len(new_prompts) - 1] * n
                rewards += use["rewards"]
                age += [float(step - use["step"])] * n
                row_extras.append(use.get("extras", {}))
                self.replayed += 1
        for p, rows, r in fresh_effective:
            t = torch.tensor(r)
            self.buffer.append({"prompt": p, "gen": select_rows(res.generation, rows), "rewards": r, "step": step, "uses": 0,
                                "quality": float(t.std(unbiased=False)),
                                "extras": {k: res.extras[k][rows].clone() for k in row_keys}})
        self.buffer.sort(key=lambda e: -self.priority(e, step))
        del self.buffer[self.buffer_size :]
        if self.replayed == 0:
            res.extras.setdefault("replay_age", torch.zeros(res.group_index.shape[0]))
            return out
        gen = concat_generations(pieces, int(getattr(res.generation, "pad_id", 0) or 0))
        extras = {"replay_age": torch.tensor(age)}
        for k in row_keys:  # a key a buffered group lacks (saved before it existed) reads 0
            like = res.extras[k]
            extras[k] = torch.cat([e[k] if k in e else torch.zeros(len(p.texts), dtype=like.dtype)
                                   for e, p in zip(row_extras, pieces)])
        used = sorted(set(pp))
        remap = {p: j for j, p in enumerate(used)}
        out.result = SampleResult(
            generation=gen,
            group_index=torch.tensor(gi, dtype=torch.long),
            rollouts_spent=res.rollouts_spent,
            extras=extras,
            metrics=res.metrics,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            prompt_position=torch.tensor([remap[p] for p in pp], dtype=torch.long),
        )
        out.prompt_indices = [new_prompts[p] for p in used]
        out.rewards = out.result.rewards
        return out

    def metrics(self) -> Dict[str, float]:  # noqa: D102
        return {"selector/replayed_groups": float(self.replayed), "selector/buffer": float(len(self.buffer))}

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102 - the buffer holds tensors (torch.save it)
        return {**super().state_dict(), "buffer": [dict(e) for e in self.buffer]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # noqa: D102
        super().load_state_dict(state)
        self.buffer = [dict(e) for e in state.get("buffer", [])]


@dataclass(frozen=True)
class ReruleSelectorParams:
    """Parameters of :class:`ReruleSelector` (hard-case replay). The paper's method section was not
    reached (only its abstract): every value is our choice."""

    reward_threshold: float = param(0.5, "a group is a hard case when its mean reward is below this (our choice: 0.5)")
    buffer_size: int = param(64, "hard-case groups kept, the least hard evicted first (our choice: 64)")
    replay_start: int = param(11, "first RL step that replays; groups are buffered only before it "
                                  "(our choice: 11, the second half of a 20-step recipe)")
    replay_ratio: float = param(0.25, "replayed groups per fresh group of a replay step, rounded up "
                                      "(our choice: 0.25)")
    max_replays: int = param(0, "times one buffered group may be replayed, 0 for no limit (our choice: 0)")


@SELECTORS.register(
    "rerule",
    paper="Replay What Matters: Off-Policy Replay for Efficient LLM Reinforcement Unlearning (ReRULE, arXiv:2606.15333)",
    description="Uniform prompts; low-reward hard-case groups of early steps are buffered and appended to later batches.",
    params=ReruleSelectorParams,
)
class ReruleSelector(UniformSelector):
    """Hard-case replay (ReRULE, arXiv:2606.15333; the rule is our reading of the abstract).

    Prompts are drawn like ``uniform``; :meth:`postprocess` (run by the rollout
    driver after scoring) has two stages:

    * **collection**, steps ``< replay_start``: each scored group whose mean
      reward is below ``reward_threshold`` and whose rewards are not all equal
      (an all-equal group has GRPO advantage 0: replaying it would add no
      gradient) is stored whole: its generation (with the behaviour policy's
      ``rollout_logprobs``), rewards, reward components and step. One entry per
      prompt (a newer hard group of the same prompt replaces the older). Past
      ``buffer_size`` entries the least hard one is evicted (highest mean
      reward; ties: the oldest). The batch is unchanged.
    * **replay**, steps ``>= replay_start``: nothing more is stored; ``k =
      ceil(replay_ratio * P)`` buffered groups (``P`` the step's groups) are
      appended to the batch, taken in the order fewest replays so far, lowest
      mean reward, oldest step, prompt index, skipping prompts already in the
      batch and, with ``max_replays > 0``, groups replayed that often. No
      rollout is spent on them.

    A replayed group keeps its stored rewards, so the step's estimator
    recomputes its group-relative advantage from them (for GRPO the same value
    as when it was sampled). Its rows keep the behaviour log-probs in
    ``rollout_logprobs`` and ``extras['replay_age']`` (steps since sampling; 0
    on fresh rows); the importance weight against the behaviour policy is the
    loss side's: ``precision.correction=tis`` multiplies each token's loss by
    ``min(pi_old / pi_behaviour, cap)`` (recipes/rerule.yaml sets it).
    The batch's per-row extras (``[B]`` and ``[B, R]``; wider ones are dropped on a replay step) travel
    with replayed rows, ``[B, R]`` ones right-padded with 0 to the widest.

    Args:
        reward_threshold: mean group reward below which a group is a hard case.
        buffer_size: entries kept (>= 1).
        replay_start: first replaying step (RL steps count from 1; >= 1).
        replay_ratio: replayed groups per fresh group (>= 0; 0 never replays).
        max_replays: replays of one entry at most (0: no limit).

    Raises:
        ValueError: ``buffer_size < 1``, ``replay_start < 1``, ``replay_ratio < 0`` or ``max_replays < 0``.
    """

    roles = frozenset({Role.REPLAY})

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        seed: int = 0,
        *,
        reward_threshold: float,
        buffer_size: int,
        replay_start: int,
        replay_ratio: float,
        max_replays: int,
    ) -> None:
        super().__init__(num_prompts, prompts_per_step, seed)
        if int(buffer_size) < 1:
            raise ValueError(f"rerule buffer_size must be >= 1, got {buffer_size}")
        if int(replay_start) < 1:
            raise ValueError(f"rerule replay_start must be >= 1 (RL steps count from 1), got {replay_start}")
        if float(replay_ratio) < 0:
            raise ValueError(f"rerule replay_ratio must be >= 0, got {replay_ratio}")
        if int(max_replays) < 0:
            raise ValueError(f"rerule max_replays must be >= 0 (0: no limit), got {max_replays}")
        self.reward_threshold, self.buffer_size = float(reward_threshold), int(buffer_size)
        self.replay_start, self.replay_ratio, self.max_replays = int(replay_start), float(replay_ratio), int(max_replays)
        self.buffer: List[Dict[str, Any]] = []
        self.replayed = 0
        self.stored = 0

    def is_hard(self, rewards: List[float]) -> bool:
        """A hard case worth replaying: mean reward below the threshold, rewards not all equal."""
        return bool(rewards) and sum(rewards) / len(rewards) < self.reward_threshold and not is_zero_variance(rewards)

    def replay_count(self, groups: int) -> int:
        """Groups to append at a replay step with ``groups`` fresh groups: ``ceil(replay_ratio * groups)``."""
        return int(math.ceil(self.replay_ratio * groups - 1e-9)) if self.replay_ratio > 0 else 0

    def store(self, entry: Dict[str, Any]) -> None:
        """Add a hard-case entry (keys ``prompt``, ``gen``, ``rewards``, ``step``, ``extras``), replacing an
        older entry of its prompt, then evict the least hard entries past ``buffer_size``."""
        entry = {**entry, "mean": sum(entry["rewards"]) / len(entry["rewards"]), "uses": 0}
        self.buffer = [e for e in self.buffer if e["prompt"] != entry["prompt"]]
        self.buffer.append(entry)
        self.buffer.sort(key=lambda e: (e["mean"], -e["step"], e["prompt"]))  # hardest, then newest, first
        del self.buffer[self.buffer_size :]

    def choose(self, k: int, exclude: set) -> List[Dict[str, Any]]:
        """The ``k`` entries to replay now (see the class docstring); their replay counts are incremented."""
        cands = [e for e in self.buffer if e["prompt"] not in exclude
                 and (self.max_replays == 0 or e["uses"] < self.max_replays)]
        cands.sort(key=lambda e: (e["uses"], e["mean"], e["step"], e["prompt"]))
        picked = cands[:k]
        for e in picked:
            e["uses"] += 1
        return picked

    def postprocess(self, out: Any, step: int) -> Any:  # noqa: D102 - see class
        res, rw = out.result, out.rewards
        self.replayed = self.stored = 0
        n_rows = res.group_index.shape[0]
        if rw is None:
            return out
        groups: Dict[int, List[int]] = {}
        for r, g in enumerate(res.group_index.tolist()):
            groups.setdefault(g, []).append(r)
        pos = res.positions()
        # per-row extras ([B] and [B, R]: reward components, token-level values) travel with stored groups
        row_keys = sorted(k for k, v in res.extras.items()
                          if k != "replay_age" and v.dim() in (1, 2) and v.shape[0] == n_rows)
        if step < self.replay_start:
            for g, rows in sorted(groups.items()):
                r = rw[rows].tolist()
                if self.is_hard(r):
                    self.store({"prompt": out.prompt_indices[int(pos[rows[0]])], "gen": select_rows(res.generation, rows),
                                "rewards": r, "step": int(step),
                                "extras": {k: res.extras[k][rows].clone() for k in row_keys}})
                    self.stored += 1
            res.extras.setdefault("replay_age", torch.zeros(n_rows))
            return out
        in_batch = {out.prompt_indices[int(pos[rows[0]])] for rows in groups.values()}
        picked = self.choose(self.replay_count(len(groups)), in_batch)
        if not picked:
            res.extras.setdefault("replay_age", torch.zeros(n_rows))
            return out
        self.replayed = len(picked)
        pieces = [res.generation] + [e["gen"] for e in picked]
        n_pos, next_g = len(out.prompt_indices), int(res.group_index.max()) + 1
        gi, pp, rewards, age = [res.group_index], [pos], [rw.float()], [torch.zeros(n_rows)]
        extras = {k: [res.extras[k]] for k in row_keys}
        for j, e in enumerate(picked):
            n = len(e["rewards"])
            gi.append(torch.full((n,), next_g + j, dtype=torch.long))
            pp.append(torch.full((n,), n_pos + j, dtype=torch.long))
            rewards.append(torch.tensor(e["rewards"], dtype=torch.float32))
            age.append(torch.full((n,), float(step - e["step"])))
            for k in row_keys:  # a key the entry lacks (stored before it existed) reads 0
                like = res.extras[k]
                extras[k].append(e["extras"][k] if k in e["extras"]
                                 else torch.zeros((n, *like.shape[1:]), dtype=like.dtype))
        pad = int(getattr(res.generation, "pad_id", 0) or 0)
        ex = {k: torch.cat(v) if v[0].dim() == 1 else pad_cat(v, 0) for k, v in extras.items()}
        ex["replay_age"] = torch.cat(age)
        out.result = SampleResult(
            generation=concat_generations(pieces, pad),
            group_index=torch.cat(gi),
            rollouts_spent=res.rollouts_spent,
            extras=ex,
            metrics=res.metrics,
            rewards=torch.cat(rewards),
            prompt_position=torch.cat(pp),
        )
        out.prompt_indices = list(out.prompt_indices) + [e["prompt"] for e in picked]
        out.rewards = out.result.rewards
        return out

    def metrics(self) -> Dict[str, float]:  # noqa: D102
        return {"selector/replayed_groups": float(self.replayed), "selector/buffer": float(len(self.buffer)),
                "selector/stored_groups": float(self.stored)}

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102 - the buffer holds tensors (torch.save it)
        return {**super().state_dict(), "buffer": [dict(e) for e in self.buffer]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # noqa: D102
        super().load_state_dict(state)
        self.buffer = [dict(e) for e in state.get("buffer", [])]
