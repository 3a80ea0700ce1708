"""The join state in PostgreSQL, scoped to Kafka partitions: ingest workers on several hosts.

:class:`PgStateStore` has the interface of :class:`ingest.state.StateStore` (the SQLite
default for one host), so :class:`ingest.join.Joiner` and the worker use either. Why a
shared database and not a compacted changelog topic per partition (the Kafka Streams
model): ``docs/decisions.md`` D16. In short: a changelog lives
in the broker, and the embedded broker is memory-only, so a broker restart would lose the
open labels with the topics, while the database outlives it; and a changelog restore
replays every open completion body (~18 KiB each) on each rebalance, up to an end the
embedded broker misreports, where a database hands the new owner the rows at once.

Scoping. Every label row carries ``part``, its home partition
(``ingest.partition.home_partition(completion_id, n)``); so do the dedupe (``events``) and
sealed rows, so that a restore reads its partitions' rows only (``docs/decisions.md`` D88:
a dead letter's row carries the partition it was folded in when known, else NULL and is
restored with every partition; the column is added to a schema of an earlier layout at
open and filled at the next :meth:`PgStateStore.take_ownership`). A worker folds only
records of the partitions Kafka assigned to it, and the worker forwards any record found outside its home
partition there first (``ingest.worker``), so a label's rows are written by the owner of its
partition only. :meth:`assign` takes ownership of the assigned partitions in the table
``partitions(part, owner, epoch)``: the epoch of a partition taken over from another worker is
incremented. Each fold transaction calls :meth:`fence`, which locks its partitions' rows
(``FOR SHARE``) and raises :class:`Fenced` unless this store still holds them at its epoch.
A worker that lost a partition while it was stopped (GC pause, network) can therefore not
fold into it after the new owner took over: the takeover's ``UPDATE`` waits for any fold in
progress (at most ``takeover_wait_s``; the worker retries), and every later fold of the old
owner is refused. A worker frozen inside a transaction loses its session, and so its locks,
after ``idle_in_transaction_s``. Sealing selects due labels of
owned partitions only, ``FOR UPDATE SKIP LOCKED``, and claims them in the same transaction.

Recovery. A worker holds a session-level advisory lock on its owner id for its whole life;
PostgreSQL drops it when the worker's connection closes, SIGKILL included. So
:meth:`owner_alive` is the same test as the SQLite store's ``flock``: the new owner of a
partition finishes (the shard exists) or releases (it does not) the claims of dead owners
only (:meth:`ingest.join.Joiner.recover`). Open labels, their completion bodies (``bytea``),
the dedupe set and the sealed set are rows, so another host continues from exactly the
state the dead worker committed; the worker commits a batch's offsets only after the
transaction holding its effects, as with SQLite.

Completion bodies are stored out of line without compression (``STORAGE EXTERNAL``): they
are mostly base64 of zstd, which pglz (the default) cannot shrink but spent ~0.1 ms of server
CPU per 18 KiB body on (measured: 1.12 vs 0.41 server CPU-s to fold 2,000 completions and
4,287 votes, 42 MB either way).

Counters are rows per owner (``counters(owner, name, value)``), summed when read, so that
workers never update the same row (a shared counter row would serialise every commit).

Cost (``docs/decisions.md`` D66). Each batch method is one statement whatever its row count:
the rows travel as array parameters expanded by ``unnest``, text and bytea arrays built in
PostgreSQL's binary array format (nothing escaped, no hex). A fold transaction is a fixed
number of round trips: BEGIN travels in one query with the fence's lock, the counters in one
with COMMIT, and :meth:`PgStateStore.put_many` writes labels and bodies in one statement.
Bodies are read back in binary form at sealing.

Tables live in the PostgreSQL schema named after the consumer group (``schema``).
"""

from __future__ import annotations

import hashlib
import re
import socket
import struct
import threading

from schemas import topics

from ingest.label import LabelState
from ingest.partition import home_partitions
from ingest.store import Fenced, StoreBase, _dead_parts, _in_parts, default_owner, now_ms  # noqa: F401 - Fenced: also imported from here


