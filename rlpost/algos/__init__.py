"""The algorithm library: pure tensor functions, registered by kind.

See :mod:`rlpost.algos.registries` for the calling conventions; the
registries load every component on first lookup (:mod:`rlpost.algos.catalog`).
"""
