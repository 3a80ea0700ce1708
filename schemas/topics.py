"""Kafka topics: names, keys, retention and explicit creation (DESIGN §2; ``docs/kafka.md``).

Every topic is created explicitly with a fixed partition count; nothing relies on broker
auto-creation (the embedded Tansu broker auto-creates with 4 partitions, which would break
co-partitioning of completions and feedback). Names carry ``FLYWHEEL_KAFKA_TOPIC_PREFIX``:
``topics.COMPLETIONS`` and friends are read through the module's ``__getattr__``, so they
always name the topics of the current settings (:func:`schemas.settings.kafka_settings`).

:func:`plan` says what every topic should look like; :func:`create_topics` creates the missing
ones; :func:`check_topics` compares a cluster with the plan and lists every mismatch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

DAY_MS = 24 * 3600 * 1000
DEFAULT_PARTITIONS = 6
# ingest's app id (``flywheel ingest --app-id`` default). Its consumer group is the app id under
# the topic prefix (:func:`ingest_group`; ``topics.INGEST_GROUP`` names the default one), so two
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

_CONSTANTS = {"COMPLETIONS": "completions", "FEEDBACK": "feedback", "SAMPLES": "samples",
              "DEADLETTER": "deadletter", "DEPLOYMENTS": "deployments"}


def topic_name(short: str, prefix: str | None = None) -> str:
    """Full topic name of ``short`` (a key of :data:`SPECS`) with ``prefix`` (default: settings').

    Other ``FLYWHEEL_KAFKA_*`` values that do not validate do not stop a name from being read
    (modules read names at import); the prefix is then taken as the environment gives it, and
    the first Kafka client or the CLI's settings check reports the bad value."""
    return (current_prefix() if prefix is None else prefix) + SPECS[short].base


def current_prefix() -> str:
    """The settings' ``topic_prefix`` (``FLYWHEEL_KAFKA_TOPIC_PREFIX``), read even when other
    ``FLYWHEEL_KAFKA_*`` values do not validate (see :func:`topic_name`)."""
    from pydantic import ValidationError

    from schemas.settings import kafka_settings

    try:
        return kafka_settings().topic_prefix
    except ValidationError:
        return os.environ.get("FLYWHEEL_KAFKA_TOPIC_PREFIX", "")


def ingest_group(app_id: str = INGEST_APP_ID, prefix: str | None = None) -> str:
    """The Kafka consumer group of the ingest workers with ``app_id``: ``prefix + app_id``
    (``prefix`` default: :func:`current_prefix`).

    Every member of one deployment computes the same name (the workers join it; serving's
    event log reads its committed offsets), and deployments with different prefixes on one
    cluster get different groups. The PostgreSQL join state is keyed by it too
    (``ingest.state_pg.schema_name``)."""
    return (current_prefix() if prefix is None else prefix) + app_id


def __getattr__(name: str):  # COMPLETIONS, ..., ALL_TOPICS, INGEST_GROUP: names under the current prefix
    if name in _CONSTANTS:
        return topic_name(_CONSTANTS[name])
    if name == "INGEST_GROUP":
        return ingest_group()
    if name == "ALL_TOPICS":
        return tuple(topic_name(s) for s in SPECS)
    raise AttributeError(f"module 'schemas.topics' has no attribute {name!r}")


@dataclass(frozen=True)
class TopicPlan:
    """What one topic must look like on the cluster."""

    short: str
    name: str
    partitions: int
    replication_factor: int
    configs: dict[str, str]


def plan(settings=None, partitions: int | None = None) -> list[TopicPlan]:
    """Every Flywheel topic as the settings want it (``partitions`` overrides the settings')."""
    from schemas.settings import kafka_settings

    s = settings or kafka_settings()
    out = []
    for short, spec in SPECS.items():
        configs = {"retention.ms": str(s.retention_ms.get(short, spec.retention_ms)),
                   "max.message.bytes": str(s.max_message_bytes)}
        out.append(TopicPlan(short, s.topic_prefix + spec.base, partitions or s.partitions,
                             s.replication_factor, configs))
    return out


def admin_client(bootstrap: str | None = None, settings=None, timeout_s: float = 30.0):
    """A kafka-python ``KafkaAdminClient`` with the settings' security, retried until reachable.

    Raises:
        RuntimeError: the cluster was not reachable within ``timeout_s`` (the message has the
            address and the client's last error).
    """
    from kafka.admin import KafkaAdminClient
    from kafka.errors import KafkaError

    from schemas.settings import kafka_client_config

    kw = kafka_client_config(bootstrap, settings=settings)
    if kw["security_protocol"] in ("SSL", "SASL_SSL"):
        tls_preflight(kw["bootstrap_servers"], settings, timeout_s)
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            left_ms = max(100, int((deadline - time.monotonic()) * 1000))
            return KafkaAdminClient(**kw, client_id="flywheel-admin", request_timeout_ms=10_000,
                                    bootstrap_timeout_ms=left_ms, reconnect_backoff_max_ms=1000)
        except KafkaError as exc:  # broker not up yet
            last = exc
            time.sleep(0.2)
    raise RuntimeError(f"Kafka cluster at {kw['bootstrap_servers']} not reachable within {timeout_s}s "
                       f"({kw['security_protocol']}): {last}")


def tls_preflight(bootstrap: str, settings=None, timeout_s: float = 10.0) -> None:
    """One TLS handshake with the first bootstrap broker, with the settings' CA, client
    certificate and hostname check: kafka-python 3.0.12's admin client waits forever when the
    handshake fails (an untrusted certificate), so the cause is found and named here first.

    Raises:
        RuntimeError: the handshake failed or timed out (the message has the address and the
            TLS error, e.g. ``CERTIFICATE_VERIFY_FAILED``).
    """
    import socket
    import ssl

    from schemas.settings import kafka_settings

    s = settings or kafka_settings()
    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    ctx = ssl.create_default_context(cafile=str(s.ssl_cafile) if s.ssl_cafile else None)
    ctx.check_hostname = s.ssl_check_hostname
    if s.ssl_certfile:
        ctx.load_cert_chain(str(s.ssl_certfile), str(s.ssl_keyfile))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic())) as raw:
                with ctx.wrap_socket(raw, server_hostname=host):
                    return
        except ssl.SSLError as exc:
            raise RuntimeError(f"TLS handshake with {host}:{port} failed (FLYWHEEL_KAFKA_SSL_*): {exc}") from None
        except OSError as exc:  # not listening yet
            if time.monotonic() >= deadline:
                raise RuntimeError(f"Kafka cluster at {bootstrap} not reachable within {timeout_s}s (TLS): "
                                   f"{exc}") from None
            time.sleep(0.2)


