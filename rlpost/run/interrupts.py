"""Graceful Ctrl-C / SIGTERM for a training run.

The first SIGINT or SIGTERM only records the request: the runner finishes the
step in progress, writes a checkpoint, says what it saved and exits with status
130. A second one exits at once (status 130, no checkpoint; the last one on disk
is intact), after killing this process's child processes (the verifier worker),
so nothing is left running. The verifier worker ignores SIGINT and SIGTERM
itself (``rlpost.rewards.scoring``), so a terminal's Ctrl-C or a scheduler's
SIGTERM to the whole process group neither prints a child traceback nor takes
away the verifier the step in progress still needs.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Dict, Optional


class StopRequest:
    """Turns the first SIGINT/SIGTERM into a flag and the second into an immediate exit.

    Use as a context manager around the training loop; handlers are installed
    only in the main thread (elsewhere ``signal`` refuses) and the previous ones
    are restored on exit.

    Attributes:
        signum: the first signal received, or None.
        step: a callable returning the step in progress (for the message).
    """

    def __init__(self, step=lambda: 0) -> None:
        self.signum: Optional[int] = None
        self.step = step
        self._old: Dict[int, Any] = {}
        self._pid = os.getpid()

    @property
    def requested(self) -> bool:
        """Whether a stop was requested."""
        return self.signum is not None

    @property
    def name(self) -> str:
        """``SIGINT`` / ``SIGTERM`` of the first signal."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame: Any) -> None:
        # os.write, not logging or print: a signal handler may interrupt a thread that holds their locks
        if os.getpid() != self._pid:  # a forked child that inherited the handler: act as the default would
            os._exit(128 + signum)
        if self.signum is not None:
            os.write(2, b"\nsecond interrupt: exiting now without a new checkpoint (the last one on disk is intact)\n")
            _kill_children()
            os._exit(130)
        self.signum = signum
        os.write(2, (f"\n{signal.Signals(signum).name}: finishing step {self.step() + 1}, then saving a checkpoint "
                     f"(interrupt again to exit at once)\n").encode())

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}


def _kill_children() -> None:
    """SIGKILL every live multiprocessing child of this process (best effort)."""
    try:
        import multiprocessing as mp

        for p in mp.active_children():
            try:
                os.kill(p.pid, signal.SIGKILL)
            except OSError:
                pass
    except Exception:
        pass
