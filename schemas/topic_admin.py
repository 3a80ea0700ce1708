"""Creating and checking Flywheel's Kafka topics on a cluster (``flywheel topics create|check``,
the embedded broker's start, the demo, the ingest worker's internal topic), as
:func:`schemas.topics.plan` says they must be.

Knows the Kafka admin protocol (kafka-python's ``KafkaAdminClient``); the topics' contract
(names, keys, retention) is :mod:`schemas.topics`.
"""

from __future__ import annotations

import time

from schemas.settings import kafka_client_config, kafka_settings, topic_names
from schemas.topics import DEFAULT_PARTITIONS, TopicPlan, plan

ADMIN_TIMEOUT_S = 30.0  # how long an admin operation waits for the cluster (s); `flywheel topics --timeout-s`


def admin_client(bootstrap: str | None = None, settings=None, timeout_s: float = ADMIN_TIMEOUT_S):
    """A kafka-python ``KafkaAdminClient`` with the settings' security, retried until reachable.

    Raises:
        RuntimeError: the cluster was not reachable within ``timeout_s`` (the message has the
            address and the client's last error).
    """
    from kafka.admin import KafkaAdminClient
    from kafka.errors import KafkaError


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
                  timeout_s: float = ADMIN_TIMEOUT_S) -> dict:
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

    want = plan(settings or kafka_settings(), partitions)
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


def check_topics(bootstrap: str | None = None, settings=None, timeout_s: float = ADMIN_TIMEOUT_S) -> dict:
    """Compare the cluster's Flywheel topics with :func:`plan`; changes nothing.

    Returns:
        ``{"topics": describe(...), "mismatches": [...], "unverified": [...]}``.

    Raises:
        RuntimeError: the cluster is not reachable (:func:`admin_client`).
    """
    want = plan(settings or kafka_settings())
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


def ensure_topics(bootstrap: str, partitions: int = DEFAULT_PARTITIONS, timeout_s: float = ADMIN_TIMEOUT_S) -> dict[str, int]:
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
    names = topic_names()
    c, f = names.completions, names.feedback
    if counts.get(c) != counts.get(f):
        raise RuntimeError(f"{c} has {counts.get(c)} partitions but {f} has {counts.get(f)}: "
                           "they must be co-partitioned by completion_id")
    return counts
