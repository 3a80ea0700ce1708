"""Feedback SDK (ingest/sdk.py) against a real HTTP server on a port: arguments the server
would refuse (a lone surrogate) are refused in the caller's thread and the sender thread goes
on; an answer that is not the contract's does not stop the sender; a truncated spool does not
stop the next client; a base_url without a scheme, or with a query string or fragment, is
refused at construction, as are a bool or float where a count goes, a user id that is not a
string, a spool_path that is a directory, an api_key/feedback_key that cannot be a Bearer
header (empty, not a str, whitespace, control or non-ASCII characters), and a base_url with a
port outside 1-65535 or a space in the host (each ValueError names the argument); a spool
line that is not UTF-8 is moved to the .corrupt file and the rest is sent."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid

import pytest
import uvicorn
from fastapi import FastAPI, Request

from ingest.sdk import FeedbackClient, build_event


def _serve(app):
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
    """A recorder of the batch route; ``odd`` answers (200 with a body that is not the
    contract's) are given to the first requests."""
    state = {"received": [], "odd": []}
    app = FastAPI()

    @app.post("/v1/feedback/batch")
    async def batch(req: Request):
        body = await req.json()
        if state["odd"]:
            return state["odd"].pop(0)
        state["received"] += body["events"]
        return {"accepted": len(body["events"]), "rejected": 0,
                "results": [{"index": i, "status": 200, "event_id": e["event_id"], "accepted": True,
                             "duplicate": False} for i, e in enumerate(body["events"])]}

    @app.post("/v1/feedback")
    async def one(req: Request):
        body = await req.json()
        state["received"].append(body)
        return {"event_id": body["event_id"], "accepted": True, "duplicate": False}

    url, srv, th = _serve(app)
    state["url"] = url
    yield state
    srv.should_exit = True
    th.join(5)


@pytest.mark.parametrize("kw,field", [
    ({"comment": "ok \ud800"}, "comment"),
    ({"user": "\udfff"}, "user"),
    ({"metadata": {"k": "v\ud83d"}}, "metadata"),
    ({"comment": "a\x00b"}, "comment"),
])
def test_bad_text_refused_in_caller_and_sender_keeps_sending(server, kw, field):
    fb = FeedbackClient(server["url"], backoff_s=0.01)
    cid = uuid.uuid4()
    with pytest.raises(ValueError, match=f"^{field}:"):
        fb.thumbs_up(cid, **kw)
    good = fb.thumbs_up(cid)
    assert fb.flush(10) == 0
    assert fb._thread.is_alive()
    assert [e["event_id"] for e in server["received"]] == [good]
    assert fb.shutdown(2) == []


@pytest.mark.parametrize("value", [10**400, 1e7, -2e6], ids=["huge-int", "1e7", "-2e6"])
def test_score_out_of_the_events_bounds_refused(value):
    with pytest.raises(ValueError, match="^value:"):
        build_event(uuid.uuid4(), "score", value, name="helpfulness")
    assert build_event(uuid.uuid4(), "score", 1e6, name="helpfulness")["value"] == 1e6


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "localhost:8000", "ftp://x", "http://", "not a url"])
def test_base_url_without_scheme_or_host_refused(url):
    with pytest.raises(ValueError, match="^base_url:"):
        FeedbackClient(url)


@pytest.mark.parametrize("odd", [{"results": [1, "x"]}, {"results": [{"index": 0, "status": "200"}]},
                                 {"results": "none"}, {"ok": True}])
def test_odd_batch_answer_is_resent_and_the_sender_lives(server, odd):
    server["odd"].append(odd)
    fb = FeedbackClient(server["url"], backoff_s=0.01, linger_s=0.2)
    cid = uuid.uuid4()
    ids = [fb.thumbs_up(cid), fb.thumbs_down(cid)]
    assert fb.flush(10) == 0
    assert fb._thread.is_alive()
    assert [e["event_id"] for e in server["received"]] == ids
    assert fb.shutdown(2) == []


def test_truncated_spool_does_not_stop_the_next_client(server, tmp_path):
    spool = tmp_path / "fb.spool"
    good = build_event(uuid.uuid4(), "thumb", 1)
    spool.write_text(json.dumps(good) + "\n" + '{"completion_id": "7ed1\n')
    fb = FeedbackClient(server["url"], spool_path=spool, backoff_s=0.01)
    assert fb.flush(10) == 0
    assert [e["event_id"] for e in server["received"]] == [good["event_id"]]
    assert fb.stats()["respooled"] == 1
    assert (tmp_path / "fb.spool.corrupt").read_text() == '{"completion_id": "7ed1\n'
    assert not spool.exists()
    assert fb.shutdown(2) == []


