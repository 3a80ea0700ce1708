"""The logic of ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``.

Model names (``model`` in a request): the served model name (``served_model_name``,
default ``flywheel``) routes by the sticky split between stable and candidate (by hashed
user); a served version id (``v000003``: the stable or the candidate) pins that version;
anything else is 404 ``model_not_found``. ``/v1/models`` lists the served name first, then
the versions.

Each of the ``n`` choices is its own completion: own id, own ``GenRequest``, own
``CompletionEvent``, own feedback target, seed + i when seeded. Choice ``i`` carries its id
in ``choices[i].completion_id`` (also on every streamed chunk's choice); the response ``id``
is choice 0's, so ``n=1`` clients (and feedback on ``resp.id``) work unchanged. Headers:
``x-flywheel-completion-id`` (choice 0), ``x-flywheel-completion-ids`` (all, in choice
order), ``x-flywheel-model-version``, ``x-flywheel-split``.

Split (``train``/``eval``, see :mod:`schemas.split`): the request's
``metadata.flywheel_split`` or header ``X-Flywheel-Split`` (they must agree), else a stable
hash of the prompt token ids against the pod's ``eval_share``. Raw user ids are hashed with
the pod's salt before any event is written and never leave the pod.

Every choice runs through the engine's async protocol (:class:`serving.engine_base.Engine`),
as vLLM's serving classes drive its ``EngineClient``: one task per choice iterates
``engine.generate(req)`` (``final_only`` for a JSON answer), a client that goes away ends
the choices with ``engine.abort``, ``/healthz`` asks ``engine.check_health``. The ``n``
choices are admitted all or none (:meth:`OpenAIServing._start`).

CPU work on a request's prompt (the chat template, tokenisation) runs in a small thread pool
(:data:`TOKENIZE_WORKERS` threads; the Rust tokenizer releases the GIL), never on the event
loop: a large prompt never delays ``/healthz`` or another request's stream.

Signals (:mod:`serving.signals`): each finished choice of a chat request that names a user
(``user`` or header ``x-flywheel-user``) and has no ``tools`` goes to the pod's
:class:`serving.signals.SignalDetector` on one thread of its own, in the order the choices
finished, off the event loop and after the choice's event was submitted; the ``regenerate``
and ``followup`` events it returns go to ``flywheel.feedback`` (key = the earlier
completion's id) through the pod's event log, as posted feedback does. The answer does not
wait for them, and at most :data:`SIGNAL_BACKLOG` choices wait for that thread (a slow judge
costs the choices beyond it their signals, counted, never memory or a request's time).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import StreamingResponse

from schemas.events import hash_user, now_ms
from schemas.split import SPLIT_HEADER, SPLIT_TAG, SPLITS, choose_split
from serving.http import wire
from serving.http.completion_log import CompletionLogger
from serving.http.errors import error_body, json_response
from serving.http.metrics import ServingMetrics
from serving.http.prompts import PromptBuilder
from serving.http.streaming import ChoiceStreams
from serving.params import GenRequest, GenResult, ServingValidationError
from serving.protocol import ChatCompletionRequest, CompletionRequest
from serving.signals import ChatTurn, SignalDetector
from serving.slots import Slots

if TYPE_CHECKING:
    from serving.engine_base import LoadedModel

log = logging.getLogger("flywheel.serving.openai")

USER_HEADER = "x-flywheel-user"
CID_HEADER = "x-flywheel-completion-id"
CIDS_HEADER = "x-flywheel-completion-ids"  # all n choices, comma-separated, in choice order
VERSION_HEADER = "x-flywheel-model-version"
DEFAULT_SERVED_MODEL_NAME = "flywheel"
TOKENIZE_WORKERS = 2  # threads tokenising prompts (bounded: more would only contend for the cores)
#: Finished choices waiting for the signal detector at most (a slow judge cannot grow the queue,
#: and the pod's shutdown waits for at most this many); a choice beyond it is not observed
#: (logged, counted in ``OpenAIServing.signals_dropped``).
SIGNAL_BACKLOG = 10_000
REQUEST_ID_MAX_CHARS = 256  # x-request-id: CompletionEvent.request_id's bound


def user_hash(request: Request, user: str | None, salt: str) -> str:
    """Salted hash of the request's user: ``user`` field, else header ``x-flywheel-user``,
    else ``anonymous``."""
    return hash_user(user or request.headers.get(USER_HEADER) or "anonymous", salt)


def names_user(request: Request, user: str | None) -> bool:
    """Whether the request names its user (``user`` field or header ``x-flywheel-user``)."""
    return bool(user or request.headers.get(USER_HEADER))


class OpenAIServing:
    """OpenAI inference over the pod's weight slots.

    Args:
        slots: stable/candidate weights over the engine.
        prompts: tokenization rules.
        completions_log: where completion events go.
        metrics: the pod's metrics.
        salt: user-id salt.
        served_model_name: the ``model`` alias for the sticky split.
        eval_share: share of untagged prompts put in the eval split, in [0, 1].
        default_max_tokens: chat ``max_tokens`` when the request sets none (tokens).
        signals: derives ``regenerate`` / ``followup`` events from chat requests; None or
            one with both kinds off derives nothing.
        feedback_topic: the feedback topic's full name, where derived signals go.
    """

    def __init__(self, slots: Slots, prompts: PromptBuilder, completions_log: CompletionLogger,
                 metrics: ServingMetrics, *, salt: str, served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
                 eval_share: float, default_max_tokens: int, signals: SignalDetector | None = None,
                 feedback_topic: str):
        self.slots = slots
        self.engine = slots.engine
        self.prompts = prompts
        self.log = completions_log
        self.metrics = metrics
        self.salt = salt
        self.served_model_name = served_model_name
        self.eval_share = eval_share
        self.default_max_tokens = default_max_tokens
        self.inflight = 0  # choices submitted and not finished (event loop only)
        # an engine on the base protocol (serving.engine_base.Engine) takes final_only; one whose
        # generate(req) predates it streams every step, and a JSON answer reads only the last
        self._final_only = "final_only" in inspect.signature(self.engine.generate).parameters
        self._cpu = concurrent.futures.ThreadPoolExecutor(TOKENIZE_WORKERS, thread_name_prefix="flywheel-tokenize")
        self.signals = signals if signals is not None and signals.enabled else None
        self.feedback_topic = feedback_topic
        # one thread, FIFO: a reply is remembered before a later request's choice is observed
        self._signal_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flywheel-signals") \
            if self.signals is not None else None
        self._signal_last: concurrent.futures.Future | None = None
        self.signal_backlog = SIGNAL_BACKLOG
        self._signal_pending = 0  # submitted to the signals thread, not finished (changed on the loop and there)
        self._signal_lock = threading.Lock()
        self.signals_dropped = 0  # finished choices not observed: the backlog was full
        self._signal_drop_logged = 0.0

    async def off_loop(self, fn, *args):
        """``fn(*args)`` in the tokenising pool (bounded), awaited: CPU work on a prompt never
        runs on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    # ------------------------------------------------------------------ request -> plan
    def resolve_model(self, name: str) -> str | None:
        """None for the served model name (sticky split), the version for a served version.

        Raises:
            ServingValidationError: 404 ``model_not_found`` for any other name.
        """
        if name == self.served_model_name:
            return None
        served = self.slots.served_versions()
        if name in served:
            return name
        raise ServingValidationError(
            "model", name, f"the model {name!r} does not exist: use {self.served_model_name!r} or a served "
            f"version ({', '.join(served)})", status=404, code="model_not_found")

    def split_of(self, request: Request, body, prompt: list[int]) -> str:
        """``train`` or ``eval`` for this request (tag, else hash of ``prompt``).

        Raises:
            ServingValidationError: a tag that is not ``train``/``eval``, or two that differ.
        """
        tags = []
        meta = (body.metadata or {}).get(SPLIT_TAG)
        if meta is not None:
            if meta not in SPLITS:
                raise ServingValidationError(f"metadata.{SPLIT_TAG}", meta, "must be 'train' or 'eval'")
            tags.append(meta)
        hdr = request.headers.get(SPLIT_HEADER)
        if hdr is not None:
            if hdr not in SPLITS:
                raise ServingValidationError(SPLIT_HEADER, hdr, "must be 'train' or 'eval'")
            tags.append(hdr)
        if len(set(tags)) > 1:
            raise ServingValidationError(f"metadata.{SPLIT_TAG}", meta, f"disagrees with header {SPLIT_HEADER}: "
                                         f"{hdr!r}")
        return choose_split(prompt, self.eval_share, tag=tags[0] if tags else None)

    def running(self) -> float:
        """Requests the engine runs now (its own count when it keeps one)."""
        n = getattr(self.engine, "num_running", None)
        if callable(n):
            return float(n())
        return float(max(0, self.inflight - self.engine.queue_depth()))

    # ------------------------------------------------------------------ endpoints
    def models(self) -> dict:
        """``/v1/models``: the served name, then stable, then the candidate if any."""
        st = self.slots.status(check_digests=False)
        data = [{"id": self.served_model_name, "object": "model", "created": st.stable.loaded_at // 1000,
                 "owned_by": "flywheel", "slot": "split"},
                {"id": st.stable.version, "object": "model", "created": st.stable.loaded_at // 1000,
                 "owned_by": "flywheel", "slot": "stable"}]
        if st.candidate:
            data.append({"id": st.candidate.version, "object": "model",
                         "created": st.candidate.loaded_at // 1000, "owned_by": "flywheel", "slot": "candidate"})
        return {"object": "list", "data": data}

    async def chat(self, body: ChatCompletionRequest, request: Request):
        """OpenAI chat completions (JSON or SSE)."""
        version = self.resolve_model(body.model)
        structured = self.structured_ok()
        body.check_supported(structured=structured)
        if body.top_logprobs and not body.logprobs:
            raise ServingValidationError("top_logprobs", body.top_logprobs, "requires logprobs=true")
        tools = body.tool_spec() if structured else None
        request_id = self.request_id(request)
        prompt = await self.off_loop(self.prompts.chat_ids, body, tools)
        self.prompts.check_len("messages", prompt)
        asked = body.max_completion_tokens or body.max_tokens
        field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        sp = body.sampling(self.prompts.budget(field, prompt, asked, self.default_max_tokens))
        # tools: an agent, not a person, reads and re-sends these replies
        derive = self.signals is not None and tools is None and names_user(request, body.user)
        return await self._serve(request, body, version, prompt, sp, body.top_logprobs or 0, chat=True,
                                 structured=body.structured_outputs() if structured else None, tools=tools,
                                 request_id=request_id, messages=body.messages if derive else None)

    async def completions(self, body: CompletionRequest, request: Request):
        """OpenAI (legacy) text completions (JSON or SSE)."""
        version = self.resolve_model(body.model)
        structured = self.structured_ok()
        body.check_supported(structured=structured)
        request_id = self.request_id(request)
        prompt = await self.off_loop(self.prompts.completion_ids, body)
        self.prompts.check_len("prompt", prompt)
        sp = body.sampling(self.prompts.budget("max_tokens", prompt, body.max_tokens, 16))
        return await self._serve(request, body, version, prompt, sp, body.logprobs or 0, chat=False,
                                 structured=body.structured_outputs() if structured else None,
                                 request_id=request_id)

    @staticmethod
    def request_id(request: Request) -> str:
        """Header ``x-request-id``, else a new ``req-<16 hex>``.

        Raises:
            ServingValidationError: 400 naming ``x-request-id`` when it is longer than
                :data:`REQUEST_ID_MAX_CHARS` (the completion event could not carry it).
        """
        rid = request.headers.get("x-request-id")
        if not rid:
            return f"req-{uuid.uuid4().hex[:16]}"
        if len(rid) > REQUEST_ID_MAX_CHARS:
            raise ServingValidationError("x-request-id", rid[:40] + "...", f"at most {REQUEST_ID_MAX_CHARS} characters")
        return rid

    def structured_ok(self) -> bool:
        """Whether the engine does structured outputs and tool calls (the vLLM engine)."""
        return bool(getattr(self.engine, "supports_structured", False))

    # ------------------------------------------------------------------ running n choices
    async def _serve(self, request: Request, body, version: str | None, prompt: list[int], sp,
                     top_logprobs: int, chat: bool, structured: dict | None = None, tools: list | None = None,
                     request_id: str = "", messages: list | None = None):
        """Run ``n`` choices on one version and answer in the OpenAI shape, as JSON or SSE.
        ``structured``: vLLM structured-outputs constraint; ``tools``: parse tool calls;
        ``messages``: the chat messages each finished choice is observed with by the signal
        detector (None: not observed)."""
        split = self.split_of(request, body, prompt)
        uh = user_hash(request, body.user, self.salt)
        run = _Run(lm=self.slots.pick(uh, version=version), prompt=prompt, n=body.n or 1, stops=body.stop_strings(),
                   split=split, user_hash=uh, created_ms=now_ms(),
                   request_id=request_id or self.request_id(request),
                   q=asyncio.Queue() if body.stream else None, structured=structured, tools=tools,
                   messages=messages)
        # choice i samples with seed + i: n copies of one seeded draw would be surprising
        run.sps = [sp if i == 0 or sp.seed is None else sp.model_copy(update={"seed": sp.seed + i})
                   for i in range(run.n)]
        run.greqs = [GenRequest(prompt_token_ids=run.prompt, sampling=run.sps[i], model=run.lm,
                                stop_token_ids=(self.engine.eos_id,), top_logprobs=top_logprobs,
                                stop_check=self.prompts.stop_check(run.stops), structured=run.structured)
                     for i in range(run.n)]
        await self._start(run)
        if run.q is None:
            return await self._json(run, body, chat, request)
        return self._stream(run, body, chat)

    async def _start(self, run: "_Run") -> None:
        """Start the ``n`` choices (:meth:`_choice`, each iterating ``engine.generate``), all
        or none: a choice the engine refuses (429 queue full, 400, engine closed) stops the
        others before they made a token, nothing is logged, and the refusal is raised.

        The engine admits or refuses a request when its ``generate`` starts, before it first
        suspends (:meth:`serving.engine_base.Engine.generate`), so one pass of the event loop
        after the choices started tells which were refused.

        Raises:
            ServingValidationError: the engine refused a choice (status 429, 400...).
            RuntimeError: the engine is closed.
        """
        metrics, version = self.metrics, run.lm.version
        # counted when routed, so errors <= requests per version (error rate = errors / requests)
        metrics.version_requests.labels(version).inc(run.n)
        metrics.version_errors.labels(version)  # export 0 errors, not "no data", for this version
        run.tasks = [asyncio.ensure_future(self._choice(run, i)) for i in range(run.n)]
        try:
            await asyncio.sleep(0)  # every choice runs up to its admission
        except asyncio.CancelledError:
            run.abort(self.engine)  # nobody will read the answer; the choices still log their events
            raise
        refused = [t.exception() for t in run.tasks if t.done() and not t.cancelled() and t.exception()]
        if not refused:
            run.admitted = True
            return
        others = [t for t in run.tasks if not t.done()]
        for t in others:
            t.cancel()  # leaving engine.generate aborts its request
        await asyncio.gather(*others, return_exceptions=True)
        if isinstance(refused[0], ServingValidationError) and refused[0].status == 429:
            metrics.version_errors.labels(version).inc(run.n)  # all n choices failed
        raise refused[0]

    def _generate(self, req: GenRequest, final: bool):
        """``engine.generate(req)``; ``final``: only the last output is wanted (JSON answers)."""
        if final and self._final_only:
            return self.engine.generate(req, final_only=True)
        return self.engine.generate(req)

    async def _choice(self, run: "_Run", i: int) -> GenResult:
        """Choice ``i`` through ``engine.generate``: its steps to the stream (if any), then its
        event logged and observed. Once admitted it runs to its end even if the client goes
        away (an abort ends it early): one completion, one event.

        Raises:
            ServingValidationError, RuntimeError: the engine refused it (before admission).
            Exception: the engine failed it (counted as an error of its version).
        """
        self.inflight += 1
        res = None
        try:
            async with contextlib.aclosing(self._generate(run.greqs[i], final=run.q is None)) as outs:
                async for out in outs:
                    if run.q is not None and (out.token_ids or not out.finished):
                        run.q.put_nowait((i, out, None))
                    if out.finished:
                        res = out.result
            if res is None:
                raise RuntimeError(f"the engine ended choice {i} without a finished output")
        except BaseException as exc:
            if run.admitted:  # a refusal is counted, all n at once, by _start
                self.metrics.version_errors.labels(run.lm.version).inc()
                if run.q is not None:
                    run.q.put_nowait((i, None, exc))
            raise
        finally:
            self.inflight -= 1
        self.log.submit(run.cids[i], run.request_id, run.user_hash, run.prompt, run.sps[i], res, run.created_ms,
                        run.split)  # built off the loop
        if run.messages is not None:
            self._submit_signal(run, i, res)
        self.metrics.observe(res, len(run.prompt))
        if run.q is not None:
            run.q.put_nowait((i, None, res))  # after every step of choice i
        return res

    def _submit_signal(self, run: "_Run", i: int, res: GenResult) -> None:
        """Hand choice ``i`` to the signals thread, unless :attr:`signal_backlog` choices are
        already waiting there (then it is not observed: counted in :attr:`signals_dropped`,
        logged at most once a minute)."""
        with self._signal_lock:
            full = self._signal_pending >= self.signal_backlog
            if full:
                self.signals_dropped += 1
            else:
                self._signal_pending += 1
        if full:
            now = time.monotonic()
            if now - self._signal_drop_logged > 60:
                self._signal_drop_logged = now
                log.warning("signals: %d finished choices wait for the signal detector (its judge is slow?): "
                            "completion %s not observed; %d not observed so far", self.signal_backlog, run.cids[i],
                            self.signals_dropped)
            return
        try:
            self._signal_last = self._signal_pool.submit(self._derive, run, i, res)
        except RuntimeError:  # closed: the pod is stopping
            with self._signal_lock:
                self._signal_pending -= 1
            log.warning("signals of completion %s not derived: the pod is stopping", run.cids[i])

    def _derive(self, run: "_Run", i: int, res: GenResult) -> None:
        """Observe choice ``i`` with the signal detector and publish the events it returns
        (on the signals thread; a failure is logged, the request already has its answer)."""
        try:
            self._observe(run, i, res)
        finally:
            with self._signal_lock:
                self._signal_pending -= 1

    def _observe(self, run: "_Run", i: int, res: GenResult) -> None:
        try:
            if run.turn is None:  # once per request: its choices run here one after the other
                run.turn = self.signals.turn(run.messages)
            text = self.prompts.text(res.completion_token_ids, run.stops)
            events = self.signals.observe_turn(run.user_hash, run.turn, run.cids[i], text, run.created_ms,
                                               run.request_id)
            ev_log = self.log.event_log
            for ev in events:
                if ev_log is not None:
                    ev_log.emit(self.feedback_topic, str(ev.completion_id), ev.to_bytes())
                self.metrics.events_accepted.labels(ev.kind).inc()
        except Exception:  # noqa: BLE001 - a signal must never fail or stall serving
            log.exception("signals of completion %s could not be derived", run.cids[i])

    def flush_signals(self, timeout_s: float = 30.0) -> None:
        """Wait until every finished choice was observed and its events handed to the event log."""
        last = self._signal_last
        if last is not None:
            concurrent.futures.wait([last], timeout=timeout_s)

    def close(self) -> None:
        """Finish the pending signal observations and stop their thread (before the event
        log closes)."""
        if self._signal_pool is not None:
            self._signal_pool.shutdown(wait=True)

    async def _json(self, run: "_Run", body, chat: bool, request: Request | None = None):
        """The whole response once every choice ended. A client that disconnects first
        aborts the choices still running, as vLLM's server does (``with_cancellation``); their
        events are still logged, and the answer nobody reads is a 499."""
        results_f = asyncio.ensure_future(asyncio.gather(*run.tasks))
        results_f.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, even when nobody waits
        gone = asyncio.ensure_future(_client_gone(request)) if request is not None else None
        try:
            await asyncio.wait([results_f] + ([gone] if gone else []), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            run.abort(self.engine)
            raise
        finally:
            if gone is not None:
                gone.cancel()
        if not results_f.done():
            run.abort(self.engine)
            return json_response(error_body("client closed the request before the answer", None,
                                            code="client_closed_request"), 499)
        results = results_f.result()
        choices = []
        for i, res in enumerate(results):
            if chat:
                lp = wire.chat_logprobs(res, self.prompts.token_str) if body.logprobs else None
            else:
                lp = wire.completion_logprobs(res, self.prompts.token_str) if body.logprobs is not None else None
            text, calls = self.prompts.text(res.completion_token_ids, run.stops), None
            if run.tools:  # vLLM's tool parser on the whole completion
                text, calls = self.engine.parse_tool_calls(text, run.tools)
            choices.append(wire.choice(i, text, res, str(run.cids[i]), chat=chat, logprobs=lp, tool_calls=calls))
        out = wire.response(str(run.cids[0]), run.created_ms // 1000, run.lm.version, choices,
                            wire.usage(len(run.prompt), results), chat=chat)
        return json_response(out, 200, run.headers())

    def _stream(self, run: "_Run", body, chat: bool) -> StreamingResponse:
        """Server-sent events as the choices run (:class:`serving.http.streaming.ChoiceStreams`)."""
        streams = ChoiceStreams(
            str(run.cids[0]), [str(c) for c in run.cids], run.created_ms // 1000, run.lm.version, chat=chat,
            text=lambda ids: self.prompts.text(ids, run.stops), token_str=self.prompts.token_str,
            want_logprobs=bool(body.logprobs) if chat else body.logprobs is not None,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            prompt_len=len(run.prompt), text_stream=lambda: self.prompts.text_stream(run.stops), stops=run.stops)
        # client went away: stop generating the choices still running; their events are still logged
        return StreamingResponse(streams.events(run.q, lambda: run.abort(self.engine, unfinished_only=True)),
                                 media_type="text/event-stream", headers=run.headers())


async def _client_gone(request: Request) -> None:
    """Return once the client of ``request`` (whose body was read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class _Run:
    """One request's ``n`` choices while they run."""

    lm: LoadedModel
    prompt: list[int]
    n: int
    stops: list[str]
    split: str
    user_hash: str
    created_ms: int
    request_id: str
    q: asyncio.Queue | None  # streaming: (choice, step | None, None | result | exception)
    structured: dict | None = None  # vLLM structured-outputs constraint (response_format)
    tools: list | None = None  # OpenAI tools the completion may call
    messages: list | None = None  # chat messages the signal detector observes (None: not observed)
    turn: ChatTurn | None = None  # the detector's reading of ``messages``, made once (signals thread)
    cids: list[uuid.UUID] = field(default_factory=list)
    sps: list = field(default_factory=list)
    greqs: list[GenRequest] = field(default_factory=list)
    tasks: list = field(default_factory=list)  # one asyncio task per choice (OpenAIServing._choice)
    admitted: bool = False  # every choice was admitted by the engine (OpenAIServing._start)

    def __post_init__(self):
        self.cids = [uuid.uuid4() for _ in range(self.n)]

    def headers(self) -> dict[str, str]:
        return {CID_HEADER: str(self.cids[0]), CIDS_HEADER: ",".join(map(str, self.cids)),
                VERSION_HEADER: self.lm.version, SPLIT_HEADER: self.split}

    def abort(self, engine, unfinished_only: bool = False) -> None:
        """``engine.abort`` every choice (``unfinished_only``: those still running); each still
        ends through its ``generate`` iteration and logs its event."""
        for g, task in zip(self.greqs, self.tasks):
            if not (unfinished_only and task.done()):
                engine.abort(g)
