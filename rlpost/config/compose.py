"""Compose and validate configs before anything heavy loads.

:func:`compose_config` runs Hydra's composition (defaults lists, overrides,
structured-schema type checks) and turns every Hydra/OmegaConf error into a
:class:`rlpost.errors.ConfigError` with one clear sentence that names the key and
the valid choices. :func:`validate_config` then checks what the schema cannot:
registered names and combinations that make sense.
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path
from typing import Any, List

from omegaconf import DictConfig, OmegaConf

from rlpost.config.schema import GROUP_SCHEMAS, register_schemas
from rlpost.errors import ConfigError
from rlpost.tasks.answer_tags import EXTRACTORS


def conf_dir() -> Path:
    """The config tree: ``$RLPOST_CONF_DIR`` or ``conf/`` beside the package."""
    env = os.environ.get("RLPOST_CONF_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "conf"


def group_choices(group: str) -> List[str]:
    """Preset names available in ``conf/<group>/``."""
    d = conf_dir() / group
    return sorted(p.stem for p in d.glob("*.yaml")) if d.exists() else []


def _schema_keys(path: str) -> List[str]:
    """Valid keys under a dotted config path (from the dataclass schemas)."""
    from dataclasses import fields, is_dataclass

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
        default = f.default_factory() if f.default_factory is not None else None  # type: ignore[misc]
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
)


def normalize_overrides(overrides: List[str]) -> List[str]:
    """Turn ``a.params.k=v`` into Hydra's add-or-override ``++a.params.k=v`` for :data:`FREE_DICTS`."""
    out = []
    for o in overrides:
        if "=" in o and not o.startswith(("+", "~")) and o.split("=", 1)[0].startswith(FREE_DICTS):
            o = "++" + o
        out.append(o)
    return out


def compose_config(overrides: List[str], return_hydra_config: bool = False) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra ``overrides`` (no sweeps).

    Raises:
        ConfigError: unknown group choice, unknown key, wrong type, bad syntax.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schemas()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = compose("config", overrides=normalize_overrides(list(overrides)), return_hydra_config=return_hydra_config)
    except ConfigError:
        raise
    except Exception as e:  # Hydra raises several unrelated exception types
        raise friendly_error(e) from None
    return cfg


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


def validate_config(cfg: DictConfig) -> None:
    """Semantic checks that schemas cannot express.

    Checks registered names (estimator, loss, aggregation, KL estimator, task kind,
    selector, sampler), the algorithm's combination rules, value ranges, and the
    partial-rollout settings (:func:`rlpost.executor.check_partial`).

    Raises:
        ConfigError: naming the key, the problem and the fix.
    """
    import rlpost.algos  # noqa: F401  (registers)
    import rlpost.samplers  # noqa: F401
    import rlpost.selectors  # noqa: F401
    import rlpost.tasks  # noqa: F401
    from rlpost.algos.registries import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES
    from rlpost.samplers import SAMPLERS
    from rlpost.selectors import SELECTORS
    from rlpost.tasks import TASKS

    a = cfg.algo
    ADV_ESTIMATORS.entry(a.adv_estimator)
    POLICY_LOSSES.entry(a.loss)
    LOSS_AGGS.entry(a.loss_agg)
    KL_ESTIMATORS.entry(a.kl.estimator)
    TASKS.entry(cfg.task.kind)
    SAMPLERS.entry(cfg.sampler.name)
    SELECTORS.entry(cfg.selector.name)
    if ADV_ESTIMATORS.tag(a.adv_estimator, "needs_critic", False) and not a.critic.enabled:
        raise ConfigError(
            f"algo.adv_estimator={a.adv_estimator} needs a critic (value model) but algo.critic.enabled=false. "
            f"Fix: add algo.critic.enabled=true, or pick a critic-free estimator such as grpo."
        )
    try:
        from rlpost.algos.validate import validate_algo
    except ImportError:
        validate_algo = None
    if validate_algo is not None:
        validate_algo(a)
    checks = [
        (cfg.steps >= 1, "steps must be >= 1"),
        (a.n_samples_per_prompt >= 1, "algo.n_samples_per_prompt must be >= 1"),
        (a.ppo_epochs >= 1 and a.mini_batches >= 1, "algo.ppo_epochs and algo.mini_batches must be >= 1"),
        (cfg.selector.prompts_per_step >= 1, "selector.prompts_per_step must be >= 1"),
        (cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1"),
        (cfg.rollout.temperature > 0, "rollout.temperature must be > 0"),
        (0 < cfg.rollout.top_p <= 1, "rollout.top_p must be in (0, 1]"),
        (cfg.trainer.micro_batch_size >= 1, "trainer.micro_batch_size must be >= 1"),
        (cfg.trainer.lr > 0, "trainer.lr must be > 0"),
        (cfg.precision.trainer_dtype in ("fp32", "bf16", "fp16", "auto"), "precision.trainer_dtype must be fp32, bf16, fp16 or auto"),
        (cfg.trainer.engine in ("torch", "deepspeed"), f"trainer.engine={cfg.trainer.engine!r}: valid choices are torch, deepspeed"),
        (cfg.logger.backend in ("wandb", "jsonl", "none"), f"logger.backend={cfg.logger.backend!r}: valid choices are wandb, jsonl, none"),
        (cfg.model.source in ("gguf_wheel", "hf", "tiny"), f"model.source={cfg.model.source!r}: valid choices are gguf_wheel, hf, tiny"),
        (cfg.task.answer_format in EXTRACTORS, f"task.answer_format={cfg.task.answer_format!r}: valid choices are {', '.join(EXTRACTORS)}"),
    ]
    if a.mini_batches > 1:
        B = cfg.selector.prompts_per_step * a.n_samples_per_prompt
        checks.append((B >= a.mini_batches, f"algo.mini_batches={a.mini_batches} exceeds the {B} rollouts per step"))
    for ok, msg in checks:
        if not ok:
            raise ConfigError(f"Invalid config: {msg}.")
    if cfg.precision.correction not in (None, "none"):
        try:
            from rlpost.algos.corrections import CORRECTIONS
        except ImportError:
            raise ConfigError("precision.correction is not available in this build; use precision.correction=none.") from None
        CORRECTIONS.entry(cfg.precision.correction)
    from rlpost.executor import check_partial

    check_partial(cfg)
