"""One reconciler per pod, one record: a pod takes a declarative target (``PUT /admin/desired``)
and converges to it idempotently, refusing an older generation; operator commands only change
the record and watch; with no controller running a rollback converges through the pods' own
watch of the record.

Real parts: serving pods (torch engine, tiny MoE, uvicorn on their own ports) over one model
store, the real `flywheel` deploy CLI in-process, a real DuckDB ledger. Expected states come
from the target's rule (stable X, candidate Y at w: each pod's /admin/slots says so).
"""

from __future__ import annotations

import time

import httpx
import pytest
import typer
from typer.testing import CliRunner

from deploy import ledger
from deploy.commands import register
from modelstore.desired import DesiredState, FleetRecord
from deploy.serving_client import ServingAdmin
from modelstore.store import ModelStore
from schemas import settings
from serving.commands import build_pod
from servers import ServerThread
from tests.test_deploy_controller import publish_v
from tests.test_fleet import _with

TOKEN = "reconciler-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _serving(url: str) -> tuple:
    s = httpx.get(url + "/admin/slots", headers=AUTH, timeout=30).json()
    return s["stable"]["version"], (s["candidate"] or {}).get("version"), s["candidate_weight"]


@pytest.fixture()
def store(tmp_path, tiny_moe_dir, fw_home):
    st = ModelStore(tmp_path / "store")
    st.init_base(tiny_moe_dir)
    publish_v(st, "v000000")  # v000001
    publish_v(st, "v000001")  # v000002
    return st


def _pod(store, name: str, poll_s: float | None = None):
    pod = build_pod(ModelStore(store.root), pod=name, max_batch=2, admin_token=TOKEN, log_events=False,
                    desired_poll_s=poll_s)
    return pod, ServerThread(pod.app).start()


