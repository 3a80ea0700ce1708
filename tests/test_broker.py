"""`flywheel broker start|status|stop`: a real detached Tansu broker with explicit topics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient

from schemas.settings import topic_names
ALL_TOPICS = topic_names().all
COMPLETIONS = topic_names().completions


def _cli(env, *args):
    return subprocess.run([sys.executable, "-m", "flywheel.cli", "broker", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_broker_cli_lifecycle_and_explicit_topics(tmp_path):
    env = dict(os.environ, FLYWHEEL_HOME=str(tmp_path / "home"))
    env.pop("FLYWHEEL_KAFKA_BOOTSTRAP", None)
    assert _cli(env, "status").returncode == 1  # nothing running yet
    r = _cli(env, "start", "--partitions", "3")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    try:
        st = _cli(env, "status")
        assert st.returncode == 0 and json.loads(st.stdout)["bootstrap"] == info["bootstrap"]
        # starting again returns the running broker, not a second one
        assert json.loads(_cli(env, "start").stdout.strip().splitlines()[-1])["pid"] == info["pid"]
        again = _cli(env, "start", "--port", str(info["bootstrap"].rsplit(":", 1)[1]), "--partitions", "3")
        assert json.loads(again.stdout.strip().splitlines()[-1])["pid"] == info["pid"], again.stderr
        # ... but other settings are refused, not silently ignored
        for args, opt in ((["--partitions", "8"], "--partitions"), (["--port", "1"], "--port")):
            r = _cli(env, "start", *args)
            flat = " ".join(r.stderr.replace("│", " ").split())  # rich wraps the error box
            assert r.returncode == 2 and opt in flat and "stop it first" in flat, r.stderr
        admin = KafkaAdminClient(bootstrap_servers=info["bootstrap"])
        try:
            meta = {(m.get("topic") or m.get("name")): len(m["partitions"])
                    for m in admin.describe_topics(list(ALL_TOPICS))}
        finally:
            admin.close()
        assert meta == {t: 3 for t in ALL_TOPICS}  # explicit, not the broker's auto-create default of 4
        # it is a real Kafka-protocol broker: a record round-trips through a third-party client
        p = KafkaProducer(bootstrap_servers=info["bootstrap"])
        p.send(COMPLETIONS, key=b"k", value=b"hello", partition=1).get(timeout=10)
        p.close()
        c = KafkaConsumer(bootstrap_servers=info["bootstrap"], consumer_timeout_ms=3000)
        tp = TopicPartition(COMPLETIONS, 1)
        c.assign([tp])
        c.seek_to_beginning(tp)
        assert [m.value for m in c] == [b"hello"]
        c.close()
    finally:
        stop = _cli(env, "stop")
    assert stop.returncode == 0 and "stopped" in stop.stdout
    assert _cli(env, "status").returncode == 1


def test_external_kafka_bootstrap_wins(tmp_path, broker):
    env = dict(os.environ, FLYWHEEL_HOME=str(tmp_path / "home"), FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap)
    st = _cli(env, "status")
    assert st.returncode == 0 and json.loads(st.stdout) == {"bootstrap": broker.bootstrap, "external": True}


def test_broker_start_refuses_bad_port_and_partitions(tmp_path):
    """Bad arguments are usage errors naming the option (exit 2, no traceback), and nothing
    is started; the library raises ValueError naming the argument."""
    import pytest

    from flywheel import broker

    env = dict(os.environ, FLYWHEEL_HOME=str(tmp_path / "home"))
    env.pop("FLYWHEEL_KAFKA_BOOTSTRAP", None)
    for args, opt in ((["--partitions", "0"], "--partitions"), (["--port", "99999"], "--port"),
                      (["--port", "0"], "--port"), (["--partitions", "-3"], "--partitions")):
        r = _cli(env, "start", *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert opt in r.stderr and "Traceback" not in r.stderr + r.stdout, r.stderr
    import socket

    with socket.socket() as s:  # a port that is taken: refused at once, not after a 30 s wait
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        r = _cli(env, "start", "--port", str(taken))
    assert r.returncode == 2 and "--port" in r.stderr and "not free" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert not (tmp_path / "home" / "broker.json").exists()
    with pytest.raises(ValueError, match="partitions"):
        broker.spawn(partitions=0)
    with pytest.raises(ValueError, match="port"):
        broker.spawn(port=70000)
