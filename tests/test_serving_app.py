"""The OpenAI-compatible API against a real uvicorn server, a real Tansu broker and the
official ``openai`` client; events are read back from Kafka with kafka-python."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import numpy as np
import openai
import pytest

from schemas.settings import topic_names
from schemas.events import CompletionEvent, FeedbackEvent, hash_user
from schemas.modelspec import load_tokenizer
from serving.pod import build_pod
from servers import ServerThread
from serving.slots import CheckpointStore

SALT = "test-salt-123"


def consume(bootstrap: str, topic: str, want: int, timeout_s: float = 20.0, keys=None) -> list:
    """Records of ``topic`` from the beginning (no consumer group), until ``want`` or timeout;
    with ``keys`` (str set), only records with those keys (and ``want`` counts those)."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                      auto_offset_reset="earliest", consumer_timeout_ms=500)
    parts = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic)]
    c.assign(parts)
    c.seek_to_beginning(*parts)
    out = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(out) < want:
        for recs in c.poll(timeout_ms=300).values():
            out.extend(r for r in recs if keys is None or (r.key or b"").decode() in keys)
    c.close()
    return out


@pytest.fixture(scope="module")
def pod(tiny_moe_dir, tmp_path_factory):
    import os

    from flywheel.broker import spawn

    os.environ["FLYWHEEL_USER_SALT"] = SALT
    b = spawn(die_with_parent=True)
    p = build_pod(CheckpointStore(tiny_moe_dir), pod="pod-test", max_batch=8, bootstrap=b.bootstrap,
                  journal=tmp_path_factory.mktemp("j") / "ev.journal")
    srv = ServerThread(p.app).start()
    yield {"url": srv.url, "bootstrap": b.bootstrap, "pod": p, "tok": load_tokenizer(tiny_moe_dir)}
    srv.stop()
    p.close()
    b.stop()
    os.environ.pop("FLYWHEEL_USER_SALT", None)


@pytest.fixture(scope="module")
def client(pod):
    return openai.OpenAI(base_url=pod["url"] + "/v1", api_key="unused", max_retries=0)


def test_chat_completion_logs_one_event(pod, client):
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    raw = client.chat.completions.with_raw_response.create(
        model="flywheel", messages=msgs, max_tokens=8, temperature=0.7, seed=11, logprobs=True,
        top_logprobs=3, user="alice")
    resp = raw.parse()
    cid = resp.id
    uuid.UUID(cid)
    assert raw.headers["x-flywheel-completion-id"] == cid
    assert raw.headers["x-flywheel-model-version"] == "v000000" == resp.model
    tok = pod["tok"]
    want_prompt = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert resp.usage.prompt_tokens == len(want_prompt)
    lps = [c.logprob for c in resp.choices[0].logprobs.content]
    assert resp.usage.completion_tokens == len(lps) >= 1
    for c in resp.choices[0].logprobs.content:
        assert len(c.top_logprobs) == 3
        assert c.top_logprobs[0].logprob >= c.logprob - 1e-6

    recs = consume(pod["bootstrap"], topic_names().completions, 2, timeout_s=3, keys={cid})
    assert len(recs) == 1
    assert b"alice" not in recs[0].value
    ev = CompletionEvent.from_bytes(recs[0].value)
    assert str(ev.completion_id) == cid and ev.pod == "pod-test" and ev.model_version == "v000000"
    assert ev.user_hash == hash_user("alice", SALT)
    assert ev.prompt_token_ids == want_prompt
    assert tok.decode(ev.completion_token_ids, skip_special_tokens=True) == resp.choices[0].message.content
    np.testing.assert_allclose(ev.behavior_logprobs, lps, rtol=0, atol=1e-6)
    assert ev.sampling.temperature == 0.7 and ev.sampling.seed == 11 and ev.sampling.max_tokens == 8
    assert ev.expert_routes.to_array().shape == (len(want_prompt) + len(lps) - 1, 2, 2)
    assert ev.finish_reason == resp.choices[0].finish_reason


