"""Feedback serving derives from chat traffic (serving/signals.py): ``regenerate`` when a user
sends the same messages again within the window, ``followup`` when a served reply comes back
in the user's next request, judged by a pluggable judge (default: the documented rules).

The detector is pure: hand-worked cases with explicit times. One end-to-end test runs a real
uvicorn server over the tiny MoE and a real Tansu broker and reads the events back from
``flywheel.feedback``. Expected event ids are computed here from the documented formula
(``uuid5(namespace, f"{kind}:{earlier completion}:{later turn id}")``, the turn id being the
digest of the later request's messages, 128 bits of sha256 of the canonical JSON
``[[role, text, extras], ...]``, written as a UUID)."""

from __future__ import annotations

import hashlib
import json
import uuid

import httpx
import pytest

from schemas.settings import topic_names
from schemas.events import FeedbackEvent, hash_user
from serving.config import ServeConfig
from serving.signals import SIGNAL_NAMESPACE, SignalDetector, rule_judge

T0 = 1_700_000_000_000  # ms
ALICE, BOB = hash_user("alice", "salt"), hash_user("bob", "salt")
Q = [{"role": "user", "content": "What is 2 + 2?"}]
NS = uuid.UUID("6f1c0d2e-8a4b-5c3d-9e7f-0a1b2c3d4e5f")  # the contract's namespace, written out

