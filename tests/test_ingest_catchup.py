"""A partition's labels are not sealed until the worker has caught up on it (D93).

A worker restores a partition's labels from the checkpoint store when it is assigned the
partition; the events of those labels that the checkpoint does not hold lie in the part of the
partition not read yet (records a killed owner folded after its last checkpoint; after a
memory-only broker restarted, the records below the old fetch position). The labels are held
(not sealed, not dead-lettered as orphans, not dropped) until the worker has read every topic
of the partition up to the end offset it had at the assignment, or ``catchup_timeout_s``
passed (a warning names the partition).

In process, through :class:`ingest.processor.Processor` on a real SQLite checkpoint store and
real Parquet shards, the records handed to ``fold`` as ``getmany`` returns them; then a real
Tansu broker and real ``python -m ingest`` worker processes, one SIGKILLed after folding a
vote it never checkpointed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ingest.app import IngestConfig
from ingest.join import JoinConfig
from ingest.processor import Processor
from schemas.settings import topic_names
from test_ingest_poison import TP, Rec, completion as completion_json, vote as vote_json
from test_ingest_restore_partition import N, ids_by_partition

ROOT = Path(__file__).resolve().parents[1]
PART = 3  # the held partition
OTHER = 1  # a partition with nothing to catch up


def _cfg(tmp_path, **kw) -> IngestConfig:
    """Labels due 1 ms after their last vote (a restored label is due at once); orphans after
    1 ms too; the catch-up timeout far away unless given."""
    kw.setdefault("catchup_timeout_s", 3600)
    return IngestConfig(join=JoinConfig(seal_after_s=0.001, max_label_age_s=3600, orphan_ttl_s=0.001),
                        bootstrap="127.0.0.1:1", samples_dir=tmp_path / "samples", state_path=tmp_path / "state.sqlite",
                        catalog=tmp_path / "catalog.duckdb", **kw)


def _tps(part: int) -> list[TP]:
    """The partition's TopicPartitions of every consumed topic (the assignment gives all three)."""
    t = topic_names()
    return [TP(t.completions, part), TP(t.feedback, part), TP(t.rekeyed, part)]


def _processor(cfg) -> Processor:
    p = Processor(cfg)
    p.partition_count = N  # as the runtime sets it from the assignment
    return p


def _samples(cfg) -> dict:
    from samplestore.catalog import read_samples

    if not any(Path(cfg.samples_dir).glob("**/*.parquet")):
        return {}
    out: dict = {}
    for s in read_samples(cfg.samples_dir):
        assert str(s.completion_id) not in out, f"completion {s.completion_id} sealed twice"
        out[str(s.completion_id)] = s
    return out


def _gauge(p: Processor) -> dict[int, float]:
    """``flywheel_ingest_partition_caught_up`` by partition, as ``GET /metrics`` shows it."""
    from prometheus_client.parser import text_string_to_metric_families

    return {int(s.labels["partition"]): s.value for f in text_string_to_metric_families(p.metrics.exposition().decode())
            if f.name == "flywheel_ingest_partition_caught_up" for s in f.samples}


def _eid(raw: bytes) -> str:
    return json.loads(raw)["event_id"]


