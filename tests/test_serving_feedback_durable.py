"""A vote is answered 200 only once durable (acked by Kafka or fsync'd in the journal).

Kafka is unreachable in both cases; with a journal on a full disk (``/dev/full``: every write
fails with ENOSPC) the answer is 503 ``event_not_durable`` and the pod forgets the id, so a
retry with the same id is published, not answered ``duplicate``; with a working journal the
event is on disk when the 200 arrives.
"""

from __future__ import annotations

import base64
import json
import uuid

import httpx
import pytest

from schemas.settings import topic_names
from flywheel.broker import free_port
from serving.app import create_app
from serving.engine import TorchEngine
from serving.eventlog import EventLog
from servers import ServerThread
from serving.slots import CheckpointStore, Slots


@pytest.fixture(scope="module")
def slots(tiny_moe_dir):
    eng = TorchEngine(tiny_moe_dir, max_batch=2, threads=1)
    s = Slots(eng, CheckpointStore(tiny_moe_dir))
    s.start("v000000")
    yield s
    eng.close()


def _pod(slots, journal):
    ev = EventLog(f"127.0.0.1:{free_port()}", journal, send_timeout_s=0.5, retry_interval_s=60)
    return ev, ServerThread(create_app(slots, ev, pod="durable", salt="s")).start()


def test_full_disk_and_no_kafka_is_503_and_the_id_is_forgotten(slots):
    ev, srv = _pod(slots, "/dev/full")
    try:
        body = {"completion_id": str(uuid.uuid4()), "event_id": str(uuid.uuid4()), "value": 1}
        for _ in range(2):  # the retry is published again (not answered duplicate: true)
            r = httpx.post(srv.url + "/v1/feedback", json=body, timeout=60)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "event_not_durable" and err["param"] == "event_id"
            assert "No space left on device" in err["message"] and "retry with the same event_id" in err["message"]
        r = httpx.post(srv.url + "/v1/feedback/batch", timeout=60, json={"events": [
            {"completion_id": str(uuid.uuid4()), "value": -1}, {"completion_id": "not-a-uuid", "value": 1}]})
        assert r.status_code == 200
        j = r.json()
        assert [x["status"] for x in j["results"]] == [503, 400] and (j["accepted"], j["rejected"]) == (0, 2)
        assert j["results"][0]["error"]["code"] == "event_not_durable"
        assert ev.counters.failed == 3
    finally:
        srv.stop()
        ev.close(timeout_s=0.5)


def test_no_kafka_answers_once_the_event_is_in_the_journal(slots, tmp_path):
    journal = tmp_path / "ev.journal"
    ev, srv = _pod(slots, journal)
    try:
        eid = str(uuid.uuid4())
        r = httpx.post(srv.url + "/v1/feedback", json={"completion_id": str(uuid.uuid4()), "event_id": eid,
                                                       "value": 1}, timeout=60)
        assert r.status_code == 200 and r.json()["duplicate"] is False
        lines = [json.loads(x) for x in journal.read_text().splitlines()]  # read right after the answer
        assert [(x["topic"], json.loads(base64.b64decode(x["value"]))["event_id"]) for x in lines] == \
            [(topic_names().feedback, eid)]
    finally:
        srv.stop()
        ev.close(timeout_s=0.5)


def test_a_retry_is_answered_only_once_the_first_post_is_durable(slots, tmp_path):
    """A client that gave up waiting and retries the same event_id while the first post is
    still not durable gets no 200 before that event is journaled (it used to get 200
    ``duplicate`` at once, so a pod killed before the write lost an answered vote). The journal
    write is held back by holding the journal's lock."""
    journal = tmp_path / "ev.journal"
    ev, srv = _pod(slots, journal)
    eid = str(uuid.uuid4())
    body = {"completion_id": str(uuid.uuid4()), "event_id": eid, "value": 1}
    try:
        with ev._jlock:  # the event log cannot journal: nothing can become durable
            for _ in range(2):  # the first post, then the retry of an impatient client
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(srv.url + "/v1/feedback", json=body, timeout=1.0)
            assert not journal.exists() or journal.read_bytes() == b""
        r = httpx.post(srv.url + "/v1/feedback", json=body, timeout=30)
        assert r.status_code == 200 and r.json() == {"event_id": eid, "accepted": True, "duplicate": True}
        lines = [json.loads(x) for x in journal.read_text().splitlines()]  # durable before that answer
        assert [json.loads(base64.b64decode(x["value"]))["event_id"] for x in lines] == [eid]  # published once
    finally:
        srv.stop()
        ev.close(timeout_s=0.5)
