"""Ingest workers on separate hosts (issue 12 item 1): PostgreSQL join state scoped to
partitions, no file shared between workers, takeover after SIGKILL and a broker restart.

Each worker has its own ``FLYWHEEL_HOME`` (standing in for its own host: its own catalog, no
SQLite file, no body segments); the join state is a real PostgreSQL server started by the
test (``ingest.pglocal``); the Parquet shards go to one shared directory standing in for
object storage (``FLYWHEEL_SAMPLES``). The expected samples are an independent reference
join of what the test produced (``test_ingest_e2e.reference_join``).

The traffic mixes thumbs with every implicit kind (copy, regenerate, edit by kept share,
followup; ``test_ingest_fuzz.signal_traffic``), on completions with thumbs and without, with
duplicate deliveries and a user's later judgement replacing an earlier one, and signals the
default reward policy refuses. Each sample's component columns are checked against
``test_ingest_fuzz.reference_signals`` and its reward and digest against the default policy's
documented formula and canonical JSON (``docs/data.md``), worked out here without the join's
code.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import time
import uuid
from fractions import Fraction
from pathlib import Path

import pytest

from schemas.settings import topic_names
from test_ingest_e2e import ROOT, check, make_traffic, produce, read_dead, reference_join, start_worker, stop, wait_for
from test_ingest_fuzz import reference_signals, signal_traffic

pytestmark = pytest.mark.skipif(not any(Path("/usr/lib/postgresql").glob("*/bin/postgres")),
                                reason="PostgreSQL not installed (apt-get install -y postgresql)")


@pytest.fixture()
def pg():
    """A throwaway PostgreSQL server (initdb + postgres on a free port)."""
    from ingest import pglocal

    srv = pglocal.start()
    yield srv
    srv.stop()


def test_home_partitions_equal_kafka_pythons_murmur2():
    """The vectorised hash gives kafka-python's DefaultPartitioner partition for UUID keys
    and for keys of other lengths."""
    import random

    from kafka.partitioner.default import murmur2

    from ingest.partition import home_partitions

    rng = random.Random(0)
    keys = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(3000)] + ["", "a", "x" * 37]
    for n in (1, 2, 3, 6, 7):
        assert home_partitions(keys, n) == [(murmur2(k.encode()) & 0x7FFFFFFF) % n for k in keys]


def test_pg_store_fences_a_worker_whose_partition_was_taken_over(pg):
    """Ownership moves with an epoch: the old owner's folds are refused after the takeover,
    a dead owner is told apart from a live one by its advisory lock."""
    from ingest.state_pg import Fenced, PgStateStore

    a, b = PgStateStore(pg.url, owner="host-a"), PgStateStore(pg.url, owner="host-b")
    assert a.assign([0, 1], 2) == {0: 1, 1: 1}
    with a.transaction():
        a.fence([0, 1])
    assert b.assign([1], 2) == {1: 2}  # taken over: next epoch
    with pytest.raises(Fenced, match="partition 1: owned by host-b at epoch 2"):
        with a.transaction():
            a.fence([1])
    assert a.assign([0, 1], 2) == {0: 1, 1: 3}  # kept 0 at its epoch, took 1 back
    assert b.owner_alive("host-a") and not b.owner_alive("host-c")
    a.close()
    assert not b.owner_alive("host-a")
    with pytest.raises(RuntimeError, match="already held by a live worker"):
        PgStateStore(pg.url, owner="host-b")
    b.close()


def test_pg_store_takeover_waits_bounded_and_a_frozen_owner_is_ended(pg):
    """A takeover waits at most ``takeover_wait_s`` for the previous owner's fold in progress
    (then Fenced: retried by the worker); a worker frozen inside a transaction loses its
    session after ``idle_in_transaction_s``, with its locks: it counts as dead."""
    from ingest.state_pg import Fenced, PgStateStore

    a = PgStateStore(pg.url, owner="host-a", idle_in_transaction_s=1.0)
    b = PgStateStore(pg.url, owner="host-b", takeover_wait_s=0.3)
    a.assign([0, 1], 2)
    tx = a.transaction()
    tx.__enter__()
    a.fence([0])  # a fold of host-a in progress on partition 0
    t0 = time.monotonic()
    with pytest.raises(Fenced, match=r"partitions \[0\]: .*longer than takeover_wait_s=0.3"):
        b.assign([0], 2)
    assert time.monotonic() - t0 < 20 and b.owned() == []  # refused after takeover_wait_s, not held by the fold
    assert b.owner_alive("host-a")
    deadline = time.monotonic() + 60  # host-a is frozen inside its transaction: the server ends its session
    while b.owner_alive("host-a") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not b.owner_alive("host-a")
    assert b.assign([0], 2) == {0: 2}
    import psycopg

    with pytest.raises(psycopg.Error, match="idle-in-transaction"):  # host-a resumes: its commit fails, nothing of it lands
        tx.__exit__(None, None, None)
    a.close()  # on a session the server ended: no error
    b.close()


def test_pg_store_join_semantics_and_recovery_of_a_dead_owners_claims(pg, tmp_path):
    """The Joiner on the PostgreSQL store: dedupe, last vote wins, seal, late vote; a killed
    owner's claim is finished (its shard exists) or released (it does not) by the partition's
    next owner, and a live owner's claim is left alone."""
    from ingest.join import JoinConfig, Joiner
    from ingest.partition import home_partition
    from ingest.state_pg import PgStateStore
    from test_ingest_join import T0, completion, vote

    cfg = JoinConfig(seal_after_s=10, max_label_age_s=100, orphan_ttl_s=20)
    a = Joiner(PgStateStore(pg.url, owner="host-a"), cfg)
    a.store.assign([0, 1], 2)
    cs = [completion() for _ in range(6)]
    a.on_completions([(c, None) for c in cs], now=T0)
    v1 = vote(cs[0].completion_id, "u1", 1, created_at=T0)
    flip = vote(cs[0].completion_id, "u1", -1, created_at=T0 + 5)
    assert [o for o, _ in a.on_feedbacks([(v1, None), (v1, None), (flip, None)], now=T0 + 1)] == \
        ["folded", "duplicate", "folded"]
    a.on_feedbacks([(vote(c.completion_id, "u2", 1), None) for c in cs[1:]], now=T0 + 1)
    res = a.tick(T0 + 1 + 10_000, shard_for=lambda s: str(tmp_path / f"{s.completion_id}.parquet"), limit=2)
    assert len(res.samples) == 2  # claimed, shard not written yet
    done, lost = res.samples
    (tmp_path / f"{done.completion_id}.parquet").write_bytes(b"written")  # killed after the shard, before the mark
    b = Joiner(PgStateStore(pg.url, owner="host-b"), cfg)
    b.store.assign([0, 1], 2)  # takes both partitions over (next epoch)
    assert b.recover(lambda p: Path(p).exists()) == {"sealed": 0, "released": 0, "live": 2}  # a still runs
    a.store.close()  # killed: its connection (and advisory lock) is gone
    assert b.recover(lambda p: Path(p).exists()) == {"sealed": 1, "released": 1, "live": 0}
    assert b.store.sealed_among([str(done.completion_id), str(lost.completion_id)]) == {str(done.completion_id)}
    rest = b.tick(T0 + 1 + 10_000, shard_for=lambda s: "x")
    assert sorted(str(s.completion_id) for s in rest.samples) == sorted(
        str(c.completion_id) for c in cs if str(c.completion_id) != str(done.completion_id))
    b.commit_sealed(rest.samples, "x")
    s0 = {str(s.completion_id): s for s in res.samples + rest.samples}[str(cs[0].completion_id)]
    assert (s0.votes_up, s0.votes_down, sorted(s0.event_ids)) == (0, 1, sorted([str(v1.event_id), str(flip.event_id)]))
    late = b.on_feedbacks([(vote(cs[1].completion_id, "u9", 1), None)], now=T0 + 20_000)
    assert late[0][0] == "late" and b.store.open_count() == 0
    assert {home_partition(str(c.completion_id), 2) for c in cs} <= {0, 1}
    # 7 folded votes (the late one is recorded once its dead letter is published); 6 sealed
    assert b.store.dedupe_sizes() == (7, 6)
    assert b.prune(T0 + 10**12) == (7, 6)  # everything older than the retention horizon
    b.store.close()


