"""Imports every test-time strategy file so each registers in :data:`rlpost.eval.test_time.TEST_TIME`."""

from rlpost.eval import pot  # noqa: F401  (Policy of Thoughts, arXiv:2601.20379)
