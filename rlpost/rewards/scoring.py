"""Score responses with a task's verifier, isolated in a worker process with a timeout.

A verifier that raises, hangs or kills its process gives reward 0 for that
sample and is counted in the metrics (``reward/verifier_errors``,
``reward/verifier_timeouts``); it never stops the run.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

_WORKER_TASK: Any = None


def _score_one(args: Tuple[str, Any]) -> Tuple[str, float, bool]:
    response, example = args
    try:
        s = float(_WORKER_TASK.score(response, example))
        if s != s:  # NaN
            return ("error", 0.0, False)
        fmt = bool(_WORKER_TASK.format_ok(response))
        return ("ok", s, fmt)
    except Exception:  # noqa: BLE001 - any verifier failure becomes reward 0
        return ("error", 0.0, False)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv:2503.14476, Eq. 13).

    0 for ``len <= max_len - buffer``; ``-penalty * (len - (max_len - buffer)) / buffer``
    inside the buffer window; ``-penalty`` beyond ``max_len``.

    Args:
        lengths: ``[B]`` response lengths in tokens.
        max_len: the generation limit; buffer: window width (> 0).
    Returns:
        ``[B]`` float penalties (<= 0).
    """
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    start = max_len - buffer
    over = (lengths.float() - start).clamp(min=0.0)
    return -penalty * torch.clamp(over / buffer, max=1.0)


class RewardFunction:
    """Scores batches of responses for one task.

    Args:
        task: a :class:`rlpost.tasks.Task` (its ``score`` may raise or hang).
        timeout_s: time allowed per response.
        format_weight: weight of ``task.format_ok`` added to correctness.
        overlong_buffer, overlong_penalty, max_len: DAPO soft overlong shaping.
        length_penalty: subtracted per response token.
        isolate: run the verifier in a worker process (True) or in-process
            (False: no hang protection, for debugging).
        majority_vote: TTRL pseudo-labels (Zuo et al., "TTRL: Test-Time
            Reinforcement Learning", arXiv:2504.16084): responses to the same
            prompt (same ``Example.index``) vote with their extracted answers
            (``task.answer_key``); the most frequent answer becomes the label and
            each response is scored against it by the task's verifier. Gold
            answers are only used for the monitoring metrics
            ``reward/ttrl_label_accuracy`` and ``reward/gold_correct_mean``.
    """

    def __init__(
        self,
        task: Any,
        timeout_s: float = 5.0,
        format_weight: float = 0.0,
        overlong_buffer: int = 0,
        overlong_penalty: float = 1.0,
        max_len: int = 0,
        length_penalty: float = 0.0,
        isolate: bool = True,
        majority_vote: bool = False,
    ) -> None:
        self.task = task
        self.timeout_s = float(timeout_s)
        self.format_weight = format_weight
        self.overlong_buffer = overlong_buffer
        self.overlong_pen = overlong_penalty
        self.max_len = max_len
        self.length_penalty = length_penalty
        self.isolate = isolate
        self.majority_vote = majority_vote
        self._pool: Optional[Any] = None

    @classmethod
    def from_config(cls, task: Any, reward_cfg: Any, max_len: int = 0) -> "RewardFunction":
        """Build from a ``task.reward`` node (:class:`rlpost.config.schema.RewardConfig`).

        Args:
            task: the task whose verifier scores responses.
            reward_cfg: ``cfg.task.reward``.
            max_len: generation limit in tokens (``rollout.max_new_tokens``), the
                end of DAPO's overlong window.
        """
        g = lambda k, d: getattr(reward_cfg, k, d) if reward_cfg is not None else d  # noqa: E731
        return cls(
            task,
            timeout_s=g("timeout_s", 5.0),
            format_weight=g("format_weight", 0.0),
            overlong_buffer=g("overlong_buffer", 0),
            overlong_penalty=g("overlong_penalty", 1.0),
            max_len=max_len,
            length_penalty=g("length_penalty", 0.0),
            majority_vote=bool(g("majority_vote", False)),
        )

    def _ensure_pool(self) -> Any:
        global _WORKER_TASK
        if self._pool is None:
            _WORKER_TASK = self.task
            ctx = mp.get_context("fork")
            from rlpost.interrupts import ignore_sigint

            self._pool = ctx.Pool(1, initializer=ignore_sigint)  # Ctrl-C is the runner's to handle
        return self._pool

    def _restart(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def close(self) -> None:
        """Stop the worker process."""
        self._restart()

    def correctness(self, responses: Sequence[str], examples: Sequence[Any]) -> Tuple[List[float], List[bool], Dict[str, float]]:
        """Verifier scores and format flags for each response, plus failure counts.

        Returns:
            ``(scores, format_ok, counts)`` where counts has ``errors`` and ``timeouts``.
        """
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
            return scores, fmts, {"errors": errors, "timeouts": 0}
        i = 0
        while i < n:
            pool = self._ensure_pool()
            pending = [(j, pool.apply_async(_score_one, ((responses[j], examples[j]),))) for j in range(i, n)]
            restarted = False
            for j, res in pending:
                deadline = time.monotonic() + self.timeout_s
                try:
                    st, s, f = res.get(timeout=max(0.0, deadline - time.monotonic()))
                except mp.TimeoutError:
                    timeouts += 1
                    self._restart()
                    i = j + 1
                    restarted = True
                    break
                except Exception:  # worker died (segfault, os._exit)
                    errors += 1
                    self._restart()
                    i = j + 1
                    restarted = True
                    break
                scores[j], fmts[j] = s, f
                errors += st == "error"
            if not restarted:
                i = n
        return scores, fmts, {"errors": errors, "timeouts": timeouts}

    def __call__(
        self, responses: Sequence[str], examples: Sequence[Any], lengths: torch.Tensor
    ) -> Tuple[torch.Tensor, Dict[str, float]]:
        """Shaped rewards ``[B]`` and metrics for a batch.

        ``reward = correctness + format_weight * format_ok + overlong_penalty
        - length_penalty * length``.

        Args:
            responses: decoded responses, examples: their :class:`Example`\\ s,
            lengths: ``[B]`` response lengths in tokens.
        """
        extra: Dict[str, float] = {}
        if self.majority_vote:
            scores, fmts, counts, extra = self._ttrl_correctness(responses, examples)
        else:
            scores, fmts, counts = self.correctness(responses, examples)
        corr = torch.tensor(scores, dtype=torch.float32)
        fmt = torch.tensor([float(f) for f in fmts])
        r = corr + self.format_weight * fmt
        if self.overlong_buffer > 0 and self.max_len > 0:
            r = r + overlong_penalty(lengths, self.max_len, self.overlong_buffer, self.overlong_pen)
        if self.length_penalty:
            r = r - self.length_penalty * lengths.float()
        metrics = {
            "reward/correct_mean": float(corr.mean()) if len(corr) else 0.0,
            "reward/format_mean": float(fmt.mean()) if len(fmt) else 0.0,
            "reward/verifier_errors": float(counts["errors"]),
            "reward/verifier_timeouts": float(counts["timeouts"]),
            **extra,
        }
        return r, metrics

    def _ttrl_correctness(
        self, responses: Sequence[str], examples: Sequence[Any]
    ) -> Tuple[List[float], List[bool], Dict[str, float], Dict[str, float]]:
        """Scores against per-prompt majority-vote labels (TTRL), plus label-quality metrics."""
        from rlpost.eval.stats import majority_vote

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
