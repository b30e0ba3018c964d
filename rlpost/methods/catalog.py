"""Every hook-using method's file, imported by :data:`rlpost.methods.base.METHODS` on first lookup.

A new method in a new file adds one import here.
"""

from rlpost.methods import a2tgpo, a3po, a_star_po, capo, cscr, distill_topk, dppo, erc, hapo  # noqa: F401
from rlpost.methods import mipu, mssr, otr, poise, quads, reference_responses, remax  # noqa: F401
from rlpost.methods import rollout_entropy, seed, seed_grpo, sp3o, sspo, tbrm, turn_updates, vcpo  # noqa: F401
from rlpost.methods import grpo_vps, oprl  # noqa: F401
from rlpost.methods import length_cap  # noqa: F401  (rows at the generation limit: Apriel-Reasoner's length penalty)
from rlpost.methods import episode_match  # noqa: F401  (hgpo / rtmc / g2po need multi-turn episodes)
from rlpost.methods import osw_ft  # noqa: F401  (OSW-FT: the probe rollouts swapped for the expert trajectories)
from rlpost.methods import drift  # noqa: F401  (DRIFT: rollouts from the frozen reference policy)
from rlpost.methods import spear  # noqa: F401  (SPEAR: self-imitation replay buffer and tool-call bonus)
from rlpost.methods import r3l  # noqa: F401  (R^3L: old log-probs for the retry importance weight)
from rlpost.methods import echo  # noqa: F401  (ECHO: old-policy token entropy and top-k confidence)
from rlpost.methods import n_grpo  # noqa: F401  (N-GRPO: the rollout's mixed input embeddings in every log-prob pass)
from rlpost.methods import mopd  # noqa: F401  (Open-MOPD: each row's domain and target share for the budget weights)
from rlpost.methods import lens  # noqa: F401  (LENS: CRPO's calibrated anchor for purified rollouts; the reference for its detector)
from rlpost.methods import m3po  # noqa: F401  (M3PO: the rollout's hybrid thinking embeddings in every log-prob pass)
from rlpost.methods import empo2  # noqa: F401  (EMPO²: off-policy rows' old log-probs from the memory context, low-probability row mask)
from rlpost.methods import t5  # noqa: F401  (T^5: twin-critic qualification gate and saddle-point advantage mixing)
