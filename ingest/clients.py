"""The Kafka client settings of an ingest worker: its consumer's and producer's keyword arguments.

:mod:`ingest.app` (the worker's configuration and entry point) and :mod:`ingest.worker` (the
runtime) both read them here; this module imports neither, so neither imports the other for
them. ``cfg`` is an :class:`ingest.app.IngestConfig`, read only through its attributes.
"""

from __future__ import annotations

from schemas import settings

METADATA_MAX_AGE_MS = 5000  # the consumer refreshes topic metadata at least this often (ms)
SESSION_TIMEOUT_S = 6.0  # group joins take ~half the session timeout on Tansu (DESIGN §3)


def consumer_settings(cfg) -> dict:
    """``AIOKafkaConsumer`` keyword arguments of an ingest worker (``bench/ingest.py`` reads
    the raw consume rate with exactly these, minus the group). ``cfg``: an
    :class:`ingest.app.IngestConfig` (its ``bootstrap``, ``group_id`` and ``app_id``).

    Offsets are committed by the worker after the batch's SQLite transaction (never
    automatically); with no committed offset the group starts from the earliest record
    (never ``latest``: end offsets are wrong on the embedded broker, DESIGN §3). The range
    assignor gives partition p of both topics to the same member (they are co-partitioned
    by completion_id, so a label's completion and votes usually meet in one worker).
    """
    from aiokafka.coordinator.assignors.range import RangePartitionAssignor

    return dict(
        **settings.kafka_client_config(cfg.bootstrap, "aiokafka"), group_id=cfg.group_id, client_id=cfg.app_id,
        enable_auto_commit=False, auto_offset_reset="earliest",
        session_timeout_ms=int(SESSION_TIMEOUT_S * 1000), heartbeat_interval_ms=1000,
        partition_assignment_strategy=(RangePartitionAssignor,),
        # topics are never auto-created (ingest.worker.no_topic_auto_creation): a group that
        # rejoined before they were re-created (embedded broker restart) sees them, and
        # rebalances, at the next metadata refresh (aiokafka's default: 5 min)
        metadata_max_age_ms=METADATA_MAX_AGE_MS,
        # fetch more per round trip: completions carry expert routes (~18 KiB each)
        fetch_max_bytes=64 << 20, max_partition_fetch_bytes=16 << 20)


def producer_settings(cfg) -> dict:
    """``AIOKafkaProducer`` keyword arguments (samples and dead letters; not idempotent:
    the embedded broker's InitProducerId fails, DESIGN §3). ``cfg``: an
    :class:`ingest.app.IngestConfig` (its ``bootstrap`` and ``app_id``)."""
    # a sample is ~19 KiB: with the default 16 KiB batches each one was its own produce request
    return dict(**settings.kafka_client_config(cfg.bootstrap, "aiokafka"), client_id=cfg.app_id, acks="all",
                linger_ms=5, max_batch_size=1 << 20, max_request_size=settings.kafka_settings().max_message_bytes)
