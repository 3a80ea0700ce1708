"""``flywheel serve`` flags checked before anything loads: ``--pod ''``, a pod name with '/' or
too long for its journal file name, ``--threads`` beyond a C int. Each is a usage error naming
the flag, exit 2. Real CLI subprocesses (no model is needed: they stop at the option check)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _serve(args, home):
    env = {**os.environ, "FLYWHEEL_HOME": str(home), "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    for k in ("FLYWHEEL_KAFKA_BOOTSTRAP", "FLYWHEEL_STORE", "FLYWHEEL_MODEL_DIR"):
        env.pop(k, None)
    env["FLYWHEEL_MODEL_DIR"] = str(home / "no-model")  # a run that got past the check would fail otherwise
    return subprocess.run([sys.executable, "-m", "flywheel.cli", "serve", "--port", "1", *args], env=env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("args,flag", [
    (["--pod", ""], "--pod"),
    (["--pod", "a/b"], "--pod"),
    (["--pod", "p" * 250], "--pod"),
    (["--pod", ".."], "--pod"),
    (["--threads", "99999999999999999999"], "--threads"),
    (["--threads", "5000"], "--threads"),
], ids=["empty-pod", "slash-pod", "long-pod", "dotdot-pod", "huge-threads", "5000-threads"])
def test_bad_serve_flag_is_a_usage_error(tmp_path, args, flag):
    r = _serve(args, tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out, out
    assert flag in out, out


def test_good_pod_name_passes_the_check(tmp_path):
    """A valid name gets past the option check: what stops it is the missing model."""
    r = _serve(["--pod", "pod-é.1"], tmp_path)
    out = r.stdout + r.stderr
    assert "--pod" not in out.split("Error")[-1], out
    assert "Traceback" not in out, out
