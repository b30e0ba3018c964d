"""A small name -> object registry used for every pluggable piece, with typed parameters.

Advantage estimators, policy losses, aggregation modes, KL estimators, corrections,
selectors, samplers, tasks and verifiers each live in their own :class:`Registry`.
A preset in ``conf/`` then only names registered entries, and a misspelt name
fails with the list of valid choices.

Component parameters: a component that has parameters declares them ONCE, as a
frozen dataclass passed to :meth:`Registry.register` (``params=``). Each field
carries the paper's default and one documentation line (:func:`param`). The
registered function (or class ``__init__``) names the same parameters as
keyword-only arguments *without* defaults; registration checks that the names
agree and installs the declaration's defaults on it, so a direct call and a
config-driven call see the same values. A config sets only the fields that
differ (:meth:`Registry.resolve`): an unknown or misspelt key, a wrong type or a
value outside a :class:`Choice` raises :class:`ConfigError` naming the valid keys.

What generic tests need to know, declared beside the component (a kernel feature, docs/ARCHITECTURE.md,
"What a component declares for the generic tests"): the registry-wide tests run every entry on one
small batch, and a component whose inputs that batch lacks says so at its registration, not in the
tests. ``example_inputs=fn`` (:data:`ExampleInputs`) returns the extra inputs, parameters and config
overrides a generic test or a smoke run passes it; ``zero_variance="..."`` is the paper's reason an
advantage estimator gives a group of equal rewards a non-zero advantage (the default property: exactly 0).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

#: ``example_inputs(logprobs, generator) -> dict``: what a generic test adds for this component on a small
#: batch. ``logprobs`` ``[B, R]`` are the batch's current-policy log-probs (no grad; a teacher or reference
#: may sit near them), ``generator`` a seeded ``torch.Generator`` for every random draw. The dict holds any of
#: :data:`EXAMPLE_KEYS`.
ExampleInputs = Callable[[Any, Any], Dict[str, Any]]

#: the keys an ``example_inputs`` result may hold, and what each is for
EXAMPLE_KEYS: Dict[str, str] = {
    "params": "component parameters the small batch needs (e.g. a smaller k than the groups hold)",
    "extras": "entries of the input's extras dict (AdvantageInput.extras / PolicyLossInput.extras); a tensor "
              "that requires grad is a leaf whose gradient the test checks beside the log-probs'",
    "batch_extras": "RolloutBatch.extras a trainer-level test records before the update (a sampler's record)",
    "overrides": "Hydra overrides a smoke run of a preset using the component needs (a list of strings)",
}

from rlpost.core.errors import ConfigError


class Choice(str, Enum):
    """A closed set of string choices for a parameter or config field (member name == value).

    As a ``str`` subclass a member compares, hashes and formats like its value,
    so ``Baseline.mean == "mean"``; OmegaConf rejects any other string with the
    list of members.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


