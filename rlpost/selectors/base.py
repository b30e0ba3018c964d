"""Prompt selectors: which dataset prompts enter each RL step.

A selector keeps state across steps (reward histories, posteriors), is updated
with each step's rewards, and is saved in checkpoints so that a resumed run
selects exactly the same prompts.
"""

from __future__ import annotations

import copy
import enum
from typing import Any, ClassVar, Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from rlpost.core.errors import ConfigError
from rlpost.core.registry import Registry, defaults_of

SELECTORS = Registry("prompt selector", "selector", typed_params=True)


def is_zero_variance(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """True when all rewards of a group are equal (GRPO advantage 0 for every row)."""
    return len(rewards) == 0 or (max(rewards) - min(rewards)) <= tol


def success_counts(rewards: Sequence[float], threshold: float = 0.5, binary: bool = False):
    """``(successes, failures)`` of one group of rewards in [0, 1].

    ``binary``: a reward counts as a success when ``>= threshold``; otherwise
    fractional rewards add fractional evidence (``r`` successes, ``1 - r``
    failures, clipped to [0, 1]).
    """
    r = np.clip(np.asarray(rewards, dtype=np.float64), 0.0, 1.0)
    if binary:
        s = float((r >= threshold).sum())
        return s, float(len(r)) - s
    return float(r.sum()), float((1.0 - r).sum())


def success_rate(rewards: Sequence[float], threshold: float = 0.5) -> float:
    """Share of one group's rewards that are ``>= threshold`` (a group accuracy in [0, 1]).

    Returns 0.0 for an empty group.
    """
    r = list(rewards)
    return sum(1 for x in r if x >= threshold) / len(r) if r else 0.0


def append_history(store: Dict[int, List[Any]], i: int, record: Any, window: Optional[int] = None) -> None:
    """Append ``record`` to prompt ``i``'s list in ``store``, keeping only the newest ``window``.

    ``window`` None keeps every record. The per-prompt bookkeeping of the
    history-based selectors (HIVE's accuracies, SEELE's ``(hint, accuracy, n)``
    rounds).
    """
    h = store.setdefault(int(i), [])
    h.append(record)
    if window is not None and len(h) > window:
        del h[: len(h) - window]


def pack_state(value: Any) -> Any:
    """Checkpoint form of one selector attribute listed in :attr:`Selector.saved_state`.

    A NumPy array becomes a nested list; a dict keyed by prompt index gets
    string keys and copied values. Raises TypeError for anything else.
    """
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): copy.deepcopy(v) for k, v in value.items()}
    raise TypeError(f"cannot save selector state of type {type(value).__name__}")


def unpack_state(saved: Any, like: Any) -> Any:
    """Inverse of :func:`pack_state`; ``like`` (the live attribute) gives the type and dtype."""
    if isinstance(like, np.ndarray):
        return np.asarray(saved, dtype=like.dtype)
    return {int(k): copy.deepcopy(v) for k, v in dict(saved).items()}


class Role(str, enum.Enum):
    """What a selector does besides choosing prompts (:meth:`Selector.select`, every selector's role).

    A selector declares its extra roles in :attr:`Selector.roles`; the rollout
    driver (:func:`rlpost.run.collect.collect_rollouts`) calls a role's
    methods only when it is declared, and the partial-rollout producer refuses
    selectors with any extra role. Each role has its methods on the base class:

    * ``FILTER`` (group filtering): :meth:`Selector.keep_group`, :meth:`Selector.refill`,
      :attr:`Selector.max_rounds` (DAPO's dynamic sampling).
    * ``ALLOCATE`` (rollout allocation): :meth:`Selector.rollout_counts` (CurES).
    * ``HINT`` (hints): :meth:`Selector.hint_fractions` (SEELE).
    * ``REPLAY`` (batch replay): :meth:`Selector.postprocess` (POPO).
    """

    FILTER = "group filtering"
    ALLOCATE = "rollout allocation"
    HINT = "hints"
    REPLAY = "batch replay"


