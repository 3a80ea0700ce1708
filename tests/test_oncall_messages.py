"""What the on-call CLI tells the operator about the fleet, checked on real pods: a canary with
no controller running says so (`flywheel status`, `flywheel canary start`); pods named with
`--serving` become the record's pods; a ledger row says when no pod was watched; an unreadable
record is named and never called "in sync"; a stopped pod has one name (`timeout`) in `status`
and in `rollback`. What a hostile tester fed them (D92): a `--serving` list that does not answer
is never recorded and `--record-pods` replaces the list; a password in `--serving` is refused
before anything is written; a heartbeat or a record with hostile fields is "unreadable", naming
the field, never a crash; two operators at once watch the record's pods; a record replaced by a
directory while a command watches is reported; a heartbeat that cannot be written leaves no temp
file and is logged once; a bad `$FLYWHEEL_CONTROLLER_SEEN_S` is a warning.

Real parts: serving pods (torch engine, tiny MoE, uvicorn on their own ports, each watching the
record) over one model store, a real `flywheel serve` process stopped with SIGSTOP, the real
deploy CLI in-process, a real DuckDB ledger, the controller's real `--once` step. Expected
texts and numbers come from the rule each message states (ages from the heartbeat's time,
counts from the pods started).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal

import pytest

from deploy import ledger, operator
from deploy.controller import ControllerConfig
from deploy.wiring import ControllerRunConfig, build_controller
from modelstore.desired import HEARTBEAT_FILE, DesiredState, FleetRecord, RecordUnreadable
from schemas import settings
from schemas.events import now_ms
from schemas.pod_target import PodTarget
from tests.test_fleet import _serve_process, _with, fleet  # noqa: F401 - fixtures
from tests.test_reconciler import store, watched_fleet  # noqa: F401 - fixtures

DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port


def _rows(*decisions):
    return [d for d in ledger.decisions(settings.ledger_path()) if d.decision in decisions]


def _no_pods_recorded(store):
    FleetRecord(store).change(_with(pods=[]), "test", "pods")


def _serving(urls):
    return sum((["--serving", u] for u in urls), [])


def _heartbeat(store, raw: bytes | dict):
    store._put_atomic(raw if isinstance(raw, bytes) else json.dumps(raw).encode(), *HEARTBEAT_FILE)


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


def test_a_serving_list_is_recorded_only_when_all_of_it_answers_and_record_pods_replaces_it(watched_fleet, store):
    urls, cli = watched_fleet
    _no_pods_recorded(store)
    # one pod of the list does not answer (a typo'd port): not recorded, and the output says why
    r, out = cli("rollback", "--to", "v000001", "--yes", "--timeout", "0", *_serving([urls[0], DEAD]))
    assert r.exit_code == 1, out
    assert (f"note: --serving {urls[0]}, {DEAD} was not recorded as the fleet's pods: {DEAD} did not answer "
            "(unreachable); it is used for this command only") in out, out
    assert FleetRecord(store).read().pods == [] and not _rows("FLEET_PODS")
    # a headless Service's name that finds no pod: not recorded either
    spec = "dns+http://no-such-pod.invalid:8000"
    r, out = cli("rollback", "--to", "v000002", "--yes", "--timeout", "0", "--serving", spec)
    assert r.exit_code == 1 and f"was not recorded as the fleet's pods: {spec} found no pod (" in out, out
    assert FleetRecord(store).read().pods == []
    # the right list (one URL named twice) answers: recorded once each, in the action's change, with a row
    r, out = cli("rollback", "--to", "v000001", "--yes", "--timeout", "60", *_serving(urls + [urls[1]]))
    assert r.exit_code == 0 and "stable is now v000001 on all 3 pods" in out, out
    d = FleetRecord(store).read()
    assert d.pods == urls and _rows("MANUAL_ROLLBACK")[-1].numbers["generation"] == d.generation
    row = _rows("FLEET_PODS")[-1]
    assert (row.numbers["pods"], row.numbers["was"], row.numbers["replaced"], row.numbers["generation"]) == \
        (urls, [], False, d.generation)
    assert row.reason.endswith(f": the fleet's pods recorded from --serving: {', '.join(urls)} (were none)"), row
    # another list is not used while the record lists pods; --record-pods replaces the list
    r, out = cli("rollback", "--to", "v000002", "--yes", "--timeout", "60", "--serving", urls[0])
    assert r.exit_code == 0 and "is not that list and is not used" in out and "on all 3 pods" in out, out
    assert FleetRecord(store).read().pods == urls
    r, out = cli("rollback", "--to", "v000001", "--yes", "--timeout", "60", "--record-pods",
                 *_serving([urls[0], urls[2]]))
    assert r.exit_code == 0 and "stable is now v000001 on all 2 pods" in out, out
    d = FleetRecord(store).read()
    assert d.pods == [urls[0], urls[2]]
    row = _rows("FLEET_PODS")[-1]
    assert (row.numbers["pods"], row.numbers["was"], row.numbers["replaced"], row.numbers["generation"]) == \
        ([urls[0], urls[2]], urls, True, d.generation)
    # --record-pods needs the list to record
    gen = d.generation
    r, out = cli("rollback", "--to", "v000002", "--yes", "--record-pods")
    assert r.exit_code == 2 and "--record-pods: needs --serving" in out, out
    assert FleetRecord(store).read().generation == gen


def test_a_password_in_serving_is_refused_before_anything_is_written(watched_fleet, store):
    urls, cli = watched_fleet
    _no_pods_recorded(store)
    gen, rows = FleetRecord(store).read().generation, len(ledger.decisions(settings.ledger_path()))
    host = urls[0].removeprefix("http://")
    for args in (["rollback", "--to", "v000001"], ["canary", "start", "v000001"], ["promote"]):
        r, out = cli(*args, "--yes", "--timeout", "0", "--serving", urls[1], "--serving", f"http://ops:hunter2@{host}")
        assert r.exit_code == 2, out
        assert f"error: --serving: 'http://***@{host}' carries a user name or password" in out, out
        assert "hunter2" not in out and "ops:" not in out, out
    assert FleetRecord(store).read().generation == gen and FleetRecord(store).read().pods == []
    assert len(ledger.decisions(settings.ledger_path())) == rows  # no row either
    r, out = cli("status", "--serving", f"http://ops:hunter2@{host}")  # a read: refused the same way
    assert r.exit_code == 2 and f"serving: 'http://***@{host}' carries a user name or password" in out, out
    assert "hunter2" not in out, out


HOUR_MS = 3_600_000


def _beat(**kw):
    return {"at": now_ms() - HOUR_MS, "host": "ctl-host", "pid": 4242, "poll_s": 5.0, "error": None, **kw}


def _raw_beat(at: str, **kw) -> bytes:
    """A heartbeat whose ``at`` is written as the JSON text ``at`` (numbers json.dumps cannot write)."""
    return json.dumps(_beat(at=0, **kw)).replace('"at": 0', f'"at": {at}').encode()


# (heartbeat, why it is unreadable): each reason derived from the bound it breaks
HOSTILE_BEATS = [
    (_beat(at=-99999999999999999), "at: before the epoch (negative)"),
    (_raw_beat("1" + "0" * 400), "at: dated more than 10**12 s in the future, beyond the 300 s clock skew allowed"),
    (_raw_beat("1e30"), "at: must be a whole number of ms since the epoch, got float"),
    (_beat(at=now_ms() + 3650 * 86_400_000 + 60_000),
     "at: dated 3650 days in the future, beyond the 300 s clock skew allowed"),
    (_raw_beat(str(now_ms()), poll_s="x").replace(b'"x"', b"Infinity"),
     "poll_s: must be a finite number of seconds in [0, 86400], got inf"),
    (_raw_beat(str(now_ms()), poll_s="x").replace(b'"x"', b"NaN"),
     "poll_s: must be a finite number of seconds in [0, 86400], got nan"),
    (_beat(poll_s=-1000), "poll_s: must be a finite number of seconds in [0, 86400], got -1000"),
    (_beat(poll_s=10 ** 9), "poll_s: must be a finite number of seconds in [0, 86400], got 1e+09"),
    (_beat(host="h" * 256), "host: 256 characters (at most 255)"),
    (_beat(pid=-1), "pid: must be a whole number in [0, 2**53], got int -1"),
    (_beat(host="x" * 70_000), "larger than 65536 bytes (a heartbeat is a few hundred): not read"),
]


def test_a_hostile_heartbeat_is_unreadable_naming_the_field_never_a_crash(watched_fleet, store):
    urls, cli = watched_fleet
    beat = f"{store.root}/{'/'.join(HEARTBEAT_FILE)}"
    FleetRecord(store).change(_with(candidate="v000001", weight=0.25), "test", "canary")
    for hb, why in HOSTILE_BEATS:
        _heartbeat(store, hb)
        with pytest.raises(ValueError) as exc:
            FleetRecord(store).last_beat()
        assert str(exc.value) == f"fleet/controller.json: {why}", (why, exc.value)
    for hb, why in HOSTILE_BEATS[:5]:  # the ones that crashed `status` (ValueError, OverflowError) or hid it
        _heartbeat(store, hb)
        r, out = cli("status")
        assert r.exit_code == 0 and r.exception is None, (why, out)
        assert (f"warning: the canary of v000001 is in progress but its heartbeat {beat} is unreadable "
                f"(fleet/controller.json: {why})") in out, (why, out)
        r, _ = cli("status", "-o", "json")
        doc = json.loads(r.output)
        assert doc["controller"]["running"] is False and doc["controller"]["error"] == f"fleet/controller.json: {why}"
        assert "NaN" not in r.output and "Infinity" not in r.output and len(r.output) < 20_000
    # rich markup in the host is printed as it is
    _heartbeat(store, _beat(host="[/red]evil[bold]"))
    r, out = cli("status")
    assert r.exit_code == 0 and r.exception is None, out
    assert f"its last heartbeat ({beat}, [/red]evil[bold] pid 4242, at " in out, out
    # dated ahead within the clock skew allowed: running, no warning
    _heartbeat(store, _beat(at=now_ms() + 60_000))
    doc = json.loads(cli("status", "-o", "json")[0].output)
    assert doc["controller"]["running"] is True and doc["controller"]["age_s"] == 0 and not doc["warnings"]


def test_canary_start_never_fails_on_the_controller_warning_after_its_change(watched_fleet, store, monkeypatch):
    urls, cli = watched_fleet
    _heartbeat(store, _beat(at=-99999999999999999))
    r, out = cli("canary", "start", "v000001", "--yes", "--weight", "0.25", "--timeout", "60")
    assert r.exit_code == 0 and "on all 3 pods" in out, out
    assert "is unreadable (fleet/controller.json: at: before the epoch (negative))" in out, out
    r, out = cli("canary", "abort", "--yes", "--timeout", "60")
    assert r.exit_code == 0, out

    def broken(self, now=None):
        raise RuntimeError("the store fell over")
    monkeypatch.setattr(FleetRecord, "last_beat", broken)
    r, out = cli("canary", "start", "v000001", "--yes", "--weight", "0.25", "--timeout", "60")
    assert r.exit_code == 0 and "on all 3 pods" in out, out
    assert "is unreadable (RuntimeError: the store fell over)" in out, out
    assert FleetRecord(store).read().candidate == "v000001"


@pytest.mark.parametrize("pods,why", [
    ("a string", "pods: must be a list of pod specs (http(s):// URLs or dns+http(s):// specs), got str"),
    ({"a": 1}, "pods: must be a list of pod specs (http(s):// URLs or dns+http(s):// specs), got dict"),
    ([""], "pods[0]: '' is not a pod URL http(s)://host:port (or dns+http(s)://name:port)"),
    (["file:///etc/passwd"], "pods[0]: 'file:///etc/passwd' is not a pod URL http(s)://host:port (or "
                             "dns+http(s)://name:port)"),
    ([5], "pods[0]: must be a pod URL (a string), got int '5'"),
    ([None], "pods[0]: must be a pod URL (a string), got NoneType 'None'"),
    ([["x"]], "pods[0]: must be a pod URL (a string), got list \"['x']\""),
    (["http://127.0.0.1:1", "http://ops:pw@h:1"], "pods[1]: 'http://***@h:1' carries a user name or password"),
])
def test_a_record_with_hostile_pods_is_unreadable_naming_the_entry(pods, why):
    raw = json.dumps({"generation": 3, "stable": "v000000", "pods": pods}).encode()
    with pytest.raises(RecordUnreadable) as exc:
        DesiredState.from_json(raw)
    assert str(exc.value).startswith(f"fleet/desired.json: {why}"), exc.value


def test_status_and_an_action_on_a_record_with_hostile_pods_name_the_record(watched_fleet, store):
    urls, cli = watched_fleet
    path = store.root / "fleet" / "desired.json"
    for pods, why in (("a string", "pods: must be a list"), ([5], "pods[0]: must be a pod URL (a string), got int")):
        raw = json.loads(path.read_bytes())
        raw["pods"] = pods
        path.write_text(json.dumps(raw))
        r, out = cli("status")
        assert r.exit_code == 1 and isinstance(r.exception, (SystemExit, type(None))), (r.exception, out)
        assert f"error: desired-state record unreadable: {path}: {why}" in out and "error: serving" not in out, out
        r, out = cli("rollback", "--to", "v000001", "--yes", "--timeout", "0")
        assert r.exit_code == 1 and f"fleet desired-state record unreadable: fleet/desired.json: {why}" in out, out


def test_two_operators_at_once_watch_the_pods_the_record_names(watched_fleet, store, monkeypatch):
    urls, cli = watched_fleet
    _no_pods_recorded(store)
    real = FleetRecord.change

    def b_records_first(self, fn, actor, action, *a, **kw):
        """Operator B records the fleet's three pods just before A's change takes the lock."""
        if action.startswith("manual rollback") and not self.read().pods:
            real(self, _with(pods=urls), "operator-b", "pods", "b's --serving")
        return real(self, fn, actor, action, *a, **kw)
    monkeypatch.setattr(FleetRecord, "change", b_records_first)
    r, out = cli("rollback", "--to", "v000001", "--yes", "--timeout", "60", "--serving", urls[0])
    assert r.exit_code == 0 and "stable is now v000001 on all 3 pods" in out, out
    assert (f"note: acting on the fleet's pods {', '.join(urls)} (recorded in its desired state by the controller "
            f"or an earlier command); --serving {urls[0]} is not that list and is not used") in out, out
    assert FleetRecord(store).read().pods == urls
    assert _rows("FLEET_CONVERGED")[-1].numbers["pods"]["pods"] == 3


def test_a_record_replaced_by_a_directory_while_watching_is_reported(watched_fleet, store, monkeypatch):
    urls, cli = watched_fleet
    FleetRecord(store).change(_with(pods=[DEAD]), "test", "pods")  # a pod that never converges: the watch goes on
    path = store.root / "fleet" / "desired.json"
    real = operator.observe_pods_generation

    def then_a_directory(*a, **kw):
        out = real(*a, **kw)
        if path.is_file():
            path.unlink()
            path.mkdir()
        return out
    monkeypatch.setattr(operator, "observe_pods_generation", then_a_directory)
    r, out = cli("rollback", "--to", "v000001", "--yes", "--timeout", "30")
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.exception, out)
    assert f"the desired-state record {path} became unreadable while watching: " in out and "directory" in out, out
    end = _rows("FLEET_NOT_CONVERGED")[-1]
    assert "became unreadable while watching" in end.numbers["discovery_error"], end


def test_a_heartbeat_that_cannot_be_written_leaves_no_temp_file_and_is_logged_once(store, monkeypatch, caplog):
    monkeypatch.delenv("FLYWHEEL_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.setenv("FLYWHEEL_STORE", str(store.root))
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", DEAD)
    fleet_dir = store.root / "fleet"
    (fleet_dir / "controller.json").mkdir(parents=True)  # os.replace onto a directory fails at every poll
    ctl = build_controller(ControllerRunConfig(), ControllerConfig(steps=(0.25, 1.0)), 1.0)
    with caplog.at_level(logging.WARNING, logger="deploy.controller"):
        for _ in range(3):
            ctl.beat(5.0)
    assert [p.name for p in fleet_dir.iterdir() if ".tmp-" in p.name] == []
    logged = [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()]
    assert len(logged) == 1 and ".tmp-" not in logged[0], logged
    assert f"{fleet_dir / 'controller.json'}" in logged[0], logged


def test_a_bad_controller_seen_variable_is_a_warning_not_a_refusal(watched_fleet, store, monkeypatch):
    urls, cli = watched_fleet
    monkeypatch.setenv("FLYWHEEL_CONTROLLER_SEEN_S", "soon")
    warn = "FLYWHEEL_CONTROLLER_SEEN_S: must be a number of seconds > 0, got 'soon'; using the default 60 s"
    r, out = cli("status")
    assert r.exit_code == 0 and f"warning: {warn}" in out, out
    assert warn in json.loads(cli("status", "-o", "json")[0].output)["warnings"]
    r, out = cli("canary", "start", "v000001", "--yes", "--weight", "0.25", "--timeout", "60")
    assert r.exit_code == 0 and "on all 3 pods" in out and f"warning: {warn}" in out, out
