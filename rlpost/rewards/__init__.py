"""Reward computation: verifiers run isolated with a timeout, plus reward shaping."""

from rlpost.rewards.scoring import RewardFunction, overlong_penalty  # noqa: F401
