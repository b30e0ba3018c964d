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
#: with both kinds goes under ``ray``. Every test marked ``vllm`` elsewhere joins ``engines``.
ENGINE_GROUPS = {
    "ray": {"test_ray_launcher.py", "test_ray_console.py", "test_method_roll.py", "test_vllm_runs.py"},
    "engines": {"test_vllm_engine.py", "test_judge_vllm_serve.py", "test_deepspeed.py", "test_data_parallel.py",
                "test_async.py"},
}
ENGINE_FILES = {f: g for g, files in ENGINE_GROUPS.items() for f in files}
#: files with many independent, self-contained cases (no module-scoped fixture worth sharing): their
#: tests are spread over the workers one by one, and scheduled last, so the short units fill the end
#: of the run on both cores
SPREAD_FILES = {"test_recipes.py"}
#: groups scheduled first, longest first (docs/TESTING.md's profile), so that no long group starts last
FIRST = ["engines", "ray"]


def _group(item) -> str:
    name = item.path.name
    if name in ENGINE_FILES:
        return ENGINE_FILES[name]
    if item.get_closest_marker("vllm") is not None:
        return "engines"
    if name in SPREAD_FILES:
        return item.nodeid
    return name


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: the cores this process may run on (``os.cpu_count()`` counts the host's in a container)."""
    return max(1, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_collection_modifyitems(config, items):
    """Give each test its xdist group (:func:`_group`); order the groups: :data:`FIRST`, then the other
    files as collected, then the tests of :data:`SPREAD_FILES` (a stable sort; run with
    ``--no-loadscope-reorder`` so xdist keeps this order)."""
    rank = {g: i for i, g in enumerate(FIRST)}
    for item in items:
        item.stash[_GROUP] = g = _group(item)
        item.add_marker(pytest.mark.xdist_group(g))

    def key(it):
        g = it.stash[_GROUP]
        if g in rank:
            return (0, rank[g])
        return (2, 0) if it.path.name in SPREAD_FILES else (1, 0)

    items.sort(key=key)


_GROUP = pytest.StashKey[str]()


def pytest_configure(config):
    """Under xdist each worker runs torch on one thread: two workers on two cores, no spin-waiting."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)
