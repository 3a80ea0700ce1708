"""The contract of ``ingest.store.JoinStore``, once, on both stores: SQLite
(``ingest.state.StateStore``, a file) and PostgreSQL (``ingest.state_pg.PgStateStore``, a real
server from ``ingest.pglocal``, one per module, a fresh schema per test; skipped when
PostgreSQL is not installed). Each expected value is computed by hand from the method's
docstring in ``ingest/store.py``; the last tests run the Joiner over the interface.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from ingest.join import JoinConfig, Joiner, LabelState
from ingest.store import JoinStore
from test_ingest_join import T0, completion, vote

HAVE_PG = any(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
CFG = JoinConfig(seal_after_s=10, max_label_age_s=100, orphan_ttl_s=20)
N = 3  # partitions: the PostgreSQL store owns all of them (assign), so any label may be put


@pytest.fixture(scope="module")
def pg_url():
    if not HAVE_PG:
        pytest.skip("PostgreSQL not installed (apt-get install -y postgresql)")
    from ingest import pglocal

    srv = pglocal.start()
    yield srv.url
    srv.stop()


class Backend:
    """Opens stores of one kind on one state, and kills one (its process gone, its lock
    released, its registration left behind, as after SIGKILL)."""

    def __init__(self, kind: str, tmp_path: Path, request):
        self.kind, self.opened = kind, []
        if kind == "sqlite":
            self.spec = tmp_path / "state.sqlite"
        else:
            self.spec = request.getfixturevalue("pg_url")
            self.schema = "contract_" + uuid.uuid4().hex[:12]

    def open(self, owner: str | None = None) -> JoinStore:
        if self.kind == "sqlite":
            from ingest.state import StateStore

            s = StateStore(self.spec, owner=owner)
        else:
            from ingest.state_pg import PgStateStore

            s = PgStateStore(self.spec, schema=self.schema, owner=owner)
        s.assign(range(N), N)
        self.opened.append(s)
        return s

    def kill(self, s: JoinStore) -> None:
        if self.kind == "sqlite":
            os.close(s._owner_fd)  # the kernel drops the flock; the lock file stays
            s._owner_fd = None
        else:
            import psycopg

            pid = s.db.info.backend_pid
            s.db.close()  # the server drops the advisory lock when the backend exits; the owners row stays
            deadline = time.monotonic() + 10  # the backend exits after the client's Terminate, not with it
            with psycopg.connect(self.spec, autocommit=True) as c:
                while c.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0]:
                    assert time.monotonic() < deadline, f"backend {pid} still runs 10 s after its client closed"
                    time.sleep(0.02)

    def close(self) -> None:
        for s in self.opened:
            try:
                s.close()
            except Exception:  # noqa: BLE001 - a killed store
                pass


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request, tmp_path):
    b = Backend(request.param, tmp_path, request)
    yield b
    b.close()


@pytest.fixture()
def store(backend) -> JoinStore:
    return backend.open("w1")


def label(cid: str, completion=None, **kw) -> LabelState:
    return LabelState(completion_id=cid, completion=completion, first_seen_at=T0, **kw)


def cids(n: int) -> list[str]:
    return [str(uuid.UUID(int=i + 1)) for i in range(n)]


def test_both_stores_are_join_stores(store, backend):
    assert isinstance(store, JoinStore)
    assert store.owner == "w1" and store.scoped == (backend.kind == "postgresql")
    Joiner(store, CFG)  # accepted
    with pytest.raises(TypeError, match="not a JoinStore .*missing .*claim_many"):
        Joiner(object(), CFG)


def test_put_get_first_body_wins(store):
    a, b, c = cids(3)
    with store.transaction():
        store.put_many([(label(a, b'{"body": 1}', created_at=T0), T0 + 5), (label(b), T0 + 6)])
        store.put(label(a, b'{"body": 2}', created_at=T0, seq=7), T0 + 9)  # a second body: kept out
    got = store.get(a)
    assert (bytes(got.completion), got.seq, got.claim, got.created_at) == (b'{"body": 1}', 7, None, T0)
    assert store.get(b).completion is None and store.get(c) is None
    many = store.get_many([a, b, c, a])
    assert sorted(many) == [a, b] and many[a].completion == "" and many[b].completion is None
    with store.transaction():  # a state read by get_many ("" body) put back keeps the stored body
        store.put_many([(many[a], T0 + 9)])
        store.put_many([(label(b, "late body"), T0 + 6)])  # the first body of b (a str)
    assert bytes(store.get(a).completion) == b'{"body": 1}' and bytes(store.get(b).completion) == b"late body"
    assert store.open_count() == 2


def test_due_earliest_first_without_claimed(store):
    a, b, c, d = cids(4)
    with store.transaction():
        store.put_many([(label(a, b"A"), 300), (label(b, b"B"), 100), (label(c), 200), (label(d, b"D"), 150)])
        store.claim(d, "shard:x")
    with store.transaction():
        due = store.due(250, 10)
    assert [s.completion_id for s in due] == [b, c]  # a is not due, d is claimed
    assert [bytes(s.completion) if s.completion else None for s in due] == [b"B", None]
    with store.transaction():
        assert [s.completion_id for s in store.due(1_000, 1)] == [b]
        assert [s.completion_id for s in store.due(99, 10)] == []


def test_claim_unclaim_delete(store):
    a, b, c = cids(3)
    with store.transaction():
        store.put_many([(label(a, b"A"), 100), (label(b, b"B"), 100)])
        store.claim_many([(a, "shard:/s/1.parquet"), (b, "dead:"), (c, "bad:")])  # c: no label, ignored
    with store.transaction():
        assert sorted(store.claims()) == [(a, "shard:/s/1.parquet", "w1"), (b, "dead:", "w1")]
        assert store.due(1_000, 10) == []
    assert store.get(a).claim == "shard:/s/1.parquet" and store.get_many([b])[b].claim == "dead:"
    with store.transaction():
        store.unclaim(b)
    with store.transaction():
        assert store.claims() == [(a, "shard:/s/1.parquet", "w1")]
        assert [s.completion_id for s in store.due(1_000, 10)] == [b]
        store.delete_many([a, c])
        store.delete(b)
    assert store.open_count() == 0 and store.get(a) is None
    with store.transaction():  # the body went with the label
        store.put(label(a), 100)
    assert store.get(a).completion is None


def test_dedupe_set_first_row_wins(store):
    a = cids(1)[0]
    with store.transaction():
        store.add_events([("e1", a, T0), ("e2", a, T0 + 1)])
        store.add_event("e1", a, T0 + 10**9)  # already recorded: the first row (at T0) stays
        store.mark_dead(["e3", "e2"], at=T0)  # e2 stays folded into a
    assert store.events_seen(["e1", "e3", "e9", "e1"]) == {"e1", "e3"}
    assert store.event_seen("e2") and not store.event_seen("e9")
    assert store.dedupe_sizes() == (3, 0)
    with store.transaction():  # nothing open or sealed holds them: all older than T0 + 5 go
        assert store.prune(T0 + 5) == (3, 0)


def test_sealed_set_second_record_replaces(store):
    a, b, c = cids(3)
    with store.transaction():
        store.mark_sealed_many([(a, T0, "s1"), (b, T0, "s1")])
        store.mark_sealed(a, T0 + 1_000, "s2")  # replaces a's row: sealed later
    assert store.sealed_among([a, b, c, a]) == {a, b} and store.is_sealed(b) and not store.is_sealed(c)
    with store.transaction():
        assert store.prune(T0 + 500) == (0, 1)  # b only: a was re-sealed after the horizon
    assert store.sealed_among([a, b]) == {a}


def test_prune_keeps_events_of_open_and_recently_sealed_labels(store):
    open_, gone, old, recent = cids(4)
    with store.transaction():
        store.put(label(open_), T0)
        store.add_events([("e-open", open_, 10), ("e-gone", gone, 10), ("e-old", old, 10), ("e-recent", recent, 10),
                          ("e-new", gone, 900)])
        store.mark_dead(["d-old"], at=10)
        store.mark_dead(["d-new"], at=900)
        store.mark_sealed_many([(old, 100, "s"), (recent, 600, "s")])
    assert store.dedupe_sizes() == (7, 2)
    with store.transaction():
        # events before 500 whose label is neither open nor sealed at/after 500: e-gone, e-old,
        # d-old; sealed before 500: old
        assert store.prune(500) == (3, 1)
    assert store.events_seen(["e-open", "e-gone", "e-old", "e-recent", "e-new", "d-old", "d-new"]) == \
        {"e-open", "e-recent", "e-new", "d-new"}
    assert store.dedupe_sizes() == (4, 1)


def test_counters_are_written_with_their_transaction(store):
    store.bump("outside", 2)  # outside a transaction: at once
    store.bump("zero", 0)
    with store.transaction():
        store.bump("samples", 3)
        store.bump("samples")
        assert store.counters()["samples"] == 4  # the open unit's bumps are counted
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.bump("samples", 100)
            store.put(label(cids(1)[0]), 1)
            raise RuntimeError("rolled back")
    assert store.counters() == {"outside": 2, "samples": 4}
    assert store.open_count() == 0  # the label went with the failed unit


def test_counters_sum_over_owners(backend):
    a, b = backend.open("w1"), backend.open("w2")
    a.bump("samples", 3)
    with b.transaction():
        b.bump("samples", 4)
        b.bump("late")
    assert a.counters() == b.counters() == {"samples": 7, "late": 1}


def test_owners_alive_dead_and_forgotten(backend):
    me, peer, gone = backend.open("w1"), backend.open("w2"), backend.open("w3")
    assert me.owner_alive("w1") and me.owner_alive("w2")
    assert not me.owner_alive(None) and not me.owner_alive("never-started")
    backend.kill(gone)
    assert not me.owner_alive("w3") and me.dead_owners() == ["w3"]
    me.forget_owner("w3")
    assert me.dead_owners() == []
    peer.close()  # a clean exit unregisters
    assert not me.owner_alive("w2") and me.dead_owners() == []


def test_partitions_assign_revoke_and_fencing(backend):
    from ingest.partition import home_partition
    from ingest.state_pg import Fenced

    s = backend.open("w1")
    assert sorted(s.assign([2, 0, 2], N)) == [0, 2] and s.owned() == [0, 2]
    with s.transaction():
        s.fence([0, 2])
    other = next(c for c in (str(uuid.uuid4()) for _ in range(1000)) if home_partition(c, N) == 1)
    if not s.scoped:  # one shared file: every label is reachable, fencing is a no-op
        with s.transaction():
            s.fence([1])
            s.put(label(other), 1)
        assert s.open_count() == 1
    else:
        with pytest.raises(Fenced, match="partitions \\[1\\]"):
            with s.transaction():
                s.put(label(other), 1)
        with pytest.raises(Fenced):
            with s.transaction():
                s.fence([1])
        peer = backend.open("w2")  # takes every partition over: the next epoch
        assert peer.assign(range(N), N) == {0: 2, 1: 2, 2: 2}
        with pytest.raises(Fenced, match="partition 0: owned by w2"):
            with s.transaction():
                s.fence([0])
    s.revoke()
    assert s.owned() == []


# -- the Joiner over the interface --------------------------------------------------------------
def test_fold_dedupe_last_vote_seal_late(store):
    j = Joiner(store, CFG)
    c = completion()
    cid = str(c.completion_id)
    assert j.on_completions([(c, None), (c, None)], now=T0) == ["new", "duplicate"]
    v1, v2 = vote(c.completion_id, "u1", 1, created_at=T0), vote(c.completion_id, "u2", 1, created_at=T0)
    flip = vote(c.completion_id, "u1", -1, created_at=T0 + 5)
    out = j.on_feedbacks([(v1, None), (v1, None), (v2, None), (flip, None)], now=T0 + 1)
    assert [o for o, _ in out] == ["folded", "duplicate", "folded", "folded"]
    assert j.tick(T0 + 1 + 9_999).samples == []
    res = j.tick(T0 + 1 + 10_000, shard_for=lambda s: "shard-1")
    (s,) = res.samples
    # u1's last vote is the flip: one up (u2), one down (u1), mean reward 0
    assert (s.votes_up, s.votes_down, s.n_votes, s.reward, s.label) == (1, 1, 2, 0.0, False)
    assert s.event_ids == [str(v1.event_id), str(v2.event_id), str(flip.event_id)]
    with store.transaction():
        assert store.claims() == [(cid, "shard:shard-1", "w1")]
    j.commit_sealed(res.samples, "shard-1")
    assert store.sealed_among([cid]) == {cid} and store.open_count() == 0
    late = vote(c.completion_id, "u3", 1, created_at=T0 + 20)
    (outcome, dl), = j.on_feedbacks([(late, None)], now=T0 + 20_000)
    assert outcome == "late" and dl.field == "completion_id"
    assert j.on_completions([(c, None)], now=T0 + 20_000) == ["sealed"]
    n = store.counters()
    assert (n["completions"], n["completions_duplicate"], n["feedback_folded"], n["samples"],
            n["completions_after_seal"]) == (1, 1, 3, 1, 1)
    assert store.dedupe_sizes() == (3, 1)  # the late vote is recorded once its dead letter is published


def test_orphan_release_and_recovery_of_a_dead_owners_claims(backend, tmp_path):
    a = Joiner(backend.open("w1"), CFG)
    orphan = vote(uuid.uuid4(), "u1", 1)
    a.on_feedbacks([(orphan, None)], now=T0)
    res = a.tick(T0 + 20_000)
    assert res.dead_event_ids == [str(orphan.event_id)] and res.orphan_ids == [str(orphan.completion_id)]
    a.commit_dead(res, now=T0 + 20_000)
    assert a.store.events_seen([str(orphan.event_id)]) == {str(orphan.event_id)} and a.store.open_count() == 0
    assert a.store.counters()["feedback_orphaned"] == 1
    cs = [completion() for _ in range(3)]
    a.on_completions([(c, None) for c in cs], now=T0)
    a.on_feedbacks([(vote(c.completion_id, "u1", 1), None) for c in cs], now=T0 + 1)
    res = a.tick(T0 + 1 + 10_000, shard_for=lambda s: str(tmp_path / f"{s.completion_id}.parquet"))
    assert len(res.samples) == 3
    retry, written, lost = (str(s.completion_id) for s in res.samples)
    a.release([retry])  # its shard could not be written: due again
    with a.store.transaction():
        assert [s.completion_id for s in a.store.due(T0 + 1 + 10_000, 10)] == [retry]
    (tmp_path / f"{written}.parquet").write_bytes(b"x")  # killed after this shard, before marking it
    b = Joiner(backend.open("w2"), CFG)
    assert b.recover(lambda p: Path(p).exists()) == {"sealed": 0, "released": 0, "live": 2}  # w1 still runs
    backend.kill(a.store)
    assert b.recover(lambda p: Path(p).exists()) == {"sealed": 1, "released": 1, "live": 0}
    assert b.store.sealed_among([retry, written, lost]) == {written}
    assert b.store.dead_owners() == []  # w1 forgotten once its claims were settled
    again = b.tick(T0 + 1 + 10_000, shard_for=lambda s: "s2")
    assert sorted(str(s.completion_id) for s in again.samples) == sorted([retry, lost])
