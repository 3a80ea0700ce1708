"""The join store: the one interface of the join's durable state, and the logic its two
implementations share.

:class:`JoinStore` is every method :class:`ingest.join.Joiner`, ``ingest.worker`` and
``ingest.metrics`` call on the state, documented once here. The worker's join state is
:class:`ingest.keyed.KeyedState` (its partitions in memory), which checkpoints itself into a
**checkpoint store** (:class:`CheckpointStore`: a JoinStore, whose methods write one
checkpoint inside one transaction, plus taking partitions over, fencing and restoring;
``docs/decisions.md`` D81). Two checkpoint stores implement it:
:class:`ingest.state.StateStore` (SQLite, one file shared by the workers of one host, the
default) and :class:`ingest.state_pg.PgStateStore` (PostgreSQL, labels scoped to Kafka
partitions, workers on several hosts; ``docs/decisions.md`` D16). ``tests/
test_join_store_contract.py`` checks each method's contract on both.

Vocabulary (every method below uses it):

* A **label** is the open state of one ``completion_id``: a :class:`ingest.label.LabelState`
  (its JSON) with ``due_at`` (ms: when :meth:`JoinStore.due` hands it to the seal timer) and,
  apart, the completion's body (the CompletionEvent JSON as consumed, ~18 KiB). A body is
  stored once: the first one put wins, later puts keep it.
* A **claim** marks a label being decided by one worker (its **owner**, one id per store
  instance, i.e. per worker process): ``"shard:<path>"`` while its sample is written to that
  shard, ``"dead:"`` while an orphan's dead letters are published, ``"bad:"`` while a
  malformed completion's are. A claimed label is hidden from :meth:`JoinStore.due` until it
  is deleted (sealed, dead-lettered) or unclaimed (retried). Recovery
  (:meth:`ingest.join.Joiner.recover`) finishes or releases only the claims whose owner is
  dead (:meth:`JoinStore.owner_alive`), never a live worker's.
* The **dedupe set** holds every feedback ``event_id`` folded (with its ``completion_id``) or
  dead-lettered (``completion_id`` NULL), with ``at`` (ms, when recorded); the **sealed set**
  every ``completion_id`` already decided, with ``sealed_at`` (ms) and its shard path (``""``
  for a malformed completion). Both are pruned past ``JoinConfig.dedupe_retention_s``.
* A row's **partition** (``part``) is the home partition of its ``completion_id``
  (``ingest.partition``) among the partition count of the last :meth:`JoinStore.assign` (NULL
  before one); a dead-lettered event's is the partition it was folded in when the caller
  gives it (:meth:`JoinStore.mark_dead`), else NULL. A restore
  (:meth:`CheckpointStore.snapshot`) reads by it (``docs/decisions.md`` D88).
* **Counters** are named integers (``samples``, ``feedback_folded``, ...) added up by
  :meth:`JoinStore.bump`, durable with the transaction that bumped them.

Transactions: every method that writes must run inside :meth:`JoinStore.transaction`
(re-entrant and thread-safe: the outermost one commits, or rolls back on an exception, and
holds the store's lock for its whole body, so the consumer thread and the seal thread never
interleave inside one). Reads may run outside one. Times are ms since the epoch (UTC).
"""

from __future__ import annotations

import abc
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from typing import TYPE_CHECKING, ContextManager, Iterable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ingest.label import LabelState


class Fenced(RuntimeError):
    """This worker no longer owns a partition it is writing (another worker took it over)."""


def now_ms() -> int:
    """The wall clock in ms since the epoch (the default ``at`` of the dedupe rows)."""
    return int(time.time() * 1000)