def test_kafka_mode_missing_broker_try_is_bounded_by_timeout_s():
    """Kafka mode against a port where no broker listens: each try gives up after
    ``timeout_s`` (was kafka-python's 30 s bootstrap wait, then up to 60 s per send), so the
    error is seen and retried, and a stopping client's sender thread ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fb = FeedbackClient(kafka_bootstrap=f"127.0.0.1:{port}", user_salt="s" * 16, timeout_s=1.0, backoff_s=0.05)
    eid = fb.thumbs_up(uuid.uuid4())
    t0 = time.monotonic()
    while fb.stats()["retries"] < 1 and time.monotonic() - t0 < 20:
        time.sleep(0.1)
    waited = time.monotonic() - t0
    assert fb.stats()["retries"] >= 1 and fb.last_error, fb.stats()
    assert waited < 8, waited
    unsent = fb.shutdown(timeout_s=0.5)
    assert [p["event_id"] for p in unsent] == [eid]
    fb._thread.join(5)
    assert not fb._thread.is_alive()


def test_a_200_that_is_not_the_feedback_apis_answer_sends_nothing(tmp_path):
    """base_url pointed at a product's web front end: every route answers 200 with an HTML page.
    No event counts as sent; each stays pending and shutdown hands every one back."""
    from fastapi.responses import HTMLResponse

    app = FastAPI()
    page = HTMLResponse("<html><body>Welcome</body></html>")
    app.post("/v1/feedback/batch")(lambda: page)
    app.post("/v1/feedback")(lambda: page)
    url, srv, th = _serve(app)
    try:
        fb = FeedbackClient(url, backoff_s=0.01, max_backoff_s=0.05, linger_s=0.01)
        cid = uuid.uuid4()
        ids = [fb.thumbs_up(cid)]  # one event: the one-event route
        assert fb.flush(1) == 1
        ids += [fb.copy(cid), fb.regenerate(cid)]  # the batch route
        assert fb.flush(1) == 3 and fb.stats()["sent"] == 0
        assert sorted(e["event_id"] for e in fb.shutdown(1)) == sorted(ids)
    finally:
        srv.should_exit = True
        th.join(5)


@pytest.mark.parametrize("kw,name,why", [
    ({"batch_size": True}, "batch_size", "not bool"),
    ({"queue_size": True}, "queue_size", "not bool"),
    ({"keep_rejected": True}, "keep_rejected", "not bool"),
    ({"batch_size": 2.0}, "batch_size", "not float"),
    ({"queue_size": 1.5}, "queue_size", "not float"),
    ({"keep_rejected": -1}, "keep_rejected", ">= 0"),
    ({"timeout_s": float("inf")}, "timeout_s", "finite"),
    ({"linger_s": float("nan")}, "linger_s", "finite"),
])
def test_counts_and_times_of_the_wrong_type_refused(kw, name, why):
    """bool is an int subclass and a float is not a count: both refused, naming the argument."""
    with pytest.raises(ValueError, match=f"^{name}: ") as e:
        FeedbackClient("http://127.0.0.1:9", **kw)
    assert why in str(e.value)


@pytest.mark.parametrize("user", [5, 5.0, b"alice", ["alice"]])
def test_a_user_that_is_not_a_string_is_refused_not_turned_into_text(server, user):
    with pytest.raises(ValueError, match="^user: must be a string") as e:
        build_event(uuid.uuid4(), "thumb", 1, user=user)
    assert type(user).__name__ in str(e.value)
    fb = FeedbackClient(server["url"])
    with pytest.raises(ValueError, match="^user: must be a string"):
        fb.thumbs_up(uuid.uuid4(), user=user)
    assert fb.stats()["accepted"] == 0 and fb.shutdown(2) == [] and server["received"] == []


def test_spool_path_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="^spool_path: .* is a directory") as e:
        FeedbackClient("http://127.0.0.1:9", spool_path=tmp_path)
    assert str(tmp_path / "feedback.spool") in str(e.value)  # says what to give instead
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="^spool_path: .* is not a directory"):
        FeedbackClient("http://127.0.0.1:9", spool_path=tmp_path / "f" / "fb.spool")
    with pytest.raises(ValueError, match="^spool_path: must be a file path"):
        FeedbackClient("http://127.0.0.1:9", spool_path=5)


def test_spool_that_cannot_be_written_at_shutdown_still_returns_the_events(tmp_path):
    """The spool's directory was replaced by a file after the client started: shutdown logs
    the failure and still hands the events back (spooled 0), instead of raising."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed: nothing listens
    d = tmp_path / "d"
    d.mkdir()
    fb = FeedbackClient(f"http://127.0.0.1:{port}", spool_path=d / "fb.spool", backoff_s=0.01)
    eid = fb.thumbs_up(uuid.uuid4())
    d.rmdir()
    d.write_text("not a directory")
    assert [p["event_id"] for p in fb.shutdown(0.2)] == [eid]
    st = fb.stats()
    assert (st["unsent_at_shutdown"], st["spooled"], st["pending"]) == (1, 0, 0)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/?tenant=a", "http://127.0.0.1:8000?", "http://h/api#x",
                                 "https://h/#"])
