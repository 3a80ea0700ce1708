"""What the on-call CLI tells the operator about the fleet, checked on real pods: a canary with
no controller running says so (`flywheel status`, `flywheel canary start`); pods named with
`--serving` become the record's pods; a ledger row says when no pod was watched; an unreadable
record is named and never called "in sync"; a stopped pod has one name (`timeout`) in `status`
and in `rollback`. What a hostile tester fed them (D92): a `--serving` list that does not answer
is never recorded and `--record-pods` replaces the list; a password in `--serving` is refused
before anything is written; a heartbeat or a record with hostile fields is "unreadable", naming
the field, never a crash; two operators at once watch the record's pods; a record replaced by a
directory while a command watches is reported; a heartbeat that cannot be written leaves no temp
file and is logged once; a bad `$FLYWHEEL_CONTROLLER_SEEN_S` is a warning. A second trial (D94): hosts
no client can call and a web server answering 200 with a page are named per pod, never a crash; a
password is masked whatever the parse; markup is printed as it is; a FIFO is unreadable, never a
hang; one pod in several spellings counts once; the record's other fields are type-checked.

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


# -- D94: hostile pod specs, answers, markup and files (a second hostile trial) ----------------

@pytest.mark.parametrize("spec,why", [
    ("http://a..b:18810", "an empty label in the host name (two dots, or a leading dot)"),
    ("http://" + "a" * 100 + ":18810", "a host name label of 100 characters (at most 63)"),
    ("http://" + ".".join(["a" * 60] * 5) + ":1", "a host name of 304 characters (at most 253)"),
    ("http://xn--zz:8000", "the host name label 'xn--zz' is no valid IDNA A-label (Invalid A-label)"),
    ("http://127.0.0.1\x01:18810", "it holds the control or space character '\\x01'"),
    ("http://127.0.0.1\x00:18810", "it holds the control or space character '\\x00'"),
    ("http://999.1.1.1:1", "999.1.1.1 is no IPv4 address"),
    ("http://host:0", "the port '0' is not a number in [1, 65535]"),
    ("http://host:+1", "the port '+1' is not a number in [1, 65535]"),
    ("http://host:", "an empty port (':' with no number)"),
    ("http://host:1?q=1", "a query (?...) is not part of a pod's URL"),
    ("http://host:1#frag", "a fragment (#...) is not part of a pod's URL"),
    ("http://host:1//", "a path ('//') other than / is not part of a pod's URL"),
    ("ftp://[fe80::1]:80", "the scheme is not http:// or https://"),
])
def test_a_pod_spec_with_a_host_no_client_can_call_is_refused_naming_the_reason(spec, why):
    from schemas.pod_target import check_pod_spec
    with pytest.raises(ValueError) as exc:
        check_pod_spec(spec, "pods[3]")
    assert str(exc.value) == f"pods[3]: {spec!r} is not a pod URL http(s)://host:port (or dns+http(s)://name:port): {why}"


def test_good_pod_specs_are_still_accepted():
    from schemas.pod_target import check_pod_spec
    for spec in ("http://127.0.0.1:8000", "http://[::1]:8000", "https://pod-1.ns.svc.cluster.local.:8443",
                 "http://pöd:1", "http://xn--pd-fka:1", "http://pod_1:80/", "HTTP://Pod:1", "https://h",
                 "dns+http://flywheel-serving.default.svc:8000"):
        assert check_pod_spec(spec) == spec


class _NotAPod:
    """A real HTTP server that answers 200 with an HTML page to every request (a web server on
    the port a pod was expected on)."""

    def __enter__(self):
        import http.server
        import threading

        class H(http.server.BaseHTTPRequestHandler):
            def _page(self):
                body = b"<html>[/]not a pod</html>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            do_GET = do_PUT = do_POST = _page

            def log_message(self, *a):
                pass
        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        return self

    def __exit__(self, *a):
        self.srv.shutdown()
        self.srv.server_close()


def test_every_failure_of_one_pod_is_a_serving_admin_error_with_its_kind():
    from deploy.serving_client import ServingAdmin, ServingAdminError
    # hosts httpx or IDNA cannot handle (a client built by hand, past the rule): unreachable, per call
    for url in ("http://a..b:18810", "http://" + "a" * 100 + ":18810", "http://xn--zz:8000",
                "http://127.0.0.1\x01:18810", "http://127.0.0.1\x00:18810"):
        a = ServingAdmin(url, None, 1.0)
        with pytest.raises(ServingAdminError) as exc:
            a.desired_state()
        assert exc.value.kind == "unreachable" and exc.value.status == 0, (url, exc.value)
        assert "invalid URL (" in exc.value.reason, exc.value
        a.close()
    with _NotAPod() as web:
        a = ServingAdmin(web.url, None, 5.0)
        for call in (a.desired_state, a.slots):
            with pytest.raises(ServingAdminError) as exc:
                call()
            assert (exc.value.kind, exc.value.status, exc.value.transport) == ("not_a_pod", 200, True)
            assert str(exc.value).endswith("not a pod: HTTP 200 with a body that is not JSON "
                                           "('<html>[/]not a pod</html>')"), exc.value
        a.close()


def _cli():
    import typer
    from typer.testing import CliRunner

    from deploy.commands import register
    app = typer.Typer()
    register(app)

    def cli(*args):
        r = CliRunner().invoke(app, list(args))
        return r, " ".join(r.output.split())
    return cli


@pytest.fixture()
def bare_fleet(store, monkeypatch):
    """The store's record and the CLI, no pod started (the pods each test names)."""
    monkeypatch.delenv("FLYWHEEL_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.setenv("FLYWHEEL_STORE", str(store.root))
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", DEAD)
    monkeypatch.setenv("USER", "oncall-noa")
    return _cli()


def test_a_web_server_that_is_no_pod_is_named_per_pod_by_status_commands_and_the_controller(bare_fleet, store):
    cli = bare_fleet
    with _NotAPod() as web:
        FleetRecord(store).change(_with(pods=[web.url, DEAD]), "test", "pods")
        r, out = cli("status")
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.exception, out)
        assert f"not_a_pod: serving admin {web.url}/admin/slots: not a pod: HTTP 200 with a body" in out, out
        assert f"serving error: serving admin {web.url}/admin/slots: not a pod: HTTP 200 with a body that is not " \
               "JSON ('<html>[/]not a pod</html>')" in out, out
        assert f"unreachable: serving admin {DEAD}/admin/slots: unreachable" in out, out
        doc = json.loads(cli("status", "-o", "json")[0].output)
        assert [p["drift"] for p in doc["pods"]] == [["not_a_pod"], ["unreachable"]]
        r, out = cli("rollback", "--to", "v000001", "--yes", "--timeout", "0")
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.exception, out)
        assert f"({web.url}): NOT converged (not_a_pod: read state): serving admin {web.url}/admin/desired: " \
               "not a pod" in out, out
        assert _rows("FLEET_NOT_CONVERGED")[-1].numbers["pods"]["by_pod"][web.url]["outcome"] == "not_a_pod"
        r, out = cli("controller", "--once", "--steps", "0.25,1")
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.exception, out)
        # it starts the canary of the newest version; the web server fails it as a transport failure
        assert f"serving pod {web.url} failed while loading v000002 (not_a_pod: serving admin {web.url}/admin/" \
               "desired: not a pod: HTTP 200 with a body that is not JSON ('<html>[/]not a pod</html>')); " \
               "transport failure: v000002 is not marked failed" in out, out
        assert f"pod not converged: ? ({DEAD}): NOT converged (unreachable: read state)" in out, out


