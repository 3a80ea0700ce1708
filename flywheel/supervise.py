"""Supervision of the processes a command starts (``flywheel demo``'s broker, pod, ingest
worker, controller and learner): nothing they start outlives them.

Two mechanisms, for two ways to end:

* **A stop signal** (SIGINT: Ctrl-C; SIGTERM: a timeout, an operator's kill; SIGHUP: the
  terminal or SSH connection closed) reaches the supervisor, which stops every child itself:
  :class:`StopSignals` runs the given cleanup on the first one and raises ``SystemExit(128 +
  signum)``; later ones are ignored until it is done, so a second signal never cuts the cleanup
  short. A signal inherited as ignored (``nohup`` ignores SIGHUP; a shell's background job
  SIGINT) stays ignored: the user asked for that.
* **SIGKILL of the supervisor** runs no code of ours; the kernel does the work: each child is
  started with ``PR_SET_PDEATHSIG`` = SIGKILL (Linux ``prctl(2)``, :func:`die_with_parent`), so
  it is killed when the supervisor dies. Linux only; elsewhere children of a SIGKILLed
  supervisor survive, as before.

Knows nothing about what the children are.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child is SIGKILLed when this process dies.

    Returns None (nothing to do) off Linux, and off the main thread: the kernel sends the
    signal when the *thread* that forked the child exits, which for the main thread is the
    process's exit. The child exits at once (status 1) if this process died before the
    ``prctl`` call took effect.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(1)
    return preexec


class StopSignals:
    """While active, SIGINT, SIGTERM and SIGHUP run ``cleanup`` once and raise ``SystemExit(128 + signum)``.

    Use as a context manager around the supervisor's work, and call :meth:`cleanup_once` in
    its ``finally`` too (it runs ``cleanup`` at most once, whichever comes first). Only the main
    thread can set signal handlers: elsewhere it does nothing.

    Args:
        cleanup: stops every child; must be idempotent and must not raise.
    """

    def __init__(self, cleanup: Callable[[], None]):
        self._cleanup = cleanup
        self._previous: dict[int, object] = {}
        self._done = False  # main thread only (handlers run there too): no lock, which a handler could deadlock on
        self.received: int | None = None  # the first stop signal, if any

    def _handler(self, signum, _frame) -> None:
        if self.received is not None or self._done:
            return  # already stopping: let the cleanup finish
        self.received = signum
        self.cleanup_once()
        raise SystemExit(128 + signum)

    def cleanup_once(self) -> None:
        """Run ``cleanup`` unless it ran already; later stop signals are ignored from here on."""
        if self._done:
            return
        self._done = True
        self._cleanup()

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                if signal.getsignal(s) is not signal.SIG_IGN:
                    self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup_once()
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()


def run_measuring_peak(args: list[str], **popen_kwargs) -> tuple[int, int]:
    """Run ``args`` to completion and return ``(returncode, peak_rss_bytes)``.

    The peak is the child's own maximum resident set size as the kernel reports it at reaping
    (``wait4(2)``'s ``ru_maxrss``, KiB on Linux, converted to bytes): the largest of the child
    and any descendants it waited for, not their sum; the kernel's count starts at the parent's
    RSS when it forked, so a child smaller than its parent reports the parent's size. Measured
    by the kernel, so a short spike between two polls is not missed. ``popen_kwargs`` go to ``subprocess.Popen`` (``env``,
    ``stdout``, ``preexec_fn``, ...).

    Raises:
        OSError: the child could not be started.
    """
    import subprocess

    p = subprocess.Popen(args, **popen_kwargs)
    try:
        _, status, usage = os.wait4(p.pid, 0)
    except BaseException:
        p.kill()
        p.wait()
        raise
    p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return p.returncode, int(usage.ru_maxrss) * scale
