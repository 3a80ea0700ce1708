"""The logic of ``POST /v1/feedback`` and ``POST /v1/feedback/batch`` (docs/sdk.md, "HTTP API").

Each accepted event becomes one ``FeedbackEvent`` on ``flywheel.feedback`` (key =
completion id). ``event_id`` is the idempotency key: the pod remembers the content of its
last 100,000 event ids, so a retried event (same id, same content) is answered
``duplicate: true`` and not published again (once the first post's event is durable: a retry
that arrives while it is not yet waits for it), and the same id with other content is refused
409 ``event_id_conflict``. Across pods, the join counts an ``event_id`` once.

An event is answered 200 only once it is durable: acked by Kafka or fsync'd in the pod's
event journal (``EventLog.emit(durable=True)``), so a pod SIGKILLed after its answer still
delivers it. If that does not happen within ``DURABLE_TIMEOUT_S`` (or the journal write
fails) the answer is 503 ``event_not_durable`` and the id is forgotten, so the client's
retry with the same ``event_id`` publishes it again (the join dedupes by ``event_id``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import threading
import uuid
from typing import Any

from pydantic import ValidationError

from schemas.events import FeedbackEvent, clamp_event_time, hash_user, now_ms
from serving.http.completion_log import CompletionLogger
from serving.http.errors import error_body, pydantic_error_param, validation_error_body
from serving.http.metrics import ServingMetrics
from serving.params import ServingValidationError
from serving.protocol import FeedbackRequest

RECENT_EVENT_IDS = 100_000
DURABLE_TIMEOUT_S = 30.0  # how long an answer waits for its event to be acked or journaled (s)


class FeedbackServing:
    """Feedback intake of one pod.

    Args:
        event_log: a :class:`serving.eventlog.EventLog`, or None (logging off).
        completions_log: tells which version served a completion (vote metrics).
        metrics: the pod's metrics.
        salt: user-id salt.
        topic: the feedback topic's full name (:class:`schemas.topics.TopicNames`).
    """

    def __init__(self, event_log, completions_log: CompletionLogger, metrics: ServingMetrics, salt: str,
                 topic: str):
        self.event_log = event_log
        self.completions_log = completions_log
        self.metrics = metrics
        self.salt = salt
        self.topic = topic
        # event_id -> (content digest, durable future of its one publication)
        self._seen: collections.OrderedDict[str, tuple[str, Any]] = collections.OrderedDict()
        self._lock = threading.Lock()

    async def accept(self, body: FeedbackRequest, user_header: str | None) -> dict:
        """Publish one event and wait until it is durable; ``{"event_id", "accepted": True,
        "duplicate"}``.

        Raises:
            ServingValidationError: 400 naming the field (the event contract refused it), 409
                ``event_id_conflict`` (this id was posted with other content), 503
                ``event_not_durable`` (neither acked nor journaled in time; retry the same id).
        """
        result, fut = self._publish(body, user_header)
        if fut is not None:
            await self._durable(result["event_id"], fut)
        return result

    async def _durable(self, key: str, fut) -> None:
        """Wait for ``fut`` (the event's durable future); 503 and forget ``key`` if it fails."""
        try:
            # shielded: a waiter that times out must not cancel the event's durable future,
            # which other posts of the same event_id may share
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), DURABLE_TIMEOUT_S)
            return
        except asyncio.TimeoutError:
            why = f"was neither acked by Kafka nor journaled within {DURABLE_TIMEOUT_S:g} s"
        except Exception as exc:  # noqa: BLE001 - journal write failed / refused for good
            why = f"could not be made durable ({exc})"
        with self._lock:
            if self._seen.get(key, (None, None))[1] is fut:  # not a later publication of the id
                self._seen.pop(key, None)
        raise ServingValidationError("event_id", key, f"{why}; retry with the same event_id",
                                     status=503, code="event_not_durable")

    @staticmethod
    def _event_time(created_at: int) -> int:
        """The clock-skew rule (``schemas.events.clamp_event_time``, the one ingest applies on
        Kafka): a client time within the tolerance ahead of this pod's clock is clamped to it;
        beyond it, 422 ``created_at_in_future``. Earlier times pass through (the contract
        checks they are ms since the epoch)."""
        try:
            return clamp_event_time("created_at", created_at)
        except ValueError as exc:
            raise ServingValidationError("created_at", created_at, str(exc).split(": ", 1)[-1], status=422,
                                         code="created_at_in_future") from None

    def _publish(self, body: FeedbackRequest, user_header: str | None):
        """Validate, dedupe and emit one event: ``(result, durable future or None)``."""
        event_id = body.event_id or uuid.uuid4()
        uh = hash_user(body.user or user_header or "anonymous", self.salt)
        created_at = now_ms() if body.created_at is None else self._event_time(body.created_at)
        try:
            ev = FeedbackEvent(event_id=event_id, completion_id=body.completion_id, user_hash=uh, kind=body.kind,
                               value=body.value, comment=body.comment, created_at=created_at, name=body.name,
                               metadata=body.metadata, final_text=body.final_text)
        except ValidationError as exc:
            e = exc.errors()[0]
            param, msg = pydantic_error_param(e)
            value = e.get("input")
            if isinstance(value, dict):  # a model-level check: never echo user_hash
                value = value.get(param)
            reason = msg.split(": ", 1)[-1]
            # the event model's own rules end with ", got X"; the error adds "(got X)" itself
            reason = reason.rsplit(", got ", 1)[0] if ", got " in reason else reason
            raise ServingValidationError(param or "body", value, reason) from None
        content = ev.model_dump(mode="json", exclude={"event_id", "created_at"})
        digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
        key = str(event_id)
        with self._lock:  # held across the emit: one of two concurrent posts of an id publishes
            seen = self._seen.get(key)
            if seen is not None:
                if seen[0] != digest:
                    raise ServingValidationError("event_id", key, "was already posted with other content",
                                                 status=409, code="event_id_conflict")
                # a retry while the first post still waits: answered once that event is durable
                # (a 200 before it would be lost with the pod if it died first)
                return {"event_id": key, "accepted": True, "duplicate": True}, seen[1]
            fut = None
            if self.event_log is not None:
                fut = self.event_log.emit(self.topic, str(body.completion_id), ev.to_bytes(), durable=True)
            self._seen[key] = (digest, fut)  # only once published: a failed emit can be retried
            while len(self._seen) > RECENT_EVENT_IDS:
                self._seen.popitem(last=False)
        self.metrics.events_accepted.labels(body.kind).inc()
        if body.kind == "thumb":
            v = self.completions_log.version_of(str(body.completion_id))
            self.metrics.version_votes.labels(v, "up" if body.value > 0 else "down").inc()
        return {"event_id": key, "accepted": True, "duplicate": False}, fut

    async def accept_batch(self, events: list[Any], user_header: str | None) -> dict:
        """Check and publish each event on its own, in order; per-event results.

        Returns:
            ``{"accepted": int, "rejected": int, "results": [{"index", "status", ...}]}``
            where ``status`` is what ``POST /v1/feedback`` answers for that event.
        """
        results, pending = [], []
        for i, raw in enumerate(events):
            try:
                try:
                    body = FeedbackRequest.model_validate(raw)
                except ValidationError as exc:
                    param, msg = pydantic_error_param(exc.errors()[0], exc.errors())
                    results.append({"index": i, "status": 400, "accepted": False,
                                    "error": error_body(msg, param)["error"]})
                    continue
                result, fut = self._publish(body, user_header)
                results.append({"index": i, "status": 200, **result})
                if fut is not None:
                    pending.append((len(results) - 1, fut))
            except ServingValidationError as exc:
                results.append({"index": i, "status": exc.status, "accepted": False,
                                "error": validation_error_body(exc)["error"]})
        for j, fut in pending:
            try:
                await self._durable(results[j]["event_id"], fut)
            except ServingValidationError as exc:
                results[j] = {"index": results[j]["index"], "status": exc.status, "accepted": False,
                              "error": validation_error_body(exc)["error"]}
        ok = sum(r["accepted"] for r in results)
        return {"accepted": ok, "rejected": len(results) - ok, "results": results}