def key(messages: list[dict]) -> str:
    """The documented messages digest, computed here on its own."""
    canon = [[m["role"], m.get("content") or "", {}] for m in messages]
    blob = json.dumps(canon, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def eid(kind: str, earlier: uuid.UUID | str, later_messages: list[dict]) -> uuid.UUID:
    """uuid5(namespace, "kind:earlier:later turn id"), the turn id being the digest as a UUID."""
    digest = key(later_messages)
    turn = "-".join((digest[:8], digest[8:12], digest[12:16], digest[16:20], digest[20:]))
    return uuid.uuid5(NS, f"{kind}:{earlier}:{turn}")


def det(**kw) -> SignalDetector:
    args = {"regenerate": True, "followup": True, "window_s": 600.0, "max_remembered": 1000, **kw}
    return SignalDetector(**args)


def cid(n: int) -> uuid.UUID:
    return uuid.UUID(int=n)


def follow(reply: str, next_message: str, question: list[dict] = Q) -> list[dict]:
    return question + [{"role": "assistant", "content": reply}, {"role": "user", "content": next_message}]


def test_the_namespace_is_the_contracts():
    assert SIGNAL_NAMESPACE == NS


# ---------------------------------------------------------------------------- regenerate
def test_regenerate_within_the_window_marks_the_earlier_completion():
    d = det()
    assert d.observe(ALICE, Q, cid(1), "4", T0, "r1") == []
    evs = d.observe(ALICE, Q, cid(2), "Four.", T0 + 60_000, "r2")
    assert len(evs) == 1
    ev = evs[0]
    assert (ev.kind, ev.completion_id, ev.value, ev.user_hash) == ("regenerate", cid(1), 1.0, ALICE)
    assert ev.created_at == T0 + 60_000 and ev.metadata == {"source": "serving"}
    assert ev.event_id == eid("regenerate", cid(1), Q)
    FeedbackEvent.model_validate_json(ev.to_bytes())  # a valid event on the wire


def test_regenerate_window_edges_user_and_messages():
    d = det(window_s=600.0)
    d.observe(ALICE, Q, cid(1), "4", T0, "r1")
    assert [e.completion_id for e in d.observe(ALICE, Q, cid(2), "4", T0 + 600_000, "r2")] == [cid(1)]  # edge: in
    d = det(window_s=600.0)
    d.observe(ALICE, Q, cid(1), "4", T0, "r1")
    assert d.observe(ALICE, Q, cid(2), "4", T0 + 600_001, "r2") == []  # 1 ms outside
    d = det()
    d.observe(ALICE, Q, cid(1), "4", T0, "r1")
    assert d.observe(BOB, Q, cid(2), "4", T0 + 1_000, "r2") == []  # another user
    other = [{"role": "user", "content": "What is 2 + 3?"}]
    assert d.observe(ALICE, other, cid(3), "5", T0 + 2_000, "r3") == []  # other messages
    sys_q = [{"role": "system", "content": "Be brief."}] + Q
    assert d.observe(ALICE, sys_q, cid(4), "4", T0 + 3_000, "r4") == []  # one more message is other messages


def test_choices_of_one_request_and_a_retry_with_its_request_id_regenerate_nothing_twice():
    d = det()
    # request r1 with n = 2: its choices never regenerate each other
    assert d.observe(ALICE, Q, cid(1), "a", T0, "r1") == []
    assert d.observe(ALICE, Q, cid(2), "b", T0, "r1") == []
    # r2 regenerates both choices of r1, once (its second choice finds the same events)
    evs = d.observe(ALICE, Q, cid(3), "c", T0 + 10_000, "r2")
    assert sorted(e.completion_id.int for e in evs) == [1, 2]
    assert {e.event_id for e in evs} == {eid("regenerate", cid(1), Q), eid("regenerate", cid(2), Q)}
    assert d.observe(ALICE, Q, cid(4), "d", T0 + 10_000, "r2") == []
    # r2 again with its x-request-id (a transport retry): the same events, already emitted
    assert d.observe(ALICE, Q, cid(5), "e", T0 + 11_000, "r2") == []
    # r3 regenerates the latest earlier request (r2's three completions), not r1's
    evs = d.observe(ALICE, Q, cid(6), "f", T0 + 20_000, "r3")
    assert sorted(e.completion_id.int for e in evs) == [3, 4, 5]


def test_a_second_pod_derives_the_same_event_id():
    """Two detectors (two pods) that saw the same history give the same ids: the join
    counts the event once whichever pod (or retry) published it."""
    a, b = det(), det()
    for d in (a, b):
        d.observe(ALICE, Q, cid(1), "4", T0, "r1")
    ea = a.observe(ALICE, Q, cid(2), "4", T0 + 5_000, "r2")
    eb = b.observe(ALICE, Q, cid(9), "4", T0 + 7_000, "r2-retry-on-b")
    assert [e.event_id for e in ea] == [e.event_id for e in eb] == [eid("regenerate", cid(1), Q)]


# ---------------------------------------------------------------------------- follow-up
@pytest.mark.parametrize("next_message,value", [("That's wrong.", -1.0), ("Thanks, that works!", 1.0)])
def test_followup_dissatisfied_and_satisfied(next_message, value):
    d = det()
    d.observe(ALICE, Q, cid(1), "The answer is 4.", T0, "r1")
    later = follow(" The answer is\n4. ", next_message)  # the client trimmed nothing, re-wrapped: same reply
    evs = d.observe(ALICE, later, cid(2), "ok", T0 + 30_000, "r2")
    assert len(evs) == 1
    ev = evs[0]
    assert (ev.kind, ev.completion_id, ev.value, ev.user_hash, ev.created_at) == \
        ("followup", cid(1), value, ALICE, T0 + 30_000)
    assert ev.metadata == {"source": "serving"} and ev.event_id == eid("followup", cid(1), later)
    # a retry of the same follow-up (new request id) on this pod: the follow-up is not
    # emitted again (same id); the retry is itself a regenerate of the follow-up's completion
    again = d.observe(ALICE, later, cid(3), "ok", T0 + 31_000, "r3")
    assert [(e.kind, e.completion_id) for e in again] == [("regenerate", cid(2))]
    # another pod that served the same reply derives the follow-up with the same id
    b = det()
    b.observe(ALICE, Q, cid(1), "The answer is 4.", T0, "r1")
    assert [e.event_id for e in b.observe(ALICE, later, cid(7), "x", T0 + 40_000, "r7")] == [ev.event_id]


def test_followup_with_no_judgement_or_no_match_emits_nothing():
    d = det()
    d.observe(ALICE, Q, cid(1), "The answer is 4.", T0, "r1")
    assert d.observe(ALICE, follow("The answer is 4.", "And 3 + 3?"), cid(2), "6", T0 + 1_000, "r2") == []
    assert d.observe(BOB, follow("The answer is 4.", "wrong"), cid(3), "x", T0 + 2_000, "r3") == []  # not Bob's
    assert d.observe(ALICE, follow("The answer is 5.", "wrong"), cid(4), "x", T0 + 3_000, "r4") == []  # not served
    late = d.observe(ALICE, follow("The answer is 4.", "wrong, again"), cid(5), "x", T0 + 600_001, "r5")
    assert late == []  # outside the window


def test_only_a_user_message_right_after_the_last_assistant_message_is_judged():
    t = SignalDetector.turn(Q + [{"role": "assistant", "content": "4"},
                                 {"role": "tool", "content": "{}", "tool_call_id": "c1"}])
    assert t.reply_key is None  # an agent's tool result, not a person's reply
    t = SignalDetector.turn(Q + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                                 {"role": "user", "content": "wrong"}])
    assert t.reply_key is None  # nothing to match: a reply with tool calls only
    parts = [{"type": "text", "text": "no, "}, {"type": "text", "text": "wrong"}]
    t = SignalDetector.turn(follow("first", "thanks") + [{"role": "assistant", "content": "second"},
                                                         {"role": "user", "content": parts}])
    assert (t.reply, t.next_message, t.question) == ("second", "no, wrong", "thanks")


