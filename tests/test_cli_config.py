"""Config validation through the real CLI: exit status 2, one clear message, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from rlpost.cli import app

runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["config", "algo=grpoo"], "Valid choices for algo: "),
        (["config", "algo.clip.eps_hgh=0.3"], "Unknown config key 'algo.clip.eps_hgh'"),
        (["config", "steps=many"], "Wrong type for steps"),
        (["config", "algo=ppo", "algo.critic.enabled=false"], "needs a critic"),
        (["config", "algo.loss=nope"], "Unknown policy loss algo.loss='nope'"),
        (["config", "trainer.lr=-1"], "trainer.lr must be > 0"),
        # before this check, eval.limit=0 loaded the model and failed at the first evaluation (exit 4)
        (["config", "eval.limit=0"], "eval.limit=0 must be >= 1"),
        (["config", "eval.n_samples=0"], "eval.n_samples must be >= 1"),
    ],
)
def test_config_errors_exit_2_with_message(args, needle):
    res = _run(*args)
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert "Traceback" not in res.output


def test_unknown_group_lists_valid_choices():
    res = _run("config", "algo=grpoo")
    assert "grpo" in res.output and "ppo" in res.output and "sao" in res.output
    assert "Did you mean" in _run("config", "algo.loss=ppo_clipp").output


def test_train_bad_config_writes_nothing(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlpost.cli", "train", "algo=nosuch", f"hydra.run.dir={out}"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert "Unknown choice algo='nosuch'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_sweep_without_m_is_refused():
    res = _run("train", "seed=1,2")
    assert res.exit_code == 2
    assert "add -m" in res.output


def test_config_prints_resolved_yaml_and_graph():
    res = _run("config", "algo=sao")
    assert res.exit_code == 0
    assert "adv_estimator: sao" in res.output and "name: sao-arithmetic" in res.output
    g = _run("config", "--graph", "algo=ppo")
    assert g.exit_code == 0
    assert "critic_update" in g.output and "(skipped)" in g.output


def test_list_shows_groups_and_registries():
    res = _run("list", "algo")
    assert res.exit_code == 0 and "grpo" in res.output and "arXiv" in res.output
    res = _run("list", "loss")
    assert "ppo_clip" in res.output and "strict_double_clip" in res.output
    assert _run("list", "nosuchgroup").exit_code == 2
    res = _run("list")  # the groups without a schema of their own and the registries of tools and test-time strategies
    for line in ("env:", "  calculator", "reward_model:", "tool (registry):", "test_time (registry):", "  pot"):
        assert "\n" + line in res.output, line


def test_help_examples_quote_hydra_ranges_for_the_shell():
    """`seed=range(3)` unquoted is a bash syntax error; `rlpost report --help` showed it so."""
    import re

    outs = {}
    for cmd in ("train", "eval", "report", "compare", "reproduce"):  # the console script's app (report is added in main)
        p = subprocess.run([sys.executable, "-m", "rlpost.cli", cmd, "--help"], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "200"})
        assert p.returncode == 0, p.stderr
        outs[cmd] = p.stdout
        for m in re.finditer(r"\S*=range\(", p.stdout):
            assert m.group(0).startswith(("'", '"')), f"rlpost {cmd} --help: unquoted {m.group(0)}"
    assert "'seed=range(3)'" in outs["report"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--steps", "3"], "'--steps' is not an option of this command: settings are Hydra overrides "
                                    "key=value, so write steps=3; the command's options: --help."),
        (["train", "--lr=1e-4"], "'--lr=1e-4' is not an option of this command: settings are Hydra overrides "
                                 "key=value, so write trainer.lr=1e-4 or algo.critic.lr=1e-4; the command's options: --help."),
        (["eval", "--max-new-tokens", "8"], "'--max-new-tokens' is not an option of this command: settings are Hydra "
                                            "overrides key=value, so write rollout.max_new_tokens=8 or "
                                            "eval.max_new_tokens=8; the command's options: --help."),
        (["config", "steps", "3"], "'steps' is not an override: write steps=3 (rlpost config prints every key)."),
        (["config", "train"], "'train' is not an override: write key=value, e.g. steps=3 (rlpost config prints every key)."),
    ],
)
def test_argparse_style_arguments_name_the_override_to_write(args, message):
    """Hydra's own message was 'Invalid config: LexerNoViableAltException: --steps'."""
    res = _run(*args)
    assert res.exit_code == 2, res.output
    assert res.output.strip() == f"error: {message}"


