"""Feedback SDK: how a product reports thumbs, scores, copies, regenerations, edits and
follow-ups about a completion.

The caller's thread never waits on the network. ``thumbs_up`` / ``thumbs_down`` / ``score`` /
``copy`` / ``regenerate`` / ``edit`` / ``followup`` / ``record`` validate their arguments, put
the event on a bounded in-memory queue and return its ``event_id``; one background thread sends
the queue in batches. The only wait a caller can see is ``enqueue_timeout_s`` (default 20 ms)
when the queue is full.

Transports:

* HTTP (default): a batch of two or more events is ``POST {base_url}/v1/feedback/batch``
  with ``{"events": [...]}`` (at most 100 per request), a batch of one event is ``POST
  {base_url}/v1/feedback`` with the event as the body; the wire contract of ``docs/sdk.md``
  "HTTP API". A server without the batch route (404/405) is sent one ``POST /v1/feedback``
  per event from then on.
* Direct to Kafka (``kafka_bootstrap=...``): a ``schemas.events.FeedbackEvent`` on
  ``flywheel.feedback`` keyed by completion_id; ``user`` is hashed here with ``user_salt``.
  This mode reads the fleet's Kafka settings and salt with flywheel-loop's ``schemas``
  package, so it needs flywheel-loop installed; HTTP mode needs only this package.

What happens to an event (every case is counted in :meth:`FeedbackClient.stats` and none is
silent):

* **queued**: the call returned its ``event_id``; the event is sent in order, retried on
  timeouts, connection errors, 429, 5xx and 401/403 (credentials refused: the client's
  key is wrong or was rotated, not the event) with exponential backoff and full jitter, with
  the same ``event_id`` (the idempotency key), until it is delivered or the client shuts
  down.
* **dropped on overflow**: the queue held ``queue_size`` events for ``enqueue_timeout_s``;
  the call returns ``None`` (``on_full="drop"``, counted ``dropped_full``, logged) or raises
  :class:`QueueFull` (``on_full="raise"``). Such an event was never accepted.
* **rejected**: the server refused the event (4xx other than 401/403/429, or a batch result
  with a 4xx status): counted
  ``rejected``, logged with the reason, kept in :attr:`FeedbackClient.rejected` (last
  ``keep_rejected``) and passed to ``on_error``. Never retried.
* **unsent at shutdown**: :meth:`FeedbackClient.shutdown` tries to deliver for up to its
  timeout and *returns* what is still unsent (counted ``unsent_at_shutdown``, logged, and no
  longer ``pending``), and appends it to ``spool_path`` when one is set: the next client
  with that path sends it first. Interpreter exit runs ``shutdown(atexit_timeout_s)``.

After shutdown every accepted event is counted once: ``accepted == sent + rejected + pending
+ unsent_at_shutdown`` (``pending`` is 0 once shutdown has returned).

Bad arguments raise ``ValueError`` naming the argument, in the caller's thread, before
anything is queued (a time in seconds is a finite number, not a bool, at most
:data:`MAX_SECONDS`; a count is an int, not a bool). Every event is validated against the
FeedbackEvent JSON Schema shipped with this package (:mod:`flywheel_feedback.contract`), so
the client refuses what the consumers refuse.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import json
import logging
import math
import operator
import os
import random
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Literal

import httpx

from flywheel_feedback import contract

log = logging.getLogger("flywheel.sdk")

#: The event kinds, from the shipped schema.
KINDS = contract.kinds()
MAX_BATCH = 100  # the batch endpoint's limit (docs/sdk.md, HTTP API)
#: The longest time any seconds argument may give (1,000,000 s, 11.6 days): every wait of the
#: SDK (linger, backoff, a server's Retry-After, timeouts) stays below what the platform's
#: timers take (``threading.TIMEOUT_MAX`` is about 49.7 days on Windows; sockets overflow above
#: about 9.2e9 s on Linux), so no wait can raise OverflowError in the sender thread.
MAX_SECONDS = 1_000_000.0
# what FeedbackEvent's text fields refuse (NUL, lone surrogates): refused here, in the caller's
# thread, with the index of the character (the schema's pattern says the same without it), so
# that no such payload reaches the sender (a lone surrogate cannot even be encoded)
_UNSAFE_TEXT = re.compile("[\x00\ud800-\udfff]")
# kinds whose value the SDK fixes: value -> what it means (the shared contract, docs/sdk.md)
_FIXED = {"copy": (1,), "regenerate": (1,), "thumb": (1, -1), "followup": (1, -1)}


def _check_text(field: str, v: str) -> None:
    m = _UNSAFE_TEXT.search(v)
    if m is not None:
        what = "NUL" if m.group() == "\x00" else "a lone surrogate"
        raise ValueError(f"{field}: {what} (U+{ord(m.group()):04X}) at index {m.start()}: text must be valid "
                         f"Unicode without NUL")


class QueueFull(Exception):
    """The queue held ``queue_size`` unsent events for ``enqueue_timeout_s``; the new event
    was not accepted (raised with ``on_full="raise"``)."""


class ClientClosed(RuntimeError):
    """The client was shut down; it accepts no more events."""


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    """Types and text of ``metadata`` (its sizes are the schema's to check)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata: must be an object of string -> string, got {type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(k, str):
            raise ValueError(f"metadata: keys are strings, got {str(k)[:80]!r}")
        if not isinstance(v, str):
            raise ValueError(f"metadata: value of {k[:80]!r} must be a string, got {type(v).__name__}")
        _check_text("metadata", k)
        _check_text("metadata", v)
    return dict(metadata)


def _finite(value: Any) -> bool:
    """A finite int or float, not a bool."""
    try:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return False


def _seconds(name: str, value: Any, *, positive: bool = False) -> float:
    """``value`` as a number of seconds: finite, not a bool, >= 0 (> 0 when ``positive``), at
    most :data:`MAX_SECONDS`.

    Raises:
        ValueError: it is not; the message starts with ``name``.
    """
    if not _finite(value):
        what = "a number of seconds, not a boolean" if isinstance(value, bool) else "a finite number of seconds"
        raise ValueError(f"{name}: must be {what}, got {repr(value)[:40]}")
    if (value <= 0) if positive else (value < 0):
        raise ValueError(f"{name}: must be {'>' if positive else '>='} 0 seconds, got {value!r}")
    if value > MAX_SECONDS:
        raise ValueError(f"{name}: at most {MAX_SECONDS:,.0f} seconds (11.6 days; longer waits overflow the "
                         f"platform's timers), got {value!r}")
    return float(value)


def _count(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    """``value`` as an int in [lo, hi] (an ``int`` or anything with ``__index__``, not a bool).

    Raises:
        ValueError: it is not; the message starts with ``name``.
    """
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ValueError(f"{name}: must be an integer, not {type(value).__name__}, got {repr(value)[:40]}")
    value = operator.index(value)
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name}: must be {f'{lo}-{hi}' if hi is not None else f'>= {lo}'}, got {value}")
    return value


def build_event(completion_id: Any, kind: str, value: Any = None, comment: str | None = None,
                user: str | None = None, *, event_id: Any = None, name: str | None = None,
                metadata: dict[str, str] | None = None, final_text: str | None = None) -> dict:
    """Validate arguments and return the wire payload of one event (the body of
    ``POST /v1/feedback``; ``value`` is left out for an edit that carries ``final_text``;
    ``name``, ``metadata`` and ``final_text`` are there only when set).

    Args:
        completion_id: the completion's id (UUID or its string).
        kind: one of :data:`KINDS` (``thumb``, ``score``, ``edit``, ``regenerate``, ``copy``,
            ``followup``).
        value: finite number, not a bool, within +-1e6: +1 / -1 for a thumb and a followup
            (satisfied / not), 1 for a copy and a regenerate, the kept share in [0, 1] for an
            edit without ``final_text``; None only for an edit with ``final_text``.
        comment: at most 4096 chars. user: a string (the product's user id; an int id is
            refused, not turned into text), 1-256 chars (hashed by serving).
        event_id: the idempotency key (UUID); a fresh UUID4 when None.
        name: the score's name (required for, and only allowed with, ``kind="score"``):
            1-64 chars of ``A-Za-z0-9_.:/-``.
        metadata: at most 16 string keys (1-64 chars) -> string values (<= 512 chars).
        final_text: an edit's final text (the user's version of the reply), instead of
            ``value``; the join measures the kept share against the completion's text.

    Raises:
        ValueError: the message starts with the argument's name. Every event is also
            checked against the shipped FeedbackEvent schema (:func:`contract.check_event`).
    """
    try:
        cid = str(uuid.UUID(str(completion_id)))
    except ValueError:
        raise ValueError(f"completion_id: not a UUID: {completion_id!r}") from None
    if kind not in KINDS:
        raise ValueError(f"kind: must be one of {KINDS}, got {kind!r}")
    if final_text is not None:
        if kind != "edit":
            raise ValueError(f"final_text: only an edit carries a final text (kind is {kind!r})")
        if not isinstance(final_text, str):
            raise ValueError(f"final_text: must be a string, got {type(final_text).__name__}")
        _check_text("final_text", final_text)
        if value is not None:
            raise ValueError("final_text: an edit carries the kept share (value) or the final text, not both")
    elif value is None:
        what = "an edit needs the kept share in [0, 1] or final_text" if kind == "edit" else f"a {kind} needs a number"
        raise ValueError(f"value: {what}")
    if value is not None:
        if not _finite(value):
            what = "a number, not a boolean" if isinstance(value, bool) else "a finite number"
            raise ValueError(f"value: must be {what}, got {repr(value)[:40]}")
        if kind in _FIXED and value not in _FIXED[kind]:
            allowed = " or ".join(f"{v:+d}" if len(_FIXED[kind]) > 1 else str(v) for v in _FIXED[kind])
            raise ValueError(f"value: a {kind} is {allowed}, got {value!r}")
        if kind == "edit" and not 0 <= value <= 1:
            raise ValueError(f"value: an edit's kept share is in [0, 1], got {value!r}")
    if kind == "score" and name is None:
        raise ValueError("name: a score needs a name (what it scores, e.g. 'helpfulness')")
    if kind != "score" and name is not None:
        raise ValueError(f"name: only a score has a name (kind is {kind!r})")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"name: must be a string, got {type(name).__name__}")
    if comment is not None:
        if not isinstance(comment, str):
            raise ValueError(f"comment: must be a string, got {type(comment).__name__}")
        _check_text("comment", comment)
    if user is not None:
        if not isinstance(user, str):
            raise ValueError(f"user: must be a string (the product's user id, e.g. str(user_id)), got "
                             f"{type(user).__name__} {repr(user)[:40]}")
        if not user or len(user) > 256:
            raise ValueError(f"user: must be a non-empty string of at most 256 characters, got {len(user)} "
                             f"characters")
        _check_text("user", user)
    if event_id is None:
        eid = str(uuid.uuid4())
    else:
        try:
            eid = str(uuid.UUID(str(event_id)))
        except ValueError:
            raise ValueError(f"event_id: not a UUID: {event_id!r}") from None
    p: dict[str, Any] = {"completion_id": cid, "event_id": eid, "kind": kind}
    if value is not None:
        p["value"] = float(value)
    p["comment"], p["user"] = comment, user
    if name is not None:
        p["name"] = name
    md = _check_metadata(metadata)
    if md is not None:
        p["metadata"] = md
    if final_text is not None:
        p["final_text"] = final_text
    # the event a receiver makes of this payload (user hashed, time stamped), as the schema sees it
    ev = {k: v for k, v in p.items() if k != "user"}
    ev["user_hash"], ev["created_at"] = "0" * 32, int(time.time() * 1000)
    contract.check_event(ev)
    return p


