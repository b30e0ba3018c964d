"""Compose and validate configs before anything heavy loads.

:func:`compose_config` runs Hydra's composition (defaults lists, overrides,
structured-schema type checks) and turns every Hydra/OmegaConf error into a
:class:`rlpost.core.errors.ConfigError` with one clear sentence that names the key and
the valid choices. :func:`validate_config` then checks what the schema cannot:
registered names and combinations that make sense.
"""

from __future__ import annotations

import importlib
import itertools
import re
from typing import Any, List

from omegaconf import DictConfig

from rlpost.config.schema import GROUP_SCHEMAS, register_schemas
from rlpost.config.paths import conf_dir, group_choices  # noqa: F401  (re-exported)
from rlpost.core.errors import ConfigError


def _schema_keys(path: str) -> List[str]:
    """Valid keys under a dotted config path (from the dataclass schemas)."""
    from dataclasses import MISSING, fields, is_dataclass

    from rlpost.config.schema import RootConfig

    node: Any = RootConfig
    for part in [p for p in path.split(".") if p]:
        if part in GROUP_SCHEMAS and node is RootConfig:
            node = GROUP_SCHEMAS[part]
            continue
        f = {x.name: x for x in fields(node)}.get(part) if is_dataclass(node) else None
        if f is None:
            return []
        t = f.type if not isinstance(f.type, str) else None
        default = f.default_factory() if f.default_factory is not MISSING else None  # type: ignore[misc]
        node = type(default) if is_dataclass(default) else t
    if is_dataclass(node):
        return [x.name for x in fields(node) if x.name != "defaults"]
    return []


def _unknown_key(key: str, suffix: str = "") -> ConfigError:
    """``ConfigError`` for an unknown dotted ``key``, listing the valid keys of its parent."""
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    valid = _schema_keys(parent)
    hint = f" Valid keys{' of ' + parent if parent else ''}: {', '.join(valid)}." if valid else ""
    return ConfigError(f"Unknown config key {key!r}.{hint}{suffix}")


def friendly_error(err: Exception) -> ConfigError:
    """Turn a Hydra / OmegaConf composition error into a one-sentence :class:`ConfigError`."""
    msg = str(err).strip()
    if err.__cause__ is not None:
        msg = msg + "\n" + str(err.__cause__)
    m = re.search(r"Could not find '([^']+)/([^']+)'", msg)
    if m:
        group, choice = m.group(1), m.group(2)
        return ConfigError(f"Unknown choice {group}={choice!r}. Valid choices for {group}: {', '.join(group_choices(group))}.")
    m = re.search(r"Key '([^']+)' (?:is )?not in '?(\w+)'?", msg) or re.search(r"Key '([^']+)' not in", msg)
    full = re.search(r"full_key: (\S+)", msg)
    if m:
        key = full.group(1) if full else m.group(1)
        return _unknown_key(key, f" (Use +{key}=... only to add a new key on purpose.)")
    m = re.search(r"Invalid value '([^']*)', expected one of \[([^\]]*)\]", msg)
    if m:
        key = full.group(1) if full else "?"
        import difflib

        choices = [c.strip() for c in m.group(2).split(",")]
        close = difflib.get_close_matches(m.group(1), choices, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return ConfigError(f"Invalid choice {key}={m.group(1)!r}.{hint} Valid choices: {', '.join(choices)}.")
    m = re.search(r"Value '([^']*)' (?:of type '[^']*' )?could not be converted to (\w+)", msg)
    if m:
        key = full.group(1) if full else "?"
        return ConfigError(f"Wrong type for {key}: {m.group(1)!r} is not a valid {m.group(2)}.")
    m = re.search(r"Could not override '([^']+)'", msg)
    if m:
        return _unknown_key(m.group(1))
    first = msg.splitlines()[0] if msg else type(err).__name__
    return ConfigError(f"Invalid config: {first}")


#: Free-form dict fields: their keys are a component's own parameters, so an
#: override may add a key the preset does not list (``task.params.min_numbers=3``).
FREE_DICTS = (
    "task.params.", "task.reward.verifier_params.", "algo.adv_params.", "algo.loss_params.",
    "sampler.params.", "selector.params.", "precision.correction_params.",
    "precision.rollout_params.", "precision.kv_cache_params.", "model.teachers.",
)


#: Keys whose value is a file system path: outside a sweep a comma, ``=`` or bracket in it is part of
#: the path (a sweep job's directory is named ``<n>_algo=grpo,seed=1``), never Hydra syntax.
PATH_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "task.path", "eval.checkpoint", "model.path", "resume",
             "eval.harness.include")
