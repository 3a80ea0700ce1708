"""The ingest worker: completions and feedback in, shards + samples + dead letters out.

One process = one member of the consumer group ``IngestConfig.app_id`` (aiokafka), with
two activities:

* **the consumer loop** (event loop): ``getmany`` a batch of up to ``BATCH_MAX_RECORDS``
  records over every assigned partition; in the fold thread (so that the client's next fetch
  overlaps it) validate each record (malformed -> dead letter with field and reason; of a
  completion only the head the join needs, ``ingest.join.parse_completion``: its body is
  validated once, when it is sealed, and dead-lettered with its votes if malformed) and
  fold the whole batch into the SQLite join state in **one transaction** (``Joiner.on_completions`` / ``on_feedbacks``: a few
  statements per batch), publish the batch's dead letters (delivery awaited) and record
  them, then **commit the batch's offsets**;
* **the seal thread** (one worker thread, every ``tick_s``): recover dead peers' claims,
  claim due labels, validate their completions and build their RewardedSamples, write one Parquet shard per
  (model_version, day) per round, mark them sealed, dead-letter orphans (topic and file written
  before they are marked) and refresh the catalog. It shares the store (one SQLite connection, one lock held
  per transaction); a claim transaction covers at most ``SEAL_CHUNK`` labels, so the
  consumer never waits long for it. Only the Kafka sends of its results (samples, orphan
  dead letters) run on the event loop.

Why not faust (``docs/decisions.md`` D12): faust's per-message stream path capped a
do-nothing agent at ~11k records per CPU-second on this machine, below the 25 %-of-raw
target before any join work; a batch loop over the same aiokafka client has no such cap.

Crash safety (no label lost, none counted twice):

1. The offsets of a batch are committed only after the SQLite transaction holding the
   batch's effects has committed and its dead letters were delivered and recorded. So a
   committed offset never covers an event whose effect is not durable; a killed worker
   loses only batches whose offsets were not committed, and those are consumed again.
   Nothing else is needed from the broker: no transactions, no idempotent producer.
2. Replays are recognised: every event_id folded or dead-lettered is in the ``events``
   table and every sealed completion in ``sealed`` (for ``JoinConfig.dedupe_retention_s``,
   far longer than the uncommitted tail), so a replayed record folds nothing.
3. The seal thread claims due labels with the path of the shard that will hold them and the
   worker's owner id (one transaction), writes the shard atomically (temp + fsync +
   rename), then marks them sealed. A vote that arrives for a claimed label is late (its
   sample is decided). A worker killed between the rename and the mark is repaired by
   :meth:`ingest.join.Joiner.recover` (at start, and every ``RECOVER_EVERY_S`` by the live
   workers): the shard exists, so the labels are marked sealed, not sealed again; a shard
   that never appeared releases its labels to be sealed again. Recovery touches only
   claims of dead owners (an owner is alive while its process holds its ``flock``).
4. Nothing depends on end offsets, lag, or changelog highwaters (wrong on the embedded
   broker, DESIGN §3): the consumer starts from the group's committed offsets, else from
   the earliest record, and the state's dedupe makes any overlap harmless.
5. A restart of the memory-only embedded broker loses topics, data and committed offsets:
   the heartbeat fails (unknown member), the worker rejoins the group, finds no committed
   offset and reads the recreated topics from the beginning. Until the rejoin completes the
   fetcher still reads the old assignment from its old positions, which on the new broker
   may lie past records it never delivered: offsets are committed only as the member the
   batch was fetched as (:mod:`ingest.commit`), so those commits are refused (unknown
   member) or not sent (no member), never taken as a standalone commit; their records are
   consumed again, then deduped.
   Open labels stay in the SQLite state and are sealed as usual. The worker never lets
   its metadata requests auto-create a topic (:func:`no_topic_auto_creation`: the broker
   would create it with its own partition count before ``ensure_topics`` runs), refreshes
   metadata every 5 s to see the re-created topics, and retries publishes that fail
   meanwhile. ``tests/test_ingest_scale.py`` checks it with three workers on one partition.

Workers on several hosts (``--state postgresql://...``, ``ingest.state_pg``): the state is
scoped to partitions. On each assignment the store takes ownership of the assigned
partitions (a taken-over partition gets a new epoch) and every fold transaction checks it
still holds them (:class:`ingest.state_pg.Fenced` otherwise: the batch is not folded, not
committed, and the new owner consumes it). A record whose completion_id hashes (Kafka's
murmur2, ``ingest.partition``) to another partition than the one it was consumed from (a
producer with another partitioner, e.g. librdkafka's default) is not folded there: it is
forwarded to its home partition of the internal topic ``flywheel.ingest.rekeyed``, and the
batch's offsets are committed once the forward is acknowledged; the owner of that
partition folds it like any other. Shards go to ``samples_dir``, which every host must be
able to write (a shared directory; object storage's stand-in). With the SQLite default the
file is shared by the host's workers and no record is forwarded.

Counters ``consumed_completions`` / ``consumed_feedback`` count deliveries (a replayed record
counts again; ``forwarded_*``: records forwarded to their home partition); they are how
``bench/ingest.py`` measures consumption.

Samples on ``flywheel.samples`` and dead letters are at-least-once (a crash between the
shard and the publish may miss the topic copy of a shard's samples; the shards are the
source of truth the learner reads).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa

from schemas import topics as T
from schemas.events import DeadLetter, FeedbackEvent, now_ms

from ingest import catalog, writer
from ingest.clients import consumer_settings as cs, producer_settings as ps
from ingest.commit import CommitRefused, membership
from ingest.commit import commit as commit_offsets
from ingest.join import Joiner, TickResult, check_clock, dead_letter, parse_completion, parse_event
from ingest.metrics import IngestMetrics, serve_http
from ingest.partition import SOURCE_HEADER, home_partitions, rekeyed_topic
from ingest.state import open_store
from ingest.state_pg import Fenced

log = logging.getLogger("ingest")


def _record_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that a record's values can cause in the state (a number beyond SQLite's or
    PostgreSQL's integer, text that is not UTF-8, a JSON encoder refusing a value): a batch
    failing with one is folded record by record and the culprit dead-lettered. Anything else
    (the database is gone, a bug) stops the batch, uncommitted, as before."""
    errs: list[type[BaseException]] = [OverflowError, ValueError, TypeError, UnicodeError, RecursionError,
                                       sqlite3.DataError, sqlite3.IntegrityError]
    try:
        import psycopg

        errs += [psycopg.DataError, psycopg.IntegrityError]
    except ImportError:  # the PostgreSQL state is optional
        pass
    return tuple(errs)