#: Seconds between two ERROR logs about credentials the server refuses (401/403).
AUTH_LOG_INTERVAL_S = 30.0


class _Retry(Exception):
    """A transport failure worth retrying (timeout, connection, 429, 5xx, producer error)."""

    def __init__(self, reason: str, after_s: float | None = None):
        super().__init__(reason)
        self.after_s = after_s


class _Split(Exception):
    """The request was too large (413): send the batch in smaller pieces."""


class _HttpTransport:
    """Sends a batch over HTTP (the contract of docs/sdk.md, "HTTP API").

    ``send`` returns ``(resend, rejected)``: indexes of events to send again after a backoff
    (5xx / 429 results, events with no result) and ``[(index, reason)]`` of refused events;
    every other event was accepted. Raises :class:`_Retry` when nothing is known to have
    arrived, :class:`_Split` on 413."""

    def __init__(self, base_url: str, token: str | None, timeout_s: float):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        headers["User-Agent"] = "flywheel-sdk/1"
        self.http = httpx.Client(timeout=timeout_s, headers=headers)
        self.batch_route = True  # False after a 404/405 from /v1/feedback/batch
        self._auth_logged_at = -math.inf  # last ERROR about refused credentials (monotonic s)

    def send(self, batch: list[dict]) -> tuple[list[int], list[tuple[int, str]]]:
        if self.batch_route and len(batch) > 1:
            r = self._post("/v1/feedback/batch", {"events": batch})
            if r.status_code in (404, 405):
                self.batch_route = False
                log.info("feedback: %s has no batch route (HTTP %d); sending one event per request",
                         self.base_url, r.status_code)
            elif r.status_code == 200:
                return self._batch_results(r, len(batch))
            elif r.status_code == 413:
                raise _Split()
            else:
                return [], [(i, f"HTTP {r.status_code}: {r.text[:300]}") for i in range(len(batch))]
        rejected = []  # one event per request, in order; a retryable failure stops there
        for i, p in enumerate(batch):
            try:
                r = self._post("/v1/feedback", p)
            except _Retry:
                if i == 0:
                    raise
                return list(range(i, len(batch))), rejected
            if r.status_code != 200:
                rejected.append((i, f"HTTP {r.status_code}: {r.text[:300]}"))
            elif not _acknowledges(r, p):  # e.g. a web front end's HTML page: not known to be published
                if i == 0:
                    raise _Retry(_NOT_THE_API.format(url=self.base_url + "/v1/feedback", body=r.text[:120]))
                return list(range(i, len(batch))), rejected
        return [], rejected

    def _post(self, path: str, body) -> httpx.Response:
        try:
            r = self.http.post(self.base_url + path, json=body)
        except httpx.HTTPError as exc:  # timeouts, refused or reset connections
            raise _Retry(f"{type(exc).__name__}: {exc}") from None
        if r.status_code in (401, 403):  # the credentials, not the event: keep it until they work
            now = time.monotonic()
            if now - self._auth_logged_at >= AUTH_LOG_INTERVAL_S:
                self._auth_logged_at = now
                log.error("feedback: %s refused this client's credentials (HTTP %d: %s); events are "
                          "kept and retried until a valid key is used (shutdown spools them)",
                          self.base_url, r.status_code, r.text[:200])
            raise _Retry(f"HTTP {r.status_code}: credentials refused (a wrong or rotated key): {r.text[:200]}")
        if r.status_code == 429 or r.status_code >= 500:
            raise _Retry(f"HTTP {r.status_code}: {r.text[:200]}", _retry_after(r.headers.get("retry-after", "")))
        return r

    @staticmethod
    def _batch_results(r: httpx.Response, n: int) -> tuple[list[int], list[tuple[int, str]]]:
        try:
            results = r.json()["results"]
        except (ValueError, KeyError, TypeError):  # a 200 without per-event results: nothing is known published
            raise _Retry(_NOT_THE_API.format(url=str(r.request.url), body=r.text[:120])) from None
        seen, resend, rejected = set(), [], []
        if not isinstance(results, list):
            return list(range(n)), []  # not the contract's answer: nothing is known to be published
        for res in results:
            if not isinstance(res, dict):
                continue
            i, status = res.get("index"), res.get("status", 200)
            if not isinstance(i, int) or not 0 <= i < n or not isinstance(status, int):
                continue
            seen.add(i)
            if status >= 500 or status == 429:
                resend.append(i)
            elif status >= 400:
                err = res.get("error") or {}
                rejected.append((i, f"HTTP {status}: {err.get('param')}: {err.get('message')}"))
        resend += [i for i in range(n) if i not in seen]  # no result: not known to be published
        return sorted(resend), rejected

    def close(self) -> None:
        self.http.close()


