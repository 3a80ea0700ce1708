"""``flywheel --config FILE`` whose bytes are not UTF-8 (a file saved as UTF-16, a binary
picked by mistake): a usage error naming --config and why, exit 2, not a UnicodeDecodeError
traceback. Real CLI subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cli(args, home):
    env = {**os.environ, "FLYWHEEL_HOME": str(home), "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    env.pop("FLYWHEEL_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "flywheel.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_config_not_utf8_is_a_usage_error(tmp_path):
    cfg = tmp_path / "flywheel.toml"
    cfg.write_bytes("[serve]\nport = 8001\n".encode("utf-16"))
    r = _cli(["--config", str(cfg), "versions"], tmp_path / "home")
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out and "UnicodeDecodeError" not in out, out
    assert "--config" in out and "not UTF-8" in out, out


def test_config_utf8_still_works(tmp_path):
    cfg = tmp_path / "flywheel.toml"
    cfg.write_text("[versions]\noutput = \"json\"\n")
    (tmp_path / "home" / "store" / "versions").mkdir(parents=True)  # an empty model store (none: exit 1)
    r = _cli(["--config", str(cfg), "versions"], tmp_path / "home")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.lstrip().startswith(("[", "{")), r.stdout