RECORD_ERRORS = _record_errors()

BATCH_MAX_RECORDS = 2000  # records per getmany = one SQLite transaction = one offset commit
POLL_TIMEOUT_MS = 200  # getmany waits at most this long for a first record (ms)
SEAL_CHUNK = 256  # labels claimed per seal transaction (bounds the consumer's wait for the lock)
# what a sealed sample keeps once its chunk is in Arrow: its label fields (commit, metrics, keys)
_LIGHT = {"prompt_token_ids": (), "completion_token_ids": (), "behavior_logprobs": (), "expert_routes": None}
SHARD_ROWS = writer.ROW_GROUP_ROWS  # at most this many samples per seal round (= per shard)
RECOVER_EVERY_S = 5.0  # live workers finish/release dead workers' claims this often (s)
CATALOG_EVERY_S = 60.0  # catalog views re-created at most this often once they see files (s)
PRUNE_EVERY_S = 60.0  # dedupe/sealed rows older than dedupe_retention_s deleted this often (s)
COLLECT_EVERY_S = 10.0  # body segments nobody references any more deleted this often (s)
PUBLISH_BACKOFF_MAX_S = 5.0  # longest wait between two tries of a failed publish (s)
STATS_EVERY_S = 5.0  # an "ingest stats" line (INFO) at most this often, when counters moved (s)
REKEYED_CHECK_S = 10.0  # a partition-scoped worker re-creates the internal topic when missing this often (s)


def no_topic_auto_creation() -> None:
    """Make this process's aiokafka clients ask for metadata with
    ``allow_auto_topic_creation=False``.

    aiokafka sends MetadataRequest v4+ with auto-creation on, and the embedded broker then
    creates a missing topic with 4 partitions: after a broker restart a worker's metadata
    refresh could win the race against ``ensure_topics`` and create completions/feedback
    with the wrong partition count (seen as a flaky ``tests/test_ingest_scale.py``; DESIGN
    §2: never rely on auto-creation). aiokafka has no setting for it, so its client module's
    request class is wrapped; a missing topic is then "not found" and retried.
    """
    import functools

    import aiokafka.client as client
    from aiokafka.protocol.metadata import MetadataRequest

    if not isinstance(client.MetadataRequest, functools.partial):
        client.MetadataRequest = functools.partial(MetadataRequest, allow_auto_topic_creation=False)


def _source_topic(record) -> str:
    """The source topic of a record of the internal topic (its header; feedback if absent).
    A header that is not UTF-8 is read with replacement characters: anything but the
    completions topic is parsed as feedback (a dead letter names that source), so a hostile
    header never stops the worker (it raised UnicodeDecodeError at every restart)."""
    for k, v in record.headers or ():
        if k == SOURCE_HEADER and v:
            return bytes(v).decode("utf-8", errors="replace")
    return T.FEEDBACK