_HYDRA_SPECIAL = set(",=[]{}()'\" \t")


def quote_path_value(override: str) -> str:
    """``key=VALUE`` with VALUE quoted for Hydra when ``key`` is in :data:`PATH_KEYS` and VALUE holds a
    character Hydra's override grammar reads as syntax; anything else unchanged.

    ``hydra.run.dir=multirun/x/0_algo=grpo,seed=1`` -> ``hydra.run.dir='multirun/x/0_algo=grpo,seed=1'``.
    """
    key, sep, value = override.partition("=")
    if not sep or key.lstrip("+") not in PATH_KEYS or not value or value[0] in "'\"":
        return override
    if not _HYDRA_SPECIAL & set(value):
        return override
    q = "'" if "'" not in value else ('"' if '"' not in value else None)
    return f"{key}={q}{value}{q}" if q else override


def normalize_overrides(overrides: List[str], quote_paths: bool = True) -> List[str]:
    """Turn ``a.params.k=v`` into Hydra's add-or-override ``++a.params.k=v`` for :data:`FREE_DICTS`,
    and (``quote_paths``, outside a sweep) quote path values that hold Hydra syntax characters
    (:func:`quote_path_value`)."""
    out = []
    for o in overrides:
        if "=" in o and not o.startswith(("+", "~")) and o.split("=", 1)[0].startswith(FREE_DICTS):
            o = "++" + o
        out.append(quote_path_value(o) if quote_paths else o)
    return out


def compose_config(overrides: List[str], return_hydra_config: bool = False) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra ``overrides`` (no sweeps), plus what the
    composition rules add (:func:`with_rule_overrides`).

    Raises:
        ConfigError: unknown group choice, unknown key, wrong type, bad syntax.
    """
    cfg = _compose(overrides, return_hydra_config)
    extra = rule_overrides(cfg, list(overrides))
    return compose_config([*overrides, *extra], return_hydra_config) if extra else cfg


def with_rule_overrides(overrides: List[str]) -> List[str]:
    """``overrides`` followed by every override the :data:`COMPOSE_RULES` add: the command line that
    composes, in Hydra's own main (``rlpost train``), the config :func:`compose_config` returns."""
    out = list(overrides)
    while True:
        extra = rule_overrides(_compose(out, False), out)
        if not extra:
            return out
        out += extra


def _compose(overrides: List[str], return_hydra_config: bool) -> DictConfig:
    """Hydra's composition of ``overrides`` alone (no composition rules), its errors made friendly."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schemas()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return compose("config", overrides=normalize_overrides(list(overrides)), return_hydra_config=return_hydra_config)
    except ConfigError:
        raise
    except Exception as e:  # Hydra raises several unrelated exception types
        raise friendly_error(e) from None


#: Composition rules, each its owner's ``module:function(cfg, overrides) -> [override, ...]``: the
#: overrides of a sibling config group that a chosen component needs (Hydra cannot set another
#: group from an ``algo`` preset). Imported by name when composing, like :data:`GROUP_CHECKS`:
#: config sits below every owner. An override the user named is never replaced.
COMPOSE_RULES = (
    "rlpost.methods.hapo:sampler_overrides",  # a per-token temperature loss gets the sampler that owns it
    "rlpost.algos.validate:window_rollout_overrides",  # an estimator on window-cut rollouts (T-PPO's EGAE)
    "rlpost.algos.validate:estimator_sampler_overrides",  # an estimator that reads its sampler's data (Shuffle-R1)
    "rlpost.samplers:env_sampler_check",  # adds nothing: refuses sampler=X that an env preset would replace
)


def rule_overrides(cfg: DictConfig, overrides: List[str]) -> List[str]:
    """The overrides every :data:`COMPOSE_RULES` entry adds to ``cfg`` composed from ``overrides``.

    ``rlpost train`` applies them to the config Hydra composed itself (:func:`rlpost.cli.train`);
    :func:`compose_config` recomposes with them.
    """
    extra: List[str] = []
    for target in COMPOSE_RULES:
        module, fn = target.split(":")
        extra += getattr(importlib.import_module(module), fn)(cfg, overrides)
    return extra


def expand_sweep(overrides: List[str]) -> List[List[str]]:
    """Expand Hydra sweep overrides (``a=1,2 b=x,y``) into their combinations.

    Raises:
        ConfigError: override syntax errors.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    except Exception as e:
        raise ConfigError(f"Bad override syntax: {str(e).splitlines()[0]}") from None
    options: List[List[str]] = []
    for o in parsed:
        if o.is_sweep_override():
            vals = list(o.sweep_string_iterator())
            options.append([f"{o.get_key_element()}={v}" for v in vals])
        else:
            options.append([o.input_line])
    return [list(c) for c in itertools.product(*options)] if options else [[]]


