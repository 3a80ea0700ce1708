"""Event log: serving's path to Kafka that never blocks a request and never drops an event.

``emit()`` puts the event on a bounded in-memory queue and returns at once. A background
thread drains the queue into a kafka-python ``KafkaProducer`` (acks=all, key=completion_id).
When Kafka is unreachable, or when the queue is full, events spill to an append-only local
journal (one JSON line per event, fsync'd). Once the journal holds anything, every later
event goes through it too, so order is kept; the thread replays the journal in order when
Kafka answers again, and also after a pod restart (the journal is read at start).

Delivery is exactly once while the pod lives and the broker answers or refuses cleanly;
at-least-once across a pod crash between a send and the journal cursor update, or when a
broker persisted a batch but its ack was lost (then the journaled copy is sent again). Order: events are sent in emission order, except that a batch in
flight when Kafka fails (<= ``batch_max`` events) may land behind events spilled meanwhile. This module knows nothing about the events' contents.

Durable emits: ``emit(..., durable=True)`` returns a future that resolves once the event is
acked by Kafka or fsync'd in the journal, so a caller (the feedback API) answers only for
events that survive a SIGKILL of the pod.

A broker that lost acked data (the memory-only embedded broker after a restart, a topic
deleted and re-created): the log keeps the events Kafka acked in the last
``resend_window_s`` in memory, and, with ``consumer_group`` (serving: ingest's group), older
ones until that group has committed past them on the broker that acked them (read every
``consumed_check_s`` by a second thread; a reading counts only if the cluster id was the same
before and after it), all within ``resend_max_bytes``. When an ack shows that the
broker is another incarnation than the one that acked them (its cluster id changed, or a
partition's offset went back to or below one acked before: offsets of a durable log only
grow) those events are journaled again and re-sent (counted ``resent``). Consumers dedupe
by key (ingest: completion_id and event_id), so a copy of an event that was consumed before
the loss folds nothing. Not covered: a pod that dies while its broker lost the data (the
window is in memory; two faults at once).
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("flywheel.serving.eventlog")

_STOP = object()
_REJECTED = "rejected"


@dataclass
class EventLogCounters:
    """Event counts since start (events, not bytes)."""

    queued: int = 0  # accepted into the in-memory queue
    sent: int = 0  # acked by Kafka straight from the queue
    spilled: int = 0  # written to the local journal
    replayed: int = 0  # journal entries acked by Kafka
    failed: int = 0  # could not be journaled either (disk error): lost, and counted
    resent: int = 0  # acked events journaled again because the broker lost them
    broker_losses: int = 0  # times an ack showed a broker that lost acked events
    resend_unprotected: int = 0  # acked events dropped from the re-send store unconsumed (byte bound)


class EventLog:
    """Bounded queue -> Kafka producer, with a local journal for outages.

    Args:
        bootstrap: ``host:port[,...]`` of the Kafka cluster, or None to journal only
            (events wait in the journal until an EventLog with a bootstrap replays them).
        journal_path: the append-only journal file; its cursor lives next to it
            (``<journal>.offset``, byte offset of the first entry not yet acked).
        max_queue: in-memory queue bound (events); beyond it ``emit`` spills to the journal.
        batch_max: events sent per producer flush.
        send_timeout_s: how long one flush may wait for acks before Kafka counts as down (s).
        retry_interval_s: how often to probe Kafka while it is down (s).
        max_request_bytes: producer request size limit (bytes). An event Kafka refuses for
            good (too large, invalid topic: a non-retriable error) is not retried forever,
            which would stall every later event: it is kept out of band in
            ``<journal>.rejected`` (same JSON-line format) and counted as ``failed``.
        resend_window_s: acked events are kept at least this long (s) to be re-sent if the
            broker turns out to have lost them (0 = off; module docstring).
        resend_max_bytes: at most this many bytes of acked events are kept for that; beyond
            it the oldest go first, counted ``resend_unprotected`` if not known consumed.
        consumer_group: the consumer group that reads these events (serving: ingest's,
            ``schemas.topics.TopicNames.ingest_group``). With it, an acked event older than
            ``resend_window_s`` is kept until that group has committed past it, as read from
            the broker that acked it (so a broker restart after a long ingest outage still
            finds it); without it, the window alone.
        consumed_check_s: how often the group's committed offsets are read (s).
    """

    def __init__(self, bootstrap: str | None, journal_path: str | Path, max_queue: int = 10_000,
                 batch_max: int = 500, send_timeout_s: float = 5.0, retry_interval_s: float = 1.0,
                 client_id: str = "flywheel-serving", max_request_bytes: int = 16 * 1024 * 1024,
                 resend_window_s: float = 300.0, resend_max_bytes: int = 64 * 1024 * 1024,
                 consumer_group: str | None = None, consumed_check_s: float = 5.0):
        self.bootstrap = bootstrap
        self.journal_path = Path(journal_path)
        self.journal_path.parent.mkdir(parents=True, exist_ok=True)
        self.cursor_path = self.journal_path.with_name(self.journal_path.name + ".offset")
        self.batch_max = batch_max
        self.send_timeout_s = send_timeout_s
        self.retry_interval_s = retry_interval_s
        self.client_id = client_id
        self.max_request_bytes = max_request_bytes
        self.rejected_path = self.journal_path.with_name(self.journal_path.name + ".rejected")
        self.counters = EventLogCounters()
        self._q: queue.Queue = queue.Queue(maxsize=max_queue)
        self._jlock = threading.Lock()  # journal file + cursor
        self._clock = threading.Lock()  # counters
        self._jfile = open(self.journal_path, "ab")
        self._producer = None
        self._kafka_up = False
        self._inflight = 0  # events taken from the queue and not yet settled
        self.resend_window_s = resend_window_s
        self.resend_max_bytes = resend_max_bytes
        self.consumer_group = consumer_group
        self.consumed_check_s = consumed_check_s
        # (acked_at, bytes, item, (topic, partition), offset), oldest ack first
        self._acked: collections.deque = collections.deque()
        self._acked_bytes = 0
        # the group's committed offsets as read from the broker with this cluster id:
        # (cluster_id, {(topic, partition): next offset to read}); set by the committed-offsets thread
        self._group_seen: tuple[str, dict] | None = None
        self._committed: dict[tuple[str, int], int] = {}  # the last of those for the acking broker
        self._next_window_scan = 0.0
        self._high: dict[tuple[str, int], int] = {}  # (topic, partition) -> highest acked offset
        self._cluster_id: str | None = None  # of the broker that acked what _acked holds
        self._lost_ids: set[str] = set()  # cluster ids of brokers that lost acked events
        self._waiters: dict[int, tuple[tuple, Future]] = {}  # id(item) -> (item, durable future)
        self._wlock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="flywheel-eventlog", daemon=True)
        self._thread.start()
        if consumer_group and bootstrap and resend_window_s > 0:
            threading.Thread(target=self._watch_group, name="flywheel-eventlog-group", daemon=True).start()

    # ---------------------------------------------------------------- request path
    def emit(self, topic: str, key: str, value: bytes, durable: bool = False) -> Future | None:
        """Log one event; never blocks on Kafka. ``value`` is the encoded event (bytes).

        Returns:
            With ``durable``, a future resolving to True once the event is acked by Kafka
            or fsync'd in the journal (it raises ``OSError`` when the journal write failed,
            ``RuntimeError`` when Kafka refused it for good or the log closed first);
            otherwise None.

        Raises:
            RuntimeError: the log is closed.
        """
        if self._closed:
            raise RuntimeError("event log is closed")
        item = (topic, key, value)
        fut = None
        if durable:
            fut = Future()
            with self._wlock:
                self._waiters[id(item)] = (item, fut)
        try:
            self._q.put_nowait(item)
            self._count("queued")
        except queue.Full:
            # Move what still waits in memory to the journal first, so the journal keeps
            # emission order (only a batch already in flight can end up behind these).
            items = []
            while True:
                try:
                    it = self._q.get_nowait()
                except queue.Empty:
                    break
                if it is _STOP:
                    self._q.put_nowait(it)
                    break
                items.append(it)
            self._spill(items + [item])
        return fut

    # ---------------------------------------------------------------- state
    @property
    def kafka_up(self) -> bool:
        """Whether the last send or probe reached Kafka."""
        return self._kafka_up

    def journal_pending(self) -> int:
        """Bytes of journal not yet acked by Kafka."""
        with self._jlock:
            return self._journal_size() - self._read_cursor()

    def queue_depth(self) -> int:
        """Events waiting in the in-memory queue."""
        return self._q.qsize()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until the queue and the journal are drained to Kafka.

        Returns:
            True when everything emitted so far was acked, False on timeout (s).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._q.empty() and self._inflight == 0 and self.journal_pending() == 0:
                return True
            time.sleep(0.02)
        return False

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush for up to ``timeout_s``, then stop; what is left stays in the journal.
        Without a broker (``bootstrap`` None) it waits only until the queue is journaled."""
        if self._closed:
            return
        if self.bootstrap is None:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and not (self._q.empty() and self._inflight == 0):
                time.sleep(0.02)
        else:
            self.flush(timeout_s)
        self._closed = True
        self._q.put(_STOP)
        self._thread.join(timeout=timeout_s + 5)
        with self._wlock:
            left, self._waiters = list(self._waiters.values()), {}
        for _, fut in left:
            fut.set_exception(RuntimeError("event log closed before the event was durable"))
        with self._jlock:
            self._jfile.close()
        if self._producer is not None:
            try:
                self._producer.close(timeout=1)
            except Exception:  # noqa: BLE001 - closing a dead producer
                pass

    # ---------------------------------------------------------------- internals
    def _count(self, name: str, n: int = 1) -> None:
        with self._clock:
            setattr(self.counters, name, getattr(self.counters, name) + n)

    def _journal_size(self) -> int:
        try:
            return self.journal_path.stat().st_size
        except FileNotFoundError:
            return 0

    def _read_cursor(self) -> int:
        try:
            return int(self.cursor_path.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def _write_cursor(self, off: int) -> None:
        tmp = self.cursor_path.with_name(self.cursor_path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(off))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.cursor_path)

    def _settle(self, items, error: BaseException | None = None) -> None:
        """Resolve the durable futures of ``items`` (True, or ``error``)."""
        if not self._waiters:
            return
        with self._wlock:
            found = [self._waiters.pop(id(it)) for it in items if id(it) in self._waiters]
        for _, fut in found:
            if not fut.set_running_or_notify_cancel():
                continue  # its waiter gave up (cancelled): nothing to tell, and the log goes on
            if error is None:
                fut.set_result(True)
            else:
                fut.set_exception(error)

    def _spill(self, items: list[tuple[str, str, bytes]], count: bool = True) -> None:
        lines = _encode_lines(items)
        with self._jlock:
            size0 = self._journal_size()
            try:
                self._jfile.write(lines)
                self._jfile.flush()
                os.fsync(self._jfile.fileno())
                exc = None
            except OSError as e:
                exc = e
                self._discard_partial_write(size0)
        if exc is None:
            if count:
                self._count("spilled", len(items))
            self._settle(items)
        else:
            log.error("event journal write failed, %d events lost: %s", len(items), exc)
            self._count("failed", len(items))
            self._settle(items, exc)

    def _discard_partial_write(self, size0: int) -> None:
        """After a failed journal write (disk full): drop what is still buffered and any
        partial line on disk, so a later write starts on a line boundary. Holds _jlock."""
        try:
            self._jfile.close()  # flushing the buffer fails again; the file is closed anyway
        except OSError:
            pass
        try:
            os.truncate(self.journal_path, size0)
        except OSError:
            pass
        self._jfile = open(self.journal_path, "ab")

    def _retain(self, p, acked: list[tuple[tuple, object]]) -> None:
        """Keep ``acked`` ((item, RecordMetadata) pairs) for re-sending; first, if these acks
        show a broker that lost what it acked before, journal the kept events again."""
        cluster_id = getattr(getattr(p, "_metadata", None), "cluster_id", None)
        went_back = [(md.topic, md.partition) for _, md in acked
                     if md.offset <= self._high.get((md.topic, md.partition), -1)]
        if cluster_id in self._lost_ids:  # metadata not refreshed yet: the id is not this broker's
            cluster_id = None
        changed = cluster_id is not None and self._cluster_id is not None and cluster_id != self._cluster_id
        if (went_back or changed) and self._acked:
            kept = [e[2] for e in self._acked]
            log.warning("the broker lost acked events (%s): re-sending the %d events acked in the last %g s%s",
                        f"cluster id {self._cluster_id} -> {cluster_id}" if changed
                        else f"offsets went back on {sorted(set(went_back))[:3]}", len(kept), self.resend_window_s,
                        f" or not yet consumed by {self.consumer_group}" if self.consumer_group else "")
            self._acked.clear()
            self._acked_bytes = 0
            self._count("broker_losses")
            self._spill(kept, count=False)
            self._count("resent", len(kept))
        if went_back or changed:
            self._high = {}
            self._committed = {}
            if self._cluster_id is not None:
                self._lost_ids.add(self._cluster_id)
            self._cluster_id = None
        if cluster_id is not None and cluster_id not in self._lost_ids:
            self._cluster_id = cluster_id
        for _, md in acked:
            tp = (md.topic, md.partition)
            self._high[tp] = max(self._high.get(tp, -1), md.offset)
        if self.resend_window_s <= 0:
            return
        now = time.monotonic()
        for it, md in acked:
            n = len(it[2]) + len(it[1])
            self._acked.append((now, n, it, (md.topic, md.partition), md.offset))
            self._acked_bytes += n
        self._trim(now)

    def _consumed(self, entry) -> bool:
        """Whether the consumer group committed past this retained event (acking broker's view)."""
        return entry[4] < self._committed.get(entry[3], -1)

    def _trim(self, now: float) -> None:
        """Drop retained events: the oldest beyond ``resend_max_bytes``; past
        ``resend_window_s``, those the consumer group committed past (all, without a group)."""
        while self._acked and self._acked_bytes > self.resend_max_bytes:
            e = self._acked.popleft()
            self._acked_bytes -= e[1]
            if not self._consumed(e):
                self._count("resend_unprotected")
        if self.consumer_group is None or not self.bootstrap:
            while self._acked and now - self._acked[0][0] > self.resend_window_s:
                self._acked_bytes -= self._acked.popleft()[1]
            return
        seen = self._group_seen
        if seen is not None and seen[0] == self._cluster_id:
            self._committed = seen[1]
        if now < self._next_window_scan or not self._acked or now - self._acked[0][0] <= self.resend_window_s:
            return
        self._next_window_scan = now + self.consumed_check_s  # O(retained) at most this often
        keep = collections.deque()
        for e in self._acked:
            if now - e[0] > self.resend_window_s and self._consumed(e):
                self._acked_bytes -= e[1]
            else:
                keep.append(e)
        self._acked = keep

    def _watch_group(self) -> None:
        """Thread: read the consumer group's committed offsets every ``consumed_check_s``
        while events are retained. A reading counts only if the cluster id was the same
        before and after it (the offsets are that broker's)."""
        admin = None
        while not self._closed:
            time.sleep(self.consumed_check_s)
            if not self._acked:
                continue
            try:
                if admin is None:
                    from kafka.admin import KafkaAdminClient

                    from schemas.settings import kafka_client_config

                    admin = KafkaAdminClient(**kafka_client_config(self.bootstrap), client_id=self.client_id,
                                             request_timeout_ms=int(self.send_timeout_s * 1000))
                before = admin.describe_cluster().get("cluster_id")
                offsets = admin.list_group_offsets([self.consumer_group]).get(self.consumer_group, {})
                if before is not None and admin.describe_cluster().get("cluster_id") == before:
                    self._group_seen = (before, {(tp.topic, tp.partition): om.offset
                                                 for tp, om in offsets.items() if om.offset >= 0})
            except Exception as exc:  # noqa: BLE001 - broker down or restarting: read again later
                log.debug("reading the committed offsets of %s failed: %s", self.consumer_group, exc)
                _close_quietly(admin)
                admin = None
        _close_quietly(admin)

    def _get_producer(self):
        if self._producer is None:
            from kafka import KafkaProducer

            from schemas.settings import kafka_client_config

            self._producer = KafkaProducer(
                **kafka_client_config(self.bootstrap), client_id=self.client_id, acks="all",
                linger_ms=5, max_block_ms=2000, bootstrap_timeout_ms=2000, request_timeout_ms=int(self.send_timeout_s * 1000),
                retries=0, reconnect_backoff_max_ms=1000, max_request_size=self.max_request_bytes,
                allow_auto_create_topics=False)  # DESIGN §2: topics are created explicitly
        return self._producer

    def _drop_producer(self) -> None:
        p, self._producer = self._producer, None
        self._kafka_up = False
        if p is None:
            return
        # kafka-python's close() flushes first and raises on a timeout before it reaches its
        # force-close, leaving the sender thread alive with our unacked batches: it would
        # deliver them once the broker is back, after we journaled them (duplicates). So
        # force-close the sender (abort incomplete batches) when close() does not finish.
        try:
            p.close(timeout=0)
        except Exception:  # noqa: BLE001
            sender = getattr(p, "_sender", None)
            if sender is not None:
                sender.force_close()
            p._closed = True  # keep __del__ from flushing again

    def _reject(self, items: list[tuple[str, str, bytes]], why: str) -> None:
        log.error("kafka refused %d events for good (%s): kept in %s", len(items), why, self.rejected_path)
        with open(self.rejected_path, "ab") as f:
            f.write(_encode_lines(items))
            f.flush()
            os.fsync(f.fileno())
        self._count("failed", len(items))
        self._settle(items, RuntimeError(f"kafka refused the event for good: {why}"))

    def _send(self, items: list[tuple[str, str, bytes]]) -> list[bool]:
        """Send in order and wait for acks; per item: True (acked), False (retry later) or
        ``_REJECTED`` (refused for good; now in the rejected file)."""
        if self.bootstrap is None:
            return [False] * len(items)
        try:
            p = self._get_producer()
        except Exception as exc:  # noqa: BLE001 - NoBrokersAvailable and friends
            log.debug("kafka unreachable: %s", exc)
            self._drop_producer()
            return [False] * len(items)
        futs: list = []
        for t, k, v in items:
            try:
                futs.append(p.send(t, key=k.encode(), value=v))
            except Exception as exc:  # noqa: BLE001 - metadata timeout etc.
                if getattr(exc, "retriable", True) is False:
                    self._reject([(t, k, v)], repr(exc))
                    futs.append(_REJECTED)
                else:
                    log.debug("kafka send failed: %s", exc)
                    futs.append(None)
        try:
            p.flush(timeout=self.send_timeout_s)
        except Exception:  # noqa: BLE001
            pass
        ok: list = []
        acked = []
        for it, f in zip(items, futs):
            good = f if f is _REJECTED else False
            if f is not None and f is not _REJECTED and f.is_done:
                good = f.succeeded()
                if good:
                    acked.append((it, f.value))
                elif getattr(f.exception, "retriable", True) is False:
                    self._reject([it], repr(f.exception))
                    good = _REJECTED
            ok.append(good)
        self._settle([it for it, _ in acked])
        if acked:
            self._retain(p, acked)
        if all(ok):
            self._kafka_up = True
        else:
            self._drop_producer()
        return ok

    def _replay(self) -> bool:
        """Send journal entries from the cursor on, in order; True when the journal is drained."""
        with self._jlock:
            start = self._read_cursor()
            size = self._journal_size()
        if start >= size:
            return True
        with open(self.journal_path, "rb") as f:
            f.seek(start)
            while True:
                offsets, items = [], []
                pos = f.tell()
                for _ in range(self.batch_max):
                    line = f.readline()
                    if not line or not line.endswith(b"\n"):
                        break
                    pos += len(line)
                    d = json.loads(line)
                    items.append((d["topic"], d["key"], base64.b64decode(d["value"])))
                    offsets.append(pos)
                if not items:
                    break
                ok = self._send(items)
                failed = [it for it, good in zip(items, ok) if not good]
                if len(failed) == len(items):
                    return False
                # Partial failure: those that failed go to the journal's end (the acked ones
                # must not be sent twice), then the cursor moves past the whole batch.
                if failed:
                    self._spill(failed, count=False)
                with self._jlock:
                    self._write_cursor(offsets[-1])
                self._count("replayed", sum(1 for g in ok if g is True))
                if failed:
                    return False
        with self._jlock:  # drained: truncate so the journal does not grow forever
            if self._read_cursor() >= self._journal_size():
                self._jfile.truncate(0)
                self._jfile.seek(0)
                self._write_cursor(0)
                return True
        return False

    def _run(self) -> None:
        next_probe = 0.0
        stopping = False
        while True:
            pending_journal = self.journal_pending() > 0
            if pending_journal and self.bootstrap is not None and time.monotonic() >= next_probe:
                if not self._replay():
                    next_probe = time.monotonic() + self.retry_interval_s
                continue_loop = True
            else:
                continue_loop = False
            try:
                first = self._q.get(timeout=0.05 if (continue_loop or pending_journal) else 0.2)
            except queue.Empty:
                if stopping:
                    return
                continue
            if first is _STOP:
                stopping = True
                if self._q.empty():
                    return
                continue
            items = [first]
            while len(items) < self.batch_max:
                try:
                    it = self._q.get_nowait()
                except queue.Empty:
                    break
                if it is _STOP:
                    stopping = True
                    break
                items.append(it)
            self._inflight = len(items)
            if self.journal_pending() > 0 or not self._kafka_up and time.monotonic() < next_probe:
                self._spill(items)  # keep order behind the journal
            else:
                ok = self._send(items)
                failed = [it for it, good in zip(items, ok) if not good]
                self._count("sent", sum(1 for g in ok if g is True))
                if failed:  # only the unacked ones: an acked event is never sent twice
                    self._spill(failed)
                    next_probe = time.monotonic() + self.retry_interval_s
            self._inflight = 0
            if stopping and self._q.empty():
                return



def _close_quietly(client) -> None:
    """Close a Kafka client that may be half-started or already broken (None: nothing)."""
    if client is None:
        return
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing a dead client
        pass


def _encode_lines(items: list[tuple[str, str, bytes]]) -> bytes:
    return b"".join(
        json.dumps({"topic": t, "key": k, "value": base64.b64encode(v).decode()}).encode() + b"\n"
        for t, k, v in items)
