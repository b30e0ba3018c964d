"""The ``rlpost`` command line (Typer). Hydra resolves the config groups.

Commands: ``train``, ``eval``, ``config``, ``list`` (and ``compare`` and
``report`` from the evaluation modules). User errors print one line and exit with the error's code
(2 for config errors) without a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from rlpost.core.errors import ConfigError, Interrupted, RlpostError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="rlpost: reinforcement-learning post-training of language models.\n\n"
    "Example: rlpost train algo=grpo model=smollm2-135m task=arithmetic steps=60",
)

EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


def _print_version(value: bool) -> None:
    if value:
        from rlpost import __version__

        typer.echo(f"rlpost {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print the rlpost version and exit.")) -> None:
    """rlpost: reinforcement-learning post-training of language models."""


def _fail(err: RlpostError) -> None:
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(code=err.exit_code)


def _check_syntax(overrides: List[str]) -> None:
    """Arguments that are not ``key=value`` overrides: ``--steps 3`` or ``steps 3`` (argparse habits).

    Hydra's own message for them is a parser exception name (``LexerNoViableAltException: --steps``);
    this names the argument and the override to write instead.

    Raises:
        ConfigError: an argument starting with ``-`` or without ``=`` (``~key`` deletions excepted).
    """
    for i, o in enumerate(overrides):
        nxt = overrides[i + 1] if i + 1 < len(overrides) else None
        value = nxt if nxt is not None and "=" not in nxt and not nxt.startswith("-") else None
        if o.startswith("-"):
            key, _, val = o.lstrip("-").partition("=")
            paths = _key_paths(key.replace("-", "_"))
            fix = (" or ".join(f"{k}={val or value or 'VALUE'}" for k in paths[:3]) if paths
                   else "key=value (rlpost config prints every key)")
            raise ConfigError(f"{o!r} is not an option of this command: settings are Hydra overrides key=value, "
                              f"so write {fix}; the command's options: --help.")
        if "=" not in o and not o.startswith("~"):
            paths = _key_paths(o)
            fix = " or ".join(f"{k}={value or 'VALUE'}" for k in paths[:3]) if paths else "key=value, e.g. steps=3"
            raise ConfigError(f"{o!r} is not an override: write {fix} (rlpost config prints every key).")


def _key_paths(name: str) -> List[str]:
    """Dotted config keys whose last part is ``name`` (``limit`` -> ``eval.limit``, ...), top level first."""
    from rlpost.config.compose import _schema_keys

    if "." in name:  # already a dotted key: itself, when the schema has it
        parent, _, last = name.rpartition(".")
        return [name] if last in _schema_keys(parent) else []
    found, todo = [], [""]
    while todo:  # breadth first over the schema, three levels deep at most
        path = todo.pop(0)
        for k in _schema_keys(path):
            full = f"{path}.{k}" if path else k
            if k == name:
                found.append(full)
            if full.count(".") < 2:
                todo.append(full)
    return found


def _check_recipe(overrides: List[str]) -> None:
    """Override syntax (:func:`_check_syntax`), and ``recipe=NAME`` without ``+``: Hydra would say
    "Unknown config key 'recipe'"; say how to write it."""
    from rlpost.config.compose import group_choices

    _check_syntax(overrides)
    for o in overrides:
        if o.split("=", 1)[0] == "recipe":
            name = o.split("=", 1)[1] if "=" in o else "NAME"
            raise ConfigError(f"{o!r}: a recipe is added on top of the defaults, so it takes a leading +: "
                              f"+recipe={name}. Recipes: {', '.join(group_choices('recipe'))}.")


def _validate(overrides: List[str], multirun: bool, train: bool = False) -> None:
    """Compose and validate every run of a (possibly swept) override list (``train``: also the checks
    that only ``rlpost train`` makes, e.g. no ``eval.test_time``)."""
    from rlpost.config.compose import PATH_KEYS, compose_config, expand_sweep, validate_config

    _check_recipe(overrides)

    combos = expand_sweep(overrides) if multirun else [overrides]
    if not multirun:
        for o in overrides:
            if o.split("=", 1)[0].lstrip("+") in PATH_KEYS:  # a path (a sweep job's directory holds commas)
                continue
            if "," in o.split("=", 1)[-1] and not any(c in o for c in "[{'\""):
                raise ConfigError(
                    f"{o!r} looks like a sweep; add -m (rlpost train -m {' '.join(overrides)}) to run it, "
                    f"or quote the value for Hydra to pass a literal comma, inside shell quotes: \"key='a, b'\"."
                )
    for combo in combos:
        cfg = compose_config([o for o in combo if not o.startswith("hydra.")])
        validate_config(cfg)
        if train:
            from rlpost.eval.test_time import check_not_training

            check_not_training(cfg)


def _with_rule_overrides(overrides: List[str], multirun: bool) -> List[str]:
    """``overrides`` plus what the composition rules add (:data:`rlpost.config.compose.COMPOSE_RULES`).

    Hydra composes the run's config itself, so a rule's overrides (``algo=hapo``'s sampler, an
    estimator's window-cut rollouts) must be on its command line. A sweep whose jobs would need
    different ones is refused (name them per job instead).

    Raises:
        ConfigError: the jobs of a sweep need different rule overrides.
    """
    from rlpost.config.compose import expand_sweep, with_rule_overrides

    combos = expand_sweep(overrides) if multirun else [overrides]
    extra = set()
    for c in combos:
        plain = [o for o in c if not o.startswith("hydra.")]
        extra.add(tuple(with_rule_overrides(plain)[len(plain):]))
    if len(extra) > 1:
        raise ConfigError(f"the jobs of this sweep need different settings ({' | '.join(' '.join(e) or '(none)' for e in sorted(extra))}) "
                          f"that their algorithms compose with. Fix: sweep them separately, or name those settings.")
    return [*overrides, *next(iter(extra))]


def _launch(fn: Callable[[Any], Any], overrides: List[str], multirun: bool) -> None:
    """Run ``fn(cfg)`` under Hydra's own main (run dirs, sweeps, launchers)."""
    import hydra

    from rlpost.config.compose import conf_dir, normalize_overrides
    from rlpost.config.schema import register_schemas

    register_schemas()
    argv = ["rlpost"] + (["--multirun"] if multirun else []) + normalize_overrides(list(overrides), quote_paths=not multirun)
    old = sys.argv
    sys.argv = argv
    try:
        hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(fn)()
    finally:
        sys.argv = old


def _run_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def _mark_failed(err: BaseException) -> None:
    """Write ``<run dir>/FAILED`` holding the error, so a failed run is told apart from a finished one."""
    import traceback

    from rlpost.run.checkpoint import FAILED_MARKER

    try:
        d = _run_dir()
        d.mkdir(parents=True, exist_ok=True)
        tb = "" if isinstance(err, RlpostError) else "\n" + "".join(traceback.format_exception(err))
        (d / FAILED_MARKER).write_text(f"{type(err).__name__}: {err}\n{tb}")
    except Exception:  # pragma: no cover - marking must never hide the error itself
        pass


def _guard(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wrap a Hydra task so user errors exit cleanly (SystemExit passes through Hydra).

    A run that fails gets a ``FAILED`` file with the error; an interrupted one
    (:class:`rlpost.core.errors.Interrupted`) does not, since ``resume=auto`` continues it.
    """
    from rlpost.core.errors import Interrupted
    from rlpost.experiments.sweep import summarize_current_sweep
    from rlpost.core.tracking import log

    def wrapped(cfg: Any) -> Any:
        import logging

        logging.captureWarnings(True)  # Python warnings: to stderr once each (OnceFilter) and into cli.log
        try:  # transformers' warnings through the same handlers (it has its own stderr handler by default)
            from transformers.utils import logging as hf_logging

            hf_logging.disable_default_handler()
            hf_logging.enable_propagation()
        except ImportError:  # pragma: no cover - transformers is a dependency
            pass
        try:
            return fn(cfg)
        except Interrupted as e:
            log.warning(str(e))
            sys.exit(e.exit_code)
        except RlpostError as e:
            _mark_failed(e)
            summarize_current_sweep()  # a failed sweep job: Hydra calls no callback after sys.exit
            log.error(f"error: {e}")
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            log.warning("interrupted; nothing was saved by this command")
            sys.exit(130)
        except Exception as e:
            _mark_failed(e)
            summarize_current_sweep()
            raise

    wrapped.__name__ = fn.__name__
    return wrapped


@app.command(context_settings=EXTRA)
def train(
    ctx: typer.Context,
    multirun: bool = typer.Option(False, "-m", "--multirun", help="Sweep: run every combination (a=1,2 b=x,y)."),
) -> None:
    """Train a policy with RL. Arguments are Hydra overrides.

    Examples:

      rlpost train                                  (default: GRPO, SmolLM2-135M, arithmetic)

      rlpost train algo=sao model=tiny steps=5 logger=jsonl

      rlpost train -m algo=grpo,sao seed=1,2        (a sweep, one run directory each)

      rlpost train resume=auto hydra.run.dir=outputs/myrun   (continue a killed run)
    """
    overrides = list(ctx.args)
    note = None
    try:
        _validate(overrides, multirun, train=True)
        overrides = _with_rule_overrides(overrides, multirun)
        if not multirun:  # resume=...: the run's own overrides, checked before Hydra writes anything
            from rlpost.run.resume import plan_resume

            plan = plan_resume(overrides)
            overrides, note = plan.overrides, plan.note
        if not multirun:  # trainer.num_procs > 1: re-run this command under torchrun
            from rlpost.config.compose import compose_config
            from rlpost.trainer.torchrun import needs_launch, relaunch

            cfg0 = compose_config([o for o in overrides if not o.startswith("hydra.")])
            if needs_launch(cfg0):
                raise typer.Exit(code=relaunch(cfg0, overrides))
    except RlpostError as e:
        _fail(e)

    def task(cfg: Any) -> None:
        from rlpost.run.runner import train as run_train
        from rlpost.core.tracking import log

        for line in (note or "").splitlines():
            log.info(line)
        run_train(cfg, _run_dir())  # logs the closing summary (console and cli.log)

    _launch(_guard(task), overrides, multirun)


def _harness_shorthand(overrides: List[str]) -> List[str]:
    """``rlpost eval``'s shorthand: ``harness=a,b`` is ``eval.harness.tasks=[a,b]``, ``harness.K=V`` is ``eval.harness.K=V``."""
    out = []
    for o in overrides:
        key, sep, val = o.partition("=")
        if key == "harness" and sep:
            names = val.strip("[]")
            out.append(f"eval.harness.tasks=[{names}]")
        elif key.startswith("harness.") and sep:
            out.append(f"eval.{o}")
        else:
            out.append(o)
    return out


@app.command("eval", context_settings=EXTRA)
def eval_cmd(ctx: typer.Context) -> None:
    """Evaluate a model or checkpoint on a task's held-out split; writes eval.json.

    Examples:

      rlpost eval                                    (base model, default task)

      rlpost eval eval.checkpoint=outputs/grpo-arithmetic/<time>/final

      rlpost eval task=gsm8k task.path=PATH/gsm8k/test.jsonl eval.limit=100   (offline: a local copy; written to outputs/eval-gsm8k/<time>/)

      rlpost eval harness=gsm8k,arc_easy eval.checkpoint=outputs/<run>/final   (lm-evaluation-harness; harness.json)

      rlpost eval harness=my_task harness.include=tasks/ harness.limit=50     (a local task YAML)
    """
    overrides = _harness_shorthand(list(ctx.args))
    try:
        _validate(overrides, False)
    except RlpostError as e:
        _fail(e)

    harness = any(o.split("=", 1)[0] == "eval.harness.tasks" for o in overrides)
    if not any(o.split("=", 1)[0].lstrip("+") in ("name", "hydra.run.dir") for o in overrides):
        # outputs/eval-<task>/<time> (or eval-harness/), apart from training runs
        overrides = [f"name=eval-{'harness' if harness else '${task.name}'}"] + overrides

    def task(cfg: Any) -> None:
        from omegaconf import OmegaConf

        from rlpost.eval.evaluate import evaluate
        from rlpost.core.tracking import eval_line, log
        from rlpost.models.loader import load_policy
        from rlpost.rollout import EngineConfig, build_engine
        from rlpost.run.runner import pick_device, seed_everything
        from rlpost.tasks import build_task

        seed_everything(cfg.seed)
        run_dir = _run_dir()
        mcfg = cfg.model
        adapter = None
        if cfg.eval.checkpoint:
            from rlpost.models.lora import is_adapter_dir, read_adapter

            ck = Path(cfg.eval.checkpoint)
            path = ck / "policy" if (ck / "policy").is_dir() else ck
            if is_adapter_dir(path) and not (path / "config.json").exists():
                # a LoRA checkpoint holds the adapter only: the base is this command's model=..., as in training
                settings, adapter = read_adapter(path)
                mcfg = OmegaConf.merge(mcfg, {"lora": settings})
            elif not (path / "config.json").exists():
                raise RlpostError(f"eval.checkpoint={cfg.eval.checkpoint!r} holds no model (config.json). "
                                  "Fix: point it at a run's final/ or checkpoints/step_N/ directory.")
            else:
                mcfg = OmegaConf.merge(mcfg, {"source": "hf", "path": str(path), "lora": {"rank": 0}})
        device = pick_device(cfg.device)
        policy, tok = load_policy(mcfg, seed=cfg.seed)
        if adapter is not None:
            from rlpost.models.lora import load_adapter_state_dict, merged_model

            load_adapter_state_dict(policy, adapter)
            policy = merged_model(policy)
        policy.to(device).eval()
        if cfg.eval.harness.tasks:  # lm-evaluation-harness tasks instead of the rlpost task's held-out split
            from rlpost.eval.harness import metric_lines, run_harness, write_results

            res = run_harness(policy, tok, cfg.eval.harness, seed=cfg.seed, device=str(device))
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            path = write_results(run_dir, res)
            for line in metric_lines(res):
                log.info(line)
            log.info(f"wrote {path} and {run_dir / 'harness_samples.jsonl'}")
            return
        from rlpost.tasks.base import task_prompts

        t = build_task(cfg.task)
        from rlpost.samplers import SAMPLERS, Sampler, build_sampler

        if SAMPLERS.get(cfg.sampler.name).eval_task is not Sampler.eval_task:  # a prompt-conditioning sampler (RC-GRPO)
            t = build_sampler(cfg.sampler, int(cfg.algo.n_samples_per_prompt)).eval_task(t)
        # rollout.speculative.drafter=mtp_head without a head file fits one on the task's training prompts
        engine = build_engine(EngineConfig.of(cfg), policy, tok, device, run_dir=run_dir, prompts=task_prompts(t, tok, cfg.seed))
        from rlpost.eval.test_time import TestTimeContext, build_test_time

        strategy = build_test_time(cfg)  # eval.test_time: a registered per-problem strategy, or None (greedy)
        res = evaluate(engine, tok, t, cfg.eval, seed=cfg.seed, rollout_cfg=cfg.rollout,
                       progress=f"evaluating {cfg.task.name}",
                       test_time=None if strategy is None else (strategy, TestTimeContext(policy, tok, engine, cfg, device)))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        (run_dir / "eval.json").write_text(json.dumps(res, indent=1, default=str))
        log.info(eval_line(res, f"of {cfg.eval.checkpoint or 'the base model'}"))
        log.info(f"wrote {run_dir / 'eval.json'}")

    _launch(_guard(task), overrides, False)


@app.command(context_settings=EXTRA)
def config(
    ctx: typer.Context,
    graph: bool = typer.Option(False, "--graph", help="Print the run graph (stages) instead of the YAML."),
) -> None:
    """Print the fully resolved config as YAML (or its run graph) without loading any model.

    Below the YAML, comment lines give each component's effective parameters
    (its declared paper defaults with this config's overrides applied).

    Examples:

      rlpost config algo=sao

      rlpost config --graph algo=ppo
    """
    from omegaconf import OmegaConf

    from rlpost.config.compose import compose_config, validate_config

    try:
        _check_recipe(list(ctx.args))
        cfg = compose_config(list(ctx.args))
        validate_config(cfg)
    except RlpostError as e:
        _fail(e)
    if graph:
        from rlpost.run.runner import format_graph

        typer.echo(format_graph(cfg))
    else:
        typer.echo(OmegaConf.to_yaml(cfg, resolve=True))
        typer.echo("# effective component parameters (declared defaults + this config):")
        for key, kw in effective_params(cfg):
            typer.echo(f"#   {key}: " + (", ".join(f"{k}={v!r}" for k, v in kw.items()) or "(no parameters)"))


REGISTRY_GROUPS = {
    "adv_estimator": ("rlpost.algos.registries", "ADV_ESTIMATORS"),
    "loss": ("rlpost.algos.registries", "POLICY_LOSSES"),
    "loss_agg": ("rlpost.algos.registries", "LOSS_AGGS"),
    "kl": ("rlpost.algos.registries", "KL_ESTIMATORS"),
    "correction": ("rlpost.algos.corrections", "CORRECTIONS"),
    "selector_kind": ("rlpost.selectors", "SELECTORS"),
    "sampler_kind": ("rlpost.samplers", "SAMPLERS"),
    "task_kind": ("rlpost.tasks.base", "TASKS"),
    "verifier": ("rlpost.tasks.verifiers", "VERIFIERS"),
    "reward_model_kind": ("rlpost.rewards.kinds", "REWARD_MODELS"),  # task.reward.models.<name>.kind
    "step_segment": ("rlpost.tasks.steps", "SEGMENTERS"),  # a PRM's segment= rule
    "tool": ("rlpost.envs.tools", "TOOLS"),  # an agent's tools (sampler.params.tools)
    "test_time": ("rlpost.eval.test_time_catalog", "TEST_TIME"),  # rlpost eval eval.test_time=<name>
}
# config directories composed with `+`/`=` but without a schema group of their own (env=, reward_model=)
EXTRA_CONF_GROUPS = ("env", "reward_model")


def _preset_description(path: Path) -> str:
    """A preset's description: its leading comment, up to the end of the first sentence that ends a line.

    Continuation lines are joined, so a sentence that runs over several comment
    lines is shown whole (never cut at the first line's end).
    """
    block: List[str] = []
    for line in path.read_text().splitlines():
        s = line.strip()
        if s.startswith("# @package"):
            continue
        if not s.startswith("#"):
            break
        block.append(s.lstrip("#").strip())
    out: List[str] = []
    for s in block:
        out.append(s)
        if s.endswith((".", "!", "?", ")")):
            break
    return " ".join(out)


def _wrap(text: str, indent: int) -> str:
    """``text`` wrapped to the terminal width, continuation lines indented by ``indent``."""
    import shutil
    import textwrap

    width = max(60, shutil.get_terminal_size((120, 24)).columns)
    return "\n".join(textwrap.wrap(text, width=width, initial_indent="", subsequent_indent=" " * indent)) or text


@app.command("list")
def list_cmd(group: Optional[str] = typer.Argument(None, help="A config group (algo, sampler, ...) or registry (loss, adv_estimator, ...).")) -> None:
    """List the choices of each config group (or of one), with a one-line description each.

    Examples:

      rlpost list

      rlpost list algo

      rlpost list loss

    Component registries (loss, adv_estimator, correction, selector_kind,
    sampler_kind) also list each component's parameters with their defaults.
    """
    import importlib

    import rlpost.tasks  # noqa: F401
    from rlpost.config.compose import conf_dir, group_choices
    from rlpost.config.schema import GROUP_SCHEMAS
    from rlpost.core.registry import param_rows

    conf_groups = list(GROUP_SCHEMAS) + list(EXTRA_CONF_GROUPS) + ["recipe"]
    groups = [group] if group else conf_groups + list(REGISTRY_GROUPS)
    for g in groups:
        if g in conf_groups:
            typer.echo(f"{g}:")
            for name in group_choices(g):
                typer.echo(_wrap(f"  {name:<24} {_preset_description(conf_dir() / g / (name + '.yaml'))}", 27))
        elif g in REGISTRY_GROUPS:
            mod, attr = REGISTRY_GROUPS[g]
            reg = getattr(importlib.import_module(mod), attr)
            typer.echo(f"{g} (registry):")
            for e in reg:
                extra = f"  [{e.paper}]" if e.paper else ""
                typer.echo(_wrap(f"  {e.name:<24} {e.description}{extra}", 27))
                if reg.typed_params:  # the component's declared parameters, defaults and docs
                    for pname, ptype, default, doc in param_rows(e.params):
                        typer.echo(f"      {pname} = {default!r} ({ptype}): {doc}")
        else:
            valid = ", ".join(conf_groups + list(REGISTRY_GROUPS))
            _fail(ConfigError(f"Unknown group {g!r}. Valid groups: {valid}."))


@app.command("recipes")
def recipes_cmd(
    name: Optional[str] = typer.Argument(None, help="One recipe: print its card (paper setting, claim, CPU check)."),
    markdown: bool = typer.Option(False, "--markdown", help="Print the table in Markdown (docs/RECIPES.md)."),
) -> None:
    """List the recipes with their papers' claims and whether `rlpost reproduce` reproduced them.

    Examples:

      rlpost recipes

      rlpost recipes vade
    """
    from omegaconf import OmegaConf

    from rlpost.experiments import recipes as R

    try:
        if name is not None:
            rec = R.load_recipe(name)
            typer.echo(f"{name}: {rec.description}")
            if rec.card is not None:
                raw = OmegaConf.load(rec.path)["card"]
                typer.echo(OmegaConf.to_yaml(raw).rstrip())
            if isinstance(rec.card, R.LinkCard):  # `rlpost reproduce NAME` would refuse it: point to the method recipe
                typer.echo(f"reproduced: see recipe {rec.card.recipe_of} (rlpost recipes {rec.card.recipe_of}); "
                           + R.link_card_note(name, rec.card))
                return
            res = R.load_result(name)
            typer.echo("reproduced: " + (R.format_result(res) if res else "not run (rlpost reproduce " + name + ")"))
            return
        if markdown:
            typer.echo(R.markdown_table())
            return
        rows = R.table_rows()
    except RlpostError as e:
        _fail(e)
    for n, what, claim, status in rows:
        typer.echo(f"{n}  [{what}]")
        typer.echo(_wrap(f"    claim: {claim}", 11))
        typer.echo(_wrap(f"    here:  {status}", 11))


@app.command("reproduce", context_settings=EXTRA)
def reproduce_cmd(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Recipe name (rlpost recipes lists them)."),
    seeds: int = typer.Option(3, "--seeds", help="Matched seeds, 0..N-1 (or from --first-seed)."),
    first_seed: int = typer.Option(0, "--first-seed", help="Seed of the first pair."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directories (default outputs/reproduce/NAME); finished runs are reused."),
    record: bool = typer.Option(True, "--record/--no-record", help="Append the result to recipes/results/NAME.json."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print each arm's overrides and stop."),
    metric: str = typer.Option("correct", "--metric", help="Per-problem figure compared: correct (greedy accuracy), pass@K, maj@K, mean@N."),
) -> None:
    """Check a recipe's claim here: its CPU variant vs its baseline over matched seeds (paired bootstrap CI).

    Extra arguments are Hydra overrides for both arms (the budget).

    Examples:

      rlpost reproduce cpu_arithmetic_grpo --seeds 3 steps=10 eval.limit=100

      rlpost reproduce vade --seeds 5

      rlpost reproduce vade --seeds 3 --metric pass@4

      rlpost reproduce dapo --dry-run
    """
    from rlpost.experiments import recipes as R

    extra = list(ctx.args)
    try:
        _check_recipe(extra)
        rec = R.load_recipe(name)
        if dry_run:
            card = rec.card
            if not isinstance(card, R.Card):
                raise ConfigError(R.link_card_note(name, card) + f"; reproduce that one: rlpost reproduce {card.recipe_of}"
                                  if isinstance(card, R.LinkCard) else f"recipe {name} has no claim card to reproduce")
            root = Path(out) if out else Path("outputs") / "reproduce" / name
            for s in range(first_seed, first_seed + seeds):
                for arm, ov in R.arm_overrides(name, card, s, extra, metric, stage_dir=root / "stage" / f"seed{s}").items():
                    typer.echo(f"seed {s} {arm}: " + (" ".join(ov) if ov else "(the method run's eval_start.json)"))
            return
        import logging

        from rlpost.core.tracking import log

        if not log.handlers and not logging.getLogger().handlers:  # outside Hydra: progress lines to stdout
            logging.basicConfig(level=logging.INFO, format="%(message)s")
        res = R.reproduce(name, seeds=seeds, extra=extra, out=out, record=record, first_seed=first_seed, log=log.info,
                          metric=metric)
    except RlpostError as e:
        _fail(e)
    except Interrupted as e:  # Ctrl-C in an arm: exit 130 (the next call reruns unfinished arms from scratch)
        typer.echo(str(e), err=True)
        raise typer.Exit(code=e.exit_code)
    typer.echo(R.format_result(res))
    if record:
        typer.echo(f"recorded in {res['record']}")


@app.command("rm-pairs", context_settings=EXTRA)
def rm_pairs_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="JSONL file to write."),
    n: int = typer.Option(400, "--n", help="Number of pairs."),
    seed: int = typer.Option(0, "--seed"),
    min_offset: int = typer.Option(1, "--min-offset", help="Smallest |wrong - gold|."),
    max_offset: int = typer.Option(10, "--max-offset", help="Largest |wrong - gold|."),
) -> None:
    """Write chosen/rejected pairs from a task's training prompts: the gold answer against a wrong one.

    Arguments are Hydra overrides choosing the task (default task=arithmetic).

    Example:

      rlpost rm-pairs --out pairs.jsonl --n 400 task=arithmetic
    """
    from rlpost.config.compose import compose_config
    from rlpost.rewards.train_rm import task_pairs, write_pairs
    from rlpost.tasks import build_task

    try:
        cfg = compose_config(list(ctx.args))
        rows = task_pairs(build_task(cfg.task), n, seed=seed, min_offset=min_offset, max_offset=max_offset)
        write_pairs(rows, str(out))
    except RlpostError as e:
        _fail(e)
    typer.echo(f"{len(rows)} pairs -> {out}")


@app.command("train-rm", context_settings=EXTRA)
def train_rm_cmd(
    ctx: typer.Context,
    pairs: Path = typer.Option(..., "--pairs", help="JSONL rows with prompt, chosen, rejected (system optional)."),
    out: Path = typer.Option(..., "--out", help="Directory for the trained reward model."),
    steps: int = typer.Option(60, "--steps"),
    lr: float = typer.Option(2e-5, "--lr"),
    batch_size: int = typer.Option(8, "--batch-size", help="Pairs per step."),
    eval_frac: float = typer.Option(0.2, "--eval-frac", help="Share of pairs held out for pairwise accuracy."),
    train_layers: int = typer.Option(-1, "--train-layers", help="-1: all; k: last k layers + head; 0: head on cached features."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Train a Bradley-Terry reward model (one score head) on chosen/rejected pairs; print held-out pairwise accuracy.

    Arguments are Hydra overrides choosing the base model (default model=smollm2-135m).
    The result is a directory for task.reward.models.<name>.model_path (kind=rm).

    Example:

      rlpost train-rm --pairs pairs.jsonl --out rm/ --train-layers 0 --steps 300 --lr 1e-3
    """
    import json

    from rlpost.config.compose import compose_config
    from rlpost.rewards.train_rm import init_reward_model, read_pairs, train_reward_model

    try:
        cfg = compose_config(list(ctx.args))
        rows = read_pairs(str(pairs))
        model, tok = init_reward_model(cfg.model, seed=seed)
        rep = train_reward_model(rows, model, tok, str(out), steps=steps, lr=lr, batch_size=batch_size,
                                 eval_frac=eval_frac, seed=seed, train_layers=train_layers, log=typer.echo)
    except RlpostError as e:
        _fail(e)
    typer.echo(json.dumps(rep))
    typer.echo(f"held-out pairwise accuracy {rep['heldout_accuracy']:.3f} (before training {rep['heldout_accuracy_before']:.3f}, "
               f"{rep['heldout_pairs']} pairs); saved to {out}")


def main() -> None:
    """Console-script entry point."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    # one progress bar on the console (rlpost's): no "Loading weights" / shard bars from transformers and
    # the hub (HF_HUB_DISABLE_PROGRESS_BARS=0 brings them back, e.g. for a long model download)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from rlpost.eval.compare import register_cli

    register_cli(app)  # `rlpost compare`
    from rlpost.eval.report import register_cli as register_report

    register_report(app)  # `rlpost report`
    app()


def effective_params(cfg: Any) -> List[tuple]:
    """``(config key=name, {param: value})`` of each chosen component: its declared defaults plus this config.

    What the run will pass to the loss, estimator, correction, selector and
    sampler (``rlpost config`` prints it under the YAML). Call after
    :func:`validate_config`.
    """
    from rlpost.algos.corrections import CORRECTIONS
    from rlpost.algos.registries import ADV_ESTIMATORS
    from rlpost.algos.validate import adv_overrides, loss_kwargs
    from rlpost.core.registry import as_dict as _as_dict
    from rlpost.samplers import SAMPLERS
    from rlpost.selectors import SELECTORS

    a = cfg.algo
    return [
        (f"algo.loss={a.loss}", loss_kwargs(a)),
        (f"algo.adv_estimator={a.adv_estimator}", ADV_ESTIMATORS.kwargs(a.adv_estimator, adv_overrides(a))),
        (f"precision.correction={cfg.precision.correction}",
         CORRECTIONS.kwargs(cfg.precision.correction, _as_dict(cfg.precision.correction_params))),
        (f"selector={cfg.selector.name}", SELECTORS.kwargs(cfg.selector.name, _as_dict(cfg.selector.params))),
        (f"sampler={cfg.sampler.name}", SAMPLERS.kwargs(cfg.sampler.name, _as_dict(cfg.sampler.params))),
    ]



if __name__ == "__main__":
    main()
