"""Test-time strategies of ``rlpost eval``: how the answer to each held-out problem is produced.

Without ``eval.test_time`` the evaluation decodes each problem greedily with the evaluated weights.
A test-time strategy replaces that one step: given the problem, the task (whose *visible* feedback it
may use) and the policy, it returns the response that is then scored, like any greedy response, by
the task's own verifier (:meth:`rlpost.tasks.base.Task.score`, e.g. HumanEval's hidden unit tests).
A strategy may spend compute per problem (sampling, search, per-instance updates of a transient
adapter), but must leave the evaluated weights as it found them before the next problem.

The one hook: :func:`build_test_time` turns ``eval.test_time`` / ``eval.test_time_params`` into a
strategy (None when unset) and :func:`rlpost.eval.evaluate.evaluate` calls its
:meth:`TestTimeStrategy.respond` instead of greedy decoding. ``rlpost eval`` names no strategy; each
registers in its own file under :data:`TEST_TIME` (catalog :mod:`rlpost.eval.test_time_catalog`).

Checks (:func:`check_config`, run by ``validate_config`` for every command): a known name, known
parameters (a misspelt key names the valid ones), no ``eval.n_samples > 1`` (the sampled pass@k
figures would not use the strategy). ``rlpost train`` refuses any ``eval.test_time``
(:func:`check_not_training`): a per-problem procedure at evaluation time is not a training run's
periodic evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from rlpost.core.errors import ConfigError
from rlpost.core.registry import Registry, plain

#: Registered test-time strategies (``eval.test_time=<name>``), each a :class:`TestTimeStrategy` subclass.
TEST_TIME = Registry("test-time strategy", "eval.test_time", typed_params=True,
                     catalog="rlpost.eval.test_time_catalog")


@dataclass
class TestTimeContext:
    """What a strategy may use besides the problem.

    Attributes:
        policy: the evaluated causal LM (the same module the engine generates with when it shares
            weights); a strategy that changes it must restore it bit for bit before returning.
        tokenizer: its tokenizer.
        engine: the :class:`rlpost.rollout.base.RolloutEngine` of the evaluation; after changing
            ``policy`` a strategy calls ``engine.sync_weights(policy)``.
        cfg: the whole run config (``trainer``, ``precision``, ``rollout``, ``model`` ...).
        device: the policy's device.
    """

    policy: Any
    tokenizer: Any
    engine: Any
    cfg: Any
    device: Any


class TestTimeStrategy:
    """Base class: produce one response per problem.

    Subclasses take their declared parameters as keyword-only ``__init__`` arguments (the registry
    checks them against the params dataclass) and implement :meth:`respond`.
    """

    name: str = ""

    def __init__(self, **params: Any) -> None:
        self.params = params

    def respond(self, task: Any, examples: List[Any], prompts: List[List[int]], ctx: TestTimeContext,
                max_new_tokens: int, stop: List[str], seed: int, bar: Any = None) -> Dict[str, Any]:
        """Responses to ``examples`` (token-id ``prompts``, one each).

        Returns:
            ``{"texts": [str], "lengths": [int] (tokens), "finished": [bool], "info": [dict]}``,
            one entry per example; ``info`` is written into that problem's evaluation record.
        """
        raise NotImplementedError


def _settings(eval_cfg: Any) -> tuple:
    name = getattr(eval_cfg, "test_time", None) if eval_cfg is not None else None
    params = getattr(eval_cfg, "test_time_params", None) if eval_cfg is not None else None
    return (str(name) if name else None), dict(plain(params) or {})


def check_config(cfg: Any) -> None:
    """``eval.test_time``: a registered name, its parameters, and no sampled pass@k beside it.

    Raises:
        ConfigError: unknown strategy (lists the choices); unknown or ill-typed parameter (names the
            valid keys and defaults); parameters without a strategy; ``eval.n_samples > 1``.
    """
    ev = getattr(cfg, "eval", None)
    name, params = _settings(ev)
    if name is None:
        if params:
            raise ConfigError(f"eval.test_time_params={params} is set but eval.test_time is not. "
                              f"Fix: eval.test_time=<one of {', '.join(TEST_TIME.names())}>, or drop the params.")
        return
    TEST_TIME.resolve(name, params, "eval.test_time_params")
    if int(getattr(ev, "n_samples", 1) or 1) > 1:
        raise ConfigError(f"eval.test_time={name} with eval.n_samples={ev.n_samples}: the sampled pass@k figures "
                          "would come from the plain weights, not the strategy. Fix: eval.n_samples=1.")


def check_not_training(cfg: Any) -> None:
    """``rlpost train`` refuses ``eval.test_time``.

    Raises:
        ConfigError: ``eval.test_time`` is set (names the command that runs it).
    """
    name, _ = _settings(getattr(cfg, "eval", None))
    if name is not None:
        raise ConfigError(f"eval.test_time={name} is an evaluation-time procedure (per-problem search or updates "
                          "on a transient adapter) and is not run by `rlpost train`. Fix: drop eval.test_time here "
                          f"and run `rlpost eval eval.test_time={name} eval.checkpoint=<run>/final` on the result.")


def build_test_time(cfg: Any) -> Optional[TestTimeStrategy]:
    """The strategy named by ``cfg.eval.test_time`` with its parameters, or None when unset.

    Raises:
        ConfigError: as :func:`check_config`.
    """
    check_config(cfg)
    name, params = _settings(cfg.eval)
    if name is None:
        return None
    resolved = TEST_TIME.resolve(name, params, "eval.test_time_params")
    strategy = TEST_TIME.get(name)(**{k: getattr(resolved, k) for k in resolved.__dataclass_fields__})
    strategy.name = name
    return strategy
