"""`flywheel pause` / `resume`: recorded intent (the fleet's desired-state record on the model
store + ledger, with who ran it) that a real `flywheel learn` daemon process honours before
each cycle. The operator's `FLYWHEEL_HOME` and the learner's are different directories (as
two pods are): the pause reaches the learner through the store alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import typer
from typer.testing import CliRunner

from deploy import ledger
from deploy.commands import register
from modelstore.desired import FleetRecord
from modelstore.store import ModelStore
from schemas import settings
from schemas.modelspec import load_model

from test_learner_cycle import write_shard  # noqa: E402  (learner's test helpers: real samples)
from test_learner_replay import make_samples  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_pause_is_recorded_and_the_learner_daemon_honours_it(tiny_moe_dir, tmp_path, fw_home, monkeypatch):
    monkeypatch.setenv("USER", "oncall-bob")
    monkeypatch.delenv("FLYWHEEL_KAFKA_BOOTSTRAP", raising=False)
    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    monkeypatch.setenv("FLYWHEEL_STORE", str(store.root))
    app = typer.Typer()
    register(app)
    run = CliRunner().invoke
    r = run(app, ["pause", "--reason", "disk full on the learner box", "--yes"])
    assert r.exit_code == 0, r.output
    rec = json.loads((store.root / "fleet" / "desired.json").read_text())["paused"]
    assert rec["actor"] == "oncall-bob" and rec["reason"] == "disk full on the learner box"
    assert not (fw_home / "learner" / "paused").exists()  # no local flag file
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", "http://127.0.0.1:9")  # nothing serves here
    r = run(app, ["status", "--json"])
    st = json.loads(r.output)
    assert st["learner"]["paused"]["actor"] == "oncall-bob"
    assert r.exit_code == 1 and st["serving"] is None and st["serving_error"]  # serving down: exit 1
    assert "already paused by oncall-bob" in run(app, ["pause", "--yes"]).output

    samples = make_samples(load_model(tiny_moe_dir), 4, version="v000000", seed=21)
    write_shard(tmp_path / "samples", samples, "v000000", "a")  # enough to trigger a cycle
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FLYWHEEL_HOME": str(tmp_path / "learner-home")}
    env.pop("MASTER_PORT", None)
    p = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "learn", "--store", str(tmp_path / "store"),
                          "--samples", str(tmp_path / "samples"), "--every-n", "4", "--every-h", "10",
                          "--poll-s", "0.3", "--steps", "1"],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        # wait until the daemon is up and says it is paused (imports take seconds on a busy box)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any("learn: paused by operator" in x for x in lines):
            assert p.poll() is None, "".join(lines)[-3000:]
            time.sleep(0.2)
        time.sleep(2)  # paused: 4 new samples >= every_n, yet no cycle across several polls
        assert p.poll() is None and ModelStore(tmp_path / "store").versions() == ["v000000"]
        r = run(app, ["resume", "--yes"])
        assert r.exit_code == 0 and "resumed by oncall-bob" in r.output
        assert FleetRecord(store).read().paused is None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and ModelStore(tmp_path / "store").versions() == ["v000000"]:
            assert p.poll() is None, "".join(lines)[-3000:]
            time.sleep(0.5)
        assert ModelStore(tmp_path / "store").versions() == ["v000000", "v000001"]
    finally:
        p.kill()
        p.wait(10)
        reader.join(10)
    out = "".join(lines)
    assert "learn: paused by operator" in out and "oncall-bob" in out and "learn: resumed" in out
    rows = [(d.decision, d.actor) for d in ledger.decisions(settings.ledger_path())]
    assert rows == [("PAUSE", "oncall-bob"), ("RESUME", "oncall-bob")]
    assert json.loads(run(app, ["status", "--json"]).output)["learner"]["paused"] is None
