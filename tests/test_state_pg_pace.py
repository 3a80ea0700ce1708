"""The PostgreSQL join state's batched statements (``ingest.state_pg``, D66): a batch method is
one statement whatever its row count, a fold transaction a fixed number of round trips, and
the rows bound as arrays keep the contract's rules where one batch repeats an id. Real
server from ``ingest.pglocal`` (skipped when PostgreSQL is not installed)."""

from __future__ import annotations

import threading
import uuid

import pytest

from ingest.join import Joiner, LabelState
from test_ingest_join import T0, completion, vote
from test_join_store_contract import CFG, N, pg_url  # noqa: F401 - pg_url: the real server fixture


@pytest.fixture()
def schema():
    return "pace_" + uuid.uuid4().hex[:12]


@pytest.fixture()
def store(pg_url, schema):
    from ingest.state_pg import PgStateStore

    s = PgStateStore(pg_url, schema=schema, owner="w1")
    s.assign(range(N), N)
    yield s
    s.close()


class Counting:
    """Wraps a store's connection: counts the queries sent (each one round trip)."""

    def __init__(self, store):
        self.store, self.n, self.sent = store, 0, []
        self._execute = store.db.execute

        def execute(q, params=None, **kw):
            self.n += 1
            self.sent.append(q if isinstance(q, (str, bytes)) else str(q))
            return self._execute(q, params, **kw)

        store.db.execute = execute

    def reset(self) -> None:
        self.n, self.sent = 0, []


def cid(i: int) -> str:
    return str(uuid.UUID(int=i + 1))


def label(c: str, completion=None, **kw) -> LabelState:
    return LabelState(completion_id=c, completion=completion, first_seen_at=T0, **kw)


def test_a_fold_is_a_fixed_number_of_round_trips_whatever_its_size(store):
    j = Joiner(store, CFG)
    q = Counting(store)
    sizes = []
    for n in (1, 40):
        comps = [completion(created_at=T0) for _ in range(n)]
        votes = [vote(c.completion_id, f"u{u}", 1, created_at=T0) for c in comps for u in range(3)]
        q.reset()
        with store.transaction():
            store.fence([0, 1, 2])
            assert j.on_completions([(c, c.model_dump_json()) for c in comps], now=T0) == ["new"] * n
            assert [o for o, _ in j.on_feedbacks([(v, None) for v in votes], now=T0)] == ["folded"] * (3 * n)
            store.bump("consumed_feedback", len(votes))
        sizes.append(q.n)
    # BEGIN + fence; sealed, labels, put; seen, sealed, labels, put, events; counters + COMMIT
    assert sizes == [10, 10], q.sent
    assert q.sent[0].startswith("BEGIN; SELECT part") and q.sent[-1].endswith(b"; COMMIT")
    c = store.counters()
    assert (c["completions"], c["feedback_folded"], c["consumed_feedback"]) == (41, 123, 123)
    assert store.open_count() == 41 and store.dedupe_sizes() == (123, 0)


def test_repeated_ids_in_one_batch(store):
    a, b = cid(1), cid(2)
    with store.transaction():  # labels: the last pair wins; bodies: the first one
        store.put_many([(label(a, b"first", seq=1), T0 + 1), (label(b), T0 + 2), (label(a, b"second", seq=2), T0 + 3)])
    got = store.get(a)
    assert (bytes(got.completion), got.seq) == (b"first", 2)
    with store.transaction():
        assert [s.completion_id for s in store.due(T0 + 2, 10)] == [b]  # a is due at T0+3 (its last pair)
        store.claim_many([(a, "shard:x"), (b, "dead:"), (a, "shard:y")])
    assert sorted(store.claims()) == [(a, "shard:y", "w1"), (b, "dead:", "w1")]
    with store.transaction():  # dedupe set: the first row of an event wins, in one batch and across
        store.add_events([("e1", a, 5), ("e2", None, 6), ("e1", b, 7)])
        store.add_events([("e2", a, 8)])
        store.mark_dead(["e3", "e3", "e1"], 9)
        store.mark_sealed_many([(a, 10, "s1"), (b, 11, "s2"), (a, 12, "s3")])
    rows = store.db.execute("SELECT event_id, completion_id, at FROM events ORDER BY event_id").fetchall()
    assert rows == [("e1", a, 5), ("e2", None, 6), ("e3", None, 9)]
    assert store.db.execute("SELECT completion_id, sealed_at, shard FROM sealed ORDER BY sealed_at").fetchall() == [
        (b, 11, "s2"), (a, 12, "s3")]
    assert store.events_seen(["e1", "e2", "e3", "e4", "e1"]) == {"e1", "e2", "e3"}
    assert store.sealed_among([a, b, cid(3)]) == {a, b}
    with store.transaction():
        store.delete_many([a, a, b])
    assert store.open_count() == 0 and store.db.execute("SELECT count(*) FROM completions").fetchone()[0] == 0