def test_the_judge_is_pluggable_and_its_answer_checked():
    seen = []

    def judge(reply, next_message, question):
        seen.append((reply, next_message, question))
        return -1 if "hmm" in next_message else None

    d = det(judge=judge)
    d.observe(ALICE, Q, cid(1), "The answer is 4.", T0, "r1")
    evs = d.observe(ALICE, follow("The answer is 4.", "hmm"), cid(2), "x", T0 + 1_000, "r2")
    assert [(e.kind, e.value) for e in evs] == [("followup", -1.0)]
    assert seen == [("The answer is 4.", "hmm", "What is 2 + 2?")]
    # "thanks" means nothing to this judge: no event where the default rules give +1
    d.observe(ALICE, Q, cid(3), "Four.", T0 + 2_000, "r3")
    assert d.observe(ALICE, follow("Four.", "thanks"), cid(4), "x", T0 + 3_000, "r4") == []
    bad = det(judge=lambda r, n, q: 0)  # an answer that is no verdict: no event, counted
    bad.observe(ALICE, Q, cid(1), "The answer is 4.", T0, "r1")
    assert bad.observe(ALICE, follow("The answer is 4.", "x"), cid(2), "x", T0 + 1_000, "r2") == []
    assert bad.judge_errors == 1


@pytest.mark.parametrize("judge", [lambda r, n, q: 1 / 0, lambda r, n, q: True, lambda r, n, q: "+1"])
def test_a_failing_judge_costs_only_its_followup(judge, caplog):
    """A judge that raises or answers nonsense: the same request's regenerate is still
    emitted (once), the follow-up is not, the failure is logged and counted, and the detector
    goes on judging later turns."""
    d = det(judge=judge)
    d.observe(ALICE, Q, cid(1), "The answer is 4.", T0, "r1")
    later = follow("The answer is 4.", "thanks")
    assert d.observe(ALICE, later, cid(2), "You're welcome.", T0 + 1_000, "r2") == []  # the follow-up: not judged
    # the same messages again: a regenerate of cid 2 (the follow-up of cid 1 fails again)
    evs = d.observe(ALICE, later, cid(3), "Any time.", T0 + 2_000, "r3")
    assert [(e.kind, e.completion_id, e.event_id) for e in evs] == [("regenerate", cid(2), eid("regenerate", cid(2), later))]
    assert d.judge_errors == 2 and "follow-up judge failed" in caplog.text
    d.judge = rule_judge
    d.observe(ALICE, Q, cid(4), "Four.", T0 + 3_000, "r4")
    assert [(e.kind, e.value) for e in d.observe(ALICE, follow("Four.", "thanks"), cid(5), "x", T0 + 4_000, "r5")] == [
        ("followup", 1.0)]


