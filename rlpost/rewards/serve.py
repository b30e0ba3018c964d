"""Start a local ``vllm serve`` (vLLM's CPU backend here) for an LLM judge, and wait until it answers.

Used by the judge's real-server test, the benchmark and the documented CPU run.
The settings are the ones that work on this CPU (docs/ENGINES.md, "vLLM on CPU"):
fp32 or bf16, eager mode, a KV cache of ``kv_cache_gib`` GiB (``VLLM_CPU_KVCACHE_SPACE``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import List, Optional


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class VllmServer:
    """vLLM's OpenAI-compatible server (what ``vllm serve MODEL_DIR`` runs) as a child process (its own process group), stopped on exit.

    Args:
        model_dir: the local model directory.
        port: TCP port (0: a free one).
        dtype: float32 | bfloat16.
        max_model_len: context length served.
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB: vLLM reads it as an int).
        threads: ``OMP_NUM_THREADS`` of the server (None: unchanged).
        log_path: where the server's output goes (None: a temp file).
        served_name: ``--served-model-name``.

    Raises:
        RuntimeError: (``start``) no ``vllm`` executable, or the server did not
            answer ``/v1/models`` within ``timeout_s`` (the log's tail in the message).
    """

    def __init__(self, model_dir: str, port: int = 0, dtype: str = "float32", max_model_len: int = 1024,
                 kv_cache_gib: float = 1.0, threads: Optional[int] = None, log_path: Optional[str] = None,
                 served_name: str = "judge") -> None:
        self.model_dir, self.port = str(model_dir), int(port) or free_port()
        self.dtype, self.max_model_len, self.kv = dtype, int(max_model_len), kv_cache_gib
        self.threads, self.served_name = threads, served_name
        self.log_path = log_path or f"/tmp/rlpost-vllm-serve-{self.port}.log"
        self.proc: Optional[subprocess.Popen] = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> List[str]:
        """The ``vllm serve`` command line."""
        # the OpenAI server's module, not the `vllm` console script: vllm-cpu's script looks up the version of a
        # distribution named "vllm" and fails (PackageNotFoundError) before serving
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir, "--port", str(self.port), "--host", "127.0.0.1", "--dtype", self.dtype,
                "--enforce-eager", "--max-model-len", str(self.max_model_len), "--served-model-name", self.served_name,
                "--max-num-seqs", "16"]

    def start(self, timeout_s: float = 240.0) -> "VllmServer":
        """Start the server and wait until ``GET /v1/models`` answers."""
        import importlib.util

        cmd = self.command()
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError("vllm is not installed (bash scripts/setup.sh installs vLLM's CPU backend)")
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(max(1, int(round(self.kv)))), VLLM_LOGGING_LEVEL="WARNING")
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.base_url + "/models", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(1.0)
        tail = Path(self.log_path).read_text()[-2000:]
        self.stop()
        raise RuntimeError(f"vllm serve did not come up within {timeout_s} s; log tail:\n{tail}")

    def stop(self) -> None:
        """SIGTERM the server's process group, then SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
