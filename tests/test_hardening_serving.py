"""Hardening II, serving side, over real HTTP on a real pod (tiny MoE, real Tansu broker):

* defect 3: a vote stamped beyond the clock-skew tolerance is 422 naming ``created_at``; one
  within it reaches Kafka clamped to the pod's clock (``schemas.events.clamp_event_time``);
* defect 4: a 7.5 MB prompt is refused 413 before it is read (the client never sends the
  rest, so only an early answer can arrive), and ``/healthz`` answers while a prompt's
  tokeniser is held busy (tokenising runs off the event loop). Neither test measures time, so
  a busy machine cannot fail them and a slow one cannot pass them by luck.
"""

from __future__ import annotations

import json
import socket
import threading
import uuid

import httpx
import pytest

from schemas.settings import topic_names
from schemas.events import MAX_FUTURE_SKEW_MS, FeedbackEvent, now_ms
from tests.test_serving_app import consume

@pytest.fixture(scope="module")
def pod(tiny_moe_dir, tmp_path_factory):
    from flywheel.broker import spawn
    from serving.commands import build_pod
    from servers import ServerThread
    from serving.slots import CheckpointStore

    b = spawn(partitions=2, die_with_parent=True)
    p = build_pod(CheckpointStore(tiny_moe_dir), pod="pod-hardening", max_batch=2, bootstrap=b.bootstrap,
                  journal=tmp_path_factory.mktemp("j") / "ev.journal")
    srv = ServerThread(p.app).start()
    try:
        yield {"url": srv.url, "bootstrap": b.bootstrap, "app": p.app}
    finally:
        srv.stop()
        p.close()
        b.stop()


def _vote(cid: str, **kw) -> dict:
    return {"completion_id": cid, "value": 1, "event_id": str(uuid.uuid4()), "user": "skewed", **kw}


