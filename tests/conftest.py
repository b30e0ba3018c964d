"""Shared test fixtures: tiny-model overrides and config composition."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# A run small enough for unit tests: 2-layer random model, 4 prompts x 4 samples, 12 tokens.
TINY = [
    "model=tiny",
    "logger=jsonl",
    "rollout.max_new_tokens=12",
    "selector.prompts_per_step=4",
    "algo.n_samples_per_prompt=4",
    "eval.limit=8",
    "eval.at_start=false",  # unit tests log steps 1..N only (the summary test turns it on)
    "eval.max_new_tokens=12",
    "task.train_size=64",
    "task.eval_size=16",
    "trainer.micro_batch_size=8",
    "precision=fp32",  # the same dtype on every machine (the default, auto, depends on the CPU)
]


def tiny_overrides(*extra: str) -> List[str]:
    """TINY plus ``extra`` overrides (later ones win)."""
    return TINY + list(extra)


@pytest.fixture(autouse=True)
def _restore_logging():
    """Undo what an in-process CLI run (``CliRunner().invoke(app, ["train"|"eval", ...])``) does to logging.

    Hydra's ``job_logging`` puts a console handler on the root logger, bound to the runner's captured
    stdout, and a ``FileHandler`` on the run's ``cli.log``. Left in place, later tests log into a closed
    stream and a file under another test's deleted directory (the CI failure of stop 39). Handlers a
    test adds are closed and removed, and the root and ``rlpost`` levels are restored.
    """
    import logging

    root, pkg = logging.getLogger(), logging.getLogger("rlpost")
    before, levels = list(root.handlers), (root.level, pkg.level)
    yield
    for h in [h for h in root.handlers if h not in before]:
        root.removeHandler(h)
        h.close()
    root.setLevel(levels[0])
    pkg.setLevel(levels[1])


@pytest.fixture
def compose():
    """``compose(overrides) -> DictConfig`` through the real Hydra config tree."""
    from rlpost.config.compose import compose_config

    return compose_config


@pytest.fixture
def one_thread():
    """Run the test with one intra-op torch thread (restored after).

    Tiny-model forwards are latency-bound: one thread avoids spin-waiting on a shared machine.
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def train_rows(tmp_path, overrides):
    """Train ``model=tiny`` (6 new tokens, 2 prompts x 4 samples, no final evaluation or checkpoint) with
    ``overrides`` in ``tmp_path``; returns the logged step rows (dicts with ``reward/mean``)."""
    import json

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["model=tiny", "logger=jsonl", "rollout.max_new_tokens=6", "selector.prompts_per_step=2",
                          "algo.n_samples_per_prompt=4", "eval.at_end=false", "checkpoint.every=0", *overrides])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "reward/mean" in r]


def update_with_gradient(trainer, batch):
    """Run ``trainer.policy_update(batch)`` with the optimizer step replaced by a capture.

    Returns ``(metrics, g)``: the update's metrics and the flat gradient ``[n_params]`` (all
    parameters that received one, concatenated in order) it would have stepped on. The weights
    are not changed, so a test can compare gradients of several configurations on one model.
    """
    import torch

    grads = {}

    def capture(params):
        grads["g"] = torch.cat([p.grad.flatten() for p in params if p.grad is not None]).clone()
        trainer.opt.zero_grad(set_to_none=True)
        return float(grads["g"].norm())

    trainer._policy_step = capture
    metrics = trainer.policy_update(batch)
    return metrics, grads["g"]


def start_local_ray() -> None:
    """A local Ray cluster of 2 CPUs for tests: no dashboard, a 100 MB object store, worker output kept in
    Ray's logs, and workers that import this checkout on one thread each (a running cluster is shut down first)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False,
             configure_logging=False, runtime_env={"env_vars": {
                 "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}})


class CharTok:
    """A tokenizer with one token per character (id = code point), offsets like a fast tokenizer, and a
    decode that joins the characters: step boundaries map to tokens by hand (GRPO-VPS, SCOPE tests)."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        out = {"input_ids": [ord(c) for c in text]}
        if return_offsets_mapping:
            out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
        return out

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


# ---------------------------------------------------------------- parallel runs (pytest-xdist)
#
# The README's test command runs the suite on every core (`-n auto`; pyproject.toml adds `--dist loadgroup`).
# The unit of work is a test file (its module-scoped fixtures are built once), except the files below.

