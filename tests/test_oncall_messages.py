"""What the on-call CLI tells the operator about the fleet, checked on real pods: a canary with
no controller running says so (`flywheel status`, `flywheel canary start`); pods named with
`--serving` become the record's pods; a ledger row says when no pod was watched; an unreadable
record is named and never called "in sync"; a stopped pod has one name (`timeout`) in `status`
and in `rollback`.

Real parts: serving pods (torch engine, tiny MoE, uvicorn on their own ports, each watching the
record) over one model store, a real `flywheel serve` process stopped with SIGSTOP, the real
deploy CLI in-process, a real DuckDB ledger, the controller's real `--once` step. Expected
texts and numbers come from the rule each message states (ages from the heartbeat's time,
counts from the pods started).
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from deploy import ledger
from deploy.controller import ControllerConfig
from deploy.wiring import ControllerRunConfig, build_controller
from modelstore.desired import HEARTBEAT_FILE, DesiredState, FleetRecord
from schemas import settings
from schemas.pod_target import PodTarget
from tests.test_fleet import _serve_process, _with, fleet  # noqa: F401 - fixtures
from tests.test_reconciler import store, watched_fleet  # noqa: F401 - fixtures

DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port


def _rows(*decisions):
    return [d for d in ledger.decisions(settings.ledger_path()) if d.decision in decisions]


def _no_pods_recorded(store):
    FleetRecord(store).change(_with(pods=[]), "test", "pods")


def test_a_canary_with_no_controller_running_is_flagged_until_one_runs(watched_fleet, store):
    urls, cli = watched_fleet
    r, out = cli("canary", "start", "v000001", "--yes", "--weight", "0.25", "--timeout", "60")
    assert r.exit_code == 0 and "on all 3 pods" in out, out
    beat = f"{store.root}/{'/'.join(HEARTBEAT_FILE)}"
    assert f"warning: the canary of v000001 is in progress but no controller has run: {beat}" in out, out
    assert "it stays at step 0 (25%) until a controller runs" in out, out
    r, out = cli("status")
    assert "warning: the canary of v000001 is in progress but no controller has run" in out, out
    r, out = cli("status", "-o", "json")
    doc = json.loads(r.output)
    assert doc["controller"]["running"] is False and doc["controller"]["heartbeat"] is None
    # one step of the real controller (a CronJob's `--once`) writes its heartbeat: no warning
    r, out = cli("controller", "--once", "--steps", "0.25,1", "--min-votes", "5")
    assert r.exit_code == 0 and "phase=canary candidate=v000001 step=0" in out, out
    hb = json.loads((store.root / HEARTBEAT_FILE[0] / HEARTBEAT_FILE[1]).read_text())
    assert (hb["pid"], hb["poll_s"], hb["error"]) == (os.getpid(), None, None)
    r, out = cli("status")
    assert "no controller" not in out, out
    doc = json.loads(cli("status", "-o", "json")[0].output)
    assert doc["controller"]["running"] is True and doc["controller"]["heartbeat"]["at"] == hb["at"]
    # the loop writes it too, with its --poll-s, after every step
    ctl = build_controller(ControllerRunConfig(), ControllerConfig(steps=(0.25, 1.0)), 3.0)
    polls = iter([False, True])
    ctl.run_forever(0.0, stop=lambda: next(polls))
    loop = json.loads((store.root / HEARTBEAT_FILE[0] / HEARTBEAT_FILE[1]).read_text())
    assert (loop["poll_s"], loop["error"]) == (0.0, None) and loop["at"] >= hb["at"]
    # the --once heartbeat ten minutes old: past the declared 60 s (no --poll-s for --once)
    hb["at"] -= 600_000
    store._put_atomic(json.dumps(hb).encode(), *HEARTBEAT_FILE)
    r, out = cli("status")
    m = re.search(r"no controller has been seen for (\d+) s: its last heartbeat \(([^,]+), ", out)
    assert m and 600 <= int(m.group(1)) < 900 and m.group(2) == beat, out
    assert "older than 60 s ($FLYWHEEL_CONTROLLER_SEEN_S plus its --poll-s)" in out, out
    # the canary ended: nothing to warn about
    r, out = cli("canary", "abort", "--yes", "--timeout", "60")
    assert r.exit_code == 0 and "no controller" not in out, out
    assert "no controller" not in cli("status")[1]


def test_pods_named_with_serving_become_the_records_pods(watched_fleet, store, monkeypatch):
    urls, cli = watched_fleet
    _no_pods_recorded(store)
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", DEAD)  # the default is not one of the pods
    r, out = cli("rollback", "--to", "v000001", "--yes", "--timeout", "60", *sum((["--serving", u] for u in urls), []))
    assert r.exit_code == 0 and "stable is now v000001 on all 3 pods" in out, out
    d = FleetRecord(store).read()
    assert d.pods == urls
    assert _rows("MANUAL_ROLLBACK")[-1].numbers["generation"] == d.generation  # written with the action
    # status and the next command, with no --serving, reach the recorded pods
    r, out = cli("status", "-o", "json")
    doc = json.loads(r.output)
    assert r.exit_code == 0 and [p["url"] for p in doc["pods"]] == urls and doc["converged"] is True, r.output
    r, out = cli("rollback", "--to", "v000002", "--yes", "--timeout", "60")
    assert r.exit_code == 0 and "on all 3 pods" in out, out
    # a --serving that differs from the recorded pods is not used and does not replace them
    r, out = cli("rollback", "--to", "v000001", "--yes", "--timeout", "60", "--serving", urls[0])
    assert r.exit_code == 0 and "is not that list and is not used" in out and "on all 3 pods" in out, out
    assert FleetRecord(store).read().pods == urls


def test_the_ledger_says_how_many_pods_converged_or_that_none_was_watched(watched_fleet, store):
    urls, cli = watched_fleet
    r, out = cli("rollback", "--to", "v000001", "--yes", "--timeout", "60")
    assert r.exit_code == 0, out
    act, end = _rows("MANUAL_ROLLBACK", "FLEET_CONVERGED")[-2:]
    why = "manual rollback of stable v000000 to v000001 by oncall-noa"
    assert (act.decision, act.reason) == ("MANUAL_ROLLBACK", why)  # written before any pod was watched
    assert (end.decision, end.reason) == ("FLEET_CONVERGED", f"{why} (3 of 3 pods converged)")
    # no pod to watch: a headless Service's name that does not resolve (RFC 6761 .invalid)
    _no_pods_recorded(store)
    spec = "dns+http://no-such-pod.invalid:8000"
    r, out = cli("rollback", "--to", "v000002", "--yes", "--timeout", "0", "--serving", spec)
    assert r.exit_code == 1 and "no pod to watch (" in out and "0 of 0" not in out, out
    act, end = _rows("MANUAL_ROLLBACK", "FLEET_NOT_CONVERGED")[-2:]
    why = "manual rollback of stable v000001 to v000002 by oncall-noa"
    assert (act.decision, act.reason) == ("MANUAL_ROLLBACK", why)
    assert end.decision == "FLEET_NOT_CONVERGED" and end.numbers["pods"]["pods"] == 0
    assert end.reason.startswith(f"{why} (no pod to watch: ") and "no-such-pod.invalid" in end.reason, end.reason
    assert not [x for x in ledger.decisions(settings.ledger_path()) if "0 of 0" in x.reason]


@pytest.mark.parametrize("damage", ["not json", "a directory"])
def test_status_names_an_unreadable_record_and_calls_no_pod_in_sync(watched_fleet, store, damage):
    urls, cli = watched_fleet
    r, out = cli("rollback", "--to", "v000001", "--yes", "--timeout", "60")
    assert r.exit_code == 0, out
    path = store.root / "fleet" / "desired.json"
    if damage == "not json":
        path.write_bytes(b"{\x00")
        reason = "not JSON"
    else:
        path.unlink()
        path.mkdir()
        reason = "Is a directory"
    serving = sum((["--serving", u] for u in urls), [])
    r, out = cli("status", *serving)
    assert r.exit_code == 1, out
    assert f"desired-state record unreadable: {path}: " in out and reason in out, out
    assert "in sync" not in out and "serve the desired state" not in out and "drift unknown" in out, out
    r, _ = cli("status", "-o", "json", *serving)
    doc = json.loads(r.output)
    assert r.exit_code == 1 and doc["converged"] is None and str(path) in doc["desired_error"], r.output
    assert [p["url"] for p in doc["pods"]] == urls and all(p["slots"] for p in doc["pods"])


def test_a_stopped_pod_is_a_timeout_in_status_and_in_rollback(fleet, tmp_path):
    f = fleet
    p, url, _ = _serve_process(f, tmp_path / "pod-s-home", "pod-s")
    try:
        FleetRecord(f.store).change(_with(pods=[f.url(0), url]), "test", "pods")
        os.killpg(p.pid, signal.SIGSTOP)  # accepts connections, never answers
        r, out = f.cli("status", "--serving-timeout-s", "1")
        assert r.exit_code == 1, out
        row = rf"{re.escape(url)}[ │]+timeout: serving admin {re.escape(url)}/admin/slots: no answer within 1 s"
        assert re.search(row, out) and "unreachable" not in out, out
        doc = json.loads(f.cli("status", "--serving-timeout-s", "1", "-o", "json")[0].output)
        assert [p_["drift"] for p_ in doc["pods"] if p_["url"] == url] == [["timeout"]]
        r, out = f.cli("rollback", "--to", "v000000", "--yes", "--timeout", "3")
        assert r.exit_code == 1 and f"({url}): NOT converged (timeout): no answer by the deadline" in out, out
        assert "unreachable" not in out and "hung)" not in out, out
        assert _rows("FLEET_NOT_CONVERGED")[-1].numbers["pods"]["by_pod"][url]["outcome"] == "timeout"
    finally:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        p.wait(30)


def test_the_record_and_a_pod_target_refuse_inconsistent_fields_with_one_message():
    cases = [(dict(stable="v000001", candidate=None, weight=0.5), "weight: 0.5 with no candidate"),
             (dict(stable="v000001", candidate="v000001", weight=0.5), "candidate: v000001 is also the stable version")]
    for fields, msg in cases:
        with pytest.raises(ValueError) as rec:
            DesiredState(generation=3, **fields).validate()
        with pytest.raises(ValueError) as pod:
            PodTarget(generation=3, **fields)
        assert str(rec.value) == msg and msg in str(pod.value), (rec.value, pod.value)
