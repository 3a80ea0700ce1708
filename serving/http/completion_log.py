"""One ``CompletionEvent`` per served completion, on ``flywheel.completions`` (key =
completion id), and a bounded memory of which version served each recent completion (so a
thumb vote can be counted per version in ``flywheel_version_votes_total``).

Building an event (pydantic validation, route compression, JSON encoding) costs ~1 ms per
completion with routes; :meth:`CompletionLogger.submit` does it on one background thread, off
the event loop, in submission order (one thread, FIFO), and ``flush`` waits for it."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import uuid

from pydantic import TypeAdapter, ValidationError

from schemas.events import CompletionEvent, ExpertRoutes, IdText, SamplingParams
from serving.params import GenResult

log = logging.getLogger("flywheel.serving.completion_log")

RECENT_COMPLETIONS = 100_000  # completion ids remembered for per-version vote counts


class CompletionLogger:
    """Builds, validates and emits completion events.

    Args:
        event_log: a :class:`serving.eventlog.EventLog`, or None (logging off: benchmarks).
        pod: the pod name written into every event.
        topic: the completions topic's full name (:class:`schemas.topics.TopicNames`).
        on_emit: called with ``"completion"`` after each event (metrics).

    Raises:
        ValueError: ``pod`` is not a valid event ``pod`` (1-256 characters, no NUL or lone
            surrogate): every event would fail to build.
    """

    def __init__(self, event_log, pod: str, topic: str, on_emit=None):
        try:
            TypeAdapter(IdText).validate_python(pod)
        except ValidationError as exc:
            raise ValueError(f"pod: {pod[:80]!r} cannot name a pod in events: {exc.errors()[0]['msg']}") from None
        self.event_log = event_log
        self.pod = pod
        self.topic = topic
        self.on_emit = on_emit
        self._recent: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flywheel-completion-log")
        self._last: concurrent.futures.Future | None = None

    def submit(self, cid: uuid.UUID, request_id: str, user_hash: str, prompt: list[int], sp: SamplingParams,
               res: GenResult, created_ms: int, split: str) -> concurrent.futures.Future:
        """:meth:`emit` on the logger's thread; returns at once. The completion's version is
        remembered now (a vote right after the response finds it); an event that fails to
        build is logged with its error (it cannot be valid later either)."""
        self._remember(str(cid), res.version)
        fut = self._pool.submit(self._emit_logged, cid, request_id, user_hash, prompt, sp, res, created_ms, split)
        self._last = fut
        return fut

    def _emit_logged(self, *args) -> None:
        try:
            self.emit(*args)
        except Exception:  # noqa: BLE001 - one bad event must not stop the logger thread
            log.exception("completion event %s could not be built", args[0])

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every submitted event went to the event log."""
        last = self._last
        if last is not None:
            concurrent.futures.wait([last], timeout=timeout_s)

    def close(self) -> None:
        """Finish the submitted events and stop the thread."""
        self._pool.shutdown(wait=True)

    def emit(self, cid: uuid.UUID, request_id: str, user_hash: str, prompt: list[int], sp: SamplingParams,
             res: GenResult, created_ms: int, split: str) -> None:
        """Log choice ``cid``'s completion (``split``: ``train`` or ``eval``)."""
        routes = ExpertRoutes.from_array(res.expert_routes) if res.expert_routes is not None else None
        ev = CompletionEvent(
            completion_id=cid, request_id=request_id, created_at=created_ms, model_version=res.version,
            pod=self.pod, user_hash=user_hash, prompt_token_ids=prompt,
            completion_token_ids=res.completion_token_ids, behavior_logprobs=res.behavior_logprobs,
            sampling=sp, expert_routes=routes, finish_reason=res.finish_reason, ttft_ms=res.ttft_ms,
            latency_ms=res.latency_ms, split=split)
        if self.event_log is not None:
            self.event_log.emit(self.topic, str(cid), ev.to_bytes())
        if self.on_emit is not None:
            self.on_emit("completion")
        self._remember(str(cid), res.version)

    def _remember(self, cid: str, version: str) -> None:
        with self._lock:
            self._recent[cid] = version
            while len(self._recent) > RECENT_COMPLETIONS:
                self._recent.popitem(last=False)

    def version_of(self, cid: str) -> str:
        """The version that served ``cid`` (``unknown`` if not among the recent ones)."""
        with self._lock:
            return self._recent.get(cid, "unknown")