#: files whose tests start engines, by kind: one worker runs a kind's files one after another (a Ray
#: cluster at a time: Ray's /tmp/ray session and its 2-CPU cluster; the vLLM engines, servers and
#: torchrun/DeepSpeed process groups likewise), while another worker may run the other kind. A file
#: with both kinds goes under ``ray``.
ENGINE_GROUPS = {
    "ray": {"test_ray_launcher.py", "test_ray_console.py", "test_method_roll.py", "test_vllm_runs.py"},
    "engines": {"test_vllm_engine.py", "test_judge_vllm_serve.py", "test_deepspeed.py", "test_data_parallel.py",
                "test_async.py"},
    # the files that run programs in the sandbox: every sandboxed program runs as the user nobody, whose
    # RLIMIT_NPROC (16 in the containment tests) counts the programs of both workers together, so two of these
    # files at once made forks fail (rlpost/envs/sandbox.py)
    "sandbox": {"test_sandbox_containment.py", "test_code_task.py", "test_agents.py", "test_episode_integrity.py",
                "test_method_agentflow.py", "test_method_pot.py"},
}
ENGINE_FILES = {f: g for g, files in ENGINE_GROUPS.items() for f in files}
#: tests marked ``vllm`` in other files (``file::test``): they join ``engines``. The collection checks that
#: every ``vllm`` test is in an engine group, so a new one outside these files is named here.
VLLM_ELSEWHERE = {
    "test_lora.py::test_vllm_engine_runs_the_adapter_through_lora_requests",
    "test_vllm.py::test_engine_on_the_cpu_platform_drives_the_calls_the_real_cpu_engine_needs",
}
#: files with many independent, self-contained cases (no module-scoped fixture worth sharing): their
#: tests are spread over the workers one by one, and scheduled last, so the short units fill the end
#: of the run on both cores
SPREAD_FILES = {"test_recipes.py"}
#: groups scheduled first, longest first (docs/TESTING.md's profile), so that no long group starts last
FIRST = ["engines", "ray", "sandbox"]


def group_of(nodeid: str) -> str:
    """The unit of work of test ``nodeid`` (``tests/FILE.py::name[params]``): its engine group, the test itself
    for :data:`SPREAD_FILES`, else its file."""
    path, _, rest = nodeid.partition("::")
    name = path.rsplit("/", 1)[-1]
    if name in ENGINE_FILES:
        return ENGINE_FILES[name]
    if f"{name}::{rest.split('[', 1)[0]}" in VLLM_ELSEWHERE:
        return "engines"
    if name in SPREAD_FILES:
        return nodeid
    return path


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: the cores this process may run on (``os.cpu_count()`` counts the host's in a container)."""
    return max(1, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_xdist_make_scheduler(config, log):
    """Units of work by :func:`group_of`, in collection order (``--no-loadscope-reorder``).

    xdist's own ``loadgroup`` reads ``xdist_group`` marks by suffixing the node id, which pytest 9.2 no longer
    lets a plugin do (``Node.nodeid`` is derived from a structured id): every test became a unit of its own, so
    engine tests ran on both workers at once and module fixtures (a vLLM engine, a torchrun run) were built
    once per worker. The scope comes from the node id instead."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Order the tests for :func:`pytest_xdist_make_scheduler`: the :data:`FIRST` groups, then the other files as
    collected, then the tests of :data:`SPREAD_FILES` (a stable sort).

    Raises:
        pytest.UsageError: a test marked ``vllm`` outside the engine groups (name it in :data:`VLLM_ELSEWHERE`).
    """
    rank = {g: i for i, g in enumerate(FIRST)}
    stray = [it.nodeid for it in items if it.get_closest_marker("vllm") is not None
             and group_of(it.nodeid) not in ENGINE_GROUPS]
    if stray:
        raise pytest.UsageError("tests marked vllm outside the engine groups; add them to VLLM_ELSEWHERE in "
                                "tests/conftest.py: " + ", ".join(stray))

    def key(it):
        g = group_of(it.nodeid)
        if g in rank:
            return (0, rank[g])
        return (2, 0) if it.path.name in SPREAD_FILES else (1, 0)

    items.sort(key=key)


def pytest_configure(config):
    """Under xdist each worker runs torch on one thread: two workers on two cores, no spin-waiting."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)
