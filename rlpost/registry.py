"""A small name -> object registry used for every pluggable piece.

Advantage estimators, policy losses, aggregation modes, KL estimators, selectors,
samplers, tasks and verifiers each live in their own :class:`Registry`. A preset in
``conf/`` then only names registered entries, and a misspelt name fails with the
list of valid choices.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

from rlpost.errors import ConfigError


@dataclass
class Entry:
    """One registered object with its documentation.

    Attributes:
        name: registry key used in configs.
        obj: the registered function or class.
        paper: "Title (arXiv:XXXX.XXXXX)" of the method it implements, or "" for
            plumbing.
        description: one line shown by ``rlpost list``.
        tags: free-form properties (for example ``needs_critic``) that config
            validation reads.
    """

    name: str
    obj: Any
    paper: str = ""
    description: str = ""
    tags: Dict[str, Any] = field(default_factory=dict)


class Registry:
    """Maps names to objects for one kind of component.

    Args:
        kind: human-readable kind, used in error messages ("advantage estimator").
        config_key: the config key that selects an entry (``algo.adv_estimator``),
            used in error messages.
    """

    def __init__(self, kind: str, config_key: str = "") -> None:
        self.kind = kind
        self.config_key = config_key
        self._entries: Dict[str, Entry] = {}

    def register(
        self, name: str, *, paper: str = "", description: str = "", **tags: Any
    ) -> Callable[[Any], Any]:
        """Decorator registering ``obj`` under ``name``.

        Raises:
            ValueError: if ``name`` is already registered (a programming error).
        """

        def deco(obj: Any) -> Any:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            desc = description
            if not desc and getattr(obj, "__doc__", None):
                desc = obj.__doc__.strip().splitlines()[0]
            self._entries[name] = Entry(name, obj, paper, desc, dict(tags))
            return obj

        return deco

    def entry(self, name: str) -> Entry:
        """Return the :class:`Entry` for ``name``.

        Raises:
            ConfigError: unknown name; the message lists the valid choices and the
                closest match.
        """
        if name not in self._entries:
            choices = sorted(self._entries)
            close = difflib.get_close_matches(str(name), choices, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            key = f"{self.config_key}=" if self.config_key else ""
            raise ConfigError(
                f"Unknown {self.kind} {key}{name!r}.{hint} Valid choices: {', '.join(choices)}."
            )
        return self._entries[name]

    def get(self, name: str) -> Any:
        """Return the registered object for ``name`` (see :meth:`entry` for errors)."""
        return self.entry(name).obj

    def names(self) -> List[str]:
        """Sorted registered names."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries[n] for n in self.names())

    def tag(self, name: str, key: str, default: Optional[Any] = None) -> Any:
        """Return tag ``key`` of entry ``name`` (``default`` when absent)."""
        return self.entry(name).tags.get(key, default)
