"""Feedback SDK against small real servers on ports: a FastAPI/uvicorn recorder that speaks
the HTTP API of docs/sdk.md and fails on demand, a TCP server that accepts connections and
never answers; Kafka mode against the real broker."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ingest.sdk import AsyncFeedbackClient, ClientClosed, FeedbackClient, QueueFull, build_event
from schemas.settings import topic_names
from schemas.events import FeedbackEvent, hash_user


class Recorder:
    def __init__(self):
        self.received: list[dict] = []  # accepted events, in arrival order
        self.requests: list[tuple[str, int]] = []  # (path, events in the request)
        self.fail_next = 0  # answer this status to this many requests
        self.status_on_fail = 503
        self.sleep_next = 0  # sleep 1 s on this many requests (client timeout)
        self.item_status: dict[str, int] = {}  # event_id -> status to answer in a batch (once)
        self.batch_route = True
        self.max_batch_events = 100  # more than this: 413
        self.auth: list[str | None] = []
        self.attempts: list[list[dict]] = []  # every request's events as posted, failed ones included


def _serve(app) -> tuple[str, uvicorn.Server, threading.Thread]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", srv, th


@pytest.fixture()
def server():
    rec = Recorder()
    app = FastAPI()

    async def gate(req: Request, path: str, n: int):
        rec.requests.append((path, n))
        rec.auth.append(req.headers.get("authorization"))
        if rec.sleep_next:
            rec.sleep_next -= 1
            await asyncio.sleep(1.0)
        if rec.fail_next:
            rec.fail_next -= 1
            return JSONResponse({"error": {"message": "down", "param": None}}, status_code=rec.status_on_fail)
        return None

    @app.post("/v1/feedback")
    async def one(req: Request):
        body = await req.json()
        rec.attempts.append([body])
        if (r := await gate(req, "one", 1)) is not None:
            return r
        st = rec.item_status.pop(body["event_id"], 200)
        if st != 200:
            return JSONResponse({"error": {"message": "no", "param": "value"}}, status_code=st)
        rec.received.append(body)
        return {"event_id": body["event_id"], "accepted": True, "duplicate": False}

    @app.post("/v1/feedback/batch")
    async def batch(req: Request):
        if not rec.batch_route:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        events = (await req.json())["events"]
        rec.attempts.append(events)
        if (r := await gate(req, "batch", len(events))) is not None:
            return r
        if len(events) > rec.max_batch_events:
            return JSONResponse({"error": {"message": "too large", "param": "events"}}, status_code=413)
        results = []
        for i, ev in enumerate(events):
            st = rec.item_status.pop(ev["event_id"], 200)
            if st == 200:
                rec.received.append(ev)
                results.append({"index": i, "status": 200, "event_id": ev["event_id"], "accepted": True})
            else:
                results.append({"index": i, "status": st, "accepted": False,
                                "error": {"message": "refused", "param": "value"}})
        return {"accepted": sum(r["status"] == 200 for r in results), "results": results}

    url, srv, th = _serve(app)
    yield url, rec
    srv.should_exit = True
    th.join(5)


@pytest.fixture()
def hung_server():
    """Accepts TCP connections and never answers (reads and discards)."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(64)
    conns, stop = [], threading.Event()

    def loop():
        ls.settimeout(0.1)
        while not stop.is_set():
            try:
                c, _ = ls.accept()
                conns.append(c)
            except OSError:
                continue

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{ls.getsockname()[1]}", conns
    stop.set()
    th.join(2)
    for c in conns:
        c.close()
    ls.close()


def test_payload_event_ids_metadata_score_and_order(server):
    url, rec = server
    fb = FeedbackClient(url, api_key="k1", linger_s=0.2)
    cid = uuid.uuid4()
    mine = uuid.uuid4()
    e1 = fb.thumbs_up(cid, user="alice", event_id=mine, metadata={"surface": "chat"})
    e2 = fb.thumbs_down(str(cid), user="bob", comment="wrong")
    e3 = fb.score(cid, "helpfulness", 0.25, metadata={"rater": "r1"})
    e4 = fb.record(cid, "copy", 1)
    assert fb.flush() == 0
    assert fb.shutdown() == []
    assert e1 == str(mine)  # the caller's id is the event's id
    assert [r["event_id"] for r in rec.received] == [e1, e2, e3, e4]
    assert len({e1, e2, e3, e4}) == 4 and all(uuid.UUID(e).version == 4 for e in (e2, e3, e4))
    assert rec.received[0] == {"completion_id": str(cid), "event_id": e1, "kind": "thumb", "value": 1.0,
                               "comment": None, "user": "alice", "metadata": {"surface": "chat"}}
    assert rec.received[2] == {"completion_id": str(cid), "event_id": e3, "kind": "score", "value": 0.25,
                               "comment": None, "user": None, "name": "helpfulness", "metadata": {"rater": "r1"}}
    assert rec.requests == [("batch", 4)]  # one batch (linger 0.2 s collected all four)
    assert rec.auth == ["Bearer k1"]
    assert fb.stats() == {"accepted": 4, "sent": 4, "rejected": 0, "dropped_full": 0, "retries": 0,
                          "unsent_at_shutdown": 0, "spooled": 0, "respooled": 0, "pending": 0}


