"""FLYWHEEL_HOME naming a file: every command says so in one line, exit 1, never a traceback
(real CLI subprocesses; ``ingest`` is covered in tests/test_settings_errors.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["data", "stats"], ["versions"]])
def test_home_that_is_a_file(tmp_path, args):
    f = tmp_path / "afile"
    f.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(FLYWHEEL_HOME=str(f), PYTHONPATH=str(ROOT), COLUMNS="200")
    r = subprocess.run([sys.executable, "-m", "flywheel.cli", *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip() == f"error: FLYWHEEL_HOME={f}: cannot be used as Flywheel's home: not a directory", r.stderr
