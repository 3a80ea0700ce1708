"""Chaos (issue 11): traffic and votes flow while every part of the loop fails once.

Real processes everywhere: a Tansu broker, two ``flywheel serve`` pods, two ``flywheel
ingest`` workers, ``flywheel learn --once`` cycles. A client thread asks for completions
and posts votes (some posted twice with the same ``event_id``, to the same or the other
pod; some flipped) the whole time, while, one after the other:

(a) the broker restarts (memory-only: topics, data and committed offsets are gone) while
    votes it acked wait unconsumed (the workers are SIGSTOPped around it);
(b) an ingest worker is SIGKILLed (and started again);
(c) a serving pod is SIGKILLed and started again (same pod name, so same journal);
(d) a learner cycle is SIGKILLed during its optimizer steps (after its first step's
    checkpoint); the next cycle publishes a version, which both pods load.

At the end: every feedback event a pod answered 200 is in exactly one sample or one dead
letter (the Parquet files ingest keeps: the topics died with the broker), no event is in two
places, nothing appears that was never posted, and every slot of every pod serves weights
whose digest equals the store's manifest (``/admin/slots``: ``digest_ok``,
``manifest_digest``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest

from flywheel.broker import free_port, spawn
from schemas.settings import topic_names
from test_e2e import Service, cli, event_ids_in_samples

pytestmark = pytest.mark.timeout(600)


class Traffic(threading.Thread):
    """One client: a completion, then its votes, in a loop, spread over the live pods."""

    def __init__(self, urls: list[str], seed: int = 0):
        super().__init__(daemon=True)
        self.urls = urls
        self.rng = random.Random(seed)
        self.accepted: set[str] = set()  # event ids answered 200
        self.accepted_by: dict[str, tuple[float, str]] = {}  # event id -> (monotonic time, pod url) of its first 200
        self.posted: set[str] = set()  # every event id posted
        self.completions = 0
        self.errors: Counter = Counter()
        self.stop_flag = threading.Event()
        self.lock = threading.Lock()

    def n_accepted(self) -> int:
        with self.lock:
            return len(self.accepted)

    def _post(self, c: httpx.Client, first: int, path: str, body: dict) -> httpx.Response | None:
        """POST to the pod ``first``, the other pod if that one is unreachable."""
        for k in range(len(self.urls)):
            url = self.urls[(first + k) % len(self.urls)]
            try:
                r = c.post(url + path, json=body)
                r.extensions["flywheel_url"] = url
                return r
            except httpx.HTTPError as exc:
                self.errors[type(exc).__name__] += 1
        return None

    def _vote(self, c: httpx.Client, pod: int, cid: str, eid: str, value: int, user: str) -> None:
        with self.lock:
            self.posted.add(eid)
        r = self._post(c, pod, "/v1/feedback",
                       {"completion_id": cid, "event_id": eid, "kind": "thumb", "value": value, "user": user})
        if r is None or r.status_code != 200:
            self.errors[f"feedback {getattr(r, 'status_code', 'unreachable')}"] += 1
            return
        assert r.json()["event_id"] == eid
        with self.lock:
            self.accepted.add(eid)
            self.accepted_by.setdefault(eid, (time.monotonic(), r.extensions["flywheel_url"]))

    def run(self) -> None:
        i = 0
        with httpx.Client(timeout=60) as c:
            while not self.stop_flag.is_set():
                i += 1
                pod = i % len(self.urls)
                user = f"user-{i % 7}"
                r = self._post(c, pod, "/v1/chat/completions", {
                    "model": "flywheel", "messages": [{"role": "user", "content": f"def add(a, b): # {i}"}],
                    "max_tokens": 4, "temperature": 1.0, "user": user, "seed": i})
                if r is None or r.status_code != 200:
                    self.errors[f"completion {getattr(r, 'status_code', 'unreachable')}"] += 1
                    time.sleep(0.2)
                    continue
                self.completions += 1
                cid = r.json()["id"]
                eid, value = str(uuid.uuid4()), self.rng.choice([1, -1])
                self._vote(c, pod, cid, eid, value, user)
                if self.rng.random() < 0.3:  # the same event again, to the same or the other pod
                    self._vote(c, pod + self.rng.randint(0, 1), cid, eid, value, user)
                if self.rng.random() < 0.2:  # the user changes their mind
                    self._vote(c, pod + 1, cid, str(uuid.uuid4()), -value, user)
                time.sleep(0.2)  # ~3 rounds per second: enough votes per phase, CPU left for the rest


def dead_event_ids(dead_dir: Path) -> list[str]:
    """Event ids of the feedback dead letters in ingest's dead-letter files."""
    import pyarrow.parquet as pq

    out = []
    for f in sorted(dead_dir.glob("*.parquet")):
        t = pq.read_table(f).to_pylist()
        for d in t:
            if d["source_topic"] != topic_names().feedback:
                continue
            try:
                out.append(str(json.loads(d["payload"])["event_id"]))
            except (ValueError, KeyError, TypeError):
                out.append(f"unparsable:{d['payload'][:80]}")
    return out


