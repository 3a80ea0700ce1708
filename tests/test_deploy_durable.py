"""Operator actions are durable (issue 11, defect 4): whatever sequence of promote, rollback
and rollback --to an operator runs, a restarted pod serves what the pod served before.

The pod is a real serving app (torch engine, tiny MoE, uvicorn on its own port) over a real
model store; actions go through the real `flywheel` deploy CLI. After each sequence the
restart is checked with the function the pod runs at start (``default_version`` on a
freshly opened store); one sequence (the one in the issue) restarts a real `flywheel serve`
subprocess. The expected stable after each action comes from a reference model of the
rules (promote: the candidate; rollback: the last earlier stable not rolled back since;
rollback --to X: X), written here independently of the implementation.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
import typer
from typer.testing import CliRunner

from deploy import ledger
from deploy.commands import register
from deploy.serving_client import ServingAdmin
from modelstore.store import ModelStore
from flywheel.broker import free_port
from schemas import settings
from serving.commands import build_pod, default_version
from servers import ServerThread
from tests.test_deploy_controller import publish_v

TOKEN = "durable-admin"
ACTIONS = ("promote", "rollback", "rollback --to v000000", "rollback --to v000001")


def _cli():
    app = typer.Typer()
    register(app)
    return app


def _publish_chain(store: ModelStore, n: int) -> None:
    parent = "v000000"
    for i in range(n):
        parent = publish_v(store, parent, scale=1.0 + 0.001 * (i + 1)).version


class Reference:
    """What stable must be after each action, by the rules alone."""

    def __init__(self):
        self.history = ["v000000"]  # stables in order
        self.bad: set[str] = set()  # rolled back since they were stable
        self.next = 1

    @property
    def stable(self) -> str:
        return self.history[-1]

    def apply(self, action: str) -> str | None:
        """The new stable, or None when the action must be refused (stable unchanged)."""
        cur = self.stable
        if action == "promote":
            new = f"v{self.next:06d}"
            self.next += 1
        elif action == "rollback":
            new = next((v for v in reversed(self.history) if v != cur and v not in self.bad), None)
            if new is None:
                return None
        else:
            new = action.rsplit(" ", 1)[1]
        if new != cur and action != "promote":
            self.bad.add(cur)
        self.bad.discard(new)
        self.history.append(new)
        return new


@pytest.fixture()
def pod_env(tmp_path, tiny_moe_dir, monkeypatch):
    template = tmp_path / "template"
    store = ModelStore(template)
    store.init_base(tiny_moe_dir)
    _publish_chain(store, 3)  # v000001..v000003, each a delta on the one before
    root = tmp_path / "store"
    shutil.copytree(template, root)
    monkeypatch.delenv("FLYWHEEL_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.setenv("FLYWHEEL_STORE", str(root))
    monkeypatch.setenv("FLYWHEEL_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("USER", "oncall-carol")
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path / "home0"))
    pod = build_pod(ModelStore(root), pod="durable", max_batch=2, admin_token=TOKEN, log_events=False,
                    desired_poll_s=0.2)  # the pod converges to the record by itself: no controller runs here
    srv = ServerThread(pod.app).start()
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", srv.url)
    admin = ServingAdmin(srv.url, TOKEN, timeout_s=60)
    ns = type("PodEnv", (), {})()
    ns.template, ns.root, ns.pod, ns.srv, ns.admin, ns.tmp = template, root, pod, srv, admin, tmp_path
    ns.digest = {v: store.manifest(v).weights_digest for v in store.versions()}
    yield ns
    admin.close()
    srv.stop()
    pod.close()


def desire_candidate(root, version: str, weight: float = 0.0) -> None:
    """Put ``version`` in the fleet's desired state as the candidate (what a canary start does)."""
    from modelstore.desired import FleetRecord

    def fn(d):
        d.candidate, d.weight = version, weight
        return d
    FleetRecord(ModelStore(root)).change(fn, "test", "candidate")


def _reset(e, monkeypatch, i: int) -> None:
    """Fresh store files, ledger and home; the pod back on v000000 with no candidate."""
    for name in ("versions", "stable.json", "fleet"):
        p = e.root / name
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    shutil.copytree(e.template / "versions", e.root / "versions")
    shutil.copy2(e.template / "stable.json", e.root / "stable.json")
    monkeypatch.setenv("FLYWHEEL_HOME", str(e.tmp / f"home{i}"))
    rec = e.pod.watch.reconciler  # the record was removed under the pod: as a restarted pod, it has taken none
    with rec._lock:
        rec.target, rec.generation, rec.error = None, 0, None
    e.admin.rollback("v000000")
    s = e.admin.slots()
    assert s.stable.version == "v000000" and s.candidate is None


