"""A throwaway PostgreSQL server for tests and benchmarks (Debian's ``postgresql`` package).

``start()`` runs ``initdb`` in a new temporary directory and ``postgres`` on a free port of 127.0.0.1 as the
caller's own child process (trust authentication, user ``flywheel``, no fsync: the data is
thrown away). PostgreSQL refuses to run as root, so under root both run as the ``postgres``
system user (``setpriv``, which execs: the server is the child itself), which owns the
directory (made under the system's temp dir, which that user can reach; a pytest ``tmp_path``
is private to root). Production points ``flywheel ingest --state``
at its own database instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

USER = "flywheel"


def bindir() -> Path:
    """Directory of ``initdb`` and ``postgres`` (the newest ``/usr/lib/postgresql/<v>/bin``).

    Raises:
        RuntimeError: PostgreSQL is not installed (``apt-get install -y postgresql``).
    """
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True):
        if (d / "postgres").exists() and (d / "initdb").exists():
            return d
    exe = shutil.which("initdb")
    if exe:
        return Path(os.path.realpath(exe)).parent
    raise RuntimeError("PostgreSQL is not installed: apt-get install -y postgresql")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PgServer:
    """A running throwaway PostgreSQL server."""

    proc: subprocess.Popen
    port: int
    dir: Path

    @property
    def url(self) -> str:
        """``postgresql://flywheel@127.0.0.1:<port>/postgres``."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Fast shutdown (SIGINT), SIGKILL after ``timeout_s``, then delete its directory;
        idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


def start(timeout_s: float = 30.0) -> PgServer:
    """``initdb`` into a new temporary directory and start ``postgres`` on a free port;
    returns once it accepts connections. :meth:`PgServer.stop` deletes the directory.

    Raises:
        RuntimeError: not installed, ``initdb`` failed, or no connection within ``timeout_s``
            (the message holds the server log's tail).
    """
    b = bindir()
    dir = Path(tempfile.mkdtemp(prefix="flywheel-pg-"))
    prefix: list[str] = []
    if os.geteuid() == 0:  # postgres refuses root: run as the package's system user
        shutil.chown(dir, "postgres")
        prefix = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--"]
    log = dir / "postgres.log"
    r = subprocess.run(prefix + [str(b / "initdb"), "-D", str(dir / "data"), "-A", "trust", "-U", USER,
                                 "-E", "UTF8", "--no-sync"], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"initdb failed ({r.returncode}): {r.stderr[-2000:]}")
    port = _free_port()
    proc = subprocess.Popen(prefix + [str(b / "postgres"), "-D", str(dir / "data"), "-p", str(port), "-k", str(dir),
                                      "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
                                      "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                                      "-c", "max_connections=50"],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    srv = PgServer(proc=proc, port=port, dir=dir)
    deadline = time.monotonic() + timeout_s
    import psycopg

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            psycopg.connect(srv.url, connect_timeout=2).close()
            return srv
        except psycopg.OperationalError:
            time.sleep(0.1)
    srv.stop()
    raise RuntimeError(f"postgres did not accept connections within {timeout_s} s: {log.read_text()[-2000:]}")