_NOT_THE_API = ("HTTP 200 from {url} without the feedback API's answer (is base_url Flywheel serving's?): "
                "{body!r}; the events are kept and retried")


def _retry_after(header: str) -> float | None:
    """The seconds of a ``Retry-After`` header (``120`` or ``1.5``), at most
    :data:`MAX_SECONDS`; None when it is absent or not that form (an HTTP date, ``inf``)."""
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)?", header.strip()):
        return None
    return min(float(header), MAX_SECONDS)


def _acknowledges(r: httpx.Response, payload: dict) -> bool:
    """Whether a 200 from ``POST /v1/feedback`` is serving's answer for this event:
    ``{"event_id": <the event's>, "accepted": ..., "duplicate": ...}`` (docs/sdk.md)."""
    try:
        body = r.json()
    except ValueError:
        return False
    if not isinstance(body, dict) or "accepted" not in body:
        return False
    try:  # serving answers the event_id in its canonical form
        return uuid.UUID(str(body.get("event_id"))) == uuid.UUID(str(payload.get("event_id")))
    except ValueError:
        return False


class _KafkaTransport:
    """Sends a batch of FeedbackEvent bytes to ``flywheel.feedback`` (acks=all)."""

    def __init__(self, bootstrap: str, timeout_s: float):
        from schemas.settings import topic_names

        self.bootstrap, self.timeout_s = bootstrap, timeout_s
        self.topic = topic_names().feedback  # the fleet's prefix, resolved when the client is made
        self.producer = None

    def send(self, batch: list[dict]) -> tuple[list[int], list[tuple[int, str]]]:
        try:
            if self.producer is None:
                from kafka import KafkaProducer

                from schemas.settings import kafka_client_config

                ms = max(1, int(self.timeout_s * 1000))  # every wait of one try: bootstrap, metadata, request
                self.producer = KafkaProducer(**kafka_client_config(self.bootstrap), acks="all",
                                              request_timeout_ms=ms, max_block_ms=ms, bootstrap_timeout_ms=ms)
            futs = [self.producer.send(self.topic, key=p["completion_id"].encode(), value=p["_bytes"]) for p in batch]
            self.producer.flush(timeout=self.timeout_s)
            for f in futs:
                f.get(timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any producer error: resend (event_id dedupes)
            raise _Retry(f"{type(exc).__name__}: {exc}") from None
        return [], []

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close(timeout=self.timeout_s)


def _flywheel_schemas() -> None:
    """Check that flywheel-loop's ``schemas`` package is importable (Kafka mode needs it).

    Raises:
        ValueError: it is not; the message starts ``kafka_bootstrap:``.
    """
    try:
        import schemas.events  # noqa: F401
        import schemas.settings  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            "kafka_bootstrap: Kafka mode reads the fleet's Kafka settings (FLYWHEEL_KAFKA_*), topic prefix and "
            f"user salt with flywheel-loop's `schemas` package, which cannot be imported here ({exc}): install "
            "flywheel-loop next to this package, or send over HTTP (base_url), which needs nothing else") from None


