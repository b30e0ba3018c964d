"""Every model-reward kind registered (importing this module registers rm, judge, local_judge, prm, prs)."""

from rlpost.rewards.models import REWARD_MODELS, _register_builtin

_register_builtin()

__all__ = ["REWARD_MODELS"]
