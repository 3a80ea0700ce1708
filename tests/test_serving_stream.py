"""Streaming over real HTTP (uvicorn on a port, httpx as the client) on the torch engine:
a client that disconnects mid-stream aborts its request within one decode step and frees its
row; streamed chunks carry the raw behavior logprobs of their tokens."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from schemas.manifest import BASE_VERSION
from serving.app import create_app
from serving.engine import TorchEngine
from servers import ServerThread
from serving.slots import CheckpointStore, Slots


@pytest.fixture(scope="module")
def served(tiny_moe_dir):
    eng = TorchEngine(tiny_moe_dir, max_batch=8)
    slots = Slots(eng, CheckpointStore(tiny_moe_dir))
    slots.start(BASE_VERSION)
    app = create_app(slots, None, pod="stream-test", salt="s")
    srv = ServerThread(app).start()
    yield eng, srv
    srv.stop()
    eng.close()


def _spy(eng, monkeypatch):
    """Record every GenRequest the app submits, its token count at each abort call, and its
    future."""
    seen = {"reqs": [], "at_abort": [], "futs": []}
    submit, abort = eng.submit, eng.abort

    def spy_submit(req):
        n = [0]
        inner = req.on_step

        def on_step(out):
            n[0] += len(out.token_ids)
            if inner is not None:
                inner(out)

        req.on_step = on_step
        req._count = n
        seen["reqs"].append(req)
        fut = submit(req)
        seen["futs"].append(fut)
        return fut

    def spy_abort(request):
        req = request if not isinstance(request, str) else next(r for r in seen["reqs"] if r.request_id == request)
        seen["at_abort"].append(req._count[0])
        abort(request)

    monkeypatch.setattr(eng, "submit", spy_submit)
    monkeypatch.setattr(eng, "abort", spy_abort)
    return seen


def test_client_disconnect_aborts_within_one_step(served, monkeypatch):
    eng, srv = served
    seen = _spy(eng, monkeypatch)
    monkeypatch.setattr(eng, "eos_id", -1)  # only max_tokens or the abort can end it
    body = {"model": "flywheel", "prompt": "def add(a, b):", "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", srv.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                if got == 3:
                    break
        # leaving the block closes the connection with the body unread: the client is gone
    res = seen["futs"][0].result(60)
    assert res.finish_reason == "abort"
    assert len(res.completion_token_ids) < 900
    assert seen["at_abort"], "the server never aborted the request"
    assert len(res.completion_token_ids) - seen["at_abort"][0] <= 1  # within one decode step
    deadline = time.monotonic() + 10
    while eng.num_running() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.num_running() == 0 and eng.queue_depth() == 0  # its row is freed


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_chunks_carry_logprobs(served, chat):
    """Concatenated over the chunks, the streamed logprobs are the non-streamed response's
    (same greedy tokens, same raw logprobs) and the top-2 per token are there."""
    eng, srv = served
    if chat:
        url = srv.url + "/v1/chat/completions"
        body = {"model": "flywheel", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 12,
                "temperature": 0, "logprobs": True, "top_logprobs": 2}
    else:
        url = srv.url + "/v1/completions"
        body = {"model": "flywheel", "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "logprobs": 2}
    with httpx.Client(timeout=60) as c:
        full = c.post(url, json=body).json()["choices"][0]["logprobs"]
        lps, tops, toks = [], [], []
        with c.stream("POST", url, json=dict(body, stream=True)) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                if lp is None:
                    continue
                if chat:
                    lps += [x["logprob"] for x in lp["content"]]
                    toks += [x["token"] for x in lp["content"]]
                    tops += [len(x["top_logprobs"]) for x in lp["content"]]
                else:
                    lps += lp["token_logprobs"]
                    toks += lp["tokens"]
                    tops += [len(t) for t in lp["top_logprobs"]]
    if chat:
        assert toks == [x["token"] for x in full["content"]]
        assert lps == [x["logprob"] for x in full["content"]]
    else:
        assert toks == full["tokens"] and lps == full["token_logprobs"]
    assert len(lps) >= 1 and set(tops) == {2}


@pytest.mark.parametrize("extra,field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]}, "tools"),
])
def test_torch_engine_refuses_structured_outputs_and_tools(served, extra, field):
    """The torch engine has no structured outputs or tool calls: a clear 400 naming the field
    and the engine that has them; the neutral values still pass."""
    _eng, srv = served
    body = {"model": "flywheel", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    with httpx.Client(timeout=60) as c:
        r = c.post(srv.url + "/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and "vLLM engine" in err["message"] and "torch engine" in err["message"]
        ok = c.post(srv.url + "/v1/chat/completions", json=dict(body, response_format={"type": "text"}, tools=[],
                                                               tool_choice="none"))
        assert ok.status_code == 200, ok.text