@pytest.mark.parametrize("next_message,question,value", [
    ("That's wrong.", None, -1), ("that\u2019s not right", None, -1), ("It doesn't work", None, -1),
    ("didnt compile", None, -1), ("I get a TypeError traceback", None, -1), ("error on line 3", None, -1),
    ("Not what I asked.", None, -1), ("please try again", None, -1), ("not great", None, -1),
    ("Thanks, but it fails on []", None, -1),  # a failure beats thanks
    ("Thank you!", None, 1), ("works now, no errors", None, 1), ("Perfect", None, 1), ("great, and for 5?", None, 1),
    ("What is 2 + 2?", "What is 2 + 2?", -1),  # the question again
    ("what is 2+2", "What is 2 + 2?", -1),  # the same words: what, is, 2, 2
    ("so what is the sum of 2 and 2", "what is the sum of 2 and 2?", -1),  # word sets: Jaccard 7/8 >= 0.8
    ("so what is the sum of 2 and 3", "what is the sum of 2 and 2?", None),  # Jaccard 7/9 < 0.8
    ("And for 5?", "What is 2 + 2?", None), ("ok", None, None), ("", None, None),
])
def test_the_default_rules(next_message, question, value):
    assert rule_judge("any reply", next_message, question) == value


# ---------------------------------------------------------------------------- switches and bounds
def test_each_signal_switches_off():
    def run(d):
        d.observe(ALICE, Q, cid(1), "The answer is 4.", T0, "r1")
        out = d.observe(ALICE, Q, cid(2), "The answer is 4.", T0 + 1_000, "r2")
        return out + d.observe(ALICE, follow("The answer is 4.", "wrong"), cid(3), "x", T0 + 2_000, "r3")

    # the follow-up matches the latest completion with that reply text (cid 2)
    assert [(e.kind, e.completion_id) for e in run(det())] == [("regenerate", cid(1)), ("followup", cid(2))]
    assert [e.kind for e in run(det(regenerate=False))] == ["followup"]
    assert [e.kind for e in run(det(followup=False))] == ["regenerate"]
    off = det(regenerate=False, followup=False)
    assert not off.enabled and run(off) == [] and off.remembered() == 0


def test_memory_is_bounded():
    d = det(max_remembered=2)
    qs = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
    for i, q in enumerate(qs):
        d.observe(ALICE, q, cid(i), f"reply {i}", T0 + i, f"r{i}")
    assert d.remembered() == 2
    assert d.observe(ALICE, qs[0], cid(10), "x", T0 + 10, "r10") == []  # question 0 was forgotten
    assert [e.completion_id for e in d.observe(ALICE, qs[2], cid(11), "x", T0 + 11, "r11")] == [cid(2)]
    assert d.remembered() == 2
    one = det(max_remembered=1)  # one key's own choices beyond the bound: the oldest go
    for i in range(3):
        one.observe(ALICE, Q, cid(i), "x", T0, "r0")
    assert one.remembered() == 1
    assert [e.completion_id for e in one.observe(ALICE, Q, cid(5), "x", T0 + 1, "r1")] == [cid(2)]


def test_expired_entries_are_dropped():
    d = det(window_s=1.0)
    d.observe(ALICE, Q, cid(1), "a", T0, "r1")
    d.observe(BOB, [{"role": "user", "content": "later"}], cid(2), "b", T0 + 5_000, "r2")
    assert d.remembered() == 1  # Alice's completion left the window when Bob's came


@pytest.mark.parametrize("kw,msg", [({"window_s": 0}, "window_s"), ({"window_s": float("nan")}, "window_s"),
                                    ({"window_s": True}, "window_s"), ({"max_remembered": 0}, "max_remembered")])
def test_bad_settings_are_refused_by_name(kw, msg):
    with pytest.raises(ValueError, match=msg):
        det(**kw)


