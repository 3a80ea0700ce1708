"""The join's durable state: one SQLite file (WAL) the ingest worker controls.

Why not a stream processor's table (e.g. faust's): such a table is rebuilt from its
changelog topic at start, up to the highwater that ListOffsets(latest) reports, and the
embedded broker under-reports that end offset after multi-record batches (DESIGN §3);
recovery would silently stop early and lose votes. So the join state is checkpointed here:
the worker holds its partitions' state in memory (``ingest.keyed``) and writes each
checkpoint, with the offsets it covers, in one transaction before those offsets are
committed (``ingest/worker.py``, ``docs/decisions.md`` D81; tables ``partitions`` (the
checkpoint ownership epochs) and ``offsets``). SQLite in WAL mode with
``synchronous=NORMAL`` survives a killed process (SIGKILL): a committed transaction is in
the WAL in the OS page cache. It does not survive losing the host's disk; workers that
share the partitions must share this file (one host), see ``ingest/worker.py``. Workers on
several hosts use the PostgreSQL store instead (``ingest.state_pg``, chosen by
:func:`open_store`; ``docs/decisions.md`` D16).

Claim owners: several workers share the file, and each one claims the labels it seals. A
claim records its ``owner`` (one id per :class:`StateStore`, i.e. per worker process). The
owner holds an exclusive ``flock`` on ``<state>.owners/<owner>.lock`` for its whole life; the
kernel drops the lock when the process dies (SIGKILL included). :meth:`StateStore.owner_alive`
tries that lock without blocking, so recovery finishes or releases only the claims of dead
workers, never those of a live one still writing its shard (which would seal a label twice).

Retention: ``events`` rows carry ``at`` (ms, when recorded) and ``sealed`` rows ``sealed_at``;
:meth:`StateStore.prune` deletes rows older than a horizon (``JoinConfig.dedupe_retention_s``).

Tables:
    labels(completion_id, state JSON, due_at ms, claim, owner): open :class:`LabelState` s;
        ``claim`` is ``"shard:<path>"`` while its sample is being written, ``"dead:"``
        while an orphan's dead letters are published, else NULL; ``owner`` is the claiming
        worker's id.
    completions(completion_id, seg, off, len, body): where the CompletionEvent JSON of an
        open label is (the bytes as consumed, ~18 KiB with expert routes): ``len`` bytes at
        ``off`` of body segment ``seg`` (see below), or inline in ``body`` (``:memory:``
        stores, and files migrated from an earlier layout). Written once, read once at
        sealing, deleted with the label.
    events(event_id, completion_id, at ms, part): every feedback event folded or
        dead-lettered within the retention horizon (the dedupe set; ``completion_id`` NULL for
        dead-lettered ones).
    sealed(completion_id, sealed_at ms, shard, part): labels already written.
    counters(name, value).
    meta(name, value): ``partition_count``, the partition count the ``part`` columns were
        computed with.

Partitions (``docs/decisions.md`` D88): ``labels``, ``events`` and ``sealed`` rows carry
``part``, the home partition of their ``completion_id`` (``ingest.partition``), so that a
restore (:meth:`StateStore.snapshot`) reads the rows of the partitions it takes only (index
on ``part``). A dead-lettered event's row carries the partition it was folded in when the
caller gives it (``mark_dead(parts=)``), else NULL: read by every restore. ``part`` is NULL
where the partition count was not known when the row was written (no :meth:`StateStore.
assign` yet: in-process use) and in files of an earlier layout (the column is added at
open); :meth:`StateStore.take_ownership` fills those from the ``completion_id`` once the
count is known, and recomputes every row if the count changed.

Body segments: completion bodies are appended to ``<state>.bodies/<owner>.<n>.seg``, one
open segment per worker (so workers never contend on it), rotated at ``SEGMENT_BYTES``. The
bytes are flushed to the OS before the transaction that references them commits (the same
SIGKILL guarantee as the WAL). A segment is deleted once no ``completions`` row references it
and no live worker can add one: its owner's rotated segments, or any segment of a dead owner
(:meth:`StateStore.collect_segments`). Why: an 18 KiB body inserted into SQLite and deleted at
sealing was written three times (WAL, checkpoint, free pages) and cost ~60 us to insert and
~30 us to delete per completion; an append is a few us (one ``writev`` per batch, straight
from the consumed buffers) and a deletion is one ``unlink`` per segment.

Cost (measured, ``bench/RESULTS.md``): the batch methods (:meth:`StateStore.get_many`,
:meth:`StateStore.put_many`, :meth:`StateStore.events_seen`, ...) read and write a whole
consumer batch in a few statements; counters are added up in memory and written once per
transaction.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
from pathlib import Path

from schemas import topics

from ingest.label import LabelState
from ingest.store import Fenced, JoinStore, StoreBase, _in_parts, default_owner

_SCHEMA = """
CREATE TABLE IF NOT EXISTS labels(completion_id TEXT PRIMARY KEY, state TEXT NOT NULL,
    due_at INTEGER NOT NULL, claim TEXT, owner TEXT, part INTEGER);
