"""``selector=pope``: oracle-solution prefixes as guidance on hard prompts (POPE).

POPE ("POPE: Learning to Reason on Hard Problems via Privileged On-Policy
Exploration", Qu, Setlur, Smith, Salakhutdinov, Kumar, arXiv:2601.18779; code
https://github.com/CMU-AIRe/POPE) trains on hard problems, those the policy
never solves, by conditioning rollouts on a prefix of an oracle (human) solution
so that the guided rollouts can earn reward. The oracle text is guidance, never a
training target: only the tokens the policy samples after it carry loss. Hard
problems are trained in both their guided and their unguided form, and the
behaviour learnt under guidance transfers to the unguided problem.

The prefix rides on the driver's hint path (:class:`rlpost.selectors.base.Role`
``HINT``, shared with ``selector=seele``): its token ids open the assistant turn
(prompt tokens, no loss, no log-probs) and the verifier judges prefix +
completion as one answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from rlpost.core.registry import param
from rlpost.selectors.base import SELECTORS, Role, UniformSelector, success_rate


@dataclass(frozen=True)
class PopeSelectorParams:
    """Parameters of :class:`PopeSelector` (oracle-prefix guidance on hard prompts)."""

    prefix_frac: float = param(0.25, "share of the oracle solution (characters) a hard prompt's first guided visit gets.")
    prefix_step: float = param(0.25, "growth of that share after a guided visit that solved nothing.")
    max_prefix: float = param(0.75, "largest share of the oracle solution given.")
    threshold: float = param(0.5, "reward at or above which a rollout counts as a success.")


@SELECTORS.register(
    "pope",
    paper="POPE: Learning to Reason on Hard Problems via Privileged On-Policy Exploration (arXiv:2601.18779); "
    "code https://github.com/CMU-AIRe/POPE",
    description="Uniform prompts; a prompt the policy never solves alternates between unguided visits and visits "
    "guided by a prefix of its oracle solution (prefix in the context, no loss on it).",
    params=PopeSelectorParams,
)
class PopeSelector(UniformSelector):
    """Privileged on-policy exploration: oracle-solution prefixes on hard prompts only.

    Prompts are drawn like ``uniform``. Each prompt carries a state:

    * **hard**: its latest *unguided* visit had no success (all ``n`` rewards below
      ``threshold``; the paper's "0 of n solved"). A prompt is unguided until it
      has been seen once, and is no longer hard once an unguided visit succeeds.
    * **prefix share** ``h`` in ``[prefix_frac, max_prefix]``: starts at
      ``prefix_frac`` and grows by ``prefix_step`` after a guided visit that
      solved nothing, and stays put once a guided visit succeeds.

    A hard prompt's visits alternate guided / unguided (a 1:1 guided:unguided
    mix over its visits); every other prompt is unguided (hint fraction 0).
    :meth:`hint_fractions` returns ``h`` for guided visits, which the driver
    turns into the first ``round(h * len(solution))`` characters of the task's
    :meth:`rlpost.tasks.base.Task.reference_solution` (GSM8K-style data carry a
    worked solution; without one it is the bare answer, so the task needs a
    ``solution`` field for the method to mean anything).

    Which tokens get gradient: only the completion the policy sampled after the
    prefix (the prefix is part of ``prompt_ids``); the reward is that of prefix +
    completion.

    Where the paper leaves it open or we simplify: the paper picks, offline, the
    shortest oracle prefix under which the base model solves the problem at least
    once; here that search runs online, one ``prefix_step`` per failed guided
    visit (our choice). The paper puts the prefix in the user turn with an
    instruction to continue from it; here it opens the assistant turn (the
    model continues the partial solution directly, no instruction text needed),
    which is the driver's existing hint path. Hardness comes from the policy's
    own unguided visits during training rather than a pass@k filter run before it
    (the paper's k=128 at 32k tokens is far beyond a CPU budget). The
    alternation fixes the guided:unguided ratio at 1:1.

    Args:
        num_prompts, prompts_per_step, seed: as ``uniform``.
        prefix_frac: first prefix share of a hard prompt.
        prefix_step: increase after a guided visit with no success.
        max_prefix: cap on the share.
        threshold: success threshold of a reward.

    Raises:
        ValueError: ``prefix_frac`` / ``max_prefix`` outside (0, 1], ``prefix_frac >
            max_prefix`` or ``prefix_step < 0``.
    """

    roles = frozenset({Role.HINT})
    saved_state = ("hard", "prefix", "last_hint")

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        seed: int = 0,
        *,
        prefix_frac: float = 0.25,
        prefix_step: float = 0.25,
        max_prefix: float = 0.75,
        threshold: float = 0.5,
    ) -> None:
        super().__init__(num_prompts, prompts_per_step, seed)
        if not (0 < prefix_frac <= 1 and 0 < max_prefix <= 1):
            raise ValueError(f"pope: prefix_frac={prefix_frac} and max_prefix={max_prefix} must lie in (0, 1]")
        if prefix_frac > max_prefix:
            raise ValueError(f"pope: prefix_frac={prefix_frac} is above max_prefix={max_prefix}")
        if prefix_step < 0:
            raise ValueError(f"pope: prefix_step={prefix_step} must be >= 0")
        self.prefix_frac, self.prefix_step, self.max_prefix = float(prefix_frac), float(prefix_step), float(max_prefix)
        self.threshold = float(threshold)
        self.hard: Dict[int, bool] = {}
        self.prefix: Dict[int, float] = {}
        self.last_hint: Dict[int, float] = {}
        self.step_hints: List[float] = []

    def is_hard(self, i: int) -> bool:
        """Whether prompt ``i``'s latest unguided visit solved nothing (False before any visit)."""
        return bool(self.hard.get(int(i), False))

    def hint_fractions(self, prompt_indices: List[int]) -> Optional[List[float]]:  # noqa: D102 - see class
        out = []
        for i in (int(x) for x in prompt_indices):
            guided = self.is_hard(i) and self.last_hint.get(i, 0.0) <= 0.0  # alternate: guided after unguided
            out.append(self.prefix.get(i, self.prefix_frac) if guided else 0.0)
        self.step_hints = list(out)
        for i, h in zip(prompt_indices, out):
            self.last_hint[int(i)] = h
        return out

    def update(self, prompt_indices, rewards):  # noqa: D102 - see class
        for i, r in zip(prompt_indices, rewards):
            i, r = int(i), list(r)
            if not r:
                continue
            solved = success_rate(r, self.threshold) > 0
            if self.last_hint.get(i, 0.0) > 0:  # a guided visit: grow the prefix until it suffices
                if not solved:
                    self.prefix[i] = min(self.max_prefix, self.prefix.get(i, self.prefix_frac) + self.prefix_step)
            else:
                self.hard[i] = not solved

    def metrics(self) -> Dict[str, float]:
        """``selector/guided_frac`` (share of this step's prompts guided), ``selector/prefix_mean``
        (mean prefix share of the guided ones, 0 if none), ``selector/hard_known`` (prompts marked hard)."""
        h = [x for x in self.step_hints if x > 0]
        return {
            "selector/guided_frac": float(len(h) / len(self.step_hints)) if self.step_hints else 0.0,
            "selector/prefix_mean": float(np.mean(h)) if h else 0.0,
            "selector/hard_known": float(sum(self.hard.values())),
        }
