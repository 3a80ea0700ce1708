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
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from schemas.events import hash_user, now_ms
from schemas.split import SPLIT_HEADER, SPLIT_TAG, SPLITS, choose_split
from serving.http import wire
from serving.http.completion_log import CompletionLogger
from serving.http.errors import json_response
from serving.http.metrics import ServingMetrics
from serving.http.prompts import PromptBuilder
from serving.params import GenRequest, GenResult, ServingValidationError, StepOutput
from serving.protocol import ChatCompletionRequest, CompletionRequest
from serving.slots import Slots

USER_HEADER = "x-flywheel-user"
CID_HEADER = "x-flywheel-completion-id"
CIDS_HEADER = "x-flywheel-completion-ids"  # all n choices, comma-separated, in choice order
VERSION_HEADER = "x-flywheel-model-version"
DEFAULT_SERVED_MODEL_NAME = "flywheel"


def user_hash(request: Request, user: str | None, salt: str) -> str:
    """Salted hash of the request's user: ``user`` field, else header ``x-flywheel-user``,
    else ``anonymous``."""
    return hash_user(user or request.headers.get(USER_HEADER) or "anonymous", salt)


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
    """

    def __init__(self, slots: Slots, prompts: PromptBuilder, completions_log: CompletionLogger,
                 metrics: ServingMetrics, *, salt: str, served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
                 eval_share: float = 0.0, default_max_tokens: int = 256):
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
        body.check_supported()
        if body.top_logprobs and not body.logprobs:
            raise ServingValidationError("top_logprobs", body.top_logprobs, "requires logprobs=true")
        prompt = self.prompts.chat_ids(body)
        self.prompts.check_len("messages", prompt)
        asked = body.max_completion_tokens or body.max_tokens
        field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        sp = body.sampling(self.prompts.budget(field, prompt, asked, self.default_max_tokens))
        return await self._serve(request, body, version, prompt, sp, body.top_logprobs or 0, chat=True)

    async def completions(self, body: CompletionRequest, request: Request):
        """OpenAI (legacy) text completions (JSON or SSE)."""
        version = self.resolve_model(body.model)
        body.check_supported()
        prompt = self.prompts.completion_ids(body)
        self.prompts.check_len("prompt", prompt)
        sp = body.sampling(self.prompts.budget("max_tokens", prompt, body.max_tokens, 16))
        return await self._serve(request, body, version, prompt, sp, body.logprobs or 0, chat=False)

    # ------------------------------------------------------------------ running n choices
    async def _serve(self, request: Request, body, version: str | None, prompt: list[int], sp,
                     top_logprobs: int, chat: bool):
        """Run ``n`` choices on one version and answer in the OpenAI shape, as JSON or SSE."""
        engine, metrics = self.engine, self.metrics
        split = self.split_of(request, body, prompt)
        uh = user_hash(request, body.user, self.salt)
        lm = self.slots.pick(uh, version=version)
        n = body.n or 1
        cids = [uuid.uuid4() for _ in range(n)]
        # choice i samples with seed + i: n copies of one seeded draw would be surprising
        sps = [sp if i == 0 or sp.seed is None else sp.model_copy(update={"seed": sp.seed + i}) for i in range(n)]
        request_id = request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex[:16]}"
        created_ms = now_ms()
        stops = body.stop_strings()
        headers = {CID_HEADER: str(cids[0]), CIDS_HEADER: ",".join(map(str, cids)), VERSION_HEADER: lm.version,
                   SPLIT_HEADER: split}
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
                def on_step(out: StepOutput, i=i) -> None:
                    loop.call_soon_threadsafe(q.put_nowait, (i, out, None))

                greqs.append(GenRequest(prompt_token_ids=prompt, sampling=sps[i], model=lm,
                                        stop_token_ids=(engine.eos_id,), top_logprobs=top_logprobs,
                                        on_step=on_step if stream else None,
                                        stop_check=self.prompts.stop_check(stops)))
                futs.append(engine.submit(greqs[-1]))  # raises 429 here, before anything is logged
        except ServingValidationError as exc:
            for g, f in zip(greqs, futs):  # all or nothing: never a partial set of choices
                f.cancel()
                engine.abort(g)
            if exc.status == 429:
                metrics.version_errors.labels(lm.version).inc(n)  # all n choices failed
            raise
        self.inflight += n

        async def finish(i: int) -> GenResult:
            # Runs to the end even if the client goes away: one completion, one event.
            try:
                res = await asyncio.wrap_future(futs[i])
            except BaseException as exc:
                metrics.version_errors.labels(lm.version).inc()
                if q is not None:
                    q.put_nowait((i, None, exc))
                raise
            finally:
                self.inflight -= 1
            self.log.submit(cids[i], request_id, uh, prompt, sps[i], res, created_ms, split)  # built off the loop
            metrics.observe(res, len(prompt))
            if q is not None:
                q.put_nowait((i, None, res))  # after every token of choice i (same loop, FIFO)
            return res

        tasks = [asyncio.ensure_future(finish(i)) for i in range(n)]
        created = created_ms // 1000
        rid = str(cids[0])
        if not stream:
            try:
                results = await asyncio.shield(asyncio.gather(*tasks))
            except asyncio.CancelledError:
                for g in greqs:
                    engine.abort(g)
                raise
            choices = []
            for i, res in enumerate(results):
                if chat:
                    lp = wire.chat_logprobs(res, self.prompts.token_str) if body.logprobs else None
                else:
                    lp = wire.completion_logprobs(res, self.prompts.token_str) if body.logprobs is not None else None
                choices.append(wire.choice(i, self.prompts.text(res.completion_token_ids, stops), res, str(cids[i]),
                                           chat=chat, logprobs=lp))
            out = wire.response(rid, created, lm.version, choices, wire.usage(len(prompt), results), chat=chat)
            return json_response(out, 200, headers)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        want_lp = bool(body.logprobs) if chat else body.logprobs is not None
        lp_toks: list[list[tuple[int, float, list]]] = [[] for _ in range(n)]  # not yet sent, per choice
        lp_off = [0] * n  # text offset of choice i's next token (completions' text_offset)

        def take_logprobs(i: int) -> dict | None:
            """The streamed chunk's ``logprobs``: the tokens since choice i's previous chunk."""
            if not want_lp or not lp_toks[i]:
                return None
            steps, lp_toks[i] = lp_toks[i], []
            if chat:
                return wire.chat_logprobs_of(steps, self.prompts.token_str)
            out, lp_off[i] = wire.completion_logprobs_of(steps, self.prompts.token_str, lp_off[i])
            return out

        def chunk(i: int, delta_text: str | None, finish_reason: str | None, first: bool = False) -> str:
            return wire.sse(wire.chunk(rid, created, lm.version, i, str(cids[i]), delta_text, finish_reason,
                                       chat=chat, first=first, include_usage=include_usage,
                                       logprobs=None if first else take_logprobs(i)))

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
                    i, step, x = await q.get()
                    if step is None:  # choice i ended: x is its GenResult or its exception
                        left -= 1
                        if isinstance(x, BaseException):
                            yield wire.sse({"error": {"message": f"internal error: {type(x).__name__}",
                                                      "type": "server_error", "param": None, "code": None}})
                            yield wire.sse("[DONE]")
                            return
                        results[i] = x
                        text = self.prompts.text(x.completion_token_ids, stops)
                        if len(text) > len(sent[i]) and text.startswith(sent[i]):
                            yield chunk(i, text[len(sent[i]):], None)
                        yield chunk(i, None if chat else "", wire.wire_finish(x.finish_reason))
                        continue
                    toks[i] += step.token_ids
                    if want_lp:
                        tops = step.top_logprobs or [[] for _ in step.token_ids]
                        lp_toks[i] += zip(step.token_ids, step.logprobs, tops)
                    text = self.prompts.text(toks[i], stops)
                    if text.endswith("\ufffd"):
                        continue  # incomplete UTF-8 sequence: wait for the next token
                    if len(text) > len(sent[i]) and text.startswith(sent[i]):
                        delta, sent[i] = text[len(sent[i]):], text
                        yield chunk(i, delta, None)
                if include_usage:
                    yield wire.sse(wire.usage_chunk(rid, created, lm.version, wire.usage(len(prompt), results),
                                                    chat=chat))
                yield wire.sse("[DONE]")
            finally:
                for g, task in zip(greqs, tasks):
                    if not task.done():
                        engine.abort(g)  # client went away: stop generating; the event is still logged

        return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)
