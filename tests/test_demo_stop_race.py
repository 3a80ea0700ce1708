"""A stop signal at the demo's most dangerous points (D106): each test sends SIGTERM to this
process at one exact point, in-process, with real children (``sleep``), and checks that the
call ends with ``SystemExit(143)`` and leaves no child running.

The points:

* inside the fork of a child (``os.register_at_fork``'s hooks, which ``subprocess.Popen`` runs
  when it has a ``preexec_fn``, as every demo child has): CPython drops an exception raised
  there, so before D106 the handler stopped the children started so far, its ``SystemExit`` was
  lost, and the demo went on with the new child untracked (the controller that outlived a
  ``SIGTERM`` in ``test_demo_cli.py::test_sigterm_stops_every_child``);
* after a stop whose ``SystemExit`` was lost elsewhere (a ``__del__``): no child is started;
* while the main thread holds a child's wait lock (inside ``Popen.poll``): stopping it is
  bounded, never a wait on that lock.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console

import flywheel.demo as demo_mod
from flywheel.demo import Demo
from flywheel.demo_config import DemoConfig
from flywheel.supervise import StopSignals, die_with_parent, run_measuring_peak

# at most one hook per process (os.register_at_fork cannot unregister): it acts while armed
_armed: dict = {}


def _after_fork_in_parent() -> None:
    """The parent's side of a fork, after CPython's own hooks (``logging``'s ``_releaseLock``):
    send SIGTERM to this process once, when armed, on a fork by the main thread (the demo's).
    ``os.kill`` of the own process runs the Python handler before it returns, so the handler
    runs here, inside the hook."""
    if threading.current_thread() is threading.main_thread() and _armed.pop("kill", False):
        _armed["children"] = {c.pid for c in psutil.Process().children()}  # the new child among them
        os.kill(os.getpid(), signal.SIGTERM)


os.register_at_fork(after_in_parent=_after_fork_in_parent)


@pytest.fixture
def sigterm_default():
    """SIGTERM as a fresh process has it (StopSignals keeps an inherited ignore, which would
    make these tests vacuous); restored after."""
    prev = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        _armed.clear()
        signal.signal(signal.SIGTERM, prev)


@pytest.fixture
def no_child_left():
    """Yields a function giving this process's children started since the test began; kills
    and reaps any such child still there at the end (the test has failed then)."""
    before = {c.pid for c in psutil.Process().children()}

    def new() -> list[psutil.Process]:
        return [c for c in psutil.Process().children() if c.pid not in before and _running(c)]

    yield new
    for c in new():
        try:
            c.kill()
            c.wait(10)
        except psutil.Error:
            pass


def _running(c: psutil.Process) -> bool:
    try:
        return c.is_running() and c.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ignores_sigterm_in_sleep(pid: int) -> bool:
    """Whether process ``pid`` runs ``sleep`` with SIGTERM ignored (Linux ``/proc``)."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return fields["Name"].strip() == "sleep" and bool(int(fields["SigIgn"], 16) & (1 << (signal.SIGTERM - 1)))


def _demo(tmp_path, monkeypatch) -> Demo:
    """A Demo whose children are ``sleep 300`` (``_cli`` names every flywheel child), with the
    state :meth:`Demo.setup` would leave for ``start_controller``, and no broker."""
    monkeypatch.setattr(demo_mod, "_cli", lambda *args: ["sleep", "300"])
    d = Demo(DemoConfig(out=tmp_path / "out"), console=Console(file=io.StringIO(), width=200))
    d.logs = tmp_path
    d.home = tmp_path / "home"
    d.url = "http://127.0.0.1:9"
    d.bootstrap = "127.0.0.1:9"
    d.broker = None
    return d


def test_sigterm_inside_the_controllers_fork_stops_it_and_exits(tmp_path, monkeypatch, sigterm_default, no_child_left):
    d = _demo(tmp_path, monkeypatch)
    serving = d._start("serving", ["sleep", "300"], d._env())  # a child started before the signal
    with pytest.raises(SystemExit) as exc:
        with d.stop_signals:
            _armed["kill"] = True
            d.start_controller([{"latency_s": 2.0}])  # its Popen forks: SIGTERM arrives inside
    assert "kill" not in _armed  # the hook fired (inside the controller's fork)
    assert exc.value.code == 128 + signal.SIGTERM == 143
    assert d.stop_signals.received == signal.SIGTERM
    # the controller is tracked and stopped, as is the child started before
    assert [p.name for p in d.procs] == ["serving", "controller"]
    assert d.controller is None  # start_controller did not return
    ctl = d.procs[1]
    assert ctl.p.pid in _armed["children"]  # it was forked before the signal
    assert serving.p.returncode == ctl.p.returncode == -signal.SIGTERM  # each ended by the cleanup's SIGTERM
    assert no_child_left() == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped SystemExit
def test_a_lost_stop_starts_no_child(tmp_path, monkeypatch, sigterm_default, no_child_left):
    d = _demo(tmp_path, monkeypatch)
    stopped = []
    d.stop_children = lambda: stopped.append(len(d.procs))  # counts the cleanup's runs
    d.stop_signals = StopSignals(d.stop_children)

    class SignalledInDel:
        def __del__(self):  # CPython drops what a __del__ raises: the handler's SystemExit too
            os.kill(os.getpid(), signal.SIGTERM)

    with d.stop_signals:
        SignalledInDel()  # freed at once: the handler runs in __del__, its SystemExit is lost
        assert d.stop_signals.received == signal.SIGTERM and stopped == [0]
        for start in (lambda: d.start_controller([]), lambda: d._start("ingest", ["sleep", "300"], d._env()),
                      lambda: d.learn(1)):
            with pytest.raises(SystemExit) as exc:
                start()
            assert exc.value.code == 143
    assert d.procs == [] and no_child_left() == []
    assert stopped == [0, 0, 0, 0]  # the handler's run, then once per refusal (idempotent)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_while_a_childs_wait_lock_is_held_stops_it_in_bounded_time(tmp_path, monkeypatch, sigterm_default,
                                                                           no_child_left):
    d = _demo(tmp_path, monkeypatch)
    p = d._start("ingest", ["sh", "-c", "trap '' TERM; exec sleep 300"], d._env())  # only SIGKILL ends it
    deadline = time.monotonic() + 60
    while not _ignores_sigterm_in_sleep(p.p.pid):  # the trap set and sleep exec'd
        assert time.monotonic() < deadline and p.alive()
        time.sleep(0.01)
    p.stop_timeout_s = 0.5
    lock = p.p._waitpid_lock  # what Popen.poll holds between its waitpid and the release
    assert lock.acquire(blocking=False)
    try:
        with pytest.raises(SystemExit) as exc:
            with d.stop_signals:
                os.kill(os.getpid(), signal.SIGTERM)  # as if it fired inside p.alive()
        assert exc.value.code == 143
        # the cleanup could not reap it (the lock is held): it sent SIGKILL and said so
        said = " ".join(d.console.file.getvalue().split())
        assert f"could not stop ingest: ingest (pid {p.p.pid}) was sent SIGKILL but not seen to exit within 0.5 s" \
            in said, said
    finally:
        lock.release()
    assert p.p.wait(10) == -signal.SIGKILL
    assert no_child_left() == []


def test_sigterm_inside_the_learners_fork_kills_it(sigterm_default, no_child_left):
    cleaned = []
    st = StopSignals(lambda: cleaned.append(1))
    with pytest.raises(SystemExit) as exc:
        with st:
            _armed["kill"] = True
            run_measuring_peak(["sleep", "300"], stop=st, preexec_fn=die_with_parent())
    assert "kill" not in _armed and exc.value.code == 143 and cleaned == [1]
    started = _armed["children"] - {c.pid for c in psutil.Process().children()}
    assert len(started) == 1  # it was started, and is reaped now
    assert no_child_left() == []


def test_deferred_acts_on_the_signal_at_the_end_of_the_outermost_block(sigterm_default):
    events = []
    st = StopSignals(lambda: events.append("cleanup"))
    with pytest.raises(SystemExit) as exc:
        with st:
            with st.deferred():
                with st.deferred():
                    os.kill(os.getpid(), signal.SIGTERM)
                    events.append("inner body goes on")
                events.append("outer body goes on")
                raise OSError("the block's own error")  # replaced by the stop
    assert exc.value.code == 143
    assert events == ["inner body goes on", "outer body goes on", "cleanup"]
    assert isinstance(exc.value.__context__, OSError)


def test_deferred_without_a_signal_changes_nothing():
    st = StopSignals(lambda: None)
    with st:
        with st.deferred():
            pass
        with pytest.raises(OSError):
            with st.deferred():
                raise OSError("passes through")
        st.check()  # no signal: returns
    assert st.received is None


def test_blocking_sigterm_in_the_main_thread_does_not_defer_its_handler():
    """Why deferred() is Python-level: with SIGTERM blocked in the main thread
    (``pthread_sigmask``), the kernel gives it to another thread, and Python runs the handler in
    the main thread all the same."""
    ran = []
    prev = signal.signal(signal.SIGTERM, lambda s, f: ran.append(threading.current_thread() is threading.main_thread()))
    other = threading.Event()
    t = threading.Thread(target=other.wait, daemon=True)  # unblocked: started before the mask
    t.start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(2000):  # Python code in the main thread, SIGTERM blocked there
            if ran:
                break
            other.wait(0.01)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        signal.signal(signal.SIGTERM, prev)
        other.set()
        t.join(10)
    assert ran == [True]
