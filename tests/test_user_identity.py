"""One identity across the fleet (issue 19 item 2): the user salt is a fleet secret.

Two real ``flywheel serve`` pods (subprocesses, each its own ``FLYWHEEL_HOME``, one shared
store, the same ``FLYWHEEL_USER_SALT``) with v000001 as candidate at 50 %: every user gets the
same ``user_hash`` (computed here from the salt) and the same arm (computed here from the
split's formula) on both pods. A vote posted through pod B for a completion pod A served,
its duplicate and its flip, go through the real join (Tansu broker + ``flywheel ingest``)
(the ingest worker in this process) into one sample with one voter whose last vote won. The
topics carry a prefix, and the worker's consumer group on the broker carries it too (issue 19
item 5).

A pod configured for a fleet without the salt refuses to start, naming the setting.

Pod B runs with ``--admin-port`` (the Kubernetes shape, issue 19 item 4): ``/admin`` and
``/metrics`` answer there only, the product API on the product port only.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from schemas import topic_admin
from schemas.settings import topic_names
from flywheel.broker import free_port
from schemas.events import CompletionEvent, hash_user
from flywheel.supervise import die_with_parent

pytestmark = pytest.mark.timeout(300)

SALT = "fleet-salt-0123456789abcdef"
TOKEN = "fleet-admin-token"
PREFIX = "fleet-a."


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "flywheel.cli", *args]


def arm_of(user: str, salt: str, weight: float) -> str:
    """The arm the sticky split must give ``user``: candidate iff
    sha256("slot:" + user_hash)[:12 hex] / 16^12 < weight (serving.slots, written out here)."""
    uh = hashlib.sha256(f"{salt}:{user}".encode()).hexdigest()[:32]
    frac = int(hashlib.sha256(f"slot:{uh}".encode()).hexdigest()[:12], 16) / float(16 ** 12)
    return "v000001" if frac < weight else "v000000"


def test_other_salts_would_split_users_differently():
    """The pod test below can fail: with two salts, a third or more of users change arm."""
    users = [f"user-{i}" for i in range(200)]
    differ = sum(arm_of(u, "salt-of-pod-a-0000", 0.5) != arm_of(u, "salt-of-pod-b-0000", 0.5) for u in users)
    assert 60 <= differ <= 140, differ  # ~half, as the issue measured (32 of 40)
    assert hash_user("alice", SALT) == hashlib.sha256(f"{SALT}:alice".encode()).hexdigest()[:32]


class Proc:
    def __init__(self, name: str, args: list[str], env: dict, logs: Path):
        self.name, self.log = name, logs / f"{name}.log"
        self.f = open(self.log, "wb")
        self.p = subprocess.Popen(args, env=env, stdout=self.f, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent())

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.f.close()


def wait_for(pred, timeout_s: float, what: str, procs):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for s in procs:
            assert s.p.poll() is None, f"{s.name} died:\n{s.tail()}"
        v = pred()
        if v:
            return v
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}\n" + "\n".join(f"--- {s.name}\n{s.tail()}" for s in procs))


def samples_of(samples_dir: Path, cid: str) -> list[dict]:
    import duckdb

    if not list(samples_dir.rglob("*.parquet")):
        return []
    con = duckdb.connect()
    try:
        cur = con.execute("SELECT n_votes, votes_up, votes_down, label, reward, event_ids, user_hash "
                          "FROM read_parquet(?, hive_partitioning=true) WHERE completion_id = ?",
                          [str(samples_dir / "**" / "*.parquet"), cid])
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]
    finally:
        con.close()


def test_two_pods_one_salt_same_user_hash_arm_and_vote(broker, tiny_moe_dir, tmp_path, monkeypatch):
    from deploy.serving_client import ServingAdmin
    from modelstore.store import ModelStore
    from ingest.app import IngestConfig
    from ingest.join import JoinConfig
    from ingest.worker import Worker
    from tests.test_deploy_controller import publish_v
    from tests.test_serving_app import consume

    monkeypatch.setenv("FLYWHEEL_KAFKA_TOPIC_PREFIX", PREFIX)
    topic_admin.ensure_topics(broker.bootstrap)
    store = ModelStore(tmp_path / "store")
    store.init_base(tiny_moe_dir)
    publish_v(store, "v000000")
    samples = tmp_path / "samples"
    logs = tmp_path / "logs"
    logs.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    base.update(FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap, FLYWHEEL_KAFKA_TOPIC_PREFIX=PREFIX,
                FLYWHEEL_STORE=str(store.root), FLYWHEEL_SAMPLES=str(samples), FLYWHEEL_USER_SALT=SALT,
                FLYWHEEL_ADMIN_TOKEN=TOKEN, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    ports, admin_port = [free_port(), free_port()], free_port()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    admin_urls = [urls[0], f"http://127.0.0.1:{admin_port}"]  # pod B: /admin and /metrics on their own port
    procs: list[Proc] = []
    thread = None
    try:
        for name, port, extra in zip(("pod-a", "pod-b"), ports, ([], ["--admin-port", str(admin_port)])):
            procs.append(Proc(name, cli("serve", "--fleet", "--port", str(port), "--pod", name, "--max-batch", "4",
                                        "--threads", "1", *extra),
                              dict(base, FLYWHEEL_HOME=str(tmp_path / f"home-{name}")), logs))
        # the real join in this process while the pods start: the ingest worker of the prefix
        cfg = IngestConfig(join=JoinConfig(seal_after_s=1.0), tick_s=0.2, bootstrap=broker.bootstrap,
                           samples_dir=samples, state_path=tmp_path / "ingest" / "state.sqlite",
                           catalog=tmp_path / "ingest" / "catalog.duckdb")
        worker, loop, stop = Worker(cfg), asyncio.new_event_loop(), asyncio.Event()
        thread = threading.Thread(target=lambda: loop.run_until_complete(worker.run(stop)), daemon=True)
        thread.start()

        def healthy():
            try:
                return all(httpx.get(u + "/healthz", timeout=1).status_code == 200 for u in urls)
            except httpx.HTTPError:
                return False

        wait_for(healthy, 120, "both pods healthy", procs)
        check_admin_port(urls[1], admin_urls[1])
        for u in admin_urls:  # the same candidate at 50 % on both pods, as the controller sets it
            admin = ServingAdmin(u, TOKEN, timeout_s=60)
            admin.load("v000001")
            admin.set_weight(0.5)
        users = [f"user-{i}" for i in range(12)]
        served: dict[str, list[str]] = {}
        cids: dict[tuple[str, int], str] = {}
        with httpx.Client(timeout=60) as c:
            for u in users:
                for i, url in enumerate(urls):
                    r = c.post(url + "/v1/completions", json={"model": "flywheel", "prompt": [5, 6, 7],
                                                             "max_tokens": 1, "user": u})
                    assert r.status_code == 200, r.text
                    served.setdefault(u, []).append(r.headers["x-flywheel-model-version"])
                    cids[(u, i)] = r.json()["id"]
        want = {u: arm_of(u, SALT, 0.5) for u in users}
        assert {u: v for u, v in served.items()} == {u: [want[u]] * 2 for u in users}
        assert set(want.values()) == {"v000000", "v000001"}  # both arms are in play

        # the CompletionEvents of both pods carry one user_hash per user: the salt's
        keys = {cid for cid in cids.values()}
        evs = [CompletionEvent.from_bytes(r.value)
               for r in consume(broker.bootstrap, topic_names().completions, len(keys), keys=keys)]
        assert len(evs) == len(keys)
        pods_of_hash: dict[str, set[str]] = {}
        for ev in evs:
            pods_of_hash.setdefault(ev.user_hash, set()).add(ev.pod)
        assert set(pods_of_hash) == {hash_user(u, SALT) for u in users}
        assert all(p == {"pod-a", "pod-b"} for p in pods_of_hash.values())

        # alice's completion came from pod A; her up-vote through A, its retry and her flip through B
        cid = cids[(users[0], 0)]
        up, down = str(uuid.uuid4()), str(uuid.uuid4())
        with httpx.Client(timeout=60) as c:
            for url, eid, value in ((urls[0], up, 1), (urls[1], up, 1), (urls[1], down, -1)):
                r = c.post(url + "/v1/feedback", json={"completion_id": cid, "event_id": eid, "kind": "thumb",
                                                       "value": value, "user": users[0]})
                assert r.status_code == 200 and r.json()["event_id"] == eid, r.text
                time.sleep(0.01)  # the flip is the later vote (created_at in ms)
        (s,) = wait_for(lambda: samples_of(samples, cid), 90, "alice's sample sealed", procs)
        assert (s["n_votes"], s["votes_up"], s["votes_down"], s["label"]) == (1, 0, 1, False), s
        assert s["reward"] == JoinConfig().reward.combine(thumb=-1.0) and sorted(s["event_ids"]) == sorted([up, down])
        assert s["user_hash"] == hash_user(users[0], SALT)

        # the worker's consumer group carries the topic prefix (item 5)
        admin = topic_admin.admin_client(broker.bootstrap)
        try:
            groups = {g["group_id"] for g in admin.list_groups()}
            committed = {g: admin.list_group_offsets([g]).get(g, {}) for g in (PREFIX + "flywheel-ingest",
                                                                                 "flywheel-ingest")}
        finally:
            admin.close()
        assert groups == {PREFIX + "flywheel-ingest"}, groups
        assert committed[PREFIX + "flywheel-ingest"] and not committed["flywheel-ingest"], committed
    finally:
        for p in procs:
            p.p.terminate()
        if thread is not None:
            loop.call_soon_threadsafe(stop.set)
            thread.join(30)
        for p in procs:
            p.stop()


def check_admin_port(product: str, admin: str) -> None:
    """``flywheel serve --admin-port``: /admin and /metrics only on the admin port (the product
    port answers 404, before auth), the product API only on the product port, probes on both."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(timeout=30) as c:
        for path in ("/admin/slots", "/metrics", "/admin"):
            r = c.get(product + path, headers=auth)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.text)
        assert c.post(product + "/admin/promote", headers=auth).status_code == 404
        assert c.get(admin + "/admin/slots").status_code == 401  # there, and behind the admin token
        assert c.get(admin + "/admin/slots", headers=auth).json()["stable"]["version"] == "v000000"
        assert "flywheel_version_requests_total" in c.get(admin + "/metrics").text
        r = c.post(admin + "/v1/completions", json={"model": "flywheel", "prompt": [5], "max_tokens": 1})
        assert r.status_code == 404, r.text
        for base_url in (product, admin):
            assert c.get(base_url + "/health").status_code == 200
            assert c.get(base_url + "/healthz").json()["pod"] == "pod-b"


