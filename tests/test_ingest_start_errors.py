"""``flywheel ingest`` that cannot start says why in one line, exit 1: an unreachable Kafka
bootstrap, and a --worker-port already in use. Real subprocesses; a real broker for the port
case."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *args, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    e.update(PYTHONPATH=str(ROOT), FLYWHEEL_HOME=str(tmp_path / "home"), COLUMNS="200", **env)
    return subprocess.run([sys.executable, "-m", "flywheel.cli", "ingest", *args], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=90)


def test_unreachable_bootstrap_is_one_line(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _run(tmp_path, FLYWHEEL_KAFKA_BOOTSTRAP=f"127.0.0.1:{port}")
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "╭" not in r.stderr, r.stderr[-3000:]
    assert f"error: Kafka at 127.0.0.1:{port}" in r.stderr


@pytest.mark.timeout(120)
def test_worker_port_in_use_is_one_line(broker, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run(tmp_path, "--worker-port", str(port), FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "╭" not in r.stderr, r.stderr[-3000:]
    assert f"--worker-port {port}" in r.stderr and "in use" in r.stderr
