"""The demo's fixed eval goes through the fleet's desired-state record: each version other than
the stable is put in the candidate slot at weight 0 by a change of the record (as the operator
commands change it), the pod loads it by its own watch of the record, and ``flywheel status``
(``deploy.status.gather_status``) finds the pod serving the record while the version is asked;
at the end the record's candidate slot is emptied and the pod agrees.

Real parts: a serving pod (torch engine, tiny MoE, uvicorn on a free port) watching the record
of a real model store, the real ``flywheel.demo.Demo`` (its workload's fixed prompts), a real
DuckDB ledger. Expected states come from the rule (the version asked is the record's
candidate at 0 %, every pod's slots say the same), not from the code under test.
"""

from __future__ import annotations

import io
import os
import socket

import httpx
import pytest
from rich.console import Console

from deploy import ledger
from deploy.controller import current_status
from deploy.status import gather_status
from deploy.wiring import rollout_status_path
from flywheel.demo import EVAL_ACTOR, Demo
from flywheel.demo_config import DemoConfig
from modelstore.desired import FleetRecord
from modelstore.store import ModelStore
from schemas import settings
from schemas.events import now_ms
from serving.commands import build_pod
from servers import ServerThread
from tests.test_deploy_controller import publish_v

TOKEN = "demo-eval-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _slots(url: str) -> tuple:
    s = httpx.get(url + "/admin/slots", headers=AUTH, timeout=30).json()
    return s["stable"]["version"], (s["candidate"] or {}).get("version"), s["candidate_weight"]


@pytest.fixture()
def rig(tmp_path, tiny_moe_dir, fw_home, monkeypatch):
    """A store with v000000 (stable) and two children of it, v000001 and v000002; one pod watching its record every
    0.2 s; the heartbeat the demo's controller leaves when it is stopped; a demo of two fixed
    prompts pointed at them."""
    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    publish_v(store, "v000000")
    publish_v(store, "v000000", scale=1.0002)  # a child of v000000 too: damaging v000001 leaves it whole
    monkeypatch.setenv("FLYWHEEL_STORE", str(store.root))
    monkeypatch.setenv("FLYWHEEL_ADMIN_TOKEN", TOKEN)
    monkeypatch.delenv("FLYWHEEL_KAFKA_BOOTSTRAP", raising=False)
    pod = build_pod(ModelStore(store.root), pod="pod-0", max_batch=2, admin_token=TOKEN, log_events=False,
                    desired_poll_s=0.2)
    srv = ServerThread(pod.app).start()
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", srv.url)
    # the demo's controller ran until the eval stopped it: its last heartbeat is seconds old
    FleetRecord(store).beat({"at": now_ms(), "host": socket.gethostname(), "pid": os.getpid(), "poll_s": 5.0,
                             "error": None})
    cfg = DemoConfig(out=tmp_path / "out", families=("basic_arithmetic",), family_weights=None,
                     fixed_per_family=2, fixed_humaneval=0, concurrency=2, max_tokens_short=4)
    out = io.StringIO()
    demo = Demo(cfg, console=Console(file=out, width=300))
    demo.store, demo.url = ModelStore(store.root), srv.url
    try:
        yield demo, store, srv.url, out
    finally:
        srv.stop()
        pod.close()


def test_the_fixed_eval_puts_each_version_in_the_record_and_status_shows_no_drift(rig):
    demo, store, url, out = rig
    gen0 = FleetRecord(store).read().generation
    seen: dict[str, dict] = {}

    def check(v: str) -> None:  # once the pod serves v, before its prompts are asked
        s = gather_status([url])
        seen[v] = {"desired": (s.desired.stable, s.desired.candidate, s.desired.weight, s.desired.action,
                               s.desired.actor), "slots": _slots(url), "drift": [dr for _, _, _, dr in s.rows],
                   "converged": s.to_dict()["converged"], "warnings": s.warnings, "err": s.err}

    rows = demo.fixed_eval(on_version=check)

    # each version is asked with the record saying so: the stable as stable, the others as the
    # candidate at 0 % (no user is sent to it); the pod serves exactly that, so no drift
    assert seen["v000000"]["desired"][:3] == ("v000000", None, 0.0)
    assert seen["v000000"]["slots"] == ("v000000", None, 0.0)
    for v in ("v000001", "v000002"):
        assert seen[v]["desired"] == ("v000000", v, 0.0, "fixed eval", EVAL_ACTOR), seen[v]
        assert seen[v]["slots"] == ("v000000", v, 0.0), seen[v]
    for v, got in seen.items():
        assert got["drift"] == [[]] and got["converged"] is True, (v, got)
        assert got["warnings"] == [] and got["err"] is None, (v, got)

    # every version answered both fixed prompts, each reply from the version asked
    assert sorted((r["version"], r["key"]) for r in rows) == sorted(
        (v, t.key) for v in ("v000000", "v000001", "v000002") for t in demo.fixed)

    # after the eval: the record's candidate slot is empty and the pod agrees
    d = FleetRecord(store).read()
    assert (d.stable, d.candidate, d.weight, d.action) == ("v000000", None, 0.0, "fixed eval done")
    assert d.generation == gen0 + 3  # two versions put in, one emptying: each one change of the record
    assert _slots(url) == ("v000000", None, 0.0)
    s = gather_status([url])
    assert [dr for _, _, _, dr in s.rows] == [[]] and s.to_dict()["converged"] is True and s.warnings == []

    # the ledger holds the pods' convergence (rows no rollout status or final decision reads)
    rows_l = [e for e in ledger.decisions(settings.ledger_path()) if e.actor == EVAL_ACTOR]
    assert [(e.decision, e.version) for e in rows_l] == [("FLEET_CONVERGED", "v000001"),
                                                          ("FLEET_CONVERGED", "v000002"),
                                                          ("FLEET_CONVERGED", "v000002")]
    assert all(e.numbers["pods"]["converged"] == 1 for e in rows_l)
    assert current_status(rollout_status_path(), settings.ledger_path()).candidate is None
    assert ledger.Ledger(settings.ledger_path()).final_decision("v000001") is None
    assert "fixed eval: candidate slot emptied" in out.getvalue()


def test_a_version_the_pod_cannot_load_is_left_out_and_taken_out_of_the_record(rig):
    """v000001's payload is damaged: the pod refuses it (checksum), the eval logs it, empties the
    candidate slot in the record again and goes on with v000002; no drift remains."""
    demo, store, url, out = rig
    p = store.root / "versions" / "v000001" / "payload.bin"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    p.write_bytes(bytes(raw))
    asked: list[str] = []
    rows = demo.fixed_eval(on_version=asked.append)
    assert asked == ["v000000", "v000002"]
    assert {r["version"] for r in rows} == {"v000000", "v000002"}
    log = " ".join(out.getvalue().split())
    assert "fixed eval: v000001 did not load" in log and "refused" in log, log
    d = FleetRecord(store).read()
    assert (d.candidate, d.weight) == (None, 0.0)
    assert _slots(url) == ("v000000", None, 0.0)
    s = gather_status([url])
    assert [dr for _, _, _, dr in s.rows] == [[]] and s.warnings == []