def default_owner() -> str:
    """A new claim-owner id: ``<host>-<pid>-<8 hex>`` (unique per store instance)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@runtime_checkable
class JoinStore(Protocol):
    """The join's durable state (see the module docstring for labels, claims, owners, the
    dedupe and sealed sets, counters and transactions).

    Attributes:
        owner: this store's claim-owner id.
        path: what the state is (a file path, ``":memory:"`` or a database URL), for messages.
        scoped: True when labels belong to Kafka partitions (PostgreSQL): the worker folds a
            record only in its label's home partition (``ingest.partition``) and the store
            refuses (:class:`ingest.state_pg.Fenced`) a label of a partition it does not own.
            False for one state shared by every worker (SQLite): partitions are recorded only.
    """

    owner: str
    path: str
    scoped: bool

    # -- life and transactions ---------------------------------------------------------
    def transaction(self) -> ContextManager[None]:
        """One atomic unit (see the module docstring). Counter bumps inside it are written at
        its commit and undone with it."""

    def flush(self) -> None:
        """Make every committed unit durable now (the SQLite store's open group commit,
        ``begin_batch``); nothing to do where each transaction commits on its own."""

    def close(self) -> None:
        """Flush, close the connection and give up this owner (its lock is released, so
        peers see it dead and recover its claims)."""

    # -- partitions --------------------------------------------------------------------
    def assign(self, parts: Iterable[int], n: int) -> dict[int, int]:
        """Kafka assigned partitions ``parts`` of ``n`` to this worker. A scoped store takes
        ownership of each (a partition taken over from another owner gets the next epoch;
        one this store held keeps its epoch) and from then on :meth:`due` and :meth:`claims`
        see those partitions only. Returns ``{part: epoch}`` (epoch 0: not scoped).

        Raises:
            ingest.state_pg.Fenced: a previous owner's fold held a partition too long: call
                again (nothing of this assignment is owned meanwhile).
            ValueError: ``n`` < 1 (scoped store).
        """

    def revoke(self) -> None:
        """Kafka revoked the assignment: a scoped store seals and recovers nothing until the
        next :meth:`assign`."""

    def owned(self) -> list[int]:
        """The partitions of the last :meth:`assign`, ascending (empty after :meth:`revoke`)."""

    def fence(self, parts: Iterable[int]) -> None:
        """Inside a transaction, before folding records of ``parts``: check that this store
        still owns them (a scoped store locks their ownership rows until the transaction
        ends, so a takeover waits for the fold). No-op for a store that is not scoped.

        Raises:
            ingest.state_pg.Fenced: a partition not assigned to this store, or taken over.
        """

    # -- owners ------------------------------------------------------------------------
    def owner_alive(self, owner: str | None) -> bool:
        """Whether worker ``owner`` still runs (it is this store, or its process holds its
        lock). None or an unknown owner counts as dead."""

    def dead_owners(self) -> list[str]:
        """Registered owners whose worker is gone (killed), claims or not."""

    def forget_owner(self, owner: str) -> None:
        """Unregister dead ``owner`` once its claims are finished or released (never this
        store's own owner)."""

    def collect_segments(self) -> int:
        """Delete out-of-line completion bodies no label references and no live worker can
        reference again; returns how many files were deleted (0 where bodies are rows)."""

    def size_bytes(self) -> int:
        """Bytes the state takes on disk (file, WAL and body segments; or the tables), 0 for
        an in-memory state."""

    # -- labels ------------------------------------------------------------------------
    def get(self, cid: str) -> LabelState | None:
        """The label of ``cid`` with its ``claim`` and its completion body (bytes; None while
        only feedback arrived), or None when there is none. A scoped store locks the row
        until the transaction ends."""

    def get_many(self, cids: Iterable[str]) -> dict[str, LabelState]:
        """The labels of ``cids`` (absent ones left out; duplicates allowed), each with its
        ``claim``; the body is not read: ``completion`` is ``""`` when one is stored, None
        when not. Putting such a state back keeps the stored body."""

    def put(self, st: LabelState, due_at: int) -> None:
        """:meth:`put_many` of one label."""

    def put_many(self, items: list[tuple[LabelState, int]]) -> None:
        """Upsert ``(label, due_at ms)`` pairs (the label's JSON and ``due_at`` replace the
        stored ones; its claim is kept). A body (``completion`` bytes or str) is stored only
        if the label has none yet (first wins); ``""`` or None stores nothing.

        Raises:
            ingest.state_pg.Fenced: (scoped store) a label whose home partition this store
                does not own.
        """

    def delete(self, cid: str) -> None:
        """:meth:`delete_many` of one label."""

    def delete_many(self, cids: list[str]) -> None:
        """Remove the labels of ``cids`` with their bodies (absent ones ignored)."""

    def due(self, now: int, limit: int) -> list[LabelState]:
        """At most ``limit`` unclaimed labels with ``due_at <= now`` (ms), earliest first,
        with their bodies (bytes, or None). A scoped store returns labels of owned
        partitions only, locked (skipping rows another worker locked) until the
        transaction ends: claim them in the same transaction."""

    def claim(self, cid: str, claim: str) -> None:
        """:meth:`claim_many` of one label."""

    def claim_many(self, claims: list[tuple[str, str]]) -> None:
        """Claim each ``(completion_id, claim)`` for this owner (``claim``: ``"shard:<path>"``,
        ``"dead:"`` or ``"bad:"``); an absent label is ignored."""

    def unclaim(self, cid: str) -> None:
        """Release the claim on ``cid`` (and its owner): the label is due again."""

    def claims(self) -> list[tuple[str, str, str | None]]:
        """Every open claim as ``(completion_id, claim, owner)``; a scoped store: those in
        owned partitions, rows locked until the transaction ends."""

    def open_count(self) -> int:
        """Labels open in the whole state (every partition)."""

    # -- dedupe and sealed sets ---------------------------------------------------------
    def event_seen(self, eid: str) -> bool:
        """Whether ``eid`` is in the dedupe set."""

    def events_seen(self, eids: Iterable[str]) -> set[str]:
        """Those of ``eids`` in the dedupe set (folded or dead-lettered)."""

    def add_event(self, eid: str, cid: str, at: int | None = None) -> None:
        """:meth:`add_events` of one event at ``at`` ms (default now)."""

    def add_events(self, rows: list[tuple[str, str, int]]) -> None:
        """Record ``(event_id, completion_id, at ms)`` as folded; an event already recorded
        keeps its first row."""

    def mark_dead(self, eids: list[str], at: int | None = None, parts: list[int | None] | None = None) -> None:
        """Record ``eids`` as dead-lettered at ``at`` ms (default now), with no completion; an
        event already recorded keeps its first row. ``parts``: each event's partition (the
        one it was consumed from and folded in, which is its completion's home partition;
        None: unknown, the row is then restored with every partition), one per event.

        Raises:
            ValueError: ``parts`` not of the length of ``eids``.
        """

    def is_sealed(self, cid: str) -> bool:
        """Whether ``cid`` is in the sealed set."""

    def sealed_among(self, cids: Iterable[str]) -> set[str]:
        """Those of ``cids`` in the sealed set."""

    def mark_sealed(self, cid: str, sealed_at: int, shard: str) -> None:
        """:meth:`mark_sealed_many` of one label."""

    def mark_sealed_many(self, rows: list[tuple[str, int, str]]) -> None:
        """Record ``(completion_id, sealed_at ms, shard path)`` as sealed (a second record of
        a completion replaces the first)."""

    def prune(self, before_ms: int) -> tuple[int, int]:
        """Delete sealed rows with ``sealed_at < before_ms``, and dedupe rows with ``at <
        before_ms`` whose label is neither open nor sealed at or after ``before_ms`` (an event
        is remembered at least as long as its label); rows without ``at`` (an earlier
        layout) are kept. Returns ``(events_deleted, sealed_deleted)``; a scoped store lets one
        worker prune at a time (the others get ``(0, 0)``)."""

    def dedupe_sizes(self) -> tuple[int, int]:
        """``(rows in the dedupe set, rows in the sealed set)``."""

    # -- counters ------------------------------------------------------------------------
    def bump(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name``: inside a transaction at its commit (undone with it),
        outside one at once. ``n == 0`` does nothing."""

    def counters(self) -> dict[str, int]:
        """Every counter: the committed values summed over all workers, plus this store's
        uncommitted bumps."""


@runtime_checkable
class CheckpointStore(JoinStore, Protocol):
    """A :class:`JoinStore` that checkpoints a worker's in-memory join state
    (:class:`ingest.keyed.KeyedState`, ``docs/decisions.md`` D81): the JoinStore methods write
    one checkpoint inside one :meth:`JoinStore.transaction`, and these take partitions over,
    fence a checkpoint and restore a partition's state.

    Partition ownership here is by epoch in both stores (the SQLite file shared by a host's
    workers too), so a worker that lost a partition can no longer checkpoint into it.
    """

    def take_ownership(self, parts: Iterable[int], n: int) -> dict[int, int]:
        """Own partitions ``parts`` of ``n`` for checkpoints: one taken over from another
        owner gets the next epoch, one this store held keeps its own. Also gives every row
        whose ``part`` is NULL its home partition among ``n`` (rows of an earlier layout, or
        written before the count was known), or recomputes every row's when the rows were
        partitioned among another count (table ``meta``). Returns ``{part: epoch}``.

        Raises:
            Fenced: (PostgreSQL) the previous owner's transaction held a partition too long.
        """

    def fence_ownership(self, parts: Iterable[int]) -> None:
        """Inside a transaction: check that this store still owns ``parts`` at the epochs
        :meth:`take_ownership` gave (no takeover can commit before this transaction ends).

        Raises:
            Fenced: a partition taken over by another owner, or never taken.
        """

    def snapshot(self, parts: list[int] | None, n: int | None):
        """The state of partitions ``parts`` of ``n`` (None: all) as ``(labels, events,
        sealed)``: ``labels`` rows ``(completion_id, state JSON, due_at, claim, owner,
        has_body)``, ``events`` rows ``(event_id, completion_id or None, at)`` and ``sealed``
        rows ``(completion_id, sealed_at)``, each of a label whose home partition
        (``ingest.partition``) is in ``parts``, and the dedupe rows of dead letters recorded in
        those partitions; dead letters recorded without a partition are in every partition's.
        Only those rows are read (by ``part``, indexed), plus the rows whose ``part`` is still
        NULL (filtered here by their ``completion_id``).

        Raises:
            ValueError: ``parts`` given without ``n``.
        """

    def bodies(self, cids: Iterable[str]) -> dict[str, bytes]:
        """The stored completion bodies of ``cids`` (absent ones left out)."""

    def save_offsets(self, offsets: dict[tuple[str, int], int]) -> None:
        """Record ``{(topic, partition): next offset}`` (the records a checkpoint holds the
        effects of), in the open transaction."""

    def saved_offsets(self) -> dict[tuple[str, int], int]:
        """Every recorded ``(topic, partition) -> next offset``."""


def _in_parts(rows: list, parts, n: int | None, key: int) -> list[tuple]:
    """Restored ``rows`` (each ending with its ``part``) of partitions ``parts`` among ``n``,
    the ``part`` dropped: a row read with a NULL ``part`` is kept when the home partition of
    its field ``key`` (a completion_id) is in ``parts``, or when that field is NULL too (a dead
    letter recorded without a partition: restored with every partition). ``parts`` None:
    every row.

    Raises:
        ValueError: ``parts`` given without ``n``.
    """
    if parts is None:
        return [tuple(r[:-1]) for r in rows]
    if n is None:
        raise ValueError("n: the partition count is needed to restore partitions")
    from ingest.partition import home_partitions

    keep = set(parts)
    loose = [r for r in rows if r[-1] is None and r[key] is not None]
    homes = dict(zip((r[key] for r in loose), home_partitions([r[key] for r in loose], n))) if loose else {}
    return [tuple(r[:-1]) for r in rows if r[-1] is not None or r[key] is None or homes[r[key]] in keep]


# (table, key column, completion_id column) of the rows that carry a ``part``
_PARTED = (("labels", "completion_id", "completion_id"), ("events", "event_id", "completion_id"),
           ("sealed", "completion_id", "completion_id"))
PARTITION_COUNT = "partition_count"  # meta row: the count the ``part`` columns were computed with


def _dead_parts(eids: list, parts) -> list:
    """``parts`` of :meth:`JoinStore.mark_dead` checked against ``eids`` (None: all unknown).

    Raises:
        ValueError: not one partition per event.
    """
    if parts is None:
        return [None] * len(eids)
    parts = [None if p is None else int(p) for p in parts]
    if len(parts) != len(eids):
        raise ValueError(f"parts: {len(parts)} partitions for {len(eids)} event ids (one per event, or None)")
    return parts


class StoreBase(abc.ABC):
    """What :class:`ingest.state.StateStore` and :class:`ingest.state_pg.PgStateStore` share:
    the single-item methods (each calls its batch form), the transaction skeleton and the
    counters' in-memory deltas, and the statements that are the same SQL on both.

    A subclass sets ``db`` (a DB-API connection in autocommit mode), ``owner``, ``path``,
    ``scoped`` and calls :meth:`_init_base`; it provides :meth:`_begin`, :meth:`_commit`,
    :meth:`_abort` (the three steps of an outermost transaction), :meth:`_write_counters`
    and :meth:`_stored_counters`. Shared statements are written with ``?`` placeholders;
    ``_PARAM`` is the driver's (``%s`` for psycopg).
    """

    _PARAM = "?"
    _batch = False  # a group commit is open (SQLite's begin_batch)
    scoped = False
    _n: int | None = None  # the partition count of the last assign / take_ownership

    def _init_base(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._pending: dict[str, int] = {}  # counter deltas of the open unit, written at its commit
        self._sql_cache: dict[str, str] = {}

    def _sql(self, q: str) -> str:
        """``q`` with the driver's placeholders."""
        out = self._sql_cache.get(q)
        if out is None:
            out = self._sql_cache[q] = q if self._PARAM == "?" else q.replace("?", self._PARAM)
        return out

    def _exec(self, q: str, params=()):
        """Run one shared statement; returns the cursor."""
        return self.db.execute(self._sql(q), params)

    def _execmany(self, q: str, rows: list) -> None:
        """Run one shared statement for each of ``rows`` (nothing when there are none)."""
        if rows:
            self.db.executemany(self._sql(q), rows)

    # -- transactions --------------------------------------------------------------------
    @contextmanager
    def transaction(self):
        """See :meth:`JoinStore.transaction`."""
        with self._lock:
            outer = self._depth == 0
            if outer:
                self._begin()
                pending = dict(self._pending)
            self._depth += 1
            try:
                yield
            except BaseException:
                self._depth -= 1
                if outer:
                    self._pending = pending
                    self._abort()
                raise
            self._depth -= 1
            if outer:
                try:
                    self._commit()
                except BaseException:
                    self._pending = pending
                    self._abort()
                    raise

    @abc.abstractmethod
    def _begin(self) -> None:
        ...

    @abc.abstractmethod
    def _commit(self) -> None:
        ...

    @abc.abstractmethod
    def _abort(self) -> None:
        ...

    # -- partitions of rows ----------------------------------------------------------------
    def _homes(self, cids: list) -> list[int | None]:
        """The home partition of each of ``cids`` among the last assignment's count (None for
        a None id, and for every id while no count is known)."""
        if self._n is None:
            return [None] * len(cids)
        from ingest.partition import home_partitions

        known = [c for c in cids if c is not None]
        it = iter(home_partitions(known, self._n) if known else ())
        return [None if c is None else next(it) for c in cids]

    def _settle_parts(self, n: int) -> dict[str, int]:
        """Inside a transaction: give every row whose ``part`` is NULL (and that has a
        ``completion_id``) its home partition among ``n``; when the rows were partitioned
        among another count (``meta``), recompute every row's (dead letters' become NULL:
        their completion is not recorded). Records ``n``. Returns rows updated per table."""
        row = self._exec("SELECT value FROM meta WHERE name=?", (PARTITION_COUNT,)).fetchone()
        every = row is not None and int(row[0]) != n
        out = {}
        for table, key, cid in _PARTED:
            cond = [f"{cid} IS NOT NULL"] + ([] if every else ["part IS NULL"])
            rows = self._exec(f"SELECT {key}, {cid} FROM {table} WHERE {' AND '.join(cond)}").fetchall()
            if rows:
                from ingest.partition import home_partitions

                self._set_parts(table, key, [r[0] for r in rows], home_partitions([r[1] for r in rows], n))
            out[table] = len(rows)
        if every:
            self._exec("UPDATE events SET part=NULL WHERE completion_id IS NULL AND part IS NOT NULL")
        self._exec("INSERT INTO meta(name, value) VALUES(?,?) ON CONFLICT(name) DO UPDATE SET value=excluded.value",
                   (PARTITION_COUNT, n))
        return out

    def _set_parts(self, table: str, key: str, keys: list[str], parts: list[int]) -> None:
        """Set ``part`` of the rows of ``table`` whose ``key`` is each of ``keys``."""
        self._execmany(f"UPDATE {table} SET part=? WHERE {key}=?", list(zip(parts, keys)))

    # -- single items: their batch forms -------------------------------------------------
    def put(self, st: LabelState, due_at: int) -> None:
        """See :meth:`JoinStore.put`."""
        self.put_many([(st, due_at)])

    def delete(self, cid: str) -> None:
        """See :meth:`JoinStore.delete`."""
        self.delete_many([cid])

    def claim(self, cid: str, claim: str) -> None:
        """See :meth:`JoinStore.claim`."""
        self.claim_many([(cid, claim)])

    def event_seen(self, eid: str) -> bool:
        """See :meth:`JoinStore.event_seen`."""
        return bool(self.events_seen([eid]))

    def add_event(self, eid: str, cid: str, at: int | None = None) -> None:
        """See :meth:`JoinStore.add_event`."""
        self.add_events([(eid, cid, now_ms() if at is None else at)])

    def is_sealed(self, cid: str) -> bool:
        """See :meth:`JoinStore.is_sealed`."""
        return bool(self.sealed_among([cid]))

    def mark_sealed(self, cid: str, sealed_at: int, shard: str) -> None:
        """See :meth:`JoinStore.mark_sealed`."""
        self.mark_sealed_many([(cid, sealed_at, shard)])

    # -- statements that are the same SQL on both ----------------------------------------
    def claim_many(self, claims: list[tuple[str, str]]) -> None:
        """See :meth:`JoinStore.claim_many`."""
        self._execmany("UPDATE labels SET claim=?, owner=? WHERE completion_id=?",
                       [(claim, self.owner, cid) for cid, claim in claims])

    def unclaim(self, cid: str) -> None:
        """See :meth:`JoinStore.unclaim`."""
        self._exec("UPDATE labels SET claim=NULL, owner=NULL WHERE completion_id=?", (cid,))

    def open_count(self) -> int:
        """See :meth:`JoinStore.open_count`."""
        return self._exec("SELECT count(*) FROM labels").fetchone()[0]

    def add_events(self, rows: list[tuple[str, str, int]]) -> None:
        """See :meth:`JoinStore.add_events`."""
        homes = self._homes([r[1] for r in rows])
        self._execmany("INSERT INTO events(event_id, completion_id, at, part) VALUES(?,?,?,?) ON CONFLICT DO NOTHING",
                       [(e, c, at, h) for (e, c, at), h in zip(rows, homes)])

    def mark_dead(self, eids: list[str], at: int | None = None, parts: list[int | None] | None = None) -> None:
        """See :meth:`JoinStore.mark_dead`."""
        at = now_ms() if at is None else at
        self._execmany("INSERT INTO events(event_id, completion_id, at, part) VALUES(?, NULL, ?, ?) ON CONFLICT "
                       "DO NOTHING", [(e, at, p) for e, p in zip(eids, _dead_parts(eids, parts))])

    def mark_sealed_many(self, rows: list[tuple[str, int, str]]) -> None:
        """See :meth:`JoinStore.mark_sealed_many`."""
        homes = self._homes([r[0] for r in rows])
        self._execmany("INSERT INTO sealed(completion_id, sealed_at, shard, part) VALUES(?,?,?,?) ON CONFLICT"
                       "(completion_id) DO UPDATE SET sealed_at=excluded.sealed_at, shard=excluded.shard, "
                       "part=coalesce(excluded.part, sealed.part)",
                       [(c, at, shard, h) for (c, at, shard), h in zip(rows, homes)])

    def _may_prune(self) -> bool:
        """Whether this store prunes now (PostgreSQL: one worker at a time)."""
        return True

    def prune(self, before_ms: int) -> tuple[int, int]:
        """See :meth:`JoinStore.prune`."""
        if not self._may_prune():
            return 0, 0
        ne = self._exec(
            "DELETE FROM events WHERE at < ? AND NOT EXISTS (SELECT 1 FROM labels l WHERE "
            "l.completion_id = events.completion_id) AND NOT EXISTS (SELECT 1 FROM sealed s WHERE "
            "s.completion_id = events.completion_id AND s.sealed_at >= ?)", (before_ms, before_ms)).rowcount
        ns = self._exec("DELETE FROM sealed WHERE sealed_at < ?", (before_ms,)).rowcount
        return ne, ns

    def dedupe_sizes(self) -> tuple[int, int]:
        """See :meth:`JoinStore.dedupe_sizes`."""
        return (self._exec("SELECT count(*) FROM events").fetchone()[0],
                self._exec("SELECT count(*) FROM sealed").fetchone()[0])

    # -- counters ------------------------------------------------------------------------
    def bump(self, name: str, n: int = 1) -> None:
        """See :meth:`JoinStore.bump`."""
        if not n:
            return
        with self._lock:
            self._pending[name] = self._pending.get(name, 0) + n
            if not (self._depth or self._batch):
                self._write_counters()

    def counters(self) -> dict[str, int]:
        """See :meth:`JoinStore.counters`."""
        with self._lock:
            out = self._stored_counters()
            for k, v in self._pending.items():
                out[k] = out.get(k, 0) + v
        return out

    @abc.abstractmethod
    def _write_counters(self) -> None:
        ...

    @abc.abstractmethod
    def _stored_counters(self) -> dict[str, int]:
        ...
