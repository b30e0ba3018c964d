"""Every file of :mod:`rlpost.algos` that registers a component, imported by the registries on first lookup.

A new estimator, loss, aggregation mode or KL estimator in a new file adds one
import here (:attr:`rlpost.registry.Registry.catalog`).
"""

from rlpost.algos import advantages, aggregation, corrections, hapo, losses, offpolicy, regularizers, shaping  # noqa: F401
from rlpost.algos import turns  # noqa: F401  (turn-level advantages on multi-turn episodes)
from rlpost.algos import distill, preference, value  # noqa: F401  (teacher-based losses; EXO, SPPO; A*-PO)
from rlpost.algos import ripo, seed  # noqa: F401  (RIPO's isometric clip; SEED's hindsight-skill distillation loss)
from rlpost.algos import cscr, r2vpo, rapid, xrpo  # noqa: F401  (CSCR; R²VPO; RAPID; XRPO's sharpening)
from rlpost.algos import sapo_ar, tbrm  # noqa: F401  (single-rollout turn-level GAE; TBRM)
from rlpost.algos import otr  # noqa: F401  (one-token rollouts: SFT as a token-level policy gradient)
from rlpost.algos import capo  # noqa: F401  (CAPO's curvature-aware token mask)
from rlpost.algos import poise, tppo  # noqa: F401  (POISE's hidden-state probe baseline; T-PPO's EGAE)
from rlpost.algos import a2tgpo  # noqa: F401  (A²TGPO's information-gain turn advantages and turn clip)