class WorkerStartError(RuntimeError):
    """The worker cannot start: its Kafka cluster is unreachable or its HTTP port cannot be
    bound (the message names the address; ``flywheel ingest`` prints it in one line, exit 1)."""


class Worker:
    """One ingest worker process (see the module docstring).

    Args:
        cfg: ``ingest.app.IngestConfig``.
        consumer_settings / producer_settings: keyword arguments of ``AIOKafkaConsumer`` /
            ``AIOKafkaProducer`` (default: ``ingest.clients.consumer_settings(cfg)`` / ...).
    """

    def __init__(self, cfg, consumer_settings: dict | None = None, producer_settings: dict | None = None):
        self.cfg = cfg
        self.consumer_kw = consumer_settings or cs(cfg)
        self.producer_kw = producer_settings or ps(cfg)
        self.store = open_store(cfg.state_path, cfg.group_id)
        # a partition-scoped store (PostgreSQL) folds a label only in its home partition: records
        # found elsewhere are forwarded there through the internal topic (ingest.partition)
        self.scoped = bool(getattr(self.store, "scoped", False))
        self.rekeyed = rekeyed_topic()
        self._n: int | None = None  # partitions of the consumed topics (from the assignment)
        self._assign: tuple[set[int], int] | None = None  # an assignment the store has not taken yet
        self.joiner = Joiner(self.store, cfg.join, decode=completion_decoder())
        self.metrics = IngestMetrics()  # Prometheus: GET /metrics on worker_port
        self.dead_dir = catalog.deadletters_dir(cfg.samples_dir)
        # a dead-letter file was written since the last housekeeping (for the catalog refresh)
        self._wrote_dead = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ingest-seal")
        # the fold runs off the event loop so that aiokafka's next fetch overlaps it
        self._fold_pool = ThreadPoolExecutor(1, thread_name_prefix="ingest-fold")
        self._t = {"recover": time.monotonic(), "prune": 0.0, "stats": 0.0, "cat_at": 0.0, "collect": 0.0,
                   "rekeyed": time.monotonic()}
        self._cat = {"samples": False, "dead": False}
        self._last_stats: dict | None = None
        self.producer = None
        self.consumer = None
        # offsets of folded batches not committed yet, and the membership they were fetched as
        self._pending: dict = {}
        self._pending_member = None
        log.info("ingest owner %s", self.store.owner)
        rec = self.joiner.recover(lambda p: Path(p).exists())
        if rec["sealed"] or rec["released"]:
            log.info("ingest recover: %s", rec)

    # -- consumer loop ---------------------------------------------------------------------
    def fold(self, batch: dict) -> tuple[list[DeadLetter], list[str], dict[str, int], list]:
        """Validate and fold one ``getmany`` batch (``{TopicPartition: [ConsumerRecord]}``)
        in one transaction. Returns ``(dead letters to publish, their event_ids to record
        once published, malformed counters to bump then, records to forward)``.

        A partition-scoped store folds only events whose home partition
        (``ingest.partition``) is the one they were consumed from; the others are returned as
        ``(home partition, key, value, source topic)`` to forward through the internal topic
        (their offsets are committed once the forward is acknowledged).

        Raises:
            ingest.state_pg.Fenced: another worker took over one of the batch's partitions.
        """
        self.take_partitions()
        comps, fbs, dead = [], [], []
        malformed = {"deadletter_malformed_completion": 0, "deadletter_malformed_feedback": 0,
                     "deadletter_future": 0}
        n = {"consumed_completions": 0, "consumed_feedback": 0, "forwarded_completions": 0, "forwarded_feedback": 0}
        now = now_ms()
        tc = self.joiner.tc
        for tp, recs in batch.items():
            for r in recs:
                src = _source_topic(r) if tp.topic == self.rekeyed else tp.topic
                is_c = src == tc
                n["consumed_completions" if is_c else "consumed_feedback"] += 1
                # a completion: its head only (the body is validated once, at sealing)
                ev = parse_completion(r.value, src, r.key) if is_c else parse_event(FeedbackEvent, r.value, src, r.key)
                if isinstance(ev, DeadLetter):
                    dead.append(ev)
                    malformed["deadletter_malformed_completion" if is_c else "deadletter_malformed_feedback"] += 1
                elif isinstance(ev := check_clock(ev, r.value, src, r.key, now), DeadLetter):
                    dead.append(ev)
                    malformed["deadletter_future"] += 1
                else:
                    (comps if is_c else fbs).append((ev, r.value, tp))
        forward: list[tuple[int, bytes, bytes, str]] = []
        comps = self._route(comps, tc, forward, n)
        fbs = self._route(fbs, self.joiner.tf, forward, n)
        parts = {tp.partition for tp in batch}
        try:
            outc, outs = self._fold_tx(comps, fbs, now, parts, n)
        except RECORD_ERRORS as exc:  # a value the state refuses: find it, fold the others
            log.warning("ingest: a batch of %d records could not be folded (%s: %s); folding them one by one",
                        len(comps) + len(fbs), type(exc).__name__, exc)
            outc, outs = self._fold_each(comps, fbs, now, parts, n, dead)
        self.metrics.folded(batch, outc, outs)
        eids = []
        for (ev, _), (_, dl) in zip(fbs, outs):
            if dl is not None:
                dead.append(dl)
                eids.append(str(ev.event_id))
        return dead, eids, malformed, forward

    def _fold_tx(self, comps: list, fbs: list, now: int, parts: set[int], n: dict[str, int]) -> tuple[list, list]:
        """Fold parsed ``(event, raw)`` completions and feedback in one transaction (fenced to
        ``parts``), counters ``n`` bumped in it; returns the join's outcomes."""
        with self.store.transaction():  # completions first: fewer votes wait as orphans
            self.store.fence(parts)
            outc = self.joiner.on_completions(comps, now)
            outs = self.joiner.on_feedbacks(fbs, now)
            for k, v in n.items():
                self.store.bump(k, v)
        return outc, outs

    def _fold_each(self, comps: list, fbs: list, now: int, parts: set[int], n: dict[str, int],
                   dead: list[DeadLetter]) -> tuple[list, list]:
        """:meth:`_fold_tx` record by record, after a batch failed with one of
        :data:`RECORD_ERRORS`: a record whose own fold raises is dead-lettered (field
        ``value``, reason ``unfoldable: <error>``; appended to ``dead``, a vote's outcome carries
        its dead letter so that its event_id is recorded once published), the others are
        folded, so nothing a record carries stops the join."""
        outc, outs = [], []
        self._fold_tx([], [], now, parts, n)
        for item in comps:
            try:
                outc += self._fold_tx([item], [], now, parts, {})[0]
            except RECORD_ERRORS as exc:
                log.warning("ingest: completion %s dead-lettered: %s: %s", item[0].completion_id, type(exc).__name__, exc)
                dead.append(dead_letter(self.joiner.tc, str(item[0].completion_id), "value",
                                        f"unfoldable: {type(exc).__name__}: {str(exc)[:200]}", item[1], now))
                outc.append("unfoldable")
        for item in fbs:
            try:
                outs += self._fold_tx([], [item], now, parts, {})[1]
            except RECORD_ERRORS as exc:
                log.warning("ingest: feedback %s dead-lettered: %s: %s", item[0].event_id, type(exc).__name__, exc)
                outs.append(("unfoldable", dead_letter(self.joiner.tf, str(item[0].completion_id), "value",
                                                       f"unfoldable: {type(exc).__name__}: {str(exc)[:200]}",
                                                       item[1], now)))
        return outc, outs

    def _route(self, items: list, src: str, forward: list, n: dict[str, int]) -> list:
        """``(event, raw)`` of the ``(event, raw, TopicPartition)`` items to fold here; those
        outside their home partition (partition-scoped store only) are appended to ``forward``
        as ``(home, key, raw, src)`` and counted in ``forwarded_*``."""
        if not (self.scoped and self._n) or not items:
            return [(ev, raw) for ev, raw, _ in items]
        homes = home_partitions([str(ev.completion_id) for ev, _, _ in items], self._n)
        here = []
        for (ev, raw, tp), h in zip(items, homes):
            if h == tp.partition:  # (a forwarded record is home: it was sent to partition h)
                here.append((ev, raw))
            else:
                forward.append((h, str(ev.completion_id).encode(), raw, src))
                n["forwarded_completions" if src == self.joiner.tc else "forwarded_feedback"] += 1
        return here

    def assigned(self, assigned) -> None:
        """Kafka assigned ``assigned`` (TopicPartitions) to this worker: the store takes
        ownership of their partitions (``ingest.state_pg.PgStateStore.assign``), and dead
        owners' claims in them are recovered at the next housekeeping."""
        parts = self.consumer.partitions_for_topic(T.COMPLETIONS) if self.consumer is not None else None
        if not parts:
            return
        self._n = len(parts)
        self._assign = ({tp.partition for tp in assigned}, self._n)  # taken in the fold thread

    def take_partitions(self) -> bool:
        """In the fold thread (before each fetch and each fold): make the store own the
        partitions of the last assignment (:meth:`assigned`). A takeover that waited too long
        for the previous owner is retried before the next fetch; the batches of those
        partitions are refused meanwhile. Returns whether nothing is left to take."""
        a = self._assign
        if a is None:
            return True
        try:
            epochs = self.store.assign(*a)
        except Fenced as exc:
            log.warning("ingest: %s; retrying", exc)
            return False
        if self._assign is a:  # (a newer assignment that arrived meanwhile stays pending)
            self._assign = None
        if self.scoped:
            log.info("ingest owns partitions %s", json.dumps(epochs, sort_keys=True))
        self._t["recover"] = 0.0
        return True

    async def publish(self, topic: str, msgs: list[tuple], on_retry=None) -> None:
        """Send ``(key, value)`` or ``(key, value, partition, headers)`` messages and wait
        until every one is acknowledged (``on_retry``: a blocking callable run in a thread
        before each retry).

        A failed send (e.g. the embedded broker restarting: its topics are back only once
        ``ensure_topics`` ran) is retried, all messages again, with backoff up to
        ``PUBLISH_BACKOFF_MAX_S``, until it succeeds: samples and dead letters are
        at-least-once, and a batch's offsets wait for its dead letters."""
        from aiokafka.errors import KafkaError

        delay = 0.1
        while True:
            try:
                futs = [await self.producer.send(topic, key=m[0], value=m[1], partition=m[2] if len(m) > 2 else None,
                                                 headers=m[3] if len(m) > 3 else None) for m in msgs]
                if futs:
                    await asyncio.gather(*futs)
                return
            except KafkaError as exc:
                log.warning("ingest: publishing %d messages to %s failed (%s: %s); retrying in %.1f s",
                            len(msgs), topic, type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, PUBLISH_BACKOFF_MAX_S)
                if on_retry is not None:
                    try:
                        await asyncio.get_running_loop().run_in_executor(None, on_retry)
                    except Exception as exc:  # noqa: BLE001 - retried with the publish
                        log.warning("ingest: %s failed before a retry: %s",
                                    getattr(on_retry, "__name__", on_retry), exc)

    async def forward(self, fwd: list[tuple[int, bytes, bytes, str]]) -> None:
        """Send records found outside their home partition to that partition of the internal
        topic, their source topic in a header; returns once every one is acknowledged."""
        await self.publish(self.rekeyed, [(k, v, p, [(SOURCE_HEADER, src.encode())]) for p, k, v, src in fwd],
                           on_retry=self.ensure_rekeyed)

    def ensure_rekeyed(self) -> int | None:
        """Create the internal topic (``ingest.partition.rekeyed_topic``) with the completions
        topic's partition count if it is missing (at start, and again after a memory-only
        broker lost it). Returns that count, None while completions does not exist."""
        from kafka.admin import NewTopic
        from kafka.errors import TopicAlreadyExistsError

        from schemas import settings as S
        from schemas import topics as topics_mod

        admin = topics_mod.admin_client(self.cfg.bootstrap, timeout_s=10.0)
        try:
            have = topics_mod.describe(admin, [T.COMPLETIONS, self.rekeyed])
            if T.COMPLETIONS not in have:
                return None
            n = have[T.COMPLETIONS]["partitions"]
            if self.rekeyed not in have:
                rf = S.kafka_settings().replication_factor
                try:
                    admin.create_topics([NewTopic(self.rekeyed, n, rf)])
                    log.info("ingest: created %s with %d partitions", self.rekeyed, n)
                except TopicAlreadyExistsError:
                    pass
            elif have[self.rekeyed]["partitions"] != n:
                log.error("ingest: %s has %d partitions, %s has %d: forwarded records would miss their home "
                          "partition; delete it (it holds only records in transit)", self.rekeyed,
                          have[self.rekeyed]["partitions"], T.COMPLETIONS, n)
            return n
        finally:
            admin.close()

    async def publish_dead(self, dead: list[DeadLetter]) -> None:
        """Publish ``dead`` to the dead-letter topic, then write them as one dead-letter file;
        both are done before this returns, so the caller marks the events dead-lettered (or
        commits past them) only once the topic and the file hold them. A crash between the
        two writes and the mark dead-letters them again (at-least-once, never lost).

        Raises whatever the send or the file write raised (the caller retries)."""
        await self.publish(T.DEADLETTER, [((d.key or "").encode(), d.to_bytes()) for d in dead])
        await asyncio.get_running_loop().run_in_executor(None, writer.write_deadletters, dead, self.dead_dir)
        self._wrote_dead = True
        self.metrics.dead_letters(dead)

    async def consume(self, stop: asyncio.Event) -> None:
        """The consumer loop until ``stop`` is set (finishes the batch in hand first)."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            if self._assign is not None and not await loop.run_in_executor(self._fold_pool, self.take_partitions):
                await asyncio.sleep(1.0)
            batch = await self.consumer.getmany(timeout_ms=POLL_TIMEOUT_MS, max_records=BATCH_MAX_RECORDS)
            member = membership(self.consumer)  # the assignment these records were fetched under
            batch = {tp: recs for tp, recs in batch.items() if recs}
            if not batch:
                await self.commit_pending()
                continue
            try:
                dead, eids, malformed, fwd = await loop.run_in_executor(self._fold_pool, self.fold, batch)
            except Fenced as exc:  # the new owner consumes it from the committed offsets
                log.warning("ingest: batch not folded: %s", exc)
                for tp, recs in batch.items():
                    if tp in self.consumer.assignment():
                        self.consumer.seek(tp, recs[0].offset)
                continue
            if fwd:
                await self.forward(fwd)  # acknowledged before the offsets move past them
            if dead:
                await self.publish_dead(dead)  # delivered before the offsets move past them
                with self.store.transaction():
                    self.joiner.store.mark_dead(eids)
                    for k, v in malformed.items():
                        self.store.bump(k, v)
            if member != self._pending_member:
                self._pending = {}
            self._pending_member = member
            self._pending.update({tp: recs[-1].offset + 1 for tp, recs in batch.items()})
            await self.commit_pending()

    async def commit_pending(self) -> None:
        """Commit the offsets of the folded batches not committed yet (:mod:`ingest.commit`:
        only as the member the batches were fetched as). A commit the coordinator may take
        later (it is moving) is kept and sent again after the next poll; one it refused for
        the membership is dropped: the next assignment consumes those records again from the
        committed offsets, and the join state dedupes them."""
        if not self._pending:
            return
        try:
            await commit_offsets(self.consumer, self._pending, self._pending_member)
        except CommitRefused as exc:
            if exc.retriable and self._pending_member == membership(self.consumer):
                log.debug("ingest: offset commit not taken yet (%s); sent again after the next poll", exc)
                return
            log.info("ingest: offsets of %d partitions not committed (%s); those records are consumed again "
                     "and deduped", len(self._pending), exc)
        self._pending = {}

    # -- seal thread -----------------------------------------------------------------------
    def seal_round(self) -> tuple[list[tuple[bytes, bytes]], list[TickResult], bool]:
        """In the seal thread: claim due labels ``SEAL_CHUNK`` at a time (one short
        transaction each) until none is due or ``SHARD_ROWS`` samples are in hand, write one
        shard per (model_version, day) and mark the samples sealed. Returns ``(sample
        messages to publish, tick results holding orphans to dead-letter, whether more may be
        due)``.

        Each chunk is turned into Arrow columns and topic values as it is claimed, and its
        samples keep only their label fields after that (:data:`_LIGHT`): a round holds one
        chunk's token lists at a time, so the next chunk reuses their memory (a round of
        ``SHARD_ROWS`` labels would otherwise hold ~75 MB of Python lists; D67)."""
        t0 = time.perf_counter()
        shard_for = writer.shard_namer(self.cfg.samples_dir)  # one shard per partition per round
        shards: dict[str, list[tuple[list, pa.Table, list[bytes]]]] = {}  # path -> chunks (samples, table, values)
        rows_in: dict[str, int] = {}  # path -> rows converted so far (a notice names its row)
        orphans: list[TickResult] = []
        rows, more = 0, False
        while True:
            res = self.joiner.tick(now_ms(), shard_for, limit=SEAL_CHUNK)
            for path, samples in res.shards.items():
                good, table, values, bad = writer.shard_parts(samples, self._encoder(path, rows_in.get(path, 0)))
                if bad:  # claimed "bad:" before the shard exists; dead-lettered with the orphans
                    log.warning("ingest: %d sample(s) of shard %s cannot be written, quarantined: %s", len(bad),
                                path, "; ".join(f"{s.completion_id} {f}: {r}" for s, f, r in bad[:3]))
                    orphans.append(self.joiner.quarantine(bad))
                if good:
                    rows_in[path] = rows_in.get(path, 0) + len(good)
                    shards.setdefault(path, []).append(([x.model_copy(update=_LIGHT) for x in good], table, values))
            rows += len(res.samples)
            if res.orphan_ids or res.bad_ids:
                orphans.append(res)
            if len(res.samples) + len(res.orphan_ids) + len(res.bad_ids) + len(res.dropped) < SEAL_CHUNK:
                break
            if rows >= SHARD_ROWS:
                more = True
                break
        msgs: list[tuple[bytes, bytes]] = []
        for path, chunks in shards.items():
            samples = [x for c in chunks for x in c[0]]
            try:
                writer.write_table(pa.concat_tables([c[1] for c in chunks]), path)
            except Exception:
                log.exception("ingest: shard %s failed; labels released, retried next tick", path)
                self.joiner.release([str(x.completion_id) for x in samples])
                continue
            self.joiner.commit_sealed(samples, path)
            self.metrics.sealed(samples)
            values = [v for c in chunks for v in c[2]]
            msgs.extend((str(x.completion_id).encode(), v) for x, v in zip(samples, values))
        self.metrics.seal_round.observe(time.perf_counter() - t0)
        return msgs, orphans, more

    def _encoder(self, path: str, first_row: int):
        """The samples-topic encoder of shard ``path`` for rows from ``first_row`` on."""
        if self.cfg.samples_value == "sample":
            return writer.sample_json
        return writer.notice_encoder(path, self.cfg.samples_dir, first_row)

    def housekeeping(self, wrote: int) -> None:
        """In the seal thread: recovery, pruning, catalog, stats line."""
        t = self._t
        if time.monotonic() - t["recover"] > RECOVER_EVERY_S:  # a dead peer's claims
            t["recover"] = time.monotonic()
            rec = self.joiner.recover(lambda p: Path(p).exists())
            if rec["sealed"] or rec["released"]:
                log.info("ingest recover: %s", rec)
        if time.monotonic() - t["prune"] > PRUNE_EVERY_S:
            t["prune"] = time.monotonic()
            self.joiner.prune()
        if time.monotonic() - t["collect"] > COLLECT_EVERY_S:
            t["collect"] = time.monotonic()
            self.store.collect_segments()
        wrote_dead, self._wrote_dead = self._wrote_dead, False
        # the views read the Parquet globs at query time: a refresh is needed only when the
        # first shard / dead-letter file appears (the view SQL changes), else now and then
        if (wrote and not self._cat["samples"]) or (wrote_dead and not self._cat["dead"]) or (
                (wrote or wrote_dead) and time.monotonic() - t["cat_at"] > CATALOG_EVERY_S):
            try:
                catalog.refresh_catalog(self.cfg.samples_dir, self.cfg.catalog)
                self._cat["samples"] |= bool(wrote)
                self._cat["dead"] |= wrote_dead
                t["cat_at"] = time.monotonic()
            except Exception as exc:  # the shards are the truth; the views are rebuilt next time
                log.warning("ingest: catalog refresh failed: %s", exc)
        self.metrics.observe_state(self.store)
        if time.monotonic() - t["stats"] > STATS_EVERY_S:
            c = self.stats()
            if c != self._last_stats:
                log.info("ingest stats %s", json.dumps(c, sort_keys=True))
                self._last_stats = c
            t["stats"] = time.monotonic()

    def stats(self) -> dict[str, int]:
        """The state's counters plus ``open_labels``."""
        c = self.store.counters()
        with self.store.transaction():
            c["open_labels"] = self.store.open_count()
        return c

    async def seal_loop(self, stop: asyncio.Event) -> None:
        """Every ``tick_s``: seal due labels in the seal thread; publish what it produced."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.tick_s)
            except asyncio.TimeoutError:
                pass
            if self.scoped and time.monotonic() - self._t["rekeyed"] > REKEYED_CHECK_S:
                self._t["rekeyed"] = time.monotonic()
                try:
                    if self.rekeyed not in await self.consumer.topics():
                        await loop.run_in_executor(None, self.ensure_rekeyed)
                except Exception as exc:  # noqa: BLE001 - the broker is restarting: next time
                    log.info("ingest: checking %s failed: %s", self.rekeyed, exc)
            wrote, more = 0, True
            while more and not stop.is_set():
                msgs, orphans, more = await loop.run_in_executor(self._pool, self.seal_round)
                wrote += len(msgs)
                await self.publish(T.SAMPLES, msgs)
                for res in orphans:
                    try:
                        await self.publish_dead(res.dead_letters)
                        await loop.run_in_executor(self._pool, self.joiner.commit_dead, res)
                    except Exception:
                        log.exception("ingest: orphan dead letters failed; retried next tick")
                        await loop.run_in_executor(self._pool, self.joiner.release, res.orphan_ids + res.bad_ids)
            await loop.run_in_executor(self._pool, self.housekeeping, wrote)

    # -- health ----------------------------------------------------------------------------
    async def _http(self, reader, writer_) -> None:
        """``GET /metrics``: Prometheus text (:mod:`ingest.metrics`); other paths: ``stats()`` JSON."""
        await serve_http(reader, writer_, self.metrics, self.consumer, self.stats)

    # -- lifecycle ---------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Join the group and run until ``stop`` is set (SIGTERM/SIGINT set it in
        :func:`ingest.app.run_worker`); then commit, leave the group and close the store."""
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
        from aiokafka.abc import ConsumerRebalanceListener

        stop = stop or asyncio.Event()
        no_topic_auto_creation()
        worker = self
        loop = asyncio.get_running_loop()
        if self.scoped:  # before subscribing: its appearance later would cost a rebalance
            try:
                await loop.run_in_executor(None, self.ensure_rekeyed)
            except Exception as exc:  # noqa: BLE001 - the broker is not up yet: seal_loop retries
                log.warning("ingest: creating %s failed (%s); retried every %.0f s", self.rekeyed, exc, REKEYED_CHECK_S)

        class _Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked):
                worker.store.revoke()

            def on_partitions_assigned(self, assigned):
                mine = sorted(f"{tp.topic}:{tp.partition}" for tp in assigned)
                log.info("ingest assigned %s", json.dumps(mine))
                worker.assigned(assigned)

        from aiokafka.errors import KafkaConnectionError

        self.producer = AIOKafkaProducer(**self.producer_kw)
        self.consumer = AIOKafkaConsumer(**self.consumer_kw)
        server = None
        boot = self.producer_kw.get("bootstrap_servers", self.cfg.bootstrap)
        try:
            await self.producer.start()
        except KafkaConnectionError as exc:
            self.store.close()
            raise WorkerStartError(f"Kafka at {boot}: {exc} (is the broker up? FLYWHEEL_KAFKA_BOOTSTRAP or "
                                   f"[kafka] bootstrap)") from None
        try:
            try:
                await self.consumer.start()
            except KafkaConnectionError as exc:
                raise WorkerStartError(f"Kafka at {boot}: {exc} (is the broker up? FLYWHEEL_KAFKA_BOOTSTRAP or "
                                       f"[kafka] bootstrap)") from None
            self.consumer.subscribe([T.COMPLETIONS, T.FEEDBACK] + ([self.rekeyed] if self.scoped else []),
                                    listener=_Listener())
            if self.cfg.worker_port:
                try:
                    server = await asyncio.start_server(self._http, self.cfg.worker_host, self.cfg.worker_port)
                except OSError as exc:
                    raise WorkerStartError(f"--worker-host {self.cfg.worker_host} --worker-port "
                                           f"{self.cfg.worker_port}: {exc.strerror or exc}") from None
            tasks = [asyncio.create_task(self.consume(stop), name="ingest-consume"),
                     asyncio.create_task(self.seal_loop(stop), name="ingest-seal")]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            stop.set()
            await asyncio.gather(*tasks)  # re-raises a task's failure
        finally:
            stop.set()
            if server is not None:
                server.close()
            await self.consumer.stop()
            await self.producer.stop()
            self._pool.shutdown(wait=True)
            self._fold_pool.shutdown(wait=True)
            self.store.close()


