"""Feedback SDK: how a product reports thumbs and other signals about a completion.

Two transports:

* HTTP (default): ``POST {base_url}/v1/feedback`` with JSON
  ``{"completion_id", "event_id", "kind", "value", "comment", "user"}`` (serving hashes
  ``user`` and produces the FeedbackEvent).
* Direct to Kafka (``kafka_bootstrap=...``): a :class:`schemas.events.FeedbackEvent` on
  ``flywheel.feedback`` keyed by completion_id; ``user`` is hashed here with ``user_salt``.

Every event gets a client-set ``event_id`` (UUID4), the idempotency key: a retried POST
that did reach the server counts once in the join. Timeouts, transport errors and 5xx are
retried with exponential backoff and full jitter; an event that still fails is kept in a
bounded local buffer and sent by :meth:`FeedbackClient.flush` (also run at interpreter
exit). 4xx answers are not retried: :class:`FeedbackRejected`. Bad arguments raise
``ValueError`` naming the argument before anything is sent.

Example::

    fb = FeedbackClient("http://127.0.0.1:8000", api_key="sk-...")
    fb.thumbs_up(completion_id, user="alice")
    fb.record(completion_id, "thumb", -1, comment="wrong answer", user="alice")
    fb.flush()
"""

from __future__ import annotations

import asyncio
import atexit
import math
import random
import threading
import time
import uuid
from collections import deque
from typing import Any

import httpx

from schemas import topics
from schemas.events import FeedbackEvent, hash_user, now_ms

KINDS = ("thumb", "edit", "regenerate", "copy")


class FeedbackRejected(Exception):
    """The endpoint refused the event (HTTP 4xx); not retried. ``status`` and ``body`` set."""

    def __init__(self, status: int, body: str):
        super().__init__(f"feedback rejected: HTTP {status}: {body[:300]}")
        self.status, self.body = status, body


class BufferFull(Exception):
    """The local buffer holds ``buffer_size`` unsent events; the new one was not accepted."""


def build_event(completion_id: Any, kind: str, value: Any, comment: str | None = None,
                user: str | None = None) -> dict:
    """Validate arguments and return the wire payload (with a fresh ``event_id``).

    Raises:
        ValueError: naming the argument (``completion_id`` not a UUID, unknown ``kind``,
            a thumb ``value`` other than ±1, a non-finite ``value``, ``comment`` over 4096
            chars, empty ``user`` or one over 256 chars).
    """
    try:
        cid = str(uuid.UUID(str(completion_id)))
    except ValueError:
        raise ValueError(f"completion_id: not a UUID: {completion_id!r}") from None
    if kind not in KINDS:
        raise ValueError(f"kind: must be one of {KINDS}, got {kind!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"value: must be a finite number, got {value!r}")
    if kind == "thumb" and value not in (1, -1):
        raise ValueError(f"value: a thumb is +1 or -1, got {value!r}")
    if comment is not None and (not isinstance(comment, str) or len(comment) > 4096):
        raise ValueError("comment: must be a string of at most 4096 characters")
    if user is not None and (not isinstance(user, str) or not user or len(user) > 256):
        raise ValueError(f"user: must be a non-empty string of at most 256 characters, got {str(user)[:40]!r}")
    return {"completion_id": cid, "event_id": str(uuid.uuid4()), "kind": kind, "value": float(value),
            "comment": comment, "user": user}


class _Base:
    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout_s: float = 5.0,
                 max_retries: int = 4, backoff_s: float = 0.2, max_backoff_s: float = 5.0,
                 buffer_size: int = 10_000, kafka_bootstrap: str | None = None, user_salt: str | None = None):
        if base_url is None and kafka_bootstrap is None:
            raise ValueError("base_url: required unless kafka_bootstrap is given")
        if kafka_bootstrap is not None and not user_salt:
            raise ValueError("user_salt: required in Kafka mode (users are hashed before they leave)")
        for name, v in (("timeout_s", timeout_s), ("backoff_s", backoff_s), ("max_backoff_s", max_backoff_s)):
            if not v > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {v}")
        if max_retries < 0:
            raise ValueError(f"max_retries: must be >= 0, got {max_retries}")
        if buffer_size < 1:
            raise ValueError(f"buffer_size: must be >= 1, got {buffer_size}")
        self.base_url = base_url.rstrip("/") if base_url else None
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.buffer: deque[dict] = deque()
        self.buffer_size = buffer_size
        self.kafka_bootstrap, self.user_salt = kafka_bootstrap, user_salt
        self.sent = 0

    def _delay(self, attempt: int) -> float:
        """Full-jitter exponential backoff (s): uniform(0, min(max, base * 2**attempt))."""
        return random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2 ** attempt))

    def _to_event(self, p: dict) -> FeedbackEvent:
        return FeedbackEvent(event_id=p["event_id"], completion_id=p["completion_id"],
                             user_hash=hash_user(p["user"] or "anonymous", self.user_salt), kind=p["kind"],
                             value=p["value"], comment=p["comment"], created_at=now_ms())

    def _keep(self, payload: dict) -> None:
        if len(self.buffer) >= self.buffer_size:
            raise BufferFull(f"feedback buffer full ({self.buffer_size} unsent events); event "
                             f"{payload['event_id']} not accepted")
        self.buffer.append(payload)

    @staticmethod
    def _retryable(exc: Exception) -> bool:
        return isinstance(exc, (httpx.TimeoutException, httpx.TransportError)) or (
            isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code >= 500)


