"""The ingest processor: the fold, the sealing punctuator and the shard sink, with no Kafka.

:class:`Processor` is what the stream runtime (:class:`ingest.worker.Worker`: group
membership, offset commits, fencing, the internal topic of forwarded records, retries,
checkpoint cadence, the fold and seal threads) holds and calls, as a Kafka Streams
StreamThread runs its processors. It holds the join state of the worker's partitions in
memory (:class:`ingest.keyed.KeyedState`, checkpointed to the state store) and owns no thread,
consumer or producer, so it is testable alone: hand :meth:`Processor.fold` a batch as
``getmany`` returns it (``{TopicPartition: [ConsumerRecord]}``, any objects with
``topic``/``partition`` and ``key``/``value``/``offset``/``headers``) and call
:meth:`Processor.seal_round`; ``tests/test_ingest_poison.py`` does (through the worker's
delegating methods), ``tests/test_ingest_restore_partition.py`` directly.

* :meth:`Processor.fold`: validate each record (malformed -> dead letter with field and
  reason; of a completion only the head the join needs, ``ingest.join.parse_completion``: its
  body is validated once, when it is sealed) and fold the batch into the in-memory state in
  one unit (``Joiner.on_completions`` / ``on_feedbacks``); a record the state refuses is
  found by folding the batch record by record, and dead-lettered alone.
* :meth:`Processor.seal_round` (the punctuator, every ``tick_s``): claim due labels in
  memory ``SEAL_CHUNK`` at a time, validate their completions and build their
  RewardedSamples as Arrow columns chunk by chunk, **checkpoint the claims**, write one
  Parquet shard per (model_version, day) (temp + fsync + rename), then mark the labels sealed
  in memory (the next checkpoint writes that). The order makes a crash between a shard and
  its checkpoint harmless (``docs/decisions.md`` D81): the claim names the shard, and
  recovery marks the labels of an existing shard sealed instead of sealing them again.
* :meth:`Processor.housekeeping`: recovery of claims a dead or previous owner left, pruning
  past the dedupe horizon, the catalog views, the state gauges and the stats line.

**Catch-up** (``docs/decisions.md`` D93). :meth:`Processor.assign` restores the assigned
partitions *held* (:meth:`ingest.keyed.KeyedState.assign`): no label of a partition is sealed,
dead-lettered as an orphan or dropped until the worker has read that partition up to the end
offset it had when it was assigned, in each of its topics (:meth:`Processor.caught_up`; the
runtime reports its positions and end offsets, and :meth:`Processor.fold` the offsets it
folded). A restored label may have events the checkpoint does not hold in the part not read
yet: records a killed owner folded after its last checkpoint, or, after a memory-only broker
restarted, the records below the position a consumer fetched from before its rejoin. Sealed
before they are read, those events would be dead-lettered as late. A partition that has not
caught up within ``catchup_timeout_s`` of its assignment is released anyway, with a warning
naming it (a stuck partition must not hold its samples forever).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path

import pyarrow as pa

from schemas.settings import topic_names
from schemas.events import DeadLetter, FeedbackEvent, now_ms

from samplestore import catalog, shards as writer
from ingest.join import Joiner, TickResult, check_clock, dead_letter, parse_completion, parse_event
from ingest.keyed import KeyedState
from ingest.metrics import IngestMetrics
from ingest.partition import SOURCE_HEADER, home_partitions
from ingest.state import open_store
from ingest.store import Fenced

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

SEAL_CHUNK = 256  # labels claimed per unit (bounds the fold's wait for the state's lock)
# what a sealed sample keeps once its chunk is in Arrow: its label fields (commit, metrics, keys)
_LIGHT = {"prompt_token_ids": (), "completion_token_ids": (), "behavior_logprobs": (), "expert_routes": None}
SHARD_ROWS = writer.ROW_GROUP_ROWS  # at most this many samples per seal round (= per shard)
RECOVER_EVERY_S = 5.0  # live workers finish/release dead workers' claims this often (s)
CATALOG_EVERY_S = 60.0  # catalog views re-created at most this often once they see files (s)
PRUNE_EVERY_S = 60.0  # dedupe/sealed rows older than dedupe_retention_s deleted this often (s)
COLLECT_EVERY_S = 10.0  # body segments nobody references any more deleted this often (s)
STATS_EVERY_S = 5.0  # an "ingest stats" line (INFO) at most this often, when counters moved (s)


def _source_topic(record, feedback: str) -> str:
    """The source topic of a record of the internal topic (its header; feedback if absent).
    A header that is not UTF-8 is read with replacement characters: anything but the
    completions topic is parsed as feedback (a dead letter names that source), so a hostile
    header never stops the worker (it raised UnicodeDecodeError at every restart)."""
    for k, v in record.headers or ():
        if k == SOURCE_HEADER and v:
            return bytes(v).decode("utf-8", errors="replace")
    return feedback


class Processor:
    """The fold, the sealing punctuator and the shard sink of one worker (see the module
    docstring), over the in-memory join state of its partitions.

    Args:
        cfg: ``ingest.app.IngestConfig`` (``state_path``: the checkpoint store, a SQLite file
            or a ``postgresql://`` URL; ``samples_dir``, ``catalog``, ``join``, ``samples_value``).

    Attributes:
        store: the :class:`ingest.keyed.KeyedState` (an ``ingest.store.JoinStore``).
        joiner: the :class:`ingest.join.Joiner` over it.
        metrics: the :class:`ingest.metrics.IngestMetrics` it updates.
        partition_count: partitions of the consumed topics, set by the runtime from the
            assignment; None (no Kafka): every record is folded where it was consumed.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.topics = topic_names(app_id=cfg.app_id)  # this process's topic names, resolved once
        # the join state of this worker's partitions in memory, checkpointed to the store
        # (SQLite file or PostgreSQL) with the consumed offsets (ingest.keyed)
        self.store = KeyedState(open_store(cfg.state_path, cfg.group_id))
        # the state is scoped to partitions: a label is folded only in its home partition, and
        # records found elsewhere are forwarded there through the internal topic (ingest.partition)
        self.scoped = True
        self.rekeyed = self.topics.rekeyed
        self.partition_count: int | None = None  # partitions of the consumed topics (from the assignment)
        self.joiner = Joiner(self.store, cfg.join, decode=completion_decoder(), topics=self.topics)
        self.metrics = IngestMetrics(self.topics)  # Prometheus: GET /metrics on worker_port
        self.dead_dir = catalog.deadletters_dir(cfg.samples_dir)
        # a dead-letter file was written since the last housekeeping (for the catalog refresh)
        self._wrote_dead = False
        self._t = {"recover": time.monotonic(), "prune": 0.0, "stats": 0.0, "cat_at": 0.0, "collect": 0.0}
        self._cat = {"samples": False, "dead": False}
        self._last_stats: dict | None = None
        # partitions held until caught up: partition -> {"tps": {(topic, partition): [end, position]},
        # "deadline": monotonic s}; the fold thread and the seal thread (timeouts) share it
        self._catch: dict[int, dict] = {}
        self._catch_lock = threading.Lock()

    # -- assignment and catch-up -----------------------------------------------------------
    def assign(self, tps, n: int) -> dict[int, int]:
        """Take ownership of the partitions of ``tps`` (the assigned TopicPartitions, or
        ``(topic, partition)`` pairs, of every consumed topic) among ``n`` and restore their
        state (:meth:`ingest.keyed.KeyedState.assign`), each held until caught up: every one of
        its ``tps`` read up to the end offset it had when assigned (:meth:`caught_up`), or
        ``catchup_timeout_s`` passed. Returns ``{partition: epoch}``.

        Raises:
            ingest.store.Fenced: a takeover waited too long for the previous owner (call again).
        """
        keys = {(tp[0], int(tp[1])) for tp in tps}
        epochs = self.store.assign({p for _, p in keys}, n, hold=True)
        deadline = time.monotonic() + self.cfg.catchup_timeout_s
        with self._catch_lock:
            self._catch = {p: {"tps": {k: [None, None] for k in keys if k[1] == p}, "deadline": deadline}
                           for p in epochs}
            self.metrics.partitions_caught_up(dict.fromkeys(epochs, False))
        return epochs

    def revoke(self) -> None:
        """Drop the state of every partition (:meth:`ingest.keyed.KeyedState.revoke`) and their
        catch-up."""
        self.store.revoke()
        with self._catch_lock:
            self._catch = {}
            self.metrics.partitions_caught_up({})

    def hold_all(self) -> list[int]:
        """Hold every partition of the state until the next :meth:`assign` (whose catch-up
        releases them) or :meth:`revoke`: the runtime calls it when its group membership is
        lost, as its positions may then lie past records it has not read (a restarted
        memory-only broker). Returns the partitions held, ascending."""
        parts = self.store.owned()
        self.store.hold(parts)
        with self._catch_lock:
            self._catch = {}  # (released only by the next assignment's catch-up)
            self.metrics.partitions_caught_up(dict.fromkeys(parts, False))
        return parts

    def catching_up(self) -> list[int]:
        """The partitions held until caught up, ascending."""
        with self._catch_lock:
            return sorted(self._catch)

    def caught_up(self, progress: dict) -> list[int]:
        """Record the read progress of assigned TopicPartitions and release the partitions that
        have caught up (those past ``catchup_timeout_s`` are :meth:`expire_catchup`'s).

        Args:
            progress: ``{TopicPartition or (topic, partition): (position, end)}``: ``position``
                the next offset this worker reads (records below it are folded), ``end`` the
                partition's end offset (the next offset to be written) read since the
                assignment; either None when not known yet. A TopicPartition's first known
                ``end`` is its catch-up target; later ones are ignored (a busy partition must
                not move its target away).

        A partition is caught up once each of its TopicPartitions has a target and a position
        at or past it (one with nothing to read is caught up at its first figures). Returns
        the partitions released by this call, ascending."""
        with self._catch_lock:
            if not self._catch:
                return []
            for tp, (pos, end) in progress.items():
                w = self._catch.get(int(tp[1]))
                st = w["tps"].get((tp[0], int(tp[1]))) if w else None
                if st is None:
                    continue
                if st[0] is None and end is not None:
                    st[0] = int(end)
                if pos is not None:
                    st[1] = max(int(pos), st[1] if st[1] is not None else -1)
            done = [p for p, w in self._catch.items()
                    if all(e is not None and pos is not None and pos >= e for e, pos in w["tps"].values())]
            if done:  # {partition: {topic:partition: the end offset read to}}
                read_to = {p: {f"{t}:{q}": e for (t, q), (e, _) in sorted(self._catch[p]["tps"].items())}
                           for p in sorted(done)}
                log.info("ingest caught up on partitions %s", json.dumps(read_to))
            return self._release(done, now=None)

    def _release(self, done: list[int], now: float | None) -> list[int]:
        """Release ``done`` and, with ``now``, every partition past its deadline (warning);
        under ``_catch_lock``. Returns the released partitions, ascending."""
        late = [p for p, w in self._catch.items() if p not in done and now is not None and now >= w["deadline"]]
        for p in late:
            behind = {f"{t}:{q}": {"end": e, "position": pos}
                      for (t, q), (e, pos) in sorted(self._catch[p]["tps"].items())}
            log.warning("ingest: partition %d not caught up within catchup_timeout_s=%g s (%s); its labels are "
                        "sealed anyway: events of the part not read yet may be dead-lettered as late", p,
                        self.cfg.catchup_timeout_s, json.dumps(behind, sort_keys=True))
        out = sorted(set(done) | set(late))
        if out:
            for p in out:
                del self._catch[p]
            self.store.release(out)
            self.metrics.partitions_caught_up(dict.fromkeys(out, True), update=True)
        return out

    def expire_catchup(self, now: float | None = None) -> list[int]:
        """Release the partitions held longer than ``catchup_timeout_s`` (``now``: monotonic
        seconds, default now), each named in a warning; :meth:`seal_round` calls it. Returns
        them, ascending."""
        with self._catch_lock:
            if not self._catch:
                return []
            return self._release([], time.monotonic() if now is None else now)

    # -- the fold --------------------------------------------------------------------------
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
        comps, fbs, dead = [], [], []
        malformed = {"deadletter_malformed_completion": 0, "deadletter_malformed_feedback": 0,
                     "deadletter_future": 0}
        n = {"consumed_completions": 0, "consumed_feedback": 0, "forwarded_completions": 0, "forwarded_feedback": 0}
        now = now_ms()
        tc = self.joiner.tc
        for tp, recs in batch.items():
            for r in recs:
                src = _source_topic(r, self.topics.feedback) if tp.topic == self.rekeyed else tp.topic
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
        homes: dict[str, int] = {}
        fbs = self._route(fbs, self.joiner.tf, forward, n, homes)
        # a vote dead-lettered in this batch is recorded in its partition (D88)
        self.store.event_homes(homes)
        parts = {tp.partition for tp in batch}
        try:
            outc, outs = self._fold_tx(comps, fbs, now, parts, n)
        except RECORD_ERRORS as exc:  # a value the state refuses: find it, fold the others
            log.warning("ingest: a batch of %d records could not be folded (%s: %s); folding them one by one",
                        len(comps) + len(fbs), type(exc).__name__, exc)
            outc, outs = self._fold_each(comps, fbs, now, parts, n, dead)
        self.metrics.folded(batch, outc, outs)
        if self._catch:  # (read without the lock: a stale empty dict only delays a release to the next call)
            self.caught_up({tp: (recs[-1].offset + 1, None) for tp, recs in batch.items() if recs})
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

    def _route(self, items: list, src: str, forward: list, n: dict[str, int],
               event_homes: dict[str, int] | None = None) -> list:
        """``(event, raw)`` of the ``(event, raw, TopicPartition)`` items to fold here; those
        outside their home partition (partition-scoped store only) are appended to ``forward``
        as ``(home, key, raw, src)`` and counted in ``forwarded_*``. ``event_homes`` (feedback)
        receives ``{event_id: partition}`` of the items folded here, when the partition count
        is known."""
        if not (self.scoped and self.partition_count) or not items:
            return [(ev, raw) for ev, raw, _ in items]
        homes = home_partitions([str(ev.completion_id) for ev, _, _ in items], self.partition_count)
        here = []
        for (ev, raw, tp), h in zip(items, homes):
            if h == tp.partition:  # (a forwarded record is home: it was sent to partition h)
                here.append((ev, raw))
                if event_homes is not None:
                    event_homes[str(ev.event_id)] = h
            else:
                forward.append((h, str(ev.completion_id).encode(), raw, src))
                n["forwarded_completions" if src == self.joiner.tc else "forwarded_feedback"] += 1
        return here

    # -- the sealing punctuator and the shard sink (seal thread) ---------------------------
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
        self.expire_catchup()
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
        if shards:
            # the claims (label -> shard path) are durable before any shard exists, so a
            # worker killed between a shard's rename and the checkpoint that marks its labels
            # sealed is repaired by recovery (the shard exists: sealed, not sealed again)
            try:
                self.store.checkpoint()
            except Fenced as exc:  # this worker lost a partition: its new owner seals these labels
                log.warning("ingest: %d shard(s) not written: %s", len(shards), exc)
                self.joiner.release([str(x.completion_id) for chunks in shards.values() for c in chunks for x in c[0]])
                return [], orphans, False
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

    def dead_letters_written(self, dead: list[DeadLetter]) -> None:
        """The runtime published ``dead`` and wrote their dead-letter file: counted, and the
        catalog's dead-letter view refreshed at the next :meth:`housekeeping`."""
        self._wrote_dead = True
        self.metrics.dead_letters(dead)

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
            rec = self.joiner.recover(lambda p: Path(p).exists(), previous_owners=True)
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
