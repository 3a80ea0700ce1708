"""``flywheel status --last N`` beyond any ledger: a usage error naming --last and its range,
exit 2. Real CLI subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cli(args, home):
    env = {**os.environ, "FLYWHEEL_HOME": str(home), "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    env.pop("FLYWHEEL_STORE", None)
    return subprocess.run([sys.executable, "-m", "flywheel.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize("n", ["99999999999999999999", "9223372036854775808", "100001"])
def test_status_last_out_of_range_is_a_usage_error(tmp_path, n):
    r = _cli(["status", "--serving", "http://127.0.0.1:9", "--serving-timeout-s", "1", "--last", n], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out and "Exception" not in out, out
    assert "--last" in out, out


def test_status_last_in_range_still_works(tmp_path):
    r = _cli(["status", "--serving", "http://127.0.0.1:9", "--serving-timeout-s", "1", "--last", "100000",
              "-o", "json"], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out  # the pod on port 9 is unreachable: exit 1, as documented
    assert "Traceback" not in out, out
    assert '"decisions"' in r.stdout, out
