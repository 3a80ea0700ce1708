"""Fuzzing both topics the ingest worker reads (issue 11): 10,000+ records mixing valid
events with adversarial ones, through a real worker subprocess on the real Tansu broker.

The worker must never stop; every bad record ends as a dead letter naming a field and a
reason; every valid event ends in exactly one sample (checked against the independent
reference join of ``tests/test_ingest_e2e.py``); the dead letters per source topic equal the
count computed here from what was produced.
"""

from __future__ import annotations

import json
import os
import random
import uuid
from collections import Counter
from pathlib import Path

import pytest

from schemas import topics
from schemas.events import now_ms

from test_ingest_e2e import ROOT, check, make_traffic, read_dead, reference_join, stop, wait_for  # noqa: I001

N_RECORDS = 10_000


def _completion_obj(cid: str, **kw) -> dict:
    d = dict(schema_version=1, completion_id=cid, request_id="r", created_at=now_ms(), model_version="v0000",
             pod="p0", user_hash="a", prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5, 6],
             behavior_logprobs=[-0.5, -1.25, -0.3],
             sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": None},
             finish_reason="stop", ttft_ms=1.0, latency_ms=2.0)
    d.update(kw)
    return d


def _vote_obj(cid: str, **kw) -> dict:
    d = dict(schema_version=1, event_id=str(uuid.uuid4()), completion_id=cid, user_hash="fuzz", kind="thumb",
             value=1, created_at=now_ms())
    d.update(kw)
    return d


