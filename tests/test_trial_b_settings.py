"""Trial B: settings refused with the variable or key named, never a traceback (real CLI subprocesses)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def flywheel(tmp_path, *args, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    e.update(FLYWHEEL_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "flywheel.cli", *args], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value,why", [("{bad", "not a JSON object"), ("[1]", "got list")])
def test_malformed_retention_json_is_named_not_a_traceback(tmp_path, value, why):
    r = flywheel(tmp_path, "topics", "check", FLYWHEEL_KAFKA_RETENTION_MS=value,
                 FLYWHEEL_KAFKA_BOOTSTRAP="127.0.0.1:1")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "SettingsError" not in r.stderr, r.stderr[-2000:]
    assert "FLYWHEEL_KAFKA_RETENTION_MS" in r.stderr and why in r.stderr, r.stderr
