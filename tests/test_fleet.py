"""One fleet, one truth (issue 19 item 1; issue 22 defects 6-8): operator actions and the
controller act on the fleet's desired-state record, and every pod converges to it.

Three real serving pods (torch engine, tiny MoE, uvicorn on their own ports) over one model
store; the operator runs the real `flywheel` deploy CLI (in-process, and as concurrent
subprocesses for the race); the ledger is a real DuckDB file. Expected states come from the
action's rule (rollback --to X: every pod serves X), checked on each pod's `/admin/slots`
and on real completions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import typer
from typer.testing import CliRunner

from deploy import ledger
from deploy.commands import register
from modelstore.desired import DesiredState, FleetRecord
from deploy.serving_client import ServingAdmin
from modelstore.store import CorruptVersionError, ModelStore
from schemas import settings
from serving.commands import build_pod
from servers import ServerThread
from tests.test_deploy_controller import publish_v
from flywheel.supervise import die_with_parent

TOKEN = "fleet-admin"
REPO = Path(__file__).resolve().parents[1]


def _with(**fields):
    def fn(d: DesiredState) -> DesiredState:
        for k, v in fields.items():
            setattr(d, k, v)
        return d
    return fn


class Fleet:
    """Three pods over one store; ``restart(i)`` rebuilds pod i on its port (a fresh process's state)."""

    def __init__(self, root: Path, n: int = 3, poll_s: float | None = 0.2):
        self.root, self.poll_s = root, poll_s  # each pod watches the record every poll_s (None: no watch)
        self.pods = [None] * n
        self.ports = [None] * n
        for i in range(n):
            self.start(i)
        self.admins = [ServingAdmin(self.url(i), TOKEN, timeout_s=10) for i in range(n)]

    def start(self, i: int) -> None:
        pod = build_pod(ModelStore(self.root), pod=f"pod-{i}", max_batch=2, admin_token=TOKEN, log_events=False,
                        desired_poll_s=self.poll_s)
        srv = ServerThread(pod.app, port=self.ports[i]).start()
        self.pods[i], self.ports[i] = (pod, srv), srv.port

    def stop(self, i: int) -> None:
        pod, srv = self.pods[i]
        srv.stop()
        pod.close()
        self.pods[i] = None

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def serving(self) -> list[tuple[str, str | None, float]]:
        out = []
        for a in self.admins:
            s = a.slots()
            out.append((s.stable.version, s.candidate.version if s.candidate else None, s.candidate_weight))
        return out

    def close(self) -> None:
        for a in self.admins:
            a.close()
        for i, p in enumerate(self.pods):
            if p is not None:
                self.stop(i)


@pytest.fixture()
def fleet(tmp_path, tiny_moe_dir, fw_home, monkeypatch):
    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    publish_v(store, "v000000")
    f = Fleet(store.root)
    monkeypatch.delenv("FLYWHEEL_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.setenv("FLYWHEEL_STORE", str(store.root))
    monkeypatch.setenv("FLYWHEEL_SAMPLES", str(tmp_path / "samples"))
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", f.url(0))  # one pod only: the record names all three
    monkeypatch.setenv("FLYWHEEL_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("USER", "oncall-fay")
    FleetRecord(store).change(_with(pods=[f.url(i) for i in range(3)]), "test", "pods")
    f.store, f.ledger = store, settings.ledger_path()  # where every deploy command writes it
    app = typer.Typer()
    register(app)

    def cli(*args):
        r = CliRunner().invoke(app, list(args))
        return r, " ".join(r.output.split())

    f.cli = cli
    yield f
    f.close()


def _rows(f, *decisions):
    return [d for d in ledger.decisions(f.ledger) if not decisions or d.decision in decisions]


def test_operator_actions_converge_every_pod_and_status_shows_drift(fleet):
    f = fleet
    m1 = f.store.manifest("v000001")
    # a canary in the desired state (as the controller writes it); the pods are brought to it
    r, out = f.cli("controller", "--once", "--steps", "0.5,1", "--min-votes", "5",
                   *sum((["--serving", f.url(i)] for i in range(3)), []))
    assert r.exit_code == 0, out
    assert f.serving() == [("v000000", "v000001", 0.5)] * 3
    # promote through one URL: the record lists all three pods, every pod promotes
    r, out = f.cli("promote", "--yes", "--serving", f.url(1))
    assert r.exit_code == 0 and "stable is now v000001 on all 3 pods" in out, out
    assert f.serving() == [("v000001", None, 0.0)] * 3
    assert {a.slots().stable.weights_digest for a in f.admins} == {m1.weights_digest}
    row, seen = _rows(f, "MANUAL_PROMOTE", "FLEET_CONVERGED")[-2:]  # the decision, then each pod as observed
    assert (row.decision, seen.decision) == ("MANUAL_PROMOTE", "FLEET_CONVERGED")
    assert seen.numbers["generation"] == row.numbers["generation"] == FleetRecord(f.store).read().generation
    assert seen.numbers["pods"]["converged"] == 3 and set(seen.numbers["pods"]["by_pod"]) == {f.url(i) for i in range(3)}
    # rollback --to: every pod, the store's stable record, the desired state and the ledger agree
    r, out = f.cli("rollback", "--to", "v000000", "--yes")
    assert r.exit_code == 0 and "stable is now v000000 on all 3 pods" in out, out
    assert [s for s, _, _ in f.serving()] == ["v000000"] * 3
    assert f.store.stable() == FleetRecord(f.store).read().stable == _rows(f, "MANUAL_ROLLBACK")[-1].version == "v000000"
    for i in range(3):  # real completions say so too
        rr = httpx.post(f.url(i) + "/v1/completions", json={"model": "flywheel", "prompt": [5, 6], "max_tokens": 1},
                        timeout=60)
        assert rr.headers["x-flywheel-model-version"] == "v000000"
    # a pod changed by hand drifts (its own watch acts on new generations only): status flags it; the
    # controller brings it back
    f.admins[2].rollback("v000001")
    r, out = f.cli("status", "--json")
    j = json.loads(r.output)
    assert r.exit_code == 0 and not j["converged"] and len(j["pods"]) == 3
    assert [bool(p["drift"]) for p in j["pods"]] == [False, False, True]
    assert any("pod pod-2 serves v000001 as stable but the fleet's desired state says v000000" in w
               for w in j["warnings"]), j["warnings"]
    r, out = f.cli("status")
    assert "2 of 3 pods serve the desired state" in out, out
    r, out = f.cli("controller", "--once")
    assert r.exit_code == 0, out
    assert [s for s, _, _ in f.serving()] == ["v000000"] * 3
    assert _rows(f)[-1].decision == "RECONCILE" and _rows(f)[-1].numbers["pod"] == f.url(2)
    assert _rows(f)[-1].numbers["actions"] == ["rollback to v000000"]


def test_an_unreachable_pod_is_reported_retried_and_converges_when_back(fleet):
    f = fleet
    f.stop(2)
    t0 = time.monotonic()
    # --timeout 12: the two live pods converge within it on a box with every core oversubscribed
    r, out = f.cli("rollback", "--to", "v000001", "--yes", "--timeout", "12", "--serving-timeout-s", "2")
    took = time.monotonic() - t0
    assert r.exit_code == 1 and "not converged" in out and "2 of 3 pods" in out, out
    assert "stable is now" not in out and took < 120, took  # by its --timeout, never waiting for the stopped pod
    rows = _rows(f, "MANUAL_ROLLBACK", "FLEET_NOT_CONVERGED")
    assert [x.decision for x in rows] == ["MANUAL_ROLLBACK", "FLEET_NOT_CONVERGED"]
    by_pod = rows[-1].numbers["pods"]["by_pod"]
    assert by_pod[f.url(2)]["outcome"] == "unreachable"
    assert by_pod[f.url(0)]["outcome"] == by_pod[f.url(1)]["outcome"] == "converged"
    # the pod comes back: it reads the desired state before it is ready, no action needed
    f.start(2)
    assert [s for s, _, _ in f.serving()] == ["v000001"] * 3
    # mid-canary, a restarted pod joins the same split
    FleetRecord(f.store).change(_with(stable="v000000", candidate="v000001", weight=0.25), "test", "canary")
    r, out = f.cli("controller", "--once", "--steps", "0.25,1")
    f.stop(1)
    f.start(1)
    assert f.admins[1].slots().candidate.version == "v000001" and f.admins[1].slots().candidate_weight == 0.25


def test_two_rollbacks_at_once_end_in_one_state_that_pods_record_and_ledger_agree_on(fleet):
    """Both commands start while a publish holds the store's lock; whichever runs last is
    what every pod, the desired state, the store's stable record and the ledger say. The
    earlier one either saw every pod at its generation first (exit 0) or says it was
    superseded by the later one (exit 1, naming it)."""
    f = fleet
    publish_v(f.store, "v000001")  # v000002
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "flywheel.cli", "rollback", "--yes", "--timeout", "30", "--to"]
    for run in range(2):
        with f.store._lock():  # a publish in progress
            procs = [subprocess.Popen(cmd + [v], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                     for v in ("v000000", "v000002")]
            time.sleep(1.0)
        outs = [p.communicate(timeout=120)[0] for p in procs]
        codes = [p.returncode for p in procs]
        assert 0 in codes and all(c == 0 or "superseded" in o for c, o in zip(codes, outs)), \
            "\n---\n".join(f"exit {c}:\n{o}" for c, o in zip(codes, outs))
        d = FleetRecord(f.store).read()
        last = _rows(f, "MANUAL_ROLLBACK")[-1]
        assert [s for s, _, _ in f.serving()] == [d.stable] * 3, (run, outs)
        assert f.store.stable() == last.version == d.stable, (run, outs)


def test_canary_start_and_abort_converge_every_pod_and_retry_one_that_comes_back(fleet):
    """`canary start|abort` act like promote/rollback: every pod, per-pod outcomes printed and
    in the ledger, a pod down during the action retried until --timeout, exit 1 naming a pod
    still down; the controller analyses the operator's canary and leaves the aborted one."""
    f = fleet
    f.stop(2)  # down when the command starts, back 1.5 s later: the command's retry reaches it
    back = threading.Timer(1.5, f.start, (2,))
    back.start()
    r, out = f.cli("canary", "start", "v000001", "--yes", "--weight", "0.25", "--timeout", "30",
                   "--serving-timeout-s", "2")
    back.join()
    assert r.exit_code == 0 and "canary of v000001 at 25% started" in out and "on all 3 pods" in out, out
    assert f.serving() == [("v000000", "v000001", 0.25)] * 3
    act, done = _rows(f, "MANUAL_CANARY_START", "FLEET_CONVERGED", "FLEET_NOT_CONVERGED")
    assert (act.decision, act.version, act.stable, act.step, act.weight) == ("MANUAL_CANARY_START", "v000001",
                                                                             "v000000", 0, 0.25)
    assert done.decision == "FLEET_CONVERGED" and done.numbers["pods"]["converged"] == 3
    seen = done.numbers["pods"]["by_pod"]  # each pod did it itself: two by their watch, one at its start
    assert [seen[f.url(i)]["actions"] for i in range(3)] == [["load v000001", "weight 0.25"]] * 3
    assert {p["generation"] for p in seen.values()} == {act.numbers["generation"]}
    # the controller takes the operator's canary as its own (step 0 at 25 %, holds without votes)
    r, out = f.cli("controller", "--once", "--steps", "0.25,1", "--min-votes", "5")
    assert r.exit_code == 0 and "phase=canary candidate=v000001 step=0 weight=0.25" in out, out
    assert f.serving() == [("v000000", "v000001", 0.25)] * 3
    # abort with pod 1 down for longer than --timeout: exit 1, the pod named, never "aborted ... on all"
    f.stop(1)
    r, out = f.cli("canary", "abort", "--yes", "--timeout", "4", "--serving-timeout-s", "2")
    assert r.exit_code == 1 and "not converged" in out and "2 of 3 pods" in out and "on all" not in out, out
    assert f"({f.url(1)}): NOT converged (unreachable" in out, out
    act, end = _rows(f, "MANUAL_CANARY_ABORT", "FLEET_NOT_CONVERGED")[-2:]
    assert (act.decision, end.decision) == ("MANUAL_CANARY_ABORT", "FLEET_NOT_CONVERGED")
    assert end.numbers["pods"]["by_pod"][f.url(1)]["outcome"] == "unreachable"
    assert [end.numbers["pods"]["by_pod"][f.url(i)]["candidate"] for i in (0, 2)] == [None, None]
    f.start(1)  # back: it reads the desired state (no candidate) before it is ready
    assert f.serving() == [("v000000", None, 0.0)] * 3
    r, out = f.cli("controller", "--once", "--steps", "0.25,1", "--min-votes", "5")
    assert r.exit_code == 0 and "phase=aborted" in out, out  # not restarted by the controller
    assert f.serving() == [("v000000", None, 0.0)] * 3
    assert f.store.manifest("v000001").status_history[-1].status == "aborted"


def test_two_canary_starts_at_once_end_in_one_canary(fleet):
    """Two operators start different canaries while another action holds the fleet lock:
    one wins, the other is refused; pods, desired state and ledger name the same candidate."""
    f = fleet
    publish_v(f.store, "v000001")  # v000002
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "flywheel.cli", "canary", "start", "--yes", "--timeout", "30"]
    with FleetRecord(f.store).locked("test", "another operator"):
        procs = [subprocess.Popen(cmd + [v], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for v in ("v000001", "v000002")]
        time.sleep(1.0)
    outs = [" ".join(p.communicate(timeout=120)[0].split()) for p in procs]
    assert sorted(p.returncode for p in procs) == [0, 1], outs
    won = ("v000001", "v000002")[[p.returncode for p in procs].index(0)]
    lost = outs[[p.returncode for p in procs].index(1)]
    assert f"a canary of {won} at 5% is in progress" in lost, outs
    assert f.serving() == [("v000000", won, 0.05)] * 3
    assert FleetRecord(f.store).read().candidate == won
    rows = _rows(f, "MANUAL_CANARY_START", "MANUAL_CANARY_START_FAILED")
    assert sorted((x.decision, x.version) for x in rows) == sorted(
        [("MANUAL_CANARY_START", won), ("MANUAL_CANARY_START_FAILED", ({"v000001", "v000002"} - {won}).pop())])


def test_corrupt_manifest_is_named_listed_and_skipped_by_the_controller(fleet):
    """Issue 22 defect 6: one corrupt byte in a manifest."""
    f = fleet
    publish_v(f.store, "v000001")  # v000002
    p = f.store.root / "versions" / "v000002" / "manifest.json"
    raw = bytearray(p.read_bytes())
    raw[raw.index(b'"kind"') + 1] = ord("X")  # one byte: the key becomes "Xind"
    p.write_bytes(bytes(raw))
    with pytest.raises(CorruptVersionError) as ei:
        f.store.manifest("v000002")
    assert "v000002" in str(ei.value) and "versions/v000002/manifest.json" in str(ei.value)
    r, out = f.cli("versions", "--json")
    rows = {x["version"]: x for x in json.loads(r.output)}
    assert r.exit_code == 0 and rows["v000002"]["status"] == "corrupt" and "manifest.json" in rows["v000002"]["error"]
    r, out = f.cli("versions")
    assert r.exit_code == 0 and "corrupt" in out
    # the controller records the version FAILED (once) and canaries the next good one
    for _ in range(2):
        r, out = f.cli("controller", "--once", "--steps", "0.5,1", "--min-votes", "5")
        assert r.exit_code == 0 and "candidate=v000001" in out, out
    failed = [x for x in _rows(f, "FAILED") if x.version == "v000002"]
    assert len(failed) == 1 and "manifest.json" in failed[0].reason


def test_rollback_to_the_current_stable_reloads_from_the_store(fleet):
    """Issue 22 defect 7: with its weights file corrupt, the reload fails on every pod and the
    command says so (exit 1); with good files every pod reloads it, verified."""
    f = fleet
    before = [a.slots().stable.loaded_at for a in f.admins]
    r, out = f.cli("rollback", "--to", "v000000", "--yes")
    assert r.exit_code == 0 and "reloaded from the store" in out, out
    after = [a.slots() for a in f.admins]
    assert all(s.stable.loaded_at > b for s, b in zip(after, before))
    assert {s.stable.weights_digest for s in after} == {f.store.manifest("v000000").weights_digest}
    pay = f.store.root / "versions" / "v000000" / "payload.bin"
    raw = bytearray(pay.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    pay.write_bytes(bytes(raw))
    r, out = f.cli("rollback", "--to", "v000000", "--yes", "--timeout", "5")
    assert r.exit_code == 1 and "checksum" in out and "0 of 3 pods" in out and "stable is now" not in out, out
    by_pod = _rows(f, "FLEET_NOT_CONVERGED")[-1].numbers["pods"]["by_pod"]
    assert {p["outcome"] for p in by_pod.values()} == {"refused"}


def test_controller_once_exits_nonzero_when_its_step_failed(fleet):
    """Issue 22 defect 8."""
    f = fleet
    pay = f.store.root / "versions" / "v000001" / "payload.bin"
    raw = bytearray(pay.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    pay.write_bytes(bytes(raw))
    r, out = f.cli("controller", "--once", "--steps", "0.5,1")
    assert r.exit_code == 1 and "phase=failed" in out and "the step failed" in out, out
    assert _rows(f)[-1].decision == "FAILED"
    assert f.serving() == [("v000000", None, 0.0)] * 3


def test_desired_record_names_bad_fields_and_a_lost_race_on_an_object_store(tiny_moe_dir, fw_home):
    from modelstore.desired import ConflictError

    store = ModelStore(f"memory://fleet-{time.monotonic_ns()}")
    store.init_base(tiny_moe_dir)
    rec = FleetRecord(store)
    assert (rec.read().generation, rec.read().stable) == (0, "v000000")  # derived from the stable record
    for bad, field in (({"weight": 1.5, "candidate": "v000001"}, "weight"), ({"weight": 0.5}, "weight"),
                       ({"stable": "latest"}, "stable"), ({"candidate": "newest"}, "candidate"),
                       ({"candidate": "v000000", "weight": 0.5}, "candidate: v000000 is also the stable"),
                       ({"generation": "12"}, "generation"), ({"generation": True}, "generation"),
                       ({"reload_after_ms": -1}, "reload_after_ms")):
        with pytest.raises(ValueError, match=field):
            rec.change(_with(**bad), "t", "bad")
    assert not rec.exists()  # nothing was written
    store._put_atomic(b'{"generation": 3, "stable": "v000000", "colour": "red"}', "fleet", "desired.json")
    with pytest.raises(ValueError, match="fleet/desired.json: unknown field 'colour'"):
        rec.read()
    # an "intent" left null reads (records carry it as null); a set one is an unknown field
    store._put_atomic(b'{"generation": 3, "stable": "v000000", "intent": null}', "fleet", "desired.json")
    assert (rec.read().generation, rec.read().stable) == (3, "v000000")
    store._put_atomic(b'{"generation": 3, "stable": "v000000", "intent": {"action": "abort"}}', "fleet",
                      "desired.json")
    with pytest.raises(ValueError, match="fleet/desired.json: unknown field 'intent'"):
        rec.read()
    store._put_atomic(b"{not json", "fleet", "desired.json")
    with pytest.raises(ValueError, match="fleet/desired.json: not JSON"):
        rec.read()
    store._put_atomic(DesiredState(generation=3, stable="v000000").to_json(), "fleet", "desired.json")

    def racing(d):  # another writer (no cross-process lock on an object store) wins meanwhile
        FleetRecord(store).change(_with(paused={"actor": "x", "at": 0, "reason": ""}), "other", "pause")
        d.weight = 0.0
        return d
    with pytest.raises(ConflictError, match="generation 3 -> 4"):
        rec.change(racing, "t", "mine")
    assert rec.read().generation == 4 and rec.read().paused["actor"] == "x"


def test_an_unreadable_desired_state_is_an_error_every_command_names(fleet):
    """One NUL byte in fleet/desired.json (found by a hostile trial): pause said "already paused
    by unknown" and exited 0, resume raised a traceback, status showed "0 of 0 pods" and "learner:
    running". Each now names the file, changes nothing and exits 1; status still shows the pods."""
    f = fleet
    raw = f.store._read("fleet", "desired.json")
    f.store._put_atomic(raw[:5] + b"\x00" + raw[6:], "fleet", "desired.json")
    for args in (("pause", "--yes", "--reason", "incident"), ("resume", "--yes")):
        r, out = f.cli(*args)
        assert r.exit_code == 1 and "fleet/desired.json" in out and "nothing was changed" in out, (args, out)
        assert r.exception is None or isinstance(r.exception, SystemExit), (args, r.exception)
    r, out = f.cli("status", *sum((["--serving", f.url(i)] for i in range(3)), []))
    assert r.exit_code == 1 and "desired-state record unreadable" in out and "learner: unknown" in out, out
    assert "running (not paused)" not in out and all(f"127.0.0.1:{p}" in out for p in f.ports), out
    assert f.store._read("fleet", "desired.json")[5:6] == b"\x00"  # nothing written over it
    assert not [d for d in ledger.decisions(f.ledger) if d.decision in ("PAUSE", "RESUME")]


def _serve_process(f, home: Path, name: str) -> tuple[subprocess.Popen, str, Path]:
    """A real `flywheel serve` process on the fleet's store (its own home, no Kafka: events journal)."""
    from flywheel.broker import free_port

    port = free_port()
    log = home.parent / f"{name}.log"
    env = {**os.environ, "FLYWHEEL_HOME": str(home), "FLYWHEEL_STORE": str(f.store.root), "PYTHONPATH": str(REPO),
           "PYTHONUNBUFFERED": "1"}
    env.pop("FLYWHEEL_KAFKA_BOOTSTRAP", None)
    p = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "serve", "--port", str(port), "--pod", name,
                          "--max-batch", "2", "--threads", "1"], cwd=REPO, env=env, stdout=open(log, "ab"),
                         stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            r = httpx.get(url + "/admin/slots", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
            if r.status_code == 200:
                return p, url, log
        except httpx.HTTPError:
            pass  # not up yet
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise AssertionError(f"pod process did not start: {log.read_text()[-3000:]}")
        time.sleep(0.3)


def test_an_operator_command_returns_by_its_timeout_with_a_sigstopped_pod(fleet, tmp_path):
    """A pod process stopped with SIGSTOP accepts connections and never answers. With no
    controller running, `flywheel rollback --to ... --timeout 8` (each call's own bound left at
    its 120 s default) returns by its --timeout with exit 1, a line for every pod (the stopped
    one NOT converged, timeout), and the ledger rows; once the pod resumes (SIGCONT) it
    converges by itself, through its own watch of the record."""
    import signal

    f = fleet
    p, url, log = _serve_process(f, tmp_path / "pod-s-home", "pod-s")
    try:
        FleetRecord(f.store).change(_with(pods=[f.url(0), f.url(1), url]), "test", "pods")
        os.killpg(p.pid, signal.SIGSTOP)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("FLYWHEEL_SERVING_TIMEOUT_S", None)
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "flywheel.cli", "rollback", "--to", "v000001", "--yes",
                            "--timeout", "8"], cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
        took = time.monotonic() - t0
        out = " ".join((r.stdout + r.stderr).split())
        assert r.returncode == 1, out
        assert took < 45, took  # --timeout 8 plus the CLI's start on a busy box; never the stopped pod's 120 s
        assert f"({url}): NOT converged (timeout)" in out and "no answer by the deadline (--timeout 8 s)" in out, out
        gen = FleetRecord(f.store).read().generation
        for i in (0, 1):
            assert f"ok pod-{i} ({f.url(i)}): converged (generation {gen}): stable v000001" in out, out
        assert "not converged" in out and "2 of 3 pods serve it" in out and "stable is now" not in out, out
        rows = _rows(f, "MANUAL_ROLLBACK", "FLEET_NOT_CONVERGED")[-2:]
        assert [x.decision for x in rows] == ["MANUAL_ROLLBACK", "FLEET_NOT_CONVERGED"]
        assert rows[-1].numbers["pods"]["by_pod"][url]["outcome"] == "timeout"
        os.killpg(p.pid, signal.SIGCONT)  # no controller: the pod's own watch (--desired-poll 2 s) converges it
        a = ServingAdmin(url, TOKEN, timeout_s=30)
        deadline = time.monotonic() + 90
        while a.desired_state().generation != gen and time.monotonic() < deadline:
            time.sleep(0.5)
        st = a.desired_state()
        assert (st.generation, st.converged, st.slots.stable.version) == (gen, True, "v000001")
        a.close()
    finally:
        try:
            os.killpg(p.pid, signal.SIGCONT)
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            p.kill()


@pytest.mark.parametrize("cmd", [("rollback",), ("canary", "abort")])
def test_dropping_a_candidate_that_changed_meanwhile_is_refused(fleet, monkeypatch, cmd):
    """`rollback` (with a candidate) and `canary abort` share one 'drop the candidate' path: when
    the record's candidate changed between the command's read and its change (here: while the
    operator was confirming, the canary of v000001 ended and one of v000002 began), nothing is
    dropped or marked, and the refusal is recorded."""
    import deploy.commands as commands

    f = fleet
    publish_v(f.store, "v000001")  # v000002
    rec = FleetRecord(f.store)
    rec.change(_with(candidate="v000001", weight=0.25), "controller", "canary start")

    def confirm_late(what, yes):  # the record moves on while the operator reads the prompt
        rec.change(_with(candidate="v000002", weight=0.05), "controller", "canary start")
    monkeypatch.setattr(commands, "_confirm", confirm_late)
    statuses = {v: f.store.manifest(v).status_history[-1].status for v in ("v000001", "v000002")}
    r, out = f.cli(*cmd, "--yes", "--timeout", "5")
    assert r.exit_code == 1 and "the desired state changed meanwhile" in out and "candidate now v000002" in out, out
    d = rec.read()
    assert (d.candidate, d.weight) == ("v000002", 0.05)
    assert {v: f.store.manifest(v).status_history[-1].status for v in statuses} == statuses
    decision = "MANUAL_ROLLBACK" if cmd == ("rollback",) else "MANUAL_CANARY_ABORT"
    assert _rows(f)[-1].decision == f"{decision}_FAILED"


def test_a_controller_with_an_unreadable_record_logs_one_line_and_leaves_the_pods(fleet, tmp_path, caplog):
    """fleet/desired.json damaged: the controller stays up and calls no pod; it logs one ERROR
    naming the file (no traceback), not one per poll, and one INFO once the record reads again.
    `controller --once` exits 1 naming the file."""
    import logging

    from deploy.controller import RolloutController

    f = fleet
    before = f.serving()
    raw = f.store._read("fleet", "desired.json")
    f.store._put_atomic(raw[:5] + b"\x00" + raw[6:], "fleet", "desired.json")
    ctl = RolloutController(f.store, list(f.admins), tmp_path / "samples", f.ledger, tmp_path / "rollout.json",
                            arm_metrics=False)
    polls = {"n": 0, "serving": None}

    def stop() -> bool:
        polls["n"] += 1
        if polls["n"] == 6:  # repaired after five polls
            polls["serving"] = f.serving()
            f.store._put_atomic(raw, "fleet", "desired.json")
        return polls["n"] > 7
    with caplog.at_level(logging.INFO, logger="deploy.controller"):
        ctl.run_forever(0.0, stop=stop)
    recs = [r for r in caplog.records if r.name == "deploy.controller"]
    errors = [r for r in recs if r.levelno >= logging.WARNING]
    path = f"{f.store.root}/fleet/desired.json"
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR and errors[0].exc_info is None, \
        [r.getMessage() for r in errors]
    assert path in errors[0].getMessage() and "not JSON" in errors[0].getMessage()
    assert [r.getMessage() for r in recs if "readable again" in r.getMessage()] == \
        [f"desired-state record {path} readable again: reconciling"]
    assert polls["serving"] == before  # no pod changed while the record was unreadable
    f.store._put_atomic(raw[:5] + b"\x00" + raw[6:], "fleet", "desired.json")
    r, out = f.cli("controller", "--once")
    assert r.exit_code == 1 and "fleet/desired.json: not JSON" in out, out
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception


def _ledger_beside_the_record() -> bool:
    """Whether ``schemas.settings.ledger_path()`` puts the ledger on the store's shared storage
    (``fleet/ledger.duckdb`` beside the desired-state record) rather than in ``$FLYWHEEL_HOME``."""
    from unittest import mock

    with mock.patch.dict(os.environ, {"FLYWHEEL_HOME": "/h", "FLYWHEEL_STORE": "/s"}):
        return settings.ledger_path() == Path("/s/fleet/ledger.duckdb")


@pytest.mark.skipif(not _ledger_beside_the_record(), reason="schemas.settings.ledger_path() still resolves to "
                    "$FLYWHEEL_HOME (the fleet ledger beside the desired-state record is D78's settings change)")
def test_a_rollback_from_a_second_machines_home_is_in_the_controllers_ledger_and_status(fleet, fw_home, tmp_path,
                                                                                     monkeypatch):
    """An operator on another machine (its own FLYWHEEL_HOME, the store shared through
    FLYWHEEL_STORE) rolls back: the row is in the one ledger the controller writes and reads, so
    `flywheel status` run from the controller's home shows it and the controller does not
    redo or undo it."""
    f = fleet
    r, out = f.cli("controller", "--once", "--steps", "0.5,1", "--min-votes", "5")  # the controller's canary
    assert r.exit_code == 0 and "phase=canary candidate=v000001" in out, out
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path / "laptop-home"))
    r, out = f.cli("rollback", "--yes", "--actor", "remote-ann", "--reason", "from the laptop")
    assert r.exit_code == 0 and "dropped candidate v000001" in out, out
    assert not (tmp_path / "laptop-home" / "ledger.duckdb").exists()
    monkeypatch.setenv("FLYWHEEL_HOME", str(fw_home))  # back on the controller's machine
    row = [d for d in ledger.decisions(settings.ledger_path()) if d.decision == "MANUAL_ROLLBACK"][-1]
    assert (row.version, row.actor, row.numbers["why"]) == ("v000001", "remote-ann", "from the laptop")
    seen = [d for d in ledger.decisions(settings.ledger_path()) if d.decision == "FLEET_CONVERGED"][-1]
    assert seen.numbers["generation"] == row.numbers["generation"] and seen.numbers["pods"]["converged"] == 3
    r, out = f.cli("status", "--json")
    j = json.loads(r.output)
    assert any(d["decision"] == "MANUAL_ROLLBACK" and d["actor"] == "remote-ann" for d in j["decisions"]), j
    assert j["rollout"]["phase"] == "aborted", j["rollout"]
    r, out = f.cli("controller", "--once", "--steps", "0.5,1", "--min-votes", "5")
    assert r.exit_code == 0 and "phase=aborted" in out, out  # not restarted, not resynced back
    assert f.serving() == [("v000000", None, 0.0)] * 3