def test_base_url_with_a_query_or_fragment_refused(url):
    with pytest.raises(ValueError, match="^base_url: must have no query string or fragment"):
        FeedbackClient(url)


@pytest.mark.parametrize("url", [b"http://127.0.0.1:8000", 8000])
def test_base_url_that_is_not_a_string_refused(url):
    with pytest.raises(ValueError, match="^base_url: must be a string"):
        FeedbackClient(url)


@pytest.mark.parametrize("key,why", [("a\nb", "whitespace (U+000A) at index 1"),
                                     ("a b", "whitespace (U+0020) at index 1"),
                                     ("ab\x00", "a control character (U+0000) at index 2"),
                                     ("a\x7f", "a control character (U+007F) at index 1"),
                                     ("ключ", "a non-ASCII character (U+043A) at index 0"),
                                     ("", "is empty"),
                                     (5, "must be a string"), (b"key", "must be a string")])
@pytest.mark.parametrize("name", ["api_key", "feedback_key"])
def test_a_key_that_cannot_be_a_bearer_header_is_refused(name, key, why):
    """A key with a line break or a non-ASCII character made every request fail (or httpx
    raise UnicodeEncodeError in the constructor); an empty key sent no header at all."""
    with pytest.raises(ValueError, match=f"^{name}: ") as e:
        FeedbackClient("http://127.0.0.1:9", **{name: key})
    assert why in str(e.value)


def test_a_printable_ascii_key_is_sent_as_the_bearer_header():
    seen = []
    app = FastAPI()

    @app.post("/v1/feedback")
    async def one(req: Request):
        body = await req.json()
        seen.append(req.headers.get("authorization"))
        return {"event_id": body["event_id"], "accepted": True, "duplicate": False}

    url, srv, th = _serve(app)
    try:
        key = "k-1._~+/=!$"
        fb = FeedbackClient(url, api_key=key, linger_s=0)
        fb.thumbs_up(uuid.uuid4())
        assert fb.flush(10) == 0 and fb.shutdown(2) == []
        assert seen == ["Bearer k-1._~+/=!$"]
    finally:
        srv.should_exit = True
        th.join(5)


@pytest.mark.parametrize("url,why", [("http://127.0.0.1:99999", "port 99999 is out of range"),
                                     ("http://127.0.0.1:65536/", "port 65536 is out of range"),
                                     ("http://127.0.0.1:0", "port 0 is out of range"),
                                     ("http://a b/", "the host 'a%20b'"),
                                     ("http://ex%41mple.com/", "the host")])
def test_base_url_with_a_port_out_of_range_or_a_space_in_the_host_refused(url, why):
    with pytest.raises(ValueError, match="^base_url: ") as e:
        FeedbackClient(url)
    assert why in str(e.value)


@pytest.mark.parametrize("url", ["http://127.0.0.1:65535", "http://my_host.local:1/api", "http://[::1]:8000",
                                 "https://bücher.example"])
def test_base_urls_with_valid_ports_and_hosts_are_taken(url):
    FeedbackClient(url).shutdown(0)


def test_a_spool_line_that_is_not_utf8_is_moved_to_corrupt_and_the_rest_sent(server, tmp_path):
    """A byte that is not UTF-8 made the constructor refuse the whole spool (spool_path:
    cannot read), so its valid events were stuck; now that line alone is corrupt."""
    spool = tmp_path / "fb.spool"
    a, b = build_event(uuid.uuid4(), "thumb", 1), build_event(uuid.uuid4(), "copy", 1)
    bad = b'{"comment": "caf\xe9"}'  # latin-1 e-acute: not UTF-8
    spool.write_bytes(json.dumps(a).encode() + b"\n" + bad + b"\n" + json.dumps(b).encode() + b"\n")
    fb = FeedbackClient(server["url"], spool_path=spool, backoff_s=0.01)
    assert fb.stats()["respooled"] == 2
    assert fb.flush(10) == 0
    assert [e["event_id"] for e in server["received"]] == [a["event_id"], b["event_id"]]
    assert (tmp_path / "fb.spool.corrupt").read_bytes() == bad + b"\n"
    assert not spool.exists()
    assert fb.shutdown(2) == []
