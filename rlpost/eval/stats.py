"""Evaluation statistics: pass@k, maj@k, mean@k and bootstrap confidence intervals.

All functions are pure (numpy in, floats out) so they can be checked against
closed forms with a few hand-written numbers.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Sequence, Union

import numpy as np

from rlpost.core.errors import ConfigError
from rlpost.core.voting import majority_vote


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct.

    Implements Eq. (1) of Chen et al., "Evaluating Large Language Models Trained
    on Code" (arXiv:2107.03374): ``1 - C(n - c, k) / C(n, k)``, the probability
    that at least one of ``k`` samples drawn without replacement from the ``n`` is
    correct. Computed as a running product so large ``n`` does not overflow.

    Args:
        n: samples drawn for the problem (>= 1).
        c: correct samples among them (0 <= c <= n).
        k: budget (1 <= k <= n).
    Returns:
        A probability in [0, 1].
    Raises:
        ConfigError: ``k`` outside ``[1, n]`` (raise ``eval.n_samples`` or lower
            ``eval.ks``) or ``c`` outside ``[0, n]``.
    """
    if not 1 <= k <= n:
        raise ConfigError(f"pass@{k} needs 1 <= k <= n_samples, got n={n}; set eval.n_samples >= {k} or drop {k} from eval.ks")
    if not 0 <= c <= n:
        raise ConfigError(f"pass@k: correct count c={c} outside [0, n={n}]")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def maj_at_k(
    answers: Sequence[Optional[Hashable]],
    correct: Sequence[float],
    k: int,
    rng: Optional[np.random.Generator] = None,
    draws: int = 64,
) -> float:
    """Expected majority-vote accuracy with ``k`` of one problem's ``n`` samples (maj@k).

    The voted answer is the most frequent extracted answer (see
    :func:`majority_vote`) and it is correct if the sample carrying it was
    scored correct. With ``k == n`` this is the plain majority over all samples;
    with ``k < n`` it is averaged over ``draws`` random ``k``-subsets (Monte-Carlo
    estimate of the expectation over subsets).

    Args:
        answers: ``[n]`` normalised extracted answers (None: none found).
        correct: ``[n]`` correctness in [0, 1] of each sample.
        k: voters (1 <= k <= n).
    Raises:
        ConfigError: ``k`` outside ``[1, n]`` or mismatched lengths.
    """
    n = len(answers)
    if len(correct) != n:
        raise ConfigError(f"maj@k: {n} answers but {len(correct)} correctness values")
    if not 1 <= k <= n:
        raise ConfigError(f"maj@{k} needs 1 <= k <= n_samples (n={n}); raise eval.n_samples or drop {k} from eval.ks")

    def vote(idx: Sequence[int]) -> float:
        j = majority_vote([answers[i] for i in idx])
        return 0.0 if j is None else float(correct[idx[j]])

    if k == n:
        return vote(list(range(n)))
    rng = rng if rng is not None else np.random.default_rng(0)
    return float(np.mean([vote(list(rng.choice(n, size=k, replace=False))) for _ in range(draws)]))


def bootstrap_ci(
    values: Sequence[float], n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
) -> Dict[str, float]:
    """Percentile bootstrap confidence interval of a mean.

    Resamples the ``[N]`` per-problem values with replacement ``n_boot`` times
    (Efron & Tibshirani, "An Introduction to the Bootstrap", 1993).

    Returns:
        ``{"mean", "ci_low", "ci_high", "stderr"}``; with one value the interval
        collapses to it, with none everything is NaN.
    """
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        nan = float("nan")
        return {"mean": nan, "ci_low": nan, "ci_high": nan, "stderr": nan}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, v.size, size=(n_boot, v.size))
    means = v[idx].mean(axis=1)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return {"mean": float(v.mean()), "ci_low": float(lo), "ci_high": float(hi), "stderr": float(means.std(ddof=1)) if n_boot > 1 else 0.0}