def describe(admin, names: list[str]) -> dict[str, dict]:
    """``{topic: {"partitions": n, "replication_factor": r, "configs": {...}}}`` for the
    ``names`` that exist. ``configs`` holds what the broker reports (Tansu reports none)."""
    from kafka.admin import ConfigResource, ConfigResourceType

    existing = set(admin.list_topics())
    names = [n for n in names if n in existing]
    if not names:
        return {}
    out: dict[str, dict] = {}
    for m in admin.describe_topics(names):
        parts = m.get("partitions") or []
        rf = max((len(p.get("replica_nodes") or []) for p in parts), default=0)
        out[m.get("topic") or m.get("name")] = {"partitions": len(parts), "replication_factor": rf, "configs": {}}
    try:
        res = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in out])
    except Exception:  # noqa: BLE001 - a broker without DescribeConfigs: configs stay unverified
        return out
    for r in res if isinstance(res, list) else [res]:
        _merge_configs(out, r)
    return out


def _merge_configs(out: dict[str, dict], resp) -> None:
    """Fold one DescribeConfigs answer (a kafka-python response object, or its dict form
    ``{"topic": {name: {config: value}}}``) into ``out``."""
    if isinstance(resp, dict):
        for name, cfgs in (resp.get("topic") or {}).items():
            if name in out:
                out[name]["configs"].update({k: str(v) for k, v in (cfgs or {}).items()})
        return
    for r in getattr(resp, "resources", []) or []:
        name, entries = r[3], r[4]
        if name in out:
            out[name]["configs"].update({e[0]: e[1] for e in entries if e[1] is not None})


