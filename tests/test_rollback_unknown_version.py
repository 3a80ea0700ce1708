"""`flywheel rollback --to VERSION` of a version not in the store: the message reads as a
sentence naming --to and the version. Real CLI subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_rollback_to_unknown_version_message(tmp_path):
    env = {**os.environ, "FLYWHEEL_HOME": str(tmp_path), "PYTHONPATH": str(ROOT), "COLUMNS": "300"}
    for k in ("FLYWHEEL_STORE", "FLYWHEEL_KAFKA_BOOTSTRAP"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "flywheel.cli", "rollback", "--to", "v000009", "--yes"], env=env,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 1, out
    assert "--to: version v000009 is not in the store" in out, out
    assert "'version" not in out, out
