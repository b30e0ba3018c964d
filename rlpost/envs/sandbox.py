"""A sandbox for model-written Python: a child process under POSIX resource limits.

Mechanisms (all standard Linux):

- a **supervisor** process (``sandbox_supervisor.py``, run by the trainer's interpreter) that is a
  child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): every orphaned descendant of the code is
  re-parented to it, whatever session or process group it moved to (double fork, ``setsid``,
  ``start_new_session``, daemonising). When the code exits or its wall clock runs out, the
  supervisor SIGKILLs every descendant and reaps until it has no child left, so no process of a
  call outlives the call (before, a ``setsid`` child re-parented to PID 1 survived the kill and
  used up the sandbox user's ``RLIMIT_NPROC`` for every later call);
- a **seccomp filter** (libseccomp through ``pyseccomp``) loaded just before exec: ``unshare``,
  ``setns`` and ``clone`` with a namespace flag, ``ptrace`` and ``process_vm_readv/writev``,
  ``mount`` and the new mount API, and the kernel keyring calls (``add_key``, ``request_key``,
  ``keyctl``) fail with ``EPERM``; ``clone3`` gets ``ENOSYS`` (its flags are out of a filter's
  reach; libc falls back to ``clone``). Without pyseccomp/libseccomp, :func:`run_python` refuses
  with the fix unless ``SandboxLimits(seccomp=False)``;
- in the code's process: ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space: a 10 GB
  allocation raises ``MemoryError``), ``RLIMIT_FSIZE`` (largest file the code may write; stdout
  goes to a file, so a 100 MB print is cut at the limit by ``SIGXFSZ``), ``RLIMIT_NPROC``
  (processes of the sandbox user: a fork bomb gets ``EAGAIN``), ``RLIMIT_CORE`` = 0;
- a throw-away working directory (``tempfile.mkdtemp``), removed afterwards; ``HOME`` points
  there and the environment is emptied; ``python -I`` (isolated mode: no user site, no
  ``PYTHON*`` variables);
- when the parent runs as root: a fresh, empty network namespace (``unshare(CLONE_NEWNET)``
  via libc: no interface is up, not even loopback, so every connect fails), and the child
  drops to the unprivileged user ``nobody`` (so ``RLIMIT_NPROC`` is enforced, and files
  outside world-writable places such as ``/tmp`` cannot be written).

What it does NOT protect against (no container or filesystem namespace here):
reading world-readable files; writing world-writable directories (``/tmp``) when run as root
(dropped to ``nobody``); and, when the parent is not root, writing anything the user can
write and opening network connections (``network_isolated`` then reports False; run the
trainer as root in a container, or inside a stronger sandbox such as a gVisor/Firecracker
VM, when untrusted code must be contained). ``RLIMIT_NPROC`` counts every process of the
user, so for a non-root parent it limits the sandbox only in proportion. The supervisor is
killed with the trainer (``PR_SET_PDEATHSIG``); descendants alive at that instant are then
re-parented to PID 1 (a trainer killed by SIGKILL mid-call is the one case not swept).
"""