def paired_bootstrap(
    diffs: Union[np.ndarray, Sequence[np.ndarray]], n_boot: int = 2000, alpha: float = 0.05, seed: int = 0
) -> Dict[str, float]:
    """Paired bootstrap CI of a mean difference over matched seeds and problems.

    ``diffs[s, p]`` is method B minus method A on problem ``p`` under seed ``s``
    (same problem set, same seed for both methods). Each bootstrap replicate
    resamples seeds and problems independently with replacement (a two-way
    bootstrap, so both the seed-to-seed and the problem-to-problem variance
    enter the interval) and averages the resampled cells. This is the paired-CI
    standard of DataFlex-RL's method comparisons.

    A list of ``[S, P_t]`` arrays (one per benchmark, same seeds in the same
    order) gives the benchmark-balanced difference: the mean over benchmarks of
    each benchmark's mean, with seeds resampled jointly and problems resampled
    within each benchmark (stratified).

    Args:
        diffs: ``[S, P]`` matched differences, or a list of ``[S, P_t]``.
        n_boot: replicates; alpha: 1 - confidence level.
    Returns:
        ``{"mean", "ci_low", "ci_high", "p_value", "significant"}`` where
        ``p_value`` is the two-sided bootstrap sign probability
        ``2 * min(P(d* <= 0), P(d* >= 0))`` (capped at 1) and ``significant`` is
        1.0 when the ``1 - alpha`` interval excludes 0.
    Raises:
        ConfigError: an array is not non-empty 2-D, or the seed counts differ.
    """
    strata = [np.asarray(diffs, dtype=np.float64)] if isinstance(diffs, np.ndarray) else [
        np.asarray(d, dtype=np.float64) for d in diffs
    ]
    if not strata or any(d.ndim != 2 or d.size == 0 for d in strata):
        raise ConfigError(f"paired_bootstrap needs non-empty [seeds, problems] arrays, got shapes {[d.shape for d in strata]}")
    S = strata[0].shape[0]
    if any(d.shape[0] != S for d in strata):
        raise ConfigError(f"paired_bootstrap: every benchmark needs the same seeds, got {[d.shape[0] for d in strata]}")
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    for b in range(n_boot):
        si = rng.integers(0, S, size=S)
        means[b] = np.mean([d[np.ix_(si, rng.integers(0, d.shape[1], size=d.shape[1]))].mean() for d in strata])
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    p = min(1.0, 2.0 * min(float((means <= 0).mean()), float((means >= 0).mean())))
    return {
        "mean": float(np.mean([d.mean() for d in strata])),
        "ci_low": float(lo),
        "ci_high": float(hi),
        "p_value": p,
        "significant": float(lo > 0 or hi < 0),
    }


def summarize_samples(
    correct: Sequence[Sequence[float]],
    answers: Sequence[Sequence[Optional[Hashable]]],
    ks: Sequence[int],
    seed: int = 0,
) -> Dict[str, List[float]]:
    """Per-problem pass@k, maj@k and mean@k from ``n`` samples per problem.

    Args:
        correct: ``[N][n]`` correctness (a sample counts as correct when > 0.5
            for pass@k; mean@k averages the raw scores).
        answers: ``[N][n]`` normalised extracted answers for majority votes.
        ks: budgets; each must be <= n.
    Returns:
        ``{"pass@k": [N], "maj@k": [N]}`` for each k, and ``"mean@n": [N]``, the
        mean score over all n samples (the expected accuracy of one sample;
        mean@k has the same expectation for every k, so only the lowest-variance
        estimate, k = n, is reported).
    """
    rng = np.random.default_rng(seed)
    out: Dict[str, List[float]] = {}
    for k in ks:
        out[f"pass@{k}"] = [pass_at_k(len(c), int(sum(x > 0.5 for x in c)), k) for c in correct]
        out[f"maj@{k}"] = [maj_at_k(a, c, k, rng) for a, c in zip(answers, correct)]
    if correct:
        out[f"mean@{len(correct[0])}"] = [float(np.mean(c)) for c in correct]
    return out