def test_feedback_key_is_the_bearer(server):
    url, rec = server
    fb = FeedbackClient(url, feedback_key="fb-only")
    fb.thumbs_up(uuid.uuid4())
    assert fb.shutdown() == [] and rec.auth == ["Bearer fb-only"]
    with pytest.raises(ValueError, match="^feedback_key:"):
        FeedbackClient(url, api_key="a", feedback_key="b")


def test_hung_endpoint_never_blocks_the_caller(hung_server):
    """The issue's case: a server that accepts connections and never answers. With default
    settings every call returns well under 100 ms; a full queue costs enqueue_timeout_s at
    most; every accepted event comes back from shutdown, none is lost."""
    url, _ = hung_server
    fb = FeedbackClient(url)  # defaults: timeout_s=5, enqueue_timeout_s=0.02
    t0 = time.perf_counter()
    first = fb.thumbs_up(uuid.uuid4())
    t_first = time.perf_counter() - t0
    second = fb.thumbs_down(uuid.uuid4())
    assert t_first < 2.5 and first and second  # never the 5 s send timeout on the hung server
    assert fb.shutdown(timeout_s=0.2) and fb.stats()["unsent_at_shutdown"] == 2

    fb = FeedbackClient(url, queue_size=5, enqueue_timeout_s=0.03, timeout_s=30)
    times, ids = [], []
    for _ in range(40):
        t0 = time.perf_counter()
        ids.append(fb.thumbs_up(uuid.uuid4()))
        times.append(time.perf_counter() - t0)
    assert max(times) < 15, max(times)  # bounded by enqueue_timeout_s, never the 30 s send timeout
    accepted = [e for e in ids if e is not None]
    st = fb.stats()
    assert st["accepted"] == len(accepted) and st["dropped_full"] == 40 - len(accepted) > 0
    t0 = time.perf_counter()
    unsent = fb.shutdown(timeout_s=0.3)
    assert time.perf_counter() - t0 < 15  # shutdown is bounded too: never the 30 s send timeout
    assert [p["event_id"] for p in unsent] == accepted  # every accepted event returned, in order
    assert fb.stats()["unsent_at_shutdown"] == len(accepted)
    with pytest.raises(ClientClosed):
        fb.thumbs_up(uuid.uuid4())


def test_spool_keeps_unsent_events_for_the_next_client(hung_server, server, tmp_path):
    """Shut down while the endpoint hangs: the unsent events go to the spool file; a client
    started later with the same spool sends them first, same event_ids, then its own."""
    hung_url, _ = hung_server
    url, rec = server
    spool = tmp_path / "feedback.spool"
    fb = FeedbackClient(hung_url, spool_path=spool, timeout_s=30)
    ids = [fb.thumbs_up(uuid.uuid4(), metadata={"n": str(i)}) for i in range(5)]
    ids.append(fb.score(uuid.uuid4(), "stars", 4))
    assert [p["event_id"] for p in fb.shutdown(timeout_s=0.2)] == ids
    assert fb.stats()["spooled"] == 6 and len(spool.read_text().splitlines()) == 6
    fb2 = FeedbackClient(url, spool_path=spool, linger_s=0)
    later = fb2.thumbs_down(uuid.uuid4())
    assert fb2.flush() == 0 and fb2.shutdown() == [] and not spool.exists()
    assert [r["event_id"] for r in rec.received] == ids + [later]
    assert rec.received[5]["name"] == "stars" and rec.received[2]["metadata"] == {"n": "2"}
    st = fb2.stats()
    assert (st["respooled"], st["accepted"], st["sent"]) == (6, 7, 7)


