"""Evaluation: greedy accuracy, pass@k / maj@k / mean@k with bootstrap CIs, paired comparisons."""

from rlpost.eval.evaluate import aggregate, evaluate, format_result, save_result, scalar_metrics  # noqa: F401
from rlpost.eval.stats import bootstrap_ci, maj_at_k, paired_bootstrap, pass_at_k  # noqa: F401
