"""Multi-process launch for ``trainer=deepspeed trainer.num_procs=N``: re-run the command under torchrun.

``rlpost train trainer=deepspeed trainer.num_procs=2 ...`` is turned into

    python -m torch.distributed.run --nproc_per_node=2 --master_port=<free> \\
        -m rlpost.cli train ... hydra.run.dir=<one directory for every rank>

PyTorch's standard launcher sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and the
rendezvous; every rank then builds the same run and DeepSpeed joins them
(gloo on CPU, nccl on GPU). Nothing here schedules processes itself.

Past one machine, use DeepSpeed's launcher with a hostfile (``docs/ENGINES.md``):

    deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 --module rlpost.cli train \\
        trainer=deepspeed hydra.run.dir=/shared/run ...

(``RANK`` is then already set, so no second launch happens.)
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
import subprocess
import sys
from typing import Any, List

from rlpost.core.errors import ConfigError


def needs_launch(cfg: Any) -> bool:
    """True when ``cfg`` asks for several processes and this process is not one of them yet.

    Raises:
        ConfigError: ``trainer.num_procs > 1`` with ``trainer=torch``, or ``num_procs < 1``.
    """
    n = int(cfg.trainer.num_procs)
    if n < 1:
        raise ConfigError(f"trainer.num_procs={n} must be >= 1.")
    if n > 1 and cfg.trainer.engine != "deepspeed":
        raise ConfigError(f"trainer.num_procs={n} needs the DeepSpeed engine. Fix: add trainer=deepspeed.")
    return n > 1 and "RANK" not in os.environ


def launch_command(overrides: List[str], nprocs: int, run_dir: str, port: int) -> List[str]:
    """The torchrun command line that runs ``rlpost train <overrides>`` on ``nprocs`` local processes."""
    rest = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nprocs}",
            "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "rlpost.cli", "train", *rest,
            f"hydra.run.dir={run_dir}"]


def relaunch(cfg: Any, overrides: List[str]) -> int:
    """Run the training command on ``trainer.num_procs`` processes; returns torchrun's exit status.

    The run directory is fixed up front (``hydra.run.dir`` if given, else
    ``outputs/<name>/<timestamp>``) so that every rank writes to the same one.
    """
    run_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")), None)
    if run_dir is None:
        run_dir = os.path.join("outputs", str(cfg.name), _dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = launch_command(list(overrides), int(cfg.trainer.num_procs), run_dir, port)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)


def local_device(requested: str = "auto") -> "torch.device":
    """The device this process places models on, and (on CUDA) make it the current device.

    Under torchrun/deepspeed (``LOCAL_RANK`` set) a CUDA run uses ``cuda:<LOCAL_RANK>``
    and calls ``torch.cuda.set_device`` on it *before* any model or engine is
    built: DeepSpeed, NCCL and vLLM's executor all place work on the current
    device, which otherwise is GPU 0 for every rank. ``requested``: ``auto``
    (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N`` (an explicit
    index is kept as given).

    Raises:
        ConfigError: ``LOCAL_RANK`` names a GPU this node does not have.
    """
    import torch

    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(requested)
    if dev.type != "cuda":
        return dev
    if dev.index is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        n = torch.cuda.device_count()
        if local >= n:
            raise ConfigError(f"LOCAL_RANK={local} but this node has {n} GPU(s). Fix: set trainer.num_procs <= {n}.")
        dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    return dev
