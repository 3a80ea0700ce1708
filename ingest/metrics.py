"""Prometheus metrics of one ingest worker, and the worker's small HTTP endpoint.

One :class:`IngestMetrics` per worker process, in its own ``CollectorRegistry``. What it
exports (names as Prometheus shows them):

* ``flywheel_ingest_records_consumed_total{topic}``: records delivered to this worker (a
  replayed record counts again).
* ``flywheel_ingest_records_joined_total{topic}``: records folded into the join state
  (a new completion, a vote folded into its label).
* ``flywheel_ingest_records_duplicate_total{topic}``: records recognised as already seen.
* ``flywheel_ingest_deadletters_total{topic, reason}``: dead letters published, ``reason``
  one of :data:`DEADLETTER_REASONS` (:func:`reason_class`).
* ``flywheel_ingest_samples_sealed_total``: RewardedSamples written to shards.
* ``flywheel_ingest_seal_round_seconds``: histogram, wall time of one seal round (claim,
  validate, write shards, mark sealed).
* ``flywheel_ingest_seal_delay_seconds``: histogram, per sample ``sealed_at - created_at``:
  how long after the completion its labelled sample existed.
* ``flywheel_ingest_consumer_lag{topic, partition}``: per assigned partition, the high
  watermark of the partition's last Fetch response minus the consumer's position (records),
  read when ``/metrics`` is scraped; a partition not fetched yet is left out. On a Kafka
  cluster it is the usual consumer lag. **Approximate on the embedded Tansu broker**: its
  ListOffsets(latest) under-reports the end offset after a multi-record batch (DESIGN §3),
  so lag tools that ask ListOffsets (``kafka-consumer-groups``, kafka_exporter, Burrow) read
  wrong there; the Fetch high watermark used here was right when measured (100 records in one
  batch, consumer at 30: lag 70 while ListOffsets said the end is 1;
  ``tests/test_monitoring_ingest.py``), but it is as old as the last fetch and Tansu's
  offsets are not otherwise relied on.
* ``flywheel_ingest_assigned_partitions``: partitions of completions and feedback this
  worker owns now (the internal topic of forwarded records, ``ingest.partition``, is
  assigned alongside them and left out here and in the lag).
* ``flywheel_ingest_state_open_labels``, ``flywheel_ingest_state_dedupe_rows{table}``,
  ``flywheel_ingest_state_memory_bytes``: this worker's in-memory join state (its partitions;
  ``ingest.keyed``; aggregate with ``sum``): open labels, dedupe and sealed entries, an
  estimate of its bytes; ``flywheel_ingest_state_bytes``: the checkpoint store on disk (the
  SQLite file, WAL and bodies, or the PostgreSQL tables; shared by the group's workers:
  aggregate with ``max``). Read every ``STATE_EVERY_S`` by the seal thread.
* ``flywheel_ingest_checkpoints``: checkpoints written (state changes and offsets, one
  transaction each).
* ``flywheel_ingest_partition_caught_up{partition}``: per partition this worker owns, 1 once
  it has read the partition up to the end offset it had when assigned (or its
  ``catchup_timeout_s`` passed), 0 while it catches up: its labels are not sealed meanwhile
  (``ingest.processor``, ``docs/decisions.md`` D93). A partition at 0 for long is a stuck one.

The worker's HTTP port (:func:`serve_http`) answers ``GET /metrics`` in the Prometheus text
format and any other path with the state's counters as JSON (as it always did).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.core import GaugeMetricFamily

from schemas.topics import TopicNames

STATE_EVERY_S = 15.0  # the state-size gauges are refreshed at most this often (s)
POSITION_TIMEOUT_S = 1.0  # a partition whose position is not known within this is left out (s)
# sample delay: seconds from the completion to its sealed sample (seal_after default 600 s)
DELAY_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 900, 1200, 1800, 3600, 7200, 14400)
ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

# reason label of a dead letter: (prefix of DeadLetter.reason, class); first match wins
_REASON_PREFIXES = (
    ("orphan:", "orphan"),
    ("late:", "late"),
    ("expired:", "expired"),
    ("malformed completion:", "malformed_completion"),
    ("duplicate key:", "duplicate_key"),
    ("null record value", "tombstone"),
    ("unparseable record", "unparseable"),
    ("bad json", "unparseable"),
    ("expected a json object", "unparseable"),
    ("future:", "future"),
    ("unwritable sample:", "quarantined"),
    ("unfoldable:", "unfoldable"),
)
DEADLETTER_REASONS = ("orphan", "late", "expired", "malformed_completion", "duplicate_key", "tombstone",
                      "unparseable", "unsupported_kind", "unsupported_schema_version", "future", "quarantined",
                      "unfoldable", "invalid")


def reason_class(field: str, reason: str) -> str:
    """The bounded ``reason`` label of a dead letter (its ``field`` and free-text ``reason``).

    ``orphan`` (votes whose completion never came), ``late`` (after sealing), ``expired``
    (older than the dedupe horizon), ``malformed_completion`` (a vote of a completion whose
    body failed validation), ``duplicate_key``, ``tombstone``, ``unparseable`` (not a JSON
    object), ``unsupported_kind``, ``unsupported_schema_version``, ``future`` (``created_at``
    beyond the clock-skew tolerance), ``quarantined`` (a sealed sample the shard or the samples
    topic refused), ``unfoldable`` (a value the join state refused), ``reward_policy`` (a score
    or an edit's final text the reward policy cannot use: an undeclared name, a value out of
    its declared range, no tokenizer to measure a final text), else ``invalid`` (a field
    failed the event's schema; the dead letter names it).
    """
    r = reason.lower()
    for prefix, cls in _REASON_PREFIXES:
        if r.startswith(prefix):
            return cls
    if field == "kind" and "is not used" in r:
        return "unsupported_kind"
    if field == "schema_version":
        return "unsupported_schema_version"
    if "reward policy" in r or field == "final_text":
        return "reward_policy"
    return "invalid"


class IngestMetrics:
    """The worker's Prometheus metrics (see the module docstring); thread-safe (the fold and
    seal threads update them, the event loop serves them).

    Args:
        topics: the process's topic names (the ``topic`` label of the joined and duplicate
            counters).
    """

    def __init__(self, topics: TopicNames):
        self.tc, self.tf = topics.completions, topics.feedback  # the joined and duplicate counters' labels
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_* (start time, CPU seconds, resident memory)
        self.consumed = Counter("flywheel_ingest_records_consumed", "records delivered to this worker, by topic",
                                ["topic"], registry=r)
        self.joined = Counter("flywheel_ingest_records_joined", "records folded into the join state (new "
                              "completions, folded votes), by topic", ["topic"], registry=r)
        self.duplicates = Counter("flywheel_ingest_records_duplicate", "records already seen (replays, "
                                  "duplicate deliveries), by topic", ["topic"], registry=r)
        self.dead = Counter("flywheel_ingest_deadletters", "dead letters published, by source topic and reason",
                            ["topic", "reason"], registry=r)
        self.sealed_samples = Counter("flywheel_ingest_samples_sealed", "RewardedSamples written to shards",
                                      registry=r)
        self.seal_round = Histogram("flywheel_ingest_seal_round_seconds", "wall time of one seal round (s)",
                                    buckets=ROUND_BUCKETS, registry=r)
        self.seal_delay = Histogram("flywheel_ingest_seal_delay_seconds", "per sample: sealed_at - the "
                                    "completion's created_at (s)", buckets=DELAY_BUCKETS, registry=r)
        self.open_labels = Gauge("flywheel_ingest_state_open_labels", "labels not yet sealed in this worker's "
                                 "in-memory join state (its partitions: aggregate with sum)", registry=r)
        self.memory_bytes = Gauge("flywheel_ingest_state_memory_bytes", "estimated bytes of this worker's "
                                  "in-memory join state (labels, dedupe and sealed sets, bodies not checkpointed)",
                                  registry=r)
        self.checkpoints = Counter("flywheel_ingest_checkpoints", "checkpoints of the in-memory join state and "
                                   "its offsets written to the state store", registry=r)
        self.dedupe_rows = Gauge("flywheel_ingest_state_dedupe_rows", "rows of the dedupe tables (events: "
                                 "event ids seen, sealed: completions sealed)", ["table"], registry=r)
        self.state_bytes = Gauge("flywheel_ingest_state_bytes", "bytes of the join state on disk (SQLite "
                                 "database, WAL, completion bodies)", registry=r)
        self.caught_up = Gauge("flywheel_ingest_partition_caught_up", "1 once this worker has read the "
                               "partition up to its end offset at the assignment (or the catch-up timed out), 0 "
                               "while catching up (its labels wait to be sealed)", ["partition"], registry=r)
        self._lag: dict[tuple[str, int], int] = {}
        self._assigned = 0
        self._state_at = 0.0
        self._lock = threading.Lock()
        r.register(_LagCollector(self))

    # -- updates (called by ingest.worker.Worker) -----------------------------------------
    def folded(self, batch: dict, completion_outcomes: list[str], feedback_outcomes: list) -> None:
        """One consumed batch (``{TopicPartition: [records]}``) and the join's outcomes:
        ``Joiner.on_completions``' strings and ``Joiner.on_feedbacks``' ``(outcome, dl)``."""
        by_topic: dict[str, int] = {}
        for tp, recs in batch.items():
            by_topic[tp.topic] = by_topic.get(tp.topic, 0) + len(recs)
        for topic, n in by_topic.items():
            self.consumed.labels(topic).inc(n)
        self.joined.labels(self.tc).inc(sum(1 for o in completion_outcomes if o == "new"))
        self.joined.labels(self.tf).inc(sum(1 for o, _ in feedback_outcomes if o == "folded"))
        self.duplicates.labels(self.tc).inc(sum(1 for o in completion_outcomes if o == "duplicate"))
        self.duplicates.labels(self.tf).inc(sum(1 for o, _ in feedback_outcomes if o == "duplicate"))

    def dead_letters(self, dead: list) -> None:
        """Dead letters just published (``schemas.events.DeadLetter``)."""
        for d in dead:
            self.dead.labels(d.source_topic, reason_class(d.field, d.reason)).inc()

    def sealed(self, samples: list) -> None:
        """RewardedSamples whose shard is durable and marked sealed."""
        self.sealed_samples.inc(len(samples))
        for s in samples:
            self.seal_delay.observe(max(s.sealed_at - s.created_at, 0) / 1000.0)

    def partitions_caught_up(self, states: dict[int, bool], update: bool = False) -> None:
        """Set the caught-up gauge of each partition in ``states`` (``{partition: caught up}``);
        unless ``update``, the partitions not in ``states`` are removed (a new assignment)."""
        with self._lock:
            if not update:
                self.caught_up.clear()
            for p, ok in states.items():
                self.caught_up.labels(str(p)).set(1 if ok else 0)

    def observe_state(self, store) -> None:
        """Refresh the state-size gauges from ``store`` (an ``ingest.store.JoinStore``), at most
        every ``STATE_EVERY_S``; runs in the seal thread (takes the store's lock briefly)."""
        if time.monotonic() - self._state_at < STATE_EVERY_S:
            return
        self._state_at = time.monotonic()
        with store.transaction():
            self.open_labels.set(store.open_count())
            events, sealed = store.dedupe_sizes()
        self.dedupe_rows.labels("events").set(events)
        self.dedupe_rows.labels("sealed").set(sealed)
        self.state_bytes.set(store.size_bytes())
        if hasattr(store, "memory_bytes"):
            self.memory_bytes.set(store.memory_bytes())

    async def refresh_lag(self, consumer) -> None:
        """Read each assigned partition's lag (high watermark - position) from the
        ``aiokafka`` consumer; partitions whose figures are unknown yet are left out."""
        if consumer is None:
            return
        from ingest.partition import REKEYED_BASE

        # the source topics' partitions: the internal topic of forwarded records is assigned
        # alongside them, partition for partition, and holds records only in transit
        assigned = [tp for tp in consumer.assignment() if not tp.topic.endswith(REKEYED_BASE)]
        lag: dict[tuple[str, int], int] = {}
        for tp in assigned:
            hw = consumer.highwater(tp)
            if hw is None:
                continue
            try:
                pos = await asyncio.wait_for(consumer.position(tp), POSITION_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - revoked or resetting meanwhile: no figure now
                continue
            lag[(tp.topic, tp.partition)] = max(int(hw) - int(pos), 0)
        with self._lock:
            self._lag, self._assigned = lag, len(assigned)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)


class _LagCollector:
    def __init__(self, m: IngestMetrics):
        self.m = m

    def collect(self):
        with self.m._lock:
            lag, n = dict(self.m._lag), self.m._assigned
        g = GaugeMetricFamily("flywheel_ingest_consumer_lag", "records behind the partition's high watermark "
                              "(from the last Fetch response; approximate on the embedded Tansu broker)", labels=["topic", "partition"])
        for (topic, part), v in sorted(lag.items()):
            g.add_metric([topic, str(part)], v)
        yield g
        a = GaugeMetricFamily("flywheel_ingest_assigned_partitions", "partitions assigned to this worker")
        a.add_metric([], n)
        yield a


async def serve_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, metrics: IngestMetrics,
                     consumer, stats) -> None:
    """Answer one HTTP/1.1 request on the worker's port: ``GET /metrics`` -> Prometheus text
    (consumer lag read now), any other path -> ``stats()`` as JSON. The connection closes
    after the answer. Request headers are read to the blank line first, so the close never
    resets a client that is still sending."""
    try:
        line = await asyncio.wait_for(reader.readline(), 5.0)
        while True:  # headers
            h = await asyncio.wait_for(reader.readline(), 5.0)
            if h in (b"\r\n", b"\n", b""):
                break
        parts = line.decode("latin-1").split()
        path = parts[1].split("?", 1)[0] if len(parts) >= 2 else "/"
        if path == "/metrics":
            await metrics.refresh_lag(consumer)
            body, ctype = metrics.exposition(), CONTENT_TYPE_LATEST
        else:
            body, ctype = json.dumps(stats(), sort_keys=True).encode(), "application/json"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype.encode() + b"\r\nConnection: close\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
    except (asyncio.TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()
