"""The join state in memory, checkpointed with the offsets (``ingest.keyed``, D81).

In process (real SQLite checkpoint store): a checkpoint restores into an equal state and equal
samples; nothing reaches the store before a checkpoint; a failed unit is undone in memory; a
worker that lost a partition cannot checkpoint into it; a crash between a shard and the
checkpoint that marks its labels sealed neither loses nor duplicates a sample; memory is pruned
on the join's rules. Against a real broker with real worker subprocesses: a worker SIGKILLed
right after a shard's rename and before its checkpoint, and partitions rebalanced mid-stream
between two workers, each end with every accepted event in exactly one sample (an independent
reference join, ``tests/test_ingest_e2e.py``).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ingest.join import JoinConfig, Joiner
from ingest.keyed import KeyedState
from ingest.partition import home_partitions
from ingest.state import StateStore
from ingest.store import Fenced
from schemas.events import CompletionEvent, FeedbackEvent, SamplingParams
from flywheel.supervise import die_with_parent

T0 = 1_700_000_000_000  # ms
CFG = JoinConfig(seal_after_s=10, max_label_age_s=100, orphan_ttl_s=20)
ROOT = Path(__file__).resolve().parents[1]


def completion(cid=None) -> CompletionEvent:
    return CompletionEvent(
        completion_id=cid or uuid.uuid4(), request_id="r", created_at=T0, model_version="v0001", pod="p0",
        user_hash="author", prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5],
        behavior_logprobs=[-0.5, -1.25], sampling=SamplingParams(), finish_reason="stop", ttft_ms=1.0,
        latency_ms=2.0)


def vote(cid, user, value, created_at=T0, eid=None) -> FeedbackEvent:
    return FeedbackEvent(event_id=eid or uuid.uuid4(), completion_id=cid, user_hash=user, value=value,
                         created_at=created_at)


def fold(j: Joiner, comps, votes, now=T0):
    with j.store.transaction():
        j.on_completions([(c, c.to_bytes()) for c in comps], now)
        return j.on_feedbacks([(v, None) for v in votes], now + 1)


def traffic(n=12):
    comps = [completion() for _ in range(n)]
    votes = []
    for i, c in enumerate(comps):
        votes += [vote(c.completion_id, "u1", 1), vote(c.completion_id, "u2", -1 if i % 3 else 1)]
        if i % 4 == 0:
            votes.append(vote(c.completion_id, "u1", -1, created_at=T0 + 5))  # a flip, later
    orphan = vote(uuid.uuid4(), "u9", 1)
    return comps, votes + [orphan, votes[0]]  # and a duplicate delivery


def sample_view(samples):
    return sorted((str(s.completion_id), s.votes_up, s.votes_down, sorted(s.event_ids), s.reward) for s in samples)


def test_a_checkpoint_restores_an_equal_state_and_equal_samples(tmp_path):
    path = tmp_path / "state.sqlite"
    a = Joiner(KeyedState(StateStore(path, owner="a")), CFG)
    comps, votes = traffic()
    outs = fold(a, comps, votes)
    assert [o for o, _ in outs].count("duplicate") == 1
    peek = StateStore(path, owner="peek")
    assert peek.open_count() == 0 and peek.counters() == {}  # nothing written before a checkpoint
    a.store.checkpoint({("flywheel.feedback", 0): 42})
    assert peek.open_count() == len(comps) + 1 and peek.saved_offsets() == {("flywheel.feedback", 0): 42}
    assert peek.counters() == a.store.counters()
    peek.close()

    b = Joiner(KeyedState(StateStore(path, owner="b")), CFG)
    b.store.assign(range(3), 3)  # every partition: the whole state, restored
    assert b.store.open_count() == a.store.open_count() == len(comps) + 1
    assert b.store.dedupe_sizes() == a.store.dedupe_sizes()
    for c in comps:
        cid = str(c.completion_id)
        sa, sb = a.store.get(cid), b.store.get(cid)
        assert (sa.to_json(), bytes(sa.completion)) == (sb.to_json(), bytes(sb.completion))
    # a replay after the restore folds nothing
    again = fold(b, comps, votes)
    assert {o for o, _ in again} == {"duplicate"}
    sealed_a, sealed_b = a.tick(T0 + 20_000), b.tick(T0 + 20_000)
    assert len(sealed_a.samples) == len(comps)
    assert sample_view(sealed_a.samples) == sample_view(sealed_b.samples)
    a.store.close()
    b.store.close()


def test_a_failed_unit_is_undone_in_memory():
    k = KeyedState(StateStore(":memory:"))
    j = Joiner(k, CFG)
    c = completion()
    fold(j, [c], [vote(c.completion_id, "u1", 1)])
    before = (k.get(str(c.completion_id)).to_json(), k.dedupe_sizes(), k.counters())
    v2 = vote(c.completion_id, "u2", -1)
    with pytest.raises(ZeroDivisionError):
        with k.transaction():
            j.on_feedbacks([(v2, None)], T0 + 2)
            k.mark_sealed(str(c.completion_id), T0, "x")
            1 / 0
    assert (k.get(str(c.completion_id)).to_json(), k.dedupe_sizes(), k.counters()) == before
    assert k.sealed_among([str(c.completion_id)]) == set() and not k.events_seen([str(v2.event_id)])
    # a value no 64-bit column holds is refused in the fold, as the database stores refuse it
    big = completion()
    with pytest.raises(OverflowError, match="due_at"):
        with k.transaction():
            j.on_completions([(big.model_copy(update={"created_at": 10**19}), None)], T0)
    assert k.open_count() == 1


def test_a_worker_that_lost_a_partition_cannot_checkpoint_into_it(tmp_path):
    path = tmp_path / "state.sqlite"
    a = Joiner(KeyedState(StateStore(path, owner="a")), CFG)
    assert a.store.assign([0, 1], 2) == {0: 1, 1: 1}
    c = completion()
    home = home_partitions([str(c.completion_id)], 2)[0]
    fold(a, [c], [vote(c.completion_id, "u1", 1)])
    a.store.checkpoint()
    b = Joiner(KeyedState(StateStore(path, owner="b")), CFG)
    assert b.store.assign([home], 2) == {home: 2}  # taken over: the next epoch
    assert b.store.open_count() == 1  # restored from a's checkpoint
    fold(a, [], [vote(c.completion_id, "u2", 1)])  # a zombie folds on
    with pytest.raises(Fenced, match=f"partition {home}"):
        a.store.checkpoint()  # the fold is not fenced per batch (no database call); the write is
    a.store.revoke()
    with pytest.raises(Fenced):
        a.store.fence([home])
    peek = StateStore(path, owner="peek")
    (st,) = [LabelRow(*r) for r in peek.snapshot(None, None)[0]]
    assert len(json.loads(st.state)["event_ids"]) == 1  # the zombie's vote was never written
    for s in (a.store, b.store, peek):
        s.close()


class LabelRow:
    def __init__(self, cid, state, due, claim, owner, has_body):
        self.cid, self.state, self.due, self.claim, self.owner, self.has_body = cid, state, due, claim, owner, has_body


@pytest.mark.parametrize("shard_written", [True, False])
def test_a_crash_between_a_shard_and_its_checkpoint(tmp_path, shard_written):
    """The seal round checkpoints its claims (label -> shard path) before it writes a shard.
    Killed after the shard's rename and before the checkpoint that marks its labels sealed:
    the next owner restores the claims and, the shard existing, marks them sealed (not sealed
    again); killed before the rename: the labels are released and sealed again, once."""
    path = tmp_path / "state.sqlite"
    a = Joiner(KeyedState(StateStore(path, owner="a")), CFG)
    a.store.assign([0], 1)
    comps, votes = traffic(5)
    fold(a, comps, votes)
    shard = tmp_path / "s.parquet"
    res = a.tick(T0 + 20_000, shard_for=lambda s: str(shard))
    assert len(res.samples) == 5
    a.store.checkpoint()  # what Worker.seal_round does before the shard write
    if shard_written:
        shard.write_bytes(b"rows")
    # killed here: a's memory (and the commit_sealed it would have made) is gone
    a.store.backing.db.close()
    a.store.backing.close = lambda: None
    os.close(a.store.backing._owner_fd)  # the process died: its owner lock is released
    b = Joiner(KeyedState(StateStore(path, owner="b")), CFG)
    b.store.assign([0], 1)
    rec = b.recover(lambda p: Path(p).exists(), previous_owners=True)
    if shard_written:
        assert rec == {"sealed": 5, "released": 0, "live": 0}
        assert b.store.sealed_among([str(c.completion_id) for c in comps]) == {str(c.completion_id) for c in comps}
        assert b.tick(T0 + 40_000).samples == []
        assert {o for o, _ in fold(b, comps, votes[:3])} == {"duplicate"}  # a replay
        assert [o for o, _ in fold(b, [], [vote(comps[0].completion_id, "u7", 1)])] == ["late"]
    else:
        assert rec == {"sealed": 0, "released": 5, "live": 0}
        assert sample_view(b.tick(T0 + 40_000).samples) == sample_view(res.samples)
    b.store.checkpoint()
    b.store.close()


def test_a_live_previous_owners_claim_waits_unless_its_shard_exists(tmp_path):
    path = tmp_path / "state.sqlite"
    a = Joiner(KeyedState(StateStore(path, owner="a")), CFG)
    a.store.assign([0], 1)
    comps, votes = traffic(2)
    fold(a, comps, votes)
    shards = {str(c.completion_id): tmp_path / f"{c.completion_id}.parquet" for c in comps}
    a.tick(T0 + 20_000, shard_for=lambda s: str(shards[str(s.completion_id)]))
    a.store.checkpoint()
    shards[str(comps[0].completion_id)].write_bytes(b"rows")
    b = Joiner(KeyedState(StateStore(path, owner="b")), CFG)
    b.store.assign([0], 1)  # a still runs (holds its owner lock) but no longer owns partition 0
    assert b.recover(lambda p: Path(p).exists(), previous_owners=True) == {"sealed": 1, "released": 0, "live": 1}
    a.store.backing.close()  # a exits: its last claim is released
    assert b.recover(lambda p: Path(p).exists(), previous_owners=True) == {"sealed": 0, "released": 1, "live": 0}
    b.store.close()


def test_memory_is_pruned_on_the_joins_rules_and_stated():
    k = KeyedState(StateStore(":memory:"))
    j = Joiner(k, CFG)
    comps, votes = traffic(20)
    fold(j, comps, votes)
    res = j.tick(T0 + 30_000)
    j.commit_sealed(res.samples, "s")
    j.commit_dead(res, T0 + 30_000)
    full = k.memory_bytes()
    assert k.open_count() == 0 and k.dedupe_sizes()[1] == 20 and full > 0
    horizon = T0 + 30_000 + int(CFG.dedupe_retention_s * 1000) + 1
    n_events = k.dedupe_sizes()[0]
    assert j.prune(horizon) == (n_events, 20)
    assert k.dedupe_sizes() == (0, 0) and k.memory_bytes() < full
    k.checkpoint()
    assert k.backing.dedupe_sizes() == (0, 0)  # the same prune, written with the checkpoint


# -- real broker, real worker subprocesses -------------------------------------------------------

_KILL_AFTER_SHARD = """
import os, signal, sys
from samplestore import shards as writer
real = writer.write_table
def write_then_die(table, path, *a, **kw):
    real(table, path, *a, **kw)  # the shard is renamed into place: durable and whole
    os.kill(os.getpid(), signal.SIGKILL)  # before the checkpoint that marks its labels sealed
