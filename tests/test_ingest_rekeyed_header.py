"""A record on ``flywheel.ingest.rekeyed`` whose ``flywheel-source-topic`` header is not UTF-8
is read as feedback and the PostgreSQL-scoped worker's join goes on (its partition is not
blocked by a poison pill). A real broker, a real PostgreSQL, the worker as a real
subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from flywheel.supervise import die_with_parent

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_ingest_e2e import _completion, produce, read_dead  # noqa: E402
from test_join_store_contract import pg_url  # noqa: E402,F401  (the module's PostgreSQL server)
from schemas.events import FeedbackEvent, now_ms  # noqa: E402


@pytest.mark.timeout(240)
def test_non_utf8_source_header_does_not_stop_the_worker(broker, tmp_path, pg_url):  # noqa: F811
    from kafka import KafkaProducer

    from samplestore.catalog import read_samples
    from ingest.partition import home_partitions, rekeyed_topic

    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(PYTHONPATH=str(ROOT), FLYWHEEL_HOME=str(home), FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap)
    log = tmp_path / "w.log"
    proc = subprocess.Popen([sys.executable, "-m", "ingest", "--state", pg_url, "--app-id", f"t{uuid.uuid4().hex[:8]}",
                             "--seal-after-s", "1", "--tick-s", "0.3"], cwd=ROOT, env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent())
    try:
        c1, c2 = _completion(uuid.uuid4(), "v0000"), _completion(uuid.uuid4(), "v0000")
        v1, v2 = (FeedbackEvent(event_id=uuid.uuid4(), completion_id=c.completion_id, user_hash="u", value=1,
                                created_at=now_ms() - 1000) for c in (c1, c2))
        topic = rekeyed_topic()
        p = KafkaProducer(bootstrap_servers=broker.bootstrap)
        p.send(topic, key=str(c1.completion_id).encode(), value=v1.to_bytes(),
               partition=home_partitions([str(c1.completion_id)], 6)[0],
               headers=[("flywheel-source-topic", b"\xff\xfe")]).get(30)
        p.close()
        produce(broker.bootstrap, [c1, c2], [v2])
        deadline = time.monotonic() + 90
        got = set()
        while time.monotonic() < deadline and got != {str(c1.completion_id), str(c2.completion_id)}:
            assert proc.poll() is None, f"worker exited {proc.returncode}: {log.read_text()[-3000:]}"
            if (home / "data" / "samples").exists():
                got = {str(s.completion_id) for s in read_samples(home / "data" / "samples")}
            time.sleep(0.5)
        assert got == {str(c1.completion_id), str(c2.completion_id)}, log.read_text()[-3000:]
        assert "UnicodeDecodeError" not in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