def test_serve_config_settings():
    cfg = ServeConfig()
    d = SignalDetector.from_config(cfg)
    assert (d.regenerate, d.followup, d.window_ms, d.max_remembered) == (True, True, 600_000, 50_000)
    d = SignalDetector.from_config(ServeConfig(derive_regenerate=False, signal_window_s=30, signal_memory=7))
    assert (d.regenerate, d.followup, d.window_ms, d.max_remembered) == (False, True, 30_000, 7)
    for bad in ({"signal_window_s": 0}, {"signal_window_s": float("inf")}, {"signal_memory": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServeConfig(**bad)


# ---------------------------------------------------------------------------- through HTTP
@pytest.fixture(scope="module")
def pod(tiny_moe_dir, tmp_path_factory):
    from flywheel.broker import spawn
    from serving.app import create_app
    from serving.engine import TorchEngine
    from serving.eventlog import EventLog
    from serving.slots import CheckpointStore, Slots
    from servers import ServerThread

    b = spawn()
    eng = TorchEngine(tiny_moe_dir, max_batch=4, threads=1)
    slots = Slots(eng, CheckpointStore(tiny_moe_dir))
    slots.start("v000000")
    ev = EventLog(b.bootstrap, tmp_path_factory.mktemp("j") / "ev.journal")
    app = create_app(slots, ev, pod="pod-signals", salt="fleet-salt")
    srv = ServerThread(app).start()
    yield {"url": srv.url, "bootstrap": b.bootstrap, "app": app, "ev": ev}
    srv.stop()
    app.state.flywheel.openai.close()
    ev.close()
    eng.close()
    b.stop()


def chat(pod, messages, user=None, headers=None, **kw) -> tuple[str, str]:
    body = {"model": "flywheel", "messages": messages, "max_tokens": 8, "temperature": 1.0, **kw}
    if user is not None:
        body["user"] = user
    r = httpx.post(pod["url"] + "/v1/chat/completions", json=body, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["id"], r.json()["choices"][0]["message"]["content"]


def derived(pod) -> dict[str, float]:
    """``flywheel_events_accepted_total`` of the derived kinds on the pod's /metrics, once
    every finished choice was observed."""
    pod["app"].state.flywheel.openai.flush_signals()
    text = httpx.get(pod["url"] + "/metrics", timeout=10).text
    out = {"regenerate": 0.0, "followup": 0.0}
    for line in text.splitlines():
        for kind in out:
            if line.startswith(f'flywheel_events_accepted_total{{kind="{kind}"}}'):
                out[kind] = float(line.split()[-1])
    return out


def feedback_on(pod, cids: set[str], want: int) -> list[FeedbackEvent]:
    """The first ``want`` feedback events on ``flywheel.feedback`` keyed by one of ``cids``,
    once the pod handed every derived event to its event log and the log delivered them."""
    from tests.test_serving_app import consume

    pod["app"].state.flywheel.openai.flush_signals()
    assert pod["ev"].flush(30)
    recs = consume(pod["bootstrap"], topic_names().feedback, want, keys=cids)
    return [FeedbackEvent.model_validate_json(r.value) for r in recs]


def test_http_two_identical_chats_by_one_user_regenerate_the_first(pod):
    before = derived(pod)
    msgs = [{"role": "user", "content": "Name a colour."}]
    c1, _ = chat(pod, msgs, user="carol", seed=1)
    c2, _ = chat(pod, msgs, headers={"x-flywheel-user": "carol"}, seed=2)  # the header names the same user
    evs = feedback_on(pod, {c1, c2}, 1)
    assert [(e.kind, str(e.completion_id), e.value) for e in evs] == [("regenerate", c1, 1.0)]
    ev = evs[0]
    assert ev.event_id == eid("regenerate", c1, msgs) and ev.metadata == {"source": "serving"}
    assert ev.user_hash == hash_user("carol", "fleet-salt")
    assert derived(pod) == {**before, "regenerate": before["regenerate"] + 1}
    # no user named: nothing is derived
    msgs = [{"role": "user", "content": "Name an animal."}]
    chat(pod, msgs)
    chat(pod, msgs)
    assert derived(pod) == {**before, "regenerate": before["regenerate"] + 1}


def test_http_followup_with_the_reply_and_thats_wrong_is_dissatisfied(pod):
    q = [{"role": "user", "content": "Write a haiku."}]
    c1, text = chat(pod, q, user="dave", seed=3)
    assert text.strip(), "the tiny model answered nothing to follow up on"
    later = q + [{"role": "assistant", "content": text}, {"role": "user", "content": "that's wrong"}]
    c2, _ = chat(pod, later, user="dave", headers={"x-request-id": "req-followup-1"})
    evs = feedback_on(pod, {c1}, 1)
    assert [(e.kind, str(e.completion_id), e.value) for e in evs] == [("followup", c1, -1.0)]
    assert evs[0].event_id == eid("followup", c1, later) and evs[0].user_hash == hash_user("dave", "fleet-salt")
    # the client retries the follow-up with its request id: the same follow-up (same event_id,
    # published once) and no regenerate of c2 (a retry is not the user asking again)
    before = derived(pod)
    c3, _ = chat(pod, later, user="dave", headers={"x-request-id": "req-followup-1"})
    assert derived(pod) == before
    assert [e.event_id for e in feedback_on(pod, {c1, c2, c3}, 1)] == [eid("followup", c1, later)]


def test_http_a_slow_judge_never_delays_answers_and_its_backlog_is_bounded(tiny_moe_dir, tmp_path):
    """A judge that blocks: chat answers still come back, at most ``signal_backlog`` finished
    choices wait for the signals thread (the rest are counted, not queued), and once the judge
    returns, the follow-up it was judging and the regenerates queued behind it are published."""
    import threading

    from flywheel.broker import spawn
    from serving.app import create_app
    from serving.engine import TorchEngine
    from serving.eventlog import EventLog
    from serving.slots import CheckpointStore, Slots
    from servers import ServerThread

    entered, release = threading.Event(), threading.Event()

    def slow_judge(reply, next_message, question):
        entered.set()
        release.wait(60)
        return -1

    b = spawn()
    eng = TorchEngine(tiny_moe_dir, max_batch=4, threads=1)
    slots = Slots(eng, CheckpointStore(tiny_moe_dir))
    slots.start("v000000")
    ev = EventLog(b.bootstrap, tmp_path / "ev.journal")
    sig = det(judge=slow_judge)
    app = create_app(slots, ev, pod="pod-slow-judge", salt="fleet-salt", signals=sig)
    openai = app.state.flywheel.openai
    openai.signal_backlog = 2
    srv = ServerThread(app).start()
    p = {"url": srv.url, "bootstrap": b.bootstrap, "app": app, "ev": ev}
    try:
        q = [{"role": "user", "content": "Write a haiku."}]
        c1, text = chat(p, q, user="erin", seed=3)
        assert text.strip()
        openai.flush_signals()
        later = q + [{"role": "assistant", "content": text}, {"role": "user", "content": "hmm"}]
        c2, _ = chat(p, later, user="erin", seed=4)  # the judge blocks on this follow-up
        assert entered.wait(30)
        c3, _ = chat(p, [{"role": "user", "content": "Name a colour."}], user="erin", seed=5)  # queued: 2 waiting
        cids = [chat(p, [{"role": "user", "content": "Name a colour."}], user="erin", seed=6 + k)[0]
                for k in range(3)]  # answered while the judge blocks; beyond the backlog: not observed
        assert openai.signals_dropped == 3 and openai._signal_pending == 2
        release.set()
        evs = feedback_on(p, {c1, c3}, 1)
        assert [(e.kind, str(e.completion_id), e.value) for e in evs] == [("followup", c1, -1.0)]
        assert openai._signal_pending == 0 and sig.remembered() == 3  # c1, c2, c3; not the dropped ones
        # the detector goes on: the same colour question again regenerates c3 (the last one it saw)
        c4, _ = chat(p, [{"role": "user", "content": "Name a colour."}], user="erin", seed=20)
        evs = feedback_on(p, {c3}, 1)
        assert [(e.kind, str(e.completion_id)) for e in evs] == [("regenerate", c3)] and c4 not in cids
    finally:
        release.set()
        srv.stop()
        openai.close()
        ev.close()
        eng.close()
        b.stop()
