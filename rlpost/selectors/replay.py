"""``selector=popo``: prioritized replay of mixed-reward groups instead of re-rollout (POPO)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List

import torch

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
