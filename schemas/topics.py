"""Kafka topic names and explicit topic creation (DESIGN §2).

Every topic is created explicitly with a fixed partition count; nothing relies on
broker auto-creation (the embedded Tansu broker auto-creates with 4 partitions, which
would break co-partitioning of completions and feedback).
"""

from __future__ import annotations

import time

COMPLETIONS = "flywheel.completions"
FEEDBACK = "flywheel.feedback"
SAMPLES = "flywheel.samples"
DEADLETTER = "flywheel.deadletter"
DEPLOYMENTS = "flywheel.deployments"

ALL_TOPICS: tuple[str, ...] = (COMPLETIONS, FEEDBACK, SAMPLES, DEADLETTER, DEPLOYMENTS)
DEFAULT_PARTITIONS = 6


def ensure_topics(
    bootstrap: str,
    partitions: int = DEFAULT_PARTITIONS,
    topics: tuple[str, ...] = ALL_TOPICS,
    timeout_s: float = 30.0,
) -> dict[str, int]:
    """Create ``topics`` with ``partitions`` partitions each if they do not exist.

    Args:
        bootstrap: ``host:port`` of any broker of the cluster.
        partitions: partition count for topics that are created here.
        topics: names to create.
        timeout_s: how long to keep retrying while the broker is not reachable (s).

    Returns:
        ``{topic: partition_count}`` as the broker reports it after creation.

    Raises:
        RuntimeError: the broker was not reachable within ``timeout_s``, or an existing
            completions/feedback topic has a different partition count (the join
            needs them co-partitioned).
    """
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import KafkaError, TopicAlreadyExistsError

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="flywheel-admin",
                                     request_timeout_ms=10_000)
            break
        except KafkaError as exc:  # broker not up yet
            last = exc
            time.sleep(0.2)
    else:
        raise RuntimeError(f"Kafka broker at {bootstrap} not reachable within {timeout_s}s: {last}")
    try:
        existing = set(admin.list_topics())
        missing = [t for t in topics if t not in existing]
        if missing:
            try:
                admin.create_topics([NewTopic(t, partitions, 1) for t in missing])
            except TopicAlreadyExistsError:
                pass
        counts: dict[str, int] = {}
        for _ in range(50):
            meta = admin.describe_topics(list(topics))
            counts = {(m.get("topic") or m.get("name")): len(m["partitions"]) for m in meta if m.get("partitions")}
            if len(counts) == len(topics):
                break
            time.sleep(0.1)
        if counts.get(COMPLETIONS) != counts.get(FEEDBACK) and COMPLETIONS in topics and FEEDBACK in topics:
            raise RuntimeError(
                f"{COMPLETIONS} has {counts.get(COMPLETIONS)} partitions but {FEEDBACK} has "
                f"{counts.get(FEEDBACK)}: they must be co-partitioned by completion_id")
        return counts
    finally:
        admin.close()