def test_completions_seeded_and_streaming_equal(pod, client):
    kw = dict(model="v000000", prompt="hello world, the quick", max_tokens=10, temperature=1.0, seed=5)
    a = client.completions.create(logprobs=2, **kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    assert len(a.choices[0].logprobs.token_logprobs) == a.usage.completion_tokens
    assert all(len(d) <= 2 for d in a.choices[0].logprobs.top_logprobs)
    # chat streaming with usage == the same request without streaming (greedy)
    msgs = [{"role": "user", "content": "Complete this Python function."}]
    full = client.chat.completions.create(model="flywheel", messages=msgs, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="flywheel", messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c for c in chunks if c.choices and c.choices[0].finish_reason][0].choices[0].finish_reason == \
        full.choices[0].finish_reason


def test_streamed_text_with_a_stop_string_across_tokens_equals_the_answer(pod, client):
    """A stop string whose first characters come in one token and the rest in later ones: the
    stream holds the start back, so its text equals the non-streamed answer (it once leaked the
    start of the stop string)."""
    kw = dict(model="flywheel", prompt="hello world, the quick", max_tokens=16, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    assert len(free) >= 6, free
    tried = 0
    for a in range(1, len(free) - 3):
        stop = free[a:a + 3]
        want = client.completions.create(stop=[stop], **kw).choices[0].text
        got = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **kw)
                      if c.choices)
        assert got == want == free[:free.find(stop)], (stop, got, want)
        tried += 1
    assert tried >= 3


def test_async_client_concurrent_requests_batch(pod):
    aclient = openai.AsyncOpenAI(base_url=pod["url"] + "/v1", api_key="unused", max_retries=0)

    async def go():
        return await asyncio.gather(*[aclient.completions.create(
            model="flywheel", prompt=f"def add(a, b): {i}", max_tokens=6, temperature=0) for i in range(8)])

    res = asyncio.run(go())
    ids = {r.id for r in res}
    assert len(ids) == 8
    recs = consume(pod["bootstrap"], topic_names().completions, 8, keys=ids)
    time.sleep(0.5)
    recs = consume(pod["bootstrap"], topic_names().completions, 9, timeout_s=1, keys=ids)  # a 9th would be a duplicate
    keys = [r.key.decode() for r in recs]
    for i in ids:
        assert keys.count(i) == 1
    body = httpx.get(pod["url"] + "/metrics").text
    # the 8 concurrent requests must have shared at least one batch
    counts = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in body.splitlines()
              if ln.startswith("flywheel_batch_size_bucket")}
    assert counts['flywheel_batch_size_bucket{le="1.0"}'] < counts['flywheel_batch_size_bucket{le="+Inf"}']


