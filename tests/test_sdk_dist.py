"""The feedback SDK's own distribution, ``flywheel-feedback`` (``sdk/``; decision D73).

* The FeedbackEvent schema it ships is the one ``flywheel schemas export`` writes (the SDK
  validates every event with it, so it must be the consumers' contract, byte for byte).
* The wheel, built from ``sdk/``, installs into a fresh virtual environment with only its
  declared requirements (resolved by pip from the configured package indexes): torch, numpy
  and Flywheel's own packages are not importable there, Kafka mode is refused naming
  ``kafka_bootstrap`` (it needs flywheel-loop), and the client sends a copy, a
  regenerate, both kinds of edit and both follow-ups to a real HTTP server on a port (a small
  stdlib recorder: the SDK is what is tested; the serving pod's side is tests/test_ingest_sdk.py).
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
SDK = ROOT / "sdk"
SCHEMA = "FeedbackEvent.v1.schema.json"


def test_shipped_schema_is_the_export(tmp_path):
    from flywheel.cli import app

    r = CliRunner().invoke(app, ["schemas", "export", str(tmp_path)])
    assert r.exit_code == 0, r.output
    shipped = (SDK / "flywheel_feedback" / SCHEMA).read_bytes()
    assert shipped == (tmp_path / SCHEMA).read_bytes(), (
        "sdk/flywheel_feedback/FeedbackEvent.v1.schema.json is not the export of schemas.events.FeedbackEvent: "
        "run `flywheel schemas export docs/schemas && cp docs/schemas/FeedbackEvent.v1.schema.json "
        "sdk/flywheel_feedback/`")


class _Recorder(BaseHTTPRequestHandler):
    """``POST /v1/feedback/batch`` as docs/sdk.md states it: every event accepted."""

    batches: list[list[dict]] = []
    auth: list[str | None] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path != "/v1/feedback/batch":
            self.send_error(404)
            return
        self.batches.append(body["events"])
        self.auth.append(self.headers.get("authorization"))
        out = json.dumps({"accepted": len(body["events"]), "rejected": 0, "results": [
            {"index": i, "status": 200, "event_id": e["event_id"], "accepted": True, "duplicate": False}
            for i, e in enumerate(body["events"])]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


CLIENT = r"""
import importlib.util, json, sys
for mod in ("torch", "numpy", "pydantic", "schemas", "ingest", "serving", "flywheel"):
    assert importlib.util.find_spec(mod) is None, mod + " is importable in the SDK's venv"
from flywheel_feedback import FeedbackClient

url, cid = sys.argv[1], sys.argv[2]
fb = FeedbackClient(url, feedback_key="k-fb", linger_s=0.5)
ids = [fb.copy(cid, user="alice"), fb.regenerate(cid, user="bob"), fb.edit(cid, kept=0.5),
       fb.edit(cid, final_text="the user's version", user="carol"), fb.followup(cid, True),
       fb.followup(cid, False, comment="wrong")]
errors = []
for call in (lambda: fb.edit(cid), lambda: fb.followup(cid, 1), lambda: fb.copy("nope"),
             lambda: FeedbackClient(kafka_bootstrap="127.0.0.1:9", user_salt="s")):
    try:
        call()
    except ValueError as exc:
        errors.append(str(exc).split(":")[0])
assert fb.flush(timeout_s=30) == 0 and fb.shutdown() == []
print(json.dumps({"ids": ids, "errors": errors, "stats": fb.stats()}))
"""


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` without this process's PYTHON* and FLYWHEEL_* variables (a PYTHONPATH would
    show pip and the venv packages that are not installed there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "FLYWHEEL_"))}
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=170, env=env, **kw)
    assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
    return r


@pytest.mark.timeout(180)
def test_wheel_installs_alone_without_torch_and_sends_every_signal(tmp_path):
    # build from a copy: setuptools writes build/ and *.egg-info next to the sources
    src = tmp_path / "src"
    shutil.copytree(SDK, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
          tmp_path / "wheels", src])
    (whl,) = (tmp_path / "wheels").glob("flywheel_feedback-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        meta = email.parser.Parser().parsestr(z.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
                                              .decode())
    assert {n.split("/")[0] for n in names} == {"flywheel_feedback", whl.name.split("-py")[0] + ".dist-info"}
    assert f"flywheel_feedback/{SCHEMA}" in names
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    assert meta["Name"] == "flywheel-feedback" and {r.name for r in reqs} == {"httpx", "jsonschema-rs"}

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "--no-deps", whl])
    _run([*pip, "--only-binary", ":all:", *map(str, reqs)])  # the declared requirements, resolved by pip

    _Recorder.batches, _Recorder.auth = [], []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        cid = str(uuid.uuid4())
        r = _run([py, "-I", "-c", CLIENT, f"http://127.0.0.1:{srv.server_address[1]}", cid], cwd=tmp_path)
    finally:
        srv.shutdown()
        th.join(5)
    out = json.loads(r.stdout)
    ids = out["ids"]
    assert out["errors"] == ["kept", "satisfied", "completion_id", "kafka_bootstrap"]  # Kafka mode needs flywheel-loop
    assert _Recorder.batches == [[
        {"completion_id": cid, "event_id": ids[0], "kind": "copy", "value": 1.0, "comment": None, "user": "alice"},
        {"completion_id": cid, "event_id": ids[1], "kind": "regenerate", "value": 1.0, "comment": None,
         "user": "bob"},
        {"completion_id": cid, "event_id": ids[2], "kind": "edit", "value": 0.5, "comment": None, "user": None},
        {"completion_id": cid, "event_id": ids[3], "kind": "edit", "comment": None, "user": "carol",
         "final_text": "the user's version"},
        {"completion_id": cid, "event_id": ids[4], "kind": "followup", "value": 1.0, "comment": None, "user": None},
        {"completion_id": cid, "event_id": ids[5], "kind": "followup", "value": -1.0, "comment": "wrong",
         "user": None},
    ]]
    assert _Recorder.auth == ["Bearer k-fb"]
    assert (out["stats"]["accepted"], out["stats"]["sent"]) == (6, 6)