def mismatches(want: list[TopicPlan], have: dict[str, dict]) -> list[str]:
    """Every difference between the plan and what the cluster reports, one sentence each.

    A missing topic, another partition count or replication factor, or a reported config value
    other than the planned one is a mismatch; a config the broker does not report is not
    (it cannot be verified; :func:`unverified` lists those). Pure: table-tested.
    """
    out = []
    for t in want:
        h = have.get(t.name)
        if h is None:
            out.append(f"{t.name}: missing (run `flywheel topics create`)")
            continue
        if h["partitions"] != t.partitions:
            why = "; completions and feedback must be co-partitioned" if t.short in ("completions", "feedback") else ""
            out.append(f"{t.name}: {h['partitions']} partitions, expected {t.partitions} "
                       f"(FLYWHEEL_KAFKA_PARTITIONS{why})")
        if h["replication_factor"] != t.replication_factor:
            out.append(f"{t.name}: replication factor {h['replication_factor']}, expected "
                       f"{t.replication_factor} (FLYWHEEL_KAFKA_REPLICATION_FACTOR)")
        for k, v in t.configs.items():
            got = h["configs"].get(k)
            if got is not None and str(got) != v:
                out.append(f"{t.name}: {k}={got}, expected {v}")
    return out


def unverified(want: list[TopicPlan], have: dict[str, dict]) -> list[str]:
    """``topic:config`` pairs of existing topics whose value the broker did not report."""
    return [f"{t.name}:{k}" for t in want if t.name in have for k in t.configs if k not in have[t.name]["configs"]]


def create_topics(bootstrap: str | None = None, settings=None, partitions: int | None = None,
                  timeout_s: float = 30.0) -> dict:
    """Create the missing Flywheel topics as :func:`plan` says, then verify all of them.

    Returns:
        ``{"created": [names], "topics": describe(...), "mismatches": [...], "unverified": [...]}``;
        ``mismatches`` is non-empty when a topic that already existed differs from the plan
        (it is never altered: changing partitions re-keys data, so a person decides).

    Raises:
        RuntimeError: the cluster is not reachable (:func:`admin_client`).
    """
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    want = plan(settings, partitions)
    admin = admin_client(bootstrap, settings, timeout_s)
    try:
        existing = set(admin.list_topics())
        new = [t for t in want if t.name not in existing]
        if new:
            try:
                admin.create_topics([NewTopic(t.name, t.partitions, t.replication_factor, topic_configs=t.configs)
                                     for t in new])
            except TopicAlreadyExistsError:  # a concurrent creator won; verified below
                pass
        have = _describe_until_complete(admin, [t.name for t in want])
    finally:
        admin.close()
    return {"created": [t.name for t in new], "topics": have, "mismatches": mismatches(want, have),
            "unverified": unverified(want, have)}


def check_topics(bootstrap: str | None = None, settings=None, timeout_s: float = 30.0) -> dict:
    """Compare the cluster's Flywheel topics with :func:`plan`; changes nothing.

    Returns:
        ``{"topics": describe(...), "mismatches": [...], "unverified": [...]}``.

    Raises:
        RuntimeError: the cluster is not reachable (:func:`admin_client`).
    """
    want = plan(settings)
    admin = admin_client(bootstrap, settings, timeout_s)
    try:
        have = describe(admin, [t.name for t in want])
    finally:
        admin.close()
    return {"topics": have, "mismatches": mismatches(want, have), "unverified": unverified(want, have)}


def _describe_until_complete(admin, names: list[str], tries: int = 50) -> dict[str, dict]:
    have: dict[str, dict] = {}
    for _ in range(tries):  # a new topic's metadata can lag its creation by a few ms
        have = describe(admin, names)
        if len(have) == len(names) and all(h["partitions"] for h in have.values()):
            break
        time.sleep(0.1)
    return have


def ensure_topics(bootstrap: str, partitions: int = DEFAULT_PARTITIONS, timeout_s: float = 30.0) -> dict[str, int]:
    """Create every Flywheel topic with ``partitions`` partitions if missing (the embedded
    broker's start and the demo; external clusters use ``flywheel topics create``).

    Args:
        bootstrap: ``host:port`` of any broker of the cluster.
        partitions: partition count for topics that are created here.
        timeout_s: how long to keep retrying while the broker is not reachable (s).

    Returns:
        ``{topic: partition_count}`` as the broker reports it after creation.

    Raises:
        RuntimeError: the broker was not reachable within ``timeout_s``, or an existing
            completions/feedback topic has a different partition count (the join
            needs them co-partitioned).
    """
    res = create_topics(bootstrap, partitions=partitions, timeout_s=timeout_s)
    counts = {n: h["partitions"] for n, h in res["topics"].items()}
    c, f = topic_name("completions"), topic_name("feedback")
    if counts.get(c) != counts.get(f):
        raise RuntimeError(f"{c} has {counts.get(c)} partitions but {f} has {counts.get(f)}: "
                           "they must be co-partitioned by completion_id")
    return counts