def _fleet_salt() -> str:
    """The serving fleet's salt from ``FLYWHEEL_USER_SALT`` / ``FLYWHEEL_USER_SALT_FILE``
    (:func:`schemas.settings.user_salt`; never a generated per-home one).

    Raises:
        ValueError: neither is set, or the salt is unusable; the message starts ``user_salt:``.
    """
    from schemas.settings import SaltError, user_salt

    if not (os.environ.get("FLYWHEEL_USER_SALT") or os.environ.get("FLYWHEEL_USER_SALT_FILE")):
        raise ValueError("user_salt: required in Kafka mode (users are hashed before they leave): pass serving's "
                         "salt, or set FLYWHEEL_USER_SALT or FLYWHEEL_USER_SALT_FILE as the serving pods have it")
    try:
        return user_salt(fleet=True, why="the feedback SDK's Kafka mode")
    except SaltError as exc:
        raise ValueError(f"user_salt: {exc}") from None


def _check_key(name: str, key: Any) -> None:
    """Refuse a key that cannot be sent as ``Authorization: Bearer <key>``.

    A key is None (no ``Authorization`` header) or a non-empty str of printable ASCII
    without whitespace (U+0021-U+007E): a header value is ASCII, a control character or
    line break makes every request fail, and an empty key would silently send no header.

    Raises:
        ValueError: it is not; the message starts with ``name`` and says why.
    """
    if key is None:
        return
    if not isinstance(key, str):
        raise ValueError(f"{name}: must be a string (or None for no key), got {type(key).__name__}")
    if not key:
        raise ValueError(f"{name}: is empty; pass None to send no key")
    for i, ch in enumerate(key):
        if not "\x21" <= ch <= "\x7e":
            what = ("whitespace" if ch.isspace() else "a control character" if ord(ch) < 0x20 or ord(ch) == 0x7f
                    else "a non-ASCII character")
            raise ValueError(f"{name}: {what} (U+{ord(ch):04X}) at index {i}: a key is printable ASCII without "
                             f"whitespace (it is sent in the Authorization header)")


def _spool_file(spool_path: Any) -> Path:
    """``spool_path`` as a Path to a file (it need not exist yet).

    Raises:
        ValueError: not a str or os.PathLike, a directory, or its parent exists and is not a
            directory; the message starts ``spool_path:``.
    """
    if not isinstance(spool_path, (str, os.PathLike)):
        raise ValueError(f"spool_path: must be a file path (str or os.PathLike), got {type(spool_path).__name__}")
    try:
        path = Path(spool_path)
    except TypeError as exc:  # an os.PathLike giving bytes
        raise ValueError(f"spool_path: must be a file path, got {spool_path!r} ({exc})") from None
    if path.is_dir():
        raise ValueError(f"spool_path: {str(path)!r} is a directory; give a file in it, e.g. "
                         f"{str(path / 'feedback.spool')!r}")
    if path.parent.exists() and not path.parent.is_dir():
        raise ValueError(f"spool_path: {str(path.parent)!r} is not a directory, so {str(path)!r} cannot be a file")
    return path


