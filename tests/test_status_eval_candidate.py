"""``flywheel status`` names a candidate held at 0 % for what it is: the demo's fixed eval puts
each version in the fleet record's candidate slot at weight 0 (no user sent to it) with the
controller stopped, and once the stopped controller's heartbeat is older than
``$FLYWHEEL_CONTROLLER_SEEN_S`` plus its ``--poll-s``, status says the candidate is held at 0 %
naming the record's last change (the eval's, until a later change replaces it; the record keeps
only its last change, so the line never calls it the one that put the candidate there) and that
a controller started now would open a canary of it, not that a canary is in progress; ``-o json``
holds it as ``candidate_held``. A candidate at a weight > 0
with no controller keeps the "canary in progress" warning word for word.

Real parts: a serving pod (torch engine, tiny MoE) watching the record of a real model store,
the real ``flywheel.demo.Demo._eval_candidate`` (the change the eval makes, through
``deploy.operator.run_action``), the real deploy CLI in-process, a real DuckDB ledger, the
controller's heartbeat written by ``FleetRecord.beat`` with its time set 71 s back. Expected
lines are written out here from the rule they state (times formatted from the record's and the
heartbeat's own ms, the limit 60 s + the heartbeat's 5 s poll).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from datetime import datetime, timezone

from deploy.status import controller_seen, controller_warning, gather_status
from flywheel.demo import EVAL_ACTOR
from modelstore.desired import HEARTBEAT_FILE, FleetRecord
from schemas.events import now_ms
from tests.test_demo_eval_record import _slots, rig  # noqa: F401 - fixture
from tests.test_oncall_messages import _cli

AGE_S = 71  # the stopped controller's heartbeat age: past 60 s ($FLYWHEEL_CONTROLLER_SEEN_S default) + 5 s poll
EVAL_REASON = ("fixed eval: v000001 in the candidate slot at 0 % of users, asked the fixed prompts by id "
               "(no user is sent to it)")


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%m-%d %H:%M:%S")


def _stale_beat(store) -> tuple[dict, str, float]:
    """The stopped controller's heartbeat, written AGE_S s in the past with --poll-s 5; returns
    it, the file's path and the monotonic time it was written (for the age's upper bound)."""
    b = {"at": now_ms() - AGE_S * 1000, "host": socket.gethostname(), "pid": os.getpid(), "poll_s": 5.0,
         "error": None}
    FleetRecord(store).beat(b)
    return b, f"{store.root}/{'/'.join(HEARTBEAT_FILE)}", time.monotonic()


def _age(line: str, t0: float) -> int:
    """The age the line states, checked against the heartbeat's: AGE_S s plus what passed since."""
    m = re.search(r"no controller has been seen for (\d+) s: ", line)
    assert m, line
    age = int(m.group(1))
    assert AGE_S <= age <= AGE_S + time.monotonic() - t0 + 1, (age, line)
    return age


