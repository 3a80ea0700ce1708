"""Kafka settings and ``flywheel topics create|check`` against real Tansu brokers: one plain,
one with TLS (a self-signed certificate made with ``openssl``)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from kafka.admin import KafkaAdminClient, NewTopic
from pydantic import ValidationError
from typer.testing import CliRunner

from schemas import topic_admin
from flywheel.broker import BrokerProcess, free_port, tansu_binary, wait_listening
from flywheel.cli import app
from schemas import topics
from schemas.settings import KafkaSettings, kafka_client_config, kafka_settings, topic_names

SHORTS = ("completions", "feedback", "samples", "deadletter", "ingest.rekeyed", "deployments")


def _clear_kafka_env(monkeypatch) -> None:
    import os

    for k in list(os.environ):
        if k.startswith("FLYWHEEL_KAFKA_"):
            monkeypatch.delenv(k)


@pytest.fixture()
def bare_broker(monkeypatch):
    """A Tansu broker with no topics; FLYWHEEL_KAFKA_* cleared, bootstrap set."""
    from flywheel.broker import spawn

    _clear_kafka_env(monkeypatch)
    b = spawn(create_topics=False)
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", b.bootstrap)
    yield b
    b.stop()


def _describe(bootstrap: str) -> dict[str, int]:
    """{topic: partitions}, read with a plain kafka-python admin client (not ours)."""
    a = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        return {m["name"]: len(m["partitions"]) for m in a.describe_topics(a.list_topics())}
    finally:
        a.close()


def test_create_with_prefix_then_check_ok_then_mismatch_refused(bare_broker, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_KAFKA_TOPIC_PREFIX", "team-a.")
    monkeypatch.setenv("FLYWHEEL_KAFKA_PARTITIONS", "3")
    r = CliRunner().invoke(app, ["topics", "create", "-o", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    want = {f"team-a.flywheel.{s}" for s in SHORTS}
    assert set(out["created"]) == want and out["mismatches"] == []
    assert _describe(bare_broker.bootstrap) == {t: 3 for t in want}  # nothing unprefixed was created
    assert topic_names().completions == "team-a.flywheel.completions"  # every producer and consumer uses these names

    r = CliRunner().invoke(app, ["topics", "check", "--json"])
    assert r.exit_code == 0, r.output
    assert [t["status"] for t in json.loads(r.stdout)["topics"]] == ["ok"] * len(SHORTS)

    r = CliRunner().invoke(app, ["topics", "create", "-o", "json"])  # idempotent
    assert r.exit_code == 0 and json.loads(r.stdout)["created"] == []

    monkeypatch.setenv("FLYWHEEL_KAFKA_PARTITIONS", "4")
    r = CliRunner().invoke(app, ["topics", "check"])
    assert r.exit_code == 1
    assert "error: team-a.flywheel.completions: 3 partitions, expected 4 (FLYWHEEL_KAFKA_PARTITIONS; " \
           "completions and feedback must be co-partitioned)" in r.stderr
    r = CliRunner().invoke(app, ["topics", "create"])  # an existing topic is never altered
    assert r.exit_code == 1 and "3 partitions, expected 4" in r.stderr
    assert set(_describe(bare_broker.bootstrap).values()) == {3}

    monkeypatch.setenv("FLYWHEEL_KAFKA_TOPIC_PREFIX", "team-b.")  # nothing of team-b exists
    r = CliRunner().invoke(app, ["topics", "check", "-o", "yaml"])
    assert r.exit_code == 1 and "team-b.flywheel.feedback: missing (run `flywheel topics create`)" in r.stderr


def test_create_refuses_a_preexisting_topic_with_other_partitions(bare_broker, monkeypatch):
    a = KafkaAdminClient(bootstrap_servers=bare_broker.bootstrap)
    a.create_topics([NewTopic("flywheel.feedback", 2, 1)])
    a.close()
    r = CliRunner().invoke(app, ["topics", "create", "-o", "json"])
    assert r.exit_code == 1
    out = json.loads(r.stdout)
    assert "flywheel.feedback" not in out["created"] and len(out["created"]) == len(SHORTS) - 1
    assert out["mismatches"] == ["flywheel.feedback: 2 partitions, expected 6 (FLYWHEEL_KAFKA_PARTITIONS; "
                                 "completions and feedback must be co-partitioned)"]
    with pytest.raises(RuntimeError, match="must be co-partitioned"):
        topic_admin.ensure_topics(bare_broker.bootstrap)


def test_unreachable_cluster_and_bad_settings_exit_1_naming_the_cause(monkeypatch):
    _clear_kafka_env(monkeypatch)
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", f"127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    monkeypatch.setattr(topic_admin, "admin_client", lambda b, s, timeout_s=30.0, _f=topic_admin.admin_client: _f(b, s, 1.0))
    r = CliRunner().invoke(app, ["topics", "check"])
    assert r.exit_code == 1 and "not reachable within 1.0s" in r.stderr and time.monotonic() - t0 < 20
    monkeypatch.setenv("FLYWHEEL_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    r = CliRunner().invoke(app, ["topics", "check"])
    assert r.exit_code == 1
    assert "needs FLYWHEEL_KAFKA_SASL_MECHANISM and FLYWHEEL_KAFKA_SASL_USERNAME" in r.stderr


def test_settings_validation_names_the_field(tmp_path, monkeypatch):
    _clear_kafka_env(monkeypatch)
    with pytest.raises(ValidationError, match="security_protocol"):
        KafkaSettings(security_protocol="SASL")
    with pytest.raises(ValidationError, match="set exactly one of FLYWHEEL_KAFKA_SASL_PASSWORD"):
        KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u")
    with pytest.raises(ValidationError, match="unknown topic 'completion'"):
        KafkaSettings(retention_ms={"completion": 1000})
    with pytest.raises(ValidationError, match="is not a readable file"):
        KafkaSettings(ssl_cafile=tmp_path / "nope.pem")
    with pytest.raises(ValidationError, match="a client certificate needs its key"):
        (tmp_path / "c.pem").write_text("x")
        KafkaSettings(ssl_certfile=tmp_path / "c.pem")
    with pytest.raises(ValidationError, match="topic_prefix"):
        KafkaSettings(topic_prefix="a b")


def test_sasl_from_env_and_password_file(tmp_path, monkeypatch):
    _clear_kafka_env(monkeypatch)
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    monkeypatch.setenv("FLYWHEEL_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("FLYWHEEL_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("FLYWHEEL_KAFKA_SASL_USERNAME", "flywheel")
    monkeypatch.setenv("FLYWHEEL_KAFKA_SASL_PASSWORD_FILE", str(pw))
    monkeypatch.setenv("FLYWHEEL_KAFKA_RETENTION_MS", '{"completions": 86400000}')
    kw = kafka_client_config("k:9093")
    assert kw == {"bootstrap_servers": "k:9093", "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                  "sasl_plain_username": "flywheel", "sasl_plain_password": "s3cret", "ssl_check_hostname": True}
    assert "s3cret" not in repr(kafka_settings())  # secrets never printed
    akw = kafka_client_config("k:9093", "aiokafka")
    assert akw["sasl_plain_password"] == "s3cret" and akw["ssl_context"].check_hostname
    # the kwargs are accepted by both libraries' constructors (unknown keys raise there)
    from aiokafka import AIOKafkaProducer
    from kafka import KafkaProducer

    with pytest.raises(Exception) as ei:  # no broker at k:9093; the config itself must pass
        KafkaProducer(**kw, max_block_ms=100, bootstrap_timeout_ms=100)
    assert "Unrecognized configs" not in str(ei.value)

    async def make():
        AIOKafkaProducer(**akw)
    asyncio.run(make())
    plan = {t.short: t for t in topics.plan(kafka_settings())}
    assert plan["completions"].configs == {"retention.ms": "86400000", "max.message.bytes": str(16 << 20)}
    assert plan["deployments"].configs["retention.ms"] == "-1"


def test_mismatches_table():
    want = [topics.TopicPlan("feedback", "p.flywheel.feedback", 6, 3,
                             {"retention.ms": "604800000", "max.message.bytes": "1048576"})]
    ok = {"p.flywheel.feedback": {"partitions": 6, "replication_factor": 3, "configs": {}}}
    assert topic_admin.mismatches(want, ok) == []
    assert topic_admin.unverified(want, ok) == ["p.flywheel.feedback:retention.ms", "p.flywheel.feedback:max.message.bytes"]
    cases = [({"partitions": 6, "replication_factor": 1, "configs": {}},
              ["p.flywheel.feedback: replication factor 1, expected 3 (FLYWHEEL_KAFKA_REPLICATION_FACTOR)"]),
             ({"partitions": 6, "replication_factor": 3, "configs": {"retention.ms": "1000",
                                                                     "max.message.bytes": "1048576"}},
              ["p.flywheel.feedback: retention.ms=1000, expected 604800000"])]
    for have, msgs in cases:
        assert topic_admin.mismatches(want, {"p.flywheel.feedback": have}) == msgs
    assert topic_admin.mismatches(want, {}) == ["p.flywheel.feedback: missing (run `flywheel topics create`)"]


class TlsTerminator:
    """A TLS server on ``port`` that forwards each connection's plaintext to ``upstream``
    (how a TLS listener in front of a broker behaves; Tansu 0.6.0's own ``--cert`` does not
    complete a handshake)."""

    def __init__(self, port: int, upstream: int, certfile: Path, keyfile: Path):
        import ssl
        import threading

        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(str(certfile), str(keyfile))
        self.port, self.upstream = port, upstream
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self._ready.wait(10), "TLS terminator did not start"

    async def _pipe(self, r, w):
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    async def _handle(self, cr, cw):
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            cw.close()
            return
        await asyncio.gather(self._pipe(cr, uw), self._pipe(ur, cw))

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port, ssl=self.ctx))
        self._ready.set()
        self.loop.run_forever()

    def stop(self):
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture()
def tls_broker(tmp_path, monkeypatch):
    """A Tansu broker reachable only through TLS on the port it advertises (a self-signed
    certificate for 127.0.0.1 made with ``openssl``)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    _clear_kafka_env(monkeypatch)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    inner, outer = free_port(), free_port()
    proc = subprocess.Popen([str(tansu_binary()), "broker", "--storage-engine", "memory://tansu/",
                             "--listener-url", f"tcp://127.0.0.1:{inner}",
                             "--advertised-listener-url", f"tcp://127.0.0.1:{outer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    b = BrokerProcess(pid=proc.pid, port=outer, proc=proc)
    wait_listening(inner)
    tls = TlsTerminator(outer, inner, cert, key)
    yield b, cert
    tls.stop()
    b.stop()


def test_every_client_speaks_tls_from_settings(tls_broker, tmp_path, monkeypatch):
    """Topic creation (kafka-python admin), the serving event log and the deployments ledger
    (kafka-python producers) and the ingest worker's aiokafka consumer all reach the broker over
    TLS, trusting its certificate through FLYWHEEL_KAFKA_SSL_CAFILE (without it: refused)."""
    b, cert = tls_broker
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", b.bootstrap)
    monkeypatch.setenv("FLYWHEEL_KAFKA_SECURITY_PROTOCOL", "SSL")
    r = CliRunner().invoke(app, ["topics", "check", "--timeout-s", "2"])
    assert r.exit_code == 1 and "CERTIFICATE_VERIFY_FAILED" in r.stderr  # the system's CAs do not trust it

    monkeypatch.setenv("FLYWHEEL_KAFKA_SSL_CAFILE", str(cert))
    monkeypatch.setenv("FLYWHEEL_KAFKA_PARTITIONS", "2")
    r = CliRunner().invoke(app, ["topics", "create", "-o", "json"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["created"]) == len(SHORTS)

    from deploy import ledger
    from serving.eventlog import EventLog

    ledger.publish(b.bootstrap, ledger.LedgerEntry(version="v000001", stable="v000000", step=0, weight=0.05,
                                                   decision="START", reason="tls test", ts=1),
                   topic_names().deployments)
    ev = EventLog(b.bootstrap, tmp_path / "ev.journal")
    cid = str(uuid.uuid4())
    ev.emit(topic_names().completions, cid, b'{"x": 1}')
    assert ev.flush(20.0) and ev.counters.sent + ev.counters.replayed == 1, ev.counters
    ev.close()

    from ingest.app import IngestConfig, consumer_settings

    async def read_back() -> dict[str, bytes]:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        kw = consumer_settings(IngestConfig(bootstrap=b.bootstrap, state_path=tmp_path / "s.sqlite"))
        kw.pop("group_id"), kw.pop("partition_assignment_strategy")
        c = AIOKafkaConsumer(**kw)
        await c.start()
        try:
            tps = [TopicPartition(t, p) for t in (topic_names().completions, topic_names().deployments) for p in range(2)]
            c.assign(tps)
            await c.seek_to_beginning(*tps)
            got: dict[str, bytes] = {}
            t_end = time.monotonic() + 20
            while len(got) < 2 and time.monotonic() < t_end:
                for recs in (await c.getmany(timeout_ms=500)).values():
                    got.update({r.key.decode(): r.value for r in recs})
            return got
        finally:
            await c.stop()

    got = asyncio.run(read_back())
    assert got[cid] == b'{"x": 1}'
    assert json.loads(got["v000001"])["reason"] == "tls test"


def test_docs_list_every_topic_and_setting():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "kafka.md").read_text()
    for spec in topics.SPECS.values():
        assert f"`{spec.base}`" in doc, spec.base
    for name in KafkaSettings.model_fields:
        assert f"FLYWHEEL_KAFKA_{name.upper()}" in doc, name


def test_every_kafka_client_in_the_product_takes_kafka_client_config():
    """A new producer, consumer or admin client that skips ``kafka_client_config`` would talk
    PLAINTEXT to a SASL/TLS cluster: each construction's function must build its keywords from
    it (directly, or through ingest's ``consumer_settings``/``producer_settings``)."""
    import ast
    import re

    root = Path(__file__).resolve().parents[1]
    ctor = re.compile(r"\b(KafkaProducer|KafkaConsumer|KafkaAdminClient|AIOKafkaProducer|AIOKafkaConsumer)\(")
    via = ("kafka_client_config", "consumer_settings", "producer_settings", "producer_kw", "consumer_kw")
    found = 0
    for pkg in ("serving", "ingest", "learner", "deploy", "flywheel", "schemas", "bench"):
        for f in (root / pkg).rglob("*.py"):
            src = f.read_text()
            if not ctor.search(src):
                continue
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    body = ast.get_source_segment(src, node) or ""
                    own = [ln for ln in body.splitlines() if ctor.search(ln) and not ln.lstrip().startswith(("#", '"'))]
                    nested = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n is not node
                                 for n in ast.walk(node))
                    if own and not nested:
                        found += len(own)
                        assert any(v in body for v in via), f"{f.relative_to(root)}:{node.name}: {own[0].strip()}"
    assert found >= 7, found  # event log, SDK, ledger, ingest consumer+producer, admin, demo, bench
