"""A restore reads only the partitions it takes (``docs/decisions.md`` D88).

The dedupe (``events``) and sealed rows carry ``part``, the home partition of their
``completion_id`` (and so do SQLite's labels, as PostgreSQL's did), so that
``CheckpointStore.snapshot`` reads the taken partitions' rows by an index instead of the whole
fleet's. Checked on both checkpoint stores (SQLite file; PostgreSQL, a real server from
``ingest.pglocal``, skipped when not installed): the rows read are counted on the connection
and compared with an expectation built by hand from kafka-python's murmur2; a database of
the earlier layout (built here with its DDL) opens, is migrated in place, restores by
partition and still dedupes a redelivered vote; a vote dead-lettered in a fold is recorded in
the partition it was folded in.
"""

from __future__ import annotations

import random
import sqlite3
import time
import uuid
from pathlib import Path

import pytest

from ingest.join import JoinConfig, Joiner
from ingest.keyed import KeyedState
from ingest.label import LabelState
from ingest.state import StateStore
from test_ingest_keyed import CFG, T0, completion, fold, vote
from test_ingest_multihost import pg  # noqa: F401 - the PostgreSQL server fixture

HAVE_PG = any(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
N = 6  # partitions of the consumed topics
BACKENDS = ["sqlite", pytest.param("pg", marks=pytest.mark.skipif(not HAVE_PG, reason="PostgreSQL not installed"))]


def kafka_home(cid: str, n: int = N) -> int:
    """Kafka's default partitioner, as kafka-python computes it (the reference)."""
    from kafka.partitioner.default import murmur2

    return (murmur2(cid.encode()) & 0x7FFFFFFF) % n


def ids_by_partition(k: int, seed: int) -> dict[int, list[str]]:
    """``k`` completion ids of each partition ``0..N-1`` (reproducible)."""
    rng, out = random.Random(seed), {p: [] for p in range(N)}
    while min(map(len, out.values())) < k:
        cid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if len(out[kafka_home(cid)]) < k:
            out[kafka_home(cid)].append(cid)
    return out


class Counting:
    """A connection whose cursors count the rows fetched through them (``rows``)."""

    def __init__(self, db):
        self._db, self.rows = db, 0

    def execute(self, *a, **kw):
        cur, outer = self._db.execute(*a, **kw), self

        class Cursor:
            def fetchall(self):
                rows = cur.fetchall()
                outer.rows += len(rows)
                return rows

            def fetchone(self):
                row = cur.fetchone()
                outer.rows += row is not None
                return row

            def __iter__(self):
                for row in cur:
                    outer.rows += 1
                    yield row

            def __getattr__(self, name):
                return getattr(cur, name)

        return Cursor()

    def __getattr__(self, name):
        return getattr(self._db, name)


def opener(kind: str, tmp_path: Path, request):
    """``open(owner)`` of stores of one kind on one state (PostgreSQL: a fresh schema)."""
    if kind == "sqlite":
        return lambda owner: StateStore(tmp_path / "state.sqlite", owner=owner)
    from ingest.state_pg import PgStateStore

    url, schema = request.getfixturevalue("pg").url, "restore_" + uuid.uuid4().hex[:10]
    return lambda owner: PgStateStore(url, schema=schema, owner=owner)


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_restore_reads_only_the_rows_of_the_partitions_it_takes(kind, tmp_path, request):
    open_ = opener(kind, tmp_path, request)
    ids = ids_by_partition(3, seed=1)
    a = open_("a")
    a.take_ownership(range(N), N)
    labels, events, sealed, dead = {}, {}, {}, {}
    with a.transaction():
        for p in range(N):
            for cid in ids[p][:2]:  # two open labels, two votes each
                labels[cid] = p
                a.put(LabelState(completion_id=cid, first_seen_at=T0, completion=b"{}"), T0 + 10_000)
                for i in range(2):
                    events[f"{cid}-v{i}"] = p
                    a.add_event(f"{cid}-v{i}", cid, T0)
            sealed[ids[p][2]] = p  # one sealed label
            a.mark_sealed(ids[p][2], T0, f"shard-{p}")
            events[f"{ids[p][2]}-v"] = p
            a.add_event(f"{ids[p][2]}-v", ids[p][2], T0)
            dead[f"dead-{p}"] = p  # a vote dead-lettered in partition p
        a.mark_dead(list(dead), T0, list(dead.values()))
        a.mark_dead(["dead-anywhere"], T0)  # partition unknown: every restore reads it
    a.close()

    take = [1, 4]
    b = open_("b")
    b.take_ownership(take, N)
    b.db = counting = Counting(b.db)
    got_labels, got_events, got_sealed = b.snapshot(take, N)
    b.db = counting._db
    want_labels = {c for c, p in labels.items() if p in take}
    want_events = {e for e, p in {**events, **dead}.items() if p in take} | {"dead-anywhere"}
    want_sealed = {c for c, p in sealed.items() if p in take}
    assert {r[0] for r in got_labels} == want_labels and len(want_labels) == 4
    assert {r[0] for r in got_events} == want_events and len(want_events) == 4 * 2 + 2 + 2 + 1
    assert {r[0] for r in got_sealed} == want_sealed and len(want_sealed) == 2
    # read: exactly those rows, not the whole fleet's (6 partitions: 12 labels, 31 dedupe rows, 6 sealed)
    assert counting.rows == len(want_labels) + len(want_events) + len(want_sealed) == 19
    assert {r[0]: r[1] for r in got_events}["dead-anywhere"] is None

    k = KeyedState(b)  # the worker's restore path
    k.assign(take, N)
    assert k.restored == (4, 13, 2) and k.open_count() == 4
    k.close()


# the layout before D88, as each store created it
OLD_SQLITE = """
CREATE TABLE labels(completion_id TEXT PRIMARY KEY, state TEXT NOT NULL, due_at INTEGER NOT NULL, claim TEXT,
    owner TEXT);
CREATE INDEX labels_due ON labels(due_at);
CREATE TABLE completions(completion_id TEXT PRIMARY KEY, seg TEXT, off INTEGER, len INTEGER, body BLOB);
CREATE TABLE events(event_id TEXT PRIMARY KEY, completion_id TEXT, at INTEGER);
CREATE TABLE sealed(completion_id TEXT PRIMARY KEY, sealed_at INTEGER NOT NULL, shard TEXT);
CREATE TABLE counters(name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE partitions(part INTEGER PRIMARY KEY, owner TEXT, epoch INTEGER NOT NULL);
CREATE TABLE offsets(topic TEXT NOT NULL, part INTEGER NOT NULL, next_offset INTEGER NOT NULL,
    PRIMARY KEY(topic, part));
CREATE INDEX labels_claim ON labels(claim) WHERE claim IS NOT NULL;
CREATE INDEX events_at ON events(at);
CREATE INDEX sealed_at ON sealed(sealed_at);
"""
OLD_PG = """
CREATE TABLE labels(completion_id TEXT PRIMARY KEY, part INT NOT NULL, state TEXT NOT NULL,
    due_at BIGINT NOT NULL, claim TEXT, owner TEXT);
CREATE INDEX labels_due ON labels(part, due_at) WHERE claim IS NULL;
CREATE INDEX labels_claim ON labels(part) WHERE claim IS NOT NULL;
CREATE TABLE completions(completion_id TEXT PRIMARY KEY, body BYTEA NOT NULL);
CREATE TABLE events(event_id TEXT PRIMARY KEY, completion_id TEXT, at BIGINT);
CREATE INDEX events_at ON events(at);
CREATE TABLE sealed(completion_id TEXT PRIMARY KEY, sealed_at BIGINT NOT NULL, shard TEXT);
CREATE INDEX sealed_at ON sealed(sealed_at);
CREATE TABLE counters(owner TEXT NOT NULL, name TEXT NOT NULL, value BIGINT NOT NULL, PRIMARY KEY(owner, name));
CREATE TABLE partitions(part INT PRIMARY KEY, owner TEXT, epoch BIGINT NOT NULL);
CREATE TABLE owners(owner TEXT PRIMARY KEY, lock_key BIGINT NOT NULL, host TEXT, started_at BIGINT);
CREATE TABLE offsets(topic TEXT NOT NULL, part INT NOT NULL, next_offset BIGINT NOT NULL, PRIMARY KEY(topic, part))
"""


def old_rows(home: int, other: int):
    """Rows of a join state as the earlier layout held them: in partition ``home`` an open
    label with a vote and a sealed label with a vote and a late vote dead-lettered (no
    completion); in partition ``other`` an open label with a vote. Returns ``(rows per table,
    the votes)``."""
    ids = ids_by_partition(2, seed=2)
    c_open, c_sealed, c_other = ids[home][0], ids[home][1], ids[other][0]
    j = Joiner(StateStore(":memory:"), CFG)
    votes = {"sealed": vote(uuid.UUID(c_sealed), "u1", 1), "open": vote(uuid.UUID(c_open), "u1", -1),
             "other": vote(uuid.UUID(c_other), "u2", 1), "late": vote(uuid.UUID(c_sealed), "u3", 1)}
    fold(j, [completion(uuid.UUID(c_sealed))], [votes["sealed"]])
    res = j.tick(T0 + 11_000)
    j.commit_sealed(res.samples, "shard-old")
    fold(j, [completion(uuid.UUID(c_open)), completion(uuid.UUID(c_other))], [votes["open"], votes["other"]],
         now=T0 + 11_000)
    (outcome, dl), = j.on_feedbacks([(votes["late"], None)], T0 + 12_000)
    assert outcome == "late" and dl is not None
    j.mark_dead([str(votes["late"].event_id)])
    db = j.store.db
    rows = {"labels": db.execute("SELECT completion_id, state, due_at, claim, owner FROM labels").fetchall(),
            "completions": db.execute("SELECT completion_id, body FROM completions").fetchall(),
            "events": db.execute("SELECT event_id, completion_id, at FROM events").fetchall(),
            "sealed": db.execute("SELECT completion_id, sealed_at, shard FROM sealed").fetchall()}
    assert (len(rows["labels"]), len(rows["events"]), len(rows["sealed"])) == (2, 4, 1)
    return rows, votes


def build_old(kind: str, tmp_path: Path, request, rows) -> callable:
    """An earlier-layout database holding ``rows``; returns ``open(owner)`` of a store on it."""
    if kind == "sqlite":
        path = tmp_path / "old.sqlite"
        db = sqlite3.connect(path)
        db.executescript(OLD_SQLITE)
        db.executemany("INSERT INTO labels VALUES(?,?,?,?,?)", rows["labels"])
        db.executemany("INSERT INTO completions(completion_id, body) VALUES(?,?)", rows["completions"])
        db.executemany("INSERT INTO events VALUES(?,?,?)", rows["events"])
        db.executemany("INSERT INTO sealed VALUES(?,?,?)", rows["sealed"])
        db.commit()
        db.close()
        return lambda owner: StateStore(path, owner=owner)
    import psycopg

    from ingest.state_pg import PgStateStore

    url, schema = request.getfixturevalue("pg").url, "old_" + uuid.uuid4().hex[:10]
    with psycopg.connect(url, autocommit=True) as db, db.transaction():
        db.execute(f"CREATE SCHEMA {schema}")
        db.execute(f"SET search_path TO {schema}")
        for stmt in OLD_PG.split(";"):
            db.execute(stmt)
        with db.cursor() as cur:  # labels carried their partition already
            cur.executemany("INSERT INTO labels VALUES(%s,%s,%s,%s,%s,%s)",
                            [(r[0], kafka_home(r[0]), *r[1:]) for r in rows["labels"]])
            cur.executemany("INSERT INTO completions VALUES(%s,%s)", [(c, bytes(b)) for c, b in rows["completions"]])
            cur.executemany("INSERT INTO events VALUES(%s,%s,%s)", rows["events"])
            cur.executemany("INSERT INTO sealed VALUES(%s,%s,%s)", rows["sealed"])
    return lambda owner: PgStateStore(url, schema=schema, owner=owner)


@pytest.mark.parametrize("kind", BACKENDS)
def test_an_old_database_is_migrated_and_a_redelivered_vote_is_still_deduped(kind, tmp_path, request):
    home, other = 2, 5
    rows, votes = old_rows(home, other)
    open_ = build_old(kind, tmp_path, request, rows)
    s = open_("b")  # opened: the columns are added, nothing is partitioned yet
    parts = lambda t, k: dict(s.db.execute(f"SELECT {k}, part FROM {t}").fetchall())  # noqa: E731
    assert set(parts("events", "event_id").values()) == {None}
    assert set(parts("sealed", "completion_id").values()) == {None}
    k = KeyedState(s)
    j = Joiner(k, CFG)
    k.assign([home], N)
    # restored: partition `home` only (its two labels' rows) and the dead letter of no partition
    c_open, c_sealed = str(votes["open"].completion_id), str(votes["sealed"].completion_id)
    assert k.restored == (1, 3, 1) and k.owned() == [home]
    assert set(k.labels) == {c_open} and set(k.sealed) == {c_sealed}
    assert set(k.events) == {str(votes[v].event_id) for v in ("open", "sealed", "late")}
    # migrated in place: every row with a completion has its home partition (kafka-python's
    # murmur2), the dead letter keeps none, the partition count is recorded
    want = {r[0]: (kafka_home(r[1]) if r[1] else None) for r in rows["events"]}
    assert parts("events", "event_id") == want and None in want.values()
    assert parts("sealed", "completion_id") == {c_sealed: home}
    assert parts("labels", "completion_id") == {r[0]: kafka_home(r[0]) for r in rows["labels"]}
    assert s.db.execute("SELECT value FROM meta WHERE name='partition_count'").fetchone()[0] == N
    # redelivered after the restore: deduped; a new vote for the sealed label: late
    again = fold(j, [], [votes["open"], votes["sealed"], votes["late"]], now=T0 + 13_000)
    assert [o for o, _ in again] == ["duplicate"] * 3
    assert [o for o, _ in fold(j, [], [vote(uuid.UUID(c_sealed), "u4", 1)], now=T0 + 13_000)] == ["late"]
    k.checkpoint()
    k.close()
    # another worker takes the other partition: its label, not this one's
    k2 = KeyedState(open_("c"))
    k2.assign([other], N)
    assert set(k2.labels) == {str(votes["other"].completion_id)} and k2.restored == (1, 2, 0)
    k2.close()


def test_a_restore_among_another_partition_count_repartitions_every_row(tmp_path):
    """The rows were partitioned among 6; a restore among 4 recomputes every row's partition
    (a dead letter's becomes unknown: restored with every partition)."""
    ids = ids_by_partition(1, seed=3)
    s = StateStore(tmp_path / "state.sqlite", owner="a")
    s.take_ownership(range(N), N)
    with s.transaction():
        for p in range(N):
            s.add_event(f"e{p}", ids[p][0], T0)
            s.mark_sealed(ids[p][0], T0, "x")
        s.mark_dead(["dead"], T0, [3])
    s.take_ownership([0], 4)
    assert dict(s.db.execute("SELECT event_id, part FROM events")) == {
        **{f"e{p}": kafka_home(ids[p][0], 4) for p in range(N)}, "dead": None}
    assert dict(s.db.execute("SELECT completion_id, part FROM sealed")) == {
        ids[p][0]: kafka_home(ids[p][0], 4) for p in range(N)}
    _, events, sealed = s.snapshot([0], 4)
    assert {e for e, _, _ in events} == {f"e{p}" for p in range(N) if kafka_home(ids[p][0], 4) == 0} | {"dead"}
    s.close()


@pytest.mark.parametrize("policy", ["deadletter", "drop"])
def test_a_vote_dead_lettered_in_a_fold_is_recorded_in_its_partition(tmp_path, policy):
    """Through the worker's processor (no Kafka): a late vote dead-lettered (recorded by the
    worker once published) or dropped (recorded by the join) gets the partition it was folded
    in; only that partition's restore reads it, and a redelivery there is a duplicate."""
    from ingest.app import IngestConfig
    from ingest.processor import Processor
    from schemas.settings import topic_names
    from test_ingest_poison import TP, Rec, completion as completion_json, vote as vote_json

    cfg = IngestConfig(join=JoinConfig(seal_after_s=0.001, max_label_age_s=3600, orphan_ttl_s=600, late_policy=policy),
                       bootstrap="127.0.0.1:1", samples_dir=tmp_path / "samples", state_path=tmp_path / "state.sqlite",
                       catalog=tmp_path / "catalog.duckdb")
    topics = topic_names()
    p = Processor(cfg)
    try:
        p.partition_count = N  # as the runtime sets it from the assignment
        p.store.assign(range(N), N)
        part = 3
        cid = ids_by_partition(1, seed=4)[part][0]
        p.fold({TP(topics.completions, part): [Rec(cid.encode(), completion_json(cid), 0, ())],
                TP(topics.feedback, part): [Rec(cid.encode(), vote_json(cid, "u1"), 0, ())]})
        time.sleep(0.01)
        msgs, _, _ = p.seal_round()
        assert len(msgs) == 1
        late = vote_json(cid, "u9")
        dead, eids, _, _ = p.fold({TP(topics.feedback, part): [Rec(cid.encode(), late, 0, ())]})
        if policy == "deadletter":
            assert [d.field for d in dead] == ["completion_id"] and len(eids) == 1
            with p.store.transaction():
                p.store.mark_dead(eids)  # what the worker does once the dead letter is published
        else:
            assert dead == [] and eids == []
        p.store.checkpoint()
        import json

        eid = json.loads(late)["event_id"]
        db = sqlite3.connect(tmp_path / "state.sqlite")
        assert db.execute("SELECT completion_id, part FROM events WHERE event_id=?", (eid,)).fetchone() == (None, part)
        db.close()
    finally:
        p.store.close()
    for taken, has in (([part], True), ([0, 1, 2, 4, 5], False)):
        k = KeyedState(StateStore(tmp_path / "state.sqlite", owner=f"peek-{taken[0]}"))
        k.assign(taken, N)
        assert (eid in k.events) is has
        if has:  # redelivered to its partition: a duplicate, not a second dead letter
            from schemas.events import FeedbackEvent

            (outcome, dl), = Joiner(k, cfg.join).on_feedbacks([(FeedbackEvent.model_validate_json(late), None)])
            assert (outcome, dl) == ("duplicate", None)
        k.close()