def test_feedback_publishes_event(pod, client):
    r = client.chat.completions.create(model="flywheel", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    eid = str(uuid.uuid4())
    out = httpx.post(pod["url"] + "/v1/feedback", json={"completion_id": r.id, "value": -1, "event_id": eid,
                                                        "comment": "wrong", "user": "bob"}).json()
    assert out == {"event_id": eid, "accepted": True, "duplicate": False}
    out2 = httpx.post(pod["url"] + "/v1/feedback", json={"completion_id": r.id, "value": 1},
                      headers={"x-flywheel-user": "carol"}).json()
    uuid.UUID(out2["event_id"])
    recs = consume(pod["bootstrap"], topic_names().feedback, 2, keys={r.id})
    evs = sorted((FeedbackEvent.from_bytes(x.value) for x in recs), key=lambda e: e.value)
    assert [e.value for e in evs] == [-1.0, 1.0]
    assert str(evs[0].event_id) == eid and evs[0].comment == "wrong"
    assert evs[0].user_hash == hash_user("bob", SALT) and evs[1].user_hash == hash_user("carol", SALT)
    m = httpx.get(pod["url"] + "/metrics").text
    assert 'flywheel_version_votes_total{version="v000000",vote="down"} 1.0' in m
    assert 'flywheel_events_accepted_total{kind="thumb"} 2.0' in m


@pytest.mark.parametrize("body,param,status", [
    ({"completion_id": "not-a-uuid", "value": 1}, "completion_id", 400),
    ({"completion_id": str(uuid.uuid4()), "value": 0.5}, "value", 400),
    ({"value": 1}, "completion_id", 400),
    ({"completion_id": str(uuid.uuid4()), "value": 1, "kind": "like"}, "kind", 400),
])
def test_feedback_errors_name_the_field(pod, body, param, status):
    r = httpx.post(pod["url"] + "/v1/feedback", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
    assert "user_hash" not in err["message"] and f"{param}: {param}:" not in err["message"]


def test_feedback_kind_rule_error_says_the_value_once(pod):
    r = httpx.post(pod["url"] + "/v1/feedback", json={"completion_id": str(uuid.uuid4()), "kind": "followup",
                                                      "value": 0})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert msg.startswith("value: a followup is +1") and msg.count("got") == 1, msg


@pytest.mark.parametrize("extra,param,status", [
    ({"temperature": 5}, "temperature", 400),
    ({"top_p": 0}, "top_p", 400),
    ({"n": 0}, "n", 400),
    ({"n": 17}, "n", 400),
    ({"max_tokens": 0}, "max_tokens", 400),
    ({"logit_bias": {"5": 10}}, "logit_bias", 400),
    ({"messages": []}, "messages", 400),
    ({"messages": [{"role": "user", "content": "x " * 2000}]}, "messages", 400),
])
def test_chat_errors_openai_shape(pod, extra, param, status):
    body = {"model": "flywheel", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body.update(extra)
    r = httpx.post(pod["url"] + "/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"]
    if err.get("code") == "context_length_exceeded":  # OpenAI's 400 (D77); the counts as numbers
        assert "maximum context length is 1024 tokens" in err["message"] and "got '" not in err["message"], err


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="flywheel", messages=[{"role": "user", "content": "hi"}], temperature=3)
    assert ei.value.body["param"] == "temperature"


def test_models_health_metrics(pod, client):
    assert [m.id for m in client.models.list().data] == ["flywheel", "v000000"]
    h = httpx.get(pod["url"] + "/healthz").json()
    assert h["ok"] and h["stable"] == "v000000" and h["kafka_up"] is True
    m = httpx.get(pod["url"] + "/metrics").text
    for name in ('flywheel_e2e_request_latency_seconds_bucket{le="0.01",model_name="flywheel",version="v000000"}',
                 'flywheel_time_to_first_token_seconds_count{model_name="flywheel",version="v000000"}',
                 'flywheel_generation_tokens_total{model_name="flywheel",version="v000000"}',
                 'flywheel_prompt_tokens_total{model_name="flywheel",version="v000000"}',
                 'flywheel_request_success_total{finished_reason="length",model_name="flywheel",version="v000000"}',
                 'flywheel_num_requests_running{model_name="flywheel"}',
                 'flywheel_num_requests_waiting{model_name="flywheel"} 0.0',
                 "flywheel_version_requests_total", "flywheel_eventlog_events_total",
                 "process_resident_memory_bytes", "process_cpu_seconds_total", "flywheel_swap_pause_seconds"):
        assert name in m, name
    assert 'flywheel_requests_total{endpoint="/v1/chat/completions",status="400"}' in m
    assert 'flywheel_requests_total{endpoint="/v1/chat/completions",status="413"}' not in m  # a long prompt is 400
    sent = [ln for ln in m.splitlines() if ln.startswith('flywheel_eventlog_events_total{state="sent"}')]
    assert float(sent[0].split()[-1]) >= 1
    assert json.loads(json.dumps(h))  # JSON-serialisable


def test_64_concurrent_requests_all_have_complete_routes(pod):
    aclient = openai.AsyncOpenAI(base_url=pod["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def go():
        return await asyncio.gather(*[aclient.chat.completions.create(
            model="flywheel", messages=[{"role": "user", "content": "fox " * (1 + i % 7)}], max_tokens=1 + i % 5,
            temperature=1.0, seed=i) for i in range(64)])

    res = asyncio.run(go())
    ids = {r.id: r for r in res}
    assert len(ids) == 64
    recs = consume(pod["bootstrap"], topic_names().completions, 64, keys=set(ids))
    assert len(recs) == 64
    for x in recs:
        ev = CompletionEvent.from_bytes(x.value)
        r = ids[str(ev.completion_id)]
        assert len(ev.completion_token_ids) == r.usage.completion_tokens
        arr = ev.expert_routes.to_array()
        assert arr.shape == (len(ev.prompt_token_ids) + len(ev.completion_token_ids) - 1, 2, 2)
        assert arr.max() < 4 and (arr[:, :, 0] != arr[:, :, 1]).all()  # top-2 of 4 distinct experts


def test_api_keys(pod):
    from serving.app import create_app

    app = create_app(pod["pod"].slots, None, pod="keys", salt="x", api_keys={"k1", "k2"})
    srv = ServerThread(app).start()
    try:
        body = {"model": "flywheel", "prompt": "hello", "max_tokens": 2}
        r = httpx.post(srv.url + "/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.post(srv.url + "/v1/completions", json=body,
                          headers={"Authorization": "Bearer k3"}).status_code == 401  # OpenAI: wrong key is 401
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="k2", max_retries=0)
        assert c.completions.create(**body).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="bad", max_retries=0).models.list()
    finally:
        srv.stop()


def test_stop_string(pod, client):
    kw = dict(model="flywheel", prompt="the quick brown", max_tokens=12, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    if len(full) < 6:
        pytest.skip("greedy output too short to cut")
    stop = full[3:6]
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == full[:full.find(stop)] and cut.finish_reason == "stop"


def test_stream_disconnect_still_logs_exactly_one_event(pod):
    body = {"model": "flywheel", "prompt": "hello", "max_tokens": 400, "temperature": 1.0, "seed": 3, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", pod["url"] + "/v1/completions", json=body) as r:
            cid = r.headers["x-flywheel-completion-id"]
            for i, _ in enumerate(r.iter_lines()):
                if i >= 2:
                    break
    recs = consume(pod["bootstrap"], topic_names().completions, 2, timeout_s=3, keys={cid})  # waits for a duplicate
    assert len(recs) == 1
    ev = CompletionEvent.from_bytes(recs[0].value)
    assert ev.finish_reason in ("abort", "stop") and len(ev.completion_token_ids) < 400


def test_non_streamed_request_whose_client_leaves_is_aborted(pod):
    """A JSON (non-streamed) request whose client goes away is aborted (vLLM's server's
    ``with_cancellation``): the engine frees its row within moments, not after 400 tokens, and
    its one event is logged with finish_reason abort."""
    import time

    eng = pod["pod"].engine
    body = {"model": "flywheel", "prompt": "hello", "max_tokens": 400, "temperature": 1.0, "seed": 4}
    rid = f"leaver-{time.monotonic_ns()}"
    saved, eng.eos_id = eng.eos_id, -1  # it would run all 400 tokens if nobody aborted it
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(pod["url"] + "/v1/completions", json=body, headers={"x-request-id": rid}, timeout=0.5)
        deadline = time.monotonic() + 10
        while eng.num_running() or eng.queue_depth():
            assert time.monotonic() < deadline, "the abandoned request still runs"
            time.sleep(0.05)
    finally:
        eng.eos_id = saved
    for _ in range(5):  # the event is produced after the abort, off the event loop
        recs = [r for r in consume(pod["bootstrap"], topic_names().completions, 1000, timeout_s=3)
                if CompletionEvent.from_bytes(r.value).request_id == rid]
        if recs:
            break
    assert len(recs) == 1
    ev = CompletionEvent.from_bytes(recs[0].value)
    assert ev.finish_reason == "abort" and 0 < len(ev.completion_token_ids) < 400


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", b"{not json", None),
    ("/v1/chat/completions", {"model": "flywheel", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"model": "flywheel", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000},
     "messages"),  # prompt + max_tokens over the context: OpenAI names the messages (D77)
    ("/v1/chat/completions", {"model": "flywheel", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/completions", {"model": "flywheel", "prompt": [99999]}, "prompt"),
    ("/v1/completions", {"model": "flywheel", "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"model": "flywheel", "prompt": "hi", "echo": True}, "echo"),
    ("/v1/completions", {"model": "flywheel", "prompt": "hi", "top_k": -5}, "top_k"),
])
def test_client_mistakes_are_400(pod, path, body, param):
    if isinstance(body, bytes):
        r = httpx.post(pod["url"] + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(pod["url"] + path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_n_choices_are_separate_completions(pod, client):
    kw = dict(model="flywheel", prompt="the quick brown", max_tokens=6, temperature=1.0, seed=7)
    raw = client.completions.with_raw_response.create(n=3, logprobs=0, **kw)
    r = raw.parse()
    assert [c.index for c in r.choices] == [0, 1, 2]
    cids = [c.completion_id for c in r.choices]  # extra field, kept by the openai client
    assert len(set(cids)) == 3 and r.id == cids[0] == raw.headers["x-flywheel-completion-id"]
    assert raw.headers["x-flywheel-completion-ids"] == ",".join(cids)
    assert r.usage.completion_tokens == sum(len(c.logprobs.token_logprobs) for c in r.choices)
    for i, c in enumerate(r.choices):  # choice i == a single request seeded seed + i
        assert client.completions.create(**{**kw, "seed": 7 + i}).choices[0].text == c.text
    recs = consume(pod["bootstrap"], topic_names().completions, 4, timeout_s=3, keys=set(cids))
    evs = {str(e.completion_id): e for e in (CompletionEvent.from_bytes(x.value) for x in recs)}
    assert len(recs) == 3 and set(evs) == set(cids)
    for i, c in enumerate(r.choices):
        assert evs[c.completion_id].sampling.seed == 7 + i
        np.testing.assert_allclose(evs[c.completion_id].behavior_logprobs, c.logprobs.token_logprobs, atol=1e-6)
    # feedback targets one choice
    assert httpx.post(pod["url"] + "/v1/feedback", json={"completion_id": cids[2], "value": 1}).status_code == 200
    # chat streaming, n=2: per-index text equals the non-streamed n=2 answer
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    ckw = dict(model="flywheel", messages=msgs, max_tokens=8, temperature=1.0, seed=3, n=2)
    full = client.chat.completions.create(**ckw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ckw))
    for i in range(2):
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert got == full.choices[i].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    by_index = {(c.choices[0].index, c.choices[0].completion_id) for c in chunks if c.choices}
    assert len(by_index) == 2 and (0, chunks[0].id) in by_index  # one id per choice; id = choice 0's
    assert {c.id for c in chunks} == {chunks[0].id}


def test_per_version_canary_metrics(tiny_moe_dir):
    """errors / latency / tokens per version, on a private engine with an injected fault."""
    from serving.app import create_app
    from serving.engine import TorchEngine
    from serving.slots import Slots

    eng = TorchEngine(tiny_moe_dir, max_batch=2, max_queue=1)
    slots = Slots(eng, CheckpointStore(tiny_moe_dir))
    slots.start("v000000")

    def boom(*_a):
        raise RuntimeError("injected fault")

    h = slots.stable.model.register_forward_hook(boom)
    srv = ServerThread(create_app(slots, None, pod="m", salt="x")).start()
    body = {"model": "flywheel", "prompt": "hello", "max_tokens": 3, "temperature": 0}
    try:
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 500
        h.remove()
        ok = httpx.post(srv.url + "/v1/completions", json=body, timeout=30).json()
        m = httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
        eng.close()
    assert 'flywheel_version_errors_total{version="v000000"} 1.0' in m
    assert 'flywheel_version_requests_total{version="v000000"} 2.0' in m  # failed one included
    assert f'flywheel_version_tokens_total{{version="v000000"}} {float(ok["usage"]["completion_tokens"])}' in m
    assert 'flywheel_version_latency_seconds_count{version="v000000"} 1.0' in m
    assert 'flywheel_version_latency_seconds_bucket{le="+Inf",version="v000000"} 1.0' in m
