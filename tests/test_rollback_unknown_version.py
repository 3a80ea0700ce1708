"""`flywheel rollback --to VERSION`: a version not in the store is a state error (exit 1, a
sentence naming --to and the version); a value that is no version name at all (a control
character or an escape, a path, a digit int() cannot read) is a usage error like typer's
others (exit 2 naming --to, the value shown escaped), refused before the store, the fleet's
record or the ledger is touched. Real CLI subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _rollback(tmp_path: Path, to: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLYWHEEL_HOME": str(tmp_path), "PYTHONPATH": str(ROOT), "COLUMNS": "300"}
    for k in ("FLYWHEEL_STORE", "FLYWHEEL_KAFKA_BOOTSTRAP", "FLYWHEEL_CONFIG"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "flywheel.cli", "rollback", "--to", to, "--yes"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_rollback_to_unknown_version_message(tmp_path):
    from modelstore.store import ModelStore

    ModelStore(tmp_path / "store")  # a store without v000009 (no store at all is refused before --to is read)
    r = _rollback(tmp_path, "v000009")
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 1, out
    assert "--to: version v000009 is not in the store" in out, out
    assert "'version" not in out, out


# each value, and how the message must show it (written out by hand: repr's escapes)
NOT_VERSIONS = [("v\x1b[2J", "'v\\x1b[2J'"), ("v000001\n", "'v000001\\n'"), ("\x9b31m", "'\\x9b31m'"),
                ("v\u00b2", "'v²'"), ("../v000001", "'../v000001'"), ("", "''")]


@pytest.mark.parametrize("to,shown", NOT_VERSIONS, ids=["esc", "newline", "csi8", "superscript", "path", "empty"])
def test_rollback_to_a_value_that_is_no_version_name_is_a_usage_error(tmp_path, to, shown):
    r = _rollback(tmp_path, to)
    out = " ".join((r.stdout + r.stderr).replace("│", " ").split())
    assert r.returncode == 2, (r.returncode, out)
    assert f"Invalid value for '--to': not a version name of the form v000123, got {shown}" in out, out
    assert "Traceback" not in out, out
    # nothing a terminal acts on reached it: the value is shown as escapes
    assert not [c for c in r.stdout + r.stderr if (ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) <= 0x9f], out
    # refused while parsing: no store, no fleet record, no ledger row was created
    assert not (tmp_path / "store").exists(), sorted(p.name for p in tmp_path.iterdir())
