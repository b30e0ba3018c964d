"""Reward computation: verifiers run isolated with a timeout, plus reward shaping."""

from rlpost.rewards.scoring import (  # noqa: F401
    REWARD_COMPONENTS, RewardFunction, Rewards, StepScorer, overlong_penalty, resolve_overlong_buffer,
)