def _run(e, action: str, ref: Reference) -> bool:
    """Run ``action`` as the operator would; False when there was nothing to run."""
    run = CliRunner().invoke
    if action == "promote":
        if f"v{ref.next:06d}" == ref.stable:  # the record refuses a candidate that is the stable: nothing to do
            ref.apply(action)
            return False
        desire_candidate(e.root, f"v{ref.next:06d}")
        r = run(_cli(), ["promote", "--yes", "--reason", "seq test"])
    else:
        r = run(_cli(), action.split() + ["--yes"])
    want = ref.apply(action)
    if want is None:
        assert r.exit_code == 1 and "no earlier stable version" in " ".join(r.output.split()), r.output
    else:
        assert r.exit_code == 0, (action, r.output)
    return True


def test_every_sequence_of_operator_actions_survives_a_restart(pod_env, monkeypatch):
    e = pod_env
    # every sequence of up to 3 actions of the three kinds (rollback --to the base), less the
    # length-3 ones whose first action leaves the fresh pod's stable where it was (a refused
    # rollback, rollback --to v000000): they reach the state of their 2-action suffix, which
    # is in the set; and every sequence of up to 2 that also rolls "back" to v000001
    # (promoted earlier, or never)
    seqs = [s for n in (1, 2) for s in itertools.product(ACTIONS[:3], repeat=n)]
    seqs += [("promote", *s) for s in itertools.product(ACTIONS[:3], repeat=2)]
    seqs += [s for n in (1, 2) for s in itertools.product(ACTIONS, repeat=n) if ACTIONS[3] in s]
    assert len(seqs) == 3 + 9 + 9 + 8
    t0 = time.monotonic()
    for i, seq in enumerate(seqs):
        _reset(e, monkeypatch, i)
        ref = Reference()
        ran = 0
        for action in seq:
            ran += _run(e, action, ref)
            served = e.admin.slots().stable
            assert served.version == ref.stable, (seq, action, served.version)
            assert served.weights_digest == e.digest[ref.stable] and served.digest_ok
        # restart: the version a pod starts on, read from a freshly opened store
        assert default_version(ModelStore(e.root)) == ref.stable, seq
        rows = [d for d in ledger.decisions(settings.ledger_path())  # this sequence's decisions
                if not d.decision.startswith("FLEET_")]
        assert len(rows) == ran and all(r.actor == "oncall-carol" for r in rows), seq
    assert time.monotonic() - t0 < 600


def test_issue_sequence_with_a_real_flywheel_serve_restart(pod_env, tiny_moe_dir):
    """Load v2, promote, roll back --to v000000, restart `flywheel serve`: it serves v000000."""
    e = pod_env
    run = CliRunner().invoke
    desire_candidate(e.root, "v000001")
    assert run(_cli(), ["promote", "--yes"]).exit_code == 0
    desire_candidate(e.root, "v000002")
    assert run(_cli(), ["promote", "--yes"]).exit_code == 0
    r = run(_cli(), ["rollback", "--to", "v000000", "--yes", "--reason", "v2 answers worse", "--actor", "dave"])
    assert r.exit_code == 0, r.output
    assert e.admin.slots().stable.version == "v000000"
    # v000001 was promoted once and never rolled back: the old rule would have picked it
    assert ModelStore(e.root).manifest("v000001").status_history[-1].status == "promoted"
    last = [d for d in ledger.decisions(settings.ledger_path()) if not d.decision.startswith("FLEET_")][-1]
    assert (last.decision, last.version, last.actor) == ("MANUAL_ROLLBACK", "v000000", "dave")
    assert "v2 answers worse" in last.reason and last.numbers["why"] == "v2 answers worse"
    e.srv.stop()  # the pod goes away ...
    port = free_port()
    env = dict(os.environ, FLYWHEEL_MODEL_DIR=str(tiny_moe_dir), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "serve", "--port", str(port),
                             "--store", str(e.root), "--pod", "restarted", "--max-batch", "2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:  # ... and a real `flywheel serve` starts on the same store
        deadline = time.monotonic() + 120
        while True:
            try:
                s = httpx.get(url + "/admin/slots", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=2)
                if s.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "flywheel serve did not answer in 120 s"
            time.sleep(0.3)
        stable = s.json()["stable"]
        assert stable["version"] == "v000000" and stable["weights_digest"] == e.digest["v000000"]
        assert stable["digest_ok"] is True
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