def test_text_that_needs_quoting_in_arrays_round_trips(store):
    odd = ['say "hi"', "back\\slash", "{a,b}", "NULL", "", " lead", "é ünï 中", "comma,", "tab\there"]
    ids = [f"id-{i}-{s}" for i, s in enumerate(odd)]
    with store.transaction():
        store.put_many([(label(c, s.encode() or None, pending_raw={"e": s}), T0) for c, s in zip(ids, odd)])
        store.claim_many([(c, "shard:" + s) for c, s in zip(ids, odd)])
        store.add_events([(s, c, T0) for c, s in zip(ids, odd)])
        store.mark_sealed_many([(c, T0, s) for c, s in zip(ids, odd)])
    many = store.get_many(ids)
    assert sorted(many) == sorted(ids)
    for c, s in zip(ids, odd):
        got = store.get(c)
        assert got.pending_raw == {"e": s} and got.claim == "shard:" + s
        assert (bytes(got.completion) if got.completion is not None else None) == (s.encode() or None)
    assert store.events_seen(odd) == set(odd) and store.sealed_among(ids) == set(ids)
    assert store.get_many([]) == {} and store.events_seen([]) == set() and store.sealed_among([]) == set()


def test_a_failing_statement_rolls_back_the_whole_transaction(store):
    import psycopg

    a, b = cid(1), cid(2)
    with store.transaction():
        store.put(label(a, b"A"), T0)
    with pytest.raises(psycopg.DataError):  # bigint out of range, as a record's value could cause
        with store.transaction():
            store.fence([0])
            store.put(label(b, b"B"), T0)
            store.bump("completions")
            store.add_events([("e1", b, 2 ** 70)])
    assert store.get(b) is None and store.open_count() == 1 and "completions" not in store.counters()
    with store.transaction():  # the session is usable again
        store.fence([0, 1, 2])
        store.put(label(b, b"B"), T0)
        store.bump("completions")
    assert store.open_count() == 2 and store.counters()["completions"] == 1


def test_transactions_that_send_nothing_or_only_counters(store):
    q = Counting(store)
    with store.transaction():
        pass
    assert q.n == 0
    with store.transaction():
        store.bump("x", 2)
    assert q.n == 1 and store.counters()["x"] == 2  # the counters alone, one atomic statement
    q.reset()
    with pytest.raises(KeyError):
        with store.transaction():
            store.bump("x", 5)
            raise KeyError("before any statement")
    assert q.n == 0 and store.counters()["x"] == 2
    store.bump("x")  # outside a transaction: at once
    assert store.counters()["x"] == 3
    assert store.db.info.transaction_status == 0  # idle: no transaction left open


def test_the_fence_still_holds_a_takeover_until_the_fold_commits(pg_url, schema, store):
    from ingest.state_pg import Fenced, PgStateStore

    other = PgStateStore(pg_url, schema=schema, owner="w2", takeover_wait_s=5.0)
    try:
        took = threading.Event()
        with store.transaction():
            store.fence([1])  # BEGIN and the shared lock in one query
            t = threading.Thread(target=lambda: (other.assign([1], N), took.set()))
            t.start()
            assert not took.wait(0.5)  # the takeover waits for this fold
            store.put(label(cid(7)), T0)
        t.join(10)
        assert took.is_set()
        with pytest.raises(Fenced):
            with store.transaction():
                store.fence([1])
    finally:
        other.close()


def test_text_round_trips_in_a_database_that_is_not_utf8(pg_url, schema):
    """Found by a new user: in a LATIN1 database the binary ``text[]`` arrays (UTF-8 bytes)
    were read as LATIN1, so a user ``é`` voting three times became three users. The store's
    connection speaks UTF-8; the server converts."""
    import psycopg

    from ingest.state_pg import PgStateStore

    db = "lat_" + uuid.uuid4().hex[:8]
    with psycopg.connect(pg_url, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {db} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    s = PgStateStore(pg_url.rsplit("/", 1)[0] + "/" + db, schema=schema, owner="w1")
    try:
        s.assign(range(N), N)
        j = Joiner(s, CFG)
        c = completion()
        j.on_completion(c, now=T0)
        for i, v in enumerate((1, -1, 1)):
            j.on_feedback(vote(c.completion_id, "é", v, T0 + i), now=T0 + i)
        st = s.get(str(c.completion_id))
        assert list(st.votes) == ["é"] and st.votes["é"].value == 1
        (sample,) = j.tick(T0 + 10 ** 6).samples
        assert (sample.n_votes, sample.label) == (1, True)
    finally:
        s.close()
