"""The HTTP layer's edges on a real uvicorn server, a real Tansu broker and the tiny MoE:
auth before the body (401/403, feedback-only keys), lone surrogates and non-finite numbers
refused naming the field (and the keep-alive connection survives), 404 model_not_found,
Retry-After on 429, the feedback batch / score / metadata / idempotency contract of
docs/sdk.md, the train/eval split of completions, and ``promtool check metrics`` on the
real /metrics output."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import subprocess
import threading
import time
import uuid

import httpx
import openai
import pytest

from schemas.settings import topic_names
from schemas.events import CompletionEvent, FeedbackEvent
from serving.app import create_app
from serving.engine import TorchEngine
from serving.eventlog import EventLog
from servers import ServerThread
from serving.slots import CheckpointStore, Slots
from tests.test_serving_app import consume

API, FB, ADMIN = "k-api", "k-fb", "adm-token"
H_API = {"Authorization": f"Bearer {API}"}
H_FB = {"Authorization": f"Bearer {FB}"}
H_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def env(tiny_moe_dir, tmp_path_factory):
    from flywheel.broker import spawn

    b = spawn()
    eng = TorchEngine(tiny_moe_dir, max_batch=4, threads=1)
    slots = Slots(eng, CheckpointStore(tiny_moe_dir))
    slots.start("v000000")
    ev = EventLog(b.bootstrap, tmp_path_factory.mktemp("j") / "ev.journal")
    app = create_app(slots, ev, pod="pod-http", salt="s", api_keys={API}, feedback_keys={FB}, admin_token=ADMIN,
                     eval_share=0.5, cors_origins=[ORIGIN])
    srv = ServerThread(app).start()
    yield {"url": srv.url, "bootstrap": b.bootstrap, "slots": slots, "engine": eng, "host": srv.host,
           "port": srv.port}
    srv.stop()
    ev.close()
    eng.close()
    b.stop()


def post(env, path, body=None, headers=H_API, raw: str | None = None) -> httpx.Response:
    if raw is not None:
        return httpx.post(env["url"] + path, content=raw.encode(), timeout=60,
                          headers={**headers, "content-type": "application/json"})
    return httpx.post(env["url"] + path, json=body, headers=headers, timeout=60)


def completion(env, **kw) -> dict:
    r = post(env, "/v1/completions", {"model": "flywheel", "prompt": "hello there", "max_tokens": 2,
                                      "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------- auth
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, H_ADMIN], ids=["none", "wrong", "admin"])
@pytest.mark.parametrize("raw", ['{"model": "flywheel", "prompt": "\\ud800"}', "{not json", '{"prompt": 5}'])
def test_unauthenticated_bad_body_is_401(env, headers, raw):
    r = post(env, "/v1/completions", headers=headers, raw=raw)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"


def test_feedback_only_key_posts_feedback_and_nothing_else(env):
    cid = completion(env)["id"]
    assert post(env, "/v1/feedback", {"completion_id": cid, "value": 1}, headers=H_FB).status_code == 200
    r = post(env, "/v1/feedback/batch", {"events": [{"completion_id": cid, "value": -1}]}, headers=H_FB)
    assert r.status_code == 200 and r.json()["accepted"] == 1
    for path, body in [("/v1/completions", {"model": "flywheel", "prompt": "hi"}),
                       ("/v1/chat/completions", {"model": "flywheel", "messages": [{"role": "user", "content": "x"}]})]:
        r = post(env, path, body, headers=H_FB)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    assert httpx.get(env["url"] + "/v1/models", headers=H_FB).status_code == 403
    with pytest.raises(openai.PermissionDeniedError):
        openai.OpenAI(base_url=env["url"] + "/v1", api_key=FB, max_retries=0).completions.create(
            model="flywheel", prompt="hi", max_tokens=1)
    for method, path in [("GET", "/admin/slots"), ("POST", "/admin/promote"), ("POST", "/admin/rollback")]:
        assert httpx.request(method, env["url"] + path, headers=H_FB).status_code == 401
    assert httpx.get(env["url"] + "/admin/slots", headers=H_ADMIN).status_code == 200
    assert httpx.get(env["url"] + "/admin/slots", headers=H_API).status_code == 401


def test_a_browser_page_posts_feedback_with_a_feedback_key(env):
    """CORS: the preflight (no token) is answered before auth; the POST carries the key."""
    pre = httpx.options(env["url"] + "/v1/feedback", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    cid = completion(env)["id"]
    r = post(env, "/v1/feedback", {"completion_id": cid, "value": 1}, headers={**H_FB, "Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(env["url"] + "/v1/feedback", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


# ---------------------------------------------------------------------------- bad values
def _raw_keepalive(env, requests: list[str]) -> list[tuple[int, dict, bytes]]:
    """Send HTTP/1.1 requests one after the other on ONE TCP connection; return each
    response's (status, headers, body). Raises if the server closes the connection early."""
    out = []
    with socket.create_connection((env["host"], env["port"]), timeout=60) as s:
        f = s.makefile("rb")
        for body in requests:
            data = body.encode()
            s.sendall(f"POST /v1/{'chat/completions' if 'messages' in body else 'completions'} HTTP/1.1\r\n"
                      f"Host: x\r\nAuthorization: Bearer {API}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            status_line = f.readline()
            assert status_line, "the server closed the connection"
            status = int(status_line.split()[1])
            headers = {}
            while (line := f.readline()) not in (b"\r\n", b""):
                k, v = line.decode().split(":", 1)
                headers[k.strip().lower()] = v.strip()
            out.append((status, headers, f.read(int(headers["content-length"]))))
    return out


@pytest.mark.parametrize("raw,param", [
    ('{"model": "flywheel", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages.0.content"),
    ('{"model": "flywheel", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", '
     '"text": "\\udfff"}]}]}', "messages.0.content.0.text"),
    ('{"model": "flywheel", "max_tokens": 2, "prompt": "\\ud800"}', "prompt"),
    ('{"model": "flywheel", "max_tokens": 2, "prompt": ["\\ud83d"]}', "prompt.0"),
    ('{"model": "flywheel", "max_tokens": 2, "prompt": "x", "stop": ["\\ud800"]}', "stop.0"),
])
def test_lone_surrogate_is_400_naming_the_field_and_keeps_the_connection(env, raw, param):
    ok = '{"model": "flywheel", "prompt": "hello", "max_tokens": 1}'
    (st, h, body), (st2, _, body2) = _raw_keepalive(env, [raw, ok])
    err = json.loads(body)["error"]
    assert st == 400 and err["param"] == param and "surrogate" in err["message"], body
    assert h.get("connection") != "close"
    assert st2 == 200 and json.loads(body2)["usage"]["completion_tokens"] == 1


def test_internal_error_keeps_the_connection(env):
    """An engine fault is a 500 in the OpenAI shape and the next request on the same
    connection is served."""
    lm = env["slots"].stable

    def boom(*_a):
        raise RuntimeError("injected fault")

    h = lm.model.register_forward_hook(boom)
    try:
        ok = '{"model": "flywheel", "prompt": "hello", "max_tokens": 1}'
        first = _raw_keepalive(env, [ok])
    finally:
        h.remove()
    (st, _, body), = first
    assert st == 500 and json.loads(body)["error"]["type"] == "server_error"
    (st, _, _), (st2, _, _) = _raw_keepalive(env, [ok, ok])
    assert st == st2 == 200


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", '{"model": "flywheel", "prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"model": "flywheel", "prompt": "x", "top_p": Infinity}', "top_p"),
    ("/v1/chat/completions", '{"model": "flywheel", "messages": [{"role": "user", "content": "x"}], '
                             '"temperature": -Infinity}', "temperature"),
    ("/v1/completions", '{"model": "flywheel", "prompt": "x", "presence_penalty": NaN}', "presence_penalty"),
    ("/v1/completions", '{"model": "flywheel", "prompt": "x", "max_tokens": 1e999}', "max_tokens"),
    ("/v1/feedback", '{"completion_id": "00000000-0000-4000-8000-000000000001", "value": NaN}', "value"),
    ("/v1/feedback", '{"completion_id": "00000000-0000-4000-8000-000000000002", "kind": "score", "name": "q", '
                     '"value": Infinity}', "value"),
    ("/v1/feedback", '{"completion_id": "00000000-0000-4000-8000-000000000003", "value": true}', "value"),
    ("/v1/completions", '{"model": "flywheel", "prompt": "x", "temperature": true}', "temperature"),
    ("/v1/completions", '{"model": "flywheel", "prompt": "x", "n": true}', "n"),
    # a string is not a vote
    ("/v1/feedback", '{"completion_id": "00000000-0000-4000-8000-000000000004", "value": "1"}', "value"),
    ("/v1/completions", '{"model": "flywheel", "prompt": "x", "temperature": "0.7"}', "temperature"),
    ("/v1/completions", '{"model": "flywheel", "prompt": [true, 5]}', "prompt"),  # true is not token id 1
    ("/v1/completions", '{"model": "flywheel", "prompt": [[5, false]]}', "prompt"),
    ("/v1/completions", '{"model": "flywheel", "prompt": "x", "stream": 1}', "stream"),
    ("/v1/completions", '{"model": "flywheel", "prompt": "x", "stream": true, "stream_options": '
                        '{"include_usage": "yes"}}', "stream_options.include_usage"),
])
def test_non_finite_and_boolean_numbers_are_400_naming_the_field(env, path, raw, param):
    r = post(env, path, raw=raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ":"), err