#: methods a selector overrides for each role (checked when a subclass is defined)
ROLE_METHODS: Dict[Role, Tuple[str, ...]] = {
    Role.FILTER: ("keep_group", "refill"),
    Role.ALLOCATE: ("rollout_counts",),
    Role.HINT: ("hint_fractions",),
    Role.REPLAY: ("postprocess",),
}


class Selector:
    """Base class.

    Args:
        num_prompts: size of the training split (indices ``0..num_prompts-1``).
        prompts_per_step: prompts to return from :meth:`select`.
        seed: seed of the selector's own random generator.

    Roles: every selector chooses prompts (:meth:`select`, :meth:`update`).
    Extra roles are declared in :attr:`roles` (see :class:`Role`); the methods
    of an undeclared role keep their base defaults, and defining a subclass that
    overrides a role's method without declaring the role (or the reverse) is a
    ``TypeError``. An instance may narrow its class's roles in ``__init__``
    (CurES with ``allocate=false``).

    Raises:
        ValueError: an empty split or ``prompts_per_step < 1``.
    """

    #: the extra roles this selector plays (see :class:`Role`)
    roles: ClassVar[FrozenSet[Role]] = frozenset()
    #: generation rounds per step at most (the ``FILTER`` role's refills)
    max_rounds: int = 1
    #: attributes that :meth:`state_dict` saves and :meth:`load_state_dict` restores
    #: (NumPy arrays, or dicts keyed by prompt index; see :func:`pack_state`)
    saved_state: Tuple[str, ...] = ()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        for role, methods in ROLE_METHODS.items():
            overridden = [m for m in methods if getattr(cls, m) is not getattr(Selector, m)]
            if overridden and role not in cls.roles:
                raise TypeError(f"{cls.__name__} overrides {overridden} but does not declare Role.{role.name} in roles")
            if role in cls.roles and len(overridden) < len(methods):
                raise TypeError(f"{cls.__name__} declares Role.{role.name} but does not define {list(methods)}")

    def __init__(self, num_prompts: int, prompts_per_step: int, seed: int = 0, **params: Any) -> None:
        if num_prompts <= 0:
            raise ValueError("the training split is empty")
        if prompts_per_step <= 0:
            raise ValueError("prompts_per_step must be >= 1")
        self.num_prompts = num_prompts
        self.prompts_per_step = prompts_per_step
        self.rng = np.random.default_rng(seed)
        self.skipped = 0  # prompts considered and skipped during the last select()

    def plays(self, role: Role) -> bool:
        """Whether this selector plays ``role`` (declared in :attr:`roles`)."""
        return role in self.roles

    # --- Role.FILTER
    def keep_group(self, rewards: Sequence[float]) -> bool:
        """``FILTER``: whether a scored group enters the batch."""
        return True

    def refill(self, n: int) -> List[int]:
        """``FILTER``: ``n`` more candidate prompts for the current step (distinct from the step's others)."""
        return []

    # --- Role.ALLOCATE
    def rollout_counts(self, prompt_indices: List[int]) -> Optional[List[int]]:
        """``ALLOCATE``: rollouts per selected prompt, or None for the sampler's default."""
        return None

    # --- Role.HINT
    def hint_fractions(self, prompt_indices: List[int]) -> Optional[List[float]]:
        """``HINT``: share in [0, 1] of each prompt's reference solution given as a hint, or None."""
        return None

    # --- Role.REPLAY
    def postprocess(self, out: Any, step: int) -> Any:
        """``REPLAY``: edit the scored step rollouts (a ``StepRollouts``) before training; default unchanged."""
        return out

    def attach(self, **resources: Any) -> None:
        """Receive run resources (``examples=``, ``prompt_entropy=``); unknown ones are ignored."""

    def select(self, step: int) -> List[int]:
        """Dataset indices of the prompts for ``step``."""
        raise NotImplementedError

    def update(self, prompt_indices: List[int], rewards: List[List[float]]) -> None:
        """Record the rewards of each selected prompt's rollouts (one list per prompt)."""

    def metrics(self) -> Dict[str, float]:
        """Selector metrics for the step log (``selector/...``)."""
        return {}

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue identically after a resume: the RNG and :attr:`saved_state`."""
        return {"rng": self.rng.bit_generator.state, **{k: pack_state(getattr(self, k)) for k in self.saved_state}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            KeyError: an attribute of :attr:`saved_state` is missing from ``state``.
        """
        self.rng.bit_generator.state = state["rng"]
        for k in self.saved_state:
            setattr(self, k, unpack_state(state[k], getattr(self, k)))


