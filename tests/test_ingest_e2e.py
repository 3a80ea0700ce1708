"""Ingest against a real Tansu broker, the worker as a real subprocess (``python -m ingest``).

The expected samples come from an independent reference join over the raw events the test
produced (dedupe by event_id, each user's vote with the largest (created_at, produce order)).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from schemas.settings import topic_names
from schemas.arrow import FORMAT_VERSION
from schemas.events import CompletionEvent, DeadLetter, FeedbackEvent, SamplingParams, now_ms
from flywheel.supervise import die_with_parent

ROOT = Path(__file__).resolve().parents[1]


def _completion(cid, version) -> CompletionEvent:
    return CompletionEvent(
        completion_id=cid, request_id=f"r-{cid}", created_at=now_ms(), model_version=version, pod="p0",
        user_hash="author", prompt_token_ids=[1, 2, 3], completion_token_ids=[7, 8, 9],
        behavior_logprobs=[-0.1, -0.2, -0.3], sampling=SamplingParams(temperature=0.7),
        finish_reason="stop", ttft_ms=1.0, latency_ms=3.0)


def make_traffic(n_completions: int, seed: int):
    """Completions + feedback with duplicates, flips and several users; returns
    ``(completions, feedback_in_produce_order)``."""
    rng = random.Random(seed)
    comps = [_completion(uuid.UUID(int=rng.getrandbits(128), version=4), f"v000{i % 2}")
             for i in range(n_completions)]
    fb: list[FeedbackEvent] = []
    # votes stamped in the past (flips 5 s after): a time ahead of the worker's clock is clamped to it
    # (schemas.events.clamp_event_time), which the reference join does not model
    base = now_ms() - 60_000
    for c in comps:
        for u in range(rng.randint(0, 3)):  # some completions get no vote: dropped, not samples
            v = rng.choice([1, -1])
            ev = FeedbackEvent(event_id=uuid.UUID(int=rng.getrandbits(128), version=4),
                               completion_id=c.completion_id, user_hash=f"user{u}", value=v,
                               created_at=base + rng.randint(0, 1000))
            fb.append(ev)
            if rng.random() < 0.3:
                fb.append(ev)  # duplicate delivery
            if rng.random() < 0.3:  # flip, later
                fb.append(FeedbackEvent(event_id=uuid.UUID(int=rng.getrandbits(128), version=4),
                                        completion_id=c.completion_id, user_hash=f"user{u}", value=-v,
                                        created_at=ev.created_at + 5000))
    rng.shuffle(fb)  # cross-completion order is arbitrary; per user order fixed by created_at
    return comps, fb


def reference_join(comps, fb):
    """Independent join: ``{completion_id: (up, down, set(event_ids))}`` for voted completions."""
    known = {str(c.completion_id) for c in comps}
    seen, last, eids = set(), {}, {}
    for i, e in enumerate(fb):
        eid, cid = str(e.event_id), str(e.completion_id)
        if eid in seen or cid not in known:
            continue
        seen.add(eid)
        eids.setdefault(cid, set()).add(eid)
        k = (cid, e.user_hash)
        if k not in last or (e.created_at, i) > last[k][0]:
            last[k] = ((e.created_at, i), e.value)
    out = {}
    for cid in eids:
        vals = [v for (c, _), (_, v) in last.items() if c == cid]
        out[cid] = (sum(v > 0 for v in vals), sum(v < 0 for v in vals), eids[cid])
    return out


def produce(bootstrap, comps, fb, bad: list[bytes] = ()):
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    for c in comps:
        p.send(topic_names().completions, key=str(c.completion_id).encode(), value=c.to_bytes())
    p.flush()
    for e in fb:
        p.send(topic_names().feedback, key=str(e.completion_id).encode(), value=e.to_bytes())
    for b in bad:
        p.send(topic_names().feedback, key=b"bad", value=b)
    p.flush()
    p.close()


def start_worker(env, log: Path, orphan_ttl_s: float = 4) -> subprocess.Popen:
    """An ingest worker subprocess (seal 3 s after the last vote, tick 0.5 s). ``orphan_ttl_s``
    must exceed the longest time a vote can be folded before its completion: a rebalance after
    a broker restart re-reads both topics from the start (tests that cause one pass 30)."""
    return subprocess.Popen(
        [sys.executable, "-m", "ingest", "--seal-after-s", "3", "--orphan-ttl-s", f"{orphan_ttl_s:g}", "--tick-s", "0.5"],
        cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent())


def stop(proc: subprocess.Popen, sig=signal.SIGTERM):
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def read_dead(bootstrap) -> list[DeadLetter]:
    from kafka import KafkaConsumer

    c = KafkaConsumer(topic_names().deadletter, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                      consumer_timeout_ms=3000, enable_auto_commit=False)
    out = [DeadLetter.from_bytes(m.value) for m in c]
    c.close()
    return out


def check_notices(bootstrap, samples_dir, got, every: bool) -> None:
    """``flywheel.samples`` holds SampleNotices (the default value, D67), each naming the shard
    row that holds its sample (read back with pyarrow) with the sample's own label; ``every``:
    one per sample of ``got`` (a worker killed between a shard and its publish leaves a gap)."""
    import pyarrow.parquet as pq
    from kafka import KafkaConsumer
    from schemas.events import SampleNotice

    c = KafkaConsumer(topic_names().samples, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                      consumer_timeout_ms=3000, enable_auto_commit=False)
    msgs = list(c)
    c.close()
    by_cid = {str(s.completion_id): s for s in got}
    seen = set()
    for m in msgs:
        n = SampleNotice.from_bytes(m.value)
        s = by_cid[str(n.completion_id)]
        assert m.key.decode() == str(n.completion_id) and n.shard_format == FORMAT_VERSION
        row = pq.read_table(samples_dir / n.shard).slice(n.row, 1).to_pylist()[0]
        assert row["completion_id"] == str(n.completion_id)
        assert (n.label, n.votes_up, n.votes_down, sorted(n.event_ids), n.model_version, n.split) == (
            s.label, s.votes_up, s.votes_down, sorted(s.event_ids), s.model_version, s.split)
        assert n.reward == pytest.approx(s.reward, rel=1e-6)  # (the shard's column is float32)
        seen.add(str(n.completion_id))
    if every:
        assert seen == set(by_cid) and len(msgs) == len(got)


def wait_for(cond, timeout_s, what, proc=None, log=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"worker exited {proc.returncode}: {log.read_text()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}: {log.read_text()[-3000:] if log else ''}")


def read_samples_now(samples_dir):
    from samplestore.catalog import read_samples

    return read_samples(samples_dir)


def check(samples_dir, expected):
    from samplestore.catalog import read_samples

    got = read_samples(samples_dir)
    by_cid = {}
    for s in got:
        assert str(s.completion_id) not in by_cid, f"completion {s.completion_id} sealed twice"
        by_cid[str(s.completion_id)] = s
    assert set(by_cid) == set(expected)
    all_eids = [e for s in got for e in s.event_ids]
    assert len(all_eids) == len(set(all_eids)), "an event is in two samples"
    for cid, (up, down, eids) in expected.items():
        s = by_cid[cid]
        assert (s.votes_up, s.votes_down, set(s.event_ids)) == (up, down, eids), cid
        assert s.label == (up > down) and s.reward == pytest.approx((up - down) / (up + down))
    return got


@pytest.mark.timeout(240)
@pytest.mark.parametrize("crash,workers", [(False, 1), (True, 1), (False, 2)], ids=["clean", "sigkill", "two_workers"])
def test_worker_joins_every_accepted_event_exactly_once(broker, fw_home, tmp_path, crash, workers):
    env = dict(os.environ, FLYWHEEL_HOME=str(fw_home), FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap,
               PYTHONPATH=str(ROOT))
    samples_dir = fw_home / "data" / "samples"
    comps, fb = make_traffic(60, seed=1 if crash else 0)
    bad = [b"{oops", json.dumps({"schema_version": 9}).encode(),
           json.dumps({"event_id": "x", "completion_id": str(uuid.uuid4()), "user_hash": "u",
                       "value": 1, "created_at": 1}).encode()]
    expected = reference_join(comps, fb)
    log = tmp_path / "worker.log"
    # crash run: feedback of the first half of the completions, then (after the kill) of the
    # second half, so that no vote is late by construction
    first = {c.completion_id for c in comps[: len(comps) // 2]}
    fb1 = [e for e in fb if e.completion_id in first]
    fb2 = [e for e in fb if e.completion_id not in first]
    def last_assignment(path):
        lines = [ln for ln in path.read_text().splitlines() if "ingest assigned" in ln] if path.exists() else []
        # the completions and feedback partitions (the internal topic of forwarded records is
        # assigned alongside them)
        return {tp for tp in json.loads(lines[-1].split("ingest assigned", 1)[1])
                if "ingest.rekeyed" not in tp} if lines else set()

    def split():
        a1, a2 = last_assignment(log), last_assignment(tmp_path / "worker2.log")
        return bool(a1 and a2 and not a1 & a2 and len(a1 | a2) == 12)

    if workers == 1:
        produce(broker.bootstrap, comps, fb1 if crash else fb, () if crash else bad)
    proc = start_worker(env, log)
    extra = [start_worker(env, tmp_path / "worker2.log") for _ in range(workers - 1)]
    if workers > 1:  # both workers hold their share of the partitions before the traffic comes,
        # so that each folds part of it (a worker that starts late would find the work done)
        wait_for(split, 120, "two workers splitting the 12 partitions", proc, log)
        produce(broker.bootstrap, comps, fb, bad)
    try:
        if crash:
            # kill mid-stream: once the first shard exists (some labels sealed, others open)
            wait_for(lambda: any(samples_dir.glob("**/*.parquet")), 90, "first shard", proc, log)
            stop(proc, signal.SIGKILL)
            produce(broker.bootstrap, [], fb2, bad)
            proc = start_worker(env, log)
        n_expected = len(expected)

        def done():
            from samplestore.catalog import read_samples
            return any(samples_dir.glob("**/*.parquet")) and len(read_samples(samples_dir)) >= n_expected

        wait_for(done, 120, f"{n_expected} samples", proc, log)
        time.sleep(4)  # nothing more may appear (a label sealed twice would)
        got = check(samples_dir, expected)
        check_notices(broker.bootstrap, samples_dir, got, every=not crash)
        dead = read_dead(broker.bootstrap)
        reasons = sorted(d.field for d in dead)
        assert reasons.count("value") >= 1 and "schema_version" in reasons and "event_id" in reasons
        if workers > 1:  # the two workers still split the partitions (last assignment of each)
            assert split(), (last_assignment(log), last_assignment(tmp_path / "worker2.log"))
        if not crash and workers == 1:  # orphans and late votes, through the real worker
            sealed = got[0]
            late = FeedbackEvent(event_id=uuid.uuid4(), completion_id=sealed.completion_id, user_hash="latecomer",
                                 value=1, created_at=now_ms())
            orphans = [FeedbackEvent(event_id=uuid.uuid4(), completion_id=uuid.uuid4(), user_hash="u", value=-1,
                                     created_at=now_ms()) for _ in range(2)]
            replay = next(e for e in fb if str(e.event_id) in sealed.event_ids)  # already in a sample
            # a completion whose head is fine but whose body is not (validated at sealing), voted on
            broken = _completion(uuid.uuid4(), "v0000")
            broken_raw = broken.to_bytes().replace(b'"behavior_logprobs":[-0.1,', b'"behavior_logprobs":[')
            broken_vote = FeedbackEvent(event_id=uuid.uuid4(), completion_id=broken.completion_id, user_hash="u",
                                        value=1, created_at=now_ms())
            from kafka import KafkaProducer
            kp = KafkaProducer(bootstrap_servers=broker.bootstrap)
            kp.send(topic_names().completions, key=str(broken.completion_id).encode(), value=broken_raw)
            kp.flush()
            kp.close()
            produce(broker.bootstrap, [], [late, replay, broken_vote] + orphans)

            def dead_feedback():
                return [d for d in read_dead(broker.bootstrap) if d.field == "completion_id"]

            wait_for(lambda: len(dead_feedback()) >= 4, 60, "orphan + late + malformed dead letters", proc, log)
            time.sleep(2)
            dl = dead_feedback()
            by_eid = {json.loads(d.payload)["event_id"]: d.reason for d in dl}
            assert len(dl) == 4 and by_eid[str(late.event_id)].startswith("late")
            assert all(by_eid[str(o.event_id)].startswith("orphan") for o in orphans)
            assert by_eid[str(broken_vote.event_id)].startswith("malformed completion")
            (dc,) = [d for d in read_dead(broker.bootstrap) if d.source_topic == topic_names().completions]
            assert dc.key == str(broken.completion_id) and "behavior_logprobs: 2 values for 3" in dc.reason
            assert dc.payload == broken_raw.decode()
            # every accepted event: in exactly one sample or one dead letter, never both
            in_samples = {e for s in read_samples_now(samples_dir) for e in s.event_ids}
            accepted = {str(e.event_id) for e in fb + [late, broken_vote] + orphans}
            assert in_samples | set(by_eid) == accepted and not in_samples & set(by_eid)
            assert len(read_samples_now(samples_dir)) == len(got)  # the replayed vote changed nothing
            from samplestore.catalog import query
            dbr = {(r["field"], r["reason"]): r["n"] for r in query("SELECT * FROM deadletters_by_reason", samples_dir)}
            assert dbr[("completion_id", "orphan")] == 2 and dbr[("completion_id", "late")] == 1
            assert dbr[("value", "bad JSON")] == 1 and dbr[("schema_version", "unknown schema_version 9 (this worker reads 1)")] == 1
        # the catalog file has the views
        import duckdb
        con = duckdb.connect(str(fw_home / "catalog.duckdb"), read_only=True)
        con.execute("SET file_search_path = ?", [str(fw_home)])  # the views' globs are relative to the catalog
        rows = con.execute("SELECT sum(samples), sum(votes_up), sum(votes_down) FROM votes_by_version").fetchone()
        con.close()
        assert rows == (len(got), sum(u for u, _, _ in expected.values()), sum(d for _, d, _ in expected.values()))
    finally:
        for p in [proc] + extra:
            stop(p)