def check_ranges(cfg: DictConfig) -> None:
    """Value ranges of the run, rollout and trainer settings, and the batch split."""
    a = cfg.algo
    checks = [
        (cfg.steps >= 1, "steps must be >= 1"),
        (cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1"),
        (cfg.rollout.temperature > 0, "rollout.temperature must be > 0"),
        (0 < cfg.rollout.top_p <= 1, "rollout.top_p must be in (0, 1]"),
        (cfg.trainer.micro_batch_size >= 1, "trainer.micro_batch_size must be >= 1"),
        (cfg.trainer.num_procs >= 1, f"trainer.num_procs={cfg.trainer.num_procs} must be >= 1"),
        (cfg.trainer.max_tokens_per_micro_batch >= 0,
         "trainer.max_tokens_per_micro_batch must be >= 0 (0 = micro-batches of trainer.micro_batch_size sequences)"),
        (cfg.trainer.lr > 0, "trainer.lr must be > 0"),
        (cfg.eval.limit is None or cfg.eval.limit >= 1,
         f"eval.limit={cfg.eval.limit} must be >= 1 (held-out prompts evaluated; eval.limit=null: all)"),
        (cfg.eval.n_samples >= 1, "eval.n_samples must be >= 1 (1: greedy)"),
        (cfg.eval.batch_size >= 1, "eval.batch_size must be >= 1"),
        (cfg.eval.max_new_tokens >= 1, "eval.max_new_tokens must be >= 1"),
    ]
    if a.mini_batches > 1:
        B = cfg.selector.prompts_per_step * a.n_samples_per_prompt
        checks.append((B >= a.mini_batches, f"algo.mini_batches={a.mini_batches} exceeds the {B} rollouts per step"))
    for ok, msg in checks:
        if not ok:
            raise ConfigError(f"Invalid config: {msg}.")


#: The one validation entry point's checks, by config group, in order: each is its owner's
#: ``module:function(cfg)``, imported when validation runs (config sits below every owner). Closed
#: choices (``algo.loss_agg``, ``algo.kl.estimator``, ``trainer.engine``...) are
#: enums in :mod:`rlpost.config.schema`, so composition already rejected them.
GROUP_CHECKS = (
    ("model", "rlpost.models.lora:check_model_config"),
    ("model", "rlpost.models.moe_replay:check_routing_config"),  # routing replay's engines
    ("rollout", "rlpost.rollout.self_spec:check_speculative"),
    ("model", "rlpost.algos.validate:check_teacher_config"),  # model.teacher set exactly when the algorithm distils
    ("algo", "rlpost.algos.validate:check_algo_config"),
    ("methods", "rlpost.methods.base:check_config"),
    ("precision", "rlpost.algos.validate:check_precision_config"),
    ("precision", "rlpost.rollout.fp8_stack:check_precision_rollout"),  # FP8-RL stack: block sizes, fp8 KV cache
    ("selector", "rlpost.selectors:check_config"),
    ("sampler", "rlpost.samplers:check_config"),
    ("sampler", "rlpost.samplers.s2l:check_config"),  # S2L-PO's explorer model named and resolvable
    ("sampler", "rlpost.samplers.agentflow:check_config"),  # AgentFlow's frozen copy needs the hf engine's model
    ("task", "rlpost.tasks:check_config"),
    ("eval", "rlpost.eval.test_time:check_config"),  # eval.test_time: a registered strategy and its params
    ("ranges", "rlpost.config.compose:check_ranges"),
    ("executor", "rlpost.run.executor:check_partial"),
    ("launcher", "rlpost.ray_pool:check_launcher"),
    ("card", "rlpost.experiments.recipes:check_card_config"),
)


def validate_config(cfg: DictConfig) -> None:
    """Every semantic check the schema cannot express, run from the CLI before anything loads.

    By config group (:data:`GROUP_CHECKS`): registered component names, every
    component's parameters against its declaration (losses, estimators,
    corrections, selectors, samplers: an unknown or misspelt key names the
    valid ones), the algorithm's combination rules, value ranges, and the
    partial-rollout settings.

    Raises:
        ConfigError: naming the key, the problem and the fix.
    """
    for _group, target in GROUP_CHECKS:
        module, fn = target.split(":")
        getattr(importlib.import_module(module), fn)(cfg)
