"""The on-call commands with no model store (``FLYWHEEL_HOME`` an empty or a nonexistent
directory): each refuses as ``flywheel versions`` does (exit 1, "no model store at <root>")
and creates nothing; ``flywheel status`` says what it knows in text as in its JSON; the
rollout line names the last decision once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from deploy.commands import _print_rollout, console, register
from deploy.controller import RolloutStatus
from deploy.status import FleetStatus, last_decision
from schemas.output import Format

ROOT = Path(__file__).resolve().parents[1]

# (arguments, what is typed at a prompt): every command that changes the fleet or the learner
COMMANDS = [
    (["resume"], ""),
    (["resume", "--yes"], ""),
    (["pause"], "n\n"),
    (["pause", "--yes"], ""),
    (["canary", "start", "v000001", "--yes"], ""),
    (["canary", "abort", "--yes"], ""),
    (["promote"], "n\n"),
    (["promote", "--yes"], ""),
    (["rollback", "--yes"], ""),
    (["rollback", "--to", "v000000", "--yes"], ""),
]


def _tree(d: Path) -> list[str]:
    """Every path under ``d`` (relative), sorted."""
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


@pytest.fixture(params=["empty", "nonexistent"])
def no_store_home(request, tmp_path, monkeypatch) -> Path:
    """FLYWHEEL_HOME with no model store: an empty directory, or one that does not exist."""
    home = tmp_path / "home"
    if request.param == "empty":
        home.mkdir()
    monkeypatch.setenv("FLYWHEEL_HOME", str(home))
    monkeypatch.setenv("USER", "oncall-eve")
    for var in ("FLYWHEEL_STORE", "FLYWHEEL_SERVING_URL", "FLYWHEEL_ACTOR", "FLYWHEEL_KAFKA_BOOTSTRAP"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.mark.parametrize("args,typed", COMMANDS, ids=[" ".join(a) for a, _ in COMMANDS])
def test_command_refuses_without_a_store_as_versions_does(no_store_home, tmp_path, args, typed):
    run = CliRunner().invoke
    app = _app()
    before = _tree(tmp_path)
    ref = run(app, ["versions"])
    assert ref.exit_code == 1 and "no model store at" in ref.output, ref.output
    r = run(app, args, input=typed)
    assert r.exit_code == ref.exit_code == 1, r.output
    assert f"no model store at {no_store_home / 'store'}" in " ".join(r.output.split()), r.output
    assert "learner is not paused" not in r.output and "Traceback" not in r.output, r.output
    assert _tree(tmp_path) == before  # nothing created: no store/versions, no ledger
    after = run(app, ["versions"])  # still no store
    assert after.exit_code == 1 and "no model store at" in after.output, after.output


def test_resume_real_cli_subprocess_refuses_and_creates_nothing(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "FLYWHEEL_HOME": str(home), "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    env.pop("FLYWHEEL_STORE", None)
    r = subprocess.run([sys.executable, "-m", "flywheel.cli", "resume"], env=env, capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert f"no model store at {home / 'store'}" in " ".join(out.split()), out
    assert list(home.iterdir()) == [], out


def test_status_text_agrees_with_its_json_without_a_store(no_store_home, tmp_path):
    run = CliRunner().invoke
    app = _app()
    before = _tree(tmp_path)
    flags = ["--serving", "http://127.0.0.1:9", "--serving-timeout-s", "1"]
    js = run(app, ["status", *flags, "-o", "json"])
    assert js.exit_code == 1, js.output
    doc = json.loads(js.output)
    assert doc["learner"]["paused"] is None and doc["desired_error"] is None and doc["desired"] is None
    assert doc["serving_error"].startswith("no model store at")
    assert len(doc["pods"]) == 1
    txt = run(app, ["status", *flags])
    out = " ".join(txt.output.split())
    assert txt.exit_code == 1, txt.output
    assert "learner: unknown (no store)" in out and "running (not paused)" not in out, txt.output
    assert "the desired state cannot be read" not in out, txt.output  # desired_error is null
    assert "no model store, so no desired state" in out and "(1 pod listed)" in out, txt.output
    assert "pods listed" not in out, txt.output
    assert _tree(tmp_path) == before


def test_rollback_with_a_store_but_no_stable_version_says_so(fw_home, monkeypatch):
    from modelstore.store import ModelStore

    ModelStore(fw_home / "store")  # a store with no version: nothing is stable
    monkeypatch.setenv("USER", "oncall-eve")
    monkeypatch.delenv("FLYWHEEL_SERVING_URL", raising=False)
    r = CliRunner().invoke(_app(), ["rollback", "--yes"])
    out = " ".join(r.output.split())
    assert r.exit_code == 1, r.output
    assert "no stable version in the fleet's desired state: nothing to roll back to" in out, r.output
    assert "None" not in out, r.output


@pytest.mark.parametrize("outcome,reason,want", [
    ("ROLLBACK", "ROLLBACK: reward 0.31 < stable 0.52 - 0.08", "ROLLBACK: reward 0.31 < stable 0.52 - 0.08"),
    ("HOLD", "HOLD: too few samples (12 < 50)", "HOLD: too few samples (12 < 50)"),
    ("MANUAL_ROLLBACK", "manual rollback of candidate by bob", "MANUAL_ROLLBACK: manual rollback of candidate by bob"),
    ("ADVANCE", "ADVANCEMENT: x", "ADVANCE: ADVANCEMENT: x"),  # a prefix only when followed by ':'
    ("PROMOTE", "", "PROMOTE"),
])
def test_last_decision_names_the_outcome_once(outcome, reason, want):
    assert last_decision(outcome, reason) == want


def test_status_rollout_line_shows_the_decision_once():
    s = FleetStatus(rollout=RolloutStatus(last_outcome="ROLLBACK", last_reason="ROLLBACK: reward 0.31 < 0.44"))
    with console.capture() as cap:
        _print_rollout(s, Format.table)
    out = cap.get()
    assert "last=ROLLBACK: reward 0.31 < 0.44" in out and "ROLLBACK: ROLLBACK" not in out, out