def test_a_put_target_converges_idempotently_and_an_older_generation_is_refused(store):
    pod, srv = _pod(store, "pod-a")
    url = srv.url
    try:
        put = lambda body, **kw: httpx.put(url + "/admin/desired", json=body, timeout=60, **kw)  # noqa: E731
        r = put({"generation": 5, "stable": "v000000", "candidate": "v000001", "weight": 0.25}, headers=AUTH)
        assert r.status_code == 200, r.text
        j = r.json()
        assert (j["generation"], j["target_generation"], j["converged"]) == (5, 5, True)
        assert j["actions"] == ["load v000001", "weight 0.25"]
        assert _serving(url) == ("v000000", "v000001", 0.25)
        # the same target again: nothing to do
        r = put({"generation": 5, "stable": "v000000", "candidate": "v000001", "weight": 0.25}, headers=AUTH)
        assert r.status_code == 200 and r.json()["actions"] == [] and r.json()["generation"] == 5
        # an older generation: refused, nothing changed
        r = put({"generation": 4, "stable": "v000002"}, headers=AUTH)
        assert r.status_code == 409, r.text
        assert "generation: 4 is older than generation 5" in r.json()["detail"], r.text
        assert _serving(url) == ("v000000", "v000001", 0.25)
        # a newer generation that makes the candidate stable: a pointer flip
        r = put({"generation": 6, "stable": "v000001"}, headers=AUTH)
        assert r.status_code == 200 and r.json()["actions"] == ["promote"], r.text
        assert _serving(url) == ("v000001", None, 0.0)
        g = httpx.get(url + "/admin/desired", headers=AUTH, timeout=30).json()
        assert (g["generation"], g["converged"], g["slots"]["stable"]["version"]) == (6, True, "v000001")
        # a version that cannot be loaded: 409 naming it, slots unchanged, the state says why
        r = put({"generation": 7, "stable": "v000001", "candidate": "v000009", "weight": 0.5}, headers=AUTH)
        assert r.status_code == 409 and "v000009" in r.json()["detail"], r.text
        g = httpx.get(url + "/admin/desired", headers=AUTH, timeout=30).json()
        assert (g["generation"], g["target_generation"], g["converged"]) == (6, 7, False)
        assert "v000009" in g["error"] and _serving(url) == ("v000001", None, 0.0)
        # bad bodies name the field; no token, no change
        r = put({"generation": 8, "stable": "v000001", "weight": 0.5}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "weight", r.text
        r = put({"generation": 8, "stable": "v000000"})
        assert r.status_code == 401 and _serving(url) == ("v000001", None, 0.0)
    finally:
        srv.stop()
        pod.close()


def test_a_reload_asked_with_a_flip_to_the_resident_previous_stable_is_done_in_one_take(store):
    """A target whose stable is the pod's resident previous stable and that asks for a reload
    (``flywheel rollback --to`` it while another rollback is on its way) is reached in one
    take: the flip keeps the resident weights' old load time, so the reload comes after it."""
    pod, srv = _pod(store, "pod-r")
    url = srv.url
    try:
        put = lambda body: httpx.put(url + "/admin/desired", json=body, headers=AUTH, timeout=60)  # noqa: E731
        assert put({"generation": 1, "stable": "v000000", "candidate": "v000001", "weight": 0.5}).status_code == 200
        assert put({"generation": 2, "stable": "v000001"}).json()["actions"] == ["promote"]  # v000000 stays resident
        asked = int(time.time() * 1000)
        r = put({"generation": 3, "stable": "v000000", "reload_after_ms": asked})
        assert r.status_code == 200, r.text
        j = r.json()
        assert j["actions"] == ["rollback to v000000", "reload v000000"], j
        assert (j["generation"], j["converged"]) == (3, True)
        assert j["slots"]["stable"]["version"] == "v000000" and j["slots"]["stable"]["loaded_at"] >= asked
    finally:
        srv.stop()
        pod.close()


def test_a_put_that_is_not_the_records_target_is_refused(store):
    """With a record written, a PUT carries the record's target: one ahead of the record's
    generation (a huge one too) or naming other versions at its generation is refused (409,
    naming fleet/desired.json) and changes nothing; the record's own target is taken."""
    FleetRecord(store).change(_with(stable="v000001"), "test", "rollback")  # generation 1
    FleetRecord(store).change(_with(stable="v000002"), "test", "rollback")  # generation 2
    pod, srv = _pod(store, "pod-g")
    url = srv.url
    try:
        put = lambda body: httpx.put(url + "/admin/desired", json=body, headers=AUTH, timeout=60)  # noqa: E731
        before = _serving(url)
        assert before == ("v000002", None, 0.0)
        for body in ({"generation": 3, "stable": "v000001"}, {"generation": 2**53, "stable": "v000001"},
                     {"generation": 2, "stable": "v000001"}):
            r = put(body)
            assert r.status_code == 409, r.text
            assert "not the fleet record's target: fleet/desired.json is at generation 2" in r.json()["detail"], r.text
            assert _serving(url) == before
        assert put({"generation": 2**53 + 1, "stable": "v000001"}).status_code == 400  # past any record
        g = httpx.get(url + "/admin/desired", headers=AUTH, timeout=30).json()
        assert g["error"] is None and g["target_generation"] <= 2
        r = put({"generation": 2, "stable": "v000002"})  # the record's own target
        assert r.status_code == 200 and r.json()["generation"] == 2, r.text
    finally:
        srv.stop()
        pod.close()


@pytest.fixture()
def watched_fleet(store, monkeypatch):
    """Three pods that watch the record every 0.2 s; no controller; the CLI as the operator."""
    pods = [_pod(store, f"pod-{i}", poll_s=0.2) for i in range(3)]
    urls = [srv.url for _, srv in pods]
    monkeypatch.delenv("FLYWHEEL_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.setenv("FLYWHEEL_STORE", str(store.root))
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", urls[0])
    monkeypatch.setenv("FLYWHEEL_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("USER", "oncall-noa")

    def with_pods(d: DesiredState) -> DesiredState:
        d.pods = urls
        return d
    FleetRecord(store).change(with_pods, "test", "pods")
    app = typer.Typer()
    register(app)

    def cli(*args):
        r = CliRunner().invoke(app, list(args))
        return r, " ".join(r.output.split())
    yield urls, cli
    for pod, srv in pods:
        srv.stop()
        pod.close()


def test_with_no_controller_a_rollback_converges_through_the_pods_watch(watched_fleet, store, monkeypatch):
    """No controller runs: `flywheel rollback --to` changes the record, the pods converge by
    themselves, the command (which never calls a pod's mutating endpoint) sees every pod at the
    new generation and records each pod's outcome."""
    urls, cli = watched_fleet

    def no_put(*_a, **_k):
        raise AssertionError("an operator command called PUT /admin/desired")
    monkeypatch.setattr(ServingAdmin, "put_desired", no_put)
    for a in ("load", "set_weight", "promote", "rollback"):
        monkeypatch.setattr(ServingAdmin, a, no_put)
    r, out = cli("rollback", "--to", "v000002", "--yes", "--timeout", "60")
    assert r.exit_code == 0 and "stable is now v000002 on all 3 pods" in out, out
    gen = FleetRecord(store).read().generation
    assert [_serving(u) for u in urls] == [("v000002", None, 0.0)] * 3
    for u in urls:
        assert f"({u}): converged (generation {gen})" in out, out
    rows = [d for d in ledger.decisions(settings.ledger_path()) if d.decision in ("MANUAL_ROLLBACK", "FLEET_CONVERGED")]
    assert [x.decision for x in rows] == ["MANUAL_ROLLBACK", "FLEET_CONVERGED"]
    assert rows[0].numbers["generation"] == gen
    assert rows[1].numbers["pods"]["converged"] == 3
    assert {p["generation"] for p in rows[1].numbers["pods"]["by_pod"].values()} == {gen}
    # the stable record is derived from the desired-state record, its history too
    rec = store.stable_record()
    assert store.stable() == rec["version"] == "v000002" and rec["generation"] == gen
    assert [h["version"] for h in rec["history"]] == ["v000000", "v000002"]
    r, out = cli("rollback", "--to", "v000000", "--yes", "--timeout", "60")
    assert r.exit_code == 0 and "stable is now v000000 on all 3 pods" in out, out
    assert [_serving(u) for u in urls] == [("v000000", None, 0.0)] * 3


def test_a_canary_started_and_aborted_with_no_controller_reaches_every_pod(watched_fleet, store):
    urls, cli = watched_fleet
    r, out = cli("canary", "start", "v000001", "--yes", "--weight", "0.25", "--timeout", "60")
    assert r.exit_code == 0 and "canary of v000001 at 25% started" in out and "on all 3 pods" in out, out
    assert [_serving(u) for u in urls] == [("v000000", "v000001", 0.25)] * 3
    r, out = cli("canary", "abort", "--yes", "--timeout", "60")
    assert r.exit_code == 0 and "on all 3 pods" in out, out
    assert [_serving(u) for u in urls] == [("v000000", None, 0.0)] * 3
    assert store.manifest("v000001").status_history[-1].status == "aborted"


def test_a_pod_changed_by_hand_keeps_it_until_the_next_generation(watched_fleet, store):
    """The watch acts on each new generation, not on drift: a pod driven by hand through the
    imperative routes (an evaluation session with the controller stopped) keeps what it was
    given until the record changes again, and then converges with the others."""
    urls, cli = watched_fleet
    r, out = cli("rollback", "--to", "v000001", "--yes", "--timeout", "60")
    assert r.exit_code == 0, out
    a = ServingAdmin(urls[1], TOKEN, timeout_s=60)
    try:
        a.load("v000002")  # by hand, past the record
        time.sleep(1.0)  # five of the pod's polls
        assert _serving(urls[1]) == ("v000001", "v000002", 0.0)
        r, out = cli("canary", "start", "v000002", "--yes", "--weight", "0.5", "--timeout", "60")
        assert r.exit_code == 0 and "on all 3 pods" in out, out
        assert [_serving(u) for u in urls] == [("v000001", "v000002", 0.5)] * 3
    finally:
        a.close()


def test_a_record_restored_to_an_older_generation_is_written_again_past_the_pods(watched_fleet, store):
    """The record restored from a backup (or edited) to a generation older than the pods took:
    the pods ignore it, so an operator's rollback writes the record again past the newest
    generation a pod took, and every pod converges; the ledger says so."""
    urls, cli = watched_fleet
    for v in ("v000001", "v000002", "v000001"):  # the pods take generations up to 5
        r, out = cli("rollback", "--to", v, "--yes", "--timeout", "60")
        assert r.exit_code == 0, out
    took = FleetRecord(store).read().generation
    old = FleetRecord(store).read()
    old.generation = 2  # the restored record
    store._put_atomic(old.to_json(), "fleet", "desired.json")
    r, out = cli("rollback", "--to", "v000002", "--yes", "--timeout", "60")
    assert r.exit_code == 0 and "stable is now v000002 on all 3 pods" in out, out
    d = FleetRecord(store).read()
    assert d.generation == took + 1 and d.stable == "v000002"
    assert [_serving(u) for u in urls] == [("v000002", None, 0.0)] * 3
    raised = [x for x in ledger.decisions(settings.ledger_path()) if x.numbers.get("raised_from") is not None]
    assert [(x.numbers["raised_from"], x.numbers["pods_took"], x.numbers["generation"]) for x in raised] == \
        [(3, took, took + 1)]
