"""Config check for estimators that match turns across a group's multi-turn episodes.

Estimators tagged ``needs_episodes`` (``hgpo``, arXiv:2602.22817; ``rtmc``, arXiv:2604.11037;
``g2po``, arXiv:2606.22995) compare the turns of different episodes by the environment text between
them (:mod:`rlpost.algos.turn_states`). On single-turn rows there is nothing to match: every row is
one turn at the prompt, so they would silently reduce to a group-baseline estimator. This method
refuses that configuration before any weights load.
"""

from __future__ import annotations

from typing import Any

from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method


@METHODS.register("episode_match", paper="turn matching across episodes (hgpo, rtmc, g2po)")
class EpisodeMatch(Method):
    """Refuses a ``needs_episodes`` estimator without ``sampler=episode``; needs no pass and writes nothing."""

    name = "episode_match"
    paper = "turn matching across episodes (hgpo, rtmc, g2po)"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "needs_episodes", False))

    def validate(self) -> None:
        """Raises:
            ConfigError: the sampler is not ``episode``, naming the fix (an ``env=``); or the sampler is tagged
                ``turn_rows`` (one row per turn, e.g. ``sampler=agentflow``: no episode transcript in a row)."""
        adv = str(self.cfg.algo.adv_estimator)
        sampler = str(self.cfg.sampler.name)
        from rlpost.samplers.base import runs_episodes  # samplers tagged episodes (episode, trace_tree)

        if not runs_episodes(sampler):
            raise ConfigError(
                f"algo.adv_estimator={adv} assigns credit per turn by matching the turns of a group's multi-turn "
                f"episodes, but sampler={sampler} produces single-turn rows (nothing to match: it would be a plain "
                f"group baseline). Fix: add env=calculator (or env=python / env=frozenlake), which selects "
                f"sampler=episode, or choose algo=grpo for single-turn tasks.")
        from rlpost.samplers.base import SAMPLERS

        if SAMPLERS.tag(sampler, "turn_rows", False):  # one row per turn (sampler=agentflow): no transcript to match
            raise ConfigError(
                f"algo.adv_estimator={adv} matches turns inside each episode's row, but sampler={sampler} writes one "
                f"row per turn, each with its own prompt (no episode transcript in a row). Fix: algo=flow_grpo (or "
                f"grpo) with sampler={sampler}, or env=calculator for {adv}.")
