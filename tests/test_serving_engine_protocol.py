"""One serving path (issue 21 item 4): the serving classes drive every engine through its async
protocol (:class:`serving.engine_base.Engine`: ``generate``, ``abort``, ``check_health``), never
``submit``; the protocol module is a drop-in for the class in ``serving/engine.py``; ``n``
choices are admitted all or none."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from schemas.events import SamplingParams
from schemas.manifest import BASE_VERSION
from serving.app import create_app
from serving.engine import TorchEngine
from serving.engine_base import Engine, LoopInbox
from serving.params import GenRequest
from servers import ServerThread
from serving.slots import CheckpointStore, Slots


class GenerateOnly(Engine):
    """An engine whose ``submit`` fails: whoever drives it must go through ``generate``,
    ``abort`` and ``check_health``. ``generate`` is the protocol's own, run on ``inner`` (a
    :class:`TorchEngine`); every other attribute is ``inner``'s."""

    def __init__(self, inner: TorchEngine):
        self.inner = inner
        self.generated: list[tuple[str, bool]] = []  # (request_id, final_only) per generate call
        self.aborted: list = []
        self.health_checks = 0

    def __getattr__(self, name):  # tokenizer, eos_id, pad_id, max_positions (set at load)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def submit(self, req):
        raise AssertionError("a serving class called Engine.submit")

    async def generate(self, req, *, final_only: bool = False):
        self.generated.append((req.request_id, final_only))
        async for out in Engine.generate(self.inner, req, final_only=final_only):
            yield out

    def abort(self, request):
        self.aborted.append(request)
        self.inner.abort(request)

    def check_health(self) -> dict:
        self.health_checks += 1
        return self.inner.check_health()

    def load_weights(self, state, version, expected_hashes=None):
        return self.inner.load_weights(state, version, expected_hashes=expected_hashes)

    def pause(self) -> None:
        self.inner.pause()

    def resume(self) -> None:
        self.inner.resume()

    def close(self) -> None:
        self.inner.close()

    def queue_depth(self) -> int:
        return self.inner.queue_depth()

    def num_running(self) -> int:
        return self.inner.num_running()


def _sse_texts(lines) -> dict[int, str]:
    """Text per choice index of an SSE completion stream (``[DONE]`` required)."""
    out: dict[int, str] = {}
    done = False
    for line in lines:
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                d = c.get("delta", {}).get("content") if "delta" in c else c.get("text")
                out[c["index"]] = out.get(c["index"], "") + (d or "")
    assert done
    return out


@pytest.fixture(scope="module")
def served(tiny_moe_dir):
    eng = GenerateOnly(TorchEngine(tiny_moe_dir, max_batch=4))
    slots = Slots(eng, CheckpointStore(tiny_moe_dir))
    slots.start(BASE_VERSION)
    app = create_app(slots, None, pod="protocol-test", salt="s")
    logged: list = []
    log = app.state.flywheel.completions_log
    submit = log.submit

    def spy(*a, **kw):
        logged.append(a)
        return submit(*a, **kw)

    log.submit = spy
    srv = ServerThread(app).start()
    yield eng, srv, logged
    srv.stop()
    eng.close()


