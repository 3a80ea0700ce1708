"""``flywheel ingest --state`` refuses what is no join state, naming --state, exit 2: a URL of
another scheme (``mysql://``, a misspelt ``postgresq://``) and a malformed ``postgresql://``
URL (the message without its password). Real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args,env,text", [
    (["--state", "mysql://u@db/x"], {}, "mysql:// is not a join state"),
    (["--state", "postgresq://u@db/x"], {}, "postgresq:// is not a join state"),
    ([], {"FLYWHEEL_INGEST_STATE": "postgres+psycopg://u@db/x"}, "postgres+psycopg:// is not a join state"),
    (["--state", "postgresql://u:s3cret@[bad"], {}, "not a valid PostgreSQL URL"),
], ids=["mysql", "typo", "env_driver_scheme", "malformed_pg"])
def test_state_that_is_no_join_state_is_refused(tmp_path, args, env, text):
    e = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    e.update(PYTHONPATH=str(ROOT), FLYWHEEL_HOME=str(tmp_path / "home"), COLUMNS="200",
             FLYWHEEL_KAFKA_BOOTSTRAP="127.0.0.1:1", **env)
    r = subprocess.run([sys.executable, "-m", "flywheel.cli", "ingest", *args], cwd=tmp_path, env=e,
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert text in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "s3cret" not in r.stderr + r.stdout
    assert not any(p.name.endswith(":") for p in tmp_path.iterdir()), "a SQLite 'URL' directory was created"
