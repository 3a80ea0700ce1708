"""A malformed ``--serving`` spec (or ``$FLYWHEEL_SERVING_URL``) to the operator commands
(``http://[::1``, ``dns+http://name`` without a port, a bare ``host:port``, a port out of
range): a usage error naming the spec and the form it must have, exit 2, before any pod is
asked. Real CLI subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BAD = ["http://[::1", "dns+http://localhost", "dns+http://localhost:abc", "127.0.0.1:8000", "http://",
       "http://127.0.0.1:99999"]


def _cli(args, home, env_extra=None):
    env = {**os.environ, "FLYWHEEL_HOME": str(home), "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env_extra or {})}
    for k in ("FLYWHEEL_STORE", "FLYWHEEL_KAFKA_BOOTSTRAP"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "flywheel.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize("spec", BAD)
def test_status_bad_serving_spec_is_a_usage_error(tmp_path, spec):
    r = _cli(["status", "--serving", spec, "--serving-timeout-s", "1"], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out, out
    assert f"serving: {spec!r}" in out, out


def test_status_bad_serving_url_from_the_environment(tmp_path):
    r = _cli(["status", "--serving-timeout-s", "1"], tmp_path, {"FLYWHEEL_SERVING_URL": "http://[::1"})
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out, out


@pytest.mark.parametrize("spec", ["http://127.0.0.1:9", "HTTP://127.0.0.1:9", "http://[::1]:9"])
def test_status_good_spec_of_a_down_pod_is_exit_1(tmp_path, spec):
    r = _cli(["status", "--serving", spec, "--serving-timeout-s", "1"], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Traceback" not in out and "unreachable" in out, out