def test_serving_drives_the_engine_through_generate_only(served):
    """JSON, streamed text and streamed chat, n=2, over a real port on an engine whose submit
    raises: every choice runs through ``generate`` (JSON answers with ``final_only``), and
    ``/healthz`` through ``check_health``."""
    eng, srv, logged = served
    eng.generated.clear()
    before = len(logged)
    with httpx.Client(timeout=60) as c:
        body = {"model": "flywheel", "prompt": "def add(a, b):", "max_tokens": 5, "temperature": 0, "n": 2}
        r = c.post(srv.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        texts = [ch["text"] for ch in r.json()["choices"]]
        assert len(texts) == 2 and texts[0] == texts[1]  # greedy: both choices alike
        with c.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            streamed = _sse_texts(s.iter_lines())
        assert streamed == {0: texts[0], 1: texts[1]}  # the same tokens, streamed
        chat = {"model": "flywheel", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "temperature": 0, "stream": True, "n": 2}
        with c.stream("POST", srv.url + "/v1/chat/completions", json=chat) as s:
            assert s.status_code == 200
            assert set(_sse_texts(s.iter_lines())) == {0, 1}
        checks = eng.health_checks
        assert c.get(srv.url + "/healthz").status_code == 200 and eng.health_checks == checks + 1
    assert [f for _rid, f in eng.generated] == [True, True, False, False, False, False]
    assert len(logged) - before == 6  # one completion event per choice


def test_client_gone_mid_stream_aborts_through_the_protocol(served, monkeypatch):
    """A streaming client that leaves: the choice is aborted by ``engine.abort`` and still
    logged once, with finish reason ``abort``."""
    eng, srv, logged = served
    before, aborts = len(logged), len(eng.aborted)
    monkeypatch.setattr(eng.inner, "eos_id", -1)  # only max_tokens or the abort can end it
    body = {"model": "flywheel", "prompt": "def add(a, b):", "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", srv.url + "/v1/completions", json=body) as s:
            assert s.status_code == 200
            got = 0
            for line in s.iter_lines():
                got += line.startswith("data: {")
                if got == 3:
                    break
    deadline = time.monotonic() + 30
    while len(logged) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(logged) == before + 1 and len(eng.aborted) > aborts
    res = logged[-1][5]
    assert res.finish_reason == "abort" and len(res.completion_token_ids) < 900


def test_n_choices_are_admitted_all_or_none(tiny_moe_dir):
    """n=2 with room for one: 429 ``queue_full``, the admitted choice is aborted before it
    makes a token, nothing is logged, both choices count as errors of the version."""
    eng = TorchEngine(tiny_moe_dir, max_batch=1, max_queue=1, threads=1)
    slots = Slots(eng, CheckpointStore(tiny_moe_dir))
    slots.start(BASE_VERSION)
    app = create_app(slots, None, pod="q", salt="s")
    logged: list = []
    log = app.state.flywheel.completions_log
    log.submit = lambda *a, **kw: logged.append(a)
    srv = ServerThread(app).start()
    eng.pause()  # nothing leaves the queue: choice 0 takes its one place, choice 1 finds it full
    try:
        body = {"model": "flywheel", "prompt": "hi", "max_tokens": 2, "n": 2}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "queue_full"
        waiting = list(eng.sched.pending)
        assert len(waiting) <= 1 and all(it.req.cancelled.is_set() for it in waiting)  # aborted, not run
        eng.resume()
        deadline = time.monotonic() + 30
        while (eng.queue_depth() or eng.num_running()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.queue_depth() == 0 and eng.num_running() == 0
        for it in waiting:
            res = it.fut.result(10)
            assert res.finish_reason == "abort" and res.completion_token_ids == []
        m = httpx.get(srv.url + "/metrics").text
        assert 'flywheel_version_errors_total{version="v000000"} 2.0' in m
        assert 'flywheel_version_requests_total{version="v000000"} 2.0' in m
        ok = httpx.post(srv.url + "/v1/completions", json={**body, "n": 1}, timeout=30)
        assert ok.status_code == 200, ok.text
        assert len(logged) == 1  # only the later request's choice
    finally:
        eng.resume()
        srv.stop()
        eng.close()


def test_generate_hands_steps_over_in_bursts_and_final_only(tiny_moe_dir):
    """The protocol's own ``generate`` on 6 concurrent requests: every step arrives, in order;
    every step the engine emits while the event loop is busy reaches the loop in the one
    wake-up already scheduled (here: the loop is held while the engine runs all 6 requests, so
    all of their outputs arrive in exactly one wake-up); ``final_only`` yields the result alone,
    with no per-step hand-off, while ``on_step`` still sees every step on the engine's thread.

    The loop is held by a blocking wait on the engine's last done callback, not by a sleep, so
    the count of wake-ups does not depend on how the OS interleaves the two threads."""
    inner = TorchEngine(tiny_moe_dir, max_batch=8)
    base = inner.load_base(BASE_VERSION)
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    n_req = 6
    wakes = {"n": 0}
    puts: list = []  # (queue, item) per LoopInbox.put, in call order (engine thread)
    all_done = threading.Event()

    async def main():
        inbox = LoopInbox.of(asyncio.get_running_loop())
        drain, put = inbox._drain, inbox.put

        def counted_drain():
            wakes["n"] += 1
            drain()

        def counted_put(q, item):
            puts.append((q, item))
            put(q, item)
            if sum(1 for _q, it in puts if it is None) == n_req:
                all_done.set()  # after the put: every item is in the inbox
        inbox._drain, inbox.put = counted_drain, counted_put

        async def one(p):
            return [o async for o in Engine.generate(inner, GenRequest(prompt_token_ids=p, sampling=sp, model=base))]

        inner.pause()  # nothing is emitted until every request is queued and the loop is held
        tasks = [asyncio.create_task(one([5, 6, 7 + i])) for i in range(n_req)]
        while inner.queue_depth() < n_req:  # each task submits at its first step
            await asyncio.sleep(0)
        inner.resume()
        # hold the loop (a blocking wait on the loop's thread) until every request has ended
        # and its last item is in the inbox
        assert all_done.wait(120), "the engine did not finish 6 requests of 12 tokens in 120 s"
        assert wakes["n"] == 0
        streams = await asyncio.gather(*tasks)
        burst_wakes = wakes["n"]

        seen: list = []
        req = GenRequest(prompt_token_ids=[5, 6, 7], sampling=sp, model=base, on_step=seen.append)
        n_puts = len(puts)
        finals = [o async for o in Engine.generate(inner, req, final_only=True)]
        return streams, burst_wakes, finals, seen, puts[n_puts:]

    old_eos = inner.eos_id
    inner.eos_id = -1
    try:
        streams, burst_wakes, finals, seen, final_puts = asyncio.run(main())
    finally:
        inner.eos_id = old_eos
        inner.close()
    outputs = 0
    for outs in streams:
        res = outs[-1].result
        assert outs[-1].finished and [t for o in outs[:-1] for t in o.token_ids] == res.completion_token_ids
        assert len(res.completion_token_ids) == 12  # eos disabled: max_tokens ends every request
        outputs += len(outs)
    assert outputs == len(puts) - len(final_puts) > n_req  # one put per step and one per end
    assert burst_wakes == 1  # every output of every request: one loop wake-up
    assert len(finals) == 1 and finals[0].finished
    assert [item for _q, item in final_puts] == [None]  # final_only: no per-step hand-off
    assert [t for o in seen for t in o.token_ids] == finals[0].result.completion_token_ids
    assert finals[0].result.completion_token_ids == streams[0][-1].result.completion_token_ids


def test_loop_inbox_of_is_one_per_loop():
    a = asyncio.new_event_loop()
    b = asyncio.new_event_loop()
    try:
        assert LoopInbox.of(a) is LoopInbox.of(a) and LoopInbox.of(a) is not LoopInbox.of(b)
    finally:
        a.close()
        b.close()
    q: asyncio.Queue = asyncio.Queue()
    LoopInbox.of(a).put(q, 1)  # a closed loop: dropped, never raises on the engine's thread
    assert q.qsize() == 0
