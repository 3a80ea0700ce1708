"""A dead-lettered event is in a dead-letter file before it is marked dead-lettered.

The chaos run (``tests/test_chaos.py``) once lost two orphan votes: the worker published
their dead letters, marked them dead-lettered, and was SIGKILLed before the next
housekeeping wrote the dead-letter file. Here a real worker (in this process, on the real
Tansu broker) dead-letters one orphan vote (seal thread) and one vote older than the dedupe
horizon (consumer loop); at the moment each event is marked dead-lettered in the join state, the
dead-letter files must already hold it, so a kill at that moment loses nothing.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

import pyarrow.parquet as pq

from schemas.settings import topic_names
from schemas.events import now_ms


def _event_ids_in_files(dead_dir) -> set[str]:
    out = set()
    for f in dead_dir.glob("*.parquet"):
        for d in pq.read_table(f).to_pylist():
            try:
                out.add(str(json.loads(d["payload"])["event_id"]))
            except (ValueError, KeyError, TypeError):
                out.add("unparsable:" + d["payload"][:40])
    return out


def test_dead_letters_are_in_a_file_before_they_are_marked(fw_home, broker_env):
    from kafka import KafkaProducer

    from ingest.app import IngestConfig
    from ingest.join import JoinConfig
    from ingest.worker import Worker

    cfg = IngestConfig(join=JoinConfig(seal_after_s=1, max_label_age_s=60, orphan_ttl_s=1), tick_s=0.2,
                       bootstrap=broker_env.bootstrap)
    worker = Worker(cfg)
    seen_at_mark: list[tuple[list[str], set[str]]] = []
    real_mark_dead = worker.store.mark_dead

    def mark_dead(event_ids, *a, **kw):  # the real method, observed: what the files hold right now
        seen_at_mark.append((list(event_ids), _event_ids_in_files(worker.dead_dir)))
        return real_mark_dead(event_ids, *a, **kw)

    worker.store.mark_dead = mark_dead

    orphan_id = str(uuid.uuid4())
    vote = dict(schema_version=1, event_id=orphan_id, completion_id=str(uuid.uuid4()), user_hash="u",
                kind="thumb", value=1, created_at=now_ms())
    p = KafkaProducer(bootstrap_servers=broker_env.bootstrap)
    p.send(topic_names().feedback, key=vote["completion_id"].encode(), value=json.dumps(vote).encode())
    expired = dict(vote, event_id=str(uuid.uuid4()), completion_id=str(uuid.uuid4()),
                   created_at=now_ms() - 8 * 86_400_000)  # past the 7-day dedupe horizon: consumer loop
    p.send(topic_names().feedback, key=expired["completion_id"].encode(), value=json.dumps(expired).encode())
    p.flush()
    p.close()

    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    t = threading.Thread(target=lambda: loop.run_until_complete(worker.run(stop)), daemon=True)
    t.start()
    counters: dict[str, int] = {}
    try:
        deadline = now_ms() + 60_000
        while now_ms() < deadline and counters.get("feedback_orphaned", 0) < 1:
            threading.Event().wait(0.2)
            counters = worker.store.counters()
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(60)
    assert counters.get("feedback_orphaned") == 1, counters

    marked = {e for ids, _ in seen_at_mark for e in ids}
    assert {orphan_id, expired["event_id"]} <= marked
    for ids, in_files in seen_at_mark:
        for eid in ids:
            assert eid in in_files, f"{eid} was marked dead-lettered before a dead-letter file held it"