@SELECTORS.register("uniform", paper="", description="Shuffled passes over the training split (the baseline).")
class UniformSelector(Selector):
    """Epoch-wise shuffled order without replacement; reshuffles after each pass."""

    def __init__(self, num_prompts: int, prompts_per_step: int, seed: int = 0, **params: Any) -> None:
        if params:
            raise TypeError(f"{type(self).__name__} takes no parameters {sorted(params)}")
        super().__init__(num_prompts, prompts_per_step, seed)
        self.order: List[int] = []
        self.pos = 0

    def select(self, step: int) -> List[int]:
        """The next ``prompts_per_step`` prompts of the shuffled order, all distinct.

        A step that crosses the end of a pass takes the rest of the pass, then
        the first prompts of a fresh shuffle that are not in the step already
        (the ones skipped stay at the front of the new pass, so each pass still
        covers every prompt once). With ``prompts_per_step > num_prompts`` a step
        cannot be distinct; prompts then repeat across passes.
        """
        return self._take(self.prompts_per_step)

    def _take(self, n: int, exclude: Sequence[int] = (), allow_repeats: bool = True) -> List[int]:
        """``n`` prompts of the shuffled passes, distinct from each other and from ``exclude``.

        When every prompt of the split is taken: with ``allow_repeats`` the
        passes continue (repeats are unavoidable), else fewer than ``n`` are returned.
        """
        out: List[int] = []
        taken = set(int(i) for i in exclude)
        while len(out) < n:
            if self.pos >= len(self.order):
                self.order = self.rng.permutation(self.num_prompts).tolist()
                self.pos = 0
            rest = self.order[self.pos :]
            fresh = [i for i in rest if i not in taken]
            if not fresh:  # every prompt of this pass is already taken: start a new pass
                if len(taken) >= self.num_prompts:
                    if not allow_repeats:
                        break
                    taken = set()  # more prompts per step than the split holds: repeats are unavoidable
                self.pos = len(self.order)
                continue
            take = fresh[: n - len(out)]
            # move the taken prompts to the front of what is left of the pass, keeping the others' order
            chosen = set(take)
            self.order[self.pos :] = take + [i for i in rest if i not in chosen]
            self.pos += len(take)
            out.extend(take)
            taken.update(take)
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "order": list(self.order), "pos": self.pos}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.order = list(state["order"])
        self.pos = int(state["pos"])


def build_selector(cfg: Any, num_prompts: int, seed: int, n_samples: Optional[int] = None) -> Selector:
    """Instantiate ``cfg.name`` with ``cfg.params``.

    ``n_samples`` (the algorithm's group size) is passed to selectors that
    allocate rollouts (their declared parameters include ``n_samples``) unless
    the params set it.

    Raises:
        ConfigError: unknown selector or unknown parameter.
    """

    cls = SELECTORS.get(cfg.name)
    params = dict(cfg.params or {})
    if n_samples is not None and "n_samples" in defaults_of(SELECTORS.params_of(cfg.name)):
        params.setdefault("n_samples", int(n_samples))
    try:
        return cls(num_prompts, cfg.prompts_per_step, seed, **params)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"selector={cfg.name}: bad selector.params {params}: {e}") from None
