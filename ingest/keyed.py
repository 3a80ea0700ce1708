"""The join state of a worker's partitions in memory, checkpointed with the consumed offsets.

:class:`KeyedState` is an :class:`ingest.store.JoinStore` held in plain Python structures: the
open labels (:class:`ingest.label.LabelState` objects, their ``due_at`` and their claims), the
dedupe set (``event_id -> (completion_id, at)``), the sealed set (``completion_id ->
sealed_at``), the counters' deltas and, per label, a reference to its completion body. The
fold (:meth:`ingest.join.Joiner.on_completions` / ``on_feedbacks``) and the sealing timer
(:meth:`ingest.join.Joiner.tick`) run against it with no database call; a body is read from
the checkpoint store only at sealing, one query per claimed chunk.

Checkpoints (``docs/decisions.md`` D81). The changes since the last checkpoint (labels put
or deleted, claims, dedupe and sealed rows, counters, a pending prune) and the consumed
offsets the worker hands over are written to the **checkpoint store** (the SQLite file of
:class:`ingest.state.StateStore` on one host, :class:`ingest.state_pg.PgStateStore` across
hosts) in **one transaction** by :meth:`KeyedState.checkpoint`, fenced by the ownership
epochs of the worker's partitions (:class:`ingest.store.Fenced` when another worker took one
over). The worker commits offsets to Kafka only after a checkpoint that holds their effects,
so a killed worker's successor restores the last checkpoint (:meth:`KeyedState.assign`) and
replays from the last committed offsets: every replayed record whose effect the checkpoint
already holds is recognised by the dedupe and sealed sets, as before. A completion body is
kept in memory only until the checkpoint that writes it (bounded by the checkpoint interval);
then the label keeps a reference and the body is read back at sealing.

Transactions. :meth:`KeyedState.transaction` is re-entrant and thread-safe like the database
stores'; an exception in the outermost one undoes every change made in it (a journal of the
values it replaced), so the worker's record-by-record fallback after a refused record works as
with a database. Reads hand out copies: a caller mutating a state it read changes nothing
until it puts it back. :meth:`KeyedState.put_many` takes ownership of the states it is given.

Scope. Before the first :meth:`KeyedState.assign` the state holds every label of the
checkpoint store (loaded on first use: in-process tests and benches that fold without Kafka).
From then on it holds the assigned partitions only (labels by the home partition of their
``completion_id``, ``ingest.partition``), and :meth:`KeyedState.fence` refuses a fold of any
other partition. :meth:`KeyedState.revoke` drops everything (the worker checkpoints first);
correctness does not depend on that last checkpoint: what it would have written is replayed.

Holding. :meth:`KeyedState.assign` can *hold* the partitions it restores (``hold=True``): their
labels are not handed out by :meth:`KeyedState.due` (so neither sealed, nor dead-lettered as
orphans, nor dropped) until :meth:`KeyedState.release` lets them go. The worker holds a
partition until it has read it up to the end offset it had when it was assigned
(``ingest.processor``, ``docs/decisions.md`` D93): a restored label's earlier or later
events may lie in the part not read yet. A held label keeps its due time and is sealed at
the first round after its release.
"""

from __future__ import annotations

import heapq
import sys
import threading
import time
from contextlib import contextmanager

from ingest.label import LabelState
from ingest.partition import home_partition
from ingest.store import Fenced

_MISSING = object()
_I64 = (-(1 << 63), (1 << 63) - 1)
# bytes per structure, for the memory estimate (CPython 3.11, measured with tracemalloc on
# the bench's labels: a state with its dicts and a vote, a dedupe entry, a sealed entry)
_LABEL_BYTES = 900
_EVENT_BYTES = 190
_SEALED_BYTES = 150


def _i64(name: str, v) -> None:
    """Refuse an integer the checkpoint store cannot hold (a 64-bit column), as the database
    stores refuse it inside the fold's transaction: the worker then folds the batch record by
    record and dead-letters the culprit."""
    if v is not None and not (_I64[0] <= v <= _I64[1]):
        raise OverflowError(f"{name}: {v} does not fit a 64-bit integer")