def _compact(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()  # serving's layout (NaN/Infinity as literals)


def bad_feedback(rng: random.Random) -> bytes | None:
    """One adversarial value for flywheel.feedback (every one must be dead-lettered)."""
    cid = str(uuid.uuid4())
    # the big ones (deep nesting up to 250 KB) are rare: a few dozen of them, not megabytes each second
    kind = rng.choices(range(12), weights=[1, 1] + [30] * 10)[0]
    if kind == 0:
        return b"[" * rng.randint(1_000, 100_000)  # deep nesting
    if kind == 1:
        return b'{"a":' * 50_000  # deep nesting, objects
    if kind == 2:
        return b"\xff\xfe\x80" + os.urandom(rng.randint(1, 64))  # invalid UTF-8
    if kind == 3:
        return _compact(_vote_obj(cid, value=float(rng.choice(["nan", "inf", "-inf"]))))  # non-finite
    if kind == 4:
        return _compact(_vote_obj(cid))[:-1] + b',"value":-1}'  # duplicate key
    if kind == 5:
        return _compact(_vote_obj(cid, value=rng.choice(["up", True, None, [1]])))  # wrong type
    if kind == 6:
        return _compact(_vote_obj(cid, created_at=now_ms() // 1000))  # wrong unit: seconds
    if kind == 7:
        return _compact(_vote_obj(cid, schema_version=rng.choice([0, 2, 99, "1"])))  # unknown schema
    if kind == 8:
        return None  # tombstone
    if kind == 9:
        return _compact(_vote_obj(cid))[: rng.randint(1, 60)]  # truncated
    if kind == 10:
        return _compact(_vote_obj(cid, extra_field=1))  # unknown field
    return rng.choice([b"", b"null", b"42", b'"x"', b"[]", b"{}"])


def bad_completion(rng: random.Random) -> tuple[bytes | None, bytes | None]:
    """One adversarial value for flywheel.completions, and a valid vote for it when its head
    is valid (a bad body is found when its label is sealed: the body and the vote are both
    dead-lettered)."""
    cid = str(uuid.uuid4())
    kind = rng.choices(range(8), weights=[20, 20, 20, 20, 1, 1, 20, 20])[0]  # 4, 5: ~300 KB / 100 KB, rare
    vote = _compact(_vote_obj(cid))
    if kind == 0:
        return _compact(_completion_obj(cid, behavior_logprobs=[float("nan"), float("inf"), -0.3])), vote
    if kind == 1:
        return _compact(_completion_obj(cid, behavior_logprobs=[-0.1])), vote  # wrong length
    if kind == 2:
        return _compact(_completion_obj(cid, prompt_token_ids="abc")), vote  # wrong type in the body
    if kind == 3:
        return _compact(_completion_obj(cid, created_at=now_ms() // 1000)), None  # seconds: refused at once
    if kind == 4:
        huge = _completion_obj(cid, completion_token_ids=[1] * 60_000, behavior_logprobs=[0.0] * 59_999)
        return _compact(huge), vote  # ~300 KB and inconsistent
    if kind == 5:
        return b"[" * 100_000, None  # the record that stopped the join forever
    if kind == 6:
        return None, None  # tombstone
    return _compact(_completion_obj(cid, schema_version=7)), None


@pytest.mark.timeout(420)
def test_fuzzed_topics_never_stop_the_join_and_lose_nothing(broker, fw_home, tmp_path):
    from kafka import KafkaProducer

    rng = random.Random(11)
    comps, fb = make_traffic(400, seed=5)
    expected = reference_join(comps, fb)
    n_valid = len(comps) + len(fb)
    n_bad_c = 600
    n_bad_f = N_RECORDS - n_valid - n_bad_c
    assert n_bad_f > 5_000
    bad_c = [bad_completion(rng) for _ in range(n_bad_c)]
    bad_f = [bad_feedback(rng) for _ in range(n_bad_f)]
    want_dead = Counter({topics.FEEDBACK: n_bad_f, topics.COMPLETIONS: n_bad_c})
    want_dead[topics.FEEDBACK] += sum(1 for _, v in bad_c if v is not None)  # a bad body's vote
    total = n_valid + n_bad_c + n_bad_f + sum(1 for _, v in bad_c if v is not None)
    assert total >= N_RECORDS

    p = KafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=5, max_request_size=2 << 20)
    items = [(topics.COMPLETIONS, str(c.completion_id).encode(), c.to_bytes()) for c in comps]
    items += [(topics.COMPLETIONS, str(uuid.uuid4()).encode(), v) for v, _ in bad_c]
    items += [(topics.FEEDBACK, b"fuzz", v) for v in bad_f]
    rng.shuffle(items)  # valid and adversarial records interleaved on every partition
    for t, k, v in items:
        p.send(t, key=k, value=v)
    p.flush()
    for e in fb:  # votes after their completions (no orphans among the valid events)
        p.send(topics.FEEDBACK, key=str(e.completion_id).encode(), value=e.to_bytes())
    for _, vote in bad_c:
        if vote is not None:
            p.send(topics.FEEDBACK, key=json.loads(vote)["completion_id"].encode(), value=vote)
    p.flush()
    p.close()

    env = dict(os.environ, FLYWHEEL_HOME=str(fw_home), FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap,
               PYTHONPATH=str(ROOT))
    log = tmp_path / "worker.log"
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "ingest", "--seal-after-s", "2", "--orphan-ttl-s", "4", "--tick-s", "0.5"],
        cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    samples_dir = fw_home / "data" / "samples"
    try:
        def done():
            from ingest.catalog import read_samples

            dead = Counter(d.source_topic for d in read_dead(broker.bootstrap))
            return (any(samples_dir.glob("**/*.parquet")) and len(read_samples(samples_dir)) >= len(expected)
                    and all(dead[t] >= n for t, n in want_dead.items()))

        wait_for(done, 300, "every sample and every dead letter", proc, log)
        assert proc.poll() is None, "the worker stopped"
        check(samples_dir, expected)  # every valid event in exactly one sample
        dead = read_dead(broker.bootstrap)
        assert Counter(d.source_topic for d in dead) == want_dead
        assert all(d.field and d.reason for d in dead)
        fields = Counter(d.field for d in dead if d.source_topic == topics.FEEDBACK)
        for f in ("value", "created_at", "schema_version", "extra_field"):
            assert fields[f] > 0, (f, fields)
    finally:
        stop(proc)
