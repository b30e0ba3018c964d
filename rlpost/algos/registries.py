"""Registries of the algorithm library's pure tensor functions.

Each registry maps a config name to a function; see the module of each kind for
the calling convention:

* :data:`ADV_ESTIMATORS` (``algo.adv_estimator``): ``fn(inp: AdvantageInput, *, <params>)
  -> AdvantageOutput`` in :mod:`rlpost.algos.advantages`.
* :data:`POLICY_LOSSES` (``algo.loss``): ``fn(inp: PolicyLossInput, *, <params>) ->
  (loss_matrix [B, R], metrics)`` in :mod:`rlpost.algos.losses`; the caller
  aggregates the matrix with a :data:`LOSS_AGGS` mode.
* :data:`LOSS_AGGS` (``algo.loss_agg``): ``fn(loss_mat, mask, denom) -> scalar``.
* :data:`KL_ESTIMATORS` (``algo.kl.estimator``): ``fn(logprobs, ref_logprobs) -> [B, R]``.

Estimators and losses declare their ``<params>`` once, as a frozen dataclass
registered with them (:mod:`rlpost.core.registry`); entries carry tags read by config
validation, e.g. ``needs_critic=True``.
"""

from rlpost.core.registry import Registry

CATALOG = "rlpost.algos.catalog"  # imports every file that registers an algorithm component
ADV_ESTIMATORS = Registry("advantage estimator", "algo.adv_estimator", typed_params=True, catalog=CATALOG)
POLICY_LOSSES = Registry("policy loss", "algo.loss", typed_params=True, catalog=CATALOG)
LOSS_AGGS = Registry("loss aggregation mode", "algo.loss_agg", catalog=CATALOG)
KL_ESTIMATORS = Registry("KL estimator", "algo.kl.estimator", catalog=CATALOG)
