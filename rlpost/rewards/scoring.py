"""Score responses with a task's verifier, isolated in a worker process with a timeout.

A verifier that raises, hangs or kills its process gives reward 0 for that
sample and is counted in the metrics (``reward/verifier_errors``,
``reward/verifier_timeouts``); it never stops the run.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rlpost.rewards.models import REWARD_COMPONENTS  # noqa: F401  (re-exported: the rule components)
from rlpost.core.voting import majority_vote
from rlpost.core.errors import ConfigError, VerifierTimeout
from rlpost.rewards.models import build_model_rewards, check_estimator

_WORKER_TASK: Any = None


def verify(task: Any, response: str, example: Any) -> Tuple[str, float, bool]:
    """One verifier call: ``(status, score, format_ok)``; a raising or NaN verifier is ``("error", 0.0, False)``,
    one that ended at its own time limit (:class:`rlpost.core.errors.VerifierTimeout`) ``("timeout", 0.0, False)``.

    The one place a row's correctness is computed, in the driver, its verifier
    process and the Ray reward workers (:mod:`rlpost.ray_pool.reward_workers`) alike.
    """
    try:
        s = float(task.score(response, example))
        if s != s:  # NaN
            return ("error", 0.0, False)
        fmt = bool(task.format_ok(response))
        return ("ok", s, fmt)
    except VerifierTimeout:
        return ("timeout", 0.0, False)
    except Exception:  # noqa: BLE001 - any verifier failure becomes reward 0
        return ("error", 0.0, False)


def _score_one(args: Tuple[str, Any]) -> Tuple[str, float, bool]:
    response, example = args
    return verify(_WORKER_TASK, response, example)


class _WorkerDied(Exception):
    """The verifier worker process ended while scoring (its reply never came)."""


def _worker_loop(conn: Any, runner_end: Any = None) -> None:
    """Body of the verifier worker: score each ``(response, example)`` received until ``None``.

    ``runner_end`` is the runner's end of the pipe, inherited through ``fork``: the worker closes
    its copy first, so that when the runner dies (even by SIGKILL) ``recv`` sees end-of-file and
    the worker exits instead of waiting forever on a pipe it holds open itself.
    """
    import signal

    if runner_end is not None:
        runner_end.close()

    # Ctrl-C and `kill -TERM -PGID` reach the whole process group: the runner handles them (it
    # finishes the step, which still needs this worker) and ends the worker itself with SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):
            return
        if item is None:
            return
        conn.send(_score_one(item))


class _VerifierWorker:
    """One forked process that runs verifier calls, talking to the runner over a private pipe.

    Why not ``multiprocessing.Pool``: a pool's workers and its shutdown share a
    queue lock, and a worker that dies while holding it (an idle worker waits for
    work inside that lock, so a SIGTERM sent to the whole process group kills it
    there) makes ``Pool.terminate`` wait for the lock forever: a run that saved its
    checkpoint on SIGTERM then never exited. Here nothing is shared but a pipe, so
    a timeout, a crash or shutdown is always ``kill`` + ``join``.

    The task is inherited through ``fork`` (module global ``_WORKER_TASK``), not
    pickled. The process is daemonic, so an interpreter that exits without
    :meth:`close` still ends it.
    """

    def __init__(self, task: Any) -> None:
        global _WORKER_TASK
        _WORKER_TASK = task
        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_loop, args=(child, self._conn), daemon=True, name="rlpost-verifier")
        self._proc.start()
        child.close()
        # before multiprocessing's own exit hook, which would SIGTERM (ignored here) and join forever
        atexit.register(self.kill)

    def call(self, item: Tuple[str, Any], timeout_s: float) -> Tuple[str, float, bool]:
        """Score one ``(response, example)``: ``(status, score, format_ok)``.

        Raises:
            TimeoutError: no answer within ``timeout_s`` seconds (the caller kills the worker).
            _WorkerDied: the worker ended before answering.
        """
        try:  # (TimeoutError is an OSError: raised outside this block)
            self._conn.send(item)
            answered = self._conn.poll(timeout_s)
            if answered:
                return self._conn.recv()
        except (EOFError, OSError) as e:
            raise _WorkerDied(str(e)) from None
        raise TimeoutError(f"verifier took longer than {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL the worker and reap it (used after a timeout or a crash)."""
        atexit.unregister(self.kill)
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(5)
        self._conn.close()

    def close(self) -> None:
        """Ask the worker to exit; kill it if it has not within one second."""
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(1.0)
        self.kill()


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale, arXiv:2503.14476, Eq. 13): the only implementation in rlpost.

    With ``L_max = max_len`` and ``L_cache = buffer`` (both in tokens): 0 when
    ``L <= L_max - L_cache``; ``((L_max - L_cache) - L) / L_cache * penalty``
    (linear from 0 down to ``-penalty``) inside the window; ``-penalty`` beyond
    ``L_max``. The paper's setting is ``L_max = 20480``, ``L_cache = 4096``: the
    last 20% of the response budget (:func:`resolve_overlong_buffer` turns a
    fraction into tokens).

    Args:
        lengths: ``[B]`` response lengths in generated tokens.
        max_len: the generation limit ``L_max`` (``rollout.max_new_tokens``).
        buffer: the window ``L_cache`` in tokens; ``<= 0`` turns the penalty off.
        penalty: magnitude at the limit (the paper uses 1).
    Returns:
        ``[B]`` float32 penalties (<= 0).
    Raises:
        ValueError: ``buffer > max_len``.
    """
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    if buffer > max_len:
        raise ValueError(f"overlong buffer must be in (0, max_len={max_len}] tokens, got {buffer}")
    start = max_len - buffer
    over = (lengths.float() - start).clamp(min=0.0)
    return -penalty * torch.clamp(over / buffer, max=1.0)


def resolve_overlong_buffer(buffer: float, max_len: int) -> int:
    """The overlong window in tokens: ``buffer >= 1`` is tokens, ``0 < buffer < 1`` a share of ``max_len``.

    DAPO (arXiv:2503.14476) punishes the last 4096 of 20480 tokens, i.e. a
    share of 0.2; the share is rounded to the nearest token, at least 1.

    Raises:
        ValueError: a negative buffer, a whole-token buffer that is not an
            integer, or a share without ``max_len``.
    """
    b = float(buffer or 0)
    if b < 0:
        raise ValueError(f"overlong buffer must be >= 0, got {buffer}")
    if b == 0:
        return 0
    if b < 1:
        if max_len <= 0:
            raise ValueError(f"an overlong buffer given as a share ({buffer}) needs max_len (rollout.max_new_tokens)")
        return max(1, int(round(b * max_len)))
    if b != int(b):
        raise ValueError(f"an overlong buffer >= 1 is a token count and must be an integer, got {buffer}")
    return int(b)


def _row_of(score: Any, i: int) -> Any:
    """Row ``i`` of a :class:`rlpost.rewards.models.ModelScore` as a one-row score (what a later model reads)."""
    from rlpost.rewards.models import ModelScore

    return ModelScore(values=score.values.reshape(-1)[i:i + 1],
                      token_rewards=None if score.token_rewards is None else score.token_rewards[i:i + 1],
                      raw=None if score.raw is None else score.raw.reshape(-1)[i:i + 1])


def _score_row_by_row(model: Any, name: str, responses: Sequence[str], examples: Sequence[Any],
                      prior: Dict[str, Any], err: Exception) -> Any:
    """Score each row alone after ``model``'s batch call raised ``err``: a row that raises again scores 0 and
    counts as one error; the other rows keep their own scores. Logged once per batch.

    Raises:
        ConfigError: a row's call raised one (a setting, not a row, is wrong).

    Returns:
        a :class:`rlpost.rewards.models.ModelScore` for the whole batch (``values [B]``, ``errors`` = failed
        rows, token rewards ``[]`` on a failed row, the per-row metrics summed).
    """
    from rlpost.rewards.models import ModelScore

    values, raw, tokens, errors, metrics = [], [], [], 0, {}
    any_tokens = any_raw = False
    for i, (resp, ex) in enumerate(zip(responses, examples)):
        try:
            one = model.score([resp], [ex], {k: _row_of(v, i) for k, v in prior.items()})
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - this row is the failing one
            values.append(0.0)
            raw.append(0.0)
            tokens.append([])
            errors += 1
            continue
        values.append(float(one.values.reshape(-1)[0]))
        raw.append(float(one.values.reshape(-1)[0] if one.raw is None else one.raw.reshape(-1)[0]))
        any_raw |= one.raw is not None
        tokens.append(list(one.token_rewards[0]) if one.token_rewards is not None else [])
        any_tokens |= one.token_rewards is not None
        errors += int(one.errors)
        for k, v in one.metrics.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    logging.getLogger(__name__).warning(
        "reward model %r raised on a batch of %d rows (%s: %s); scored row by row: %d row(s) failed and score 0",
        name, len(responses), type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "", errors)
    return ModelScore(values=torch.tensor(values, dtype=torch.float32), errors=errors, metrics=metrics,
                      token_rewards=tokens if any_tokens else None,
                      raw=torch.tensor(raw, dtype=torch.float32) if any_raw else None)


#: reward components, in the order they are summed (:meth:`RewardFunction.score`)


@dataclass
class Rewards:
    """Scored responses: the total reward and its parts.

    Attributes:
        total: ``[B]`` float32 reward that training and selectors use:
            ``correct + format + overlong + length``.
        components: ``{"correct", "format", "overlong", "length"} -> [B]`` float32
            (format, overlong and length already weighted / signed).
        metrics: ``reward/...`` values of this call (means, verifier failure counts).
        format_ok: ``[B]`` float32 1/0 format flags (monitoring; their weighted
            share is the ``format`` component), or None.
        token_rewards: per row, ``(response token index, reward)`` pairs from a
            process reward model (:mod:`rlpost.rewards.process`), or None;
            :func:`rlpost.samplers.base.score_rows` turns them into
            ``extras['turn_rewards']`` ``[B, R]`` (added to the estimator's token rewards).
    """

    total: torch.Tensor
    components: Dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)
    format_ok: Optional[torch.Tensor] = None
    token_rewards: Optional[List[List[Tuple[int, float]]]] = None


class RewardFunction:
    """Scores batches of responses for one task: the one owner of every reward term.

    Correctness (the task's verifier), the format bonus, DAPO's soft overlong
    punishment and the per-token length penalty are all computed here, from
    the responses' generated token counts; nothing downstream reshapes rewards.

    Args:
        task: a :class:`rlpost.tasks.Task` (its ``score`` may raise or hang).
        timeout_s: time allowed per response.
        format_weight: weight of ``task.format_ok`` added to correctness.
        overlong_buffer: DAPO's window ``L_cache``: tokens when >= 1, a share of
            ``max_len`` when in (0, 1) (DAPO, arXiv:2503.14476: 4096 of 20480 = 0.2);
            0 = off. Resolved to tokens at construction (``self.overlong_buffer``).
        overlong_penalty: DAPO's penalty at the limit (the paper: 1).
        max_len: the generation limit ``L_max`` in tokens (``rollout.max_new_tokens``).
        length_penalty: subtracted per generated response token.
        isolate: run the verifier in a worker process (True) or in-process
            (False: no hang protection, for debugging).
        majority_vote: TTRL pseudo-labels (Zuo et al., "TTRL: Test-Time
            Reinforcement Learning", arXiv:2504.16084): responses to the same
            prompt (same ``Example.index``) vote with their extracted answers
            (``task.answer_key``); the most frequent answer becomes the label and
            each response is scored against it by the task's verifier. Gold
            answers are only used for the monitoring metrics
            ``reward/ttrl_label_accuracy`` and ``reward/gold_correct_mean``
            (a second verifier call per response).
        models: model rewards (name -> :class:`rlpost.rewards.models.ModelReward`,
            ``task.reward.models``): each weighted score is one more component,
            named after its entry, added to the total.
        correct_weight: weight of the rule verifier's correctness in the total
            (``task.reward.correct_weight``; 0 for a model-only reward).

    Attributes:
        verifier_calls: responses handed to the verifier so far (a counter for
            tests and ``reward/verifier_calls``).
        backend: None (the verifier runs here: in the forked worker process, or
            in-process without ``isolate``) or an object with
            ``correctness(responses, examples, fallback)`` (same return as
            :meth:`correctness`), ``pop_metrics()`` and ``close()`` that runs the
            verifier elsewhere, e.g. Ray reward workers
            (:class:`rlpost.ray_pool.reward_workers.RayRewardPool`); ``fallback`` is
            this object's own isolated scorer, for rows the backend could not score.

    Raises:
        ValueError: a bad overlong buffer (:func:`resolve_overlong_buffer`, or
            larger than ``max_len``).
    """

    def __init__(
        self,
        task: Any,
        timeout_s: float = 5.0,
        format_weight: float = 0.0,
        overlong_buffer: float = 0,
        overlong_penalty: float = 1.0,
        max_len: int = 0,
        length_penalty: float = 0.0,
        isolate: bool = True,
        majority_vote: bool = False,
        models: Optional[Dict[str, Any]] = None,
        correct_weight: float = 1.0,
    ) -> None:
        self.task = task
        self.timeout_s = float(timeout_s)
        self.format_weight = format_weight
        self.overlong_buffer = resolve_overlong_buffer(overlong_buffer, max_len)
        if self.overlong_buffer > 0 and max_len > 0 and self.overlong_buffer > max_len:
            raise ValueError(f"overlong buffer {self.overlong_buffer} tokens exceeds max_len={max_len}")
        self.overlong_pen = overlong_penalty
        self.max_len = max_len
        self.length_penalty = length_penalty
        self.isolate = isolate
        self.majority_vote = majority_vote
        self.verifier_calls = 0
        self.backend: Optional[Any] = None
        self._pool: Optional[Any] = None
        self.models: Dict[str, Any] = dict(models or {})
        self.correct_weight = float(correct_weight)

    @classmethod
    def from_config(cls, task: Any, reward_cfg: Any, max_len: int = 0, old_spelling: Optional[Dict[str, Any]] = None) -> "RewardFunction":
        """Build from a ``task.reward`` node (:class:`rlpost.config.schema.RewardConfig`).

        Args:
            task: the task whose verifier scores responses.
            reward_cfg: ``cfg.task.reward``.
            max_len: generation limit in tokens (``rollout.max_new_tokens``), the
                end of DAPO's overlong window.
            old_spelling: ``overlong_buffer`` / ``overlong_penalty`` written in
                ``algo.adv_params`` (the old spelling,
                :func:`rlpost.algos.validate.old_shaping_spelling`); applied like
                ``task.reward``'s own keys.

        Raises:
            rlpost.core.errors.ConfigError: both spellings set an overlong window
                (the punishment would count twice), or a bad window.
        """

        g = lambda k, d: getattr(reward_cfg, k, d) if reward_cfg is not None else d  # noqa: E731
        buf, pen = g("overlong_buffer", 0), g("overlong_penalty", 1.0)
        ps = {k: v for k, v in dict(old_spelling or {}).items() if k in ("overlong_buffer", "overlong_penalty")}
        if float(ps.get("overlong_buffer", 0) or 0) > 0:
            if float(buf or 0) > 0:
                raise ConfigError(
                    f"task.reward.overlong_buffer={buf} and algo.adv_params.overlong_buffer={ps['overlong_buffer']} "
                    f"both ask for DAPO's overlong punishment, which would then count twice. Fix: set it once, "
                    f"as task.reward.overlong_buffer (algo.adv_params.overlong_buffer is its old spelling).")
            buf, pen = ps["overlong_buffer"], ps.get("overlong_penalty", 1.0)

        models = build_model_rewards(g("models", None), task)  # start-time checks: score head, endpoint
        try:
            return cls(
                task,
                models=models,
                correct_weight=g("correct_weight", 1.0),
                timeout_s=g("timeout_s", 5.0),
                format_weight=g("format_weight", 0.0),
                overlong_buffer=buf,
                overlong_penalty=pen,
                max_len=max_len,
                length_penalty=g("length_penalty", 0.0),
                majority_vote=bool(g("majority_vote", False)),
            )
        except ValueError as e:
            raise ConfigError(f"task.reward: {e}. Fix: an overlong_buffer in (0, 1) (share of rollout.max_new_tokens) "
                              f"or a whole number of tokens <= rollout.max_new_tokens.") from None

    def _ensure_pool(self) -> "_VerifierWorker":
        if self._pool is None:
            self._pool = _VerifierWorker(self.task)
        return self._pool

    def _restart(self) -> None:
        if self._pool is not None:
            self._pool.kill()
            self._pool = None

    def close(self) -> None:
        """Stop the worker process (never blocks for more than about a second), the backend's workers and the
        model rewards."""
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        for m in self.models.values():
            m.close()

    def attach(self, tokenizer: Any = None, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> None:
        """Hand the policy tokenizer and the trainer's dtype and device to the model rewards (loads their weights)."""
        for m in self.models.values():
            m.attach(tokenizer=tokenizer, dtype=dtype, device=device)

    def state_dict(self) -> Dict[str, Any]:
        """``{entry name: state}`` of the model rewards with cross-step state (a running normaliser's statistics)."""
        return {name: st for name, m in self.models.items() if (st := m.state_dict())}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; an entry this config no longer has is ignored."""
        for name, st in state.items():
            if name in self.models:
                self.models[name].load_state_dict(st)

    def check_estimator(self, adv_estimator: str) -> None:
        """Raise :class:`rlpost.core.errors.ConfigError` when a process reward meets an estimator that drops token rewards."""

        check_estimator(self.models, adv_estimator)

    def begin_step(self) -> None:
        """A new RL step: model rewards clear their per-step caches (the judge's request cache)."""
        for m in self.models.values():
            m.begin_step()

    def correctness(self, responses: Sequence[str], examples: Sequence[Any]) -> Tuple[List[float], List[bool], Dict[str, float]]:
        """Verifier scores and format flags for each response, plus failure counts.

        Returns:
            ``(scores, format_ok, counts)`` where counts has ``errors`` and ``timeouts``.
        """
        self.verifier_calls += len(responses)
        if self.backend is not None:
            return self.backend.correctness(responses, examples, self._local_correctness)
        return self._local_correctness(responses, examples)

    def _local_correctness(self, responses: Sequence[str], examples: Sequence[Any]
                           ) -> Tuple[List[float], List[bool], Dict[str, int]]:
        """:meth:`correctness` in this process: the forked verifier worker (``isolate``) or directly."""
        global _WORKER_TASK
        n = len(responses)
        scores = [0.0] * n
        fmts = [False] * n
        errors = timeouts = 0
        if not self.isolate:
            _WORKER_TASK = self.task
            for i, a in enumerate(zip(responses, examples)):
                st, s, f = _score_one(a)
                scores[i], fmts[i] = s, f
                errors += st == "error"
                timeouts += st == "timeout"
            return scores, fmts, {"errors": errors, "timeouts": timeouts}
        for j in range(n):
            worker = self._ensure_pool()
            try:
                st, s, f = worker.call((responses[j], examples[j]), self.timeout_s)
            except TimeoutError:
                timeouts += 1
                self._restart()
                continue
            except _WorkerDied:  # segfault, os._exit, killed from outside
                errors += 1
                self._restart()
                continue
            scores[j], fmts[j] = s, f
            errors += st == "error"
            timeouts += st == "timeout"
        return scores, fmts, {"errors": errors, "timeouts": timeouts}

    def __call__(
        self, responses: Sequence[str], examples: Sequence[Any], lengths: torch.Tensor
    ) -> Tuple[torch.Tensor, Dict[str, float]]:
        """``(total [B], metrics)`` of :meth:`score` (the same numbers, without the components)."""
        r = self.score(responses, examples, lengths)
        return r.total, r.metrics

    def score(self, responses: Sequence[str], examples: Sequence[Any], lengths: torch.Tensor,
              overlong_lengths: Optional[torch.Tensor] = None) -> Rewards:
        """Shaped rewards of a batch, with their components.

        ``reward = correctness + format_weight * format_ok + overlong_penalty(overlong_length)
        - length_penalty * length``.

        Args:
            responses: decoded responses (what the verifier judges).
            examples: their :class:`rlpost.tasks.Example`\\ s.
            lengths: ``[B]`` response lengths in generated tokens (the rollout's
                response mask summed, plus a tree branch's shared prefix).
            overlong_lengths: ``[B]`` lengths DAPO's overlong window compares with ``max_len``
                (``rollout.max_new_tokens``, a per-turn budget); None: ``lengths``. Multi-turn
                episodes pass their longest model turn: the budget is per turn, so an episode whose
                every turn ended inside it is not punished for its summed length (docs/AGENTS.md).
        Returns:
            :class:`Rewards` (float32 ``[B]`` total and components, ``reward/...`` metrics).
        """
        extra: Dict[str, float] = {}
        if self.majority_vote:
            scores, fmts, counts, extra = self._ttrl_correctness(responses, examples)
        else:
            scores, fmts, counts = self.correctness(responses, examples)
        corr = torch.tensor(scores, dtype=torch.float32)
        fmt = torch.tensor([float(f) for f in fmts], dtype=torch.float32)
        lengths = torch.as_tensor(lengths).reshape(-1)
        ol = lengths if overlong_lengths is None else torch.as_tensor(overlong_lengths).reshape(-1)
        if ol.numel() != lengths.numel():
            raise ValueError(f"score: {ol.numel()} overlong_lengths for {lengths.numel()} lengths (one per response)")
        parts = {
            "correct": corr,
            "format": self.format_weight * fmt,
            "overlong": (overlong_penalty(ol, self.max_len, self.overlong_buffer, self.overlong_pen)
                         if self.overlong_buffer > 0 and self.max_len > 0 else torch.zeros(len(corr))),
            "length": -float(self.length_penalty) * lengths.float() if self.length_penalty else torch.zeros(len(corr)),
        }
        parts["correct"] = self.correct_weight * corr if self.correct_weight != 1.0 else corr
        model_metrics, token_rewards = self._model_parts(responses, examples, parts, counts)
        total = sum(parts.values(), torch.zeros(len(corr)))
        metrics = {
            "reward/correct_mean": float(corr.mean()) if len(corr) else 0.0,
            "reward/format_mean": float(fmt.mean()) if len(fmt) else 0.0,
            "reward/verifier_errors": float(counts["errors"]),
            "reward/verifier_timeouts": float(counts["timeouts"]),
            **extra,
            **model_metrics,
            **(self.backend.pop_metrics() if self.backend is not None else {}),
        }
        if self.models:
            metrics["reward/rule_correct_mean"] = float(corr.mean()) if len(corr) else 0.0
        return Rewards(total.float(), {k: v.float() for k, v in parts.items()}, metrics, fmt, token_rewards)

    def _model_parts(self, responses: Sequence[str], examples: Sequence[Any], parts: Dict[str, torch.Tensor],
                     counts: Dict[str, int]) -> Tuple[Dict[str, float], Optional[List[List[Tuple[int, float]]]]]:
        """Score with each model reward (config order); add its weighted component to ``parts``.

        A model's failed rows score 0 and are added to ``counts['errors']`` (as
        verifier errors are). A model whose batch call raises is called again row by row
        (:func:`_score_row_by_row`): only the rows that raise alone fail. Returns ``reward/<name>_...`` metrics and the
        token rewards of the process rewards (summed per position), or None.
        """
        metrics: Dict[str, float] = {}
        token: Optional[List[List[Tuple[int, float]]]] = None
        prior: Dict[str, Any] = {}
        for name, m in self.models.items():
            try:
                out = m.score(responses, examples, prior)
            except ConfigError:  # a setting is wrong: every row would fail; the run stops with the fix
                raise
            except Exception as e:  # noqa: BLE001 - a forward error or a bad row: isolate it to its row
                out = _score_row_by_row(m, name, responses, examples, prior, e)
            prior[name] = out
            v = out.values.float().reshape(-1)
            parts[name] = float(m.weight) * v
            counts["errors"] += int(out.errors)
            metrics[f"reward/{name}_mean"] = float(v.mean()) if len(v) else 0.0
            metrics[f"reward/{name}_errors"] = float(out.errors)
            metrics.update(out.metrics)
            if out.token_rewards is not None:
                token = [[] for _ in responses] if token is None else token
                for i, row in enumerate(out.token_rewards):
                    token[i].extend((int(t), float(m.weight) * float(r)) for t, r in row)
        return metrics, token

    def _ttrl_correctness(
        self, responses: Sequence[str], examples: Sequence[Any]
    ) -> Tuple[List[float], List[bool], Dict[str, float], Dict[str, float]]:
        """Scores against per-prompt majority-vote labels (TTRL), plus label-quality metrics."""
        groups: Dict[Any, List[int]] = {}
        for i, ex in enumerate(examples):
            groups.setdefault((ex.index, ex.question), []).append(i)
        keys = [self.task.answer_key(r) for r in responses]
        pseudo: List[Any] = list(examples)
        labelled = [False] * len(responses)
        winners: List[int] = []
        ratios: List[float] = []
        for members in groups.values():
            j = majority_vote([keys[i] for i in members])
            if j is None:
                continue
            w = members[j]
            winners.append(w)
            ratios.append(sum(keys[i] == keys[w] for i in members) / len(members))
            label = self.task.extract_answer(responses[w])
            for i in members:
                pseudo[i] = self.task.with_answer(examples[i], label)
                labelled[i] = True
        scores, fmts, counts = self.correctness(responses, pseudo)
        scores = [s if ok else 0.0 for s, ok in zip(scores, labelled)]
        gold, _, gcounts = self.correctness(responses, examples)
        counts = {k: counts[k] + gcounts[k] for k in counts}
        extra = {
            "reward/ttrl_label_accuracy": float(sum(gold[w] > 0.5 for w in winners) / len(groups)) if groups else 0.0,
            "reward/ttrl_majority_ratio": float(sum(ratios) / len(ratios)) if ratios else 0.0,
            "reward/gold_correct_mean": float(sum(gold) / len(gold)) if gold else 0.0,
        }
        return scores, fmts, counts, extra


class StepScorer:
    """The one scorer of one step's rollouts (issue: produce and score exactly once).

    Wraps the run's :class:`RewardFunction` with the training examples, so a
    sampler or producer scores rows by dataset index. Every call scores fresh
    responses; nothing is ever scored twice, and the totals it returns are the
    rewards training uses. Per-step metrics are accumulated over calls (a
    sampler may score several rounds): verifier errors, timeouts and calls are
    summed, TTRL's label metrics averaged over scored responses.

    Args:
        reward_fn: the run's :class:`RewardFunction`.
        examples: the training split (dataset index -> :class:`rlpost.tasks.Example`).
    """

    def __init__(self, reward_fn: RewardFunction, examples: Sequence[Any]) -> None:
        self.reward_fn = reward_fn
        self.examples = examples
        self.calls = 0
        self.seconds = 0.0  # wall time spent scoring (``time/reward_s``)
        self._sums: Dict[str, float] = {}
        self._n = 0
        if hasattr(reward_fn, "begin_step"):
            reward_fn.begin_step()  # a new step: the judge's request cache starts empty

    def __call__(self, prompt_indices: Sequence[int], texts: Sequence[str], lengths: torch.Tensor,
                 overlong_lengths: Optional[torch.Tensor] = None) -> Rewards:
        """Score ``texts[i]`` (answering dataset prompt ``prompt_indices[i]``, ``lengths[i]`` generated tokens;
        ``overlong_lengths[i]``: the length DAPO's overlong shaping compares, an episode's longest turn).

        Returns:
            :class:`Rewards` of the call.
        Raises:
            ValueError: the three arguments differ in length.
        """
        n = len(texts)
        if len(prompt_indices) != n or int(torch.as_tensor(lengths).numel()) != n:
            raise ValueError(f"score: {len(prompt_indices)} indices, {n} texts, {torch.as_tensor(lengths).numel()} lengths")
        if n == 0:
            z = torch.zeros(0)
            return Rewards(z, {k: z for k in REWARD_COMPONENTS}, {})
        before, t0 = self.reward_fn.verifier_calls, time.perf_counter()
        out = self.reward_fn.score(list(texts), [self.examples[int(i)] for i in prompt_indices], lengths,
                                   overlong_lengths=overlong_lengths)
        self.seconds += time.perf_counter() - t0
        self.calls += self.reward_fn.verifier_calls - before
        self._n += n
        for k, v in out.metrics.items():
            if k in ("reward/verifier_errors", "reward/verifier_timeouts") or k.endswith(_SUMMED):
                self._sums[k] = self._sums.get(k, 0.0) + v
            elif (k.startswith("reward/ttrl_") or k == "reward/gold_correct_mean"
                  or k.startswith(self._model_keys)):
                self._sums[k] = self._sums.get(k, 0.0) + v * n
        return out

    def metrics(self) -> Dict[str, float]:
        """``reward/verifier_calls``, ``reward/verifier_errors``, ``reward/verifier_timeouts`` (sums over
        the step's calls) and TTRL's label metrics (means over scored responses)."""
        m = {"reward/verifier_calls": float(self.calls), "reward/verifier_errors": 0.0, "reward/verifier_timeouts": 0.0}
        for k, v in self._sums.items():
            m[k] = v if (k in m or k.endswith(_SUMMED)) else v / max(1, self._n)
        return m

    @property
    def _model_keys(self) -> Tuple[str, ...]:
        """``reward/<name>_`` prefixes of the model rewards (their means are averaged over rows) and the rule's."""
        names = tuple(getattr(self.reward_fn, "models", {}) or {})
        return tuple(f"reward/{n}_" for n in names) + ("reward/rule_correct_mean",) if names else ("\0",)


#: per-call counts that a step sums (model-reward failures, judge requests, cache hits)
_SUMMED = ("_errors", "_parse_errors", "_requests", "_cache_hits", "_no_step_rows", "_timeouts",
           "_failures", "_restarts", "_rescored")
