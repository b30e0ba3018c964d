"""A sandbox for model-written Python: a child process under POSIX resource limits.

Mechanisms (all standard POSIX / Linux, applied in the child between ``fork`` and ``exec``):

- its own session and process group (``os.setsid``); on a wall-clock timeout the whole
  group is killed (``os.killpg(SIGKILL)``), so ``fork``-ed children die with it;
- ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space: a 10 GB allocation raises
  ``MemoryError``), ``RLIMIT_FSIZE`` (largest file the code may write; stdout goes to a file,
  so a 100 MB print is cut at the limit by ``SIGXFSZ``), ``RLIMIT_NPROC`` (processes of the
  sandbox user: a fork bomb gets ``EAGAIN``), ``RLIMIT_CORE`` = 0;
- a throw-away working directory (``tempfile.mkdtemp``), removed afterwards; ``HOME`` points
  there and the environment is emptied; ``python -I`` (isolated mode: no user site, no
  ``PYTHON*`` variables);
- when the parent runs as root: a fresh, empty network namespace (``unshare(CLONE_NEWNET)``
  via libc: no interface is up, not even loopback, so every connect fails), and the child
  drops to the unprivileged user ``nobody`` (so ``RLIMIT_NPROC`` is enforced, and files
  outside world-writable places such as ``/tmp`` cannot be written).

What it does NOT protect against (no container, seccomp or filesystem namespace here):
reading world-readable files; writing world-writable directories (``/tmp``) when run as root
(dropped to ``nobody``); and, when the parent is not root, writing anything the user can
write and opening network connections (``network_isolated`` then reports False; run the
trainer as root in a container, or inside a stronger sandbox such as a gVisor/Firecracker
VM, when untrusted code must be contained). ``RLIMIT_NPROC`` counts every process of the
user, so for a non-root parent it limits the sandbox only in proportion.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

CLONE_NEWNET = 0x40000000


@dataclass
class SandboxLimits:
    """Resource limits of one sandboxed run.

    Attributes:
        wall_s: wall-clock seconds before the process group is killed.
        cpu_s: CPU seconds (``RLIMIT_CPU``).
        memory_mb: address-space limit in MiB (``RLIMIT_AS``).
        output_bytes: stdout + stderr kept (and the largest file the code may write, ``RLIMIT_FSIZE``).
        nproc: process limit of the sandbox user (``RLIMIT_NPROC``; enforced when dropped to ``nobody``).
        isolate_network: enter an empty network namespace when possible.
        python: interpreter to run; default the system ``/usr/bin/python3`` when dropping to
            ``nobody`` (a virtualenv under ``/root`` is not readable by it), else ``sys.executable``.
    """

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    output_bytes: int = 16_384
    nproc: int = 16
    isolate_network: bool = True
    python: Optional[str] = None


@dataclass
class SandboxResult:
    """Outcome of :func:`run_python`.

    Attributes:
        stdout, stderr: captured text, each cut at ``output_bytes``.
        returncode: exit status (negative: killed by that signal), None if it never ran.
        timed_out: the wall-clock limit killed it.
        output_truncated: output reached ``output_bytes``.
        network_isolated: the code ran in an empty network namespace.
        seconds: wall time.
    """

    stdout: str
    stderr: str
    returncode: Optional[int]
    timed_out: bool
    output_truncated: bool
    network_isolated: bool
    seconds: float

    @property
    def ok(self) -> bool:
        """True when the code exited with status 0 within its limits."""
        return self.returncode == 0 and not self.timed_out and not self.output_truncated

    def message(self, limit_chars: int = 2000) -> str:
        """The text a tool returns to the model: stdout, or a one-line error naming the limit hit."""
        if self.timed_out:
            return f"Error: execution timed out (killed).\n{self.stdout[:limit_chars]}".rstrip()
        if self.returncode == -signal.SIGXCPU or self.returncode == -signal.SIGKILL:
            return "Error: CPU time limit exceeded (killed)."
        if self.output_truncated or self.returncode == -signal.SIGXFSZ:
            return f"Error: output limit exceeded; first part:\n{self.stdout[:limit_chars]}".rstrip()
        if self.returncode != 0:
            err = self.stderr.strip().splitlines()
            last = err[-1] if err else f"exit status {self.returncode}"
            return f"Error: {last}"[:limit_chars]
        return self.stdout[:limit_chars]


_NOBODY: Optional[tuple] = None


def _nobody() -> Optional[tuple]:
    global _NOBODY
    if _NOBODY is None:
        try:
            pw = pwd.getpwnam("nobody")
            _NOBODY = (pw.pw_uid, pw.pw_gid)
        except KeyError:
            _NOBODY = ()
    return _NOBODY or None


def run_python(code: str, limits: Optional[SandboxLimits] = None) -> SandboxResult:
    """Run ``code`` with ``python -I`` in a fresh directory under :class:`SandboxLimits`.

    Never raises for anything the code does (loops, huge allocations, forks, sockets,
    writes, floods of output): those end as a non-ok :class:`SandboxResult`.

    Raises:
        OSError: the sandbox itself could not be set up (no temp directory, no python).
    """
    lim = limits or SandboxLimits()
    root = os.geteuid() == 0
    drop = _nobody() if root else None
    isolate = bool(lim.isolate_network and root)
    work = tempfile.mkdtemp(prefix="rlpost-sandbox-")
    try:
        with open(os.path.join(work, "main.py"), "w") as f:
            f.write(code)
        out_path, err_path = os.path.join(work, ".stdout"), os.path.join(work, ".stderr")
        if drop:
            for p in (work, os.path.join(work, "main.py")):
                os.chown(p, *drop)
        fsize = int(lim.output_bytes) + 1

        def child_setup() -> None:  # runs in the child between fork and exec
            os.setsid()
            if isolate:
                if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) != 0:
                    os._exit(99)
            resource.setrlimit(resource.RLIMIT_CPU, (int(lim.cpu_s), int(lim.cpu_s) + 1))
            mem = int(lim.memory_mb) * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_NPROC, (int(lim.nproc), int(lim.nproc)))
            if drop:
                os.setgroups([])
                os.setgid(drop[1])
                os.setuid(drop[0])

        env = {"PATH": "/usr/bin:/bin", "HOME": work, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
        t0 = time.perf_counter()
        timed_out = False
        with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
            if drop:
                os.chown(out_path, *drop)
                os.chown(err_path, *drop)
            exe = lim.python or ("/usr/bin/python3" if drop and os.path.exists("/usr/bin/python3") else sys.executable)
            proc = subprocess.Popen(
                [exe, "-I", "main.py"], cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=fo,
                stderr=fe, preexec_fn=child_setup, close_fds=True,
            )
            try:
                proc.wait(timeout=float(lim.wall_s))
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)  # the whole group: forked children die too, even those forked mid-kill
                proc.wait()
        secs = time.perf_counter() - t0
        if proc.returncode == 99 and isolate:
            isolate = False  # could not enter a network namespace: report it honestly
        stdout, n_out = _read_capped(out_path, lim.output_bytes)
        stderr, n_err = _read_capped(err_path, lim.output_bytes)
        truncated = n_out >= fsize or n_err >= fsize or proc.returncode == -signal.SIGXFSZ
        return SandboxResult(stdout, stderr, proc.returncode, timed_out, truncated, isolate, secs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _kill_group(pgid: int, wait_s: float = 2.0) -> None:
    """SIGKILL process group ``pgid`` until it is empty (a fork bomb may fork while being killed).

    Repeats ``killpg`` every 10 ms for at most ``wait_s`` seconds; a group whose
    only members are zombies awaiting their reaper counts as gone.
    """
    deadline = time.perf_counter() + wait_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if not _live_members(pgid) or time.perf_counter() > deadline:
            return
        time.sleep(0.01)


def _live_members(pgid: int) -> bool:
    """Whether any non-zombie process is in group ``pgid`` (read from /proc; False where /proc is absent)."""
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _read_capped(path: str, n: int) -> tuple:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        return f.read(n).decode("utf-8", "replace"), size
