"""Feedback SDK (flywheel_feedback.client) against a real HTTP server on a local port (a small
stdlib server speaking the HTTP API of docs/sdk.md): a long ``linger_s`` never holds back
``flush()`` or ``shutdown()``, non-finite times are refused naming the argument, a server's
huge ``Retry-After`` does not kill the sender, and after ``shutdown()`` every accepted event
is counted exactly once (``accepted == sent + rejected + pending + unsent_at_shutdown``,
``pending == 0``), also when the sender is still inside a request that succeeds afterwards."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flywheel_feedback import FeedbackClient
from flywheel_feedback.client import MAX_SECONDS, _retry_after


class _Api:
    """What the server does: every knob is read per request."""

    def __init__(self):
        self.received: list[dict] = []  # events answered 200, in order
        self.requests: list[tuple[str, int]] = []  # (path, events in the request)
        self.status = 200  # whole-request status (503 etc.; 200 = answer per event)
        self.retry_after: str | None = None  # Retry-After header on a non-200 answer
        self.fail_next = 0  # answer ``status`` to this many requests, then 200 (0: always ``status``)
        self.item_status: dict[str, int] = {}  # event_id -> status in a batch answer
        self.hold: threading.Event | None = None  # a request waits for this before answering
        self.arrived = threading.Event()  # set when a request has been read
        self.got = threading.Condition()  # notified when ``received`` grows
        self.lock = threading.Lock()

    def wait_received(self, n: int, timeout_s: float = 30.0) -> list[dict]:
        """Wait (at most ``timeout_s``, a generous bound) until ``n`` events were received."""
        with self.got:
            self.got.wait_for(lambda: len(self.received) >= n, timeout_s)
            return list(self.received)


def _handler(api: _Api):
    class H(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            events = body["events"] if self.path == "/v1/feedback/batch" else [body]
            with api.lock:
                api.requests.append((self.path, len(events)))
                status = api.status
                fail = status != 200
                if fail and api.fail_next > 0:
                    api.fail_next -= 1
                    if api.fail_next == 0:
                        api.status = 200
            api.arrived.set()
            if api.hold is not None:
                api.hold.wait(60)
            if fail:
                self._send(status, {"error": {"message": "down", "type": "server_error", "param": None,
                                              "code": None}})
                return
            results, ok = [], []
            for i, e in enumerate(events):
                st = api.item_status.get(e["event_id"], 200)
                if st == 200:
                    ok.append(e)
                    results.append({"index": i, "status": 200, "event_id": e["event_id"], "accepted": True,
                                    "duplicate": False})
                else:
                    results.append({"index": i, "status": st, "accepted": False,
                                    "error": {"message": "refused", "type": "invalid_request_error",
                                              "param": "event_id", "code": None}})
            with api.got:
                api.received += ok
                api.got.notify_all()
            if self.path == "/v1/feedback/batch":
                self._send(200, {"accepted": len(ok), "rejected": len(events) - len(ok), "results": results})
            elif results[0]["status"] == 200:
                self._send(200, {"event_id": body["event_id"], "accepted": True, "duplicate": False})
            else:
                self._send(results[0]["status"], {"error": results[0]["error"]})

        def _send(self, status: int, obj: dict):
            out = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            if status != 200 and api.retry_after is not None:
                self.send_header("retry-after", api.retry_after)
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    return H


@pytest.fixture()
def api():
    """A running server; yields its ``_Api`` with ``.url``."""
    a = _Api()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(a))
    srv.daemon_threads = True
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    a.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield a
    if a.hold is not None:
        a.hold.set()
    srv.shutdown()
    srv.server_close()
    th.join(5)


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _wait_until(pred, timeout_s: float = 30.0) -> bool:
    """Poll ``pred`` until it holds, at most ``timeout_s`` (a generous bound, not a timing)."""
    done = threading.Event()
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        done.wait(0.02)
    return pred()


def _once_each(st: dict) -> int:
    return st["sent"] + st["rejected"] + st["pending"] + st["unsent_at_shutdown"]


# ---------------------------------------------------------------- linger

def test_flush_cuts_an_hour_of_linger_short(api):
    """linger_s=3600 with one event queued (the one-event route) and then two (the batch
    route): flush() sends them now, and the sender is alive afterwards."""
    fb = FeedbackClient(api.url, linger_s=3600)
    cid = uuid.uuid4()
    first = fb.thumbs_up(cid)
    assert fb.flush(60) == 0
    assert [e["event_id"] for e in api.wait_received(1)] == [first]
    more = [fb.copy(cid), fb.regenerate(cid)]
    assert fb.flush(60) == 0
    assert [e["event_id"] for e in api.wait_received(3)] == [first] + more
    assert api.requests == [("/v1/feedback", 1), ("/v1/feedback/batch", 2)]
    assert fb._thread.is_alive()
    assert fb.shutdown(10) == [] and fb.stats()["sent"] == 3


def test_flush_with_timeout_0_still_sends_what_is_queued(api):
    """flush(0) waits for nothing but still ends the linger: the event arrives without a
    second flush (waited for on the server, bound 30 s, far below the 3600 s linger)."""
    fb = FeedbackClient(api.url, linger_s=3600)
    eid = fb.thumbs_down(uuid.uuid4())
    fb.flush(0)
    assert [e["event_id"] for e in api.wait_received(1, 30)] == [eid]
    assert fb.shutdown(10) == []
    assert fb.stats()["sent"] == 1


def test_shutdown_cuts_a_long_linger_short(api):
    fb = FeedbackClient(api.url, linger_s=MAX_SECONDS)
    eid = fb.followup(uuid.uuid4(), True)
    assert fb.shutdown(30) == []
    assert [e["event_id"] for e in api.received] == [eid]
    assert fb.stats()["sent"] == 1 and not fb._thread.is_alive()


@pytest.mark.parametrize("name", ["linger_s", "timeout_s", "enqueue_timeout_s", "backoff_s", "max_backoff_s",
                                  "atexit_timeout_s"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), MAX_SECONDS * 2, True])
def test_non_finite_or_huge_or_bool_times_refused_naming_the_argument(name, bad):
    with pytest.raises(ValueError, match=f"^{name}: ") as e:
        FeedbackClient("http://127.0.0.1:9", **{name: bad})
    assert ("boolean" in str(e.value)) == (bad is True)


def test_flush_and_shutdown_timeouts_refused_when_not_finite():
    fb = FeedbackClient(_closed_port())
    for bad in (float("inf"), float("nan"), -1.0, True):
        with pytest.raises(ValueError, match="^timeout_s: "):
            fb.flush(bad)
        with pytest.raises(ValueError, match="^timeout_s: "):
            fb.shutdown(bad)
    assert fb.shutdown(0) == []  # the refused calls did not shut it down


def test_a_huge_retry_after_does_not_kill_the_sender(api):
    """A 503 with ``Retry-After: 99999999999999999999`` (over 3e12 years): the sender sleeps
    (at most MAX_SECONDS) instead of dying of OverflowError, and flush() wakes it."""
    api.status, api.fail_next, api.retry_after = 503, 1, "99999999999999999999"
    fb = FeedbackClient(api.url, linger_s=0)
    eid = fb.thumbs_up(uuid.uuid4())
    assert _wait_until(lambda: fb.stats()["retries"] == 1)  # counted just before the sleep starts
    assert fb.flush(60) == 0
    assert fb._thread.is_alive()
    assert [e["event_id"] for e in api.received] == [eid]
    assert [p for p, _ in api.requests] == ["/v1/feedback", "/v1/feedback"]
    assert fb.stats()["retries"] == 1
    assert fb.shutdown(10) == []


@pytest.mark.parametrize("header,seconds", [("120", 120.0), ("1.5", 1.5), (" 7 ", 7.0),
                                            ("99999999999999999999", MAX_SECONDS), ("inf", None), ("nan", None),
                                            ("1e3", None), ("-5", None), ("", None),
                                            ("Wed, 21 Oct 2015 07:28:00 GMT", None)])
def test_retry_after_header_seconds(header, seconds):
    """Retry-After's delay-seconds form, capped at MAX_SECONDS; anything else is no hint."""
    assert _retry_after(header) == seconds


