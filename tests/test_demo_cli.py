"""`flywheel demo` as a user meets it: it never deletes a folder it did not make, and a
SIGTERM (a timeout, an operator's kill) stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]


def flat(text: str) -> str:
    """``text`` with rich's wrapping undone: panel borders dropped, whitespace runs one space
    (where rich breaks a line depends on the length of the paths in it)."""
    return " ".join(text.replace("\u2502", " ").split())


def test_out_home_not_made_by_a_demo_is_refused_and_kept(tmp_path):
    keep = tmp_path / "out" / "home" / "notes.txt"
    keep.parent.mkdir(parents=True)
    keep.write_text("mine")
    r = subprocess.run([sys.executable, "-m", "flywheel.cli", "demo", "--quick", "--out", str(tmp_path / "out")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--out" in r.stderr and "not made by flywheel demo" in flat(r.stderr), r.stderr
    assert keep.read_text() == "mine"


def test_model_init_refuses_a_directory_it_did_not_write(tmp_path):
    keep = tmp_path / "mine" / "config.json"
    keep.parent.mkdir()
    keep.write_text('{"hidden_size": 64}')
    r = subprocess.run([sys.executable, "-m", "flywheel.cli", "model", "init", "--out", str(keep.parent)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--out" in r.stderr and "not written by" in flat(r.stderr), r.stderr
    assert keep.read_text() == '{"hidden_size": 64}'


def test_sigterm_stops_every_child(tiny_moe_dir, tmp_path):
    import json

    cfg_before = (tiny_moe_dir / "config.json").read_text()
    # COLUMNS: rich's log lines keep their source column at the right edge, so a wrapped
    # message has "demo.py:NNN" in the middle of it
    env = {**os.environ, "FLYWHEEL_MODEL_DIR": str(tiny_moe_dir), "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}
    env.pop("FLYWHEEL_KAFKA_BOOTSTRAP", None)
    p = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "demo", "--quick", "--out", str(tmp_path / "d")],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    deadline = time.time() + 240
    while time.time() < deadline:
        line = p.stdout.readline()
        seen.append(line)
        if "traffic" in line or not line:
            break
    kids = [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
    assert kids, "".join(seen[-20:])
    from tests.test_demo_signals import _children, _listening, _ports

    ports = _ports(_children(p.pid))
    assert len(ports) == 2 and all(_listening(x) for x in ports), ports  # the broker's and the pod's
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=120)
    assert p.returncode == 143
    assert "flywheel demo: stopped by SIGTERM; every process it started is stopped" in flat(p.stdout.read())
    time.sleep(1)
    alive = [k for k in kids if psutil.pid_exists(k) and psutil.Process(k).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], [psutil.Process(k).cmdline()[:4] for k in alive]
    assert [x for x in ports if _listening(x)] == []
    # the demo used the given checkpoint as is: a model dir it did not write is never replaced
    assert (tiny_moe_dir / "config.json").read_text() == cfg_before
    assert json.loads(cfg_before)["hidden_size"] == 64
    assert "as given" in flat("".join(seen)), "".join(seen[-20:])