writer.write_table = write_then_die
from ingest.__main__ import main
main(sys.argv[1:])
"""


def _worker(env, log, *extra, script=None):
    args = ["--seal-after-s", "2", "--orphan-ttl-s", "30", "--tick-s", "0.3", *extra]
    cmd = [sys.executable, "-c", script, *args] if script else [sys.executable, "-m", "ingest", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=die_with_parent())


@pytest.mark.timeout(300)
def test_sigkill_between_a_shard_write_and_its_checkpoint(broker, fw_home, tmp_path):
    from test_ingest_e2e import check, make_traffic, produce, reference_join, stop, wait_for

    env = dict(os.environ, FLYWHEEL_HOME=str(fw_home), FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap,
               PYTHONPATH=str(ROOT))
    samples_dir = fw_home / "data" / "samples"
    state = fw_home / "ingest" / "state.sqlite"
    comps, fb = make_traffic(40, seed=11)
    comps2, fb2 = make_traffic(30, seed=13)  # produced after the kill: sealed by the next worker
    expected = reference_join(comps + comps2, fb + fb2)
    produce(broker.bootstrap, comps, fb)
    log = tmp_path / "killed.log"
    proc = _worker(env, log, script=_KILL_AFTER_SHARD)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        stop(proc, signal.SIGKILL)
        raise AssertionError(f"the worker never wrote a shard: {log.read_text()[-3000:]}")
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    shards = list(samples_dir.glob("**/*.parquet"))
    assert len(shards) == 1
    # killed in the window: the shard is whole on disk, its labels are claimed for it in the
    # checkpoint store and none of them is recorded as sealed
    db = sqlite3.connect(f"file:{state}?mode=ro", uri=True)
    claimed = {cid for cid, claim in db.execute("SELECT completion_id, claim FROM labels WHERE claim IS NOT NULL")
               if claim == f"shard:{shards[0]}"}
    n_sealed = db.execute("SELECT count(*) FROM sealed").fetchone()[0]
    db.close()
    import pyarrow.parquet as pq

    in_shard = set(pq.read_table(shards[0], columns=["completion_id"]).column(0).to_pylist())
    assert claimed == in_shard and n_sealed == 0
    produce(broker.bootstrap, comps2, fb2)
    log2 = tmp_path / "worker.log"
    proc = _worker(env, log2)
    try:
        recovered = f"ingest recover: {{'sealed': {len(in_shard)}, 'released': 0"
        wait_for(lambda: recovered in log2.read_text(), 120, "the claims of the killed worker settled", proc, log2)
        wait_for(lambda: len(_read(samples_dir)) >= len(expected), 120, "every sample", proc, log2)
        time.sleep(3)  # nothing more may appear (a label sealed twice would)
        check(samples_dir, expected)
    finally:
        stop(proc)


def _read(samples_dir):
    from samplestore.catalog import read_samples

    return read_samples(samples_dir) if any(samples_dir.glob("**/*.parquet")) else []


@pytest.mark.timeout(300)
def test_partitions_rebalanced_mid_stream_between_two_workers(broker, fw_home, tmp_path):
    """Worker A folds the first third of the votes alone; B joins (A checkpoints and hands
    over, B restores its partitions from A's checkpoint); the second third is folded by both;
    A leaves (B restores A's partitions); the last third is folded by B. Each label's votes
    come within one phase, so none is late by construction."""
    from test_ingest_e2e import check, make_traffic, produce, reference_join, stop, wait_for
    from test_ingest_scale import in_state

    env = dict(os.environ, FLYWHEEL_HOME=str(fw_home), FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap,
               PYTHONPATH=str(ROOT))
    samples_dir = fw_home / "data" / "samples"
    state = fw_home / "ingest" / "state.sqlite"
    comps, fb = make_traffic(60, seed=12)
    expected = reference_join(comps, fb)
    thirds = [{c.completion_id for c in comps[i::3]} for i in range(3)]
    phase = [[e for e in fb if e.completion_id in t] for t in thirds]
    la, lb = tmp_path / "a.log", tmp_path / "b.log"

    def owned(log):
        lines = [ln for ln in log.read_text().splitlines() if "ingest owns partitions" in ln] if log.exists() else []
        return set(json.loads(lines[-1].split("ingest owns partitions", 1)[1])) if lines else set()

    # a long seal delay: no label of a phase is sealed before its phase's votes are all in
    a = _worker(env, la, "--seal-after-s", "6")
    b = None
    try:
        produce(broker.bootstrap, comps, phase[0])
        wait_for(lambda: in_state(state, comps, phase[0]), 120, "phase 1 checkpointed", a, la)
        b = _worker(env, lb, "--seal-after-s", "6")
        wait_for(lambda: owned(la) and owned(lb) and not owned(la) & owned(lb) and len(owned(la) | owned(lb)) == 6,
                 120, "the partitions split between A and B", b, lb)
        produce(broker.bootstrap, [], phase[1])
        wait_for(lambda: in_state(state, comps, phase[0] + phase[1]), 120, "phase 2 checkpointed", b, lb)
        stop(a)
        assert a.returncode == 0, la.read_text()[-3000:]
        wait_for(lambda: len(owned(lb)) == 6, 120, "B owns every partition", b, lb)
        produce(broker.bootstrap, [], phase[2])
        wait_for(lambda: len(_read(samples_dir)) >= len(expected), 150, "every sample", b, lb)
        time.sleep(3)
        check(samples_dir, expected)
        restored = [int(ln.split("ingest restored ", 1)[1].split()[0]) for ln in lb.read_text().splitlines()
                    if "ingest restored " in ln]
        assert any(n > 0 for n in restored), restored  # B continued labels A had folded
    finally:
        for p in (a, b):
            if p is not None:
                stop(p)