# ---------------------------------------------------------------- counted once after shutdown

def test_closed_port_each_event_counted_once_after_shutdown():
    fb = FeedbackClient(_closed_port(), backoff_s=0.01, max_backoff_s=0.02, linger_s=0)
    ids = [fb.thumbs_up(uuid.uuid4()) for _ in range(5)]
    unsent = fb.shutdown(0.3)
    assert [p["event_id"] for p in unsent] == ids
    st = fb.stats()
    assert (st["accepted"], st["sent"], st["rejected"], st["pending"], st["unsent_at_shutdown"]) == (5, 0, 0, 0, 5)
    assert _once_each(st) == 5
    assert [p["event_id"] for p in fb.shutdown(0)] == ids  # idempotent: the same hand-back, counted once
    assert fb.stats() == st
    assert fb.flush(0) == 5  # five not delivered


def test_refusing_server_each_event_counted_once_after_shutdown(api, tmp_path):
    """Every request answered 503: the events stay unsent, are spooled, and each is counted
    once, as unsent (spooled) and not also as pending."""
    api.status = 503
    spool = tmp_path / "fb.spool"
    fb = FeedbackClient(api.url, backoff_s=0.01, max_backoff_s=0.02, linger_s=0, spool_path=spool)
    cid = uuid.uuid4()
    ids = [fb.copy(cid), fb.regenerate(cid), fb.thumbs_down(cid)]
    assert api.arrived.wait(30)
    unsent = fb.shutdown(0.3)
    assert [p["event_id"] for p in unsent] == ids
    st = fb.stats()
    assert (st["accepted"], st["pending"], st["unsent_at_shutdown"], st["spooled"]) == (3, 0, 3, 3)
    assert _once_each(st) == 3 and api.received == []
    assert [json.loads(line)["event_id"] for line in spool.read_text().splitlines()] == ids