def where_lost(missing: set[str], bootstrap: str) -> dict[str, list]:
    """For a failure message: each missing event id's (partition, offset) on the broker's
    feedback topic now, ``[]`` where the broker does not hold it (so: was it never re-sent
    to the restarted broker, or was it there and not consumed?)."""
    from test_serving_app import consume

    found: dict[str, list] = {e: [] for e in missing}
    for m in consume(bootstrap, topic_names().feedback, want=1 << 30, timeout_s=5.0):  # all it holds
        for e in missing:
            if e.encode() in (m.value or b""):
                found[e].append((m.partition, m.offset))
    return found


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(pred, timeout_s: float, what: str, services=(), every_s: float = 0.3):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for s in services:
            assert s.p.poll() is None, f"{s.name} died:\n{s.tail()}"
        v = pred()
        if v:
            return v
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}\n" + "\n".join(f"--- {s.name}\n{s.tail()}" for s in services))


def sigkill(s: Service) -> None:
    os.killpg(s.p.pid, signal.SIGKILL)
    s.p.wait(10)
    s.f.close()


def test_chaos_nothing_lost_and_every_pod_serves_its_manifest(fw_home, tiny_moe_dir, tmp_path):
    from modelstore.store import ModelStore
    from schemas import settings

    t_start = time.monotonic()
    marks: dict[str, float] = {}
    root = Path(__file__).resolve().parents[1]
    broker_port = free_port()
    b = spawn(broker_port, die_with_parent=True)
    env = dict(os.environ, FLYWHEEL_HOME=str(fw_home), FLYWHEEL_KAFKA_BOOTSTRAP=b.bootstrap,
               FLYWHEEL_MODEL_DIR=str(tiny_moe_dir), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(root),
               # a tiny model gains nothing from intra-op threads, and on a loaded 2-core box their
               # spin-waits made the learner's measuring pass 5 ms per linear
               OMP_NUM_THREADS="1")
    store = ModelStore(settings.store_dir())
    store.init_base(tiny_moe_dir)
    logs = tmp_path / "logs"
    logs.mkdir()
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]

    def pod(k: int, gen: int = 0) -> Service:
        return Service(f"pod-{k}.{gen}", cli("serve", "--port", str(ports[k]), "--pod", f"pod-{k}", "--max-batch", "4"),
                       env, logs)

    def worker(k: int, gen: int = 0) -> Service:
        return Service(f"ingest-{k}.{gen}", cli("ingest", "--seal-after-s", "2", "--tick-s", "0.5",
                                          "--orphan-ttl-s", "30"), env, logs)

    pods = [pod(0), pod(1)]
    workers = [worker(0), worker(1)]
    traffic = Traffic(urls, seed=11)
    learners: list[Service] = []
    samples_dir = settings.samples_dir()
    from samplestore.catalog import deadletters_dir

    dead_dir = deadletters_dir(samples_dir)
    try:
        for u in urls:
            wait_until(lambda: healthy(u), 180, f"{u} healthy", pods + workers)
        traffic.start()

        def more_votes(n: int, what: str, alive) -> None:
            start = traffic.n_accepted()
            wait_until(lambda: traffic.n_accepted() >= start + n, 120, f"{n} votes accepted {what}", alive)

        more_votes(15, "before any fault", pods + workers)
        marks["warm"] = time.monotonic() - t_start

        # (a) the broker restarts: memory-only, everything it held is gone. The workers are
        # stopped (SIGSTOP) first, so that votes acked by this broker and never consumed are
        # certainly lost with it: only the pods' re-send can bring them back
        for w in workers:
            os.killpg(w.p.pid, signal.SIGSTOP)
        try:
            more_votes(6, "acked while no worker consumes", pods)
            marks["broker_stop"] = time.monotonic() - t_start
            b.stop()
        finally:
            for w in workers:
                os.killpg(w.p.pid, signal.SIGCONT)
        time.sleep(1.0)
        b = spawn(broker_port, die_with_parent=True)
        marks["broker_up"] = time.monotonic() - t_start
        more_votes(15, "after the broker restart", pods + workers)
        marks["broker_restart"] = time.monotonic() - t_start

        # (b) an ingest worker is SIGKILLed, then started again
        sigkill(workers[0])
        more_votes(8, "with one worker", pods + workers[1:])
        workers[0] = worker(0, 1)
        more_votes(8, "after the worker restart", pods + workers)
        marks["worker_kill"] = time.monotonic() - t_start

        # (c) a serving pod is SIGKILLed mid-traffic, then started again under its name
        sigkill(pods[0])
        more_votes(8, "with one pod", pods[1:] + workers)
        pods[0] = pod(0, 1)
        wait_until(lambda: healthy(urls[0]), 180, "pod-0 healthy again", pods + workers)
        more_votes(8, "after the pod restart", pods + workers)
        marks["pod_kill"] = time.monotonic() - t_start

        # (d) a learner cycle is SIGKILLed during its optimizer steps: once its first step's
        # checkpoint is written (39 steps still to go, each with its checkpoint: seconds)
        wait_until(lambda: any(samples_dir.rglob("*.parquet")), 60, "a first shard", pods + workers)
        ckpt_meta = fw_home / "learner" / "ckpt" / "meta.json"
        learn = ("learn", "--once", "--lr", "1e-3", "--min-samples", "1", "--measure-free-max", "8")
        learner = Service("learn-killed", cli(*learn, "--steps", "40", "--checkpoint-every", "1"), env, logs)
        learners.append(learner)
        wait_until(lambda: ckpt_meta.exists(), 240, "the learner's first step", pods + workers + [learner])
        sigkill(learner)
        killed_after = json.loads(ckpt_meta.read_text())["step"]
        assert 1 <= killed_after < 40, killed_after
        assert store.versions() == ["v000000"], "a killed cycle published something"
        marks["learner_kill"] = time.monotonic() - t_start
        r = subprocess.run(cli(*learn, "--steps", "2"), env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert store.versions() == ["v000000", "v000001"], r.stdout[-2000:]
        marks["learner_next_cycle"] = time.monotonic() - t_start
        for u in urls:
            lr = httpx.post(u + "/admin/load", json={"version": "v000001"}, timeout=180)
            assert lr.status_code == 200, lr.text
        more_votes(5, "after the candidate loads", pods + workers)
        traffic.stop_flag.set()
        traffic.join(90)
        assert not traffic.is_alive()

        # every accepted vote: in exactly one sample or one dead letter
        accepted = set(traffic.accepted)

        def settled():
            return accepted <= set(event_ids_in_samples(samples_dir)) | set(dead_event_ids(dead_dir))

        try:
            wait_until(settled, 180, "every accepted vote in a sample or a dead letter", pods + workers, every_s=1.0)
        except AssertionError as exc:
            missing = accepted - set(event_ids_in_samples(samples_dir)) - set(dead_event_ids(dead_dir))
            try:
                on_broker = where_lost(missing, b.bootstrap)
            except Exception as e:  # noqa: BLE001 - a diagnostic only
                on_broker = {"?": repr(e)}
            detail = {e: (round(traffic.accepted_by[e][0] - t_start, 1), traffic.accepted_by[e][1], on_broker.get(e))
                      for e in sorted(missing)}
            raise AssertionError(f"{len(missing)} of {len(accepted)} accepted votes lost: (accepted at s, by, "
                                 f"(partition, offset) on the broker now) {detail}, phases {marks}\n"
                                 f"{exc}") from None
        time.sleep(3.0)  # anything sealed or dead-lettered twice would show up now
        in_samples, in_dead = event_ids_in_samples(samples_dir), dead_event_ids(dead_dir)
        counts = Counter(in_samples) + Counter(in_dead)
        twice = {e: n for e, n in counts.items() if n > 1}
        assert not twice, f"{len(twice)} events in two places: {list(twice.items())[:5]}"
        assert accepted <= set(counts)
        assert set(counts) <= traffic.posted, "an event nobody posted"
        marks["settled"] = time.monotonic() - t_start

        # every slot of every pod serves its manifest's weights
        for u in urls:
            s = httpx.get(u + "/admin/slots", timeout=10).json()
            slots = [s["stable"]] + ([s["candidate"]] if s.get("candidate") else [])
            assert [x["version"] for x in slots] == ["v000000", "v000001"], s
            for x in slots:
                assert x["digest_ok"] is True, (s["pod"], x)
                assert x["weights_digest"] == x["manifest_digest"] == store.manifest(x["version"]).weights_digest

        def pod_counter(u: str, state: str) -> float:
            text = httpx.get(u + "/metrics", timeout=10).text
            head = f'flywheel_eventlog_events_total{{state="{state}"}}'
            line = [ln for ln in text.splitlines() if ln.startswith(head)]
            return float(line[0].split()[-1]) if line else 0.0

        resent = [pod_counter(u, "resent") for u in urls]
        assert resent[1] > 0, "pod-1 never noticed that the restarted broker lost what it had acked"
        print(f"chaos: {traffic.completions} completions, {len(accepted)} votes accepted, "
              f"{len(set(in_samples))} in samples, {len(set(in_dead))} dead letters, client errors "
              f"{dict(traffic.errors)}, resent by pod-1 after the broker restart {resent[1]:g}, "
              f"learner killed after step {killed_after} of 40, "
              f"phases {json.dumps({k: round(v, 1) for k, v in marks.items()})}, "
              f"wall {time.monotonic() - t_start:.1f} s")
    finally:
        traffic.stop_flag.set()
        for s in pods + workers + learners:
            if not s.f.closed:
                s.stop()
        b.stop()