from __future__ import annotations

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
        seccomp: load the system-call filter (namespaces, ptrace, mounts and kernel keyrings denied;
            needs pyseccomp + libseccomp, else :func:`run_python` refuses with the fix).
    """

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    output_bytes: int = 16_384
    nproc: int = 16
    isolate_network: bool = True
    python: Optional[str] = None
    seccomp: bool = True


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

    @property
    def cpu_limited(self) -> bool:
        """True when the CPU-time limit ended the code (SIGXCPU at ``cpu_s``, SIGKILL at the hard limit)."""
        return self.returncode in (-signal.SIGXCPU, -signal.SIGKILL)

    def message(self, limit_chars: int = 2000) -> str:
        """The text a tool returns to the model: stdout, or a one-line error naming the limit hit."""
        if self.timed_out:
            return f"Error: execution timed out (killed).\n{self.stdout[:limit_chars]}".rstrip()
        if self.cpu_limited:
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


_SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_supervisor.py")


def seccomp_available() -> Optional[str]:
    """None when the seccomp filter can be built here, else why not (with the fix)."""
    try:
        import pyseccomp  # noqa: F401

        pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    except (ImportError, OSError, RuntimeError) as e:
        return (f"the sandbox's seccomp filter needs pyseccomp and libseccomp ({type(e).__name__}: {e}). Fix: "
                "pip install pyseccomp (scripts/setup.sh does) and apt-get install libseccomp2, or set "
                "SandboxLimits(seccomp=False) to run without a system-call filter")
    return None


def run_python(code: str, limits: Optional[SandboxLimits] = None) -> SandboxResult:
    """Run ``code`` with ``python -I`` in a fresh directory under :class:`SandboxLimits`.

    The code runs under a supervisor process (``rlpost/envs/sandbox_supervisor.py``): a child
    subreaper that, when the code exits or its wall clock runs out, kills and reaps every
    descendant, whatever session or group it moved to (module docstring).

    Never raises for anything the code does (loops, huge allocations, forks, detached children,
    sockets, writes, floods of output): those end as a non-ok :class:`SandboxResult`.

    Raises:
        OSError: the sandbox itself could not be set up (no temp directory, no python, no
            libseccomp while ``limits.seccomp`` is on: the message names the fix).
    """
    import json

    lim = limits or SandboxLimits()
    if lim.seccomp:
        why = seccomp_available()
        if why is not None:
            raise OSError(why)
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
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
        exe = lim.python or ("/usr/bin/python3" if drop and os.path.exists("/usr/bin/python3") else sys.executable)
        with open(_SUPERVISOR) as fh:
            supervisor = fh.read()
        r_fd, w_fd = os.pipe()
        cfg = {"status_fd": w_fd, "isolate": isolate, "cpu_s": int(lim.cpu_s), "memory_mb": int(lim.memory_mb),
               "fsize": fsize, "nproc": int(lim.nproc), "drop": list(drop) if drop else None, "seccomp": bool(lim.seccomp),
               "exe": exe, "env": env, "wall_s": float(lim.wall_s)}
        t0 = time.perf_counter()
        status: dict = {}
        try:
            with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
                if drop:
                    os.chown(out_path, *drop)
                    os.chown(err_path, *drop)
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-c", supervisor, json.dumps(cfg)], cwd=work, env={"PATH": env["PATH"]},
                    stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, pass_fds=(w_fd,), close_fds=True,
                    start_new_session=True,
                )
                os.close(w_fd)
                w_fd = -1
                try:
                    proc.wait(timeout=float(lim.wall_s) + 30.0)  # the supervisor keeps the wall clock
                except subprocess.TimeoutExpired:  # pragma: no cover - a hung supervisor
                    _kill_group(proc.pid)
                    proc.wait()
            with os.fdopen(r_fd, "rb") as fr:
                r_fd = -1
                raw = fr.read()
            status = json.loads(raw.decode() or "{}")
        finally:
            for fd in (r_fd, w_fd):
                if fd >= 0:
                    os.close(fd)
        if status.get("error") or "returncode" not in status:
            raise OSError(f"sandbox supervisor failed: {status.get('error') or 'no status'} "
                          f"(exit {proc.returncode}; {_read_capped(err_path, 500)[0].strip()})")
        secs = time.perf_counter() - t0
        rc, timed_out = status["returncode"], bool(status["timed_out"])
        if rc == 99 and isolate:
            isolate = False  # could not enter a network namespace: report it honestly
        stdout, n_out = _read_capped(out_path, lim.output_bytes)
        stderr, n_err = _read_capped(err_path, lim.output_bytes)
        truncated = n_out >= fsize or n_err >= fsize or rc == -signal.SIGXFSZ
        return SandboxResult(stdout, stderr, rc, timed_out, truncated, isolate, secs)
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