def _flat(out: str) -> str:
    return " ".join(out.replace("│", " ").split())


def test_a_fleet_pod_without_the_salt_refuses_to_start(tmp_path, monkeypatch):
    """Refused before the model load (no store exists here), exit 2, the setting named; the
    real command as a subprocess once, then each configuration in-process."""
    from typer.testing import CliRunner

    from flywheel.cli import app

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(FLYWHEEL_HOME=str(tmp_path / "home"), FLYWHEEL_ADMIN_TOKEN=TOKEN)
    r = subprocess.run(cli("serve", "--host", "0.0.0.0", "--port", str(free_port())), env=env,
                       capture_output=True, text=True, timeout=60)
    out = _flat(r.stdout + r.stderr)
    assert r.returncode == 2 and "Invalid value for FLYWHEEL_USER_SALT" in out and "--host 0.0.0.0" in out, out
    assert not (tmp_path / "home" / "user_salt").exists()  # no per-pod salt was made up

    for k in list(os.environ):
        if k.startswith("FLYWHEEL_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FLYWHEEL_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("FLYWHEEL_STORE", str(tmp_path / "no-store"))
    monkeypatch.setenv("FLYWHEEL_MODEL_DIR", str(tmp_path / "no-model"))  # not the machine's cached model
    secret = tmp_path / "user-salt"
    cases = [({}, ["--fleet"], "FLYWHEEL_USER_SALT", "this pod serves a fleet (--fleet)"),
             ({"FLYWHEEL_FLEET": "1"}, [], "FLYWHEEL_USER_SALT", "this pod serves a fleet (--fleet)"),
             ({"FLYWHEEL_USER_SALT": "short"}, ["--fleet"], "FLYWHEEL_USER_SALT", "at least 16 characters, got 5"),
             ({"FLYWHEEL_USER_SALT_FILE": str(tmp_path / "nope")}, ["--fleet"], "FLYWHEEL_USER_SALT_FILE",
              "cannot read"),
             ({"FLYWHEEL_USER_SALT_FILE": str(secret)}, ["--fleet"], "FLYWHEEL_USER_SALT_FILE", "is empty"),
             ({"FLYWHEEL_USER_SALT": SALT, "FLYWHEEL_USER_SALT_FILE": str(secret)}, ["--fleet"],
              "FLYWHEEL_USER_SALT", "not both")]
    secret.write_text("\n")
    for extra, args, setting, why in cases:
        r = CliRunner().invoke(app, ["serve", "--port", str(free_port()), *args], env=extra)
        out = _flat(r.output)
        assert r.exit_code == 2 and f"Invalid value for {setting}:" in out and why in out, (extra, args, out)
    port = free_port()
    r = CliRunner().invoke(app, ["serve", "--port", str(port), "--admin-port", str(port)],
                           env={"FLYWHEEL_USER_SALT": SALT})
    assert r.exit_code == 2 and "Invalid value for --admin-port: must differ from --port" in _flat(r.output), r.output
    # with the salt from a mounted secret file the check passes and the next one (no model) speaks
    secret.write_text(SALT + "\n")
    r = CliRunner().invoke(app, ["serve", "--fleet", "--port", str(free_port())],
                           env={"FLYWHEEL_USER_SALT_FILE": str(secret)})
    assert r.exit_code == 2 and "SALT" not in r.output and "flywheel model init" in _flat(r.output), r.output


def test_salt_sources(tmp_path, monkeypatch):
    """One box keeps its generated salt across restarts; a file and the variable give the
    same salt; the feedback SDK's Kafka mode takes the fleet's salt from the environment."""
    from ingest.sdk import FeedbackClient
    from schemas.settings import user_salt

    for k in ("FLYWHEEL_USER_SALT", "FLYWHEEL_USER_SALT_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path / "home"))
    first = user_salt()
    assert len(first) == 32 and user_salt() == first  # read back, not regenerated
    assert (tmp_path / "home" / "user_salt").stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="^user_salt: required in Kafka mode"):
        FeedbackClient(kafka_bootstrap="127.0.0.1:1")
    f = tmp_path / "salt"
    f.write_text(f"  {SALT}\n")
    monkeypatch.setenv("FLYWHEEL_USER_SALT_FILE", str(f))
    assert user_salt(fleet=True) == SALT
    fb = FeedbackClient(kafka_bootstrap="127.0.0.1:1", atexit_timeout_s=0)
    try:
        assert fb.user_salt == SALT
    finally:
        fb.shutdown(timeout_s=0)
    monkeypatch.delenv("FLYWHEEL_USER_SALT_FILE")
    monkeypatch.setenv("FLYWHEEL_USER_SALT", SALT)
    assert user_salt() == user_salt(fleet=True) == SALT
