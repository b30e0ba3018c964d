"""Foundations every layer may import: errors, registries, the rollout batch, metrics logging,
the partial-rollout buffer, largest-remainder apportionment and the ``precision=auto`` decision.

Nothing here imports another part of rlpost (config, engines, algorithms or the run).
"""