def test_ingest_cli_says_in_one_line_that_the_join_state_is_unreachable(tmp_path):
    """A PostgreSQL URL nothing listens on: exit 1 and one line naming the URL, its password
    hidden (not a 100-line traceback)."""
    import subprocess
    import sys

    from flywheel.broker import free_port

    url = f"postgresql://flywheel:s3cret@127.0.0.1:{free_port()}/flywheel"
    env = dict(os.environ, FLYWHEEL_HOME=str(tmp_path / "home"), FLYWHEEL_KAFKA_BOOTSTRAP="127.0.0.1:1",
               PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "flywheel.cli", "ingest", "--state", url], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.stdout, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: join state postgresql://flywheel:***@127.0.0.1:"), lines[:5]
    assert "s3cret" not in r.stderr and "connection failed" in lines[0] and "Traceback" not in r.stderr


def _env(home: Path, bootstrap: str, pg_url: str, shared: Path) -> dict:
    """A host's environment: the default reward policy (no ``FLYWHEEL_REWARD__*`` of the
    caller's) and no tokenizer (no store, a model directory that does not exist), so an edit
    carrying ``final_text`` is refused whatever this machine has cached."""
    env = dict(os.environ, FLYWHEEL_HOME=str(home), FLYWHEEL_KAFKA_BOOTSTRAP=bootstrap, PYTHONPATH=str(ROOT),
               FLYWHEEL_INGEST_STATE=pg_url, FLYWHEEL_SAMPLES=str(shared), FLYWHEEL_MODEL_DIR=str(home / "no-model"))
    return {k: v for k, v in env.items() if not k.startswith("FLYWHEEL_REWARD__") and k != "FLYWHEEL_STORE"}


