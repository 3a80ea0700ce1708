"""A model store path that names a file (a typo in FLYWHEEL_STORE or --store): every command
says so in one line naming the path, exit 1 (``serve --store``: a usage error naming the
flag, exit 2), instead of a NotADirectoryError traceback. Real CLI subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cli(args, home, env_extra):
    env = {**os.environ, "FLYWHEEL_HOME": str(home), "PYTHONPATH": str(ROOT), "COLUMNS": "200", **env_extra}
    env.pop("FLYWHEEL_KAFKA_BOOTSTRAP", None)
    return subprocess.run([sys.executable, "-m", "flywheel.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize("args", [["versions"], ["rollback", "--yes"], ["pause", "--yes"],
                                  ["canary", "abort", "--yes"]])
def test_store_that_is_a_file_is_one_line_exit_1(tmp_path, args):
    f = tmp_path / "store.txt"
    f.write_text("not a store\n")
    r = _cli(args, tmp_path / "home", {"FLYWHEEL_STORE": str(f)})
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Traceback" not in out and "NotADirectoryError" not in out, out
    assert f"model store {f}" in out and "Not a directory" in out, out


def test_serve_store_flag_that_is_a_file_is_a_usage_error(tmp_path):
    f = tmp_path / "store.txt"
    f.write_text("not a store\n")
    r = _cli(["serve", "--store", str(f), "--port", "1"], tmp_path / "home", {})
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out, out
    assert "--store" in out and "Not a directory" in out, out
