"""Every file of :mod:`rlpost.algos` that registers a component, imported by the registries on first lookup.

A new estimator, loss, aggregation mode or KL estimator in a new file adds one
import here (:attr:`rlpost.core.registry.Registry.catalog`).
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
from rlpost.algos import oprl, vps  # noqa: F401  (OPRL: implicit-PRM step advantages; GRPO-VPS: answer-probability progress)
from rlpost.algos import adora  # noqa: F401  (ADORA's per-group advantage weights)
from rlpost.algos import apriel  # noqa: F401  (Apriel-Reasoner's difficulty-aware length penalty)
from rlpost.algos import shuffle_r1  # noqa: F401  (Shuffle-R1's pairing, batch shuffle and full-group advantage)
from rlpost.algos import hgpo  # noqa: F401  (HGPO: nested history groups of turns)
from rlpost.algos import rtmc  # noqa: F401  (RTMC: Monte Carlo Q over the rollout tree)
from rlpost.algos import g2po  # noqa: F401  (G2PO: TD errors on the group's observation graph)
from rlpost.algos import a2tgpo  # noqa: F401  (A²TGPO's information-gain turn advantages and turn clip)
from rlpost.algos import dare  # noqa: F401  (DARE: label-free reward from the group's answer distribution)
from rlpost.algos import osw_ft  # noqa: F401  (OSW-FT: SFT weighted by 1 - the probes' success rate)
from rlpost.algos import drift  # noqa: F401  (DRIFT's return-based importance weights)
from rlpost.algos import spear  # noqa: F401  (SPEAR's tool-call bonus, self-imitation replay loss)
from rlpost.algos import at2po  # noqa: F401  (AT²PO's turn-tree credit and the ATPO turn-ratio loss)
from rlpost.algos import erpd  # noqa: F401  (ERPD stage 2: the stage-1 teacher's filtered token log-ratio)
from rlpost.algos import elpo  # noqa: F401  (ELPO: hierarchical advantage over the binary-search tree, error-localized clip)
from rlpost.algos import r3l  # noqa: F401  (R^3L: Positive Amplification, shared-prefix mask of retries)
from rlpost.algos import rc_grpo  # noqa: F401  (RC-GRPO: stage-1 RCTP weights, stage-2 GRPO over token-mixed groups)
from rlpost.algos import echo  # noqa: F401  (ECHO: entropy-confidence advantage shaping, confidence-adaptive clip)
from rlpost.algos import mopd  # noqa: F401  (Open-MOPD: domain budget weights, refreshed multi-teacher distillation)
from rlpost.algos import flow_grpo  # noqa: F401  (Flow-GRPO: the outcome broadcast to every planner turn, group-normalised)
from rlpost.algos import datpo  # noqa: F401  (DATPO: tree block advantages + the annealed sibling-diversity bonus)
from rlpost.algos import t5  # noqa: F401  (T^5: twin-critic GAE, conditional-moment saddle-point mixing)