def test_a_candidate_held_at_0_by_the_fixed_eval_is_named_as_such(rig):
    demo, store, url, _ = rig
    changed, ok, how = demo._eval_candidate("v000001")  # the eval's own change of the record
    assert (changed, ok) == (True, True), how
    assert _slots(url) == ("v000000", "v000001", 0.0)
    d = FleetRecord(store).read()
    assert (d.candidate, d.weight, d.actor, d.action, d.reason) == ("v000001", 0.0, EVAL_ACTOR, "fixed eval",
                                                                    EVAL_REASON)
    b, beat, t0 = _stale_beat(store)

    s = gather_status([url])
    assert s.err is None and [dr for _, _, _, dr in s.rows] == [[]], (s.err, s.rows)
    assert len(s.warnings) == 1, s.warnings
    held = (f"the candidate v000001 is held at 0 % (no user is sent to it); the record's last change was flywheel "
            f'demo\'s "fixed eval" (generation {d.generation} at {_utc(d.updated_ms)} UTC: {EVAL_REASON}), not '
            "necessarily the one that put the candidate there")

    def line(age: int) -> str:
        return (f"{held}; no controller has been seen for {age} s: its last heartbeat ({beat}, {b['host']} pid "
                f"{b['pid']}, at {_utc(b['at'])} UTC) is older than 65 s ($FLYWHEEL_CONTROLLER_SEEN_S plus its "
                "--poll-s): a controller started now would open a canary of it")
    assert s.warnings == [line(_age(s.warnings[0], t0))]

    # -o json: the same line, and the held candidate in a field of its own
    cli = _cli()
    r, _ = cli("status", "-o", "json")
    doc = json.loads(r.output)
    assert r.exit_code == 0, r.output
    assert doc["candidate_held"] == {"version": "v000001", "weight": 0.0,
                                     "last_change": {"generation": d.generation, "actor": EVAL_ACTOR,
                                                     "action": "fixed eval", "reason": EVAL_REASON,
                                                     "updated_ms": d.updated_ms}}
    assert len(doc["warnings"]) == 1 and doc["warnings"] == [line(_age(doc["warnings"][0], t0))]
    assert doc["controller"]["running"] is False
    # the table: the line, never "a canary in progress"
    r, out = cli("status")
    assert r.exit_code == 0, out
    assert f"warning: {held}; no controller has been seen for " in out, out
    assert "a controller started now would open a canary of it" in out, out
    assert "in progress" not in out, out

    # no heartbeat at all (no controller ever ran): the same line with that reason
    (store.root / HEARTBEAT_FILE[0] / HEARTBEAT_FILE[1]).unlink()
    assert gather_status([url]).warnings == [
        f"{held}; no controller has run: {beat} (the heartbeat `flywheel controller` writes at every poll) does not "
        "exist: a controller started now would open a canary of it"]

    # a long reason with a line break is quoted on one line, cut to 120 characters
    def hold(x):
        x.candidate, x.weight = "v000001", 0.0
        return x
    long = "word " * 30 + "\nsecond line"
    d2 = FleetRecord(store).change(hold, "oncall-noa", "fixed eval", long)
    w = controller_warning(controller_seen(FleetRecord(store), 60.0), FleetRecord(store).read())
    quoted = ("word " * 30 + "second line")[:117] + "..."
    assert w.startswith(f"the candidate v000001 is held at 0 % (no user is sent to it); the record's last change was "
                        f'oncall-noa\'s "fixed eval" (generation {d2.generation} at {_utc(d2.updated_ms)} UTC: '
                        f"{quoted}), not necessarily the one that put the candidate there; no controller has run: "), w

    # a controller seen running: nothing to say (it opens the canary itself)
    FleetRecord(store).beat({**b, "at": now_ms()})
    assert controller_warning(controller_seen(FleetRecord(store), 60.0), FleetRecord(store).read()) is None


def test_a_canary_at_a_weight_above_0_keeps_the_in_progress_warning(rig):
    demo, store, url, _ = rig
    cli = _cli()
    r, out = cli("canary", "start", "v000001", "--yes", "--weight", "0.25", "--timeout", "60", "--actor",
                 "oncall-noa")
    assert r.exit_code == 0 and "on all 1 pods" in out, out
    assert _slots(url) == ("v000000", "v000001", 0.25)
    b, beat, t0 = _stale_beat(store)
    r, _ = cli("status", "-o", "json")
    doc = json.loads(r.output)
    assert doc["candidate_held"] is None
    assert len(doc["warnings"]) == 1, doc["warnings"]
    w = doc["warnings"][0]
    age = _age(w, t0)
    assert w == (f"the canary of v000001 is in progress but no controller has been seen for {age} s: its last "
                 f"heartbeat ({beat}, {b['host']} pid {b['pid']}, at {_utc(b['at'])} UTC) is older than 65 s "
                 "($FLYWHEEL_CONTROLLER_SEEN_S plus its --poll-s); it stays at step 0 (25%) until a controller runs: "
                 "start `flywheel controller` (or step it with `flywheel controller --once`), or end it by hand "
                 "(`flywheel promote --yes` / `flywheel canary abort --yes`)")
    assert "held at 0 %" not in cli("status")[1]