class FeedbackClient(_Base):
    """Synchronous feedback client (thread-safe).

    Args:
        base_url: serving's base URL, e.g. ``http://127.0.0.1:8000`` (HTTP mode).
        api_key: sent as ``Authorization: Bearer``.
        timeout_s: per-request timeout (s). max_retries: retries after the first try.
        backoff_s / max_backoff_s: backoff base and cap (s), full jitter.
        buffer_size: most unsent events kept locally; beyond it :class:`BufferFull`.
        kafka_bootstrap / user_salt: direct-to-Kafka mode instead of HTTP.

    Each method returns the ``event_id`` (str). An event whose retries are exhausted is
    buffered (returned id still valid); :meth:`flush` resends the buffer.
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, **kw):
        super().__init__(base_url, api_key, **kw)
        self._lock = threading.RLock()
        self._http = httpx.Client(timeout=self.timeout_s, headers=self.headers) if self.base_url else None
        self._producer = None
        atexit.register(self._atexit)

    def thumbs_up(self, completion_id, user: str | None = None, comment: str | None = None) -> str:
        """+1 on ``completion_id``."""
        return self.record(completion_id, "thumb", 1, comment=comment, user=user)

    def thumbs_down(self, completion_id, user: str | None = None, comment: str | None = None) -> str:
        """-1 on ``completion_id``."""
        return self.record(completion_id, "thumb", -1, comment=comment, user=user)

    def record(self, completion_id, kind: str, value: float, comment: str | None = None,
               user: str | None = None) -> str:
        """Send one signal of ``kind`` (thumb | edit | regenerate | copy) with ``value``.

        Raises ``ValueError`` (bad argument, nothing sent), :class:`FeedbackRejected` (4xx),
        :class:`BufferFull`.
        """
        payload = build_event(completion_id, kind, value, comment, user)
        with self._lock:
            if self.buffer:  # keep order: earlier unsent events first
                self.flush()
            if self.buffer:
                self._keep(payload)
                return payload["event_id"]
            if not self._send(payload):
                self._keep(payload)
        return payload["event_id"]

    def _send(self, payload: dict) -> bool:
        for attempt in range(self.max_retries + 1):
            try:
                if self._http is not None:
                    r = self._http.post(f"{self.base_url}/v1/feedback", json=payload)
                    if 400 <= r.status_code < 500:
                        raise FeedbackRejected(r.status_code, r.text)
                    r.raise_for_status()
                else:
                    self._kafka_send(payload)
                self.sent += 1
                return True
            except FeedbackRejected:
                raise
            except Exception as exc:  # noqa: BLE001 - classified below
                if not (self._retryable(exc) or self._http is None):
                    raise
                if attempt == self.max_retries:
                    return False
                time.sleep(self._delay(attempt))
        return False

    def _kafka_send(self, payload: dict) -> None:
        if self._producer is None:
            from kafka import KafkaProducer

            self._producer = KafkaProducer(bootstrap_servers=self.kafka_bootstrap, acks="all")
        ev = self._to_event(payload)
        self._producer.send(topics.FEEDBACK, key=str(ev.completion_id).encode(),
                            value=ev.to_bytes()).get(timeout=self.timeout_s)

    def flush(self) -> int:
        """Resend buffered events in order; returns how many were sent (stops at the first
        that still fails)."""
        n = 0
        with self._lock:
            while self.buffer:
                if not self._send(self.buffer[0]):
                    break
                self.buffer.popleft()
                n += 1
        return n

    def _atexit(self) -> None:
        try:
            if self.buffer:
                self.flush()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass

    def close(self) -> None:
        """Flush, then close the HTTP client / Kafka producer."""
        self._atexit()
        atexit.unregister(self._atexit)
        if self._http is not None:
            self._http.close()
        if self._producer is not None:
            self._producer.close()


class AsyncFeedbackClient(_Base):
    """asyncio twin of :class:`FeedbackClient` (same arguments and errors; coroutines).

    Call ``await client.aclose()`` to flush and close (no atexit hook: the loop is gone).
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, **kw):
        super().__init__(base_url, api_key, **kw)
        self._lock = asyncio.Lock()
        self._http = httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers) if self.base_url else None
        self._sync = None  # Kafka mode reuses the sync producer in a thread

    async def thumbs_up(self, completion_id, user: str | None = None, comment: str | None = None) -> str:
        return await self.record(completion_id, "thumb", 1, comment=comment, user=user)

    async def thumbs_down(self, completion_id, user: str | None = None, comment: str | None = None) -> str:
        return await self.record(completion_id, "thumb", -1, comment=comment, user=user)

    async def record(self, completion_id, kind: str, value: float, comment: str | None = None,
                     user: str | None = None) -> str:
        payload = build_event(completion_id, kind, value, comment, user)
        async with self._lock:
            if self.buffer:
                await self._flush_locked()
            if self.buffer or not await self._send(payload):
                self._keep(payload)
        return payload["event_id"]

    async def _send(self, payload: dict) -> bool:
        for attempt in range(self.max_retries + 1):
            try:
                if self._http is not None:
                    r = await self._http.post(f"{self.base_url}/v1/feedback", json=payload)
                    if 400 <= r.status_code < 500:
                        raise FeedbackRejected(r.status_code, r.text)
                    r.raise_for_status()
                else:
                    if self._sync is None:
                        self._sync = FeedbackClient(kafka_bootstrap=self.kafka_bootstrap, user_salt=self.user_salt,
                                                    timeout_s=self.timeout_s, max_retries=0)
                    await asyncio.to_thread(self._sync._kafka_send, payload)
                self.sent += 1
                return True
            except FeedbackRejected:
                raise
            except Exception as exc:  # noqa: BLE001
                if not (self._retryable(exc) or self._http is None):
                    raise
                if attempt == self.max_retries:
                    return False
                await asyncio.sleep(self._delay(attempt))
        return False

    async def _flush_locked(self) -> int:
        n = 0
        while self.buffer:
            if not await self._send(self.buffer[0]):
                break
            self.buffer.popleft()
            n += 1
        return n

    async def flush(self) -> int:
        """Resend buffered events in order; returns how many were sent."""
        async with self._lock:
            return await self._flush_locked()

    async def aclose(self) -> None:
        """Flush, then close."""
        await self.flush()
        if self._http is not None:
            await self._http.aclose()
        if self._sync is not None:
            self._sync.close()