CREATE INDEX IF NOT EXISTS labels_due ON labels(due_at);
CREATE TABLE IF NOT EXISTS completions(completion_id TEXT PRIMARY KEY, seg TEXT, off INTEGER, len INTEGER,
    body BLOB);
CREATE TABLE IF NOT EXISTS events(event_id TEXT PRIMARY KEY, completion_id TEXT, at INTEGER, part INTEGER);
CREATE TABLE IF NOT EXISTS sealed(completion_id TEXT PRIMARY KEY, sealed_at INTEGER NOT NULL, shard TEXT,
    part INTEGER);
CREATE TABLE IF NOT EXISTS counters(name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS partitions(part INTEGER PRIMARY KEY, owner TEXT, epoch INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS offsets(topic TEXT NOT NULL, part INTEGER NOT NULL, next_offset INTEGER NOT NULL,
    PRIMARY KEY(topic, part));
CREATE TABLE IF NOT EXISTS meta(name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
# additive migrations of files written by an earlier layout: (table, column, type)
_COLUMNS = (("labels", "owner", "TEXT"), ("events", "at", "INTEGER"), ("labels", "part", "INTEGER"),
            ("events", "part", "INTEGER"), ("sealed", "part", "INTEGER"))
_INDEXES = """
CREATE INDEX IF NOT EXISTS labels_claim ON labels(claim) WHERE claim IS NOT NULL;
CREATE INDEX IF NOT EXISTS events_at ON events(at);
CREATE INDEX IF NOT EXISTS sealed_at ON sealed(sealed_at);
CREATE INDEX IF NOT EXISTS completions_seg ON completions(seg) WHERE seg IS NOT NULL;
CREATE INDEX IF NOT EXISTS labels_part ON labels(part);
CREATE INDEX IF NOT EXISTS events_part ON events(part);
CREATE INDEX IF NOT EXISTS sealed_part ON sealed(part);
"""
SEGMENT_BYTES = 64 << 20  # a worker's body segment is rotated past this size (bytes)
CACHE_KIB = 65536  # SQLite page cache per connection (KiB; default 2 MiB)
# WAL pages before an automatic checkpoint (default 1000 = 4 MiB): a consumer batch dirties a
# few hundred pages (random UUID keys), so the default checkpointed (copy + fsync) every
# batch or two; 20,000 (~80 MiB of WAL at most) checkpoints a page once per many rewrites
WAL_CHECKPOINT_PAGES = 20_000
_IOV = 512  # buffers per writev (IOV_MAX is 1024 on Linux)
_CHUNK = 500  # ids per ``IN (...)`` query (SQLite's variable limit is far above)


def _chunks(xs: list, n: int = _CHUNK):
    for i in range(0, len(xs), n):
        yield xs[i:i + n]


def _body(completion: bytes | str) -> bytes:
    return completion.encode() if isinstance(completion, str) else bytes(completion)


class StateStore(StoreBase):
    """SQLite-backed join state (see module docstring); a :class:`ingest.store.JoinStore`,
    whose docstrings hold each method's contract. ``path=":memory:"`` for tests.

    ``owner``: this worker's claim-owner id (default :func:`ingest.store.default_owner`); a
    file store holds the owner's lock until :meth:`close` or process exit.

    All mutators must run inside :meth:`transaction` (re-entrant; the outermost one
    commits, or rolls back on an exception).

    Raises:
        ValueError: an ``owner`` that cannot be a file name.
        sqlite3.OperationalError: the file cannot be opened or stays locked 30 s.
    """

    scoped = False  # one file shared by the host's workers: a label is found from any partition

    def __init__(self, path: str | Path = ":memory:", owner: str | None = None):
        self.path = str(path)
        self.owner = owner or default_owner()
        if "/" in self.owner or self.owner.startswith("."):
            raise ValueError(f"owner: {self.owner!r} cannot be a file name")
        self._owner_fd: int | None = None
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self.owners_dir.mkdir(exist_ok=True)
            # locked before it is visible: a peer's sweep never sees it unlocked (and deletes it)
            tmp = self.owners_dir / f".{self.owner}.tmp"
            self._owner_fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._owner_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held for life
            os.rename(tmp, self.owners_dir / f"{self.owner}.lock")
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30.0)
        self._set_wal()
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
        self.db.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
        self.db.execute("BEGIN IMMEDIATE")  # schema + migration: one writer at a time
        try:
            for stmt in filter(str.strip, _SCHEMA.split(";")):
                self.db.execute(stmt)
            for table, col, typ in _COLUMNS:
                if col not in {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {col} {typ}")
            if "seg" not in {r[1] for r in self.db.execute("PRAGMA table_info(completions)")}:
                # an interim layout kept bodies inline only (body NOT NULL): rebuild, bodies kept
                self.db.execute("ALTER TABLE completions RENAME TO completions_inline")
                for stmt in filter(str.strip, _SCHEMA.split(";")):
                    self.db.execute(stmt)
                self.db.execute("INSERT INTO completions(completion_id, body) SELECT completion_id, body "
                                "FROM completions_inline")
                self.db.execute("DROP TABLE completions_inline")
            if "completion" in {r[1] for r in self.db.execute("PRAGMA table_info(labels)")}:
                # layout before the completions table: move the bodies out of the label rows
                self.db.execute("INSERT OR IGNORE INTO completions(completion_id, body) SELECT completion_id, "
                                "CAST(completion AS BLOB) FROM labels WHERE completion IS NOT NULL")
                self.db.execute("UPDATE labels SET completion=NULL WHERE completion IS NOT NULL")
            for stmt in filter(str.strip, _INDEXES.split(";")):
                self.db.execute(stmt)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self._init_base()
        self._batch = False
        self._seg_fds: dict[str, int] = {}  # read handles of body segments
        self._seg_n, self._seg_name, self._seg_file, self._seg_pos = 0, None, None, 0
        self._parts: list[int] = []

    # -- partitions (one shared file: every worker sees every label) ------------------------
    def assign(self, parts, n: int) -> dict[int, int]:
        """Record Kafka's assignment to this worker. The state is one file shared by the
        host's workers, so labels are not scoped to it (``ingest.state_pg`` is); rows written
        from now on carry their home partition among ``n``. Returns ``{part: 0}``.

        Raises:
            ValueError: ``n`` < 1.
        """
        if n < 1:
            raise ValueError(f"n: partition count must be >= 1, got {n}")
        self._parts, self._n = sorted(set(parts)), n
        return {p: 0 for p in self._parts}

    def revoke(self) -> None:
        """Forget the assignment (nothing else: the file is shared)."""
        self._parts = []

    def owned(self) -> list[int]:
        """The partitions of the last :meth:`assign`."""
        return list(self._parts)

    def fence(self, parts) -> None:
        """No-op: the host's workers share this file and its one writer lock serialises them."""

    def _set_wal(self, timeout_s: float = 30.0) -> None:
        """``PRAGMA journal_mode=WAL``, retried: on a new file, a second worker starting at the
        same moment gets SQLITE_BUSY from it at once, without the busy timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @property
    def owners_dir(self) -> Path:
        """``<state>.owners/``: one lock file per live (or not yet collected) owner."""
        return Path(self.path + ".owners")

    def close(self) -> None:
        """Flush, close the database and release this owner's lock."""
        self.flush()
        self.db.close()
        if self._seg_file is not None:
            self._seg_file.close()
            self._seg_file = None
        for fd in self._seg_fds.values():
            os.close(fd)
        self._seg_fds.clear()
        if self._owner_fd is not None:
            os.close(self._owner_fd)  # releases the flock
            (self.owners_dir / f"{self.owner}.lock").unlink(missing_ok=True)
            self._owner_fd = None

    def owner_alive(self, owner: str | None) -> bool:
        """Whether the worker ``owner`` still runs: it is this store, or another process holds
        its lock file. A missing owner (a claim from an earlier layout) counts as dead."""
        if owner == self.owner:
            return True
        if not owner or self.path == ":memory:":
            return False
        lock = self.owners_dir / f"{owner}.lock"
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def dead_owners(self) -> list[str]:
        """Owners with a lock file that no live process holds (killed workers)."""
        if self.path == ":memory:" or not self.owners_dir.exists():
            return []
        return [f.stem for f in self.owners_dir.glob("*.lock") if not self.owner_alive(f.stem)]

    def forget_owner(self, owner: str) -> None:
        """Remove a dead owner's lock file (after its claims were finished or released)."""
        if owner and owner != self.owner and self.path != ":memory:":
            (self.owners_dir / f"{owner}.lock").unlink(missing_ok=True)

    def size_bytes(self) -> int:
        """Bytes of the file, its WAL and the body segments (0 for ``:memory:``)."""
        if self.path == ":memory:":
            return 0
        size = sum(os.path.getsize(p) for p in (self.path, self.path + "-wal") if os.path.exists(p))
        if self.bodies_dir.is_dir():
            for f in self.bodies_dir.rglob("*"):
                try:
                    size += f.stat().st_size if f.is_file() else 0
                except OSError:  # removed meanwhile (segment collection)
                    pass
        return size

    # -- transactions (the skeleton is StoreBase.transaction) -------------------------------
    # Inside an open batch (begin_batch) a unit is a SAVEPOINT: it joins the batch, a failing
    # unit never undoes the batch, and it becomes durable at the next flush.
    def _begin(self) -> None:
        self.db.execute("SAVEPOINT unit" if self._batch else "BEGIN IMMEDIATE")

    def _commit(self) -> None:
        if self._batch:
            self.db.execute("RELEASE unit")  # counters stay pending until the batch's flush
        else:
            self._write_counters()
            self.db.execute("COMMIT")

    def _abort(self) -> None:
        if self._batch:
            self.db.execute("ROLLBACK TO unit")
            self.db.execute("RELEASE unit")
        else:
            self.db.execute("ROLLBACK")

    def begin_batch(self) -> None:
        """Group the following transactions into one SQLite commit (group commit) until
        :meth:`flush`. The caller must flush before it acks-and-commits offsets past them
        (the worker instead makes each consumer batch one :meth:`transaction`)."""
        with self._lock:
            if not self._batch:
                self.db.execute("BEGIN IMMEDIATE")
                self._batch = True

    def flush(self) -> None:
        """Commit the open batch, if any (durable against a killed process from here)."""
        with self._lock:
            if self._batch and self._depth == 0:
                self._write_counters()
                self.db.execute("COMMIT")
                self._batch = False

    # -- body segments --------------------------------------------------------------------
    @property
    def bodies_dir(self) -> Path:
        """``<state>.bodies/``: the completion body segments."""
        return Path(self.path + ".bodies")

    def _append_bodies(self, bodies: list[bytes]) -> list[tuple[str, int, int]]:
        """Append ``bodies`` to this owner's open segment and flush them to the OS; returns
        ``(segment, offset, length)`` of each."""
        if self._seg_file is None or self._seg_pos > SEGMENT_BYTES:
            if self._seg_file is not None:
                self._seg_file.close()
            self.bodies_dir.mkdir(exist_ok=True)
            self._seg_n += 1
            self._seg_name = f"{self.owner}.{self._seg_n}.seg"
            self._seg_file = open(self.bodies_dir / self._seg_name, "ab", buffering=0)
            self._seg_pos = self._seg_file.tell()
        out = []
        for b in bodies:
            out.append((self._seg_name, self._seg_pos, len(b)))
            self._seg_pos += len(b)
        # gathered writes straight from the consumed buffers (no copy, ~1 syscall per 512
        # bodies), in the OS before the referencing transaction commits
        fd = self._seg_file.fileno()
        for i in range(0, len(bodies), _IOV):
            chunk = bodies[i:i + _IOV]
            n = os.writev(fd, chunk)
            if n != sum(map(len, chunk)):  # a short write: finish it (os.write raises on a full disk)
                rest = memoryview(b"".join(chunk))[n:]
                while rest:
                    rest = rest[os.write(fd, rest):]
        return out

    def _body_at(self, cid: str, seg: str | None, off: int | None, n: int | None, body: bytes | None) -> bytes | None:
        if body is not None or seg is None:
            return body
        fd = self._seg_fds.get(seg)
        if fd is None:
            fd = self._seg_fds[seg] = os.open(self.bodies_dir / seg, os.O_RDONLY)
        data = os.pread(fd, n, off)
        if len(data) != n:
            raise RuntimeError(f"completion {cid}: body segment {seg} holds {len(data)} of {n} bytes at {off}")
        return data

    def collect_segments(self) -> int:
        """Delete body segments that no row references and no live worker can reference
        again (this owner's rotated ones; dead owners' ones). Returns how many."""
        if self.path == ":memory:" or not self.bodies_dir.exists():
            return 0
        n, alive = 0, {}
        with self._lock:  # no append, rotation or reference of ours between the query and the unlinks
            used = {r[0] for r in self.db.execute("SELECT DISTINCT seg FROM completions WHERE seg IS NOT NULL")}
            for f in self.bodies_dir.glob("*.seg"):
                owner = f.name[:-4].rsplit(".", 1)[0]
                if f.name in used or f.name == self._seg_name:
                    continue
                if owner not in alive:
                    alive[owner] = owner != self.owner and self.owner_alive(owner)
                if alive[owner]:
                    continue  # a live peer may still reference it
                fd = self._seg_fds.pop(f.name, None)
                if fd is not None:
                    os.close(fd)
                f.unlink(missing_ok=True)
                n += 1
            for seg in [g for g in self._seg_fds if g not in used]:  # e.g. peers' deleted segments
                os.close(self._seg_fds.pop(seg))
        return n

    # -- labels ---------------------------------------------------------------------------
    def get(self, cid: str) -> LabelState | None:
        """The open state of ``cid`` with its completion bytes (None if not yet arrived)."""
        row = self.db.execute("SELECT l.state, l.claim, c.seg, c.off, c.len, c.body FROM labels l LEFT JOIN "
                              "completions c ON c.completion_id=l.completion_id WHERE l.completion_id=?",
                              (cid,)).fetchone()
        return LabelState.from_json(row[0], self._body_at(cid, *row[2:]), row[1]) if row else None

    def get_many(self, cids) -> dict[str, LabelState]:
        """Open states of ``cids`` (absent ones left out), each with its ``claim``; the large
        completion is not read: ``completion`` is ``""`` when stored, None when not arrived
        (:meth:`put_many` keeps the stored one)."""
        out: dict[str, LabelState] = {}
        for part in _chunks(list(set(cids))):
            q = ",".join("?" * len(part))
            for cid, state, has, claim in self.db.execute(
                    f"SELECT l.completion_id, l.state, EXISTS(SELECT 1 FROM completions c WHERE "
                    f"c.completion_id=l.completion_id), l.claim FROM labels l WHERE l.completion_id IN ({q})", part):
                out[cid] = LabelState.from_json(state, "" if has else None, claim)
        return out

    def put_many(self, items: list[tuple[LabelState, int]]) -> None:
        """Upsert ``(state, due_at ms)`` pairs. A state's completion (bytes or str) is stored
        only if none is stored yet (first wins); ``""``/None store nothing."""
        if not items:
            return
        homes = self._homes([st.completion_id for st, _ in items])
        self.db.executemany("INSERT INTO labels(completion_id, state, due_at, part) VALUES(?,?,?,?) ON CONFLICT"
                            "(completion_id) DO UPDATE SET state=excluded.state, due_at=excluded.due_at, "
                            "part=coalesce(excluded.part, labels.part)",
                            [(st.completion_id, st.to_json(), due, h) for (st, due), h in zip(items, homes)])
        new = [st for st, _ in items if st.completion]
        if not new:
            return
        have = set()  # first wins: bodies already stored are not appended again
        for part in _chunks([st.completion_id for st in new]):
            have.update(r[0] for r in self.db.execute(
                f"SELECT completion_id FROM completions WHERE completion_id IN ({','.join('?' * len(part))})", part))
        new = [st for st in new if st.completion_id not in have and not have.add(st.completion_id)]
        bodies = [_body(st.completion) for st in new]
        if self.path == ":memory:":
            rows = [(st.completion_id, None, None, None, b) for st, b in zip(new, bodies)]
        else:
            rows = [(st.completion_id, *loc, None) for st, loc in zip(new, self._append_bodies(bodies))]
        self.db.executemany("INSERT INTO completions(completion_id, seg, off, len, body) VALUES(?,?,?,?,?)", rows)

    def delete_many(self, cids: list[str]) -> None:
        """Remove the open states of ``cids`` and their completions."""
        rows = [(c,) for c in cids]
        self.db.executemany("DELETE FROM labels WHERE completion_id=?", rows)
        self.db.executemany("DELETE FROM completions WHERE completion_id=?", rows)

    def due(self, now: int, limit: int) -> list[LabelState]:
        """Unclaimed states due by ``now`` (ms), earliest first, with their completion bytes."""
        rows = self.db.execute("SELECT l.completion_id, l.state, c.seg, c.off, c.len, c.body FROM labels l LEFT "
                               "JOIN completions c ON c.completion_id=l.completion_id WHERE l.due_at<=? AND "
                               "l.claim IS NULL ORDER BY l.due_at LIMIT ?", (now, limit)).fetchall()
        return [LabelState.from_json(r[1], self._body_at(r[0], *r[2:])) for r in rows]

    def claims(self) -> list[tuple[str, str, str | None]]:
        """Every open claim as ``(completion_id, claim, owner)``."""
        return [tuple(r) for r in self.db.execute(
            "SELECT completion_id, claim, owner FROM labels WHERE claim IS NOT NULL").fetchall()]

    # -- dedupe and sealed ----------------------------------------------------------------
    def _present(self, table: str, column: str, keys) -> set[str]:
        """Those of ``keys`` that have a row in ``table`` (looked up by ``column``, chunked)."""
        out: set[str] = set()
        for part in _chunks(list(set(keys))):
            out.update(r[0] for r in self.db.execute(
                f"SELECT {column} FROM {table} WHERE {column} IN ({','.join('?' * len(part))})", part))
        return out

    def events_seen(self, eids) -> set[str]:
        """Those of ``eids`` already folded or dead-lettered."""
        return self._present("events", "event_id", eids)

    def sealed_among(self, cids) -> set[str]:
        """Those of ``cids`` already sealed."""
        return self._present("sealed", "completion_id", cids)

    # -- the checkpoint store of ingest.keyed ------------------------------------------------
    def take_ownership(self, parts, n: int) -> dict[int, int]:
        """See :meth:`ingest.store.CheckpointStore.take_ownership` (table ``partitions``; the
        file's writer lock orders it with every checkpoint)."""
        if n < 1:
            raise ValueError(f"n: partition count must be >= 1, got {n}")
        epochs = {}
        self._n = n
        with self.transaction():
            self._settle_parts(n)
            for p in sorted(set(parts)):
                epochs[p] = self.db.execute(
                    "INSERT INTO partitions(part, owner, epoch) VALUES(?,?,1) ON CONFLICT(part) DO UPDATE SET "
                    "owner=excluded.owner, epoch=CASE WHEN partitions.owner=excluded.owner THEN partitions.epoch "
                    "ELSE partitions.epoch+1 END RETURNING epoch", (p, self.owner)).fetchone()[0]
        self._own = dict(epochs)
        return epochs

    def fence_ownership(self, parts) -> None:
        """See :meth:`ingest.store.CheckpointStore.fence_ownership`."""
        parts = sorted({int(p) for p in parts})
        if not parts:
            return
        have = {p: (o, e) for p, o, e in self.db.execute(
            f"SELECT part, owner, epoch FROM partitions WHERE part IN ({','.join(map(str, parts))})")}
        own = getattr(self, "_own", {})
        for p in parts:
            if p not in own or have.get(p) != (self.owner, own[p]):
                o, e = have.get(p, (None, 0))
                raise Fenced(f"partition {p}: owned by {o} at epoch {e}, not by {self.owner} at epoch {own.get(p)}")

    def snapshot(self, parts, n: int | None):
        """See :meth:`ingest.store.CheckpointStore.snapshot`."""
        if parts is not None and n is None:
            raise ValueError("n: the partition count is needed to restore partitions")
        where = ""
        if parts is not None:  # the rows of ``parts`` (index on part), and those not partitioned yet
            where = f" WHERE {{t}}part IN ({','.join(str(int(p)) for p in sorted(set(parts)))}) OR {{t}}part IS NULL"
        with self._lock:
            labels = self.db.execute(
                "SELECT l.completion_id, l.state, l.due_at, l.claim, l.owner, c.completion_id IS NOT NULL, l.part "
                "FROM labels l LEFT JOIN completions c ON c.completion_id = l.completion_id" + where.format(t="l.")
            ).fetchall()
            events = self.db.execute("SELECT event_id, completion_id, at, part FROM events"
                                     + where.format(t="")).fetchall()
            sealed = self.db.execute("SELECT completion_id, sealed_at, part FROM sealed"
                                     + where.format(t="")).fetchall()
        return _in_parts(labels, parts, n, 0), _in_parts(events, parts, n, 1), _in_parts(sealed, parts, n, 0)

    def bodies(self, cids) -> dict[str, bytes]:
        """See :meth:`ingest.store.CheckpointStore.bodies`."""
        out = {}
        with self._lock:
            for part in _chunks(list(set(cids))):
                for cid, *loc in self.db.execute(
                        f"SELECT completion_id, seg, off, len, body FROM completions WHERE completion_id IN "
                        f"({','.join('?' * len(part))})", part).fetchall():
                    b = self._body_at(cid, *loc)
                    if b is not None:
                        out[cid] = bytes(b)
        return out

    def save_offsets(self, offsets: dict[tuple[str, int], int]) -> None:
        """See :meth:`ingest.store.CheckpointStore.save_offsets`."""
        self.db.executemany("INSERT INTO offsets(topic, part, next_offset) VALUES(?,?,?) ON CONFLICT(topic, part) "
                            "DO UPDATE SET next_offset=excluded.next_offset",
                            [(t, p, o) for (t, p), o in offsets.items()])

    def saved_offsets(self) -> dict[tuple[str, int], int]:
        """See :meth:`ingest.store.CheckpointStore.saved_offsets`."""
        with self._lock:
            return {(t, p): o for t, p, o in self.db.execute("SELECT topic, part, next_offset FROM offsets")}

    # -- counters -------------------------------------------------------------------------
    def _write_counters(self) -> None:
        if self._pending:
            self.db.executemany("INSERT INTO counters(name, value) VALUES(?,?) ON CONFLICT(name) DO UPDATE "
                                "SET value=value+excluded.value", list(self._pending.items()))
            self._pending = {}

    def _stored_counters(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT name, value FROM counters").fetchall())


def open_store(spec: str | Path, app_id: str | None = None, owner: str | None = None) -> JoinStore:
    """The join state named by ``spec``: a ``postgresql://`` (or ``postgres://``) URL opens
    :class:`ingest.state_pg.PgStateStore` (workers on several hosts; tables in the schema of
    consumer group ``app_id``, default ``schemas.topics.INGEST_APP_ID``), anything else is the
    SQLite file of :class:`StateStore`
    (every worker on one host; the zero-setup default)."""
    if str(spec).startswith(("postgresql://", "postgres://")):
        from ingest.state_pg import PgStateStore, schema_name

        return PgStateStore(str(spec), schema=schema_name(app_id or topics.INGEST_APP_ID), owner=owner)
    return StateStore(spec, owner=owner)
