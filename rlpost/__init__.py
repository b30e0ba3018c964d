"""rlpost: a command-line experiment runner for RL post-training of language models."""

__version__ = "0.1.0"