_SCHEMA = """
CREATE TABLE IF NOT EXISTS labels(completion_id TEXT PRIMARY KEY, part INT NOT NULL, state TEXT NOT NULL,
    due_at BIGINT NOT NULL, claim TEXT, owner TEXT);
CREATE INDEX IF NOT EXISTS labels_due ON labels(part, due_at) WHERE claim IS NULL;
CREATE INDEX IF NOT EXISTS labels_claim ON labels(part) WHERE claim IS NOT NULL;
CREATE TABLE IF NOT EXISTS completions(completion_id TEXT PRIMARY KEY, body BYTEA NOT NULL);
ALTER TABLE completions ALTER COLUMN body SET STORAGE EXTERNAL;
CREATE TABLE IF NOT EXISTS events(event_id TEXT PRIMARY KEY, completion_id TEXT, at BIGINT, part INT);
CREATE INDEX IF NOT EXISTS events_at ON events(at);
CREATE TABLE IF NOT EXISTS sealed(completion_id TEXT PRIMARY KEY, sealed_at BIGINT NOT NULL, shard TEXT, part INT);
CREATE INDEX IF NOT EXISTS sealed_at ON sealed(sealed_at);
CREATE TABLE IF NOT EXISTS counters(owner TEXT NOT NULL, name TEXT NOT NULL, value BIGINT NOT NULL,
    PRIMARY KEY(owner, name));
CREATE TABLE IF NOT EXISTS partitions(part INT PRIMARY KEY, owner TEXT, epoch BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS owners(owner TEXT PRIMARY KEY, lock_key BIGINT NOT NULL, host TEXT, started_at BIGINT);
CREATE TABLE IF NOT EXISTS offsets(topic TEXT NOT NULL, part INT NOT NULL, next_offset BIGINT NOT NULL,
    PRIMARY KEY(topic, part));
CREATE TABLE IF NOT EXISTS meta(name TEXT PRIMARY KEY, value BIGINT NOT NULL);
"""
# the partition columns of the dedupe and sealed sets (added to a schema of an earlier layout
# first: D88) and their indexes
_PARTED = ("events", "sealed")
_PART_INDEXES = """
CREATE INDEX IF NOT EXISTS events_part ON events(part);
CREATE INDEX IF NOT EXISTS sealed_part ON sealed(part);
"""
_DDL_LOCK = 0x666C7977  # advisory lock serialising schema creation by workers starting together
_PRUNE_LOCK = 0x666C7978  # advisory lock held by the one worker pruning the dedupe set
TAKEOVER_WAIT_S = 5.0  # longest wait of assign() for the previous owner's fold in progress (s)
IDLE_IN_TRANSACTION_S = 60.0  # a session idle this long inside a transaction is ended by the server (s)


class _TextArray(bytes):
    """A ``text[]`` parameter, already in PostgreSQL's binary array format."""


class _ByteaArray(bytes):
    """A ``bytea[]`` parameter, already in PostgreSQL's binary array format."""


_ARRAY_HEAD = struct.Struct(">iiIii")  # ndim 1, has nulls, element type, length, lower bound 1
_EMPTY_ARRAY = struct.Struct(">iiI")  # ndim 0, no nulls, element type
_LEN = struct.Struct(">i").pack
_NULL = _LEN(-1)
_TEXT_OID, _BYTEA_OID = 25, 17


def _binary_array(items: list[bytes | None], oid: int) -> bytes:
    """``items`` (None: NULL) as a one-dimensional binary array of element type ``oid``."""
    if not items:
        return _EMPTY_ARRAY.pack(0, 0, oid)
    out = [_ARRAY_HEAD.pack(1, None in items, oid, len(items), 1)]
    app = out.append
    for b in items:
        if b is None:
            app(_NULL)
        else:
            app(_LEN(len(b)))
            app(b)
    return b"".join(out)


def _texts(vals) -> _TextArray:
    """A ``text[]`` parameter of ``vals`` (str; None: NULL): bound as is, no escaping."""
    return _TextArray(_binary_array([None if v is None else (v if isinstance(v, str) else str(v)).encode()
                                     for v in vals], _TEXT_OID))


def _byteas(vals: list[bytes]) -> _ByteaArray:
    """A ``bytea[]`` parameter of ``vals``."""
    return _ByteaArray(_binary_array(vals, _BYTEA_OID))


