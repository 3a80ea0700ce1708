"""Kafka topics: names, keys, retention and partitioning (DESIGN §2; ``docs/kafka.md``).

Every topic is created explicitly with a fixed partition count; nothing relies on broker
auto-creation (the embedded Tansu broker auto-creates with 4 partitions, which would break
co-partitioning of completions and feedback). Names carry ``FLYWHEEL_KAFKA_TOPIC_PREFIX``: a
process resolves them once into a :class:`TopicNames` (``schemas.settings.topic_names()``)
and passes it to what produces or consumes.

:func:`plan` says what every topic should look like under given settings; creating and
checking them on a cluster is ``schemas.topic_admin``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass

DAY_MS = 24 * 3600 * 1000
DEFAULT_PARTITIONS = 6
# ingest's app id (``flywheel ingest --app-id`` default). Its consumer group is the app id under
# the topic prefix (:func:`ingest_group`; ``TopicNames.ingest_group`` names the default one), so two
# deployments that share a Kafka cluster under different prefixes never share a group. Serving
# pods read that group's committed offsets to know which acked events ingest has consumed
# (``serving.eventlog``).
INGEST_APP_ID = "flywheel-ingest"


@dataclass(frozen=True)
class TopicSpec:
    """One Flywheel topic's contract (the rows of ``docs/kafka.md``).

    Fields:
        base: name without the prefix (``flywheel.completions``).
        key: what the record key is (UTF-8).
        value: the JSON value's contract (a ``schemas`` class; JSON Schema by ``flywheel schemas export``).
        retention_ms: default ``retention.ms`` (-1 = forever), overridable per topic.
        writers / readers: who produces and who consumes it.
    """

    base: str
    key: str
    value: str
    retention_ms: int
    writers: str
    readers: str


SPECS: dict[str, TopicSpec] = {
    "completions": TopicSpec(
        "flywheel.completions", "completion_id (UUID string)", "CompletionEvent", 7 * DAY_MS,
        "serving pods (event log)", "ingest workers (join)"),
    "feedback": TopicSpec(
        "flywheel.feedback", "completion_id (UUID string)", "FeedbackEvent", 7 * DAY_MS,
        "serving pods (/v1/feedback), the feedback SDK's Kafka mode, other producers",
        "ingest workers (join)"),
    "samples": TopicSpec(
        "flywheel.samples", "completion_id (UUID string)", "RewardedSample", 30 * DAY_MS,
        "ingest workers (after the Parquet shard is written)",
        "downstream consumers (the learner reads the Parquet shards)"),
    "deadletter": TopicSpec(
        "flywheel.deadletter", "completion_id when known, else empty", "DeadLetter", 30 * DAY_MS,
        "ingest workers", "on-call, `flywheel demo`'s loss accounting"),
    "rekeyed": TopicSpec(
        "flywheel.ingest.rekeyed", "completion_id (UUID string)",
        "CompletionEvent or FeedbackEvent bytes as received (header flywheel-source-topic)", 7 * DAY_MS,
        "ingest workers (records a producer's partitioner put off their home partition)",
        "ingest workers (join)"),
    "deployments": TopicSpec(
        "flywheel.deployments", "model version (e.g. v0003)", "DeploymentEvent", -1,
        "rollout controller and the on-call CLI (promote, rollback, pause, resume)",
        "audit consumers (the ledger of record is DuckDB)"),
}

@dataclass(frozen=True)
class TopicNames:
    """Every Flywheel topic's full name and the ingest consumer group under one prefix,
    resolved once per process (``schemas.settings.topic_names()``) and passed in.

    Fields (str): ``prefix`` and one full name per :data:`SPECS` key (``completions``,
    ``feedback``, ``samples``, ``deadletter``, ``rekeyed``, ``deployments``), and
    ``ingest_group``, the default ingest app's consumer group (:func:`ingest_group`).
    """

    prefix: str
    completions: str
    feedback: str
    samples: str
    deadletter: str
    rekeyed: str
    deployments: str
    ingest_group: str

    @classmethod
    def for_prefix(cls, prefix: str = "", app_id: str = INGEST_APP_ID) -> "TopicNames":
        """The names under ``prefix`` (no validation: the settings validate the prefix)."""
        return cls(prefix=prefix, **{short: prefix + spec.base for short, spec in SPECS.items()},
                   ingest_group=ingest_group(app_id, prefix))

    @property
    def all(self) -> tuple[str, ...]:
        """Every topic's full name, in :data:`SPECS` order."""
        return tuple(getattr(self, short) for short in SPECS)


def ingest_group(app_id: str, prefix: str) -> str:
    """The Kafka consumer group of the ingest workers with ``app_id``: ``prefix + app_id``.

    Every member of one deployment computes the same name (the workers join it; serving's
    event log reads its committed offsets), and deployments with different prefixes on one
    cluster get different groups. The PostgreSQL join state is keyed by the app id
    (``ingest.state_pg.schema_name``)."""
    return prefix + app_id


@dataclass(frozen=True)
class TopicPlan:
    """What one topic must look like on the cluster."""

    short: str
    name: str
    partitions: int
    replication_factor: int
    configs: dict[str, str]


def plan(settings, partitions: int | None = None) -> list[TopicPlan]:
    """Every Flywheel topic as ``settings`` (a :class:`schemas.settings.KafkaSettings`) want it;
    ``partitions`` overrides the settings' count."""
    s = settings
    out = []
    for short, spec in SPECS.items():
        configs = {"retention.ms": str(s.retention_ms.get(short, spec.retention_ms)),
                   "max.message.bytes": str(s.max_message_bytes)}
        out.append(TopicPlan(short, s.topic_prefix + spec.base, partitions or s.partitions,
                             s.replication_factor, configs))
    return out
