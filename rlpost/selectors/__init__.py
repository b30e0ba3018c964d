"""Prompt selectors. Importing registers the built-in ones."""

from rlpost.selectors.base import SELECTORS, Selector, build_selector  # noqa: F401
from rlpost.selectors import bayes, history, mixture, pope, replay  # noqa: F401,E402
from rlpost.selectors import xrpo_allocator  # noqa: F401,E402  (XRPO's uncertainty-reduction rollout allocator)
from rlpost.core.errors import ConfigError
from rlpost.core.registry import as_dict


def check_config(cfg) -> None:
    """``selector``: registered, ``selector.params`` holds only its declared parameters (types checked).

    Raises:
        ConfigError: ``selector.prompts_per_step < 1``, an unknown selector or parameter.
    """

    if cfg.selector.prompts_per_step < 1:
        raise ConfigError("Invalid config: selector.prompts_per_step must be >= 1.")
    SELECTORS.resolve(cfg.selector.name, as_dict(cfg.selector.params), "selector.params")
