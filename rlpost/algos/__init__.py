"""The algorithm library: registries of pure tensor functions.

Importing this package registers every estimator, loss, aggregation mode and
regularizer. See :mod:`rlpost.algos.registries` for the calling conventions.
"""

from rlpost.algos import advantages, aggregation, losses, regularizers  # noqa: F401
from rlpost.algos.registries import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES  # noqa: F401