def test_sent_rejected_and_unsent_each_counted_once(api):
    """One batch of three: the server takes the first, refuses the second (409) and answers
    503 for the third, then keeps answering 503: 1 sent, 1 rejected, 1 unsent, 0 pending."""
    fb = FeedbackClient(api.url, backoff_s=0.01, max_backoff_s=0.02, linger_s=3600)
    ids = [str(uuid.uuid4()) for _ in range(3)]
    api.item_status = {ids[1]: 409, ids[2]: 503}
    for e in ids:
        fb.thumbs_up(uuid.uuid4(), event_id=e)
    fb.flush(0)  # ends the linger: one batch of three
    assert _wait_until(lambda: fb.stats()["sent"] + fb.stats()["rejected"] == 2)
    assert fb.stats()["pending"] == 1  # the third: 503 each time
    unsent = fb.shutdown(0.3)
    assert [p["event_id"] for p in unsent] == [ids[2]]
    st = fb.stats()
    assert (st["accepted"], st["sent"], st["rejected"], st["pending"], st["unsent_at_shutdown"]) == (3, 1, 1, 0, 1)
    assert [e["event_id"] for e in api.received] == [ids[0]]


def test_a_request_answered_after_shutdown_does_not_count_twice(api):
    """The sender is inside a request (the server holds it) when shutdown's time is up:
    shutdown hands the events back. When the server then answers 200, the sender counts
    nothing: each event stays counted once, as unsent (a resend is deduplicated by its
    event_id on the server's side)."""
    api.hold = threading.Event()
    fb = FeedbackClient(api.url, timeout_s=60, linger_s=3600)
    cid = uuid.uuid4()
    ids = [fb.thumbs_up(cid), fb.copy(cid)]
    fb.flush(0)
    assert api.arrived.wait(30)  # the batch is on the wire, held
    unsent = fb.shutdown(0.2)
    assert [p["event_id"] for p in unsent] == ids
    api.hold.set()
    assert len(api.wait_received(2, 30)) == 2  # the server took them
    fb._thread.join(30)
    assert not fb._thread.is_alive()
    st = fb.stats()
    assert (st["accepted"], st["sent"], st["pending"], st["unsent_at_shutdown"]) == (2, 0, 0, 2)
    assert _once_each(st) == 2
