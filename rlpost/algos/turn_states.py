"""What a turn of a multi-turn episode row is, for estimators that match turns across a group's episodes.

Used by ``hgpo`` (:mod:`rlpost.algos.hgpo`), ``rtmc`` (:mod:`rlpost.algos.rtmc`) and ``g2po``
(:mod:`rlpost.algos.g2po`), which all pool the returns of turns that reached the same state in
different episodes of one group.

**The state of a turn (our choice).** An episode row (:mod:`rlpost.samplers.episode`) is
``model turn 1 | environment text | model turn 2 | ...`` with ``response_mask`` 1 exactly on the
model's sampled tokens. The state a turn starts from is identified here by the **token ids of the
environment text inserted just before it** (its *observation*; the first turn's observation is the
prompt, shared by the whole group, since a group is one prompt's episodes). Why this and not
something else:

* it is what the environment exposes to the model, for every environment alike, with no new
  interface: for ``env=frozenlake`` it is the rendered board (the game's Markov state: position and
  map), for ``env=calculator`` / ``env=python`` the tool results (two episodes whose calls gave the
  same result are in the same information state about the task, whatever their wording);
* the inserted ids are deterministic in the environment's reply (``render_insert`` renders the
  messages with the chat template; nothing sampled is in them), so exact id equality is exact text
  equality of the reply. One caveat: a turn that stopped at ``</tool_call>`` gets the template's
  end-of-turn text inserted before the reply, a turn that ended with the end-of-turn token does not,
  so the same reply after the two kinds of stop counts as two observations;
* the model's own text is kept apart (the *action* signature: the ids of the turn's sampled
  tokens): sampled text is almost never equal across episodes at temperature 1, so a state key that
  included it would put almost every turn in a group of its own. Each estimator says whether its
  history keys include actions (HGPO's context does, by default: the paper's context is the prompt
  the model saw).

Matching is exact (interned tuples of ids, no hash collisions). Rows of different groups are never
matched (every key carries the group id).

**Rewards of a turn.** ``r_k`` = the token rewards summed over turn ``k``'s tokens
(``AdvantageInput.token_rewards``: per-turn environment rewards from ``env_reward_at=turn`` and a
KL-in-reward penalty), plus the row's outcome reward on its last turn; the return-to-go
``G_k = sum_{k' >= k} gamma^(k' - k) r_k'`` (discount per turn). These are the quantities every
turn-level estimator here pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from rlpost.algos.turns import turn_spans

#: observation id of a row's first turn: the prompt (every row of a group shares it)
PROMPT_OBS = 0


@dataclass(frozen=True)
class Turn:
    """One model turn of one episode row.

    Attributes:
        row: the row in the batch; index: the turn's number in its episode (0-based).
        start, end: the turn's token span in the response (end exclusive).
        group: the row's group id (``AdvantageInput.group_index``).
        obs: interned id of the environment text just before the turn (:data:`PROMPT_OBS` for turn 0).
        act: interned id of the turn's sampled token ids.
        next_obs: interned id of the environment text after the turn, None for the episode's last turn.
        reward: ``r_k`` (token rewards of the turn, plus the outcome on the last turn).
        ret: ``G_k``, the discounted per-turn return-to-go.
    """

    row: int
    index: int
    start: int
    end: int
    group: int
    obs: int
    act: int
    next_obs: Optional[int]
    reward: float
    ret: float


def episode_turns(response_ids: Optional[torch.Tensor], response_mask: torch.Tensor, rewards: torch.Tensor,
                  group_index: torch.Tensor, token_rewards: Optional[torch.Tensor], gamma: float) -> List[List[Turn]]:
    """Split every row into its turns with their observation / action ids, rewards and returns.

    Args:
        response_ids: ``[B, R]`` long token ids (``AdvantageInput.response_ids``).
        response_mask: ``[B, R]`` 0/1; its maximal runs of 1 are the model's turns.
        rewards: ``[B]`` outcome rewards; group_index: ``[B]`` long.
        token_rewards: ``[B, R]`` or None, summed per turn.
        gamma: discount per turn of the return-to-go, in [0, 1].
    Returns:
        per row, its :class:`Turn` list in order (empty for a row without model tokens).
    Raises:
        ValueError: ``response_ids`` is None (the caller must pass the batch's ids), shapes differ,
            or gamma is outside [0, 1].
    """
    if response_ids is None:
        raise ValueError("this turn-level estimator matches turns by the environment text between them and needs "
                         "AdvantageInput.response_ids ([B, R] token ids); AdvantageInput.from_batch passes the batch's")
    if response_ids.shape != response_mask.shape:
        raise ValueError(f"response_ids {tuple(response_ids.shape)} and response_mask {tuple(response_mask.shape)} differ")
    if not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    obs_ids: Dict[Tuple[int, ...], int] = {}
    act_ids: Dict[Tuple[int, ...], int] = {}

    def intern(table: Dict[Tuple[int, ...], int], key: Tuple[int, ...], first: int) -> int:
        if key not in table:
            table[key] = first + len(table)
        return table[key]

    tr = token_rewards.double() if token_rewards is not None else None
    out: List[List[Turn]] = []
    for i in range(response_mask.shape[0]):
        spans = turn_spans(response_mask[i])
        ids = response_ids[i].tolist()
        n = len(spans)
        r = [float(tr[i, s:e].sum()) if tr is not None else 0.0 for s, e in spans]
        if n:
            r[-1] += float(rewards[i])
        g, run = [0.0] * n, 0.0
        for k in range(n - 1, -1, -1):
            run = r[k] + gamma * run
            g[k] = run
        obs = [PROMPT_OBS] + [intern(obs_ids, tuple(ids[spans[k - 1][1]:spans[k][0]]), PROMPT_OBS + 1)
                              for k in range(1, n)]
        gi = int(group_index[i])
        out.append([Turn(row=i, index=k, start=s, end=e, group=gi, obs=obs[k],
                         act=intern(act_ids, tuple(ids[s:e]), 0),
                         next_obs=obs[k + 1] if k + 1 < n else None, reward=r[k], ret=g[k])
                    for k, (s, e) in enumerate(spans)])
    return out


def history_key(turns: Sequence[Turn], k: int, depth: int, with_actions: bool) -> Tuple[Hashable, ...]:
    """The key of turn ``k``'s state with its last ``depth`` steps of history.

    ``(group, obs_k, (act_{k-1}, obs_{k-1}), ..., (act_{k-d}, obs_{k-d}))`` with ``d = min(depth, k)``
    (the history cannot reach before the episode's start); with ``with_actions=False`` the actions
    are left out, so only what the environment returned is compared. Two turns with equal keys share
    their current observation and those ``d`` previous steps; ``depth >= k`` compares the whole
    history.
    """
    t = turns[k]
    key: List[Hashable] = [t.group, t.obs]
    for j in range(1, min(depth, k) + 1):
        p = turns[k - j]
        key.append((p.act if with_actions else None, p.obs))
    return tuple(key)


def broadcast_turns(turns: List[List[Turn]], values: Dict[Tuple[int, int], float], shape: Tuple[int, int]) -> torch.Tensor:
    """``[B, R]`` float64: ``values[(row, turn index)]`` on that turn's tokens, 0 elsewhere (environment
    tokens and padding included)."""
    out = torch.zeros(shape, dtype=torch.float64)
    for row in turns:
        for t in row:
            out[t.row, t.start:t.end] = values.get((t.row, t.index), 0.0)
    return out


def zscores(xs: Sequence[float], eps: float, norm_by_std: bool) -> List[float]:
    """``(x - mean) / (std + eps)`` (unbiased std; ``x - mean`` without ``norm_by_std``) of one group's
    values; exactly 0 for every member of a group whose values are all equal (a group of one included)."""
    t = torch.tensor(list(xs), dtype=torch.float64)
    if t.numel() < 2 or bool((t == t[0]).all()):
        return [0.0] * t.numel()
    a = t - t.mean()
    if norm_by_std:
        a = a / (t.std() + eps)
    return a.tolist()
