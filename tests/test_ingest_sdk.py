"""Feedback SDK against a small real FastAPI/uvicorn server that records what it gets and
fails on demand; Kafka mode against the real broker."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ingest.sdk import AsyncFeedbackClient, FeedbackClient, FeedbackRejected, BufferFull
from schemas import topics
from schemas.events import FeedbackEvent, hash_user


class Recorder:
    def __init__(self):
        self.received: list[dict] = []
        self.attempts = 0
        self.fail_next = 0  # answer 503 to this many requests
        self.status_on_fail = 503
        self.sleep_next = 0  # sleep 1 s on this many requests (client timeout)
        self.auth: list[str | None] = []


@pytest.fixture()
def server():
    rec = Recorder()
    app = FastAPI()

    @app.post("/v1/feedback")
    async def feedback(req: Request):
        rec.attempts += 1
        rec.auth.append(req.headers.get("authorization"))
        if rec.sleep_next:
            rec.sleep_next -= 1
            await asyncio.sleep(1.0)
        if rec.fail_next:
            rec.fail_next -= 1
            return JSONResponse({"error": "down"}, status_code=rec.status_on_fail)
        rec.received.append(await req.json())
        return {"accepted": True}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", rec
    srv.should_exit = True
    th.join(5)


def test_payload_and_event_ids(server):
    url, rec = server
    fb = FeedbackClient(url, api_key="k1", backoff_s=0.01)
    cid = uuid.uuid4()
    e1 = fb.thumbs_up(cid, user="alice")
    e2 = fb.thumbs_down(str(cid), user="bob", comment="wrong")
    e3 = fb.record(cid, "copy", 1)
    fb.close()
    assert [r["event_id"] for r in rec.received] == [e1, e2, e3]
    assert len({e1, e2, e3}) == 3 and all(uuid.UUID(e).version == 4 for e in (e1, e2, e3))
    assert rec.received[1] == {"completion_id": str(cid), "event_id": e2, "kind": "thumb", "value": -1.0,
                               "comment": "wrong", "user": "bob"}
    assert rec.auth == ["Bearer k1"] * 3


def test_retries_5xx_and_timeouts_with_same_event_id(server):
    url, rec = server
    fb = FeedbackClient(url, backoff_s=0.01, timeout_s=0.3, max_retries=4)
    rec.fail_next, rec.sleep_next = 2, 1  # timeout, then 503 x 2 (503s on retries)
    eid = fb.thumbs_up(uuid.uuid4())
    assert rec.attempts == 4 and [r["event_id"] for r in rec.received] == [eid]
    fb.close()


def test_buffer_while_down_then_flush(server):
    url, rec = server
    fb = FeedbackClient(url, backoff_s=0.001, max_retries=1, buffer_size=3)
    rec.fail_next = 10**6
    ids = [fb.thumbs_up(uuid.uuid4()) for _ in range(3)]
    assert len(fb.buffer) == 3 and rec.received == []
    with pytest.raises(BufferFull):
        fb.thumbs_up(uuid.uuid4())
    rec.fail_next = 0
    assert fb.flush() == 3 and not fb.buffer
    later = fb.thumbs_down(uuid.uuid4())
    assert [r["event_id"] for r in rec.received] == ids + [later]  # order kept
    fb.close()


def test_4xx_not_retried(server):
    url, rec = server
    rec.fail_next, rec.status_on_fail = 1, 422
    fb = FeedbackClient(url, backoff_s=0.001)
    with pytest.raises(FeedbackRejected) as ei:
        fb.thumbs_up(uuid.uuid4())
    assert ei.value.status == 422 and rec.attempts == 1 and not fb.buffer
    fb.close()


@pytest.mark.parametrize("args,name", [
    (("not-a-uuid", "thumb", 1), "completion_id"),
    ((uuid.uuid4(), "like", 1), "kind"),
    ((uuid.uuid4(), "thumb", 0.5), "value"),
    ((uuid.uuid4(), "thumb", True), "value"),
    ((uuid.uuid4(), "edit", float("nan")), "value"),
])
def test_bad_arguments_raise_before_sending(server, args, name):
    url, rec = server
    fb = FeedbackClient(url)
    with pytest.raises(ValueError, match=f"^{name}:"):
        fb.record(*args)
    with pytest.raises(ValueError, match="^comment:"):
        fb.thumbs_up(uuid.uuid4(), comment="x" * 5000)
    assert rec.attempts == 0
    fb.close()


def test_async_client(server):
    url, rec = server

    async def go():
        fb = AsyncFeedbackClient(url, backoff_s=0.01)
        rec.fail_next = 2
        a = await fb.thumbs_up(uuid.uuid4(), user="u")
        b = await fb.record(uuid.uuid4(), "thumb", -1)
        with pytest.raises(ValueError, match="^kind:"):
            await fb.record(uuid.uuid4(), "nope", 1)
        await fb.aclose()
        return a, b

    a, b = asyncio.run(go())
    assert [r["event_id"] for r in rec.received] == [a, b] and rec.attempts == 4


@pytest.mark.timeout(60)
def test_kafka_mode(broker):
    from kafka import KafkaConsumer

    fb = FeedbackClient(kafka_bootstrap=broker.bootstrap, user_salt="salt")
    cid = uuid.uuid4()
    eid = fb.thumbs_down(cid, user="carol", comment="meh")
    fb.close()
    c = KafkaConsumer(topics.FEEDBACK, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest",
                      consumer_timeout_ms=3000)
    msgs = list(c)
    c.close()
    (m,) = msgs
    ev = FeedbackEvent.from_bytes(m.value)
    assert m.key == str(cid).encode() and str(ev.event_id) == eid and ev.value == -1.0
    assert ev.user_hash == hash_user("carol", "salt") and ev.comment == "meh"
    with pytest.raises(ValueError, match="^user_salt:"):
        FeedbackClient(kafka_bootstrap=broker.bootstrap)


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
    doc = (Path(__file__).resolve().parents[1] / "docs" / "sdk.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert len(blocks) == 5
    for code in blocks:
        exec(compile(code, "docs/sdk.md", "exec"), {"__name__": "doc"})
    assert len(rec.received) == 4  # 2 sync + 2 async
    c = KafkaConsumer(topics.FEEDBACK, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest",
                      consumer_timeout_ms=3000)
    (m,) = list(c)
    c.close()
    assert FeedbackEvent.from_bytes(m.value).user_hash == hash_user("carol", "the-serving-salt")