def test_overflow_raise_policy(hung_server):
    url, _ = hung_server
    fb = FeedbackClient(url, queue_size=1, enqueue_timeout_s=0.0, on_full="raise", linger_s=0)
    with pytest.raises(QueueFull):
        for _ in range(5):
            fb.thumbs_up(uuid.uuid4())
    assert fb.stats()["dropped_full"] == 1
    fb.shutdown(timeout_s=0.1)


def test_retries_5xx_and_timeouts_with_same_event_id(server):
    url, rec = server
    fb = FeedbackClient(url, backoff_s=0.01, timeout_s=0.3)
    rec.sleep_next, rec.fail_next = 1, 2  # a timeout, then 503 x 2
    eid = fb.thumbs_up(uuid.uuid4())
    assert fb.flush(timeout_s=10) == 0
    assert len(rec.requests) == 4 and [r["event_id"] for r in rec.received] == [eid]
    assert fb.stats()["retries"] == 3 and "503" in fb.last_error
    fb.shutdown()


def test_down_then_up_keeps_order(server):
    url, rec = server
    fb = FeedbackClient(url, backoff_s=0.01, max_backoff_s=0.05, linger_s=0)
    rec.fail_next = 10**6
    ids = [fb.thumbs_up(uuid.uuid4()) for _ in range(30)]
    deadline = time.monotonic() + 60  # two failed sends, however busy the box
    while fb.stats()["retries"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rec.received == [] and fb.stats()["pending"] == 30 and fb.stats()["retries"] >= 2
    rec.fail_next = 0
    assert fb.flush(timeout_s=10) == 0
    assert [r["event_id"] for r in rec.received] == ids  # order kept across retries and batches
    fb.shutdown()


def test_an_outage_of_thousands_of_attempts_keeps_the_sender_alive(server):
    """2**attempt passes a float's range at attempt 1024: the backoff's exponent is capped,
    so the sender thread lives through any outage and delivers when the server is back."""
    url, rec = server
    fb = FeedbackClient(url, backoff_s=1e-6, max_backoff_s=1e-5, linger_s=0)
    assert [fb.backoff_ceiling_s(a) for a in (0, 1, 3, 10**6)] == [1e-6, 2e-6, 8e-6, 1e-5]
    rec.fail_next = 1100
    eid = fb.thumbs_up(uuid.uuid4())
    assert fb.flush(timeout_s=300) == 0, fb.last_error
    assert [r["event_id"] for r in rec.received] == [eid] and fb.stats()["retries"] == 1100
    fb.shutdown()


def test_batch_results_reject_one_and_resend_5xx(server):
    url, rec = server
    errors = []
    fb = FeedbackClient(url, backoff_s=0.01, linger_s=0.2, on_error=lambda p, why: errors.append((p, why)))
    cids = [uuid.uuid4() for _ in range(5)]
    ids = [str(uuid.uuid4()) for _ in range(5)]
    rec.item_status = {ids[1]: 409, ids[3]: 503}
    for c, e in zip(cids, ids):
        fb.thumbs_up(c, event_id=e)
    assert fb.flush() == 0
    assert [r["event_id"] for r in rec.received] == [ids[0], ids[2], ids[4], ids[3]]  # 503 resent
    assert [p["event_id"] for p, _ in fb.rejected] == [ids[1]] and "409" in fb.rejected[0][1]
    assert [p["event_id"] for p, _ in errors] == [ids[1]]
    st = fb.stats()
    assert (st["accepted"], st["sent"], st["rejected"]) == (5, 4, 1)
    fb.shutdown()


def test_4xx_on_one_event_route_not_retried(server):
    url, rec = server
    rec.fail_next, rec.status_on_fail = 1, 400
    fb = FeedbackClient(url, backoff_s=0.001)
    eid = fb.thumbs_up(uuid.uuid4())
    assert fb.flush() == 0 and len(rec.requests) == 1
    assert fb.rejected[0][0]["event_id"] == eid and "400" in fb.rejected[0][1]
    assert fb.stats()["rejected"] == 1
    fb.shutdown()


@pytest.mark.parametrize("status", [401, 403])
def test_refused_credentials_keep_the_events(server, status):
    """401/403 refuse the key (wrong or rotated), not the event: the events are retried with
    their event_ids, never rejected, and arrive once the server takes the key again."""
    url, rec = server
    rec.fail_next, rec.status_on_fail = 3, status
    fb = FeedbackClient(url, backoff_s=0.01, max_backoff_s=0.02, linger_s=0.05)
    ids = [fb.thumbs_up(uuid.uuid4()) for _ in range(3)]
    assert fb.flush(timeout_s=10) == 0
    assert [r["event_id"] for r in rec.received] == ids
    st = fb.stats()
    assert (st["sent"], st["rejected"], st["retries"]) == (3, 0, 3), st
    assert f"HTTP {status}: credentials refused" in fb.last_error
    fb.shutdown()


def test_refused_credentials_at_shutdown_are_spooled(server, tmp_path):
    """A key the server never takes: shutdown hands the events back and spools them; the next
    client (with a key that works) sends them with the same event_ids."""
    url, rec = server
    spool = tmp_path / "fb.spool"
    rec.fail_next, rec.status_on_fail = 10**6, 401
    fb = FeedbackClient(url, spool_path=spool, backoff_s=0.01, max_backoff_s=0.02)
    ids = [fb.thumbs_down(uuid.uuid4()) for _ in range(2)]
    unsent = fb.shutdown(timeout_s=0.3)
    assert [p["event_id"] for p in unsent] == ids and fb.stats()["rejected"] == 0
    rec.fail_next = 0
    fb2 = FeedbackClient(url, spool_path=spool, backoff_s=0.01)
    assert fb2.flush(timeout_s=10) == 0
    assert [r["event_id"] for r in rec.received] == ids
    fb2.shutdown()


def test_no_batch_route_falls_back_to_one_per_request(server):
    url, rec = server
    rec.batch_route = False
    fb = FeedbackClient(url, linger_s=0.2)
    ids = [fb.thumbs_up(uuid.uuid4()) for _ in range(3)]
    assert fb.flush() == 0
    assert [r["event_id"] for r in rec.received] == ids and [p for p, _ in rec.requests] == ["one"] * 3
    fb.shutdown()


def test_413_splits_the_batch(server):
    url, rec = server
    rec.max_batch_events = 3
    fb = FeedbackClient(url, linger_s=0.3)
    ids = [fb.thumbs_up(uuid.uuid4()) for _ in range(10)]
    assert fb.flush() == 0
    assert [r["event_id"] for r in rec.received] == ids and fb.stats()["rejected"] == 0
    assert max(n for p, n in rec.requests if p == "batch") > 1  # still batched, in pieces
    fb.shutdown()


@pytest.mark.parametrize("args,kw,name", [
    (("not-a-uuid", "thumb", 1), {}, "completion_id"),
    ((uuid.uuid4(), "like", 1), {}, "kind"),
    ((uuid.uuid4(), "thumb", 0.5), {}, "value"),
    ((uuid.uuid4(), "thumb", True), {}, "value"),
    ((uuid.uuid4(), "edit", float("nan")), {}, "value"),
    ((uuid.uuid4(), "thumb", 1), {"event_id": "nope"}, "event_id"),
    ((uuid.uuid4(), "score", 0.5), {}, "name"),
    ((uuid.uuid4(), "score", 0.5), {"name": "has space"}, "name"),
    ((uuid.uuid4(), "thumb", 1), {"name": "x"}, "name"),
    ((uuid.uuid4(), "thumb", 1), {"metadata": {"k": 1}}, "metadata"),
    ((uuid.uuid4(), "thumb", 1), {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ((uuid.uuid4(), "thumb", 1), {"metadata": {"k": "v" * 513}}, "metadata"),
    ((uuid.uuid4(), "thumb", 1), {"metadata": ["a"]}, "metadata"),
])
def test_bad_arguments_raise_before_queueing(server, args, kw, name):
    url, rec = server
    fb = FeedbackClient(url)
    with pytest.raises(ValueError, match=f"^{name}:"):
        fb.record(*args, **kw)
    with pytest.raises(ValueError, match="^comment:"):
        fb.thumbs_up(uuid.uuid4(), comment="x" * 5000)
    assert fb.shutdown() == [] and rec.requests == [] and fb.stats()["accepted"] == 0


def test_constructor_arguments_named():
    for kw, name in [({}, "base_url"), ({"kafka_bootstrap": "x:1"}, "user_salt"),
                     ({"base_url": "http://x", "batch_size": 101}, "batch_size"),
                     ({"base_url": "http://x", "queue_size": 0}, "queue_size"),
                     ({"base_url": "http://x", "on_full": "block"}, "on_full"),
                     ({"base_url": "http://x", "enqueue_timeout_s": -1}, "enqueue_timeout_s"),
                     ({"base_url": "http://x", "timeout_s": 0}, "timeout_s")]:
        with pytest.raises(ValueError, match=f"^{name}:"):
            FeedbackClient(**kw)


def test_build_event_matches_the_server_event_schema():
    """What the SDK builds is a valid FeedbackEvent (the serving side's contract)."""
    p = build_event(uuid.uuid4(), "score", 3, name="stars", metadata={"a": "b"}, comment="ok")
    ev = FeedbackEvent(user_hash="h", created_at=1_700_000_000_000,
                       **{k: v for k, v in p.items() if k != "user"})
    assert ev.name == "stars" and ev.metadata == {"a": "b"} and ev.value == 3.0


# ---------------------------------------------------------------- copy, regenerate, edit, followup
# The shared contract (docs/sdk.md, "Signals"): copy = 1, regenerate = 1, followup = +1 / -1,
# edit = the kept share in [0, 1] as value, or final_text without value.

def test_new_signals_exact_json(server):
    url, rec = server
    fb = FeedbackClient(url, linger_s=0.2)
    cid = uuid.uuid4()
    mine = str(uuid.uuid4())
    c = fb.copy(cid, user="alice", event_id=mine)
    r = fb.regenerate(str(cid), "bob", "same mistake again", metadata={"surface": "chat"})
    k = fb.edit(cid, kept=0.25, user="carol")
    t = fb.edit(cid, final_text="Final: 42.\nThanks.", user="dave")
    up = fb.followup(cid, True, user="erin")
    down = fb.followup(cid, satisfied=False)
    assert fb.flush() == 0 and fb.shutdown() == []
    assert c == mine
    s = str(cid)
    assert rec.received == [
        {"completion_id": s, "event_id": c, "kind": "copy", "value": 1.0, "comment": None, "user": "alice"},
        {"completion_id": s, "event_id": r, "kind": "regenerate", "value": 1.0, "comment": "same mistake again",
         "user": "bob", "metadata": {"surface": "chat"}},
        {"completion_id": s, "event_id": k, "kind": "edit", "value": 0.25, "comment": None, "user": "carol"},
        {"completion_id": s, "event_id": t, "kind": "edit", "comment": None, "user": "dave",
         "final_text": "Final: 42.\nThanks."},
        {"completion_id": s, "event_id": up, "kind": "followup", "value": 1.0, "comment": None, "user": "erin"},
        {"completion_id": s, "event_id": down, "kind": "followup", "value": -1.0, "comment": None, "user": None},
    ]
    assert rec.requests == [("batch", 6)]


def test_new_signals_retried_with_the_same_event_ids(server):
    """Two 503s, then success: every attempt carries the same events with the same ids, and
    each event arrives once."""
    url, rec = server
    rec.fail_next = 2
    fb = FeedbackClient(url, backoff_s=0.01, linger_s=0.2)
    cid = uuid.uuid4()
    ids = [fb.copy(cid), fb.regenerate(cid), fb.edit(cid, final_text="mine"), fb.edit(cid, kept=1),
           fb.followup(cid, False)]
    assert fb.flush(timeout_s=10) == 0 and fb.shutdown() == []
    assert len(rec.attempts) == 3
    assert all(a == rec.attempts[0] for a in rec.attempts)  # same bodies, same event_ids
    assert [e["event_id"] for e in rec.attempts[0]] == ids
    assert [e["event_id"] for e in rec.received] == ids
    assert fb.stats()["retries"] == 2


def test_new_signals_spooled_at_shutdown_and_sent_by_the_next_client(hung_server, server, tmp_path):
    hung_url, _ = hung_server
    url, rec = server
    spool = tmp_path / "fb.spool"
    fb = FeedbackClient(hung_url, spool_path=spool, timeout_s=30)
    cid = uuid.uuid4()
    ids = [fb.copy(cid, user="u"), fb.regenerate(cid), fb.edit(cid, final_text="kept this"),
           fb.edit(cid, kept=0.5), fb.followup(cid, True)]
    unsent = fb.shutdown(timeout_s=0.2)
    assert [p["event_id"] for p in unsent] == ids and fb.stats()["spooled"] == 5
    fb2 = FeedbackClient(url, spool_path=spool, linger_s=0)
    assert fb2.flush() == 0 and fb2.shutdown() == [] and not spool.exists()
    assert rec.received == unsent  # same ids, same content (final_text kept, no value on that edit)
    assert "value" not in rec.received[2] and rec.received[2]["final_text"] == "kept this"


@pytest.mark.parametrize("call,name", [
    (lambda fb, c: fb.copy("nope"), "completion_id"),
    (lambda fb, c: fb.copy(c, user=""), "user"),
    (lambda fb, c: fb.regenerate(c, event_id="x"), "event_id"),
    (lambda fb, c: fb.regenerate(c, comment="a\x00b"), "comment"),
    (lambda fb, c: fb.edit(c), "kept"),
    (lambda fb, c: fb.edit(c, kept=0.5, final_text="x"), "kept"),
    (lambda fb, c: fb.edit(c, kept=1.5), "kept"),
    (lambda fb, c: fb.edit(c, kept=-0.1), "kept"),
    (lambda fb, c: fb.edit(c, kept=True), "kept"),
    (lambda fb, c: fb.edit(c, kept=float("nan")), "kept"),
    (lambda fb, c: fb.edit(c, final_text=3), "final_text"),
    (lambda fb, c: fb.edit(c, final_text="a\ud800"), "final_text"),
    (lambda fb, c: fb.edit(c, final_text="x" * 65537), "final_text"),
    (lambda fb, c: fb.followup(c, 1), "satisfied"),
    (lambda fb, c: fb.followup(c, "yes"), "satisfied"),
    (lambda fb, c: fb.followup(c, None), "satisfied"),
    (lambda fb, c: fb.record(c, "copy", -1), "value"),
    (lambda fb, c: fb.record(c, "copy", 2), "value"),
    (lambda fb, c: fb.record(c, "regenerate", 0), "value"),
    (lambda fb, c: fb.record(c, "followup", 0.5), "value"),
    (lambda fb, c: fb.record(c, "edit", 1.2), "value"),
    (lambda fb, c: fb.record(c, "edit"), "value"),
    (lambda fb, c: fb.record(c, "copy"), "value"),
    (lambda fb, c: fb.record(c, "edit", 0.5, final_text="x"), "final_text"),
    (lambda fb, c: fb.record(c, "thumb", 1, final_text="x"), "final_text"),
    (lambda fb, c: fb.record(c, "copy", 1, name="x"), "name"),
    (lambda fb, c: fb.copy(c, metadata={"k": "v" * 513}), "metadata"),
])
def test_new_signals_bad_arguments_named_nothing_queued(server, call, name):
    url, rec = server
    fb = FeedbackClient(url)
    with pytest.raises(ValueError, match=f"^{name}:"):
        call(fb, uuid.uuid4())
    assert fb.shutdown() == [] and rec.attempts == [] and fb.stats()["accepted"] == 0


@pytest.mark.parametrize("call,message", [
    (lambda fb, c: fb.edit(c, kept="0.5"), "kept: the share of the reply the user kept, a number in [0, 1], got '0.5'"),
    (lambda fb, c: fb.record(c, "copy", True), "value: must be a number, not a boolean, got True"),
])
def test_bad_argument_messages_show_what_was_given(server, call, message):
    url, _ = server
    fb = FeedbackClient(url)
    with pytest.raises(ValueError) as exc:
        call(fb, uuid.uuid4())
    assert str(exc.value) == message
    fb.shutdown()


def test_new_signals_are_valid_feedback_events():
    """What the SDK builds for each new kind is a FeedbackEvent the consumers accept (the
    pydantic model of schemas.events, not the schema the SDK checked with)."""
    cid = uuid.uuid4()
    for p in (build_event(cid, "copy", 1), build_event(cid, "regenerate", 1), build_event(cid, "edit", 0.0),
              build_event(cid, "edit", final_text="x" * 65536), build_event(cid, "followup", -1)):
        ev = FeedbackEvent(user_hash="h", created_at=1_700_000_000_000,
                           **{k: v for k, v in p.items() if k != "user"})
        assert (ev.kind, ev.value, ev.final_text) == (p["kind"], p.get("value"), p.get("final_text"))


def test_async_client(server):
    url, rec = server

    async def go():
        fb = AsyncFeedbackClient(url, backoff_s=0.01)
        rec.fail_next = 2
        a = await fb.thumbs_up(uuid.uuid4(), user="u")
        b = await fb.score(uuid.uuid4(), "stars", 4)
        with pytest.raises(ValueError, match="^kind:"):
            await fb.record(uuid.uuid4(), "nope", 1)
        cid = uuid.uuid4()
        more = [await fb.copy(cid, "u"), await fb.regenerate(cid), await fb.edit(cid, kept=0.75),
                await fb.edit(cid, final_text="done"), await fb.followup(cid, True)]
        with pytest.raises(ValueError, match="^satisfied:"):
            await fb.followup(cid, 0)
        assert await fb.flush() == 0
        assert await fb.aclose() == []
        return [a, b, *more]

    ids = asyncio.run(go())
    assert [r["event_id"] for r in rec.received] == ids
    assert [(r["kind"], r.get("value"), r.get("final_text")) for r in rec.received[2:]] == [
        ("copy", 1.0, None), ("regenerate", 1.0, None), ("edit", 0.75, None), ("edit", None, "done"),
        ("followup", 1.0, None)]


@pytest.mark.timeout(60)
def test_kafka_mode(broker):
    from kafka import KafkaConsumer

    fb = FeedbackClient(kafka_bootstrap=broker.bootstrap, user_salt="salt")
    cid = uuid.uuid4()
    eid = fb.thumbs_down(cid, user="carol", comment="meh")
    sid = fb.score(cid, "helpfulness", 0.5, metadata={"k": "v"})
    tid = fb.edit(cid, final_text="my version", user="carol")
    fid = fb.followup(cid, False, user="carol")
    assert fb.flush(timeout_s=30) == 0 and fb.shutdown() == []
    c = KafkaConsumer(topic_names().feedback, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest",
                      consumer_timeout_ms=3000)
    msgs = list(c)
    c.close()
    by_id = {str(e.event_id): e for e in (FeedbackEvent.from_bytes(m.value) for m in msgs)}
    assert all(m.key == str(cid).encode() for m in msgs) and len(msgs) == 4
    assert set(by_id) == {eid, sid, tid, fid}
    e = by_id[eid]
    assert e.value == -1.0 and e.user_hash == hash_user("carol", "salt") and e.comment == "meh"
    assert (by_id[sid].name, by_id[sid].metadata, by_id[sid].value) == ("helpfulness", {"k": "v"}, 0.5)
    assert (by_id[tid].kind, by_id[tid].value, by_id[tid].final_text) == ("edit", None, "my version")
    assert (by_id[fid].kind, by_id[fid].value, by_id[fid].user_hash) == ("followup", -1.0, hash_user("carol", "salt"))


@pytest.mark.timeout(90)
def test_doc_examples_run(server, broker, monkeypatch):
    """Every ```python block of docs/sdk.md runs as written (HTTP examples against the
    recorder, the Kafka one against the real broker); the events they send arrive."""
    import re
    from pathlib import Path

    from kafka import KafkaConsumer

    url, rec = server
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", url)
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", broker.bootstrap)
    monkeypatch.delenv("FLYWHEEL_API_KEY", raising=False)
    monkeypatch.delenv("FLYWHEEL_FEEDBACK_KEY", raising=False)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "sdk.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert len(blocks) == 6
    for code in blocks:
        exec(compile(code, "docs/sdk.md", "exec"), {"__name__": "doc"})
    assert len(rec.received) == 10  # 3 sync + 2 async + 5 from the product wiring
    wired = [(r["kind"], r.get("value"), r.get("final_text"), r["user"]) for r in rec.received
             if r["kind"] != "thumb" and r["kind"] != "score"]
    assert wired == [("copy", 1.0, None, "alice"), ("regenerate", 1.0, None, "bob"), ("edit", 0.8, None, "dave"),
                     ("followup", -1.0, None, "erin"), ("edit", None, "The answer is 42.", "carol")]
    c = KafkaConsumer(topic_names().feedback, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest",
                      consumer_timeout_ms=3000)
    (m,) = list(c)
    c.close()
    assert FeedbackEvent.from_bytes(m.value).user_hash == hash_user("carol", "the-serving-salt")


@pytest.mark.timeout(120)
def test_against_the_real_serving_pod(tiny_moe_dir, broker, tmp_path):
    """The SDK with a feedback-only key against a real serving pod (tiny MoE, real broker):
    batched thumbs, a named score with metadata and a caller-set event_id arrive on
    flywheel.feedback; the same event_id with other content is rejected (409), counted and
    handed to on_error, and the rest of its batch is published."""
    from kafka import KafkaConsumer

    from serving.app import create_app
    from serving.engine import TorchEngine
    from serving.eventlog import EventLog
    from servers import ServerThread
    from serving.slots import CheckpointStore, Slots

    eng = TorchEngine(tiny_moe_dir, max_batch=2, threads=1)
    slots = Slots(eng, CheckpointStore(tiny_moe_dir))
    slots.start("v000000")
    ev = EventLog(broker.bootstrap, tmp_path / "ev.journal")
    srv = ServerThread(create_app(slots, ev, pod="pod-sdk", salt="s", api_keys={"k-api"},
                                  feedback_keys={"k-fb"})).start()
    try:
        r = httpx.post(srv.url + "/v1/completions", headers={"Authorization": "Bearer k-api"}, timeout=60,
                       json={"model": "flywheel", "prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        cid = r.json()["id"]
        errors = []
        fb = FeedbackClient(srv.url, feedback_key="k-fb", linger_s=0.3, on_error=lambda p, why: errors.append(why))
        mine = str(uuid.uuid4())
        up = fb.thumbs_up(cid, user="alice", event_id=mine, metadata={"surface": "chat"})
        sc = fb.score(cid, "helpfulness", 0.75, user="bob")
        clash = fb.thumbs_down(cid, user="alice", event_id=mine)  # same id, other content: 409
        assert fb.flush(timeout_s=30) == 0 and fb.shutdown() == []
        assert up == clash == mine
        st = fb.stats()
        assert (st["accepted"], st["sent"], st["rejected"]) == (3, 2, 1) and "409" in errors[0]
        c = KafkaConsumer(topic_names().feedback, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest",
                          consumer_timeout_ms=5000)
        evs = {str(e.event_id): e for e in (FeedbackEvent.from_bytes(m.value) for m in c)}
        c.close()
        assert set(evs) == {mine, sc}
        assert evs[mine].value == 1.0 and evs[mine].metadata == {"surface": "chat"}
        assert (evs[sc].kind, evs[sc].name, evs[sc].value) == ("score", "helpfulness", 0.75)
        assert evs[sc].user_hash == hash_user("bob", "s")
    finally:
        srv.stop()
        ev.close()
        eng.close()


@pytest.mark.timeout(120)
def test_new_signals_against_the_real_serving_pod(tiny_moe_dir, broker, tmp_path):
    """copy, regenerate, both edits and a followup from the SDK through a real serving pod's
    /v1/feedback/batch arrive on flywheel.feedback as FeedbackEvents with the contract's values
    (an edit with final_text carries no value)."""
    from kafka import KafkaConsumer

    from serving.app import create_app
    from serving.engine import TorchEngine
    from serving.eventlog import EventLog
    from servers import ServerThread
    from serving.slots import CheckpointStore, Slots

    eng = TorchEngine(tiny_moe_dir, max_batch=2, threads=1)
    slots = Slots(eng, CheckpointStore(tiny_moe_dir))
    slots.start("v000000")
    ev = EventLog(broker.bootstrap, tmp_path / "ev.journal")
    srv = ServerThread(create_app(slots, ev, pod="pod-sdk", salt="s", api_keys={"k-api"},
                                  feedback_keys={"k-fb"})).start()
    try:
        r = httpx.post(srv.url + "/v1/completions", headers={"Authorization": "Bearer k-api"}, timeout=60,
                       json={"model": "flywheel", "prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        cid = r.json()["id"]
        errors = []
        fb = FeedbackClient(srv.url, feedback_key="k-fb", linger_s=0.3, on_error=lambda p, why: errors.append(why))
        ids = {"copy": fb.copy(cid, user="alice"), "regenerate": fb.regenerate(cid, user="bob"),
               "kept": fb.edit(cid, kept=0.5, user="carol"), "text": fb.edit(cid, final_text="mine", user="dave"),
               "followup": fb.followup(cid, False, user="erin")}
        assert fb.flush(timeout_s=30) == 0 and fb.shutdown() == []
        assert errors == [] and fb.stats()["sent"] == 5
        c = KafkaConsumer(topic_names().feedback, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest",
                          consumer_timeout_ms=5000)
        evs = {str(e.event_id): e for e in (FeedbackEvent.from_bytes(m.value) for m in c)}
        c.close()
        got = {k: (evs[i].kind, evs[i].value, evs[i].final_text) for k, i in ids.items()}
        assert got == {"copy": ("copy", 1.0, None), "regenerate": ("regenerate", 1.0, None),
                       "kept": ("edit", 0.5, None), "text": ("edit", None, "mine"),
                       "followup": ("followup", -1.0, None)}
        assert evs[ids["followup"]].user_hash == hash_user("erin", "s")
    finally:
        srv.stop()
        ev.close()
        eng.close()