@pytest.mark.parametrize("path,body,param,says", [
    ("/v1/completions", {"model": "flywheel", "prompt": 5}, "prompt", "must be one of str, list[int]"),
    ("/v1/completions", {"model": "flywheel", "prompt": "x", "stop": 7}, "stop", "must be one of str, list[str]"),
    ("/v1/chat/completions", {"model": "flywheel", "messages": [{"role": "user", "content": 5}]},
     "messages.0.content", "must be one of str"),
    ("/v1/completions", {"model": "flywheel", "prompt": "x", "metadata": {"str": 1}}, "metadata.str", "string"),
    ("/v1/chat/completions", {"model": "flywheel", "messages": [{"role": "user"}]}, "messages.0.content",
     "is required for a user message"),
    ("/v1/chat/completions", {"model": "flywheel", "messages": [{"role": "system", "content": "s"},
                                                               {"role": "user", "content": None}]},
     "messages.1.content", "is required for a user message"),
    ("/v1/completions", {"model": "flywheel", "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options", "only allowed with stream: true"),
    ("/v1/chat/completions", {"model": "flywheel", "messages": [{"role": "user", "content": "x"}],
                              "stream": False, "stream_options": {}}, "stream_options", "only allowed with stream"),
])
def test_wrong_types_name_the_field_not_the_union_member(env, path, body, param, says):
    r = post(env, path, body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and says in err["message"], err


@pytest.mark.parametrize("path,key", [("/v1/completions", H_API), ("/v1/feedback", H_FB)])
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
def test_json_under_another_content_type_is_400_saying_so(env, path, key, ctype):
    """Valid JSON sent as text/plain (curl -d without -H, a browser's simple request) gets a
    400 that names the content type, not "Input should be a valid dictionary"."""
    body = (b'{"model": "flywheel", "prompt": "x", "max_tokens": 1}' if path == "/v1/completions"
            else b'{"completion_id": "00000000-0000-4000-8000-000000000000", "value": 1}')
    headers = {**key, **({"content-type": ctype} if ctype else {})}
    r = httpx.post(env["url"] + path, content=body, headers=headers, timeout=60)
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "content-type application/json" in msg, r.text
    assert (repr(ctype) if ctype else "no content-type") in msg, msg


def test_admin_bodies(env):
    r = httpx.post(env["url"] + "/admin/rollback", json={"version": ""}, headers=H_ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "version"
    for path in ("/admin/load", "/admin/rollback"):  # not a version name: 400 naming it, never a path lookup
        r = httpx.post(env["url"] + path, json={"version": "../../etc"}, headers=H_ADMIN)
        assert r.status_code == 400 and r.json()["error"]["param"] == "version", r.text
    r = httpx.post(env["url"] + "/admin/load", json={"version": "v000099"}, headers=H_ADMIN)
    assert r.status_code == 409, r.text  # not in the store: refused, slots unchanged
    # the store's reason as a sentence, not the KeyError's repr ("KeyError: \"version ...\"")
    assert r.json()["detail"] == "cannot load v000099: KeyError: version 'v000099' not in store (only v000000)", r.text
    for raw in (b'{"candidate_weight": NaN}', b'{"candidate_weight": true}', b'{"candidate_weight": "1"}'):
        # a boolean or a string is not a share: `true` was read as 1.0 (every user to the candidate)
        r = httpx.post(env["url"] + "/admin/weight", content=raw,
                       headers={**H_ADMIN, "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "candidate_weight", (raw, r.text)
    assert httpx.get(env["url"] + "/admin/slots", headers=H_ADMIN).json()["stable"]["version"] == "v000000"


def test_body_over_the_bound_is_413_after_auth(env):
    srv = ServerThread(create_app(env["slots"], None, pod="small", salt="s", api_keys={API},
                                  max_body_bytes=2000)).start()
    try:
        big = {"model": "flywheel", "prompt": "x" * 3000, "max_tokens": 1}
        r = httpx.post(srv.url + "/v1/completions", json=big, headers=H_API)  # Content-Length: refused at once
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

        def chunks():  # no Content-Length: counted as it streams in
            yield b'{"model": "flywheel", "prompt": "'
            for _ in range(10):
                yield b"x" * 500
            yield b'"}'

        r = httpx.post(srv.url + "/v1/completions", content=chunks(),
                       headers={**H_API, "content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert httpx.post(srv.url + "/v1/completions", json=big).status_code == 401  # auth first
        ok = httpx.post(srv.url + "/v1/completions", json={**big, "prompt": "x" * 100}, headers=H_API)
        assert ok.status_code == 200
    finally:
        srv.stop()


# ---------------------------------------------------------------------------- OpenAI conventions
def test_unknown_model_is_404_model_not_found(env):
    r = post(env, "/v1/completions", {"model": "gpt-4o", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404
    assert r.json()["error"] | {"message": None} == {"message": None, "type": "invalid_request_error",
                                                     "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=env["url"] + "/v1", api_key=API, max_retries=0).chat.completions.create(
            model="v999999", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    r = post(env, "/v1/completions", {"model": "v000000", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.headers["x-flywheel-model-version"] == "v000000"
    ids = [m["id"] for m in httpx.get(env["url"] + "/v1/models", headers=H_API).json()["data"]]
    assert ids == ["flywheel", "v000000"]


# ---------------------------------------------------------------------------- context length (D77)
CONTEXT = 1024  # the tiny MoE's max_position_embeddings (tests/conftest.py)


def _chat_len(tok, messages) -> int:
    """Tokens of ``messages`` under the chat template with the generation prompt."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _context_error(call) -> dict:
    """The OpenAI error body of a call the official client must raise as BadRequestError."""
    with pytest.raises(openai.BadRequestError) as ei:
        call()
    assert ei.value.status_code == 400
    return ei.value.body


def test_context_overflow_is_openais_400_context_length_exceeded(env, tiny_moe_dir):
    """A prompt the context cannot take, alone or with its max_tokens, is answered as OpenAI
    answers it (400, invalid_request_error, code context_length_exceeded, param messages or
    prompt), which the openai client raises as BadRequestError; streamed requests too, before
    any event. The counts in the message are computed here from the tokenizer and the ids sent."""
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=env["url"] + "/v1", api_key=API, max_retries=0)
    tok = AutoTokenizer.from_pretrained(tiny_moe_dir)
    long_msgs = [{"role": "user", "content": "x " * 2000}]
    n_long = _chat_len(tok, long_msgs)
    assert n_long > CONTEXT
    for stream in (False, True):
        err = _context_error(lambda: client.chat.completions.create(
            model="flywheel", messages=long_msgs, max_tokens=2, stream=stream))
        assert err | {"message": None} == {"message": None, "type": "invalid_request_error",
                                           "param": "messages", "code": "context_length_exceeded"}, err
        assert err["message"] == (f"messages: this model's maximum context length is {CONTEXT} tokens, however "
                                  f"the messages resulted in {n_long} tokens (at most {CONTEXT - 1}, leaving room "
                                  f"for one new token); reduce the length of the messages")
    # prompt + max_tokens over the context: OpenAI's "you requested N tokens (P in the messages, C in the completion)"
    short = [{"role": "user", "content": "hi"}]
    n_short = _chat_len(tok, short)
    asked = CONTEXT - n_short + 1
    err = _context_error(lambda: client.chat.completions.create(model="flywheel", messages=short, max_tokens=asked))
    assert (err["param"], err["code"]) == ("messages", "context_length_exceeded"), err
    assert err["message"] == (f"messages: this model's maximum context length is {CONTEXT} tokens, however you "
                              f"requested {CONTEXT + 1} tokens ({n_short} in the messages, {asked} in max_tokens); "
                              f"reduce the length of the messages or max_tokens")
    err = _context_error(lambda: client.chat.completions.create(model="flywheel", messages=short,
                                                                max_completion_tokens=asked))
    assert err["param"] == "messages" and f"{asked} in max_completion_tokens" in err["message"], err
    # completions: the prompt's field is `prompt`; token ids give exact counts
    err = _context_error(lambda: client.completions.create(model="flywheel", prompt=[5] * CONTEXT, max_tokens=1))
    assert err | {"message": None} == {"message": None, "type": "invalid_request_error",
                                       "param": "prompt", "code": "context_length_exceeded"}, err
    assert f"the prompt resulted in {CONTEXT} tokens (at most {CONTEXT - 1}" in err["message"], err
    err = _context_error(lambda: client.completions.create(model="flywheel", prompt=[5] * 1000, max_tokens=25))
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded"), err
    assert "you requested 1025 tokens (1000 in the prompt, 25 in max_tokens)" in err["message"], err
    err = _context_error(lambda: client.completions.create(model="flywheel", prompt=[5] * 1000, max_tokens=25,
                                                           stream=True))
    assert err["param"] == "prompt", err
    # what fits is served: exactly the context, and a default budget clamped to the room left
    r = client.completions.create(model="flywheel", prompt=[5] * 1000, max_tokens=24, temperature=0)
    assert r.usage.prompt_tokens == 1000 and 1 <= r.usage.completion_tokens <= 24
    r = client.completions.create(model="flywheel", prompt=[5] * (CONTEXT - 1), temperature=0)
    assert r.usage.prompt_tokens == CONTEXT - 1 and r.usage.completion_tokens == 1
    m = httpx.get(env["url"] + "/metrics").text
    assert 'endpoint="/v1/chat/completions",status="413"' not in m


def test_prompt_over_max_prompt_tokens_is_400_naming_the_bound(env):
    """The server's own bound on prompts (``max_prompt_tokens``, below the context) answers
    the same 400 context_length_exceeded, naming the bound; a body over its byte bound is 413."""
    srv = ServerThread(create_app(env["slots"], None, pod="short", salt="s", api_keys={API},
                                  max_prompt_tokens=50)).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=API, max_retries=0)
        err = _context_error(lambda: client.completions.create(model="flywheel", prompt=[5] * 51, max_tokens=1))
        assert err | {"message": None} == {"message": None, "type": "invalid_request_error",
                                           "param": "prompt", "code": "context_length_exceeded"}, err
        assert err["message"] == ("prompt: the prompt resulted in 51 tokens, more than this server's "
                                  f"max_prompt_tokens (50); the model's maximum context length is {CONTEXT} "
                                  "tokens; reduce the length of the prompt")
        assert client.completions.create(model="flywheel", prompt=[5] * 50, max_tokens=1).usage.prompt_tokens == 50
    finally:
        srv.stop()


def test_health_and_ready(env):
    r = httpx.get(env["url"] + "/health")
    assert r.status_code == 200 and r.content == b""
    assert httpx.get(env["url"] + "/healthz").json()["ok"] is True


def test_queue_full_is_429_with_retry_after(tiny_moe_dir):
    eng = TorchEngine(tiny_moe_dir, max_batch=1, max_queue=1, threads=1)
    slots = Slots(eng, CheckpointStore(tiny_moe_dir))
    slots.start("v000000")
    srv = ServerThread(create_app(slots, None, pod="q", salt="s")).start()
    eng.pause()  # nothing leaves the queue: the first request waits, the second finds it full
    try:
        with httpx.Client(timeout=60) as c:
            body = {"model": "flywheel", "prompt": "hi", "max_tokens": 1}
            first: list = []
            t = threading.Thread(target=lambda: first.append(c.post(srv.url + "/v1/completions", json=body)))
            t.start()
            for _ in range(200):
                if eng.queue_depth() >= 1:
                    break
                time.sleep(0.01)
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
            eng.resume()
            t.join(60)
            assert first and first[0].status_code == 200
    finally:
        eng.resume()
        srv.stop()
        eng.close()


# ---------------------------------------------------------------------------- feedback contract
def test_feedback_batch_per_item_results_and_nothing_lost(env):
    cid = completion(env)["id"]
    eid_dup, eid_conflict = str(uuid.uuid4()), str(uuid.uuid4())
    events = [
        {"completion_id": cid, "value": 1, "event_id": eid_dup, "user": "u1"},              # 0 ok
        {"completion_id": cid, "value": 0.5},                                               # 1 thumb not +-1
        {"completion_id": cid, "kind": "score", "name": "helpfulness", "value": 0.25,
         "metadata": {"page": "chat", "ab": "b"}, "user": "u2"},                            # 2 ok
        {"completion_id": cid, "kind": "score", "value": 3},                                # 3 no name
        {"completion_id": cid, "value": 1, "event_id": eid_dup, "user": "u1"},              # 4 duplicate of 0
        {"completion_id": cid, "value": -1, "event_id": eid_dup, "user": "u1"},             # 5 same id, other content
        {"completion_id": cid, "value": True},                                              # 6 boolean
        {"completion_id": cid, "value": -1, "event_id": eid_conflict, "metadata": {"k": "x" * 513}},  # 7 too long
        {"completion_id": cid, "value": -1, "event_id": eid_conflict, "comment": "meh"},    # 8 ok
        "not an object",                                                                    # 9
    ]
    r = post(env, "/v1/feedback/batch", {"events": events})
    assert r.status_code == 200, r.text
    out = r.json()
    res = out["results"]
    assert [x["index"] for x in res] == list(range(10))
    assert [x["status"] for x in res] == [200, 400, 200, 400, 200, 409, 400, 400, 200, 400]
    assert (out["accepted"], out["rejected"]) == (4, 6)
    assert res[0] == {"index": 0, "status": 200, "event_id": eid_dup, "accepted": True, "duplicate": False}
    assert res[4]["duplicate"] is True and res[4]["event_id"] == eid_dup
    assert [res[i]["error"]["param"] for i in (1, 3, 5, 6, 7)] == ["value", "name", "event_id", "value", "metadata.k"]
    assert res[5]["error"]["code"] == "event_id_conflict"
    # published: items 0, 2, 8 exactly once (the duplicate is not sent again)
    recs = consume(env["bootstrap"], topic_names().feedback, 4, timeout_s=5, keys={cid})
    evs = [FeedbackEvent.from_bytes(x.value) for x in recs]
    evs = [e for e in evs if str(e.event_id) in {eid_dup, eid_conflict, res[2]["event_id"]}]
    assert sorted(str(e.event_id) for e in evs) == sorted([eid_dup, eid_conflict, res[2]["event_id"]])
    score = next(e for e in evs if e.kind == "score")
    assert (score.name, score.value, score.metadata) == ("helpfulness", 0.25, {"page": "chat", "ab": "b"})
    thumb = next(e for e in evs if str(e.event_id) == eid_dup)
    assert thumb.value == 1.0 and thumb.metadata is None and b'"metadata"' not in next(
        x.value for x in recs if FeedbackEvent.from_bytes(x.value).event_id == thumb.event_id)


@pytest.mark.parametrize("body", [{"events": []}, {"events": [{}] * 101}, {"events": {"a": 1}}, {}])
def test_feedback_batch_envelope_errors(env, body):
    r = post(env, "/v1/feedback/batch", body)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("events"), r.text


def test_single_feedback_idempotent_on_event_id(env):
    cid = completion(env)["id"]
    body = {"completion_id": cid, "value": -1, "event_id": str(uuid.uuid4()), "metadata": {"src": "t"}}
    a, b = post(env, "/v1/feedback", body).json(), post(env, "/v1/feedback", body).json()
    assert (a["duplicate"], b["duplicate"]) == (False, True) and a["event_id"] == b["event_id"]
    c = post(env, "/v1/feedback", {**body, "value": 1})
    assert c.status_code == 409 and c.json()["error"]["param"] == "event_id"
    recs = consume(env["bootstrap"], topic_names().feedback, 2, timeout_s=3, keys={cid})
    assert [FeedbackEvent.from_bytes(x.value).event_id for x in recs] == [uuid.UUID(body["event_id"])]


@pytest.mark.parametrize("extra,param", [
    ({"kind": "thumb", "name": "x"}, "name"), ({"kind": "score", "name": "has space", "value": 1}, "name"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"), ({"metadata": {"": "v"}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata.k"), ({"kind": "like"}, "kind"),
])
def test_feedback_field_errors(env, extra, param):
    r = post(env, "/v1/feedback", {"completion_id": str(uuid.uuid4()), "value": 1, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()


# ---------------------------------------------------------------------------- train / eval split
def _by_hand_split(ids: list[int], share: float) -> str:
    h = hashlib.sha256(("flywheel-split-v1:" + ",".join(map(str, ids))).encode()).hexdigest()
    return "eval" if int(h[:16], 16) / 2**64 < share else "train"


def test_completion_split_by_hash_and_by_tag(env):
    prompts = [[5, 6, 7, i] for i in range(12)]
    want = [_by_hand_split(p, 0.5) for p in prompts]
    assert {"train", "eval"} <= set(want)  # both occur among these prompts
    got, cids = [], {}
    for p, w in zip(prompts, want):
        r = post(env, "/v1/completions", {"model": "flywheel", "prompt": p, "max_tokens": 1})
        got.append(r.headers["x-flywheel-split"])
        cids[r.json()["id"]] = w
    assert got == want
    # a tag wins over the hash: metadata or header (they must agree)
    r1 = post(env, "/v1/completions", {"model": "flywheel", "prompt": prompts[0], "max_tokens": 1,
                                       "metadata": {"flywheel_split": "eval"}})
    r2 = post(env, "/v1/completions", {"model": "flywheel", "prompt": prompts[0], "max_tokens": 1},
              headers={**H_API, "X-Flywheel-Split": "train"})
    cids[r1.json()["id"]], cids[r2.json()["id"]] = "eval", "train"
    assert (r1.headers["x-flywheel-split"], r2.headers["x-flywheel-split"]) == ("eval", "train")
    recs = consume(env["bootstrap"], topic_names().completions, len(cids), keys=set(cids))
    assert {str(e.completion_id): e.split for e in map(lambda x: CompletionEvent.from_bytes(x.value), recs)} == cids
    bad = post(env, "/v1/completions", {"model": "flywheel", "prompt": "x", "metadata": {"flywheel_split": "test"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "metadata.flywheel_split"
    clash = post(env, "/v1/chat/completions", {"model": "flywheel", "messages": [{"role": "user", "content": "x"}],
                                               "metadata": {"flywheel_split": "eval"}},
                 headers={**H_API, "X-Flywheel-Split": "train"})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "metadata.flywheel_split"


# ---------------------------------------------------------------------------- metrics
def test_promtool_accepts_the_real_metrics(env):
    """``promtool check metrics`` (Debian package ``prometheus``) on this server's /metrics
    after traffic of every kind: vLLM-style names and units, no lint problem."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: apt-get install -y prometheus (CI does, .ci/run)")
    completion(env)
    post(env, "/v1/completions", {"model": "nope", "prompt": "x"})
    post(env, "/v1/feedback", {"completion_id": str(uuid.uuid4()), "value": 1})
    text = httpx.get(env["url"] + "/metrics").text
    for name in ("flywheel_time_to_first_token_seconds_bucket", "flywheel_e2e_request_latency_seconds_sum",
                 "flywheel_generation_tokens_total", "flywheel_request_success_total",
                 "flywheel_num_requests_waiting", "flywheel_version_latency_seconds_bucket",
                 "flywheel_version_decode_tokens_total", "flywheel_version_decode_seconds_total",
                 "flywheel_swap_pause_seconds", "process_resident_memory_bytes"):
        assert name in text, name
    assert "_ms" not in "".join(ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if not ln.startswith("#"))
    p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "" and p.stderr.strip() == "", p.stdout + p.stderr


# ---------------------------------------------------------------------------- SSE deltas (pure)
def test_choice_streams_wait_for_whole_characters_and_cut_at_stops():
    from serving.http.streaming import ChoiceStreams
    from serving.params import GenResult, StepOutput

    def text(ids):  # byte-level "tokenizer": ids are UTF-8 bytes; cut at the stop string "!"
        t = bytes(ids).decode("utf-8", errors="replace")
        return t[:t.find("!")] if "!" in t else t

    s = ChoiceStreams("r", ["c0"], 0, "v1", chat=False, text=text, token_str=lambda t: chr(t), want_logprobs=True,
                      include_usage=False, prompt_len=3)

    def step(ids):
        return StepOutput("r", list(ids), [-0.5] * len(ids), [])

    def delta(chunk):
        return json.loads(chunk.removeprefix("data: "))["choices"][0]

    assert delta(s.on_step(0, step(b"a")))["text"] == "a"
    assert s.on_step(0, step(b"\xc3")) is None  # half of "é": nothing yet
    d = delta(s.on_step(0, step(b"\xa9")))
    assert d["text"] == "é" and d["logprobs"]["token_logprobs"] == [-0.5, -0.5]  # both tokens since the last chunk
    assert s.on_step(0, step(b"!x")) is None  # past the stop string: no new text
    res = GenResult(completion_token_ids=list(b"a\xc3\xa9!x"), behavior_logprobs=[-0.5] * 5, top_logprobs=[],
                    expert_routes=None, finish_reason="stop", ttft_ms=1, latency_ms=2, version="v1")
    out = [delta(c) for c in s.on_finish(0, res)]
    assert [(c["text"], c["finish_reason"]) for c in out] == [("", "stop")]
