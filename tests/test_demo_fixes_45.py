"""Fixes from stop 45's hostile test: the learner's process group listens on loopback only
(learner/trainer.py), `flywheel serve` exits soon after it stops (serving/), and `flywheel demo
--out` naming an existing file is refused before anything starts (flywheel/demo_config.py)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A child that initialises the learner's group and prints its own listening TCP sockets,
# read from /proc (state 0A = LISTEN; an address is hex, little-endian per 32-bit word).
LISTENERS_CHILD = r"""
import json, os, socket, struct, torch
from learner.trainer import ensure_dist_env

def listeners():
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    out = []
    for name, fam in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in open(f"/proc/self/net/{name}").read().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in mine:
                continue
            addr, port = f[1].split(":")
            raw = b"".join(struct.pack("<I", int(addr[i:i + 8], 16)) for i in range(0, len(addr), 8))
            out.append([socket.inet_ntop(fam, raw), int(port, 16)])
    return sorted(out)

ensure_dist_env()
t = torch.tensor([1.5]); torch.distributed.all_reduce(t)
print(json.dumps({"during": listeners(), "sum": t.item(), "master_port": os.environ.get("MASTER_PORT"),
                  "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}))
torch.distributed.destroy_process_group()
print(json.dumps({"after": listeners()}))
"""


def _run_child(env_extra: dict) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_extra)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GLOO_SOCKET_IFNAME"):
        if k not in env_extra:
            env.pop(k, None)
    r = subprocess.run([sys.executable, "-c", LISTENERS_CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="reads listening sockets from Linux's /proc")
@pytest.mark.timeout(300)
def test_learner_group_listens_on_loopback_only():
    """torch's env:// rendezvous would serve its store on every interface (``*:port``); the
    learner's one-rank group must listen on 127.0.0.1 only: its store and gloo's device, two
    sockets, none on another address; the port chosen here is not left in the environment
    (a child picks its own), and the sockets close with the group."""
    during, after = _run_child({})
    assert during["sum"] == 1.5
    addrs = [a for a, _ in during["during"]]
    assert len(addrs) == 2 and addrs == ["127.0.0.1", "127.0.0.1"], during["during"]
    assert during["master_port"] is None and during["gloo_ifname"] is None
    assert after["after"] == []


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="reads listening sockets from Linux's /proc")
@pytest.mark.timeout(300)
def test_learner_group_listens_on_a_given_master_port_on_loopback():
    """``MASTER_PORT`` set: the store listens there, on 127.0.0.1, and the variable stays."""
    with socket.socket() as s:  # a port free now (the child binds it a moment later)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    during, _ = _run_child({"MASTER_PORT": str(port)})
    assert ["127.0.0.1", port] in during["during"] and {a for a, _ in during["during"]} == {"127.0.0.1"}
    assert during["master_port"] == str(port)


@pytest.mark.skipif(not Path("/sys/class/net/lo").exists(), reason="Linux names its loopback interface lo")
def test_loopback_interface_is_lo_on_linux():
    from learner.trainer import loopback_interface

    assert loopback_interface() == "lo"


def _journal_events(home: Path) -> list[dict]:
    """Every entry of the pods' event journals under ``home``: ``{"topic", "key", "value"}``,
    the value base64-decoded (bytes)."""
    import base64

    out = []
    for j in sorted((home / "serving").glob("*.journal")):
        for line in j.read_text().splitlines():
            e = json.loads(line)
            out.append({**e, "value": base64.b64decode(e["value"])})
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig,rc", [(signal.SIGTERM, 0), (signal.SIGINT, 128 + signal.SIGINT)])
def test_serve_exits_after_stopped_with_its_events_in_the_journal(tiny_moe_dir, tmp_path, sig, rc):
    """A real `flywheel serve` (torch engine, tiny model, no broker: events go to the journal)
    answers one completion, gets a stop signal, logs "stopped" and ends: SIGTERM exit 0,
    SIGINT 130; the completion's event is in the journal on disk after it ended."""
    import httpx

    from schemas.settings import free_port

    port = free_port()
    env = {**os.environ, "FLYWHEEL_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    for k in ("FLYWHEEL_KAFKA_BOOTSTRAP", "FLYWHEEL_STORE", "FLYWHEEL_MODEL_DIR", "FLYWHEEL_ADMIN_TOKEN",
              "FLYWHEEL_API_KEYS"):
        env.pop(k, None)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "serve", "--port", str(port), "--model-dir",
                                 str(tiny_moe_dir), "--max-batch", "2"], env=env, cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300  # a hang guard: the model load on a busy box
        while "serving " not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                       json={"model": "v000000", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        cid = r.headers["x-flywheel-completion-id"]
        proc.send_signal(sig)
        assert proc.wait(60) == rc, log.read_text()[-3000:]  # 60 s: a hang guard, not a timing claim
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    journal = tmp_path / "home" / "serving" / "pod-0.journal"
    assert "stopped in" in text and f"not delivered yet, kept in {journal}" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    mine = [e for e in _journal_events(tmp_path / "home") if cid.encode() in e["value"]]
    assert mine and all(e["topic"].endswith("completions") for e in mine), _journal_events(tmp_path / "home")


@pytest.mark.parametrize("out,said", [("afile", "out: {d}/afile is a file, not a directory"),
                                      ("afile/sub", "out: {d}/afile (in {d}/afile/sub) is a file, not a directory")])
def test_demo_out_naming_a_file_is_refused_before_anything_starts(tmp_path, monkeypatch, out, said):
    """`flywheel demo --quick --out afile` with afile an existing regular file (or a path under
    it): exit 2 naming --out and why, and the run (which starts every process) is never
    reached; a new directory is taken."""
    from typer.testing import CliRunner

    import flywheel.commands as fc
    from flywheel.cli import app

    started: list = []
    monkeypatch.setattr(fc, "require_demo_extra", lambda: None)
    monkeypatch.setattr(fc, "_run_demo", lambda cfg: started.append(cfg))
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path / "home"))
    (tmp_path / "afile").write_text("mine")
    r = CliRunner().invoke(app, ["demo", "--quick", "--out", str(tmp_path / out)], env={"COLUMNS": "300"})
    flat = " ".join(r.output.replace("\u2502", " ").split())
    assert r.exit_code == 2 and f"Invalid value for '--out': {said.format(d=tmp_path)}" in flat, r.output
    assert started == [] and (tmp_path / "afile").read_text() == "mine" and not (tmp_path / "home").exists()
    r = CliRunner().invoke(app, ["demo", "--quick", "--out", str(tmp_path / "new")], env={"COLUMNS": "300"})
    assert r.exit_code == 0 and [c.out for c in started] == [tmp_path / "new"], r.output