class FeedbackClient:
    """Non-blocking feedback client (thread-safe; one per process is enough).

    Args:
        base_url: serving's base URL, e.g. ``http://127.0.0.1:8000`` (HTTP mode).
        api_key: an API key or a feedback-only key (``FLYWHEEL_FEEDBACK_KEYS``: it may post
            feedback and nothing else, so a browser may hold one), sent as
            ``Authorization: Bearer``. ``feedback_key`` is the same argument by its other name.
        kafka_bootstrap / user_salt: direct-to-Kafka mode instead of HTTP. ``user_salt`` must be
            the serving fleet's salt (one user, one ``user_hash``); default
            ``FLYWHEEL_USER_SALT`` or ``FLYWHEEL_USER_SALT_FILE``, as serving reads it. Needs
            flywheel-loop installed (its ``schemas`` package reads the fleet's Kafka settings).
        timeout_s: per-request timeout of the background sender (s).
        queue_size: most events waiting to be sent (an int >= 1); beyond it, ``on_full``.
        enqueue_timeout_s: the longest a call waits for room in a full queue (s).
        on_full: ``"drop"`` (the call returns None, counted and logged) or ``"raise"``
            (:class:`QueueFull`).
        batch_size: most events per request (an int, 1-100). linger_s: after the first
            event, how long the sender waits for more before it sends a partial batch (s);
            :meth:`flush` and :meth:`shutdown` cut it short.
        backoff_s / max_backoff_s: retry backoff base and cap (s), full jitter.
        atexit_timeout_s: how long interpreter exit waits for the queue to drain (s).
        keep_rejected: how many rejected events :attr:`rejected` keeps (an int >= 0; oldest
            leave first; all are counted and logged).
        on_error: called as ``on_error(payload, reason)`` in the sender thread for every
            rejected event.
        spool_path: a JSON-lines file: :meth:`shutdown` (and interpreter exit) appends the
            events it could not send, and a client started with the same path queues them
            again first (same ``event_id``). Without it unsent events are only returned and
            logged. A process killed with SIGKILL still loses its in-memory queue. A path of
            a file (existing or not) in a directory, not a directory.

    Every time in seconds (``timeout_s``, ``enqueue_timeout_s``, ``linger_s``, ``backoff_s``,
    ``max_backoff_s``, ``atexit_timeout_s``) is a finite number, not a bool, at most
    :data:`MAX_SECONDS`; ``timeout_s``, ``backoff_s`` and ``max_backoff_s`` are > 0, the rest
    >= 0.

    Raises:
        ValueError: a bad argument, named first in the message: a time that is NaN, infinite,
            negative or above :data:`MAX_SECONDS`; a count that is a bool, a float or out of
            range; a ``base_url`` that is not an http(s) URL with a host, has a port outside
            1-65535, a host with a space or '%', or a query string or fragment; an ``api_key``
            or ``feedback_key`` that is not None or a non-empty str of printable ASCII without
            whitespace; a ``spool_path`` that is a directory, in a path that is not a
            directory, or cannot be read.
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 feedback_key: str | None = None, kafka_bootstrap: str | None = None,
                 user_salt: str | None = None, timeout_s: float = 5.0, queue_size: int = 10_000,
                 enqueue_timeout_s: float = 0.02, on_full: Literal["drop", "raise"] = "drop",
                 batch_size: int = MAX_BATCH, linger_s: float = 0.01, backoff_s: float = 0.2,
                 max_backoff_s: float = 5.0, atexit_timeout_s: float = 2.0, keep_rejected: int = 1000,
                 on_error: Callable[[dict, str], None] | None = None, spool_path: str | os.PathLike | None = None):
        if base_url is None and kafka_bootstrap is None:
            raise ValueError("base_url: required unless kafka_bootstrap is given")
        if base_url is not None:
            if not isinstance(base_url, str):
                raise ValueError(f"base_url: must be a string, got {type(base_url).__name__}")
            try:
                u = httpx.URL(base_url)
            except (httpx.InvalidURL, TypeError) as exc:
                raise ValueError(f"base_url: not a URL: {base_url!r} ({exc})") from None
            if u.scheme not in ("http", "https") or not u.host:
                raise ValueError(f"base_url: must be http:// or https:// with a host, e.g. http://127.0.0.1:8000, "
                                 f"got {base_url!r}")
            if u.query or u.fragment or "?" in base_url or "#" in base_url:
                raise ValueError(f"base_url: must have no query string or fragment (the client appends "
                                 f"/v1/feedback to it), got {base_url!r}")
            if u.port is not None and not 1 <= u.port <= 65535:
                raise ValueError(f"base_url: port {u.port} is out of range (1-65535), got {base_url!r}")
            host = u.raw_host.decode("ascii", "replace")
            if ":" not in host and not re.fullmatch(r"[A-Za-z0-9._-]+", host):
                # httpx percent-encodes a space or other odd character in the host and connects
                # to nothing; an IPv6 literal (with ':') is left to httpx
                raise ValueError(f"base_url: the host {u.host!r} has a character a host name cannot have "
                                 f"(a space, '%', ...), got {base_url!r}")
        if kafka_bootstrap is not None:
            _flywheel_schemas()
        if kafka_bootstrap is not None and not user_salt:
            user_salt = _fleet_salt()
        _check_key("api_key", api_key)
        _check_key("feedback_key", feedback_key)
        if api_key is not None and feedback_key is not None:
            raise ValueError("feedback_key: give api_key or feedback_key, not both (both are the Bearer key)")
        timeout_s = _seconds("timeout_s", timeout_s, positive=True)
        backoff_s = _seconds("backoff_s", backoff_s, positive=True)
        max_backoff_s = _seconds("max_backoff_s", max_backoff_s, positive=True)
        enqueue_timeout_s = _seconds("enqueue_timeout_s", enqueue_timeout_s)
        linger_s = _seconds("linger_s", linger_s)
        atexit_timeout_s = _seconds("atexit_timeout_s", atexit_timeout_s)
        queue_size = _count("queue_size", queue_size, 1)
        batch_size = _count("batch_size", batch_size, 1, MAX_BATCH)
        keep_rejected = _count("keep_rejected", keep_rejected, 0)
        if on_full not in ("drop", "raise"):
            raise ValueError(f"on_full: 'drop' or 'raise', got {on_full!r}")
        spool = _spool_file(spool_path) if spool_path is not None else None
        self.base_url = base_url.rstrip("/") if base_url else None
        self.kafka_bootstrap, self.user_salt = kafka_bootstrap, user_salt
        self.queue_size, self.enqueue_timeout_s, self.on_full = queue_size, enqueue_timeout_s, on_full
        self.batch_size, self.linger_s = batch_size, linger_s
        self.backoff_s, self.max_backoff_s, self.atexit_timeout_s = backoff_s, max_backoff_s, atexit_timeout_s
        self.on_error = on_error
        self.rejected: collections.deque[tuple[dict, str]] = collections.deque(maxlen=keep_rejected)
        self._transport = (_HttpTransport(self.base_url, api_key or feedback_key, timeout_s) if self.base_url
                           else _KafkaTransport(kafka_bootstrap, timeout_s))
        self._queue: collections.deque[dict] = collections.deque()
        self._inflight: list[dict] = []
        self._cond = threading.Condition()
        self._wake = threading.Event()  # cuts a backoff sleep short (flush, shutdown)
        self._closed = False  # no new events
        self._stop_at: float | None = None  # monotonic deadline for the sender
        # events taken from the queue so far, and the ``accepted`` count at the last flush():
        # the queue is in accepted order, so while taken < flush_upto an event queued before a
        # flush is still waiting and the sender does not linger
        self._taken = self._flush_upto = 0
        self._unsent: list[dict] | None = None  # what shutdown handed back (None before it did)
        self._counts = collections.Counter()
        self._last_drop_log = 0.0
        self.spool_path = spool
        if self.spool_path is not None:
            try:
                self._load_spool()
            except BaseException:
                self._transport.close()
                raise
        self._thread = threading.Thread(target=self._run, name="flywheel-feedback-sender", daemon=True)
        self._thread.start()
        atexit.register(self._atexit)

    def _load_spool(self) -> None:
        """Queue the events a previous client spooled at shutdown (before any new one), then
        remove the file; they are counted ``accepted`` and ``respooled``.

        Raises:
            ValueError: the file exists and cannot be read; the message starts ``spool_path:``.
                A line that is not UTF-8 or not an event is moved to ``<spool_path>.corrupt``
                (its bytes as they were), not raised.
        """
        try:
            raw_lines = self.spool_path.read_bytes().splitlines()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ValueError(f"spool_path: cannot read {str(self.spool_path)!r}: {exc}") from None
        bad: list[tuple[bytes, str]] = []
        for raw in raw_lines:
            if not raw.strip():
                continue
            try:  # a line cut short (a crash while spooling) or edited by hand must not stop the client
                line = raw.decode("utf-8")  # UnicodeDecodeError is a ValueError: the line is corrupt
                p = json.loads(line)
                p = build_event(p["completion_id"], p["kind"], p.get("value"), p.get("comment"), p.get("user"),
                                event_id=p["event_id"], name=p.get("name"), metadata=p.get("metadata"),
                                final_text=p.get("final_text"))
                if self.kafka_bootstrap is not None:
                    p["_bytes"] = self._to_event(p).to_bytes()
            except (ValueError, KeyError, TypeError) as exc:
                bad.append((raw, f"{type(exc).__name__}: {exc}"))
                continue
            self._queue.append(p)
        if bad:
            corrupt = self.spool_path.with_name(self.spool_path.name + ".corrupt")
            with open(corrupt, "ab") as f:  # the bytes as they were, undecodable ones included
                f.writelines(raw + b"\n" for raw, _ in bad)
            log.error("feedback: %d lines of the spool %s are not events (first: %s); kept in %s, not sent",
                      len(bad), self.spool_path, bad[0][1], corrupt)
        self._counts["accepted"] += len(self._queue)
        self._counts["respooled"] += len(self._queue)
        self.spool_path.unlink()
        log.info("feedback: %d events from the spool %s queued again", len(self._queue), self.spool_path)

    # ------------------------------------------------------------------ caller side
    def thumbs_up(self, completion_id, user: str | None = None, comment: str | None = None, *,
                  event_id=None, metadata: dict[str, str] | None = None) -> str | None:
        """+1 on ``completion_id``; returns the event_id (None if dropped on overflow)."""
        return self.record(completion_id, "thumb", 1, comment=comment, user=user, event_id=event_id,
                           metadata=metadata)

    def thumbs_down(self, completion_id, user: str | None = None, comment: str | None = None, *,
                    event_id=None, metadata: dict[str, str] | None = None) -> str | None:
        """-1 on ``completion_id``; returns the event_id (None if dropped on overflow)."""
        return self.record(completion_id, "thumb", -1, comment=comment, user=user, event_id=event_id,
                           metadata=metadata)

    def score(self, completion_id, name: str, value: float, comment: str | None = None,
              user: str | None = None, *, event_id=None, metadata: dict[str, str] | None = None) -> str | None:
        """A named numeric score (kind ``score``), e.g. ``score(cid, "helpfulness", 0.8)``: the
        reward policy's ``scores`` component of that name."""
        return self.record(completion_id, "score", value, comment=comment, user=user, event_id=event_id,
                           name=name, metadata=metadata)

    def copy(self, completion_id, user: str | None = None, comment: str | None = None, *,
             event_id=None, metadata: dict[str, str] | None = None) -> str | None:
        """The user copied the reply (kind ``copy``, value 1): call it from the copy button's
        handler. Returns the event_id (None if dropped on overflow)."""
        return self.record(completion_id, "copy", 1, comment=comment, user=user, event_id=event_id,
                           metadata=metadata)

    def regenerate(self, completion_id, user: str | None = None, comment: str | None = None, *,
                   event_id=None, metadata: dict[str, str] | None = None) -> str | None:
        """The user asked for another answer instead of ``completion_id`` (kind ``regenerate``,
        value 1; a negative signal for that completion). Returns the event_id (None if dropped)."""
        return self.record(completion_id, "regenerate", 1, comment=comment, user=user, event_id=event_id,
                           metadata=metadata)

    def edit(self, completion_id, kept: float | None = None, final_text: str | None = None,
             user: str | None = None, comment: str | None = None, *, event_id=None,
             metadata: dict[str, str] | None = None) -> str | None:
        """The user edited the reply before using it (kind ``edit``). Give exactly one of:

        Args:
            kept: the share of the reply the user kept, a number in [0, 1] (1: used as is),
                measured by the product; sent as ``value``.
            final_text: the user's final text (a string of at most 65,536 characters, no NUL
                or lone surrogate); the join computes the kept share against the completion's
                text. Send it once the text has survived the product's horizon (e.g. the
                document was saved, or N minutes passed without another edit).

        Returns the event_id (None if dropped on overflow).

        Raises:
            ValueError: both or neither given, ``kept`` not a number in [0, 1], or
                ``final_text`` not a string (the message starts with ``kept:`` or ``final_text:``).
        """
        if (kept is None) == (final_text is None):
            raise ValueError("kept: give exactly one of kept (the share of the reply kept, in [0, 1]) and "
                             f"final_text (the user's final text), got {'both' if kept is not None else 'neither'}")
        if kept is not None and (not _finite(kept) or not 0 <= kept <= 1):
            raise ValueError(f"kept: the share of the reply the user kept, a number in [0, 1], got {repr(kept)[:40]}")
        if final_text is not None and not isinstance(final_text, str):
            raise ValueError(f"final_text: must be a string, got {type(final_text).__name__}")
        return self.record(completion_id, "edit", kept, comment=comment, user=user, event_id=event_id,
                           metadata=metadata, final_text=final_text)

    def followup(self, completion_id, satisfied: bool, user: str | None = None, comment: str | None = None,
                 *, event_id=None, metadata: dict[str, str] | None = None) -> str | None:
        """What the user's next message said about ``completion_id`` (kind ``followup``): +1
        when ``satisfied`` ("thanks, that worked"), -1 when not ("that's wrong"). Returns the
        event_id (None if dropped on overflow).

        Raises:
            ValueError: ``satisfied`` is not a bool (the message starts with ``satisfied:``).
        """
        if not isinstance(satisfied, bool):
            raise ValueError(f"satisfied: must be True or False, got {satisfied!r}")
        return self.record(completion_id, "followup", 1 if satisfied else -1, comment=comment, user=user,
                           event_id=event_id, metadata=metadata)

    def record(self, completion_id, kind: str, value: float | None = None, comment: str | None = None,
               user: str | None = None, *, event_id=None, name: str | None = None,
               metadata: dict[str, str] | None = None, final_text: str | None = None) -> str | None:
        """Queue one signal (see :func:`build_event` for the arguments); returns its
        ``event_id``, or None when the queue stayed full for ``enqueue_timeout_s`` and
        ``on_full="drop"``.

        Raises:
            ValueError: a bad argument (nothing queued). QueueFull: ``on_full="raise"``.
            ClientClosed: after :meth:`shutdown`.
        """
        payload = build_event(completion_id, kind, value, comment, user, event_id=event_id, name=name,
                              metadata=metadata, final_text=final_text)
        if self.kafka_bootstrap is not None:
            payload["_bytes"] = self._to_event(payload).to_bytes()
        with self._cond:
            if self._closed:
                raise ClientClosed("feedback client is shut down; it accepts no more events")
            if len(self._queue) >= self.queue_size and not self._cond.wait_for(
                    lambda: len(self._queue) < self.queue_size or self._closed, self.enqueue_timeout_s):
                return self._overflow(payload)
            if self._closed:
                raise ClientClosed("feedback client is shut down; it accepts no more events")
            self._queue.append(payload)
            self._counts["accepted"] += 1
            self._cond.notify_all()
        return payload["event_id"]

    def _overflow(self, payload: dict) -> None:
        self._counts["dropped_full"] += 1
        now = time.monotonic()
        if now - self._last_drop_log > 10:  # one line per 10 s, with the running total
            self._last_drop_log = now
            log.warning("feedback queue full (%d events waiting, last error: %s): event %s not accepted; "
                        "%d dropped so far", self.queue_size, self._counts.get("last_error", "none"),
                        payload["event_id"], self._counts["dropped_full"])
        if self.on_full == "raise":
            raise QueueFull(f"feedback queue full ({self.queue_size} unsent events); "
                            f"event {payload['event_id']} not accepted")
        return None

    def _to_event(self, p: dict):
        """The ``schemas.events.FeedbackEvent`` of payload ``p`` (Kafka mode: user hashed here).

        Raises:
            ValueError: the model refuses it; the message starts with the field.
        """
        from pydantic import ValidationError

        from schemas.events import FeedbackEvent, hash_user, now_ms

        extra = {k: p[k] for k in ("value", "name", "metadata", "final_text") if k in p}
        try:
            return FeedbackEvent(event_id=p["event_id"], completion_id=p["completion_id"],
                                 user_hash=hash_user(p["user"] or "anonymous", self.user_salt), kind=p["kind"],
                                 comment=p["comment"], created_at=now_ms(), **extra)
        except ValidationError as exc:  # name the field, as build_event does
            e = exc.errors()[0]
            field = ".".join(str(x) for x in e["loc"]) or "event"
            raise ValueError(f"{field}: {e['msg']} (FeedbackEvent)") from None

    def stats(self) -> dict[str, int]:
        """Counters: ``accepted`` (queued), ``sent``, ``rejected``, ``dropped_full``,
        ``retries``, ``unsent_at_shutdown`` (handed back by :meth:`shutdown`; of which
        ``spooled`` went to ``spool_path``), ``respooled`` (queued from the spool at start), and
        ``pending`` (queued + in flight now; 0 once shutdown has handed the rest back). Each
        accepted event is in one of them: ``accepted == sent + rejected + pending +
        unsent_at_shutdown``."""
        with self._cond:
            out = {k: int(self._counts.get(k, 0)) for k in
                   ("accepted", "sent", "rejected", "dropped_full", "retries", "unsent_at_shutdown", "spooled",
                    "respooled")}
            out["pending"] = len(self._queue) + len(self._inflight)
        return out

    @property
    def last_error(self) -> str | None:
        """The last transport error the sender saw (None before any)."""
        return self._counts.get("last_error")

    def flush(self, timeout_s: float = 10.0) -> int:
        """Send what is queued now and wait until every event queued before this call is sent
        or rejected, at most ``timeout_s`` seconds. A sender lingering for a fuller batch
        (``linger_s``) sends at once, and one sleeping between retries tries again at once.

        Returns:
            The number of events not delivered: still pending, or handed back by
            :meth:`shutdown` (0: all delivered).

        Raises:
            ValueError: ``timeout_s`` is not a finite number of seconds in [0,
                :data:`MAX_SECONDS`] (the message starts ``timeout_s:``).
        """
        timeout_s = _seconds("timeout_s", timeout_s)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._flush_upto = self._counts["accepted"]
            self._cond.notify_all()  # ends a linger (_take), even when timeout_s is 0
            self._wake.set()  # ends a backoff sleep (_deliver)
            while (self._counts["sent"] + self._counts["rejected"] < target and self._unsent is None
                   and time.monotonic() < deadline and self._thread.is_alive()):
                self._cond.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            return len(self._queue) + len(self._inflight) + len(self._unsent or ())

    def shutdown(self, timeout_s: float = 5.0) -> list[dict]:
        """Stop accepting events, deliver what is queued for at most ``timeout_s`` seconds,
        stop the sender.

        Returns:
            The payloads still unsent (in order; empty when all went). They are handed back:
            counted ``unsent_at_shutdown`` (and no longer ``pending``), logged, and appended
            to ``spool_path`` when set. A sender still inside a request when the time is up
            counts nothing more. A later call returns the same list (idempotent).

        Raises:
            ValueError: ``timeout_s`` is not a finite number of seconds in [0,
                :data:`MAX_SECONDS`] (the message starts ``timeout_s:``).
        """
        timeout_s = _seconds("timeout_s", timeout_s)
        atexit.unregister(self._atexit)
        with self._cond:
            if self._stop_at is None:
                self._closed = True
                self._stop_at = time.monotonic() + timeout_s
                self._cond.notify_all()
        self._wake.set()
        self._thread.join(max(0.0, self._stop_at - time.monotonic()) + 0.05)
        with self._cond:
            if self._unsent is None:  # the first call to get here hands back what is left
                self._unsent = [{k: v for k, v in p.items() if k != "_bytes"}
                                for p in self._inflight + list(self._queue)]
                self._inflight, self._queue = [], collections.deque()
                self._counts["unsent_at_shutdown"] = len(self._unsent)
                self._cond.notify_all()
                if self._unsent:
                    log.warning("feedback client shut down with %d unsent events (last error: %s): %s",
                                len(self._unsent), self.last_error,
                                ", ".join(p["event_id"] for p in self._unsent[:20]))
                    if self.spool_path is not None:
                        self._spool(self._unsent)
            return [dict(p) for p in self._unsent]

    close = shutdown

    def _spool(self, unsent: list[dict]) -> None:
        """Append ``unsent`` to the spool file (JSON lines), for the next client. A file
        system error is logged (the events are still returned by :meth:`shutdown`), not raised."""
        try:
            self.spool_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.spool_path, "a") as f:
                f.writelines(json.dumps(p) + "\n" for p in unsent)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            log.error("feedback: could not spool %d unsent events to %s (%s); they are only returned by "
                      "shutdown()", len(unsent), self.spool_path, exc)
            return
        self._counts["spooled"] = len(unsent)
        log.warning("feedback: %d unsent events spooled to %s; a client with this spool_path sends them",
                    len(unsent), self.spool_path)

    def __enter__(self) -> "FeedbackClient":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _atexit(self) -> None:
        try:
            unsent = self.shutdown(self.atexit_timeout_s)
            if unsent:
                log.error("feedback: %d events unsent at interpreter exit: %s", len(unsent),
                          [p["event_id"] for p in unsent])
        except Exception:  # noqa: BLE001 - exit must go on
            log.exception("feedback: shutdown at exit failed")

    # ------------------------------------------------------------------ sender thread
    def _stopping(self) -> bool:
        return self._stop_at is not None and time.monotonic() >= self._stop_at

    def _take(self) -> bool:
        """Move the next batch into ``_inflight``; False when closed and nothing is left."""
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closed)
            if not self._queue:
                return False
            if len(self._queue) < self.batch_size and self.linger_s > 0:  # linger, unless flush/shutdown says go
                self._cond.wait_for(lambda: len(self._queue) >= self.batch_size or self._closed
                                    or self._taken < self._flush_upto, self.linger_s)
            n = min(self.batch_size, len(self._queue))
            self._inflight = [self._queue.popleft() for _ in range(n)]
            self._taken += n
            self._cond.notify_all()  # room in the queue
            return True

    def _run(self) -> None:
        try:
            while not self._stopping() and self._take():
                self._deliver()
        finally:
            try:
                self._transport.close()
            except Exception:  # noqa: BLE001 - the sender is ending anyway
                log.exception("feedback: closing the transport failed")

    def _deliver(self) -> None:
        """Send ``_inflight`` until every event in it is sent or rejected, or the stop
        deadline passes (then the rest stays in ``_inflight`` for :meth:`shutdown`), or
        shutdown has handed the events back."""
        attempt, part = 0, len(self._inflight)
        while self._inflight:
            chunk = self._inflight[:part]
            after = None
            try:
                resend, rejected = self._transport.send(chunk)
            except _Split:
                part = max(1, len(chunk) // 2)
                continue
            except Exception as exc:  # noqa: BLE001 - _Retry, or anything else: the sender must live on
                if not isinstance(exc, _Retry):
                    log.exception("feedback: sending %d events failed unexpectedly; retrying", len(chunk))
                    exc = _Retry(f"{type(exc).__name__}: {exc}")
                resend, rejected, after = list(range(len(chunk))), [], exc.after_s
                with self._cond:
                    self._counts["last_error"] = str(exc)
            if not self._settle(chunk, set(resend), rejected):
                return  # shutdown handed these events back: they are not this thread's any more
            part = len(self._inflight)
            if not resend:
                attempt = 0
                if self._stopping():
                    return
                continue
            with self._cond:
                self._counts["retries"] += 1
            if self._stopping():
                return
            delay = after if after is not None else random.uniform(0, self.backoff_ceiling_s(attempt))
            attempt += 1
            if self._stop_at is not None:
                delay = min(delay, max(0.0, self._stop_at - time.monotonic()))
            delay = min(delay, MAX_SECONDS)
            self._wake.wait(delay)
            self._wake.clear()

    def backoff_ceiling_s(self, attempt: int) -> float:
        """The ceiling of the full-jitter backoff after ``attempt`` failed sends in a row:
        ``min(max_backoff_s, backoff_s * 2**attempt)`` seconds (the wait is uniform in [0,
        ceiling]; AWS Architecture Blog, "Exponential Backoff And Jitter"). The exponent stops
        at 64, so an outage of any length (thousands of attempts) never overflows a float."""
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** min(attempt, 64))

    def _settle(self, chunk: list[dict], resend: set[int], rejected: list[tuple[int, str]]) -> bool:
        """Report the rejected events of ``chunk`` (the head of ``_inflight``), then count the
        answer and keep the events to resend; False (nothing counted) when shutdown has already
        handed them back (a shutdown whose time ends while ``on_error`` runs hands back the
        whole chunk, rejected events included: each is counted once, as unsent)."""
        with self._cond:
            if self._unsent is not None:
                return False
        rej = dict(rejected)
        keep = [p for i, p in enumerate(chunk) if i in resend]
        for i, reason in rejected:
            p = {k: v for k, v in chunk[i].items() if k != "_bytes"}
            self.rejected.append((p, reason))
            log.error("feedback event %s rejected, not retried: %s", p["event_id"], reason)
            if self.on_error is not None:
                try:
                    self.on_error(p, reason)
                except Exception:  # noqa: BLE001 - the caller's callback must not stop the sender
                    log.exception("feedback on_error callback failed")
        with self._cond:
            if self._unsent is not None:
                return False
            self._counts["sent"] += len(chunk) - len(keep) - len(rej)
            self._counts["rejected"] += len(rej)
            self._inflight = keep + self._inflight[len(chunk):]
            self._cond.notify_all()
        return True