def test_schema_keys_of_a_leaf_is_empty():
    from rlpost.config.compose import _schema_keys

    assert _schema_keys("steps") == []  # a field without a default factory (raised TypeError before)
    assert "limit" in _schema_keys("eval") and "lr" in _schema_keys("trainer")


def test_path_values_with_hydra_syntax_are_quoted_outside_a_sweep():
    from rlpost.config.compose import normalize_overrides, quote_path_value

    job = "multirun/2026-01-01_00-00-00/0_algo=grpo,seed=1"
    assert quote_path_value(f"hydra.run.dir={job}") == f"hydra.run.dir='{job}'"
    assert quote_path_value("eval.checkpoint=it's,x") == "eval.checkpoint=\"it's,x\""
    for same in ("hydra.run.dir=outputs/run", "task.path='a,b'", "algo=grpo,sao", "resume=auto", "~task.path"):
        assert quote_path_value(same) == same
    assert normalize_overrides(["task.path=a.jsonl,b.jsonl"], quote_paths=False) == ["task.path=a.jsonl,b.jsonl"]


def test_resume_a_sweep_job_by_its_directory(tmp_path):
    """A sweep job's directory is named '<n>_algo=grpo,seed=1': `hydra.run.dir=<it>` was refused as
    "looks like a sweep" (and Hydra cannot parse it unquoted), so a killed sweep job could not be resumed
    with the command its own interrupt message prints."""
    from conftest import REPO, tiny_overrides

    job = tmp_path / "0_algo=grpo,seed=1"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for steps in (1, 2):
        p = subprocess.run([sys.executable, "-m", "rlpost.cli", "train",
                            *tiny_overrides(f"steps={steps}", "eval.at_start=false", "eval.at_end=false"),
                            "resume=auto", f"hydra.run.dir={job}"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    assert "resume=auto: resuming from" in p.stdout and "(step 1 of 2)" in p.stdout
    assert (job / "DONE").read_text().strip() == "2"


_PROBE = """
import sys
from rlpost.cli import main
sys.argv = ['rlpost'] + sys.argv[1:]
try:
    main()
except SystemExit:
    pass
print('LOADED', ' '.join(m for m in ('torch', 'transformers', 'deepspeed', 'ray', 'vllm') if m in sys.modules))
"""


@pytest.mark.parametrize("args, heavy_allowed", [
    (["--version"], ""),
    (["train", "steps=abc"], ""),  # a rejected override
    (["train", "model=nosuch"], ""),
    (["list"], "torch"),  # the registries are torch functions; transformers is not needed to list them
    (["config", "model=tiny"], "torch"),
])
def test_trivial_commands_do_not_import_the_heavy_libraries(args, heavy_allowed):
    from conftest import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, env=env, timeout=300)
    loaded = [line for line in p.stdout.splitlines() if line.startswith("LOADED")][-1]
    assert loaded.split()[1:] == heavy_allowed.split(), (args, loaded, p.stderr[-2000:])


def test_train_puts_the_composition_rules_on_hydras_command_line():
    """``rlpost train algo=hapo`` composes in Hydra's own main: the rule's ``sampler=`` must be on its
    command line (it was not, and the run stopped at its own sampler check); a sweep whose jobs
    need different rule overrides is refused."""
    from rlpost.cli import _with_rule_overrides
    from rlpost.core.errors import ConfigError

    assert _with_rule_overrides(["algo=hapo", "model=tiny"], False) == ["algo=hapo", "model=tiny", "sampler=adaptive_temperature"]
    assert _with_rule_overrides(["algo=hapo", "sampler=adaptive_temperature"], False)[-1] == "sampler=adaptive_temperature"
    assert _with_rule_overrides(["algo=grpo"], False) == ["algo=grpo"]
    assert _with_rule_overrides(["algo=grpo,dr_grpo"], True) == ["algo=grpo,dr_grpo"]
    with pytest.raises(ConfigError, match="sweep them separately"):
        _with_rule_overrides(["algo=hapo,grpo"], True)