def _copy(st: LabelState, completion, claim) -> LabelState:
    """A copy of ``st`` that its reader may mutate (the votes themselves are never mutated)."""
    return LabelState(completion_id=st.completion_id, completion=completion, created_at=st.created_at,
                      votes=dict(st.votes), event_ids=list(st.event_ids),
                      signals={k: dict(v) for k, v in st.signals.items()}, first_seen_at=st.first_seen_at,
                      first_vote_at=st.first_vote_at, last_vote_at=st.last_vote_at, seq=st.seq,
                      pending_raw=dict(st.pending_raw), claim=claim)


class KeyedState:
    """The join state of this worker's partitions in memory (see the module docstring); an
    :class:`ingest.store.JoinStore` whose docstrings hold each method's contract.

    Args:
        backing: the checkpoint store (:class:`ingest.state.StateStore` or
            :class:`ingest.state_pg.PgStateStore`), owned by this object from now on
            (:meth:`close` closes it).

    Attributes:
        owner, path: the checkpoint store's.
        scoped: True: a label belongs to its home partition, folded only by that
            partition's owner (the worker forwards other records there).
        checkpoints: checkpoints written so far.
    """

    scoped = True

    def __init__(self, backing):
        self.backing = backing
        self.owner = backing.owner
        self.path = backing.path
        self._lock = threading.RLock()
        self._depth = 0
        self.parts: set[int] | None = None  # None: not assigned yet (every label)
        self.n: int | None = None
        self._loaded = False
        self.checkpoints = 0
        self.restored = (0, 0, 0)  # rows the last restore read: (labels, dedupe, sealed)
        self._homes: dict[str, int] = {}  # event_id -> its partition, of the batch being folded
        self._reset()

    def _reset(self) -> None:
        self.labels: dict[str, LabelState] = {}  # completion, claim kept apart (below)
        self.due_at: dict[str, int] = {}
        self.bodies: dict[str, bytes | None] = {}  # bytes: not checkpointed yet; None: in the checkpoint store
        self.claimed: dict[str, tuple[str, str | None]] = {}  # cid -> (claim, owner)
        self.events: dict[str, tuple[str | None, int | None]] = {}  # event_id -> (completion_id, at)
        self.sealed: dict[str, int] = {}  # completion_id -> sealed_at
        self._heap: list[tuple[int, str]] = []  # (due_at, cid), stale entries skipped lazily
        self._ctr: dict[str, int] = {}  # counter deltas since the last checkpoint
        self._clear_dirty()
        self._journal: dict | None = None
        self.holding: set[int] = set()  # partitions whose labels due() does not hand out (assign(hold=True))
        self._held: dict[int, list[tuple[int, str]]] = {}  # partition -> due-heap entries set aside while held

    def _clear_dirty(self) -> None:
        self._d_labels: set[str] = set()  # put or deleted since the checkpoint
        self._d_claims: set[str] = set()  # claimed or unclaimed since the checkpoint (the row is not rewritten)
        self._d_events: list[tuple[str, str, int]] = []
        self._d_dead: list[tuple[str, int, int | None]] = []  # (event_id, at, partition or None)
        self._d_sealed: list[tuple[str, int, str]] = []
        self._prune_before: int | None = None

    # -- loading ------------------------------------------------------------------------
    def _ensure(self) -> None:
        if not self._loaded:
            self._load(None, None)

    def _load(self, parts: set[int] | None, n: int | None) -> None:
        """Replace the memory with the checkpoint store's state of ``parts`` (None: all)."""
        labels, events, sealed = self.backing.snapshot(None if parts is None else sorted(parts), n)
        self.restored = (len(labels), len(events), len(sealed))
        self._reset()
        for cid, state, due, claim, owner, has_body in labels:
            self.labels[cid] = LabelState.from_json(state)
            self.due_at[cid] = due
            if has_body:
                self.bodies[cid] = None
            if claim is not None:
                self.claimed[cid] = (claim, owner)
            else:
                self._heap.append((due, cid))
        heapq.heapify(self._heap)
        self.events = {e: (c, at) for e, c, at in events}
        self.sealed = dict(sealed)
        self.parts, self.n, self._loaded = parts, n, True

    # -- transactions ---------------------------------------------------------------------
    @contextmanager
    def transaction(self):
        """See :meth:`ingest.store.JoinStore.transaction`: nothing is written anywhere; an
        exception undoes the outermost unit's changes in memory."""
        with self._lock:
            self._ensure()
            outer = self._depth == 0
            if outer:
                self._journal = {"labels": {}, "events": [], "sealed": {}, "ctr": dict(self._ctr),
                                 "n": (len(self._d_events), len(self._d_dead), len(self._d_sealed)),
                                 "prune": self._prune_before}
            self._depth += 1
            try:
                yield
            except BaseException:
                self._depth -= 1
                if outer:
                    self._undo()
                raise
            self._depth -= 1
            if outer:
                self._journal = None

    def _undo(self) -> None:
        j, self._journal = self._journal, None
        for cid, (st, due, body, claim) in j["labels"].items():
            for d, v in ((self.labels, st), (self.due_at, due), (self.bodies, body), (self.claimed, claim)):
                if v is _MISSING:
                    d.pop(cid, None)
                else:
                    d[cid] = v
            if due is not _MISSING and claim is _MISSING:
                heapq.heappush(self._heap, (due, cid))
        for eid in j["events"]:
            self.events.pop(eid, None)
        for cid, v in j["sealed"].items():
            if v is _MISSING:
                self.sealed.pop(cid, None)
            else:
                self.sealed[cid] = v
        self._ctr = j["ctr"]
        ne, nd, ns = j["n"]
        del self._d_events[ne:], self._d_dead[nd:], self._d_sealed[ns:]
        self._prune_before = j["prune"]

    def _touch(self, cid: str, claim_only: bool = False) -> None:
        """Journal ``cid``'s values before the open unit changes them (first change only)."""
        (self._d_claims if claim_only else self._d_labels).add(cid)
        j = self._journal
        if j is not None and cid not in j["labels"]:
            j["labels"][cid] = (self.labels.get(cid, _MISSING), self.due_at.get(cid, _MISSING),
                                self.bodies.get(cid, _MISSING), self.claimed.get(cid, _MISSING))

    def flush(self) -> None:
        """See :meth:`ingest.store.JoinStore.flush`: a :meth:`checkpoint` (no offsets)."""
        self.checkpoint()

    def close(self) -> None:
        """Checkpoint what changed (unless a partition was taken over meanwhile: the new owner
        replays it), then close the checkpoint store."""
        with self._lock:
            try:
                if self._loaded:
                    self.checkpoint()
            except Fenced:
                pass
            finally:
                self.backing.close()

    # -- partitions -----------------------------------------------------------------------
    def assign(self, parts, n: int, hold: bool = False) -> dict[int, int]:
        """Take ownership of partitions ``parts`` of ``n`` in the checkpoint store (a new
        epoch for each one taken over) and restore their state from it: the labels whose
        ``completion_id`` has its home partition there, the dedupe and sealed rows of those
        labels and the dedupe rows of the events dead-lettered there (those dead-lettered with
        no known partition are kept by every partition); only those rows are read
        (``docs/decisions.md`` D88; their counts are :attr:`restored`). What changed since the
        last checkpoint is checkpointed first (dropped if a partition was taken over
        meanwhile: the new owner replays it). ``hold``: every restored partition is held
        (:attr:`holding`, in the same step as the restore, so no seal round sees its labels
        in between) until :meth:`release`. Returns ``{part: epoch}``.

        Raises:
            ingest.store.Fenced: the previous owner's checkpoint held a partition too long
                (PostgreSQL): call again.
        """
        with self._lock:
            if self._loaded and self._dirty():
                try:
                    self.checkpoint()
                except Fenced:
                    pass
            epochs = self.backing.take_ownership(parts, n)
            self._load(set(epochs), n)
            if hold:
                self.holding = set(epochs)
            return epochs

    def hold(self, parts) -> None:
        """Hold partitions ``parts`` of this state (see :meth:`assign`'s ``hold``) until
        :meth:`release` or the next :meth:`assign` / :meth:`revoke`; others are ignored."""
        with self._lock:
            self.holding |= set(parts) & set(self.parts or ())

    def release(self, parts) -> int:
        """Stop holding partitions ``parts`` (see :meth:`assign`'s ``hold``): their labels are
        handed out by :meth:`due` again, each at its due time. Partitions not held are
        ignored. Returns how many due-heap entries were set aside for them while held."""
        with self._lock:
            back = 0
            for p in set(parts) & self.holding:
                self.holding.discard(p)
                for x in self._held.pop(p, ()):
                    heapq.heappush(self._heap, x)
                    back += 1
            return back

    def revoke(self) -> None:
        """Drop the state of every partition (Kafka revoked the assignment; the worker
        checkpoints before); folds are refused until the next :meth:`assign`."""
        with self._lock:
            self._reset()
            self.parts, self._loaded = set(), True

    def owned(self) -> list[int]:
        """The partitions of the last :meth:`assign`, ascending."""
        return sorted(self.parts or ())

    def fence(self, parts) -> None:
        """Refuse a fold of a partition this state does not hold (before any assignment,
        every partition is held).

        Raises:
            ingest.store.Fenced: a partition outside the last assignment.
        """
        if self.parts is not None:
            missing = set(parts) - self.parts
            if missing:
                raise Fenced(f"partitions {sorted(missing)}: not assigned to {self.owner} (held: {self.owned()})")

    # -- owners and disk (the checkpoint store's) -----------------------------------------------
    def owner_alive(self, owner: str | None) -> bool:
        """See :meth:`ingest.store.JoinStore.owner_alive`."""
        return self.backing.owner_alive(owner)

    def dead_owners(self) -> list[str]:
        """See :meth:`ingest.store.JoinStore.dead_owners`."""
        return self.backing.dead_owners()

    def forget_owner(self, owner: str) -> None:
        """See :meth:`ingest.store.JoinStore.forget_owner`."""
        self.backing.forget_owner(owner)

    def collect_segments(self) -> int:
        """See :meth:`ingest.store.JoinStore.collect_segments`."""
        return self.backing.collect_segments()

    def size_bytes(self) -> int:
        """Bytes of the checkpoint store on disk."""
        return self.backing.size_bytes()

    def memory_bytes(self) -> int:
        """An estimate of this state's memory (bytes): labels with their event ids, dedupe
        and sealed entries, and the bodies not checkpointed yet."""
        with self._lock:
            n_ev = sum(len(st.event_ids) for st in self.labels.values())
            pending = sum(len(b) for b in self.bodies.values() if b is not None)
            return (len(self.labels) * _LABEL_BYTES + n_ev * 80 + len(self.events) * _EVENT_BYTES
                    + len(self.sealed) * _SEALED_BYTES + pending + sys.getsizeof(self._heap))

    # -- labels -----------------------------------------------------------------------------
    def _bodies_of(self, cids: list[str]) -> dict[str, bytes]:
        """The stored bodies of ``cids`` (memory first, then one read of the checkpoint store)."""
        out, fetch = {}, []
        for c in cids:
            b = self.bodies.get(c, _MISSING)
            if b is None:
                fetch.append(c)
            elif b is not _MISSING:
                out[c] = b
        if fetch:
            out.update(self.backing.bodies(fetch))
        return out

    def get(self, cid: str) -> LabelState | None:
        """See :meth:`ingest.store.JoinStore.get` (with its body)."""
        with self._lock:
            self._ensure()
            st = self.labels.get(cid)
            if st is None:
                return None
            return _copy(st, self._bodies_of([cid]).get(cid), self.claimed.get(cid, (None,))[0])

    def get_many(self, cids) -> dict[str, LabelState]:
        """See :meth:`ingest.store.JoinStore.get_many` (copies; ``completion`` ``""`` or None)."""
        with self._lock:
            self._ensure()
            lab, bod, cl = self.labels, self.bodies, self.claimed
            out = {}
            for c in cids:
                st = lab.get(c)
                if st is not None and c not in out:
                    out[c] = _copy(st, "" if c in bod else None, cl[c][0] if c in cl else None)
            return out

    def put(self, st: LabelState, due_at: int) -> None:
        """:meth:`put_many` of one label."""
        self.put_many([(st, due_at)])

    def put_many(self, items: list[tuple[LabelState, int]]) -> None:
        """See :meth:`ingest.store.JoinStore.put_many`. Takes ownership of the states (their
        ``completion`` and ``claim`` fields are cleared: kept apart here).

        Raises:
            OverflowError: a time that a 64-bit column cannot hold (named).
        """
        with self._lock:
            self._ensure()
            for st, due in items:
                _i64("due_at", due)
                _i64("created_at", st.created_at)
                _i64("first_seen_at", st.first_seen_at)
                cid = st.completion_id
                self._touch(cid)
                body = st.completion
                if body and cid not in self.bodies:
                    self.bodies[cid] = body.encode() if isinstance(body, str) else bytes(body)
                st.completion = st.claim = None
                self.labels[cid] = st
                if self.due_at.get(cid) != due:
                    self.due_at[cid] = due
                    if cid not in self.claimed:
                        heapq.heappush(self._heap, (due, cid))

    def delete(self, cid: str) -> None:
        """:meth:`delete_many` of one label."""
        self.delete_many([cid])

    def delete_many(self, cids: list[str]) -> None:
        """See :meth:`ingest.store.JoinStore.delete_many`."""
        with self._lock:
            self._ensure()
            for cid in cids:
                if cid in self.labels:
                    self._touch(cid)
                    del self.labels[cid]
                    self.due_at.pop(cid, None)
                    self.bodies.pop(cid, None)
                    self.claimed.pop(cid, None)

    def due(self, now: int, limit: int) -> list[LabelState]:
        """See :meth:`ingest.store.JoinStore.due` (copies, with their bodies)."""
        with self._lock:
            self._ensure()
            h, out, keep = self._heap, [], []
            seen = set()
            holding, n = self.holding, self.n
            while h and h[0][0] <= now and len(out) < limit:
                d, cid = heapq.heappop(h)
                if self.due_at.get(cid) != d or cid in self.claimed or cid in seen:
                    continue  # stale: re-pushed when it changed, or claimed (re-pushed when released)
                if holding and n and (p := home_partition(cid, n)) in holding:
                    self._held.setdefault(p, []).append((d, cid))  # back in the heap at release()
                    continue
                seen.add(cid)
                out.append(cid)
                keep.append((d, cid))
            for x in keep:
                heapq.heappush(h, x)
            if len(h) > 2 * len(self.labels) + 4096:  # stale entries: rebuild
                self._heap = [(d, c) for c, d in self.due_at.items() if c not in self.claimed]
                heapq.heapify(self._heap)
                self._held = {}  # (held labels are in the rebuilt heap: set aside again when due)
            bodies = self._bodies_of(out)
            return [_copy(self.labels[c], bodies.get(c), None) for c in out]

    def claim(self, cid: str, claim: str) -> None:
        """:meth:`claim_many` of one label."""
        self.claim_many([(cid, claim)])

    def claim_many(self, claims: list[tuple[str, str]]) -> None:
        """See :meth:`ingest.store.JoinStore.claim_many`."""
        with self._lock:
            self._ensure()
            for cid, claim in claims:
                if cid in self.labels:
                    self._touch(cid, claim_only=True)
                    self.claimed[cid] = (claim, self.owner)

    def unclaim(self, cid: str) -> None:
        """See :meth:`ingest.store.JoinStore.unclaim`."""
        with self._lock:
            self._ensure()
            if cid in self.claimed:
                self._touch(cid, claim_only=True)
                del self.claimed[cid]
                if cid in self.due_at:
                    heapq.heappush(self._heap, (self.due_at[cid], cid))

    def claims(self) -> list[tuple[str, str, str | None]]:
        """See :meth:`ingest.store.JoinStore.claims`."""
        with self._lock:
            self._ensure()
            return [(cid, c, o) for cid, (c, o) in self.claimed.items()]

    def open_count(self) -> int:
        """Labels open in this state (this worker's partitions)."""
        with self._lock:
            self._ensure()
            return len(self.labels)

    # -- dedupe and sealed sets ---------------------------------------------------------------
    def event_seen(self, eid: str) -> bool:
        """See :meth:`ingest.store.JoinStore.event_seen`."""
        return bool(self.events_seen([eid]))

    def events_seen(self, eids) -> set[str]:
        """See :meth:`ingest.store.JoinStore.events_seen`."""
        with self._lock:
            self._ensure()
            ev = self.events
            return {e for e in eids if e in ev}

    def add_event(self, eid: str, cid: str, at: int | None = None) -> None:
        """:meth:`add_events` of one event."""
        self.add_events([(eid, cid, int(time.time() * 1000) if at is None else at)])

    def _record(self, eid: str, cid: str | None, at: int) -> bool:
        if eid in self.events:
            return False
        _i64("at", at)
        st = self.labels.get(cid) if cid is not None else None
        if st is not None:
            cid = st.completion_id  # one string per label, shared with its dedupe entries
        self.events[eid] = (cid, at)
        if self._journal is not None:
            self._journal["events"].append(eid)
        return True

    def add_events(self, rows: list[tuple[str, str, int]]) -> None:
        """See :meth:`ingest.store.JoinStore.add_events`."""
        with self._lock:
            self._ensure()
            for eid, cid, at in rows:
                if self._record(eid, cid, at):
                    self._d_events.append((eid, cid, at))

    def event_homes(self, homes: dict[str, int]) -> None:
        """The partitions (``{event_id: partition}``) of the feedback events of the batch about
        to be folded, each the one it was consumed from, which is its completion's home
        partition (only records in their home partition are folded). An event among them
        that is dead-lettered with no partition given (:meth:`mark_dead`: a late vote dropped
        in the fold, or the worker recording the batch's dead letters once published) is
        checkpointed in its partition, so that only that partition's restore reads it. Kept
        until the next call."""
        self._homes = homes

    def mark_dead(self, eids: list[str], at: int | None = None, parts: list[int | None] | None = None) -> None:
        """See :meth:`ingest.store.JoinStore.mark_dead` (an event without a partition in
        ``parts`` takes the one :meth:`event_homes` gave it, if any)."""
        at = int(time.time() * 1000) if at is None else at
        if parts is not None and len(parts) != len(eids):
            raise ValueError(f"parts: {len(parts)} partitions for {len(eids)} event ids (one per event, or None)")
        with self._lock:
            self._ensure()
            homes = self._homes
            for i, eid in enumerate(eids):
                if self._record(eid, None, at):
                    p = parts[i] if parts is not None else None
                    self._d_dead.append((eid, at, homes.get(eid) if p is None else int(p)))

    def is_sealed(self, cid: str) -> bool:
        """See :meth:`ingest.store.JoinStore.is_sealed`."""
        return bool(self.sealed_among([cid]))

    def sealed_among(self, cids) -> set[str]:
        """See :meth:`ingest.store.JoinStore.sealed_among`."""
        with self._lock:
            self._ensure()
            s = self.sealed
            return {c for c in cids if c in s}

    def mark_sealed(self, cid: str, sealed_at: int, shard: str) -> None:
        """:meth:`mark_sealed_many` of one label."""
        self.mark_sealed_many([(cid, sealed_at, shard)])

    def mark_sealed_many(self, rows: list[tuple[str, int, str]]) -> None:
        """See :meth:`ingest.store.JoinStore.mark_sealed_many`."""
        with self._lock:
            self._ensure()
            j = self._journal
            for cid, at, shard in rows:
                _i64("sealed_at", at)
                if j is not None and cid not in j["sealed"]:
                    j["sealed"][cid] = self.sealed.get(cid, _MISSING)
                self.sealed[cid] = at
                self._d_sealed.append((cid, at, shard))

    def prune(self, before_ms: int) -> tuple[int, int]:
        """See :meth:`ingest.store.JoinStore.prune`: the same rule on the memory now, and on
        the checkpoint store at the next checkpoint."""
        with self._lock:
            self._ensure()
            s, lab = self.sealed, self.labels
            gone_e = [e for e, (c, at) in self.events.items() if at is not None and at < before_ms and (
                c is None or (c not in lab and not s.get(c, -1) >= before_ms))]
            gone_s = [c for c, at in s.items() if at < before_ms]
            for e in gone_e:
                del self.events[e]
            for c in gone_s:
                del s[c]
            self._prune_before = max(self._prune_before or before_ms, before_ms)
            return len(gone_e), len(gone_s)

    def dedupe_sizes(self) -> tuple[int, int]:
        """See :meth:`ingest.store.JoinStore.dedupe_sizes` (this state's rows)."""
        with self._lock:
            self._ensure()
            return len(self.events), len(self.sealed)

    # -- counters ---------------------------------------------------------------------------
    def bump(self, name: str, n: int = 1) -> None:
        """See :meth:`ingest.store.JoinStore.bump`: written at the next checkpoint."""
        if n:
            with self._lock:
                self._ctr[name] = self._ctr.get(name, 0) + n

    def counters(self) -> dict[str, int]:
        """The checkpoint store's counters plus this state's deltas not checkpointed yet."""
        with self._lock:
            out = self.backing.counters()
            for k, v in self._ctr.items():
                out[k] = out.get(k, 0) + v
            return out

    # -- checkpoints ------------------------------------------------------------------------
    def _dirty(self) -> bool:
        return bool(self._d_labels or self._d_claims or self._d_events or self._d_dead or self._d_sealed or self._ctr
                    or self._prune_before is not None)

    def checkpoint(self, offsets: dict | None = None) -> int:
        """Write what changed since the last checkpoint and ``offsets`` (``{(topic,
        partition) or TopicPartition: next offset}``, the records whose effects are folded) to
        the checkpoint store in one transaction, fenced by this worker's partition epochs.
        Returns how many labels it wrote or deleted. On failure nothing is written and the
        changes stay pending (the next checkpoint writes them).

        Raises:
            ingest.store.Fenced: a partition of this state was taken over by another worker
                (the checkpoint is not written: the new owner replays those records).
            RuntimeError: called inside a :meth:`transaction`.
        """
        with self._lock:
            if self._depth:
                raise RuntimeError("checkpoint: not inside a transaction")
            if not self._loaded or not (self._dirty() or offsets):
                return 0
            b = self.backing
            puts, dels, mine, unclaim = [], [], [], []
            for cid in self._d_labels:
                st = self.labels.get(cid)
                if st is None:
                    dels.append(cid)
                    continue
                body = self.bodies.get(cid)
                if body is not None:  # written with the label (then the reference is kept: below)
                    st.completion = body
                puts.append((st, self.due_at[cid]))
            for cid in self._d_labels | self._d_claims:  # (after the puts: a new row takes its claim)
                if cid not in self.labels:
                    continue
                c = self.claimed.get(cid)
                if c is not None and c[1] == self.owner:
                    mine.append((cid, c[0]))
                elif c is None and cid in self._d_claims:
                    unclaim.append(cid)
            try:
                self._write(b, puts, dels, mine, unclaim, offsets)
            finally:
                for st, _ in puts:  # (the stored states keep no body: it is in self.bodies)
                    st.completion = None
            for st, _ in puts:  # bodies written: keep the reference only
                if self.bodies.get(st.completion_id) is not None:
                    self.bodies[st.completion_id] = None
            n = len(puts) + len(dels)
            self._ctr = {}
            self._clear_dirty()
            self.checkpoints += 1
            return n

    def _write(self, b, puts: list, dels: list, mine: list, unclaim: list, offsets: dict | None) -> None:
        """One checkpoint's transaction (see :meth:`checkpoint`)."""
        if self.parts is not None and not self.parts and (puts or dels or mine or unclaim or self._d_sealed):
            raise Fenced(f"{len(puts) + len(dels)} label(s) changed while {self.owner} holds no partition")
        dead_at: dict[int, tuple[list[str], list[int | None]]] = {}
        for eid, at, part in self._d_dead:
            eids, parts = dead_at.setdefault(at, ([], []))
            eids.append(eid)
            parts.append(part)
        with b.transaction():
            if self.parts is not None:
                b.fence_ownership(self.parts)
            b.delete_many(dels)
            b.put_many(puts)
            b.claim_many(mine)
            for cid in unclaim:
                b.unclaim(cid)
            b.add_events(self._d_events)
            for at, (eids, parts) in dead_at.items():
                b.mark_dead(eids, at, parts)
            b.mark_sealed_many(self._d_sealed)
            if self._prune_before is not None:
                b.prune(self._prune_before)
            for k, v in self._ctr.items():
                b.bump(k, v)
            if offsets:
                b.save_offsets({((tp.topic, tp.partition) if hasattr(tp, "topic") else tuple(tp)): int(o)
                                for tp, o in offsets.items()})
