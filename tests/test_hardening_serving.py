"""Hardening II, serving side, over real HTTP on a real pod (tiny MoE, real Tansu broker):

* defect 3: a vote stamped beyond the clock-skew tolerance is 422 naming ``created_at``; one
  within it reaches Kafka clamped to the pod's clock (``schemas.events.clamp_event_time``);
* defect 4: a 7.5 MB prompt is refused 413 before it is read, and ``/healthz`` answers within
  0.5 s throughout, also while a large-but-allowed prompt is tokenised (off the event loop).
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest

from schemas.settings import topic_names
from schemas.events import MAX_FUTURE_SKEW_MS, FeedbackEvent, now_ms
from tests.test_serving_app import consume

HEALTHZ_BOUND_S = 0.5


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
        yield {"url": srv.url, "bootstrap": b.bootstrap}
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


class _Prober:
    """Polls ``/healthz`` on its own connection every 50 ms; records each answer's latency."""

    def __init__(self, url: str):
        self.url, self.latencies, self.failures = url, [], []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=10) as c:
            while not self._stop.is_set():
                t = time.perf_counter()
                try:
                    ok = c.get(self.url + "/healthz").status_code == 200
                except httpx.HTTPError as exc:
                    ok = False
                    self.failures.append(repr(exc))
                self.latencies.append(time.perf_counter() - t)
                if not ok:
                    self.failures.append("not 200")
                self._stop.wait(0.05)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(15)


def test_huge_prompt_is_413_at_once_and_healthz_never_waits(pod):
    url = pod["url"] + "/v1/completions"
    huge = json.dumps({"model": "flywheel", "prompt": "def add(a, b): return a + b\n" * 268_000,
                       "max_tokens": 1}).encode()
    assert len(huge) > 7_500_000

    def chunks():  # no Content-Length: cut once past the bound while it streams in
        for i in range(0, len(huge), 65536):
            yield huge[i:i + 65536]

    # just under the inference body limit (1 MiB for 8192 prompt tokens): tokenised, in a thread
    allowed = json.dumps({"model": "flywheel", "prompt": "def add(a, b): return a + b\n" * 14_000,
                          "max_tokens": 1}).encode()
    assert 350_000 < len(allowed) < 1024 * 1024
    hdr = {"content-type": "application/json"}
    with _Prober(pod["url"]) as probe:
        time.sleep(0.3)
        took = {}
        for name, body in (("declared", huge), ("chunked", chunks()), ("allowed", allowed)):
            t = time.perf_counter()
            r = httpx.post(url, content=body, headers=hdr, timeout=120)
            took[name] = time.perf_counter() - t
            # a body over the bound: 413 before it is read; a prompt over the allowed tokens: OpenAI's 400 (D77)
            want = (400, "context_length_exceeded") if name == "allowed" else (413, "request_too_large")
            assert (r.status_code, r.json()["error"]["code"]) == want, (name, r.text[:300])
        time.sleep(0.3)
    # the bounds are generous for a shared 2-core machine: before the fix the 413 took 16-18 s
    # and /healthz waited as long
    assert took["declared"] < 3.0 and took["chunked"] < 3.0, took
    assert not probe.failures, probe.failures[:3]
    assert len(probe.latencies) >= 5 and max(probe.latencies) < HEALTHZ_BOUND_S, (max(probe.latencies), took)
    # the allowed prompt kept a tokeniser busy for longer than any probe waited: /healthz had
    # something to wait behind, and did not (on a quiet box it tokenises in ~0.3 s)
    assert took["allowed"] > 2 * max(probe.latencies), (took, max(probe.latencies))


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