def param(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Optional[Callable[[], Any]] = None) -> Any:
    """A documented parameter field: ``default`` (or ``factory`` for a list/dict) and its one-line ``doc``."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class NoParams:
    """The component takes no parameters."""


def param_rows(params: type) -> List[Tuple[str, str, Any, str]]:
    """``(name, type name, default, doc)`` of each field of a params dataclass (for ``rlpost list``)."""
    rows = []
    for f in dataclasses.fields(params):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append((f.name, str(t), plain(default), f.metadata.get("doc", "")))
    return rows


def as_dict(x: Any) -> dict:
    """A config node (``DictConfig``, mapping or None) as a plain dict, interpolations resolved."""
    if x is None:
        return {}
    from omegaconf import DictConfig, OmegaConf

    if isinstance(x, DictConfig):
        return dict(OmegaConf.to_container(x, resolve=True))  # type: ignore[arg-type]
    return dict(x)


def plain(value: Any) -> Any:
    """``value`` with :class:`Enum` members replaced by their values (what component bodies receive)."""
    if isinstance(value, Enum):
        return value.value
    return value


def defaults_of(params: type) -> Dict[str, Any]:
    """``{field: default}`` of a params dataclass, enum members as plain values."""
    return {k: plain(v) for k, v in dataclasses.asdict(params()).items()}


def _has_nan(v: Any) -> bool:
    """Whether ``v`` is a NaN float or holds one (in a list, tuple or mapping, at any depth; a string
    ``"nan"`` counts, since OmegaConf converts it for a float field)."""
    if isinstance(v, float):
        return math.isnan(v)
    if isinstance(v, str):
        return v.strip().lower() in ("nan", "+nan", "-nan")
    if isinstance(v, Mapping):
        return any(_has_nan(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_nan(x) for x in v)
    try:  # OmegaConf containers
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(v, (DictConfig, ListConfig)):
            return _has_nan(OmegaConf.to_container(v, resolve=True))
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return False


def resolve_params(params: type, overrides: Mapping[str, Any], key: str = "", owner: str = "") -> Any:
    """Instance of the params dataclass ``params`` with ``overrides`` applied, types checked by OmegaConf.

    Args:
        key: config path of the overrides, for messages; owner: who declares them.
    Raises:
        ConfigError: an unknown key (listing the valid ones), a wrong type, a
            value outside a :class:`Choice`, or a value the dataclass's own
            ``__post_init__`` refuses (its ``ValueError`` message, with ``key``).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    overrides = dict(overrides or {})
    valid = [f.name for f in dataclasses.fields(params)]
    bad = sorted(set(overrides) - set(valid))
    if bad:
        raise ConfigError(f"{key or 'parameters'}: unknown parameter(s) {', '.join(bad)} of {owner or params.__name__}. "
                          f"Valid keys: {', '.join(valid)}.")
    nan = sorted(k for k, v in overrides.items() if _has_nan(v))
    if nan:  # NaN passes every `x >= 0` range check and reaches the loss
        raise ConfigError(f"{key or 'parameters'}: {', '.join(f'{k}={overrides[k]!r}' for k in nan)} is not a number "
                          f"({owner or params.__name__}). Fix: set a number.")
    node = OmegaConf.structured(params)
    OmegaConf.set_readonly(node, False)
    try:
        return OmegaConf.to_object(OmegaConf.merge(node, overrides))
    except OmegaConfBaseException as e:
        import re

        full = getattr(e, "full_key", None) or ""
        msg = str(e).strip().splitlines()[0]
        where = f"{key}.{full}" if key and full else (key or full)
        m = re.match(r"Invalid value '([^']*)', expected one of \[([^\]]*)\]", msg)
        if m:
            msg = f"{where}={m.group(1)!r}: valid choices are {m.group(2)} ({owner or params.__name__})."
        else:
            msg = f"{where} ({owner or params.__name__}): {msg}."
        raise ConfigError(msg) from None
    except ValueError as e:  # a range check of the dataclass itself (__post_init__)
        raise ConfigError(f"{key or 'parameters'} ({owner or params.__name__}): {e}. Fix: set a value in range.") from None


def _kw_targets(obj: Any) -> Tuple[Dict[str, Callable], bool]:
    """Keyword-only parameters of ``obj`` -> the function that declares each, and whether it has ``**kwargs``.

    For a class, ``__init__`` methods are followed up the MRO while each one
    forwards ``**kwargs`` to its parent (a subclass passing its base's
    parameters through).
    """
    if not isinstance(obj, type):
        ps = inspect.signature(obj).parameters.values()
        return ({p.name: obj for p in ps if p.kind is p.KEYWORD_ONLY},
                any(p.kind is p.VAR_KEYWORD for p in ps))
    out: Dict[str, Callable] = {}
    for klass in obj.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        ps = list(inspect.signature(init).parameters.values())
        for p in ps:
            if p.kind is p.KEYWORD_ONLY:
                out.setdefault(p.name, init)
        if not any(p.kind is p.VAR_KEYWORD for p in ps):
            break
    return out, True