class AsyncFeedbackClient:
    """asyncio face of :class:`FeedbackClient` (same arguments; the sender is the same
    background thread, so no coroutine ever waits on the network).

    ``thumbs_up`` / ``thumbs_down`` / ``score`` / ``copy`` / ``regenerate`` / ``edit`` /
    ``followup`` / ``record`` are coroutines that return at once
    (at most ``enqueue_timeout_s`` on a full queue, waited in a worker thread); ``await
    flush()`` and ``await aclose()`` wait in a worker thread. Call ``await aclose()`` before
    the loop ends.
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, **kw):
        self._c = FeedbackClient(base_url, api_key, **kw)

    @property
    def rejected(self):
        return self._c.rejected

    def stats(self) -> dict[str, int]:
        return self._c.stats()

    async def _call(self, fn, *a, **kw):
        if self._c.stats()["pending"] < self._c.queue_size or self._c.enqueue_timeout_s == 0:
            return fn(*a, **kw)  # room (or no wait allowed): nothing to wait for
        return await asyncio.to_thread(fn, *a, **kw)

    async def thumbs_up(self, completion_id, user: str | None = None, comment: str | None = None, **kw):
        return await self._call(self._c.thumbs_up, completion_id, user, comment, **kw)

    async def thumbs_down(self, completion_id, user: str | None = None, comment: str | None = None, **kw):
        return await self._call(self._c.thumbs_down, completion_id, user, comment, **kw)

    async def score(self, completion_id, name: str, value: float, comment: str | None = None,
                    user: str | None = None, **kw):
        return await self._call(self._c.score, completion_id, name, value, comment, user, **kw)

    async def copy(self, completion_id, user: str | None = None, comment: str | None = None, **kw):
        """See :meth:`FeedbackClient.copy`."""
        return await self._call(self._c.copy, completion_id, user, comment, **kw)

    async def regenerate(self, completion_id, user: str | None = None, comment: str | None = None, **kw):
        """See :meth:`FeedbackClient.regenerate`."""
        return await self._call(self._c.regenerate, completion_id, user, comment, **kw)

    async def edit(self, completion_id, kept: float | None = None, final_text: str | None = None,
                   user: str | None = None, comment: str | None = None, **kw):
        """See :meth:`FeedbackClient.edit`."""
        return await self._call(self._c.edit, completion_id, kept, final_text, user, comment, **kw)

    async def followup(self, completion_id, satisfied: bool, user: str | None = None, comment: str | None = None,
                       **kw):
        """See :meth:`FeedbackClient.followup`."""
        return await self._call(self._c.followup, completion_id, satisfied, user, comment, **kw)

    async def record(self, completion_id, kind: str, value: float | None = None, comment: str | None = None,
                     user: str | None = None, **kw):
        return await self._call(self._c.record, completion_id, kind, value, comment, user, **kw)

    async def flush(self, timeout_s: float = 10.0) -> int:
        """See :meth:`FeedbackClient.flush`."""
        return await asyncio.to_thread(self._c.flush, timeout_s)

    async def aclose(self, timeout_s: float = 5.0) -> list[dict]:
        """See :meth:`FeedbackClient.shutdown`."""
        return await asyncio.to_thread(self._c.shutdown, timeout_s)


__all__ = ["AsyncFeedbackClient", "ClientClosed", "FeedbackClient", "QueueFull",
           "build_event", "KINDS", "MAX_BATCH", "MAX_SECONDS"]