def _ints(vals) -> str:
    """An integer array parameter of ``vals`` in text form (cast it: ``%s::bigint[]``)."""
    return "{" + ",".join(map(str, vals)) + "}"


def _register_arrays(db) -> None:
    """Let connection ``db`` bind :class:`_TextArray` and :class:`_ByteaArray` as binary
    ``text[]`` and ``bytea[]`` parameters."""
    from psycopg import pq
    from psycopg.adapt import Dumper

    class TextArrayDumper(Dumper):
        format = pq.Format.BINARY
        oid = 1009  # text[]

        def dump(self, obj):
            return obj

    class ByteaArrayDumper(TextArrayDumper):
        oid = 1001  # bytea[]

    db.adapters.register_dumper(_TextArray, TextArrayDumper)
    db.adapters.register_dumper(_ByteaArray, ByteaArrayDumper)


def _lock_key(owner: str) -> int:
    return int.from_bytes(hashlib.sha1(owner.encode()).digest()[:8], "big", signed=True)


def schema_name(app_id: str) -> str:
    """The PostgreSQL schema of consumer group ``app_id`` (lower case, ``[a-z0-9_]``)."""
    return "ingest_" + re.sub(r"[^a-z0-9_]", "_", app_id.lower())


class PgStateStore(StoreBase):
    """Join state in PostgreSQL (see the module docstring); a :class:`ingest.store.JoinStore`,
    whose docstrings hold each method's contract.

    Args:
        url: libpq connection URL, ``postgresql://user@host:port/db``.
        schema: the PostgreSQL schema holding the tables (default: :func:`schema_name` of
            ``schemas.topics.INGEST_APP_ID``); created if missing.
        owner: this worker's owner id (default :func:`ingest.store.default_owner`).
        takeover_wait_s: longest wait of :meth:`assign` for the previous owner (s, > 0).
        idle_in_transaction_s: the server ends this session when it idles that long inside a
            transaction (s, > 0): a frozen worker releases its partitions and counts as dead.

    All mutators run inside :meth:`transaction` (re-entrant, thread-safe; the outermost one
    commits, or rolls back on an exception). Label methods see only the partitions given to
    :meth:`assign` where they select by time (:meth:`due`, :meth:`claims`).

    Raises:
        psycopg.OperationalError: the database cannot be reached.
        ValueError: a wait that is not > 0.
        RuntimeError: ``owner`` is held by a live worker.
    """

    _PARAM = "%s"
    scoped = True  # labels belong to partitions: the worker forwards records to their home partition

    def __init__(self, url: str, schema: str | None = None, owner: str | None = None,
                 takeover_wait_s: float = TAKEOVER_WAIT_S, idle_in_transaction_s: float = IDLE_IN_TRANSACTION_S):
        import psycopg
        from psycopg import sql

        if not takeover_wait_s > 0 or not idle_in_transaction_s > 0:
            raise ValueError(f"takeover_wait_s, idle_in_transaction_s: must be > 0 seconds, got {takeover_wait_s}, "
                             f"{idle_in_transaction_s}")
        self.takeover_wait_s = takeover_wait_s
        self.path = url  # for messages; never a file
        self.schema = schema or schema_name(topics.INGEST_APP_ID)
        self.owner = owner or default_owner()
        # client_encoding UTF8: the binary text[] parameters (_texts) are UTF-8 bytes whatever the
        # database's encoding; the server converts them (a LATIN1 database re-read them as LATIN1)
        self.db = psycopg.connect(url, autocommit=True, application_name=f"flywheel-ingest {self.owner}",
                                  client_encoding="UTF8")
        _register_arrays(self.db)
        # a worker frozen inside a transaction (SIGSTOP, a VM pause) loses its session, its
        # locks and its advisory lock: its partitions can be taken over, its claims recovered
        self.db.execute(f"SET idle_in_transaction_session_timeout = {int(idle_in_transaction_s * 1000)}")
        self._init_base()
        self._unsent_begin, self._tx_thread = False, 0
        self._lit: dict[str, bytes] = {}  # counter name -> its SQL literal
        self._lit_owner = sql.Literal(self.owner).as_bytes(self.db)
        self._epochs: dict[int, int] = {}  # partition -> the epoch this store took it at
        with self.db.transaction():
            self.db.execute("SELECT pg_advisory_xact_lock(%s)", (_DDL_LOCK,))
            self.db.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema)))
            self.db.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
            for stmt in filter(str.strip, _SCHEMA.split(";")):
                self.db.execute(stmt)
            have = {t for (t,) in self.db.execute(
                "SELECT table_name FROM information_schema.columns WHERE table_schema = %s AND column_name = 'part'",
                (self.schema,))}
            for table in _PARTED:
                if table not in have:  # an earlier layout: filled at the next take_ownership
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN part INT")
            for stmt in filter(str.strip, _PART_INDEXES.split(";")):
                self.db.execute(stmt)
        self.db.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
        key = _lock_key(self.owner)
        if not self.db.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]:
            raise RuntimeError(f"owner: {self.owner!r} is already held by a live worker")
        self.db.execute("INSERT INTO owners(owner, lock_key, host, started_at) VALUES(%s,%s,%s,%s) "
                        "ON CONFLICT(owner) DO NOTHING", (self.owner, key, socket.gethostname(), now_ms()))

    def close(self) -> None:
        """Close the connection (drops this owner's advisory lock)."""
        import psycopg

        with self._lock:
            if not self.db.closed:
                try:
                    self.db.execute("DELETE FROM owners WHERE owner=%s", (self.owner,))
                    self.db.execute("SELECT pg_advisory_unlock_all()")  # now, not when the backend exits
                except psycopg.Error:  # the session is already gone (server ended it): so are its locks
                    pass
                self.db.close()

    def flush(self) -> None:
        """Nothing to do: every :meth:`transaction` commits."""

    # -- transactions (the skeleton is StoreBase.transaction) -------------------------------
    # BEGIN is sent with the transaction's first statement (:meth:`_x`; :meth:`fence` sends
    # both in one query), and the counters with COMMIT: a fold is one round trip fewer at
    # each end. A transaction that ran no statement sends neither.
    def _begin(self) -> None:
        self._unsent_begin = True
        self._tx_thread = threading.get_ident()

    def _take_begin(self) -> bool:
        """Whether the caller must send this thread's pending BEGIN (it is then no longer
        pending). Statements of other threads run as they come (outside the transaction
        while its BEGIN is pending)."""
        if self._unsent_begin and self._tx_thread == threading.get_ident():
            self._unsent_begin = False
            return True
        return False

    def _commit(self) -> None:
        if self._take_begin():  # nothing ran: the counters alone are one atomic statement
            if self._pending:
                self.db.execute(self._counters_sql())
                self._pending = {}
            return
        if self._pending:
            self.db.execute(self._counters_sql() + b"; COMMIT")
            self._pending = {}
        else:
            self.db.execute("COMMIT")

    def _abort(self) -> None:
        if self._take_begin():  # nothing was sent: nothing to roll back
            return
        if not self.db.closed:  # (a session the server ended has nothing to roll back)
            self.db.execute("ROLLBACK")

    def _x(self, q, params=None, binary: bool = False):
        """Run one statement (after this thread's pending BEGIN); returns the cursor
        (``binary``: results in binary form, e.g. bodies as their bytes, not hex)."""
        if self._take_begin():
            self.db.execute("BEGIN")
        return self.db.execute(q, params, binary=binary)

    def _exec(self, q: str, params=()):
        return self._x(self._sql(q), params)

    def _execmany(self, q: str, rows: list) -> None:
        # a shared per-row statement of StoreBase (this store's batch methods replace them all)
        if rows:  # psycopg: executemany is a cursor's
            if self._take_begin():
                self.db.execute("BEGIN")
            with self.db.cursor() as cur:
                cur.executemany(self._sql(q), rows)

    # -- partitions ------------------------------------------------------------------------
    def assign(self, parts, n: int) -> dict[int, int]:
        """Take ownership of partitions ``parts`` of ``n`` (Kafka's assignment to this worker):
        a partition held by another owner gets the next epoch, one held by this store keeps
        its own. Waits up to ``takeover_wait_s`` for a fold of the previous owner in progress.
        Returns ``{part: epoch}``.

        Raises:
            Fenced: the previous owner held a partition longer than ``takeover_wait_s`` (its
                fold is stuck; the server ends its session after ``idle_in_transaction_s``):
                call again; nothing of this assignment is owned meanwhile.
        """
        import psycopg

        if n < 1:
            raise ValueError(f"n: partition count must be >= 1, got {n}")
        epochs: dict[int, int] = {}
        try:
            self._take(sorted(set(parts)), epochs)
        except psycopg.errors.LockNotAvailable:
            raise Fenced(f"partitions {sorted(set(parts))}: the previous owner's transaction held them longer than "
                         f"takeover_wait_s={self.takeover_wait_s:g}") from None
        self._n, self._epochs = n, epochs
        return dict(epochs)

    def _take(self, parts: list[int], epochs: dict[int, int]) -> None:
        with self.transaction():
            self._x(f"SET LOCAL lock_timeout = {int(self.takeover_wait_s * 1000)}")
            for p in parts:
                epochs[p] = self._x(
                    "INSERT INTO partitions(part, owner, epoch) VALUES(%s,%s,1) ON CONFLICT(part) DO UPDATE SET "
                    "owner=excluded.owner, epoch=CASE WHEN partitions.owner=excluded.owner THEN partitions.epoch "
                    "ELSE partitions.epoch+1 END RETURNING epoch", (p, self.owner)).fetchone()[0]

    def revoke(self) -> None:
        """Forget the assignment (Kafka revoked it): nothing is sealed until :meth:`assign`."""
        self._epochs = {}

    def owned(self) -> list[int]:
        """The partitions this store holds (since the last :meth:`assign`)."""
        return sorted(self._epochs)

    def fence(self, parts) -> None:
        """Inside a transaction: lock the rows of ``parts`` (shared) and check that this store
        still owns each at its epoch.

        Raises:
            Fenced: a partition not assigned to this store, or taken over by another owner.
        """
        parts = sorted({int(p) for p in parts})
        if not parts:
            return
        q = (f"SELECT part, owner, epoch FROM partitions WHERE part IN ({','.join(map(str, parts))}) ORDER BY part "
             f"FOR SHARE")
        if self._take_begin():  # one round trip: the transaction's BEGIN and this lock
            cur = self.db.execute("BEGIN; " + q)
            cur.nextset()
        else:
            cur = self.db.execute(q)
        rows = cur.fetchall()
        have = {p: (o, e) for p, o, e in rows}
        for p in parts:
            if p not in self._epochs or have.get(p) != (self.owner, self._epochs[p]):
                raise Fenced(f"partition {p}: owned by {have.get(p, (None, 0))[0]} at epoch "
                             f"{have.get(p, (None, 0))[1]}, not by {self.owner} at epoch {self._epochs.get(p)}")

    def _parts(self, cids: list[str]) -> list[int]:
        if self._n is None:
            raise RuntimeError("partitions: assign() was not called (the partition count is unknown)")
        return home_partitions(cids, self._n)

    # -- owners ----------------------------------------------------------------------------
    def owner_alive(self, owner: str | None) -> bool:
        """Whether the worker ``owner`` still runs: its connection holds its advisory lock."""
        if owner == self.owner:
            return True
        if not owner:
            return False
        key = _lock_key(owner)
        if self._x("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]:
            self._x("SELECT pg_advisory_unlock(%s)", (key,))
            return False
        return True

    def dead_owners(self) -> list[str]:
        """Registered owners whose worker is gone."""
        return [o for (o,) in self._x("SELECT owner FROM owners").fetchall() if not self.owner_alive(o)]

    def forget_owner(self, owner: str) -> None:
        """Unregister a dead owner (its claims were finished or released)."""
        if owner and owner != self.owner:
            self._x("DELETE FROM owners WHERE owner=%s", (owner,))

    def size_bytes(self) -> int:
        """Bytes of the schema's tables and indexes (TOAST included)."""
        with self._lock:
            return int(self._x(
                "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c JOIN pg_namespace n "
                "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind = 'r'", (self.schema,)).fetchone()[0])

    def collect_segments(self) -> int:
        """Nothing to collect: bodies are rows. Returns 0."""
        return 0

    # -- labels ----------------------------------------------------------------------------
    # Each batch method is one statement: its rows travel as array parameters expanded by
    # ``unnest`` (text and bytea arrays in binary form: :func:`_texts`, :func:`_byteas`).
    def get(self, cid: str) -> LabelState | None:
        """The open state of ``cid`` with its completion bytes (None if absent); row locked."""
        row = self._x("SELECT l.state, l.claim, c.body FROM labels l LEFT JOIN completions c "
                      "USING (completion_id) WHERE l.completion_id=%s FOR UPDATE OF l", (cid,), binary=True).fetchone()
        return LabelState.from_json(row[0], row[2], row[1]) if row else None

    def get_many(self, cids) -> dict[str, LabelState]:
        """Open states of ``cids`` (rows locked); ``completion`` is ``""`` when stored, None
        when not arrived (the body is not read)."""
        rows = self._x(
            "SELECT l.completion_id, l.state, EXISTS(SELECT 1 FROM completions c WHERE "
            "c.completion_id=l.completion_id), l.claim FROM labels l WHERE l.completion_id = ANY(%s::text[]) "
            "FOR UPDATE OF l", (_texts(set(cids)),)).fetchall()
        return {cid: LabelState.from_json(state, "" if has else None, claim) for cid, state, has, claim in rows}

    def put_many(self, items: list[tuple[LabelState, int]]) -> None:
        """Upsert ``(state, due_at ms)`` pairs in their home partitions (of one id, the last
        pair wins); a completion body is stored only if none is (first wins). One statement.

        Raises:
            Fenced: a label whose home partition this store does not own."""
        if not items:
            return
        parts = self._parts([st.completion_id for st, _ in items])
        foreign = sorted(set(parts) - set(self._epochs))
        if foreign:  # the worker forwards such records to their home partition first
            raise Fenced(f"partitions {foreign}: labels there belong to their owner, not to {self.owner}")
        labels: dict[str, tuple[int, str, int]] = {}
        bodies: dict[str, bytes] = {}
        for (st, due), p in zip(items, parts):
            labels[st.completion_id] = (p, st.to_json(), due)
            if st.completion and st.completion_id not in bodies:
                bodies[st.completion_id] = (st.completion.encode() if isinstance(st.completion, str)
                                            else bytes(st.completion))
        cols = (_texts(labels), _ints(r[0] for r in labels.values()), _texts(r[1] for r in labels.values()),
                _ints(r[2] for r in labels.values()))
        upsert = ("INSERT INTO labels(completion_id, part, state, due_at) SELECT * FROM unnest(%s::text[], "
                  "%s::int[], %s::text[], %s::bigint[]) ON CONFLICT(completion_id) DO UPDATE SET "
                  "state=excluded.state, due_at=excluded.due_at")
        if bodies:  # (the two inserts touch different tables: one snapshot serves both)
            self._x(f"WITH l AS ({upsert}) INSERT INTO completions(completion_id, body) SELECT * FROM "
                    f"unnest(%s::text[], %s) ON CONFLICT DO NOTHING",
                    (*cols, _texts(bodies), _byteas(list(bodies.values()))))
        else:
            self._x(upsert, cols)

    def delete_many(self, cids: list[str]) -> None:
        """Remove the open states of ``cids`` and their completions (one statement)."""
        if cids:
            self._x("WITH l AS (DELETE FROM labels WHERE completion_id = ANY(%(c)s::text[])) "
                    "DELETE FROM completions WHERE completion_id = ANY(%(c)s::text[])", {"c": _texts(cids)})

    def due(self, now: int, limit: int) -> list[LabelState]:
        """Unclaimed states of owned partitions due by ``now`` (ms), earliest first, with their
        completion bytes; locked (``SKIP LOCKED``) until the transaction ends."""
        if not self._epochs:
            return []
        rows = self._x(
            "SELECT l.completion_id, l.state, c.body FROM labels l LEFT JOIN completions c USING (completion_id) "
            "WHERE l.part = ANY(%s) AND l.claim IS NULL AND l.due_at <= %s ORDER BY l.due_at LIMIT %s "
            "FOR UPDATE OF l SKIP LOCKED", (self.owned(), now, limit), binary=True).fetchall()
        return [LabelState.from_json(state, body) for _, state, body in rows]

    def claim_many(self, claims: list[tuple[str, str]]) -> None:
        """Claim ``(completion_id, claim)`` pairs for this owner (of one id, the last pair
        wins); absent labels are ignored. One statement."""
        if claims:
            last = dict(claims)
            self._x("UPDATE labels SET claim=v.claim, owner=%s FROM unnest(%s::text[], %s::text[]) "
                    "AS v(cid, claim) WHERE labels.completion_id=v.cid",
                    (self.owner, _texts(last), _texts(last.values())))

    def claims(self) -> list[tuple[str, str, str | None]]:
        """Open claims in owned partitions as ``(completion_id, claim, owner)`` (rows locked)."""
        if not self._epochs:
            return []
        return [tuple(r) for r in self._x(
            "SELECT completion_id, claim, owner FROM labels WHERE claim IS NOT NULL AND part = ANY(%s) "
            "ORDER BY completion_id FOR UPDATE", (self.owned(),)).fetchall()]

    # -- dedupe and sealed -----------------------------------------------------------------
    def events_seen(self, eids) -> set[str]:
        """Those of ``eids`` already folded or dead-lettered."""
        return {r[0] for r in self._x("SELECT event_id FROM events WHERE event_id = ANY(%s::text[])",
                                      (_texts(set(eids)),))}

    def sealed_among(self, cids) -> set[str]:
        """Those of ``cids`` already sealed."""
        return {r[0] for r in self._x("SELECT completion_id FROM sealed WHERE completion_id = ANY(%s::text[])",
                                      (_texts(set(cids)),))}

    def add_events(self, rows: list[tuple[str, str, int]]) -> None:
        """Record ``(event_id, completion_id, at ms)`` rows as folded (an event already
        recorded, or twice in ``rows``, keeps its first row). One statement."""
        if rows:
            first: dict[str, tuple[str, str, int]] = {}
            for r in rows:
                first.setdefault(r[0], r)
            homes = self._homes([r[1] for r in first.values()])
            self._x("INSERT INTO events(event_id, completion_id, at, part) SELECT * FROM unnest(%s::text[], "
                    "%s::text[], %s::bigint[], %s::int[]) ON CONFLICT DO NOTHING",
                    (_texts(first), _texts(r[1] for r in first.values()), _ints(r[2] for r in first.values()),
                     _ints("NULL" if h is None else h for h in homes)))

    def mark_dead(self, eids: list[str], at: int | None = None, parts: list[int | None] | None = None) -> None:
        """Record ``eids`` as dead-lettered at ``at`` ms (default now), with no completion, each
        in its partition of ``parts`` (None: unknown); an event already recorded, or twice in
        ``eids``, keeps its first row. One statement.

        Raises:
            ValueError: ``parts`` not of the length of ``eids``."""
        if eids:
            first = {}
            for e, p in zip(eids, _dead_parts(eids, parts)):
                first.setdefault(e, p)
            self._x("INSERT INTO events(event_id, completion_id, at, part) SELECT e, NULL, %s::bigint, p FROM "
                    "unnest(%s::text[], %s::int[]) AS v(e, p) ON CONFLICT DO NOTHING",
                    (now_ms() if at is None else at, _texts(first),
                     _ints("NULL" if p is None else p for p in first.values())))

    def mark_sealed_many(self, rows: list[tuple[str, int, str]]) -> None:
        """Record ``(completion_id, sealed_at ms, shard)`` rows as sealed (a later record of a
        completion replaces an earlier one). One statement."""
        if rows:
            last = {r[0]: r for r in rows}
            homes = self._homes(list(last))
            self._x("INSERT INTO sealed(completion_id, sealed_at, shard, part) SELECT * FROM unnest(%s::text[], "
                    "%s::bigint[], %s::text[], %s::int[]) ON CONFLICT(completion_id) DO UPDATE SET "
                    "sealed_at=excluded.sealed_at, shard=excluded.shard, part=coalesce(excluded.part, sealed.part)",
                    (_texts(last), _ints(r[1] for r in last.values()), _texts(r[2] for r in last.values()),
                     _ints("NULL" if h is None else h for h in homes)))

    def _may_prune(self) -> bool:
        # one worker at a time (the others skip it): two concurrent range deletes could deadlock
        return self._x("SELECT pg_try_advisory_xact_lock(%s)", (_PRUNE_LOCK,)).fetchone()[0]

    # -- the checkpoint store of ingest.keyed ------------------------------------------------
    def take_ownership(self, parts, n: int) -> dict[int, int]:
        """See :meth:`ingest.store.CheckpointStore.take_ownership`: :meth:`assign`, then the
        rows without a partition get theirs (one worker at a time)."""
        epochs = self.assign(parts, n)
        with self.transaction():
            self._x("SELECT pg_advisory_xact_lock(%s)", (_DDL_LOCK,))
            self._settle_parts(n)
        return epochs

    def _set_parts(self, table: str, key: str, keys: list[str], parts: list[int]) -> None:
        """Set ``part`` of the rows of ``table`` whose ``key`` is each of ``keys`` (one statement)."""
        self._x(f"UPDATE {table} SET part=v.p FROM unnest(%s::text[], %s::int[]) AS v(k, p) WHERE {table}.{key}=v.k",
                (_texts(keys), _ints(parts)))

    def fence_ownership(self, parts) -> None:
        """See :meth:`ingest.store.CheckpointStore.fence_ownership`: :meth:`fence`."""
        self.fence(parts)

    def snapshot(self, parts, n: int | None):
        """See :meth:`ingest.store.CheckpointStore.snapshot`."""
        if parts is not None and n is None:
            raise ValueError("n: the partition count is needed to restore partitions")
        where, args = "", ()
        if parts is not None:  # the rows of ``parts`` (index on part), and those not partitioned yet
            where, args = " WHERE part = ANY(%s::int[]) OR part IS NULL", (_ints(sorted({int(p) for p in parts})),)
        with self._lock:
            labels = self._x("SELECT l.completion_id, l.state, l.due_at, l.claim, l.owner, EXISTS(SELECT 1 FROM "
                             "completions c WHERE c.completion_id = l.completion_id), l.part FROM labels l"
                             + where.replace("part", "l.part"), args).fetchall()
            events = self._x("SELECT event_id, completion_id, at, part FROM events" + where, args).fetchall()
            sealed = self._x("SELECT completion_id, sealed_at, part FROM sealed" + where, args).fetchall()
        return _in_parts(labels, parts, n, 0), _in_parts(events, parts, n, 1), _in_parts(sealed, parts, n, 0)

    def bodies(self, cids) -> dict[str, bytes]:
        """See :meth:`ingest.store.CheckpointStore.bodies` (one statement)."""
        with self._lock:
            return {c: bytes(b) for c, b in self._x(
                "SELECT completion_id, body FROM completions WHERE completion_id = ANY(%s::text[])",
                (_texts(set(cids)),), binary=True)}

    def save_offsets(self, offsets: dict[tuple[str, int], int]) -> None:
        """See :meth:`ingest.store.CheckpointStore.save_offsets` (one statement)."""
        if offsets:
            self._x("INSERT INTO offsets(topic, part, next_offset) SELECT * FROM unnest(%s::text[], %s::int[], "
                    "%s::bigint[]) ON CONFLICT(topic, part) DO UPDATE SET next_offset=excluded.next_offset",
                    (_texts(t for t, _ in offsets), _ints(p for _, p in offsets), _ints(offsets.values())))

    def saved_offsets(self) -> dict[tuple[str, int], int]:
        """See :meth:`ingest.store.CheckpointStore.saved_offsets`."""
        with self._lock:
            return {(t, int(p)): int(o) for t, p, o in self._x("SELECT topic, part, next_offset FROM offsets")}

    # -- counters --------------------------------------------------------------------------
    def _counters_sql(self) -> bytes:
        """The upsert of the pending counter deltas, values inline (so that it can share one
        query with COMMIT)."""
        from psycopg import sql

        lits = []
        for k, v in self._pending.items():
            lit = self._lit.get(k)
            if lit is None:
                lit = self._lit[k] = sql.Literal(k).as_bytes(self.db)
            lits.append(b"(%s,%s,%d)" % (self._lit_owner, lit, int(v)))
        return (b"INSERT INTO counters(owner, name, value) VALUES " + b",".join(lits) +
                b" ON CONFLICT(owner, name) DO UPDATE SET value=counters.value+excluded.value")

    def _write_counters(self) -> None:
        if self._pending:
            self._x(self._counters_sql())
            self._pending = {}

    def _stored_counters(self) -> dict[str, int]:
        return {k: int(v) for k, v in self._x("SELECT name, sum(value) FROM counters GROUP BY name")}
