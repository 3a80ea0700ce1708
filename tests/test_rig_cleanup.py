"""The processes tests start die with the test process, even when it is SIGKILLed.

A pytest run killed from outside (a CI step's or a helper's ``timeout``) gets no chance to
run fixture teardown; its brokers and ingest workers were left running (parent 1), and a
later suite on the same box ran beside them. Tests start them with
``flywheel.supervise.die_with_parent`` (``PR_SET_PDEATHSIG``), so the kernel ends them.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path[:0] = [{tests!r}, {root!r}]
    from flywheel.broker import spawn
    from test_ingest_e2e import start_worker
    b = spawn(die_with_parent=True)  # a broker of its own, to see it die
    env = dict(os.environ, FLYWHEEL_HOME={home!r}, FLYWHEEL_KAFKA_BOOTSTRAP={bootstrap!r})
    w = start_worker(env, {log!r})
    print(b.pid, w.pid, flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its entry waits for a reaper


def test_broker_and_worker_die_when_the_test_process_is_sigkilled(broker, tmp_path):
    """The worker folds from ``broker``, which outlives the killed process (so the worker has
    no reason of its own to stop); the killed process's own broker must die too."""
    script = _SCRIPT.format(tests=str(ROOT / "tests"), root=str(ROOT), home=str(tmp_path / "home"),
                            log=str(tmp_path / "worker.log"), bootstrap=broker.bootstrap)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    children: list[int] = []
    try:
        line = parent.stdout.readline()
        assert line, f"the stand-in test process printed nothing: {parent.stderr.read()[-2000:]}"
        children = [int(x) for x in line.split()]
        assert all(_alive(p) for p in children)
        parent.send_signal(signal.SIGKILL)  # no teardown runs, as under `timeout -s KILL`
        parent.wait(10)
        deadline = time.monotonic() + 30  # a bound on a kernel signal's delivery, not a measured time
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in children if _alive(p)]
        assert not left, f"still running after their parent was SIGKILLed: {left}"
    finally:
        if parent.poll() is None:
            parent.kill()
        for p in children:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
