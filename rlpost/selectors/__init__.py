"""Prompt selectors. Importing registers the built-in ones."""

from rlpost.selectors.base import SELECTORS, Selector, build_selector  # noqa: F401
from rlpost.selectors import bayes, history, mixture, pope, replay  # noqa: F401,E402
from rlpost.selectors import xrpo  # noqa: F401,E402  (XRPO's uncertainty-reduction rollout allocator)
