"""Supervision of the processes a command starts (``flywheel demo``'s broker, pod, ingest
worker, controller and learner): nothing they start outlives them.

Two mechanisms, for two ways to end:

* **A stop signal** (SIGINT: Ctrl-C; SIGTERM: a timeout, an operator's kill; SIGHUP: the
  terminal or SSH connection closed) reaches the supervisor, which stops every child itself:
  :class:`StopSignals` runs the given cleanup on the first one and raises ``SystemExit(128 +
  signum)``; later ones are ignored until it is done, so a second signal never cuts the cleanup
  short. A signal inherited as ignored (``nohup`` ignores SIGHUP; a shell's background job
  SIGINT) stays ignored: the user asked for that. The supervisor starts each child inside
  :meth:`StopSignals.deferred`, so a stop signal meanwhile acts once the child is tracked, and
  calls :meth:`StopSignals.check` where a stop whose ``SystemExit`` was lost must still end it.
* **SIGKILL of the supervisor** runs no code of ours; the kernel does the work: each child is
  started with ``PR_SET_PDEATHSIG`` = SIGKILL (Linux ``prctl(2)``, :func:`die_with_parent`), so
  it is killed when the supervisor dies. Linux only; elsewhere children of a SIGKILLed
  supervisor survive, as before.

Knows nothing about what the children are.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from typing import Callable, Iterator

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
    """While active, SIGINT, SIGTERM and SIGHUP run ``cleanup`` and raise ``SystemExit(128 + signum)``.

    Use as a context manager around the supervisor's work, and call :meth:`cleanup_once` in
    its ``finally`` too (it runs ``cleanup`` unless it ran already). Only the main thread can
    set signal handlers: elsewhere it does nothing.

    Python runs the handler in the main thread at its next bytecode, wherever that is, and some
    places drop what it raises: CPython calls the ``os.register_at_fork`` hooks (``logging``'s
    ``_acquireLock``/``_releaseLock``, run inside every ``subprocess.Popen`` with a
    ``preexec_fn``), ``__del__`` methods and weakref callbacks with any exception reported as
    "Exception ignored" and dropped. A handler that fires there stops the children, but the
    program goes on (and ``logging``'s lock stays taken when it fired inside ``_releaseLock``).
    Hence two tools for the supervisor's code:

    * :meth:`deferred`: a block in which a stop signal is only recorded, and acted on (cleanup,
      then ``SystemExit``) when the outermost block ends. Start each child inside one, and track
      it there: a signal during the fork then finds the child tracked. (Blocking the signals
      with ``signal.pthread_sigmask`` does not do this: the kernel gives a process's signal to
      any thread that does not block it, and Python then runs the handler in the main thread
      all the same.)
    * :meth:`check`: raises the stop if a signal was received; call it before starting a child
      and in every waiting loop, so a stop whose ``SystemExit`` was dropped still ends the run.

    Args:
        cleanup: stops every child; must be idempotent and must not raise. It runs again when a
            recorded stop is acted on after it ran (children may have been started since).
    """

    def __init__(self, cleanup: Callable[[], None]):
        self._cleanup = cleanup
        self._previous: dict[int, object] = {}
        # main thread only (handlers run there too): no lock, which a handler could deadlock on
        self._done = False
        self._deferring = 0  # depth of deferred() blocks
        self.received: int | None = None  # the first stop signal, if any

    def _handler(self, signum, _frame) -> None:
        if self.received is not None or self._done:
            return  # already stopping: let the cleanup finish
        self.received = signum
        if not self._deferring:  # else acted on when the outermost deferred() block ends
            self._stop()

    def _stop(self) -> None:
        """Run ``cleanup`` (again if it ran) and raise ``SystemExit(128 + received)``."""
        self._done = True
        self._cleanup()
        raise SystemExit(128 + self.received)

    def check(self) -> None:
        """Raise ``SystemExit(128 + signum)`` (after running ``cleanup``) if a stop signal was
        received; nothing otherwise.

        Raises:
            SystemExit: a stop signal was received, here or in a handler whose exception was
                dropped (see the class).
        """
        if self.received is not None:
            self._stop()

    @contextlib.contextmanager
    def deferred(self) -> Iterator["StopSignals"]:
        """A block in which a stop signal is recorded but not acted on; when the outermost such
        block ends, a recorded one runs ``cleanup`` and raises ``SystemExit(128 + signum)``
        (replacing any exception the block raised). Main thread only.

        Raises:
            SystemExit: a stop signal was received before the block ended.
        """
        self._deferring += 1
        try:
            yield self
        finally:
            self._deferring -= 1
            if not self._deferring:
                self.check()

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


def run_measuring_peak(args: list[str], stop: StopSignals | None = None, **popen_kwargs) -> tuple[int, int]:
    """Run ``args`` to completion and return ``(returncode, peak_rss_bytes)``.

    The peak is the child's own maximum resident set size as the kernel reports it at reaping
    (``wait4(2)``'s ``ru_maxrss``, KiB on Linux, converted to bytes): the largest of the child
    and any descendants it waited for, not their sum; the kernel's count starts at the parent's
    RSS when it forked, so a child smaller than its parent reports the parent's size. Measured
    by the kernel, so a short spike between two polls is not missed. ``popen_kwargs`` go to ``subprocess.Popen`` (``env``,
    ``stdout``, ``preexec_fn``, ...). Any exception while it runs (a stop signal's
    ``SystemExit`` included) SIGKILLs the child and waits for it before it propagates.

    Args:
        stop: the caller's :class:`StopSignals`, or None: the child is started inside its
            :meth:`StopSignals.deferred` block, so a stop signal during the start is acted on
            once the child is known here (and killed).

    Raises:
        OSError: the child could not be started.
        SystemExit: ``stop`` received a stop signal before or while the child ran.
    """
    import subprocess

    p = None
    try:
        with stop.deferred() if stop is not None else contextlib.nullcontext():
            p = subprocess.Popen(args, **popen_kwargs)
        _, status, usage = os.wait4(p.pid, 0)
    except BaseException:
        if p is not None:
            p.kill()
            p.wait()
        raise
    p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return p.returncode, int(usage.ru_maxrss) * scale
