"""Imports every test-time strategy file so each registers in :data:`rlpost.eval.test_time.TEST_TIME`."""

from rlpost.eval import pot  # noqa: F401  (Policy of Thoughts, arXiv:2601.20379)
from rlpost.eval.test_time import TEST_TIME  # noqa: F401,E402  (re-exported for `rlpost list test_time`)