def test_future_votes_refused_beyond_the_tolerance_and_clamped_within(pod):
    cid = str(uuid.uuid4())
    now = now_ms()
    far = _vote(cid, created_at=now + MAX_FUTURE_SKEW_MS + 60_000)
    r = httpx.post(pod["url"] + "/v1/feedback", json=far, timeout=30)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("created_at", "created_at_in_future") and "tolerance" in err["message"]
    huge = httpx.post(pod["url"] + "/v1/feedback", json=_vote(cid, created_at=10**19), timeout=30)
    assert huge.status_code == 422 and huge.json()["error"]["param"] == "created_at", huge.text
    secs = httpx.post(pod["url"] + "/v1/feedback", json=_vote(cid, created_at=now // 1000), timeout=30)
    assert secs.status_code == 400 and secs.json()["error"]["param"] == "created_at", secs.text

    near, past = _vote(cid, created_at=now + 60_000), _vote(cid, created_at=now - 3_600_000, value=-1)
    t0 = now_ms()
    assert httpx.post(pod["url"] + "/v1/feedback", json=near, timeout=30).status_code == 200
    t1 = now_ms()
    batch = httpx.post(pod["url"] + "/v1/feedback/batch", timeout=30, json={"events": [
        _vote(cid, created_at=now_ms() + MAX_FUTURE_SKEW_MS + 60_000), past]}).json()
    assert [x["status"] for x in batch["results"]] == [422, 200], batch
    assert batch["results"][0]["error"]["param"] == "created_at"

    recs = consume(pod["bootstrap"], topic_names().feedback, 2, keys={cid})
    got = {str(e.event_id): e.created_at for e in (FeedbackEvent.from_bytes(x.value) for x in recs)}
    assert set(got) == {near["event_id"], past["event_id"]}  # nothing refused reached Kafka
    assert t0 <= got[near["event_id"]] <= t1 < near["created_at"]  # clamped to the pod's clock
    assert got[past["event_id"]] == past["created_at"]  # an earlier time is kept as sent


def _answer_to_a_body_never_finished(url: str, head: dict[str, str], first: bytes, more=()) -> tuple[int, dict]:
    """POST ``first`` (then each of ``more``, from another thread, ignoring a closed socket) to
    ``url`` on a raw socket, never ending the body; return the status and JSON the server
    answers. A server that waited for the whole body would answer nothing: the read times out."""
    u = httpx.URL(url)
    sock = socket.create_connection((u.host, u.port), timeout=60)
    lines = [f"POST {u.raw_path.decode()} HTTP/1.1", f"Host: {u.host}:{u.port}",
             *(f"{k}: {v}" for k, v in head.items())]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + first)

    def send_more():
        try:
            for chunk in more:
                sock.sendall(chunk)
        except OSError:
            pass  # the server answered and closed: the rest is never read

    sender = threading.Thread(target=send_more, daemon=True)
    sender.start()
    got = b""
    try:
        while b"\r\n\r\n" not in got:
            part = sock.recv(65536)
            assert part, f"connection closed without an answer: {got!r}"
            got += part
        header, body = got.split(b"\r\n\r\n", 1)
        length = int(next(x.split(b":", 1)[1] for x in header.split(b"\r\n")
                          if x.lower().startswith(b"content-length:")))
        while len(body) < length:
            part = sock.recv(65536)
            assert part, "connection closed inside the answer"
            body += part
    finally:
        sock.close()
    return int(header.split(b" ", 2)[1]), json.loads(body[:length])


def test_huge_prompt_is_413_before_its_body_is_read(pod):
    url = pod["url"] + "/v1/completions"
    huge = json.dumps({"model": "flywheel", "prompt": "def add(a, b): return a + b\n" * 268_000,
                       "max_tokens": 1}).encode()
    assert len(huge) > 7_500_000
    hdr = {"Content-Type": "application/json"}
    # declared: the first 64 KiB of a 7.5 MB body, and never the rest
    status, doc = _answer_to_a_body_never_finished(url, {**hdr, "Content-Length": str(len(huge))}, huge[:65536])
    assert (status, doc["error"]["code"]) == (413, "request_too_large"), doc
    # chunked, no length: 2 MiB of chunks (over the 1 MiB bound) and never the last chunk
    chunks = [b"%x\r\n%s\r\n" % (65536, huge[i:i + 65536]) for i in range(0, 2 * 1024 * 1024, 65536)]
    status, doc = _answer_to_a_body_never_finished(url, {**hdr, "Transfer-Encoding": "chunked"}, chunks[0], chunks[1:])
    assert (status, doc["error"]["code"]) == (413, "request_too_large"), doc
    # just under the inference body limit (1 MiB for 8192 prompt tokens): read and tokenised,
    # then over the context: OpenAI's 400 (D77)
    allowed = json.dumps({"model": "flywheel", "prompt": "def add(a, b): return a + b\n" * 14_000,
                          "max_tokens": 1}).encode()
    assert 350_000 < len(allowed) < 1024 * 1024
    r = httpx.post(url, content=allowed, headers=hdr, timeout=120)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded"), r.text[:300]
    assert httpx.get(pod["url"] + "/healthz", timeout=30).status_code == 200  # the pod is well after all three


def test_healthz_answers_while_a_prompt_is_being_tokenised(pod):
    openai = pod["app"].state.flywheel.openai
    real = openai.prompts
    entered, release = threading.Event(), threading.Event()

    class HeldTokeniser:  # the next completion's tokenising, held busy until released
        def __getattr__(self, name):
            return getattr(real, name)

        def completion_ids(self, body):
            entered.set()
            release.wait(120)
            return real.completion_ids(body)

    got = {}
    asker = threading.Thread(target=lambda: got.update(r=httpx.post(
        pod["url"] + "/v1/completions", json={"model": "flywheel", "prompt": "def add(a, b):", "max_tokens": 1},
        timeout=180)))
    openai.prompts = HeldTokeniser()
    try:
        asker.start()
        assert entered.wait(60), "the request never reached its tokeniser"
        # the tokeniser is provably busy now: the event loop still answers
        assert httpx.get(pod["url"] + "/healthz", timeout=30).status_code == 200
        assert httpx.get(pod["url"] + "/v1/models", timeout=30).status_code == 200
        assert asker.is_alive() and "r" not in got  # (the held request had not been answered)
    finally:
        release.set()
        asker.join(180)
        openai.prompts = real
    assert got["r"].status_code == 200, got["r"].text[:300]


def test_an_overlong_request_id_is_400_not_a_lost_event(pod):
    r = httpx.post(pod["url"] + "/v1/completions", json={"model": "flywheel", "prompt": "x", "max_tokens": 1},
                   headers={"x-request-id": "r" * 300}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id", r.text


def test_a_pod_name_no_event_can_carry_is_refused_at_start():
    """Else every completion event of the pod fails to build and is lost (logged only)."""
    from serving.http.completion_log import CompletionLogger

    for bad, why in (("p" * 257, "at most 256"), ("pod\x00", "NUL"), ("", "at least 1")):
        with pytest.raises(ValueError, match="pod: ") as exc:
            CompletionLogger(None, bad, "flywheel.completions")
        assert why in str(exc.value)
    assert CompletionLogger(None, "p" * 256, "flywheel.completions").pod == "p" * 256
