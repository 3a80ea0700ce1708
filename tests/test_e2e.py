"""The loop, end to end, with every real part as a real process.

Real Tansu broker; `flywheel serve` on a real port; the ingest worker; a DeepSpeed
learner cycle (`flywheel learn --once`) on a tiny random MoE; the rollout controller;
`flywheel rollback`. Asserts:
  * every feedback event accepted by the API is in exactly one sample;
  * the new version's weights, reconstructed on the serving side from the delta, have the
    learner's sha256 for every tensor;
  * the canary decision is in the ledger;
  * `flywheel rollback` restores the previous version's hashes.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest

from flywheel.broker import free_port
from schemas.manifest import digest_of_hashes
from flywheel.supervise import die_with_parent

pytestmark = pytest.mark.timeout(900)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "flywheel.cli", *args]


class Service:
    def __init__(self, name: str, args: list[str], env: dict, log_dir: Path):
        self.log = log_dir / f"{name}.log"
        self.f = open(self.log, "wb")
        self.p = subprocess.Popen(args, env=env, stdout=self.f, stderr=subprocess.STDOUT,
                                  start_new_session=True, preexec_fn=die_with_parent())
        self.name = name

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.f.close()


def wait_for(pred, timeout_s: float, what: str, services=()):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for s in services:
            assert s.p.poll() is None, f"{s.name} died:\n{s.tail()}"
        v = pred()
        if v:
            return v
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}\n" + "\n".join(f"--- {s.name}\n{s.tail()}" for s in services))


def event_ids_in_samples(samples_dir: Path) -> list[str]:
    import duckdb

    if not list(samples_dir.rglob("*.parquet")):
        return []
    con = duckdb.connect()
    try:
        return [r[0] for r in con.execute(
            "SELECT unnest(event_ids) FROM read_parquet(?, hive_partitioning=true)",
            [str(samples_dir / "**" / "*.parquet")]).fetchall()]
    finally:
        con.close()


def votes_by_version(samples_dir: Path) -> dict[str, int]:
    import duckdb

    if not list(samples_dir.rglob("*.parquet")):
        return {}
    con = duckdb.connect()
    try:
        return dict(con.execute(
            "SELECT model_version, sum(n_votes) FROM read_parquet(?, hive_partitioning=true) GROUP BY 1",
            [str(samples_dir / "**" / "*.parquet")]).fetchall())
    finally:
        con.close()


def test_loop_end_to_end(broker, fw_home, tiny_moe_dir, tmp_path):
    from deploy.ledger import Ledger
    from modelstore.store import ModelStore
    from schemas import settings

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, FLYWHEEL_HOME=str(fw_home), FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap,
               FLYWHEEL_SERVING_URL=url, FLYWHEEL_MODEL_DIR=str(tiny_moe_dir), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    store = ModelStore(settings.store_dir())
    store.init_base(tiny_moe_dir)
    v0 = store.manifest("v000000")
    logs = tmp_path / "logs"
    logs.mkdir()
    services = []
    try:
        serving = Service("serving", cli("serve", "--port", str(port), "--pod", "pod-e2e", "--max-batch", "4"),
                          env, logs)
        ingest = Service("ingest", cli("ingest", "--seal-after-s", "2", "--tick-s", "0.5",
                                       "--orphan-ttl-s", "60"), env, logs)
        services = [serving, ingest]

        def healthy():
            try:
                return httpx.get(url + "/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 120, "serving /healthz", services)
        rng = random.Random(7)
        accepted: list[str] = []

        def traffic(n: int, users: list[str]) -> list[tuple[str, str]]:
            out = []
            with httpx.Client(timeout=120) as c:
                for i in range(n):
                    user = users[i % len(users)]
                    r = c.post(url + "/v1/chat/completions", json={
                        "model": "flywheel", "messages": [{"role": "user", "content": f"def add(a, b): # {i}"}],
                        "max_tokens": 8, "temperature": 1.0, "user": user, "seed": i})
                    assert r.status_code == 200, r.text
                    cid = r.json()["id"]
                    out.append((cid, r.headers["x-flywheel-model-version"]))
                    # messy feedback: flips, duplicates, several users
                    events = []
                    if rng.random() < 0.3:
                        events.append((str(uuid.uuid4()), -1, user))  # flipped later
                    eid = str(uuid.uuid4())
                    value = 1 if i % 3 else -1
                    events += [(eid, value, user)]
                    if rng.random() < 0.3:
                        events.append((eid, value, user))  # duplicate delivery
                    if rng.random() < 0.3:
                        events.append((str(uuid.uuid4()), 1, user + "-friend"))  # a second user
                    for event_id, val, u in events:
                        fr = c.post(url + "/v1/feedback", json={"completion_id": cid, "event_id": event_id,
                                                                "kind": "thumb", "value": val, "user": u})
                        assert fr.status_code == 200, fr.text
                        assert fr.json()["event_id"] == event_id
                        accepted.append(event_id)
            return out

        served = traffic(10, [f"u{i}" for i in range(5)])
        assert {v for _, v in served} == {"v000000"}
        samples_dir = settings.samples_dir()
        want = set(accepted)
        wait_for(lambda: want <= set(event_ids_in_samples(samples_dir)), 90, "all votes sealed", services)

        # every accepted feedback event is in exactly one sample
        counts = Counter(event_ids_in_samples(samples_dir))
        assert {e: counts[e] for e in want} == {e: 1 for e in want}

        # one DeepSpeed learner cycle -> v000001 as a bit-exact delta on v000000
        r = subprocess.run(cli("learn", "--once", "--steps", "2", "--lr", "1e-3", "--min-samples", "1"),
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert store.versions() == ["v000000", "v000001"]
        v1 = store.manifest("v000001")
        assert v1.parent == "v000000" and v1.kind == "delta"
        assert v1.weights_digest != v0.weights_digest  # the update changed weights
        assert "mismatch/max" in v1.metrics

        controller = Service("controller", cli(
            "controller", "--serving", url, "--steps", "0.5,1.0", "--min-votes", "2", "--deadline-s", "20",
            "--deadline-outcome", "promote", "--poll-s", "0.5"), env, logs)
        services.append(controller)

        def slots():
            return httpx.get(url + "/admin/slots", timeout=5).json()

        # serving reconstructed v000001 from the delta: per-tensor hashes equal the learner's
        s = wait_for(lambda: (lambda j: j if j.get("candidate") else None)(slots()), 120,
                     "candidate loaded", services)
        assert s["candidate"]["version"] == "v000001"
        assert s["candidate"]["weights_digest"] == digest_of_hashes({k: t.sha256 for k, t in v1.tensors.items()})
        assert s["stable"]["weights_digest"] == v0.weights_digest

        ledger = Ledger(settings.ledger_path())
        # 16 users rotated through: the sticky split must give both arms votes (the controller
        # never decides on an empty arm); 4 fixed users all land on one side 1 time in 8
        users = [f"canary-user-{i}" for i in range(16)]

        def decided():
            if ledger.final_decision("v000001"):
                return True
            traffic(4, rng.sample(users, 4))
            return False

        wait_for(decided, 300, "canary decision in the ledger", services)
        d = ledger.final_decision("v000001")
        assert d["decision"] in ("PROMOTE", "ROLLBACK")
        assert d["reason"]
        if d["decision"] == "PROMOTE":
            s = slots()
            assert s["stable"]["version"] == "v000001"
            assert s["stable"]["weights_digest"] == v1.weights_digest
            # on-call rolls back: the previous version's hashes are restored
            controller.stop()
            services.remove(controller)
            rb = subprocess.run(cli("rollback", "--yes", "--serving", url), env=env, capture_output=True,
                                text=True, timeout=120)
            assert rb.returncode == 0, rb.stdout + rb.stderr
            s = slots()
            assert s["stable"]["version"] == "v000000"
            assert s["stable"]["weights_digest"] == v0.weights_digest
            assert any(e.decision == "MANUAL_ROLLBACK" and e.actor for e in ledger.decisions())
        else:
            s = slots()
            assert s["stable"]["weights_digest"] == v0.weights_digest and s.get("candidate") is None
        st = subprocess.run(cli("status", "--json", "--serving", url), env=env, capture_output=True,
                            text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        assert "v000001" in st.stdout
    finally:
        for s in services:
            s.stop()
