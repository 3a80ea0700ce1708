"""The join's durable state: one SQLite file (WAL) the ingest worker controls.

Why not a faust table: a faust table is rebuilt from its changelog topic at start, up to
the highwater that ListOffsets(latest) reports, and the embedded broker under-reports
that end offset after multi-record batches (DESIGN §3); recovery would silently stop
early and lose votes. So faust stays the stream runtime (app, topics, agents, timer) and
the join state lives here, written before the consumed event is acked. SQLite in WAL mode
with ``synchronous=NORMAL`` survives a killed process (SIGKILL): a committed transaction
is in the WAL in the OS page cache. It does not survive losing the host's disk; workers
that share the partitions must share this file (one host), see ``ingest/agents.py``.

Claim owners: several workers share the file, and each one claims the labels it seals. A
claim records its ``owner`` (one id per :class:`StateStore`, i.e. per worker process). The
owner holds an exclusive ``flock`` on ``<state>.owners/<owner>.lock`` for its whole life; the
kernel drops the lock when the process dies (SIGKILL included). :meth:`StateStore.owner_alive`
tries that lock without blocking, so recovery finishes or releases only the claims of dead
workers, never those of a live one still writing its shard (which would seal a label twice).

Retention: ``events`` rows carry ``at`` (ms, when recorded) and ``sealed`` rows ``sealed_at``;
:meth:`StateStore.prune` deletes rows older than a horizon (``JoinConfig.dedupe_retention_s``).

Tables:
    labels(completion_id, state JSON, completion JSON, due_at ms, claim, owner): open
        :class:`LabelState` s (the CompletionEvent kept apart: written once);
        ``claim`` is ``"shard:<path>"`` while its sample is being written, ``"dead:"``
        while an orphan's dead letters are published, else NULL; ``owner`` is the claiming
        worker's id.
    events(event_id, completion_id, at ms): every feedback event folded or dead-lettered
        within the retention horizon (the dedupe set; ``completion_id`` NULL for
        dead-lettered ones).
    sealed(completion_id, sealed_at ms, shard): labels already written.
    counters(name, value).
"""

from __future__ import annotations

import fcntl
import os
import socket
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from ingest.join import LabelState


def _now_ms() -> int:
    return int(time.time() * 1000)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS labels(completion_id TEXT PRIMARY KEY, state TEXT NOT NULL,
    completion TEXT, due_at INTEGER NOT NULL, claim TEXT, owner TEXT);
