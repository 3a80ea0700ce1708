"""The async engine protocol (:class:`Engine`, vLLM's ``EngineClient`` shape) that every
engine implements and the serving classes drive: :meth:`Engine.generate` streams a request's
per-step outputs, :meth:`Engine.abort` ends it, :meth:`Engine.check_health` says whether the
engine can serve; and what every engine shares: :class:`LoadedModel` (one set of servable
weights, a weight slot's content), :func:`check_request`, :data:`CHAT_STOP`.

Nothing here needs torch at import: :class:`serving.engine.TorchEngine` and
:class:`serving.engine_vllm.VLLMEngine` implement the protocol, :class:`serving.slots.Slots`
and the HTTP layer (:mod:`serving.http.serving_openai`) are typed by it. This module imports
no engine.

Hand-off from engine threads to the event loop: every output of every running request goes
through one :class:`LoopInbox` per event loop, which wakes the loop once per burst (all the
outputs of one engine step) instead of once per output.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from serving.params import GenRequest, GenResult, ServingValidationError, StepOutput

__all__ = ["CHAT_STOP", "Engine", "LoadedModel", "LoopInbox", "check_request"]

CHAT_STOP = "<|im_end|>"  # the chat template's end of turn: the engines' eos when the tokenizer has it


@dataclass
class LoadedModel:
    """One set of weights ready to serve (a weight slot's content), built by an engine's
    :meth:`Engine.load_weights` (or ``load_base``).

    Attributes:
        version: version id (``v000123``).
        model: what runs the weights: the torch module (eval mode, never mutated after load;
            KV caches are per request, so requests on different versions never share state)
            for the torch engine, the engine instance holding them for the vLLM engine.
        hashes: ``{tensor name: sha256}`` verified at load (``schemas.manifest.state_sha256``).
        weights_digest: ``digest_of_hashes(hashes)``.
        loaded_at: ms since epoch; load_ms: time to build + verify (ms).
        routers / route_buf: torch engine only: the MoE router modules and, per transformer
            layer (global index, vLLM's layout; None for dense layers), the expert indices
            ``(N, k)`` int64 of the last forward (filled by forward hooks,
            :func:`serving.torch_engine.loader.wrap`); empty for a dense model. Read them with
            :meth:`layer_routes`. route_dims: ``(L, k, E)`` of the routes it logs.
        prefix_cache: this version's :class:`serving.prefix_cache.PrefixCache`, or None when
            the engine runs without prefix caching.
    """

    version: str
    model: Any
    hashes: dict[str, str]
    weights_digest: str
    loaded_at: int
    load_ms: float
    routers: list = field(default_factory=list)
    route_buf: list = field(default_factory=list)  # per layer: last indices (N, k), None = dense
    route_dims: tuple = (0, 0, 0)  # (L, k, E): schemas.routers.route_shape of the model
    prefix_cache: Any = None  # serving.prefix_cache.PrefixCache of these weights, or None (off)

    def layer_routes(self) -> list:
        """The last forward's routes per transformer layer: ``num_hidden_layers`` tensors
        ``(N, k)`` int64, zeros for dense layers (as vLLM reports them)."""
        import torch

        ref = next(b for b in self.route_buf if b is not None)
        return [torch.zeros_like(ref) if b is None else b for b in self.route_buf]


def check_request(req: GenRequest) -> None:
    """Refuse a request no engine can run.

    Raises:
        ServingValidationError: 400 naming the field: ``prompt`` with no token, no ``model``.
    """
    if not req.prompt_token_ids:
        raise ServingValidationError("prompt", req.prompt_token_ids, "must have at least one token")
    if req.model is None:
        raise ServingValidationError("model", None, "no weights to run on")


class LoopInbox:
    """Hands items from engine threads to ``asyncio.Queue``s of one event loop, waking the loop
    once per burst instead of once per item: every step of every running request that an
    engine emits in one iteration costs one ``call_soon_threadsafe`` (one self-pipe write and
    one loop wake-up), not one each.

    Order: items reach their queues in the order :meth:`put` was called, and before any
    callback that the putting thread schedules on the loop after its :meth:`put`.

    Args:
        loop: the event loop that owns the queues.
    """

    _of_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopInbox]" = weakref.WeakKeyDictionary()
    _of_loop_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "LoopInbox":
        """The one inbox of ``loop`` (made at first use, dropped with the loop)."""
        with cls._of_loop_lock:
            inbox = cls._of_loop.get(loop)
            if inbox is None:
                inbox = cls._of_loop[loop] = cls(loop)
            return inbox

    def put(self, q: asyncio.Queue, item) -> None:
        """From any thread: ``q.put_nowait(item)`` on the loop, soon. Items put after the
        loop closed are dropped (nobody can read them)."""
        with self._lock:
            self._items.append((q, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: its consumers are gone
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, collections.deque()
            self._scheduled = False
        for q, item in items:
            q.put_nowait(item)


class Engine(abc.ABC):
    """The async engine protocol the HTTP layer uses, modelled on vLLM's ``EngineClient``
    (``vllm/engine/protocol.py``): :meth:`generate` streams per-step outputs, :meth:`abort`
    ends a request by id, :meth:`check_health`, :meth:`load_weights`, :meth:`pause` /
    :meth:`resume`.

    Implementations provide :meth:`submit` (thread-safe: queue a request, get a
    ``concurrent.futures.Future`` of its :class:`GenResult`; every new token goes to
    ``req.emit_step`` before the future resolves); :meth:`generate`, :meth:`generate_sync`
    are built on it. Attributes every engine has: ``tokenizer``, ``eos_id``, ``pad_id``,
    ``max_positions`` (context length in tokens, or None).
    """

    tokenizer: Any
    eos_id: int
    max_positions: int | None

    @abc.abstractmethod
    def submit(self, req: GenRequest) -> concurrent.futures.Future:
        """Queue ``req``; the future resolves to its :class:`GenResult`.

        Raises:
            ServingValidationError: 429 when the queue is full; 400 for an empty prompt, a
                missing model or a parameter the engine cannot honour.
            RuntimeError: the engine is closed.
        """

    @abc.abstractmethod
    def abort(self, request: "str | GenRequest") -> None:
        """End a request (by ``request_id`` or the request itself) at its next step: it
        leaves the running batch, frees its KV cache, and resolves with finish reason
        ``abort`` and the tokens made so far. Unknown or finished ids are ignored."""

    @abc.abstractmethod
    def check_health(self) -> dict:
        """Raise RuntimeError if the engine cannot serve; else a dict of facts."""

    @abc.abstractmethod
    def load_weights(self, state: dict, version: str, expected_hashes: dict[str, str] | None = None
                     ) -> LoadedModel:
        """Build servable weights from ``state`` off the request path and verify their hashes."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Admit no new request (running ones go on to their end)."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Undo :meth:`pause`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop; waiting and running requests fail with RuntimeError."""

    def queue_depth(self) -> int:
        """Requests waiting to join a running batch."""
        return 0

    def num_running(self) -> int:
        """Requests in a running batch."""
        return 0

    async def generate(self, req: GenRequest, *, final_only: bool = False) -> AsyncIterator[StepOutput]:
        """Run ``req``, yielding one :class:`StepOutput` per engine step with its new tokens
        and raw logprobs; the last one has ``finished=True`` and the whole ``result``
        (routes, finish reason, timings). Leaving the iteration early (the consumer is
        cancelled, e.g. its HTTP client went away, or ``aclose()``) aborts the request, so
        it leaves the batch at the engine's next step.

        Admission: the request is queued (or refused) as soon as the first ``__anext__()``
        starts running, before the iteration first suspends; a refusal raises there. A caller
        that starts several requests at once (the ``n`` choices of one HTTP request) can so
        tell, after one pass of the event loop, which were refused.

        Args:
            req: the request; its ``on_step`` (if any) still sees every step, on the engine's
                thread.
            final_only: yield only the last output (vLLM's ``RequestOutputKind.FINAL_ONLY``):
                no per-step hand-off to the event loop, for callers that want the result only.

        Raises:
            ServingValidationError, RuntimeError: as :meth:`submit` (before the first output);
            the engine's error if the request fails.
        """
        inbox = LoopInbox.of(asyncio.get_running_loop())
        q: asyncio.Queue = asyncio.Queue()
        if not final_only:
            prev = req.on_step

            def on_step(out: StepOutput) -> None:
                if prev is not None:
                    prev(out)
                inbox.put(q, out)

            req.on_step = on_step
        fut = self.submit(req)
        # after every step of req: the engine resolves the future after its last emit_step
        fut.add_done_callback(lambda _f: inbox.put(q, None))
        try:
            while True:
                out = await q.get()
                if out is not None:
                    yield out
                    continue
                res = fut.result()  # the engine's exception, if it failed
                yield StepOutput(request_id=req.request_id, token_ids=[], logprobs=[], finished=True, result=res)
                return
        finally:
            if not fut.done():
                self.abort(req.request_id)

    def generate_sync(self, req: GenRequest, timeout_s: float | None = None) -> GenResult:
        """Blocking run of ``req`` for scripts and tests."""
        return self.submit(req).result(timeout_s)
