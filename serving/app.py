"""The serving pod's HTTP API: OpenAI-compatible inference, feedback, admin, metrics.

``create_app`` wires an engine + weight slots + event log into a FastAPI app. Every
completion produces exactly one ``CompletionEvent`` on ``flywheel.completions`` (key =
completion id); every accepted feedback one ``FeedbackEvent`` on ``flywheel.feedback``.

Completion ids with ``n`` choices: each choice is its own completion (own id, own event,
own feedback target, seed + i when seeded). Choice ``i`` carries its id in the extra field
``choices[i].completion_id`` (also on every streamed chunk's choice); the response ``id`` is
choice 0's id, so ``n=1`` clients (and feedback on ``resp.id``) work unchanged; headers
``x-flywheel-completion-id`` (choice 0) and ``x-flywheel-completion-ids`` (all, comma-separated,
in choice order). Raw user ids are hashed with the pod's salt before any event is
written and never leave the pod.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import os
import secrets
import threading
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas import settings, topics
from schemas.admin import LoadRequest, RollbackRequest, WeightRequest
from schemas.events import CompletionEvent, ExpertRoutes, FeedbackEvent, hash_user, now_ms
from serving.eventlog import EventLog
from serving.params import GenRequest, GenResult, ServingValidationError
from serving.protocol import ChatCompletionRequest, CompletionRequest, FeedbackRequest, error_body
from serving.slots import SlotError, Slots

log = logging.getLogger("flywheel.serving.app")

USER_HEADER = "x-flywheel-user"
CID_HEADER = "x-flywheel-completion-id"
CIDS_HEADER = "x-flywheel-completion-ids"  # all n choices, comma-separated, in choice order
VERSION_HEADER = "x-flywheel-model-version"


def user_salt() -> str:
    """The pod's user-id salt: env ``FLYWHEEL_USER_SALT``, else ``$FLYWHEEL_HOME/user_salt``
    (generated once, mode 0600)."""
    env = os.environ.get("FLYWHEEL_USER_SALT")
    if env:
        return env
    f = settings.home() / "user_salt"
    if not f.exists():
        tmp = f.with_name("user_salt.tmp")
        tmp.write_text(secrets.token_hex(16))
        tmp.chmod(0o600)
        os.replace(tmp, f)
    return f.read_text().strip()


def load_keys(env_var: str, path: str | Path | None = None) -> set[str] | None:
    """API keys from a file (one per line, ``#`` comments) and/or a comma-separated env var;
    None when neither is set (auth off)."""
    keys: set[str] = set()
    if path:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.add(line)
    env = os.environ.get(env_var)
    if env:
        keys.update(k.strip() for k in env.split(",") if k.strip())
    return keys or None


class _Metrics:
    def __init__(self, event_log: EventLog | None, slots: Slots):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.registry = r = CollectorRegistry()
        lat_buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.requests = Counter("flywheel_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("flywheel_request_latency_seconds", "end-to-end completion latency (s)",
                                 ["endpoint"], buckets=lat_buckets, registry=r)
        self.ttft = Histogram("flywheel_ttft_seconds", "time to first token (s)", buckets=lat_buckets,
                              registry=r)
        self.tokens = Counter("flywheel_tokens", "tokens processed", ["kind"], registry=r)
        self.tokens_per_s = Histogram("flywheel_decode_tokens_per_second", "completion tokens/s per request",
                                      buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r)
        self.batch = Histogram("flywheel_batch_size", "requests per engine batch",
                               buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.version_requests = Counter("flywheel_version_requests", "completions routed to each model "
                                        "version (one per choice, failed ones included)", ["version"], registry=r)
        # per-version canary signals (deploy's analysis): errors = requests routed to the
        # version that failed server-side (engine exception -> 500, queue full -> 429; client
        # mistakes are rejected before routing and not counted); latency = engine ms (no queue wait) of each
        # completion; tokens = generated (completion) tokens.
        self.version_errors = Counter("flywheel_version_errors", "server-side failures by model version",
                                      ["version"], registry=r)
        self.version_latency = Histogram(
            "flywheel_version_latency_ms", "engine latency (prefill + decode, no queue wait) by model version (ms)", ["version"],
            # geometric, 25 % apart from 10 ms to ~10 min: a p99 read off the buckets is
            # within ~25 % of the true value (coarse buckets made 31 s vs 29 s look like 2x)
            buckets=tuple(round(10 * 1.25 ** i, 1) for i in range(50)), registry=r)
        self.version_tokens = Counter("flywheel_version_tokens", "generated tokens by model version",
                                      ["version"], registry=r)
        self.version_votes = Counter("flywheel_version_votes", "thumb votes by model version",
                                     ["version", "vote"], registry=r)
        self.events_accepted = Counter("flywheel_events_accepted", "events accepted by the API", ["kind"],
                                       registry=r)
        self.queue_depth = Gauge("flywheel_engine_queue_depth", "requests waiting for a batch", registry=r)
        self.queue_depth.set_function(lambda: slots.engine.queue_depth())
        self.swap_pause = Gauge("flywheel_swap_pause_ms", "last hot-swap pause (ms)", registry=r)
        self.swap_pause.set_function(lambda: slots.last_swap_pause_ms or 0.0)

        class _EventLogCollector:
            def collect(self_inner):
                if event_log is None:
                    return
                c = CounterMetricFamily("flywheel_eventlog_events", "event log counts by state",
                                        labels=["state"])
                for k, v in vars(event_log.counters).items():
                    c.add_metric([k], v)
                yield c
                g = GaugeMetricFamily("flywheel_eventlog_queue_depth", "events waiting in memory")
                g.add_metric([], event_log.queue_depth())
                yield g
                j = GaugeMetricFamily("flywheel_eventlog_journal_pending_bytes", "journal bytes not yet in Kafka")
                j.add_metric([], event_log.journal_pending())
                yield j
                u = GaugeMetricFamily("flywheel_eventlog_kafka_up", "1 when the last send reached Kafka")
                u.add_metric([], 1.0 if event_log.kafka_up else 0.0)
                yield u

        r.register(_EventLogCollector())


def create_app(slots: Slots, event_log: EventLog | None, *, pod: str = "pod-0", salt: str | None = None,
               api_keys: set[str] | None = None, admin_token: str | None = None,
               max_prompt_tokens: int = 8192, default_max_tokens: int = 256) -> FastAPI:
    """The FastAPI app of one serving pod.

    Args:
        slots: stable/candidate weights over the engine (stable must be loaded).
        event_log: where events go; None turns event logging off (benchmarks only).
        pod: pod name written into every CompletionEvent.
        salt: user-id salt (default :func:`user_salt`).
        api_keys: Bearer keys accepted for ``/v1/*``; None = no auth.
        admin_token: Bearer token for ``/admin/*``; None = no auth (local use only).
        max_prompt_tokens: longer prompts get HTTP 413 (tokens).
        default_max_tokens: chat ``max_tokens`` when the request sets none (tokens).
    """
    engine = slots.engine
    tok = engine.tokenizer
    salt = salt or user_salt()
    metrics = _Metrics(event_log, slots)
    recent_versions: collections.OrderedDict[str, str] = collections.OrderedDict()  # completion -> version
    rv_lock = threading.Lock()
    app = FastAPI(title="Flywheel serving", version="1")
    app.state.slots = slots
    app.state.metrics = metrics
    app.state.event_log = event_log

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ServingValidationError)
    async def _sve(_req: Request, exc: ServingValidationError):
        return JSONResponse(error_body(str(exc), exc.parameter, code=exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _rve(_req: Request, exc: RequestValidationError):
        errs = exc.errors()
        e = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        if e.get("type") == "json_invalid":
            return JSONResponse(error_body(f"body: invalid JSON ({e.get('msg')})", None), status_code=400)
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        return JSONResponse(error_body(f"{param or 'body'}: {e.get('msg')}", param), status_code=400)

    @app.exception_handler(SlotError)
    async def _slot(_req: Request, exc: SlotError):
        body = error_body(str(exc), None, type_="conflict")
        body["detail"] = str(exc)  # plain reason for admin clients
        return JSONResponse(body, status_code=409)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        t = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
            exc.status_code, "invalid_request_error")
        return JSONResponse(error_body(str(exc.detail), None, type_=t), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _any(_req: Request, exc: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", None, type_="server_error"),
                            status_code=500)

    # ------------------------------------------------------------------ auth
    def _bearer(request: Request) -> str | None:
        h = request.headers.get("authorization", "")
        return h[7:].strip() if h.lower().startswith("bearer ") else None

    def _check(request: Request, allowed: set[str] | None) -> None:
        if allowed is None:
            return
        got = _bearer(request)
        if got is None:
            raise StarletteHTTPException(401, "missing Authorization: Bearer <key>")
        if not any(hmac.compare_digest(got.encode(), k.encode()) for k in allowed):
            raise StarletteHTTPException(403, "invalid API key")

    def require_key(request: Request) -> None:
        _check(request, api_keys)

    def require_admin(request: Request) -> None:
        _check(request, {admin_token} if admin_token else None)

    def _user_hash(request: Request, user: str | None) -> str:
        raw = user or request.headers.get(USER_HEADER) or "anonymous"
        return hash_user(raw, salt)

    # ------------------------------------------------------------------ inference
    def _prompt_ids_chat(body: ChatCompletionRequest) -> list[int]:
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
                for i, m in enumerate(body.messages)]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def _prompt_ids_completion(body: CompletionRequest) -> list[int]:
        p = body.prompt
        if isinstance(p, list):
            if not p:
                raise ServingValidationError("prompt", p, "must not be empty")
            if isinstance(p[0], (str, list)):
                if len(p) != 1:
                    raise ServingValidationError("prompt", f"{len(p)} prompts", "only one prompt per request")
                p = p[0]
        if isinstance(p, str):
            ids = tok(p, add_special_tokens=False)["input_ids"]
            if not ids:
                raise ServingValidationError("prompt", body.prompt, "must not be empty")
            return list(ids)
        vocab = len(tok)
        bad = [t for t in p if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ServingValidationError("prompt", bad[:5], f"token ids must be in [0, {vocab})")
        return list(p)

    def _check_prompt_len(field: str, ids: list[int]) -> None:
        limit = min(max_prompt_tokens, (engine.max_positions or 10**9) - 1)
        if len(ids) > limit:
            raise ServingValidationError(field, f"{len(ids)} tokens", f"prompt is longer than {limit} tokens",
                                         status=413, code="context_length_exceeded")

    def _budget(field: str, prompt: list[int], asked: int | None, default: int) -> int:
        """New-token budget: an explicit value must fit the context; a default is clamped."""
        room = (engine.max_positions or 10**9) - len(prompt)
        if asked is None:
            return max(1, min(default, room))
        if asked > room:
            raise ServingValidationError(field, asked, f"prompt ({len(prompt)} tokens) + {field} exceeds the "
                                         f"model context ({engine.max_positions} tokens)",
                                         code="context_length_exceeded")
        return asked

    def _stop_check(stops: list[str]):
        if not stops:
            return None

        def check(toks: list[int]) -> bool:
            text = tok.decode(toks[-64:], skip_special_tokens=True)
            return any(s in text for s in stops)
        return check

    def _text(ids: list[int], stops: list[str]) -> str:
        text = tok.decode(ids, skip_special_tokens=True)
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        return text[:cut] if cut >= 0 else text

    def _emit_completion(cid: uuid.UUID, request_id: str, user_hash: str, prompt: list[int],
                         sp, res: GenResult, created_ms: int) -> None:
        routes = ExpertRoutes.from_array(res.expert_routes) if res.expert_routes is not None else None
        ev = CompletionEvent(
            completion_id=cid, request_id=request_id, created_at=created_ms, model_version=res.version,
            pod=pod, user_hash=user_hash, prompt_token_ids=prompt,
            completion_token_ids=res.completion_token_ids, behavior_logprobs=res.behavior_logprobs,
            sampling=sp, expert_routes=routes, finish_reason=res.finish_reason, ttft_ms=res.ttft_ms,
            latency_ms=res.latency_ms)
        if event_log is not None:
            event_log.emit(topics.COMPLETIONS, str(cid), ev.to_bytes())
        metrics.events_accepted.labels("completion").inc()
        with rv_lock:
            recent_versions[str(cid)] = res.version
            while len(recent_versions) > 100_000:
                recent_versions.popitem(last=False)

    @app.middleware("http")
    async def _count_requests(request: Request, call_next):
        resp = await call_next(request)
        route = request.scope.get("route")
        metrics.requests.labels(getattr(route, "path", "unmatched"), str(resp.status_code)).inc()
        return resp

    def _observe(endpoint: str, prompt: list[int], res: GenResult) -> None:
        metrics.latency.labels(endpoint).observe(res.latency_ms / 1000)
        metrics.ttft.observe(res.ttft_ms / 1000)
        metrics.tokens.labels("prompt").inc(len(prompt))
        metrics.tokens.labels("completion").inc(len(res.completion_token_ids))
        metrics.batch.observe(res.batch_size)
        # engine time (prefill + decode), not queue wait: slots on one pod run in separate
        # batches, so end-to-end latency would penalise whichever arm's batch runs second
        metrics.version_latency.labels(res.version).observe(max(0.0, res.latency_ms - res.queue_ms))
        metrics.version_tokens.labels(res.version).inc(len(res.completion_token_ids))
        dec_s = max(res.latency_ms - res.ttft_ms, 1e-3) / 1000
        if len(res.completion_token_ids) > 1:
            metrics.tokens_per_s.observe((len(res.completion_token_ids) - 1) / dec_s)

    def _tokstr(t: int) -> str:
        return tok.decode([t])

    def _chat_logprobs(res: GenResult) -> dict:
        content = []
        for j, (t, lp) in enumerate(zip(res.completion_token_ids, res.behavior_logprobs)):
            s = _tokstr(t)
            tops = [{"token": _tokstr(a), "logprob": b, "bytes": list(_tokstr(a).encode())}
                    for a, b in (res.top_logprobs[j] if res.top_logprobs else [])]
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": tops})
        return {"content": content, "refusal": None}

    def _completion_logprobs(res: GenResult) -> dict:
        tokens, offs, off = [], [], 0
        for t in res.completion_token_ids:
            s = _tokstr(t)
            tokens.append(s)
            offs.append(off)
            off += len(s)
        tops = ([{_tokstr(a): b for a, b in step} for step in res.top_logprobs] if res.top_logprobs else None)
        return {"tokens": tokens, "token_logprobs": list(res.behavior_logprobs), "top_logprobs": tops,
                "text_offset": offs}

    def _wire_finish(fr: str) -> str:
        return "stop" if fr == "abort" else fr

    async def _serve(request: Request, body, endpoint: str, prompt: list[int], sp, top_logprobs: int,
                     chat: bool):
        """Run ``n`` choices (each its own completion: id, GenRequest, CompletionEvent) on one
        version and answer in the OpenAI shape, as JSON or SSE."""
        user_hash = _user_hash(request, body.user)
        lm = slots.pick(user_hash, version=body.model)
        n = body.n or 1
        cids = [uuid.uuid4() for _ in range(n)]
        # choice i samples with seed + i: n copies of one seeded draw would be surprising
        sps = [sp if i == 0 or sp.seed is None else sp.model_copy(update={"seed": sp.seed + i})
               for i in range(n)]
        request_id = request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex[:16]}"
        created_ms = now_ms()
        stops = body.stop_strings()
        headers = {CID_HEADER: str(cids[0]), CIDS_HEADER: ",".join(map(str, cids)), VERSION_HEADER: lm.version}
        stream = bool(body.stream)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue | None = asyncio.Queue() if stream else None

        greqs: list[GenRequest] = []
        futs = []
        # counted when routed, so errors <= requests per version (error rate = errors / requests)
        metrics.version_requests.labels(lm.version).inc(n)
        metrics.version_errors.labels(lm.version)  # export 0 errors, not "no data", for this version
        try:
            for i in range(n):
                def on_token(t: int, lp: float, i=i) -> None:
                    loop.call_soon_threadsafe(q.put_nowait, (i, t, lp))

                greqs.append(GenRequest(prompt_token_ids=prompt, sampling=sps[i], model=lm,
                                        stop_token_ids=(engine.eos_id,), top_logprobs=top_logprobs,
                                        on_token=on_token if stream else None, stop_check=_stop_check(stops)))
                futs.append(engine.submit(greqs[-1]))  # raises 429 here, before anything is logged
        except ServingValidationError as exc:
            for g, f in zip(greqs, futs):  # all or nothing: never a partial set of choices
                f.cancel()
                engine.abort(g)
            if exc.status == 429:
                metrics.version_errors.labels(lm.version).inc(n)  # all n choices failed
            raise

        async def finish(i: int) -> GenResult:
            # Runs to the end even if the client goes away: one completion, one event.
            try:
                res = await asyncio.wrap_future(futs[i])
            except BaseException as exc:
                metrics.version_errors.labels(lm.version).inc()
                if q is not None:
                    q.put_nowait((i, None, exc))
                raise
            _emit_completion(cids[i], request_id, user_hash, prompt, sps[i], res, created_ms)
            _observe(endpoint, prompt, res)
            if q is not None:
                q.put_nowait((i, None, res))  # after every token of choice i (same loop, FIFO)
            return res

        tasks = [asyncio.ensure_future(finish(i)) for i in range(n)]
        created = created_ms // 1000
        if not stream:
            try:
                results = await asyncio.shield(asyncio.gather(*tasks))
            except asyncio.CancelledError:
                for g in greqs:
                    engine.abort(g)
                raise
            choices = []
            for i, res in enumerate(results):
                text = _text(res.completion_token_ids, stops)
                if chat:
                    choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                    "finish_reason": _wire_finish(res.finish_reason),
                                    "logprobs": _chat_logprobs(res) if body.logprobs else None,
                                    "completion_id": str(cids[i])})
                else:
                    choices.append({"index": i, "text": text, "finish_reason": _wire_finish(res.finish_reason),
                                    "logprobs": _completion_logprobs(res) if body.logprobs is not None else None,
                                    "completion_id": str(cids[i])})
            n_out = sum(len(r.completion_token_ids) for r in results)
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n_out, "total_tokens": len(prompt) + n_out}
            out = {"id": str(cids[0]), "object": "chat.completion" if chat else "text_completion",
                   "created": created, "model": lm.version, "choices": choices, "usage": usage}
            return JSONResponse(out, headers=headers)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i: int, delta_text: str | None, finish_reason: str | None, first: bool = False) -> str:
            if chat:
                delta: dict = {}
                if first:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                ch = {"index": i, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            else:
                ch = {"index": i, "text": delta_text or "", "finish_reason": finish_reason, "logprobs": None}
            ch["completion_id"] = str(cids[i])
            d = {"id": str(cids[0]), "object": obj, "created": created, "model": lm.version, "choices": [ch]}
            if include_usage:
                d["usage"] = None
            return f"data: {json.dumps(d)}\n\n"

        async def sse():
            try:
                if chat:
                    for i in range(n):
                        yield chunk(i, "", None, first=True)
                toks: list[list[int]] = [[] for _ in range(n)]
                sent = [""] * n
                results: list[GenResult | None] = [None] * n
                left = n
                while left:
                    i, t, x = await q.get()
                    if t is None:  # choice i ended: x is its GenResult or its exception
                        left -= 1
                        if isinstance(x, BaseException):
                            raise x
                        results[i] = x
                        text = _text(x.completion_token_ids, stops)
                        if len(text) > len(sent[i]) and text.startswith(sent[i]):
                            yield chunk(i, text[len(sent[i]):], None)
                        yield chunk(i, None if chat else "", _wire_finish(x.finish_reason))
                        continue
                    toks[i].append(t)
                    text = _text(toks[i], stops)
                    if text.endswith("\ufffd"):
                        continue  # incomplete UTF-8 sequence: wait for the next token
                    if len(text) > len(sent[i]) and text.startswith(sent[i]):
                        delta, sent[i] = text[len(sent[i]):], text
                        yield chunk(i, delta, None)
                if include_usage:
                    n_out = sum(len(r.completion_token_ids) for r in results)
                    d = {"id": str(cids[0]), "object": obj, "created": created, "model": lm.version,
                         "choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out,
                                                  "total_tokens": len(prompt) + n_out}}
                    yield f"data: {json.dumps(d)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                for g, task in zip(greqs, tasks):
                    if not task.done():
                        engine.abort(g)  # client went away: stop generating; the event is still logged

        return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """OpenAI chat completions (non-streaming and SSE streaming)."""
        require_key(request)
        body.check_supported()
        if body.top_logprobs and not body.logprobs:
            raise ServingValidationError("top_logprobs", body.top_logprobs, "requires logprobs=true")
        prompt = _prompt_ids_chat(body)
        _check_prompt_len("messages", prompt)
        asked = body.max_completion_tokens or body.max_tokens
        field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        sp = body.sampling(_budget(field, prompt, asked, default_max_tokens))
        return await _serve(request, body, "chat", prompt, sp, body.top_logprobs or 0, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI (legacy) text completions (non-streaming and SSE streaming)."""
        require_key(request)
        body.check_supported()
        prompt = _prompt_ids_completion(body)
        _check_prompt_len("prompt", prompt)
        sp = body.sampling(_budget("max_tokens", prompt, body.max_tokens, 16))
        return await _serve(request, body, "completions", prompt, sp, body.logprobs or 0, chat=False)

    @app.get("/v1/models")
    async def models(request: Request):
        """The versions this pod serves (stable first)."""
        require_key(request)
        st = slots.status(check_digests=False)
        data = [{"id": st.stable.version, "object": "model", "created": st.stable.loaded_at // 1000,
                 "owned_by": "flywheel", "slot": "stable"}]
        if st.candidate:
            data.append({"id": st.candidate.version, "object": "model",
                         "created": st.candidate.loaded_at // 1000, "owned_by": "flywheel",
                         "slot": "candidate"})
        return {"object": "list", "data": data}

    @app.post("/v1/feedback")
    async def feedback(body: FeedbackRequest, request: Request):
        """Publish one FeedbackEvent keyed by completion_id; returns its event_id."""
        require_key(request)
        event_id = body.event_id or uuid.uuid4()
        try:
            ev = FeedbackEvent(event_id=event_id, completion_id=body.completion_id,
                               user_hash=_user_hash(request, body.user), kind=body.kind, value=body.value,
                               comment=body.comment, created_at=now_ms())
        except ValidationError as exc:
            e = exc.errors()[0]
            msg = e["msg"].removeprefix("Value error, ")
            field = ".".join(str(x) for x in e["loc"])
            value = e.get("input")
            if not field:  # a model-level check names its field as "field: reason"
                field, _, msg = msg.partition(": ")
                value = value.get(field) if isinstance(value, dict) else None  # never echo user_hash
            raise ServingValidationError(field, value, msg) from None
        if event_log is not None:
            event_log.emit(topics.FEEDBACK, str(body.completion_id), ev.to_bytes())
        metrics.events_accepted.labels(body.kind).inc()
        if body.kind == "thumb":
            with rv_lock:
                v = recent_versions.get(str(body.completion_id), "unknown")
            metrics.version_votes.labels(v, "up" if body.value > 0 else "down").inc()
        return {"event_id": str(event_id), "accepted": True}

    @app.get("/metrics")
    async def prom():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz():
        try:
            facts = engine.check_health()
        except RuntimeError as exc:
            return JSONResponse({"ok": False, "reason": str(exc)}, status_code=503)
        st = slots.status(check_digests=False)
        facts.update({"ok": True, "pod": pod, "stable": st.stable.version,
                      "candidate": st.candidate.version if st.candidate else None,
                      "kafka_up": event_log.kafka_up if event_log else None})
        return facts

    # ------------------------------------------------------------------ admin (schemas/admin.py)
    @app.get("/admin/slots")
    async def admin_slots(request: Request):
        require_admin(request)
        return slots.status().model_dump()

    @app.post("/admin/load")
    async def admin_load(body: LoadRequest, request: Request):
        require_admin(request)
        return (await run_in_threadpool(slots.load_candidate, body.version)).model_dump()

    @app.post("/admin/weight")
    async def admin_weight(body: WeightRequest, request: Request):
        require_admin(request)
        return slots.set_weight(body.candidate_weight).model_dump()

    @app.post("/admin/promote")
    async def admin_promote(request: Request):
        require_admin(request)
        return slots.promote().model_dump()

    @app.post("/admin/rollback")
    async def admin_rollback(request: Request, body: RollbackRequest | None = None):
        require_admin(request)
        version = body.version if body else None
        return (await run_in_threadpool(slots.rollback, version)).model_dump()

    return app

