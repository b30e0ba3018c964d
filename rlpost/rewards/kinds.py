"""Every model-reward kind's file (rm in rlpost.rewards.models; judge, local_judge, prm, prs here), imported
by :data:`rlpost.rewards.models.REWARD_MODELS` on its first lookup."""

from rlpost.rewards import judge, process, staged  # noqa: F401
from rlpost.rewards.models import REWARD_MODELS  # noqa: F401