#: The worker process's cyclic-collector thresholds (``gc.set_threshold``): a young
#: collection per 50,000 net allocations (Python's default: 700), then 20 and 100.
GC_THRESHOLDS = (50_000, 20, 100)


def completion_decoder():
    """A ``token ids -> text`` function for an edit's kept share (``ingest.join.kept_share``),
    or None when this worker cannot decode completions (then an edit carrying ``final_text``
    is dead-lettered, field ``final_text``; one carrying its kept share as ``value`` is not).

    The tokenizer is the deployment's: ``tokenizer.json`` of the model store's base checkpoint
    (``$FLYWHEEL_STORE/base``, a local store), else of ``$FLYWHEEL_MODEL_DIR``
    (``schemas.settings.base_model_dir``), read with the ``tokenizers`` package (Hugging
    Face's Rust tokenizer, no model code); special tokens are skipped. Every version of a
    deployment shares its base tokenizer.
    """
    from schemas import settings

    store = settings.store_dir()
    dirs = ([Path(store) / "base"] if isinstance(store, Path) else []) + [settings.base_model_dir()]
    path = next((d / "tokenizer.json" for d in dirs if (d / "tokenizer.json").is_file()), None)
    if path is None:
        log.info("ingest: no tokenizer.json in %s: edits with final_text will be dead-lettered",
                 " or ".join(map(str, dirs)))
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        log.warning("ingest: %s found but the tokenizers package is not installed: edits with final_text will be "
                    "dead-lettered", path)
        return None
    tok = Tokenizer.from_file(str(path))
    log.info("ingest: completions decoded for edits' kept share with %s", path)
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


def configure_gc() -> None:
    """Set the worker process's garbage collection: the objects alive at start-up (modules,
    validators, clients) never die, so ``gc.freeze`` keeps them out of every collection, and
    :data:`GC_THRESHOLDS` collect less often. A fold batch allocates ~1k lists per 2k
    records, nearly all freed by reference counting; at Python's defaults the collector
    took 8-12 % of an in-process fold and seal (``bench/ingest_floor.py``, D68). Called by
    :func:`run` and by the benches that drive a :class:`Worker` in their own process."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run(cfg) -> None:
    """Run a :class:`Worker` for ``cfg`` in this process until SIGTERM/SIGINT."""

    async def main():
        configure_gc()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Worker(cfg).run(stop)

    asyncio.run(main())