SECRET = "hunter2"


@pytest.mark.parametrize("spec,shown", [
    (" http://ops:hunter2@pod:8000", "http://***@pod:8000"),
    ("\thttp://ops:hunter2@pod:8000", "http://***@pod:8000"),
    ("http://ops:hun#ter2@pod:8000", "http://***@pod:8000"),
    ("http://ops:hun/ter2@pod:8000", "http://***@pod:8000"),
    ("http://ops:hun?ter2@pod:8000", "http://***@pod:8000"),
    ("http://ops:hun@ter2@pod:8000", "http://***@pod:8000"),
    ("//ops:hunter2@pod:8000", "//***@pod:8000"),
    ("http:///ops:hunter2@pod:8000", "http://***@pod:8000"),
    ("dns+http://ops:hunter2@svc:8000", "dns+http://***@svc:8000"),
    ("ops:hunter2@pod:8000", "***@pod:8000"),
    ("http://ops:1234#x@pod:8000", "http://***@pod:8000"),  # ambiguous: a fragment or a password?
])
def test_a_password_is_masked_whatever_the_parse_and_the_spec_is_refused(spec, shown):
    from schemas.pod_target import check_pod_spec, redact_spec
    assert redact_spec(spec) == shown
    with pytest.raises(ValueError) as exc:
        check_pod_spec(spec, "pods[0]")
    assert str(exc.value).startswith(f"pods[0]: {shown!r} carries a user name or password"), exc.value
    assert SECRET not in str(exc.value) and "1234" not in str(exc.value)
    # the record's message (what a pod, the controller and status print) masks it too
    for rec in ({"generation": 3, "stable": "v000000", "pods": [spec]}, {"generation": 3, "stable": spec},
                {"generation": 3, "stable": "v000000", spec: 1}):
        with pytest.raises(RecordUnreadable) as exc:
            DesiredState.from_json(json.dumps(rec).encode())
        assert SECRET not in str(exc.value) and "1234" not in str(exc.value), exc.value
        assert str(exc.value).startswith("fleet/desired.json: "), exc.value