def bind_params(kind: str, name: str, obj: Any, params: type) -> None:
    """Check that ``obj``'s keyword-only arguments are exactly the fields of ``params``; install the defaults.

    Raises:
        ValueError: (a programming error, at import) ``params`` is not a frozen
            dataclass with a default and a doc line per field, a function takes
            ``**kwargs`` (which would swallow a misspelt parameter), the names
            disagree, or a default is written in the signature too.
    """
    if not (dataclasses.is_dataclass(params) and params.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise ValueError(f"{kind} {name!r}: params must be a frozen dataclass")
    defaults = defaults_of(params)
    for f in dataclasses.fields(params):
        if not f.metadata.get("doc"):
            raise ValueError(f"{kind} {name!r}: parameter {f.name!r} needs a doc line (param(default, doc))")
    targets, var_kw = _kw_targets(obj)
    if var_kw and not isinstance(obj, type):
        raise ValueError(f"{kind} {name!r}: a registered function must not take **kwargs (it would swallow misspelt parameters)")
    if set(targets) != set(defaults):
        raise ValueError(f"{kind} {name!r}: keyword-only arguments {sorted(targets)} differ from "
                         f"the declared parameters {sorted(defaults)} of {params.__name__}")
    for k, fn in targets.items():
        kwd = fn.__kwdefaults__ or {}
        if k in kwd and kwd[k] != defaults[k]:
            raise ValueError(f"{kind} {name!r}: default of {k!r} is {kwd[k]!r} in {fn.__qualname__} but "
                             f"{defaults[k]!r} in {params.__name__}; write defaults only in the declaration")
        fn.__kwdefaults__ = {**kwd, k: defaults[k]}


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
        params: the frozen dataclass declaring the component's parameters
            (:class:`NoParams` when it has none).
        example_inputs: :data:`ExampleInputs` of a component whose inputs a
            generic test's small batch lacks, or None (read through
            :meth:`Registry.example`).
        zero_variance: for an advantage estimator, the paper's reason a group
            whose rewards are all equal gets a non-zero advantage; "" means it
            gets exactly 0 (the generic property).
    """

    name: str
    obj: Any
    paper: str = ""
    description: str = ""
    tags: Dict[str, Any] = field(default_factory=dict)
    params: type = NoParams
    example_inputs: Optional[ExampleInputs] = None
    zero_variance: str = ""


class Registry:
    """Maps names to objects for one kind of component.

    Args:
        kind: human-readable kind, used in error messages ("advantage estimator").
        catalog: a module that imports every component of this kind, imported on the
            first lookup (see :meth:`_load`); "" when the components register on import
            of the registry's own module.
        config_key: the config key that selects an entry (``algo.adv_estimator``),
            used in error messages.
        typed_params: every entry declares its parameters (``params=``; none
            given means :class:`NoParams`) and registration checks them
            (:func:`bind_params`). Components (losses, estimators, corrections,
            selectors, samplers) set it; plumbing with a fixed calling
            convention does not.
    """

    def __init__(self, kind: str, config_key: str = "", typed_params: bool = False, catalog: str = "") -> None:
        self.kind = kind
        self.config_key = config_key
        self.typed_params = typed_params
        self.catalog = catalog
        self._loaded = not catalog
        self._entries: Dict[str, Entry] = {}

    def _load(self) -> None:
        """Import the registry's catalog module (every component of its kind) on the first lookup.

        The components import the registry to register themselves, so the
        registry cannot import them at module level without a cycle; its
        catalog (``catalog=``, a module importing each component's file) is
        imported here instead, once.
        """
        if not self._loaded:
            self._loaded = True
            importlib.import_module(self.catalog)

    def register(
        self, name: str, *, paper: str = "", description: str = "", params: Optional[type] = None,
        example_inputs: Optional[ExampleInputs] = None, zero_variance: str = "", **tags: Any
    ) -> Callable[[Any], Any]:
        """Decorator registering ``obj`` under ``name``.

        Args:
            params: frozen dataclass declaring the parameters (see the module
                docstring); None for plumbing whose calling convention is fixed
                (aggregation modes, KL estimators, tasks, verifiers).
            example_inputs: what a generic test passes this component beyond its
                small shared batch (:data:`ExampleInputs`, keys
                :data:`EXAMPLE_KEYS`); None when the shared batch is enough.
            zero_variance: an advantage estimator's reason (the paper's) for a
                non-zero advantage on a group of equal rewards; "" = exactly 0.

        Raises:
            ValueError: ``name`` registered twice, ``params`` disagrees with
                ``obj`` (see :func:`bind_params`), or ``example_inputs`` is not
                callable; all programming errors.
        """
        if example_inputs is not None and not callable(example_inputs):
            raise ValueError(f"{self.kind} {name!r}: example_inputs must be a function (logprobs, generator) -> dict")

        def deco(obj: Any) -> Any:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            desc = description
            if not desc and getattr(obj, "__doc__", None):
                desc = obj.__doc__.strip().splitlines()[0]
            if params is not None or self.typed_params:
                bind_params(self.kind, name, obj, params or NoParams)
            self._entries[name] = Entry(name, obj, paper, desc, dict(tags), params or NoParams, example_inputs,
                                        zero_variance)
            return obj

        return deco

    def example(self, name: str, logprobs: Any, generator: Any) -> Dict[str, Any]:
        """The declared example inputs of ``name`` with every key of :data:`EXAMPLE_KEYS` present.

        Args:
            logprobs: ``[B, R]`` current-policy log-probs of the test's batch (no grad).
            generator: a seeded ``torch.Generator`` for the component's random draws.
        Returns:
            ``{"params": {}, "extras": {}, "batch_extras": {}, "overrides": [], ...}`` updated with
            what ``example_inputs`` returns (all empty when the entry declares none).
        Raises:
            ConfigError: unknown name (see :meth:`entry`).
            ValueError: the declaration returned a key outside :data:`EXAMPLE_KEYS`
                (a programming error in the component's file).
        """
        out: Dict[str, Any] = {"params": {}, "extras": {}, "batch_extras": {}, "overrides": []}
        fn = self.entry(name).example_inputs
        if fn is None:
            return out
        got = dict(fn(logprobs, generator))
        bad = sorted(set(got) - set(EXAMPLE_KEYS))
        if bad:
            raise ValueError(f"{self.kind} {name!r}: example_inputs returned {bad}; "
                             f"valid keys: {', '.join(EXAMPLE_KEYS)}")
        out.update(got)
        return out

    def params_of(self, name: str) -> type:
        """The params dataclass of entry ``name`` (see :meth:`entry` for errors)."""
        return self.entry(name).params

    def resolve(self, name: str, overrides: Optional[Mapping[str, Any]] = None, key: str = "") -> Any:
        """The params instance of ``name``: the declaration's defaults with ``overrides`` applied.

        Types are checked and converted by OmegaConf from the dataclass (an int
        for a float field is fine; a string for a number or a value outside a
        :class:`Choice` is not).

        Args:
            key: config path of the overrides (``algo.loss_params``), for messages.
        Raises:
            ConfigError: unknown name; unknown key (naming the valid keys and the
                closest match); wrong type or choice.
        """
        overrides = dict(overrides or {})
        self.check_keys(name, overrides, key)
        return resolve_params(self.params_of(name), overrides, key, f"{self.kind} {name!r}")

    def check_keys(self, name: str, keys: Any, key: str = "") -> None:
        """Raise :class:`ConfigError` if ``keys`` holds a parameter that ``name`` does not declare."""
        rows = param_rows(self.params_of(name))
        valid = [r[0] for r in rows]
        bad = sorted(set(keys) - set(valid))
        if not bad:
            return
        close = difflib.get_close_matches(bad[0], valid, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        listing = ", ".join(f"{n} (default {d!r})" for n, _, d, _ in rows) or "none: it takes no parameters"
        where = key or "parameters"
        raise ConfigError(
            f"{where}: unknown parameter{'s' if len(bad) > 1 else ''} {', '.join(bad)} for {self.kind} {name!r}.{hint} "
            f"Valid keys: {listing}."
        )

    def kwargs(self, name: str, overrides: Optional[Mapping[str, Any]] = None, key: str = "") -> Dict[str, Any]:
        """Keyword arguments for calling entry ``name``: its defaults with ``overrides`` (unknown keys raise).

        The fast path of the training loop: keys are checked, values are taken
        as given (config validation has type-checked them through :meth:`resolve`).

        Raises:
            ConfigError: unknown key.
        """
        overrides = dict(overrides or {})
        self.check_keys(name, overrides, key)
        return {**defaults_of(self.params_of(name)), **{k: plain(v) for k, v in overrides.items()}}

    def entry(self, name: str) -> Entry:
        """Return the :class:`Entry` for ``name``.

        Raises:
            ConfigError: unknown name; the message lists the valid choices and the
                closest match.
        """
        self._load()
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
        self._load()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries[n] for n in self.names())

    def tag(self, name: str, key: str, default: Optional[Any] = None) -> Any:
        """Return tag ``key`` of entry ``name`` (``default`` when absent)."""
        return self.entry(name).tags.get(key, default)