CREATE INDEX IF NOT EXISTS labels_due ON labels(due_at);
CREATE TABLE IF NOT EXISTS events(event_id TEXT PRIMARY KEY, completion_id TEXT, at INTEGER);
CREATE TABLE IF NOT EXISTS sealed(completion_id TEXT PRIMARY KEY, sealed_at INTEGER NOT NULL, shard TEXT);
CREATE TABLE IF NOT EXISTS counters(name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
# additive migrations of files written by an earlier layout: (table, column, type)
_COLUMNS = (("labels", "owner", "TEXT"), ("events", "at", "INTEGER"))
_INDEXES = """
CREATE INDEX IF NOT EXISTS labels_claim ON labels(claim) WHERE claim IS NOT NULL;
CREATE INDEX IF NOT EXISTS events_at ON events(at);
CREATE INDEX IF NOT EXISTS sealed_at ON sealed(sealed_at);
"""


class StateStore:
    """SQLite-backed join state (see module docstring). ``path=":memory:"`` for tests.

    ``owner``: this worker's claim-owner id (default ``<host>-<pid>-<random>``); a file store
    holds the owner's lock until :meth:`close` or process exit.

    All mutators must run inside :meth:`transaction` (re-entrant; the outermost one
    commits, or rolls back on an exception).
    """

    def __init__(self, path: str | Path = ":memory:", owner: str | None = None):
        self.path = str(path)
        self.owner = owner or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
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
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("BEGIN IMMEDIATE")  # schema + migration: one writer at a time
        try:
            for stmt in filter(str.strip, _SCHEMA.split(";")):
                self.db.execute(stmt)
            for table, col, typ in _COLUMNS:
                if col not in {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {col} {typ}")
            for stmt in filter(str.strip, _INDEXES.split(";")):
                self.db.execute(stmt)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self._depth = 0
        self._lock = threading.RLock()
        self._batch, self._batch_n, self._batch_t = False, 0, 0.0
        self._pending: dict[str, int] = {}  # counter deltas of the open batch, written at flush

    @property
    def owners_dir(self) -> Path:
        """``<state>.owners/``: one lock file per live (or not yet collected) owner."""
        return Path(self.path + ".owners")

    def close(self) -> None:
        """Flush, close the database and release this owner's lock."""
        self.flush()
        self.db.close()
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

    @contextmanager
    def transaction(self):
        """One atomic unit. Inside an open batch (:meth:`begin_batch`) it joins the batch
        and becomes durable at the next :meth:`flush`."""
        with self._lock:
            outer = self._depth == 0
            if outer:  # in a batch, a SAVEPOINT: a failing unit never undoes the batch
                self.db.execute("SAVEPOINT unit" if self._batch else "BEGIN IMMEDIATE")
                pending = dict(self._pending)
            self._depth += 1
            try:
                yield
            except BaseException:
                self._depth -= 1
                if outer:
                    self._pending = pending
                    self.db.execute("ROLLBACK TO unit" if self._batch else "ROLLBACK")
                    if self._batch:
                        self.db.execute("RELEASE unit")
                raise
            self._depth -= 1
            if outer:
                self.db.execute("RELEASE unit" if self._batch else "COMMIT")

    def begin_batch(self) -> None:
        """Group the following transactions into one SQLite commit (group commit) until
        :meth:`flush`. The caller must flush before it acks-and-commits offsets past them
        (``ingest.agents`` does it from faust's ``on_commit_initiated``)."""
        with self._lock:
            if not self._batch:
                self.db.execute("BEGIN IMMEDIATE")
                self._batch, self._batch_n, self._batch_t = True, 0, time.monotonic()
            self._batch_n += 1

    def flush(self) -> None:
        """Commit the open batch, if any (durable against a killed process from here)."""
        with self._lock:
            if self._batch and self._depth == 0:
                self._write_counters()
                self.db.execute("COMMIT")
                self._batch = False

    def flush_if(self, max_events: int, max_age_s: float) -> None:
        """:meth:`flush` when the batch holds ``max_events`` or is ``max_age_s`` old."""
        if self._batch and (self._batch_n >= max_events or time.monotonic() - self._batch_t >= max_age_s):
            self.flush()

    # -- labels ---------------------------------------------------------------------------
    def get(self, cid: str) -> LabelState | None:
        row = self.db.execute("SELECT state, completion FROM labels WHERE completion_id=?", (cid,)).fetchone()
        return LabelState.from_json(row[0], row[1]) if row else None

    def feedback_lookup(self, eid: str, cid: str) -> tuple[bool, bool, LabelState | None]:
        """One query for a feedback event: ``(event_id seen, completion sealed, open state)``.
        The state's ``completion`` is not read (it is large): it is ``""`` when present, None
        when not yet arrived; :meth:`put` keeps the stored one."""
        row = self.db.execute(
            "SELECT EXISTS(SELECT 1 FROM events WHERE event_id=?), EXISTS(SELECT 1 FROM sealed WHERE "
            "completion_id=?), (SELECT state FROM labels WHERE completion_id=?), (SELECT completion IS NOT NULL "
            "FROM labels WHERE completion_id=?)", (eid, cid, cid, cid)).fetchone()
        st = LabelState.from_json(row[2], "" if row[3] else None) if row[2] is not None else None
        return bool(row[0]), bool(row[1]), st

    def put(self, st: LabelState, due_at: int) -> None:
        """Upsert ``st``; the completion column is written only when it changes from NULL
        (so a state from :meth:`feedback_lookup`, completion ``""``, keeps the stored one)."""
        self.db.execute("INSERT INTO labels(completion_id, state, completion, due_at) VALUES(?,?,?,?) "
                        "ON CONFLICT(completion_id) DO UPDATE SET state=excluded.state, due_at=excluded.due_at, "
                        "completion=coalesce(labels.completion, excluded.completion)",
                        (st.completion_id, st.to_json(), st.completion, due_at))

    def delete(self, cid: str) -> None:
        self.db.execute("DELETE FROM labels WHERE completion_id=?", (cid,))

    def due(self, now: int, limit: int) -> list[LabelState]:
        rows = self.db.execute("SELECT state, completion FROM labels WHERE due_at<=? AND claim IS NULL "
                               "ORDER BY due_at LIMIT ?", (now, limit)).fetchall()
        return [LabelState.from_json(r[0], r[1]) for r in rows]

    def claim(self, cid: str, claim: str) -> None:
        """Claim ``cid`` for this owner (``claim``: ``"shard:<path>"`` or ``"dead:"``)."""
        self.db.execute("UPDATE labels SET claim=?, owner=? WHERE completion_id=?", (claim, self.owner, cid))

    def unclaim(self, cid: str) -> None:
        self.db.execute("UPDATE labels SET claim=NULL, owner=NULL WHERE completion_id=?", (cid,))

    def claims(self) -> list[tuple[str, str, str | None]]:
        """Every open claim as ``(completion_id, claim, owner)``."""
        return [tuple(r) for r in self.db.execute(
            "SELECT completion_id, claim, owner FROM labels WHERE claim IS NOT NULL").fetchall()]

    def open_count(self) -> int:
        return self.db.execute("SELECT count(*) FROM labels").fetchone()[0]

    # -- dedupe and sealed ----------------------------------------------------------------
    def event_seen(self, eid: str) -> bool:
        return self.db.execute("SELECT 1 FROM events WHERE event_id=?", (eid,)).fetchone() is not None

    def add_event(self, eid: str, cid: str, at: int | None = None) -> None:
        """Record ``eid`` folded into ``cid`` at ``at`` ms (default now)."""
        self.db.execute("INSERT OR IGNORE INTO events(event_id, completion_id, at) VALUES(?,?,?)",
                        (eid, cid, _now_ms() if at is None else at))

    def mark_dead(self, eids: list[str], at: int | None = None) -> None:
        """Record ``eids`` dead-lettered at ``at`` ms (default now)."""
        at = _now_ms() if at is None else at
        self.db.executemany("INSERT OR IGNORE INTO events(event_id, completion_id, at) VALUES(?, NULL, ?)",
                            [(e, at) for e in eids])

    def is_sealed(self, cid: str) -> bool:
        return self.db.execute("SELECT 1 FROM sealed WHERE completion_id=?", (cid,)).fetchone() is not None

    def mark_sealed(self, cid: str, sealed_at: int, shard: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO sealed(completion_id, sealed_at, shard) VALUES(?,?,?)",
                        (cid, sealed_at, shard))

    def prune(self, before_ms: int) -> tuple[int, int]:
        """Delete ``sealed`` rows sealed before ``before_ms``, and ``events`` rows recorded
        before it whose label is neither open nor sealed at/after it (an event is remembered
        at least as long as its label). Returns ``(events_deleted, sealed_deleted)``. Rows
        from an earlier layout (no ``at``) are kept."""
        ne = self.db.execute(
            "DELETE FROM events WHERE at < ? AND NOT EXISTS (SELECT 1 FROM labels l WHERE "
            "l.completion_id = events.completion_id) AND NOT EXISTS (SELECT 1 FROM sealed s WHERE "
            "s.completion_id = events.completion_id AND s.sealed_at >= ?)", (before_ms, before_ms)).rowcount
        ns = self.db.execute("DELETE FROM sealed WHERE sealed_at < ?", (before_ms,)).rowcount
        return ne, ns

    def dedupe_sizes(self) -> tuple[int, int]:
        """``(rows in events, rows in sealed)``."""
        return (self.db.execute("SELECT count(*) FROM events").fetchone()[0],
                self.db.execute("SELECT count(*) FROM sealed").fetchone()[0])

    # -- counters -------------------------------------------------------------------------
    def bump(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (inside a batch: kept in memory, written at flush,
        undone with a failing unit)."""
        if not n:
            return
        if self._batch:
            self._pending[name] = self._pending.get(name, 0) + n
        else:
            self.db.execute("INSERT INTO counters(name, value) VALUES(?,?) "
                            "ON CONFLICT(name) DO UPDATE SET value=value+excluded.value", (name, n))

    def _write_counters(self) -> None:
        if self._pending:
            self.db.executemany("INSERT INTO counters(name, value) VALUES(?,?) ON CONFLICT(name) DO UPDATE "
                                "SET value=value+excluded.value", list(self._pending.items()))
            self._pending = {}

    def counters(self) -> dict[str, int]:
        """Every counter (durable values plus the open batch's deltas)."""
        out = dict(self.db.execute("SELECT name, value FROM counters").fetchall())
        for k, v in self._pending.items():
            out[k] = out.get(k, 0) + v
        return out