def test_markup_in_what_the_operator_or_the_record_gives_is_printed_as_it_is(bare_fleet, store):
    cli = bare_fleet
    for spec in ("http://x:1/[/]", "http://x:1/[bold]", "ftp://[fe80::1]:80"):
        r, out = cli("status", "--serving", spec)
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.exception, out)
        assert f"error: serving: '{spec}' is not a pod URL" in out, out
        r, out = cli("rollback", "--to", "v000001", "--yes", "--timeout", "0", "--serving", spec)
        assert r.exit_code == 2 and f"error: --serving: '{spec}' is not a pod URL" in out, out
    r, out = cli("pause", "--yes", "--actor", "[/]ops[bold]", "--reason", "[/red] maintenance")
    assert r.exit_code == 0 and "learner paused by [/]ops[bold] (fleet desired state" in out, (r.exception, out)
    r, out = cli("pause", "--yes", "--actor", "x")
    assert r.exit_code == 0 and "learner already paused by [/]ops[bold] at " in out, (r.exception, out)
    assert out.endswith(": [/red] maintenance"), out
    r, out = cli("resume", "--yes", "--actor", "[/]")
    assert r.exit_code == 0 and "learner resumed by [/]" in out, (r.exception, out)


def _fifo_guarded(path, fn):
    """``fn()`` in a thread; if it is still blocked on the FIFO ``path`` after 60 s, a writer
    opens the FIFO to release it and the test fails (a reader that blocks on a FIFO)."""
    import threading
    out = {}

    def run():
        try:
            out["r"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            out["exc"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # EOF for the blocked reader
        t.join(10)
        pytest.fail(f"blocked on the FIFO {path}")
    if "exc" in out:
        raise out["exc"]
    return out["r"]


def test_a_fifo_in_place_of_the_heartbeat_or_the_record_is_unreadable_never_a_hang(bare_fleet, store):
    cli = bare_fleet
    FleetRecord(store).change(_with(candidate="v000001", weight=0.25, pods=[DEAD]), "test", "canary")
    beat = store.root / HEARTBEAT_FILE[0] / HEARTBEAT_FILE[1]
    os.mkfifo(beat)
    with pytest.raises(OSError) as exc:
        _fifo_guarded(beat, FleetRecord(store).last_beat)
    assert "not a regular file (a FIFO): not read" in str(exc.value) and str(beat) in str(exc.value)
    r, out = _fifo_guarded(beat, lambda: cli("status"))
    assert f"warning: the canary of v000001 is in progress but its heartbeat {beat} is unreadable " \
           f"([Errno 22] not a regular file (a FIFO): not read: '{beat}')" in out, out
    r, out = _fifo_guarded(beat, lambda: cli("canary", "abort", "--yes", "--timeout", "0"))
    assert FleetRecord(store).read().candidate is None, out
    r, out = _fifo_guarded(beat, lambda: cli("canary", "start", "v000001", "--yes", "--timeout", "0"))
    assert FleetRecord(store).read().candidate == "v000001", out
    assert f"its heartbeat {beat} is unreadable" in out, out
    path = store.root / "fleet" / "desired.json"
    path.unlink()
    os.mkfifo(path)
    r, out = _fifo_guarded(path, lambda: cli("status"))
    assert r.exit_code == 1 and f"desired-state record unreadable: {path}: " in out, out
    assert "not a regular file (a FIFO)" in out and "drift unknown" in out, out


def test_one_pod_in_several_spellings_counts_once():
    from deploy.discovery import unique_specs
    from schemas.pod_target import normalize_spec
    same = ["http://h:1", "HTTP://h:1", "http://h:1/", "http://H:1/#", "http://h:1#"]
    assert unique_specs(same + ["http://h:2"]) == ["http://h:1", "http://h:2"]
    assert {normalize_spec(s) for s in same} == {"http://h:1"}
    assert normalize_spec("http://h:80") == normalize_spec("http://h") == "http://h"
    assert normalize_spec("https://h:443/") == "https://h" and normalize_spec("https://h:80") == "https://h:80"
    assert normalize_spec("http://[::1]:80") == "http://[::1]"
    assert normalize_spec("dns+HTTP://Svc:8000/") == "dns+http://svc:8000"  # a dns+ spec keeps its port
    specs, note = operator.pod_specs(DesiredState(pods=["http://h:1", "http://h:2"]), ["HTTP://h:1/", "http://H:2"], "")
    assert specs == ["http://h:1", "http://h:2"] and note is None


@pytest.mark.parametrize("field,value,why", [
    ("paused", "yes", "paused: must be null or {\"actor\", \"at\", \"reason\"}, got str"),
    ("paused", {"actor": "x", "at": float("nan"), "reason": ""}, "paused.at: must be a whole number in [0, 2**53], "
                                                                  "got nan"),
    ("paused", {"actor": 5, "at": 0}, "paused.actor: must be a string, got int"),
    ("paused", {"at": 0}, "paused.actor: missing"),
    ("paused", {"actor": "x", "at": 0, "why": 1}, "paused: unknown field 'why'"),
    ("actor", 5, "actor: must be a string, got int"),
    ("action", None, "action: must be a string, got NoneType"),
    ("reason", ["x"], "reason: must be a string, got list"),
    ("updated_ms", -1, "updated_ms: must be a whole number in [0, 2**53], got -1"),
    ("updated_ms", 1.5, "updated_ms: must be a whole number in [0, 2**53], got 1.5"),
    ("history", "x", "history: must be a list of stable changes, got str"),
    ("history", [{"at": 0}], "history[0].version: missing"),
    ("history", [{"version": 7}], "history[0].version: must be a version id (a string), got int"),
    ("history", [{"version": "v000000", "at": float("inf")}], "history[0].at: must be a whole number in [0, 2**53], "
                                                               "got inf"),
    ("stable", 5, "stable: must be a version id (a string) or null, got int"),
])
def test_a_record_with_fields_of_the_wrong_type_is_unreadable_naming_the_field(field, value, why):
    raw = json.dumps({"generation": 3, "stable": "v000000", field: value}).encode()
    with pytest.raises(RecordUnreadable) as exc:
        DesiredState.from_json(raw)
    assert str(exc.value) == f"fleet/desired.json: {why}", exc.value


def test_status_on_a_record_with_wrong_types_says_unreadable_and_its_json_is_strict(bare_fleet, store):
    cli = bare_fleet
    FleetRecord(store).change(_with(pods=[DEAD]), "test", "pods")
    path = store.root / "fleet" / "desired.json"
    good = json.loads(path.read_text())

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON output"))
    for field, value, why in (("paused", "yes", "paused: must be null"), ("actor", 5, "actor: must be a string"),
                              ("paused", {"actor": "x", "at": float("nan"), "reason": ""}, "paused.at: must be")):
        path.write_text(json.dumps({**good, field: value}))
        r, out = cli("status")
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.exception, out)
        assert f"error: desired-state record unreadable: {path}: {why}" in out, out
        r, _ = cli("status", "-o", "json")
        doc = strict(r.output)
        assert r.exit_code == 1 and doc["desired"] is None and why in doc["desired_error"], r.output
    from schemas.output import json_safe
    assert json.dumps(json_safe({"a": [float("nan"), 1.5, {"b": float("-inf")}]}), allow_nan=False) == \
        '{"a": [null, 1.5, {"b": null}]}'


def test_every_read_commands_json_and_yaml_write_a_non_finite_number_as_null():
    from schemas.output import Format, dumps
    data = {"mean": float("nan"), "rows": [{"p99": float("inf")}, {"p99": -float("inf")}], "n": 3}
    assert json.loads(dumps(data, Format.json)) == {"mean": None, "rows": [{"p99": None}, {"p99": None}], "n": 3}
    assert dumps(data, Format.yaml).splitlines()[0] == "mean: null"