# The default reward policy's canonical JSON (every field, keys sorted, no spaces), written out
# from its documented defaults (docs/data.md, schemas/reward.py): the digest of every sample is
# the first 16 hex characters of its SHA-256.
DEFAULT_POLICY_JSON = ('{"clip":1.0,"copy_horizon_s":0.0,"copy_weight":0.5,"edit_horizon_s":0.0,"edit_weight":0.5,'
                       '"followup_horizon_s":0.0,"followup_weight":0.5,"regenerate_horizon_s":0.0,'
                       '"regenerate_weight":0.5,"scores":{},"thumb_down":-1.0,"thumb_horizon_s":0.0,'
                       '"thumb_overrides":true,"thumb_up":1.0,"thumb_weight":1.0}')
DEFAULT_POLICY_DIGEST = hashlib.sha256(DEFAULT_POLICY_JSON.encode()).hexdigest()[:16]


def _mixed_traffic(n_completions: int, seed: int):
    """``make_traffic``'s thumbs and ``signal_traffic``'s implicit signals (copy, regenerate,
    edit by kept share, followup; duplicates; a later edit or followup replacing a user's
    earlier one) on every completion, voted or not, and two completions of the second half
    with three agreeing implicit signals each (0.5 * 3 = 1.5 beyond the clip: rewards +1 and
    -1), interleaved in one produce order; and the signals the default policy refuses (an
    undeclared score, an edit's ``final_text`` with no tokenizer). Returns ``(completions,
    accepted feedback in produce order, refused)``."""
    from schemas.events import FeedbackEvent, now_ms

    comps, thumbs = make_traffic(n_completions, seed=seed)
    sig, refused = signal_traffic(comps, {str(c.completion_id): None for c in comps}, seed + 1000)
    fb = thumbs + sig
    rng = random.Random(seed)
    signalled = {e.completion_id for e in fb}
    up, down = [c for c in comps[len(comps) // 2:] if c.completion_id not in signalled][:2]
    base = now_ms() - 60_000

    def ev(c, kind, user, value):
        return FeedbackEvent(event_id=uuid.UUID(int=rng.getrandbits(128), version=4), completion_id=c.completion_id,
                             user_hash=user, kind=kind, value=value, created_at=base + rng.randint(0, 1000))
    fb += [ev(up, "copy", "user0", 1), ev(up, "edit", "user1", 1.0), ev(up, "followup", "user2", 1),
           ev(down, "regenerate", "user0", 1), ev(down, "edit", "user1", 0.0), ev(down, "followup", "user2", -1)]
    rng.shuffle(fb)  # a later judgement may arrive before the one it replaces
    return comps, fb, refused


def _exact(x: float | None) -> Fraction | None:
    """A mean of a few users' values (quarters, +-1) as the exact fraction it stands for."""
    return None if x is None else Fraction(x).limit_denominator(10**6)


def _implicit_sum(copied: int, regenerated: int, kept: Fraction | None, follow: Fraction | None) -> Fraction:
    """The default policy's weighted sum of the implicit components, before the clip:
    ``0.5 * ([copied] - [regenerated] + (2 kept_share - 1) + followup)`` over the kinds present."""
    return Fraction(1, 2) * ((copied > 0) - (regenerated > 0) + (2 * kept - 1 if kept is not None else 0)
                             + (follow if follow is not None else 0))


def reference_samples(comps, fb) -> dict[str, dict]:
    """Independent of the join: ``{completion_id: expected columns}`` for every completion
    with an accepted signal, from the events in produce order: thumbs by
    ``reference_join``, implicit signals by ``reference_signals``, and the reward of the
    default policy worked out by hand in exact fractions (docs/data.md): with a thumb, the
    thumb alone (``thumb_overrides``; ``thumb_up`` +1, ``thumb_down`` -1, weight 1: the mean
    of the users' last thumbs); without, ``0.5 * ([copied] - [regenerated] + (2 kept_share - 1)
    + followup)`` over the kinds present, clipped to [-1, 1]."""
    thumbs = [e for e in fb if e.kind == "thumb"]
    implicit = [e for e in fb if e.kind != "thumb"]
    votes, sigs = reference_join(comps, thumbs), reference_signals(implicit)
    eids: dict[str, set] = {}
    for e in implicit:
        eids.setdefault(str(e.completion_id), set()).add(str(e.event_id))
    out = {}
    for cid in set(votes) | set(sigs):
        up, down, thumb_eids = votes.get(cid, (0, 0, set()))
        copied, regenerated, kept, follow, n_implicit = sigs.get(cid, (0, 0, None, None, 0))
        kept, follow = _exact(kept), _exact(follow)
        thumb = Fraction(up - down, up + down) if up + down else None
        reward = thumb if thumb is not None else max(Fraction(-1), min(Fraction(1), _implicit_sum(
            copied, regenerated, kept, follow)))
        out[cid] = dict(votes_up=up, votes_down=down, event_ids=thumb_eids | eids.get(cid, set()), copied=copied,
                        regenerated=regenerated, n_votes=up + down + n_implicit, thumb=thumb, kept_share=kept,
                        followup=follow, reward=reward, label=reward > 0, reward_policy=DEFAULT_POLICY_DIGEST)
    return out


def check_components(shared: Path, expected: dict[str, dict], refused=()) -> list:
    """Every expected sample exactly once, every event in one sample, every column equal to
    ``expected`` (``reference_samples``); no refused signal in any sample. Returns the samples."""
    from samplestore.catalog import read_samples

    got = read_samples(shared)
    by_cid: dict = {}
    for s in got:
        assert str(s.completion_id) not in by_cid, f"completion {s.completion_id} sealed twice"
        by_cid[str(s.completion_id)] = s
    assert set(by_cid) == set(expected), (sorted(set(by_cid) - set(expected)), sorted(set(expected) - set(by_cid)))
    all_eids = [e for s in got for e in s.event_ids]
    assert len(all_eids) == len(set(all_eids)), "an event is in two samples"
    assert not {str(e.event_id) for e in refused} & set(all_eids), "a refused signal is in a sample"
    approx = ("thumb", "kept_share", "followup", "reward")
    for cid, want in expected.items():
        s = by_cid[cid]
        row = {k: getattr(s, k) for k in want}
        row["event_ids"] = set(s.event_ids)
        assert {k: v for k, v in row.items() if k not in approx} == {k: v for k, v in want.items() if k not in approx}, cid
        for k in approx:
            w = want[k]
            assert (row[k] is None) == (w is None) and (w is None or row[k] == pytest.approx(float(w), abs=1e-6)), \
                (cid, k, row[k], w)
    return got


def _wait_dead(bootstrap: str, refused, proc, log) -> None:
    """Wait until each ``refused`` signal is dead-lettered, then check that its dead letter
    names the field the default policy refuses it for: ``name`` (a score it does not
    declare) or ``final_text`` (an edit's text on a worker with no tokenizer)."""
    want = {str(e.event_id): "name" if e.kind == "score" else "final_text" for e in refused}
    got: dict[str, set] = {}

    def arrived():
        for d in read_dead(bootstrap):
            try:
                eid = json.loads(d.payload).get("event_id")
            except (ValueError, AttributeError):
                continue
            if eid in want:
                got.setdefault(eid, set()).add(d.field)
        return got.keys() >= want.keys()

    wait_for(arrived, 30, "the refused signals dead-lettered", proc, log)
    assert got == {k: {v} for k, v in want.items()}


def _owned(log: Path) -> set[int]:
    """The partitions a worker owns according to its last ``ingest owns partitions`` line."""
    lines = [ln for ln in log.read_text().splitlines() if "ingest owns partitions" in ln] if log.exists() else []
    return {int(p) for p in json.loads(lines[-1].split("ingest owns partitions", 1)[1])} if lines else set()


def _pg_rows(url: str, q: str, args=()) -> list[tuple]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as c:
        c.execute("SET search_path TO ingest_flywheel_ingest")
        return c.execute(q, args).fetchall()


def _all_in_state(url: str, comps, fb) -> bool:
    """Every produced completion is open or sealed and every feedback event recorded."""
    try:
        cids = {r[0] for r in _pg_rows(url, "SELECT completion_id FROM labels UNION SELECT completion_id FROM sealed")}
        eids = {r[0] for r in _pg_rows(url, "SELECT event_id FROM events")}
    except Exception:  # noqa: BLE001 - tables not created yet
        return False
    return {str(c.completion_id) for c in comps} <= cids and {str(e.event_id) for e in fb} <= eids


def _samples(shared: Path) -> int:
    from samplestore.catalog import read_samples

    return len(read_samples(shared)) if any(shared.glob("**/*.parquet")) else 0


def _split_traffic(comps, fb):
    """Votes of the first half of the completions, and of the second half (produced after the
    kill: their labels are open, without votes, in the killed worker's partitions)."""
    first = {c.completion_id for c in comps[: len(comps) // 2]}
    return [e for e in fb if e.completion_id in first], [e for e in fb if e.completion_id not in first]


def _covers(expected: dict[str, dict], later) -> None:
    """The traffic tests what it claims: samples with implicit signals and no thumb (the
    implicit formula: inside the clip, at 0 with label false, and clipped both ways) and with
    both (the thumb overrides them); among the ``later`` events every kind, a duplicate
    delivery and a replaced judgement."""
    implicit_only = [w for w in expected.values() if w["thumb"] is None]
    sums = [_implicit_sum(w["copied"], w["regenerated"], w["kept_share"], w["followup"]) for w in implicit_only]
    assert any(0 < abs(x) < 1 for x in sums) and 0 in sums and max(sums) > 1 and min(sums) < -1, sums
    assert any(w["thumb"] is not None and w["n_votes"] > w["votes_up"] + w["votes_down"] for w in expected.values())
    assert {e.kind for e in later} == {"thumb", "copy", "regenerate", "edit", "followup"}
    ids = [e.event_id for e in later if e.kind != "thumb"]
    assert len(ids) > len(set(ids)), "no duplicate delivery of an implicit signal"
    keys = {}
    for e in later:
        keys.setdefault((e.completion_id, e.kind, e.user_hash), set()).add(e.event_id)
    assert any(len(v) > 1 for (_, kind, _), v in keys.items() if kind in ("edit", "followup")), \
        "no edit or followup replaced by the same user's later one"


def _open_with_signals(url: str, parts, later) -> int:
    """How many labels open in partitions ``parts`` (in the state) get implicit signals in ``later``."""
    cids = sorted({str(e.completion_id) for e in later if e.kind != "thumb"})
    return _pg_rows(url, "SELECT count(*) FROM labels WHERE part = ANY(%s) AND completion_id = ANY(%s)",
                    (sorted(parts), cids))[0][0]


@pytest.mark.timeout(120)
def test_two_hosts_sigkill_takeover_equals_reference_join(pg, broker, tmp_path):
    """Two hosts on six partitions; one is SIGKILLed mid-stream, and the thumbs and implicit
    signals of the second half of the completions come after the kill (labels open in its
    partitions): the survivor takes them over; every accepted signal is in exactly one
    sample, with every component column, the reward and the policy digest as the reference
    computes them, and every refused signal is dead-lettered naming its field."""
    shared = tmp_path / "objectstore" / "samples"
    homes = [tmp_path / "host1", tmp_path / "host2"]
    logs = [tmp_path / "w1.log", tmp_path / "w2.log"]
    comps, fb, refused = _mixed_traffic(80, seed=21)
    fb1, fb2 = _split_traffic(comps, fb)
    refused1, refused2 = _split_traffic(comps, refused)
    expected = reference_samples(comps, fb)
    _covers(expected, fb2)
    procs = [start_worker(_env(h, broker.bootstrap, pg.url, shared), lg) for h, lg in zip(homes, logs)]
    try:
        wait_for(lambda: _owned(logs[0]) and _owned(logs[1]) and not _owned(logs[0]) & _owned(logs[1])
                 and len(_owned(logs[0]) | _owned(logs[1])) == 6, 90, "two hosts splitting 6 partitions",
                 procs[0], logs[0])
        parts1 = sorted(_owned(logs[0]))
        produce(broker.bootstrap, comps, fb1 + refused1)
        wait_for(lambda: any(shared.glob("**/*.parquet")) and _all_in_state(pg.url, comps, fb1), 60,
                 "first shard, phase 1 folded", procs[0], logs[0])
        stop(procs[0], signal.SIGKILL)  # mid-stream: its partitions hold open labels
        open_there = _pg_rows(pg.url, "SELECT count(*) FROM labels WHERE part = ANY(%s)", (parts1,))[0][0]
        assert open_there > 0, "the killed worker held no open label: nothing to take over"
        assert _open_with_signals(pg.url, parts1, fb2) > 0, "no implicit signal after the kill for its open labels"
        assert not list(homes[0].glob("**/*.sqlite")) and not list(homes[0].glob("**/*.seg"))
        produce(broker.bootstrap, [], fb2 + refused2)
        wait_for(lambda: _owned(logs[1]) == set(range(6)), 60, "host 2 owning every partition", procs[1], logs[1])
        wait_for(lambda: _samples(shared) >= len(expected), 60, f"{len(expected)} samples", procs[1], logs[1])
        t_all = time.monotonic()
        _wait_dead(broker.bootstrap, refused, procs[1], logs[1])
        time.sleep(max(0.0, 3 - (time.monotonic() - t_all)))  # nothing more may appear (a label sealed twice would)
        check_components(shared, expected, refused)
        assert procs[1].poll() is None
    finally:
        for p in procs:
            stop(p)


@pytest.mark.timeout(120)
def test_three_hosts_sigkill_and_broker_restart_equal_reference_join(pg, tmp_path):
    """Three hosts on three partitions; after phase 1 one host is SIGKILLed and the
    memory-only broker restarts (topics, data and offsets gone); phase 2's thumbs and
    implicit signals still meet the killed host's open labels, kept in PostgreSQL: every
    accepted signal in exactly one sample, each column as the reference computes it."""
    from flywheel.broker import free_port, spawn

    port = free_port()
    b = spawn(port, partitions=3, die_with_parent=True)
    shared = tmp_path / "objectstore" / "samples"
    logs = [tmp_path / f"w{i}.log" for i in range(3)]
    comps1, fb1, refused1 = _mixed_traffic(45, seed=31)
    comps2, fb2, refused2 = _mixed_traffic(30, seed=32)
    fb1a, fb1b = _split_traffic(comps1, fb1)  # signals of comps1's second half come after the restart
    refused1a, refused1b = _split_traffic(comps1, refused1)
    expected = reference_samples(comps1 + comps2, fb1a + fb1b + fb2)  # (in produce order)
    _covers(expected, fb1b + fb2)
    # orphans wait 30 s, not 4: when the partitions move again on the new broker (a rebalance
    # takes seconds on a loaded box), a vote can be folded well before its completion is read
    procs = [start_worker(_env(tmp_path / f"host{i}", b.bootstrap, pg.url, shared), lg, orphan_ttl_s=30)
             for i, lg in enumerate(logs)]
    try:
        wait_for(lambda: all(len(_owned(lg)) == 1 for lg in logs) and len(set().union(*map(_owned, logs))) == 3,
                 90, "three hosts owning one partition each", procs[0], logs[0])
        produce(b.bootstrap, comps1, fb1a + refused1a)
        wait_for(lambda: _all_in_state(pg.url, comps1, fb1a), 60, "phase 1 folded", procs[0], logs[0])
        killed = _owned(logs[0])
        stop(procs[0], signal.SIGKILL)
        assert _open_with_signals(pg.url, killed, fb1b) > 0, "no implicit signal after the kill for its open labels"
        b.stop()  # memory-only: topics, data and committed offsets are gone
        b = spawn(port, partitions=3, die_with_parent=True)
        # phase 2 at once: until its rejoin a consumer may fetch the recreated partitions from its
        # old positions, folding later records before earlier ones; no label is sealed before
        # its partition's new owner has read it to the end (D93), so none is sealed early
        produce(b.bootstrap, comps2, fb1b + fb2 + refused1b + refused2)
        wait_for(lambda: _samples(shared) >= len(expected), 90, f"{len(expected)} samples", procs[1], logs[1])
        t_all = time.monotonic()
        _wait_dead(b.bootstrap, refused1b + refused2, procs[1], logs[1])  # (phase 1's went with the old broker)
        time.sleep(max(0.0, 3 - (time.monotonic() - t_all)))
        check_components(shared, expected, refused1 + refused2)
        assert procs[1].poll() is None and procs[2].poll() is None
    finally:
        for p in procs:
            stop(p)
        b.stop()


def _assigned(log: Path) -> set[int]:
    """Partitions of the completions topic in a worker's last ``ingest assigned`` line."""
    lines = [ln for ln in log.read_text().splitlines() if "ingest assigned" in ln] if log.exists() else []
    tps = json.loads(lines[-1].split("ingest assigned", 1)[1]) if lines else []
    return {int(tp.rsplit(":", 1)[1]) for tp in tps if tp.rsplit(":", 1)[0] == topic_names().completions}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("state", ["postgres", "sqlite"])
def test_votes_from_a_librdkafka_producer_meet_their_completion(state, broker, tmp_path, request):
    """Issue 11 defect 8: feedback produced by confluent-kafka with its default partitioner
    (librdkafka's consistent_random, CRC32 of the key) lands in other partitions than
    kafka-python's murmur2 puts its completion in; with two workers each vote still meets
    its completion and no vote is an orphan: on two hosts with the PostgreSQL state the votes
    are forwarded to their home partition; with the one-host SQLite default the workers share
    the state file, so nothing needs forwarding."""
    confluent_kafka = pytest.importorskip("confluent_kafka")
    from kafka.partitioner.default import murmur2

    from test_ingest_e2e import read_dead

    shared = tmp_path / "objectstore" / "samples"
    logs = [tmp_path / "w1.log", tmp_path / "w2.log"]
    comps, fb = make_traffic(60, seed=41)
    expected = reference_join(comps, fb)
    if state == "postgres":
        pg = request.getfixturevalue("pg")
        envs = [_env(tmp_path / f"host{i}", broker.bootstrap, pg.url, shared) for i in range(2)]
    else:
        env = _env(tmp_path / "host", broker.bootstrap, "", shared)
        envs = [{k: v for k, v in env.items() if k != "FLYWHEEL_INGEST_STATE"}] * 2
    procs = [start_worker(e, lg) for e, lg in zip(envs, logs)]
    try:
        wait_for(lambda: len(_assigned(logs[0]) | _assigned(logs[1])) == 6
                 and not _assigned(logs[0]) & _assigned(logs[1]), 90, "two workers splitting 6 partitions",
                 procs[0], logs[0])
        produce(broker.bootstrap, comps, [])  # serving's client: kafka-python, murmur2
        p = confluent_kafka.Producer({"bootstrap.servers": broker.bootstrap})  # default partitioner
        landed: list[tuple[str, int]] = []
        def delivered(err, m):
            if err is None:
                landed.append((m.key().decode(), m.partition()))

        for e in fb:
            p.produce(topic_names().feedback, key=str(e.completion_id).encode(), value=e.to_bytes(), on_delivery=delivered)
        assert p.flush(30) == 0 and len(landed) == len(fb)
        del p
        moved = sum(part != (murmur2(k.encode()) & 0x7FFFFFFF) % 6 for k, part in landed)
        assert moved > len(fb) // 2, f"only {moved} of {len(fb)} votes landed outside the completion's partition"
        wait_for(lambda: _samples(shared) >= len(expected), 60, f"{len(expected)} samples", procs[0], logs[0])
        time.sleep(3)
        check(shared, expected)
        assert not [d for d in read_dead(broker.bootstrap) if "orphan" in d.reason]
        if state == "postgres":
            fwd = dict(_pg_rows(pg.url, "SELECT name, sum(value) FROM counters WHERE name IN "
                                "('forwarded_feedback', 'forwarded_completions') GROUP BY name"))
            assert fwd.get("forwarded_feedback", 0) >= moved and not fwd.get("forwarded_completions")
    finally:
        for p_ in procs:
            stop(p_)
