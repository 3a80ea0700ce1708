"""The join's durable state: one SQLite file (WAL) the ingest worker controls.

Why not a faust table: a faust table is rebuilt from its changelog topic at start, up to
the highwater that ListOffsets(latest) reports, and the embedded broker under-reports
that end offset after multi-record batches (DESIGN §3); recovery would silently stop
early and lose votes. So faust stays the stream runtime (app, topics, agents, timer) and
the join state lives here, written before the consumed event is acked. SQLite in WAL mode
with ``synchronous=NORMAL`` survives a killed process (SIGKILL): a committed transaction
is in the WAL in the OS page cache. It does not survive losing the host's disk; workers
that share the partitions must share this file (one host), see ``ingest/agents.py``.

Tables:
    labels(completion_id, state JSON, completion JSON, due_at ms, claim): open
        :class:`LabelState` s (the CompletionEvent kept apart: written once);
        ``claim`` is ``"shard:<path>"`` while its sample is being written, ``"dead:"``
        while an orphan's dead letters are published, else NULL.
    events(event_id, completion_id): every feedback event ever folded or dead-lettered
        (the dedupe set; ``completion_id`` NULL for dead-lettered ones).
    sealed(completion_id, sealed_at ms, shard): labels already written.
    counters(name, value).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from ingest.join import LabelState

_SCHEMA = """
CREATE TABLE IF NOT EXISTS labels(completion_id TEXT PRIMARY KEY, state TEXT NOT NULL,
    completion TEXT, due_at INTEGER NOT NULL, claim TEXT);
CREATE INDEX IF NOT EXISTS labels_due ON labels(due_at);
CREATE TABLE IF NOT EXISTS events(event_id TEXT PRIMARY KEY, completion_id TEXT);
CREATE TABLE IF NOT EXISTS sealed(completion_id TEXT PRIMARY KEY, sealed_at INTEGER NOT NULL, shard TEXT);
CREATE TABLE IF NOT EXISTS counters(name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


class StateStore:
    """SQLite-backed join state (see module docstring). ``path=":memory:"`` for tests.

    All mutators must run inside :meth:`transaction` (re-entrant; the outermost one
    commits, or rolls back on an exception).
    """

    def __init__(self, path: str | Path = ":memory:"):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30.0)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        self._depth = 0
        self._lock = threading.RLock()
        self._batch, self._batch_n, self._batch_t = False, 0, 0.0

    def close(self) -> None:
        self.flush()
        self.db.close()

    @contextmanager
    def transaction(self):
        """One atomic unit. Inside an open batch (:meth:`begin_batch`) it joins the batch
        and becomes durable at the next :meth:`flush`."""
        with self._lock:
            outer = self._depth == 0
            if outer:  # in a batch, a SAVEPOINT: a failing unit never undoes the batch
                self.db.execute("SAVEPOINT unit" if self._batch else "BEGIN IMMEDIATE")
            self._depth += 1
            try:
                yield
            except BaseException:
                self._depth -= 1
                if outer:
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

    def put(self, st: LabelState, due_at: int) -> None:
        """Upsert ``st``; the completion column is written only when it changes from NULL."""
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
        self.db.execute("UPDATE labels SET claim=? WHERE completion_id=?", (claim, cid))

    def unclaim(self, cid: str) -> None:
        self.db.execute("UPDATE labels SET claim=NULL WHERE completion_id=?", (cid,))

    def claims(self) -> list[tuple[str, str]]:
        return [tuple(r) for r in self.db.execute(
            "SELECT completion_id, claim FROM labels WHERE claim IS NOT NULL").fetchall()]

    def open_count(self) -> int:
        return self.db.execute("SELECT count(*) FROM labels").fetchone()[0]

    # -- dedupe and sealed ----------------------------------------------------------------
    def event_seen(self, eid: str) -> bool:
        return self.db.execute("SELECT 1 FROM events WHERE event_id=?", (eid,)).fetchone() is not None

    def add_event(self, eid: str, cid: str) -> None:
        self.db.execute("INSERT OR IGNORE INTO events(event_id, completion_id) VALUES(?,?)", (eid, cid))

    def mark_dead(self, eids: list[str]) -> None:
        self.db.executemany("INSERT OR IGNORE INTO events(event_id, completion_id) VALUES(?, NULL)",
                            [(e,) for e in eids])

    def is_sealed(self, cid: str) -> bool:
        return self.db.execute("SELECT 1 FROM sealed WHERE completion_id=?", (cid,)).fetchone() is not None

    def mark_sealed(self, cid: str, sealed_at: int, shard: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO sealed(completion_id, sealed_at, shard) VALUES(?,?,?)",
                        (cid, sealed_at, shard))

    # -- counters -------------------------------------------------------------------------
    def bump(self, name: str, n: int = 1) -> None:
        if n:
            self.db.execute("INSERT INTO counters(name, value) VALUES(?,?) "
                            "ON CONFLICT(name) DO UPDATE SET value=value+excluded.value", (name, n))

    def counters(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT name, value FROM counters").fetchall())
