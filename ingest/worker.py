"""The ingest worker: completions and feedback in, shards + samples + dead letters out.

One process = one member of the consumer group ``IngestConfig.app_id`` (aiokafka), with
two activities:

* **the consumer loop** (event loop): ``getmany`` a batch of up to ``BATCH_MAX_RECORDS``
  records over every assigned partition; in the fold thread (so that the client's next fetch
  overlaps it) validate each record (malformed -> dead letter with field and reason; of a
  completion only the head the join needs, ``ingest.join.parse_completion``: its body is
  validated once, when it is sealed, and dead-lettered with its votes if malformed) and
  fold the whole batch into the **in-memory join state** of this worker's partitions
  (:class:`ingest.keyed.KeyedState`: no database call), publish the batch's dead letters
  (delivery awaited) and record them; every ``checkpoint_s`` (and before a rebalance and at
  shutdown) **checkpoint** the state's changes with the folded offsets in one transaction of
  the state store (SQLite file or PostgreSQL), then **commit those offsets** to Kafka;
* **the seal thread** (one worker thread, every ``tick_s``): claim due labels in memory,
  validate their completions and build their RewardedSamples, checkpoint the claims, write
  one Parquet shard per (model_version, day) per round, mark the labels sealed in memory
  (written by the next checkpoint), dead-letter orphans (topic and file written before they
  are marked) and refresh the catalog. Only the Kafka sends of its results (samples, orphan
  dead letters) run on the event loop.

Why not faust (``docs/decisions.md`` D12): faust's per-message stream path capped a
do-nothing agent at ~11k records per CPU-second on this machine, below the 25 %-of-raw
target before any join work; a batch loop over the same aiokafka client has no such cap.

Crash safety (no label lost, none counted twice; ``docs/decisions.md`` D81):

1. Offsets are committed to Kafka only after a checkpoint holding the effects of every
   record below them (and only once those records' dead letters were delivered and
   recorded). So a committed offset never covers an event whose effect is not durable; a
   killed worker's successor restores the last checkpoint and consumes again from the last
   committed offsets. Nothing else is needed from the broker: no transactions, no
   idempotent producer, no changelog topic.
2. Replays are recognised: every event_id folded or dead-lettered is in the dedupe set and
   every sealed completion in the sealed set (for ``JoinConfig.dedupe_retention_s``, far
   longer than the uncommitted tail), both restored with the partition, so a replayed record
   whose effect the checkpoint holds folds nothing.
3. The seal thread claims due labels with the path of the shard that will hold them and
   **checkpoints the claims before it writes the shard** (temp + fsync + rename), then
   marks them sealed in memory; the next checkpoint records them sealed. A vote that arrives
   for a claimed label is late (its sample is decided). A worker killed between the rename
   and that checkpoint is repaired by :meth:`ingest.join.Joiner.recover` when the next
   owner restores the partition: the shard exists, so the labels are marked sealed, not
   sealed again; a shard that never appeared releases its labels to be sealed again. A
   partition's ownership has an epoch in the state store, and a checkpoint is fenced by it,
   so a worker that lost a partition can neither checkpoint it nor write a shard for it
   after the takeover (its claims' checkpoint is refused first).
4. The consumer starts from the group's committed offsets, else from the earliest record,
   and the state's dedupe makes any overlap harmless. **A partition's labels are not
   sealed until the worker has caught up on it** (``docs/decisions.md`` D93): restored
   held (:meth:`ingest.processor.Processor.assign`), each partition is released once the
   consumer's position has reached, in each of its topics, the end offset it had when
   assigned, so a label restored from the checkpoint meets the events the checkpoint does
   not hold (records a killed owner folded after its last checkpoint) before it is sealed,
   dead-lettered as an orphan or dropped. That end offset is the high watermark of the
   first Fetch response under the assignment (at or past the end at the assignment), not
   ListOffsets, which under-reports on the embedded broker (DESIGN §3). A partition not
   caught up within ``catchup_timeout_s`` is released with a warning naming it.
5. A restart of the memory-only embedded broker loses topics, data and committed offsets:
   the heartbeat fails (unknown member), the worker rejoins the group, finds no committed
   offset and reads the recreated topics from the beginning. Until the rejoin completes the
   fetcher still reads the old assignment from its old positions, which on the new broker
   may lie past records it never delivered: offsets are committed only as the member the
   batch was fetched as (:mod:`ingest.commit`), so those commits are refused (unknown
   member) or not sent (no member), never taken as a standalone commit. Once the worker
   sees it is no longer a member (a heartbeat found the member unknown) it folds no batch
   until the rejoin and holds every partition it has
   (:meth:`ingest.processor.Processor.hold_all`), so nothing it folded from the old
   positions is sealed; the assignment after the rejoin reads each partition from its
   committed offset (none: the beginning) and, by point 4, up to its end before sealing, so
   the records below the old position are read, and the ones above it consumed again and
   deduped, before any label of the partition is sealed. The worker never lets
   its metadata requests auto-create a topic (:func:`no_topic_auto_creation`: the broker
   would create it with its own partition count before ``ensure_topics`` runs), refreshes
   metadata every 5 s to see the re-created topics, and retries publishes that fail
   meanwhile. ``tests/test_ingest_scale.py`` checks it with three workers on one partition.

The state is scoped to partitions, whatever the store (a SQLite file shared by one host's
workers, or ``--state postgresql://...`` for workers on several hosts, ``ingest.state_pg``).
On each assignment the worker takes ownership of the assigned partitions in the store (a
taken-over partition gets a new epoch) and restores their state before it folds; every fold
checks the batch's partitions are held and every checkpoint that the epochs are still this
worker's (:class:`ingest.store.Fenced` otherwise: nothing is written, the offsets are not
committed, and the new owner consumes those records). A record whose completion_id hashes (Kafka's
murmur2, ``ingest.partition``) to another partition than the one it was consumed from (a
producer with another partitioner, e.g. librdkafka's default) is not folded there: it is
forwarded to its home partition of the internal topic ``flywheel.ingest.rekeyed``, and the
batch's offsets are committed once the forward is acknowledged; the owner of that
partition folds it like any other. Shards go to ``samples_dir``, which every host must be
able to write (a shared directory; object storage's stand-in).

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
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from schemas.events import DeadLetter

from samplestore import shards as writer
from ingest.clients import consumer_settings as cs, producer_settings as ps
from ingest.commit import CommitRefused, membership
from ingest.commit import commit as commit_offsets
from ingest.metrics import POSITION_TIMEOUT_S, serve_http
from ingest.partition import SOURCE_HEADER
from ingest.processor import SEAL_CHUNK, Processor
from ingest.store import Fenced

# SEAL_CHUNK is ingest.processor's, named here too (tests import it from the worker)
__all__ = ["BATCH_MAX_RECORDS", "POLL_TIMEOUT_MS", "SEAL_CHUNK", "Worker", "WorkerStartError", "configure_gc",
           "no_topic_auto_creation", "run"]

log = logging.getLogger("ingest")


BATCH_MAX_RECORDS = 2000  # records per getmany = one SQLite transaction = one offset commit
POLL_TIMEOUT_MS = 200  # getmany waits at most this long for a first record (ms)
PUBLISH_BACKOFF_MAX_S = 5.0  # longest wait between two tries of a failed publish (s)
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


class WorkerStartError(RuntimeError):
    """The worker cannot start: its Kafka cluster is unreachable or its HTTP port cannot be
    bound (the message names the address; ``flywheel ingest`` prints it in one line, exit 1)."""


class Worker:
    """One ingest worker process (see the module docstring): the stream runtime (group
    membership, offset commits, fencing, the internal topic, retries, checkpoint cadence, the
    fold and seal threads) that holds and calls an :class:`ingest.processor.Processor` (the
    fold, the sealing punctuator, the shard sink), as a Kafka Streams StreamThread runs its
    processors.

    Args:
        cfg: ``ingest.app.IngestConfig``.
        consumer_settings / producer_settings: keyword arguments of ``AIOKafkaConsumer`` /
            ``AIOKafkaProducer`` (default: ``ingest.clients.consumer_settings(cfg)`` / ...).
        processor: the processor to run (default: ``Processor(cfg)``).

    Attributes:
        processor: the :class:`ingest.processor.Processor`; ``store``, ``joiner``,
            ``metrics``, ``topics`` and ``dead_dir`` are its, and :meth:`fold`,
            :meth:`seal_round`, :meth:`housekeeping` and :meth:`stats` call it (:meth:`fold`
            takes a pending assignment first).
    """

    def __init__(self, cfg, consumer_settings: dict | None = None, producer_settings: dict | None = None,
                 processor: Processor | None = None):
        self.cfg = cfg
        self.processor = processor or Processor(cfg)
        self.rekeyed = self.topics.rekeyed
        self.scoped = self.processor.scoped
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ingest-seal")
        # the fold runs off the event loop so that aiokafka's next fetch overlaps it
        self._fold_pool = ThreadPoolExecutor(1, thread_name_prefix="ingest-fold")
        self._rekeyed_at = time.monotonic()  # the internal topic last checked
        self.consumer_kw = consumer_settings or cs(cfg)
        self.producer_kw = producer_settings or ps(cfg)
        self.checkpoint_s = cfg.checkpoint_s
        self._ckpt_at = time.monotonic()
        self._seal_lock: asyncio.Lock | None = None  # one seal iteration at a time (revoke waits for it)
        # an assignment the state has not taken yet: its (topic, partition) pairs and partition count
        self._assign: tuple[set[tuple[str, int]], int | None] | None = None
        self._member_ok = False  # a member of the group at the last poll (its loss holds the partitions)
        self.producer = None
        self.consumer = None
        # offsets of folded batches not committed yet, and the membership they were fetched as
        self._pending: dict = {}  # folded, not in a checkpoint yet
        self._ready: dict = {}  # in a checkpoint, not committed to Kafka yet
        self._pending_member = None
        log.info("ingest owner %s", self.store.owner)

    # -- the processor it runs -----------------------------------------------------------
    @property
    def store(self):
        """The processor's join state (:class:`ingest.keyed.KeyedState`)."""
        return self.processor.store

    @property
    def joiner(self):
        """The processor's :class:`ingest.join.Joiner`."""
        return self.processor.joiner

    @property
    def metrics(self):
        """The processor's :class:`ingest.metrics.IngestMetrics` (``GET /metrics``)."""
        return self.processor.metrics

    @property
    def topics(self):
        """This process's topic names (``schemas.settings.TopicNames``)."""
        return self.processor.topics

    @property
    def dead_dir(self):
        """Where the dead-letter files go."""
        return self.processor.dead_dir

    def fold(self, batch: dict) -> tuple[list[DeadLetter], list[str], dict[str, int], list]:
        """In the fold thread: take a pending assignment (:meth:`take_partitions`; one that
        arrived during the fetch), then :meth:`ingest.processor.Processor.fold` the batch."""
        self.take_partitions()
        return self.processor.fold(batch)

    def seal_round(self):
        """In the seal thread: :meth:`ingest.processor.Processor.seal_round`."""
        return self.processor.seal_round()

    def housekeeping(self, wrote: int) -> None:
        """In the seal thread: :meth:`ingest.processor.Processor.housekeeping`."""
        self.processor.housekeeping(wrote)

    def stats(self) -> dict[str, int]:
        """:meth:`ingest.processor.Processor.stats`."""
        return self.processor.stats()

    def assigned(self, assigned) -> None:
        """Kafka assigned ``assigned`` (TopicPartitions) to this worker: before the next fold,
        the state takes ownership of their partitions and restores them from the checkpoint
        store (:meth:`take_partitions`)."""
        parts = self.consumer.partitions_for_topic(self.topics.completions) if self.consumer is not None else None
        if parts:
            self.processor.partition_count = len(parts)
        # taken in the fold thread; a partition count the metadata does not hold yet is asked then
        self._assign = ({(tp.topic, tp.partition) for tp in assigned}, len(parts) if parts else None)

    def take_partitions(self) -> bool:
        """In the fold thread (before each fetch and each fold): make the state own the
        partitions of the last assignment (:meth:`assigned`) and restore them from the
        checkpoint store, held until caught up (:meth:`ingest.processor.Processor.assign`;
        :meth:`report_catchup`), then finish or release the
        claims a dead or previous owner left there (:meth:`ingest.join.Joiner.recover`). A
        takeover that waited too long for the previous owner is retried before the next fetch;
        the batches of those partitions are refused meanwhile. Returns whether nothing is left
        to take."""
        a = self._assign
        if a is None:
            return True
        tps, n = a
        if n is None:  # the client's metadata lacked the topic at the assignment: ask the cluster
            try:
                n = self.ensure_rekeyed()
            except Exception as exc:  # noqa: BLE001 - the broker is restarting: retried before the next fetch
                log.warning("ingest: partition count of %s unknown (%s); retrying", self.topics.completions, exc)
                return False
            if n is None:
                log.warning("ingest: %s does not exist; retrying", self.topics.completions)
                return False
            self.processor.partition_count = n
        try:
            epochs = self.processor.assign(tps, n)
        except Fenced as exc:
            log.warning("ingest: %s; retrying", exc)
            return False
        if self._assign is a:  # (a newer assignment that arrived meanwhile stays pending)
            self._assign = None
        log.info("ingest owns partitions %s", json.dumps(epochs, sort_keys=True))
        log.info("ingest restored %d open labels, %d dedupe and %d sealed rows (read: their partitions' only)",
                 *self.store.restored)
        # the claims a dead or previous owner left in these partitions
        rec = self.joiner.recover(lambda p: Path(p).exists(), previous_owners=True)
        if rec["sealed"] or rec["released"]:
            log.info("ingest recover: %s", rec)
        return True

    async def report_catchup(self) -> list[int]:
        """Hand the processor the read progress of the partitions it holds until caught up
        (:meth:`ingest.processor.Processor.caught_up`): per assigned TopicPartition, the high
        watermark of the last Fetch response under this assignment (the end offset; the first
        one becomes the target) and the consumer's position. Nothing while an assignment is
        not taken yet. Returns the partitions released."""
        waiting = set(self.processor.catching_up())
        if not waiting or self._assign is not None or self.consumer is None:
            return []
        progress = {}
        for tp in list(self.consumer.assignment()):
            if tp.partition not in waiting:
                continue
            try:
                end = self.consumer.highwater(tp)  # (None: not fetched yet under this assignment)
                pos = None if end is None else await asyncio.wait_for(self.consumer.position(tp), POSITION_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - revoked or resetting meanwhile: next poll
                continue
            progress[tp] = (pos, end)
        if not progress:
            return []
        return await asyncio.get_running_loop().run_in_executor(self._fold_pool, self.processor.caught_up, progress)

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
        from schemas import topic_admin as topics_mod

        admin = topics_mod.admin_client(self.cfg.bootstrap, timeout_s=10.0)
        try:
            have = topics_mod.describe(admin, [self.topics.completions, self.rekeyed])
            if self.topics.completions not in have:
                return None
            n = have[self.topics.completions]["partitions"]
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
                          have[self.rekeyed]["partitions"], self.topics.completions, n)
            return n
        finally:
            admin.close()

    async def publish_dead(self, dead: list[DeadLetter]) -> None:
        """Publish ``dead`` to the dead-letter topic, then write them as one dead-letter file;
        both are done before this returns, so the caller marks the events dead-lettered (or
        commits past them) only once the topic and the file hold them. A crash between the
        two writes and the mark dead-letters them again (at-least-once, never lost).

        Raises whatever the send or the file write raised (the caller retries)."""
        await self.publish(self.topics.deadletter, [((d.key or "").encode(), d.to_bytes()) for d in dead])
        await asyncio.get_running_loop().run_in_executor(None, writer.write_deadletters, dead, self.dead_dir)
        self.processor.dead_letters_written(dead)

    async def consume(self, stop: asyncio.Event) -> None:
        """The consumer loop until ``stop`` is set (finishes the batch in hand first)."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            if self._assign is not None and not await loop.run_in_executor(self._fold_pool, self.take_partitions):
                await asyncio.sleep(1.0)
            await self.report_catchup()
            batch = await self.consumer.getmany(timeout_ms=POLL_TIMEOUT_MS, max_records=BATCH_MAX_RECORDS)
            member = membership(self.consumer)  # the assignment these records were fetched under
            batch = {tp: recs for tp, recs in batch.items() if recs}
            if member is None and self._member_ok:  # a heartbeat found this member unknown: rejoining
                held = await loop.run_in_executor(self._fold_pool, self.processor.hold_all)  # (none once revoked)
                log.warning("ingest: no longer a member of the group (rejoining); no batch is folded and no label "
                            "sealed until the next assignment has caught up%s",
                            f" (partitions {json.dumps(held)} held)" if held else "")
            self._member_ok = member is not None
            if member is None and batch:
                # fetched from positions the group no longer vouches for (after a memory-only broker
                # restarted they can lie past records not read): the next assignment reads them again
                log.debug("ingest: %d records fetched outside the group not folded",
                          sum(len(r) for r in batch.values()))
                batch = {}
            if not batch:
                if time.monotonic() - self._ckpt_at >= self.checkpoint_s:
                    await self.checkpoint_and_commit()
                else:
                    await self.commit_pending()  # (one the coordinator did not take yet)
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
                with self.store.transaction():  # (each in the partition it was folded in: KeyedState.event_homes)
                    self.joiner.store.mark_dead(eids)
                    for k, v in malformed.items():
                        self.store.bump(k, v)
            if member != self._pending_member:
                self._pending, self._ready = {}, {}
            self._pending_member = member
            self._pending.update({tp: recs[-1].offset + 1 for tp, recs in batch.items()})
            if time.monotonic() - self._ckpt_at >= self.checkpoint_s:
                await self.checkpoint_and_commit()
        await self.checkpoint_and_commit()  # stopping: the offsets of what was folded

    def checkpoint(self, offsets: dict | None = None) -> bool:
        """Write the state's changes and ``offsets`` in one transaction of the checkpoint store
        (:meth:`ingest.keyed.KeyedState.checkpoint`). Returns False when a partition was taken
        over (nothing written: its new owner replays those records from the committed offsets)."""
        try:
            self.store.checkpoint(offsets)
        except Fenced as exc:
            log.warning("ingest: checkpoint not written: %s", exc)
            return False
        finally:
            self._ckpt_at = time.monotonic()
        self.metrics.checkpoints.inc()
        return True

    async def checkpoint_and_commit(self) -> None:
        """Checkpoint (in the fold thread, between two folds), then commit to Kafka the offsets
        it holds: a committed offset never covers a record whose effect is not durable."""
        offsets = dict(self._pending)
        ok = await asyncio.get_running_loop().run_in_executor(self._fold_pool, self.checkpoint, offsets)
        if not ok:  # a partition was taken over: its new owner consumes from the committed offsets
            self._pending, self._ready = {}, {}
            return
        for tp, o in offsets.items():
            if self._pending.get(tp) == o:  # (a batch folded meanwhile stays pending)
                del self._pending[tp]
        self._ready.update(offsets)
        await self.commit_pending()

    async def revoked(self) -> None:
        """Kafka is revoking this worker's partitions: once the seal iteration in progress is
        done, checkpoint, commit the offsets it holds and drop the state (the next owner
        restores it from the checkpoint store)."""
        async with self._seal_lock:
            await self.checkpoint_and_commit()
            await asyncio.get_running_loop().run_in_executor(self._fold_pool, self.processor.revoke)
            self._pending = {}  # (records folded after the checkpoint: consumed again by the next owner)

    async def commit_pending(self) -> None:
        """Commit the offsets a checkpoint holds and Kafka does not yet (:mod:`ingest.commit`:
        only as the member the batches were fetched as). A commit the coordinator may take
        later (it is moving) is kept and sent again after the next poll; one it refused for
        the membership is dropped: the next assignment consumes those records again from the
        committed offsets, and the join state dedupes them."""
        if not self._ready:
            return
        try:
            await commit_offsets(self.consumer, self._ready, self._pending_member)
        except CommitRefused as exc:
            if exc.retriable and self._pending_member == membership(self.consumer):
                log.debug("ingest: offset commit not taken yet (%s); sent again after the next poll", exc)
                return
            log.info("ingest: offsets of %d partitions not committed (%s); those records are consumed again "
                     "and deduped", len(self._ready), exc)
        self._ready = {}

    async def seal_loop(self, stop: asyncio.Event) -> None:
        """Every ``tick_s``: seal due labels in the seal thread; publish what it produced."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.tick_s)
            except asyncio.TimeoutError:
                pass
            if self.scoped and time.monotonic() - self._rekeyed_at > REKEYED_CHECK_S:
                self._rekeyed_at = time.monotonic()
                try:
                    if self.rekeyed not in await self.consumer.topics():
                        await loop.run_in_executor(None, self.ensure_rekeyed)
                except Exception as exc:  # noqa: BLE001 - the broker is restarting: next time
                    log.info("ingest: checking %s failed: %s", self.rekeyed, exc)
            wrote, more = 0, True
            while more and not stop.is_set():
                async with self._seal_lock:
                    msgs, orphans, more = await loop.run_in_executor(self._pool, self.seal_round)
                    wrote += len(msgs)
                    await self.publish(self.topics.samples, msgs)
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

        self._seal_lock = asyncio.Lock()
        # under Kafka the state holds the assigned partitions only: none until the first assignment
        await loop.run_in_executor(self._fold_pool, self.processor.revoke)

        class _Listener(ConsumerRebalanceListener):
            async def on_partitions_revoked(self, revoked):
                await worker.revoked()

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
            self.consumer.subscribe([self.topics.completions, self.topics.feedback] + ([self.rekeyed] if self.scoped else []),
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
