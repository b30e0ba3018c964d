"""The sandbox's supervisor: a small process between the trainer and model-written code.

Run by :func:`rlpost.envs.sandbox.run_python` as ``python -I -c <this file's text> <json>``: it
imports nothing from rlpost (``-I`` hides the project), only the standard library and
``pyseccomp`` (the ctypes bindings of libseccomp). It

1. makes itself a **child subreaper** (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux >= 3.4): every
   orphaned descendant of the code, whatever session or process group it moved to (double fork,
   ``setsid``, ``start_new_session``, daemonising), is re-parented to the supervisor instead of
   PID 1, so it stays reachable;
2. forks the code's process, which sets its limits, enters an empty network namespace, drops to
   ``nobody``, loads the **seccomp filter** (:func:`seccomp_filter`) and execs the interpreter;
3. waits until that process exits or the wall clock runs out, then **sweeps**: SIGKILLs every
   descendant (found in ``/proc`` by parent links) and reaps, until ``waitpid`` reports no child
   left, i.e. no descendant exists anywhere (they can only be re-parented to it);
4. writes ``{"returncode", "timed_out", "swept", "error"}`` as JSON to the status pipe.

The status travels through a pipe the code never holds (closed before exec), so the code cannot
forge it. Not part of the public API.
"""

import ctypes
import errno
import json
import os
import resource
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNET = 0x40000000
#: clone(2) flags that create a namespace (CLONE_NEWTIME, 0x80, exists only for clone3/unshare)
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
#: system calls the filter refuses with EPERM (clone with a namespace flag is refused too; clone3,
#: whose flags sit in memory a filter cannot read, gets ENOSYS so libc falls back to clone)
DENIED = ("unshare", "setns", "ptrace", "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen",
          "fsconfig", "fsmount", "fspick", "mount_setattr", "add_key", "request_key", "keyctl",
          "process_vm_readv", "process_vm_writev")


def seccomp_filter():
    """The sandbox's seccomp filter (not loaded): allow by default; EPERM for :data:`DENIED` and for
    ``clone`` with any namespace flag; ENOSYS for ``clone3``. Other architectures' system calls kill
    the process (libseccomp's default bad-arch action). Raises ImportError/OSError without libseccomp."""
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except OSError as e:  # a syscall this kernel's libseccomp does not know (old headers): nothing to deny
            if e.errno not in (errno.EINVAL, errno.EFAULT, errno.EDOM):
                raise
    for flag in NAMESPACE_FLAGS:
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    return f


def _children_map():
    kids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids


def _descendants(root):
    kids, out, todo = _children_map(), [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def sweep(deadline_s=5.0):
    """SIGKILL and reap every descendant until none is left; returns how many processes were killed."""
    me, killed, end = os.getpid(), set(), time.monotonic() + deadline_s
    while True:
        for pid in _descendants(me):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        try:
            while True:
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
        except ChildProcessError:
            return len(killed)  # no child, hence (subreaper) no descendant at all
        if time.monotonic() > end:
            return len(killed)
        time.sleep(0.002)


def main(cfg):
    """Supervise one run of the code (steps 1-4 of the module docstring); return the exit code.

    ``cfg`` is the JSON dict :func:`rlpost.envs.sandbox.run_python` passes: ``status_fd``, the
    limits (``cpu_s`` seconds, ``memory_mb``, ``fsize`` bytes, ``nproc``, ``wall_s`` seconds),
    ``seccomp``, ``isolate`` (empty network namespace), ``drop`` (uid, gid or empty), ``exe`` and
    ``env``. Returns 2 when the subreaper cannot be set (the error goes to the status pipe), else 0.
    """
    status_fd = int(cfg["status_fd"])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        os.write(status_fd, json.dumps({"error": "prctl(PR_SET_CHILD_SUBREAPER) failed: errno "
                                        f"{ctypes.get_errno()}"}).encode())
        return 2
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the trainer died: so does the supervisor
    filt = seccomp_filter() if cfg["seccomp"] else None
    pid = os.fork()
    if pid == 0:  # the code's process
        try:
            os.close(status_fd)
            if cfg["isolate"] and libc.unshare(CLONE_NEWNET) != 0:
                os._exit(99)
            cpu, mem, fsize, nproc = int(cfg["cpu_s"]), int(cfg["memory_mb"]) * 1024 * 1024, int(cfg["fsize"]), int(cfg["nproc"])
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            if cfg["drop"]:
                os.setgroups([])
                os.setgid(int(cfg["drop"][1]))
                os.setuid(int(cfg["drop"][0]))
            if filt is not None:
                filt.load()  # sets no_new_privs; kept across exec
            os.execve(cfg["exe"], [cfg["exe"], "-I", "main.py"], cfg["env"])
        except BaseException:  # noqa: BLE001 - never return into the supervisor's code
            os._exit(98)
    end, timed_out, rc = time.monotonic() + float(cfg["wall_s"]), False, None
    while rc is None:
        try:  # the code's exit, and re-parented orphans as they exit (no zombie piles up)
            got, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if got and (os.WIFSTOPPED(st) or os.WIFCONTINUED(st)):  # a traced child's stop is not an exit
            continue
        if got == pid:
            rc = os.waitstatus_to_exitcode(st)
            break
        if got:
            continue
        if time.monotonic() > end:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            while True:
                _, st = os.waitpid(pid, 0)
                if os.WIFEXITED(st) or os.WIFSIGNALED(st):
                    break
            rc = os.waitstatus_to_exitcode(st)
            break
        time.sleep(0.005)
    swept = sweep()
    os.write(status_fd, json.dumps({"returncode": rc, "timed_out": timed_out, "swept": swept}).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
