"""The ingest worker's Prometheus ``/metrics`` (``ingest.metrics``), read over real HTTP from
a real worker subprocess on a real Tansu broker; the expected figures are counted from the
records the test produced. Consumer lag is checked against a real aiokafka consumer after a
multi-record batch (where Tansu's ListOffsets under-reports the end, DESIGN §3)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ingest.metrics import DEADLETTER_REASONS, IngestMetrics, reason_class
from schemas.events import FeedbackEvent, now_ms
from schemas.settings import free_port, topic_names
from tests.test_ingest_e2e import ROOT, _completion, produce, stop, wait_for
from flywheel.supervise import die_with_parent


def samples_of(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.mark.parametrize("field,reason,want", [
    ("completion_id", "orphan: completion x not seen within orphan_ttl_s=600", "orphan"),
    ("completion_id", "late: label of completion x already sealed", "late"),
    ("created_at", "expired: created_at 1 ms is older than the dedupe horizon", "expired"),
    ("completion_id", "malformed completion: x failed validation (sampling: bad)", "malformed_completion"),
    ("completion_id", "duplicate key: the body's created_at 2 differs from the first one 1", "duplicate_key"),
    ("value", "null record value (tombstone)", "tombstone"),
    ("value", "bad JSON: JSONDecodeError: Expecting value", "unparseable"),
    ("value", "unparseable record: UnicodeDecodeError: x", "unparseable"),
    ("value", "expected a JSON object, got list", "unparseable"),
    ("kind", "kind 'edit' is not used by the label yet", "unsupported_kind"),
    ("schema_version", "unsupported schema_version 9", "unsupported_schema_version"),
    ("value", "Input should be 1 or -1 (input 3)", "invalid"),
])
def test_reason_class_is_bounded(field, reason, want):
    assert reason_class(field, reason) == want
    assert want in DEADLETTER_REASONS


@pytest.mark.timeout(120)
def test_worker_metrics_endpoint_counts_what_was_produced(broker, fw_home, tmp_path):
    comps = [_completion(uuid.uuid4(), "v000000") for _ in range(8)]
    base = now_ms()
    fb = []
    for i, c in enumerate(comps[:6]):  # 6 voted completions, 2 without a vote
        fb.append(FeedbackEvent(event_id=uuid.uuid4(), completion_id=c.completion_id, user_hash=f"u{i}",
                                value=1 if i % 2 else -1, created_at=base + i))
    fb.append(fb[0])  # one duplicate delivery
    orphan = FeedbackEvent(event_id=uuid.uuid4(), completion_id=uuid.uuid4(), user_hash="u9", value=1,
                           created_at=base)
    fb.append(orphan)  # its completion never comes: dead-lettered as orphan after orphan_ttl_s
    bad = [b"not json", json.dumps({"schema_version": 1, "event_id": str(uuid.uuid4())}).encode()]
    produce(broker.bootstrap, comps, fb, bad=bad)

    port = free_port()
    env = dict(os.environ, FLYWHEEL_HOME=str(fw_home), FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap)
    log = tmp_path / "worker.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ingest", "--seal-after-s", "2", "--orphan-ttl-s", "3", "--max-label-age-s", "4",
         "--tick-s", "0.5", "--worker-port", str(port)],
        cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent())
    url = f"http://127.0.0.1:{port}"
    try:
        def scrape():
            try:
                r = httpx.get(url + "/metrics", timeout=5)
            except httpx.HTTPError:
                return {}
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            return samples_of(r.text)

        def done():
            m = scrape()
            return (m.get(("flywheel_ingest_samples_sealed_total", ()), 0) == 6
                    and m.get(("flywheel_ingest_deadletters_total",
                               (("reason", "orphan"), ("topic", topic_names().feedback))), 0) == 1)

        wait_for(done, 90, "6 samples sealed and 1 orphan dead letter", proc, log)
        m = scrape()
        c, f = (("topic", topic_names().completions),), (("topic", topic_names().feedback),)
        assert m[("flywheel_ingest_records_consumed_total", c)] == 8
        assert m[("flywheel_ingest_records_consumed_total", f)] == len(fb) + len(bad)
        assert m[("flywheel_ingest_records_joined_total", c)] == 8
        assert m[("flywheel_ingest_records_joined_total", f)] == 7  # 6 votes + the orphan (held, then dead)
        assert m[("flywheel_ingest_records_duplicate_total", f)] == 1
        dead = {dict(k[1])["reason"]: v for k, v in m.items() if k[0] == "flywheel_ingest_deadletters_total"}
        assert dead == {"orphan": 1, "unparseable": 1, "invalid": 1}
        assert m[("flywheel_ingest_seal_delay_seconds_count", ())] == 6
        assert m[("flywheel_ingest_seal_round_seconds_count", ())] >= 1
        # every assigned partition reports a lag >= 0 (6 partitions x 2 topics, one worker)
        lags = {k[1]: v for k, v in m.items() if k[0] == "flywheel_ingest_consumer_lag"}
        assert m[("flywheel_ingest_assigned_partitions", ())] == 12
        assert len(lags) <= 12 and all(v >= 0 for v in lags.values())
        wait_for(lambda: scrape().get(("flywheel_ingest_state_dedupe_rows", (("table", "sealed"),)), 0) >= 6,
                 30, "state gauges refreshed", proc, log)
        assert scrape()[("flywheel_ingest_state_bytes", ())] > 0
        # any other path: the state's counters as JSON, as before
        js = httpx.get(url + "/stats", timeout=5).json()
        assert js["samples"] == 6 and js["consumed_completions"] == 8
    finally:
        stop(proc)


def test_consumer_lag_after_a_multi_record_batch(broker):
    """100 records produced as one batch; a consumer that read 30 of them has a lag of 70:
    the gauge uses the Fetch response's high watermark, which Tansu reports right, while its
    ListOffsets(latest) says the end is 1 (first offset + 1, DESIGN §3): lag tools built on
    ListOffsets read wrong on the embedded broker."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition
    from kafka import KafkaProducer

    # one batch: the sends wait for flush() (a 50 ms linger split them into several batches
    # on a loaded machine, and the end offset then read 98)
    p = KafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=60_000, batch_size=1 << 20)
    for i in range(100):
        p.send(topic_names().deadletter, key=b"k", value=b"x%d" % i, partition=0)
    p.flush()
    p.close()

    async def run():
        tp = TopicPartition(topic_names().deadletter, 0)
        c = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, enable_auto_commit=False,
                             auto_offset_reset="earliest")
        await c.start()
        try:
            c.assign([tp])
            got = 0
            while got < 30:
                recs = await c.getmany(tp, timeout_ms=2000, max_records=30 - got)
                got += sum(len(v) for v in recs.values())
            m = IngestMetrics(topic_names())
            await m.refresh_lag(c)
            return samples_of(m.exposition().decode()), (await c.end_offsets([tp]))[tp]
        finally:
            await c.stop()

    m, list_offsets_end = asyncio.run(run())
    assert m[("flywheel_ingest_consumer_lag", (("partition", "0"), ("topic", topic_names().deadletter)))] == 70
    assert m[("flywheel_ingest_assigned_partitions", ())] == 1
    assert list_offsets_end == 1  # Tansu's ListOffsets after a 100-record batch (if this changes, DESIGN §3 too)
