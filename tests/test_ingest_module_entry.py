"""``python -m ingest`` reads the same settings as ``flywheel ingest`` (docs/data.md): the file
FLYWHEEL_CONFIG names and the FLYWHEEL_INGEST__<OPTION> variables (``seal_after_s = 1`` seals
after 1 s; a broker named in the file is the one used). A real broker, the worker as a real
subprocess, a real shard."""

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

from test_ingest_e2e import _completion, produce  # noqa: E402
from schemas.events import FeedbackEvent, now_ms  # noqa: E402


def _env(tmp_path, **kw):
    e = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    e.update(PYTHONPATH=str(ROOT), **kw)
    return e


def _one_sample(bootstrap, env, home: Path, log: Path):
    proc = subprocess.Popen([sys.executable, "-m", "ingest"], cwd=ROOT, env=env, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent())
    try:
        c = _completion(uuid.uuid4(), "v0000")
        produce(bootstrap, [c], [FeedbackEvent(event_id=uuid.uuid4(), completion_id=c.completion_id,
                                               user_hash="u", value=1, created_at=now_ms() - 1000)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if list((home / "data" / "samples").glob("date=*/hour=*/part-*.parquet")):
                return
            assert proc.poll() is None, f"worker exited {proc.returncode}: {log.read_text()[-2000:]}"
            time.sleep(0.5)
        pytest.fail(f"no sample within 60 s (seal_after_s=1 not applied?): {log.read_text()[-2000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.timeout(180)
def test_python_m_ingest_reads_the_config_file(broker, tmp_path):
    home = tmp_path / "home"
    cfg = tmp_path / "flywheel.toml"
    cfg.write_text(f'home = "{home}"\n[kafka]\nbootstrap = "{broker.bootstrap}"\n'
                   f'[ingest]\nseal_after_s = 1\ntick_s = 0.2\n')
    _one_sample(broker.bootstrap, _env(tmp_path, FLYWHEEL_CONFIG=str(cfg)), home, tmp_path / "w.log")


@pytest.mark.timeout(180)
def test_python_m_ingest_reads_command_variables(broker, tmp_path):
    home = tmp_path / "home"
    env = _env(tmp_path, FLYWHEEL_HOME=str(home), FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap,
               FLYWHEEL_INGEST__SEAL_AFTER_S="1", FLYWHEEL_INGEST__TICK_S="0.2",
               FLYWHEEL_SERVE__PORT="8001")  # another role's variable (a shared ConfigMap) is not ingest's
    _one_sample(broker.bootstrap, env, home, tmp_path / "w.log")


@pytest.mark.parametrize("env,text", [
    ({"FLYWHEEL_INGEST__TICK_S": "abc"}, "FLYWHEEL_INGEST__TICK_S"),
    ({"FLYWHEEL_INGEST__NO_SUCH": "1"}, "ingest.no_such"),
])
def test_python_m_ingest_refuses_a_bad_variable(tmp_path, env, text):
    r = subprocess.run([sys.executable, "-m", "ingest"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=_env(tmp_path, FLYWHEEL_HOME=str(tmp_path / "home"),
                                FLYWHEEL_KAFKA_BOOTSTRAP="127.0.0.1:1", **env))
    assert r.returncode == 2 and text in r.stderr and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
