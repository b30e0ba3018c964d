"""Prompt selectors. Importing registers the built-in ones."""

from rlpost.selectors.base import SELECTORS, Selector, build_selector  # noqa: F401