def test_a_restored_label_waits_until_its_partition_is_read_to_the_end_offset(tmp_path):
    """The broker-restart order: the previous owner folded a label's later vote (feedback
    offset 2) and its completion, and checkpointed them; the next owner restores the label,
    due since its last vote is older than ``seal_after_s``, and is assigned the partition with
    feedback committed at 0 and ending at 3. No seal round seals it until the consumer has
    read feedback up to 3 (the two earlier votes at 0 and 1, then the later one again, a
    duplicate); then it is sealed once, with every vote. A label of a partition with nothing to
    catch up is sealed in the first round."""
    cfg = _cfg(tmp_path)
    t = topic_names()
    cid = ids_by_partition(1, seed=11)[PART][0]
    other = ids_by_partition(1, seed=12)[OTHER][0]
    early_up, early_down, later = vote_json(cid, "u1", 1), vote_json(cid, "u3", -1), vote_json(cid, "u2", 1)
    a = _processor(cfg)
    try:
        assert a.assign(_tps(PART), N) == {PART: 1}
        assert a.caught_up({tp: (0, 0) for tp in _tps(PART)}) == [PART]  # an empty partition: caught up at once
        a.fold({TP(t.completions, PART): [Rec(cid.encode(), completion_json(cid), 0, ())],
                TP(t.feedback, PART): [Rec(cid.encode(), later, 2, ())]})
        a.store.checkpoint()
    finally:
        a.store.close()  # (the next owner takes the partition from the checkpoint)
    time.sleep(0.01)  # the label's last vote is now older than seal_after_s

    b = _processor(cfg)
    try:
        assert b.assign(_tps(PART) + _tps(OTHER), N) == {PART: 2, OTHER: 1}
        assert b.store.restored[0] == 1  # the label, with its later vote only
        assert b.catching_up() == [OTHER, PART]
        # positions: the committed offsets; ends: the partitions' end offsets at the assignment
        progress = {TP(t.completions, PART): (1, 1), TP(t.feedback, PART): (0, 3), TP(t.rekeyed, PART): (0, 0)}
        progress.update({tp: (0, 0) for tp in _tps(OTHER)})
        assert b.caught_up(progress) == [OTHER]
        b.fold({TP(t.completions, OTHER): [Rec(other.encode(), completion_json(other), 0, ())],
                TP(t.feedback, OTHER): [Rec(other.encode(), vote_json(other, "u7", -1), 0, ())]})
        time.sleep(0.01)
        msgs, orphans, _ = b.seal_round()
        assert [k.decode() for k, _ in msgs] == [other] and orphans == []  # not the held label
        assert set(_samples(cfg)) == {other}
        assert _gauge(b) == {PART: 0, OTHER: 1}

        b.fold({TP(t.feedback, PART): [Rec(cid.encode(), early_up, 0, ()), Rec(cid.encode(), early_down, 1, ())]})
        time.sleep(0.01)
        assert b.catching_up() == [PART]  # read to 2 of 3
        assert b.seal_round()[0] == []
        b.fold({TP(t.feedback, PART): [Rec(cid.encode(), later, 2, ())]})  # read to 3: caught up
        assert b.catching_up() == []
        assert _gauge(b) == {PART: 1, OTHER: 1}
        time.sleep(0.01)
        msgs, _, _ = b.seal_round()
        assert [k.decode() for k, _ in msgs] == [cid]
        assert b.seal_round()[0] == []  # once
        s = _samples(cfg)[cid]
        assert sorted(s.event_ids) == sorted(map(_eid, (early_up, early_down, later)))
        assert (s.votes_up, s.votes_down) == (2, 1)  # u1 +1, u2 +1, u3 -1
    finally:
        b.store.close()


def test_an_orphan_is_not_expired_until_its_partition_is_caught_up(tmp_path):
    """A restored vote whose completion has not arrived (past ``orphan_ttl_s``) is not
    dead-lettered while its partition catches up; its completion, in the part not read yet,
    meets it, and the label is sealed with the vote."""
    cfg = _cfg(tmp_path)
    t = topic_names()
    cid = ids_by_partition(1, seed=13)[PART][0]
    v = vote_json(cid, "u1", 1)
    a = _processor(cfg)
    try:
        a.assign(_tps(PART), N)
        a.caught_up({tp: (0, 0) for tp in _tps(PART)})
        a.fold({TP(t.feedback, PART): [Rec(cid.encode(), v, 0, ())]})
        a.store.checkpoint()
    finally:
        a.store.close()
    time.sleep(0.01)
    b = _processor(cfg)
    try:
        b.assign(_tps(PART), N)
        b.caught_up({TP(t.completions, PART): (0, 1), TP(t.feedback, PART): (1, 1), TP(t.rekeyed, PART): (0, 0)})
        msgs, orphans, _ = b.seal_round()
        assert msgs == [] and orphans == []  # not expired while held
        b.fold({TP(t.completions, PART): [Rec(cid.encode(), completion_json(cid), 0, ())]})
        assert b.catching_up() == []
        time.sleep(0.01)
        msgs, orphans, _ = b.seal_round()
        assert [k.decode() for k, _ in msgs] == [cid] and orphans == []
        assert _samples(cfg)[cid].event_ids == [_eid(v)]
    finally:
        b.store.close()


def test_a_partition_not_caught_up_in_time_is_sealed_anyway_with_a_warning(tmp_path, caplog):
    """``catchup_timeout_s`` after the assignment the held partition is released: a warning
    names it and its positions, and its due labels are sealed at that seal round. Partitions
    whose end offset never came stay held until then."""
    cfg = _cfg(tmp_path, catchup_timeout_s=30)
    t = topic_names()
    cid = ids_by_partition(1, seed=14)[PART][0]
    p = _processor(cfg)
    try:
        p.assign(_tps(PART), N)
        p.caught_up({TP(t.feedback, PART): (0, 5)})  # (the other topics' figures never came)
        p.fold({TP(t.completions, PART): [Rec(cid.encode(), completion_json(cid), 0, ())],
                TP(t.feedback, PART): [Rec(cid.encode(), vote_json(cid), 0, ())]})
        time.sleep(0.01)
        assert p.seal_round()[0] == [] and p.catching_up() == [PART]
        assert p.expire_catchup(now=time.monotonic() + 1) == []  # before the deadline
        with caplog.at_level(logging.WARNING, logger="ingest"):
            assert p.expire_catchup(now=time.monotonic() + 31) == [PART]
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and f"partition {PART} not caught up within catchup_timeout_s=30" in warned[0]
        assert f'"{t.feedback}:{PART}": {{"end": 5, "position": 1}}' in warned[0]
        msgs, _, _ = p.seal_round()
        assert [k.decode() for k, _ in msgs] == [cid]
    finally:
        p.store.close()


def test_a_lost_membership_holds_every_partition_until_the_next_assignment(tmp_path):
    """The runtime calls ``hold_all`` when its group membership is lost: nothing is sealed
    until the next assignment has caught up."""
    cfg = _cfg(tmp_path)
    t = topic_names()
    cid = ids_by_partition(1, seed=15)[PART][0]
    p = _processor(cfg)
    try:
        p.assign(_tps(PART), N)
        p.caught_up({tp: (0, 0) for tp in _tps(PART)})
        p.fold({TP(t.completions, PART): [Rec(cid.encode(), completion_json(cid), 0, ())],
                TP(t.feedback, PART): [Rec(cid.encode(), vote_json(cid), 0, ())]})
        assert p.hold_all() == [PART]
        time.sleep(0.01)
        assert p.seal_round()[0] == []
        assert p.expire_catchup(now=time.monotonic() + 10**6) == []  # (no timeout: released by the next assignment)
        p.store.checkpoint()  # (the rejoin: the worker checkpoints, then the state is revoked and restored)
        p.revoke()
        p.assign(_tps(PART), N)
        assert p.seal_round()[0] == []
        p.caught_up({TP(t.completions, PART): (1, 1), TP(t.feedback, PART): (1, 1), TP(t.rekeyed, PART): (0, 0)})
        msgs, _, _ = p.seal_round()
        assert [k.decode() for k, _ in msgs] == [cid]
    finally:
        p.store.close()


def test_catchup_timeout_must_be_positive_and_finite(tmp_path):
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="catchup_timeout_s: must be > 0 seconds and finite"):
            _cfg(tmp_path, catchup_timeout_s=bad)


# -- a real broker and real worker processes ------------------------------------------------

def _worker(env: dict, log: Path, seal_after_s: float, checkpoint_s: float, tick_s: float = 0.5,
            *extra: str) -> subprocess.Popen:
    """``python -m ingest`` with its own seal delay, checkpoint interval and seal tick."""
    from flywheel.supervise import die_with_parent

    return subprocess.Popen(
        [sys.executable, "-m", "ingest", "--seal-after-s", f"{seal_after_s:g}", "--checkpoint-s", f"{checkpoint_s:g}",
         "--orphan-ttl-s", "60", "--tick-s", f"{tick_s:g}", *extra],
        cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=die_with_parent())


def _rows(state: Path, q: str, args=()) -> list[tuple]:
    if not state.exists():
        return []
    db = sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=10)
    try:
        return db.execute(q, args).fetchall()
    except sqlite3.OperationalError:  # tables not created yet
        return []
    finally:
        db.close()


def _logged(log: Path, text: str) -> bool:
    return log.exists() and text in log.read_text()


def _caught_up(log: Path) -> dict[int, dict[str, int]]:
    """``{partition: {topic:partition: end offset read to}}`` of every ``ingest caught up on
    partitions`` line of a worker's log."""
    out: dict[int, dict[str, int]] = {}
    for ln in log.read_text().splitlines() if log.exists() else ():
        if "ingest caught up on partitions " in ln:
            out.update({int(p): v for p, v in json.loads(ln.split("ingest caught up on partitions ", 1)[1]).items()})
    return out


@pytest.mark.timeout(180)
def test_sigkill_takeover_successor_reads_what_the_killed_worker_never_checkpointed(broker, fw_home, tmp_path):
    """Worker 1 folds a completion and its first vote (u1 +1), checkpoints them and stops
    (seal delay 10 s: the label is due 10 s after that vote, in the checkpoint store). Then
    3,000 redeliveries of that vote and a second vote (u2 -1) are produced; worker 2 (seal
    delay and checkpoint interval an hour) takes the partition over, reads them, and is
    SIGKILLed: the second vote was folded only in its memory. Once the label's due time has
    passed, worker 3 (a seal round every 50 ms) restores the label with the first vote alone,
    due at once, committed offsets before the redeliveries: it seals the label only after
    reading the partition to its end, so the one sample holds both votes and no vote is
    dead-lettered as late."""
    from ingest.partition import home_partition
    from samplestore.catalog import read_samples
    from schemas.events import FeedbackEvent, now_ms
    from test_ingest_e2e import _completion, produce, read_dead, stop, wait_for

    env = dict(os.environ, FLYWHEEL_HOME=str(fw_home), FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap,
               PYTHONPATH=str(ROOT))
    env = {k: v for k, v in env.items() if not k.startswith("FLYWHEEL_REWARD__")}
    state, samples_dir = fw_home / "ingest" / "state.sqlite", fw_home / "data" / "samples"
    comp = _completion(uuid.uuid4(), "v0001")
    cid = str(comp.completion_id)
    part = home_partition(cid, 6)
    base = now_ms() - 60_000
    v1 = FeedbackEvent(event_id=uuid.uuid4(), completion_id=comp.completion_id, user_hash="u1", value=1,
                       created_at=base)
    v2 = FeedbackEvent(event_id=uuid.uuid4(), completion_id=comp.completion_id, user_hash="u2", value=-1,
                       created_at=base + 1)
    logs = [tmp_path / f"w{i}.log" for i in (1, 2, 3)]
    t = topic_names()

    w1 = _worker(env, logs[0], 10, 0.2)
    try:
        wait_for(lambda: _logged(logs[0], "ingest owns partitions"), 90, "worker 1 owning the partitions", w1, logs[0])
        produce(broker.bootstrap, [comp], [v1])
        wait_for(lambda: _rows(state, "SELECT 1 FROM events WHERE event_id=?", (str(v1.event_id),)), 60,
                 "the first vote checkpointed", w1, logs[0])
        t_ckpt = time.monotonic()  # the label is due at most 10 s from now
    finally:
        stop(w1)  # SIGTERM: a last checkpoint, offsets committed
    assert w1.returncode == 0, logs[0].read_text()[-3000:]
    assert _rows(state, "SELECT completion_id FROM labels") == [(cid,)] and not _rows(state, "SELECT * FROM sealed")

    produce(broker.bootstrap, [], [v1] * 3000 + [v2])
    w2 = _worker(env, logs[1], 3600, 3600)
    try:
        wait_for(lambda: part in _caught_up(logs[1]), 90, "worker 2 reading the partition to its end", w2, logs[1])
    finally:
        stop(w2, signal.SIGKILL)
    assert not _rows(state, "SELECT 1 FROM events WHERE event_id=?", (str(v2.event_id),)), \
        "worker 2 checkpointed the second vote: nothing left for its successor to re-read"
    assert not _rows(state, "SELECT * FROM sealed") and not any(samples_dir.glob("**/*.parquet"))

    time.sleep(max(0.0, t_ckpt + 11 - time.monotonic()))  # the restored label is due
    w3 = _worker(env, logs[2], 1, 1, 0.05)  # a seal round every 50 ms while it reads the partition
    try:
        wait_for(lambda: any(samples_dir.glob("**/*.parquet")), 90, "the sample", w3, logs[2])
        time.sleep(2)  # nothing more may appear (a second sample of the label would)
        assert "ingest restored 1 open labels" in logs[2].read_text()
        # read to the end: the completion, then the first vote, its 3,000 redeliveries and the second vote
        assert _caught_up(logs[2])[part] == {f"{t.completions}:{part}": 1, f"{t.feedback}:{part}": 3002,
                                             f"{t.rekeyed}:{part}": 0}
        got = read_samples(samples_dir)
        assert [str(s.completion_id) for s in got] == [cid]
        assert sorted(got[0].event_ids) == sorted([str(v1.event_id), str(v2.event_id)])
        assert (got[0].votes_up, got[0].votes_down) == (1, 1)
        late = [d for d in read_dead(broker.bootstrap) if "late" in d.reason]
        assert late == [], [d.reason for d in late]
        assert w3.poll() is None
    finally:
        stop(w3)
