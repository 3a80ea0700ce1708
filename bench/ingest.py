"""Ingest benchmark (issue 4 item 6): joined events/s per worker vs the raw consume rate.

One run, one embedded Tansu broker (``--partitions``, default 2, raised to the largest
``--hosts`` count), one data set:

1. Produce ``--completions`` CompletionEvents with realistic payloads (prompt and completion
   token ids, float32 behavior logprobs, expert routes shaped (T-1, ``--layers``,
   ``--top-k``) over ``--experts`` experts, zstd + base64 as serving logs them) and 0-3
   users' thumbs on each (20 % duplicate deliveries, 20 % flips), keyed by completion_id.
2. **Raw**: the worker's own Kafka client (aiokafka, ``ingest.app.consumer_settings``
   without the group) reads both topics from the beginning, all partitions assigned,
   ``getmany`` batches of the worker's size, no processing. Measured first and last; the
   ratios use the larger (stricter) of the two.
3. **Joined, 1 worker**: ``python -m ingest`` (a real worker process, its own consumer
   group) consumes the same records, validates them (feedback in full; a completion's head,
   its body being validated once, at sealing: ``ingest.join.parse_completion``), folds them
   into its in-memory join state, checkpoints it with the offsets to the SQLite file every
   ``--checkpoint-s`` (``ingest.keyed``, D81), commits offsets, and seals labels
   (``--seal-after-s``) into Parquet shards + ``flywheel.samples``. Rate = records between
   the first counter reading at >= 10 % and the first at >= 90 % of the records consumed,
   over the time between those readings (the worker's ``consumed_*`` counters, written with
   each checkpoint, polled from its state file every 20 ms: no end offsets, DESIGN §3); when
   one checkpoint covers that whole window, from the group's settling to the last record.
   ``--state-labels N`` measures the in-memory state alone instead (memory per open label,
   the time another worker takes to restore it; no broker).
4. **Joined, 2 workers**: two worker processes in another group split the partitions (and
   share a state file); same window over their summed counters.
5. Optional ``--faust-noop``: a faust app (the runtime before D12) with the old worker's
   settings whose agents do nothing: that runtime's ceiling on this machine.

Per CPU-second figures: records per CPU-second of the measured process(es) (all threads,
user + system, from /proc) over the same window. The dev box has 2 cores shared with
other jobs, so wall rates move with the load (printed per phase); per CPU-second figures
move much less. Two workers on 2 cores compete with each other, with the broker (which
serves both) and with the other jobs: the 2-worker wall speedup is bounded by the idle
cores, not by the worker; ``two_worker_cpu_efficiency`` (records per CPU-second, 2 workers
vs 1) says whether splitting the partitions costs CPU per record.

Prints, last, ``RESULT <metric>=<value> <unit> target<op><value>`` lines:
``joined_vs_raw_consume_ratio`` (wall, target >= 0.5), ``joined_vs_raw_cpu_efficiency``
(per CPU-second, target >= 0.25), ``pipeline_vs_raw_cpu_efficiency`` (join + seal per
CPU-second, target >= 0.25; the worker's CPU while it waits between the last record and the
first label due, ``--seal-after-s`` later, is left out: ~10 ms per second of an idle worker,
0.15 CPU-s in a quick run; ``pipeline_with_idle_wait_vs_raw_cpu_efficiency`` counts it),
``two_worker_speedup`` (wall, target >= 1.5) and
``two_worker_cpu_efficiency`` (per CPU-second, target >= 0.9): issue 24's targets.

6. **Separate hosts** (``--hosts 1,2,4``, issue 12): 1, 2 and 4 workers, each with its own
   FLYWHEEL_HOME (no shared file), the join state in a PostgreSQL server started by the
   bench (``ingest.pglocal``), shards in one shared directory. Same window; the database's
   and the broker's CPU over the window are printed too, so "per CPU-second" can be read for
   the workers alone and for workers + database + broker (what a second host really costs).
   The wall speedup on the 2-core dev box is bounded by its cores, not by the workers.

Further RESULT lines with ``--hosts``: ``hosts_pg_vs_sqlite_cpu_efficiency`` (1 worker,
records per worker CPU-second, PostgreSQL vs SQLite state, target >= 0.75), and per N > 1 hosts
``hostsN_speedup`` (wall, vs 1 host), ``hostsN_cpu_efficiency`` (workers' CPU) and
``hostsN_all_cpu_efficiency`` (workers + database + broker). These three ratios count
every record folded from the moment every worker holds its partitions (before any batch is in
flight) to the last: the 10-90 % window starts at a first commit, when the other workers'
first 2,000-record batches are already being folded, so it misses their time and CPU, more
with more workers (a quick run's 4-worker window made 4 hosts look 1.8x as efficient as 1 and
7x as fast).

7. ``--fuzz N`` (Hardening II): instead of the above, N records (at least 50,000) of valid
   traffic, hand-picked hostile records and records generated from the published JSON Schemas
   on both topics, into one worker (``tests/test_ingest_fuzz.run_fuzz``, which checks that the
   worker never stops, every valid pair is joined, every refused record is dead-lettered
   naming its field, no shard write is retried). Prints the time and worker CPU to decide
   every record and ``RESULT fuzz_*`` lines.

8. ``--profile`` (issue 24): no broker. The same records handed to one in-process worker's
   own ``Worker.fold`` (getmany-sized batches) and ``Worker.seal_round`` (every label due), on
   a fresh SQLite state and real shards, first unprofiled ``--profile-reps`` times (CPU-s of
   the fold and of sealing, records / labels per CPU-s, and their medians), then once under
   ``cProfile`` with a CPU clock, fold and sealing apart (``--profile-top`` functions by own
   and by cumulative time).

    python bench/ingest.py [--quick] [--completions N] [--partitions P] [--hosts 1,2,4] [--faust-noop]
    python bench/ingest.py --fuzz 50000
    python bench/ingest.py --quick --profile
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from flywheel.broker import spawn  # noqa: E402
from schemas.settings import topic_names
from schemas.events import CompletionEvent, ExpertRoutes, FeedbackEvent, SamplingParams, now_ms  # noqa: E402


def make_events(n: int, args, seed: int = 0) -> tuple[list[tuple[bytes, bytes]], list[tuple[bytes, bytes]]]:
    """``(completions, feedback)`` as ``(key, value)`` bytes, realistic sizes."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    comps, fb = [], []
    base = now_ms()
    for i in range(n):
        cid = uuid.UUID(int=rng.getrandbits(128), version=4)
        p_len = rng.randint(args.prompt_tokens // 2, args.prompt_tokens * 3 // 2)
        c_len = rng.randint(args.completion_tokens // 2, args.completion_tokens * 3 // 2)
        routes = nrng.integers(0, args.experts, size=(p_len + c_len - 1, args.layers, args.top_k), dtype=np.uint8)
        ev = CompletionEvent(
            completion_id=cid, request_id=f"req-{i}", created_at=base, model_version=f"v{i % 2:04d}", pod="pod-0",
            user_hash=f"{rng.getrandbits(64):016x}", prompt_token_ids=nrng.integers(0, 49152, p_len).tolist(),
            completion_token_ids=nrng.integers(0, 49152, c_len).tolist(),
            behavior_logprobs=(-nrng.exponential(1.0, c_len)).astype(np.float32).tolist(),
            sampling=SamplingParams(temperature=0.7, top_p=0.95, max_tokens=256),
            expert_routes=ExpertRoutes.from_array(routes), finish_reason="stop", ttft_ms=12.5, latency_ms=900.0)
        key = str(cid).encode()
        comps.append((key, ev.to_bytes()))
        for u in range(rng.randint(0, 3)):
            v = rng.choice([1, -1])
            f = FeedbackEvent(event_id=uuid.UUID(int=rng.getrandbits(128), version=4), completion_id=cid,
                              user_hash=f"user{u}", value=v, created_at=base + rng.randint(0, 1000),
                              comment="works" if v > 0 else None)
            fb.append((key, f.to_bytes()))
            if rng.random() < 0.2:
                fb.append((key, f.to_bytes()))  # duplicate delivery
            if rng.random() < 0.2:
                fb.append((key, FeedbackEvent(event_id=uuid.uuid4(), completion_id=cid, user_hash=f"user{u}",
                                              value=-v, created_at=f.created_at + 5000).to_bytes()))
    return comps, fb


def produce(bootstrap: str, comps, fb) -> None:
    from kafka import KafkaProducer

    from schemas.settings import kafka_client_config

    p = KafkaProducer(**kafka_client_config(bootstrap), linger_ms=20, batch_size=1 << 20, max_request_size=16 << 20)
    names = topic_names()
    for k, v in comps:
        p.send(names.completions, key=k, value=v)
    for k, v in fb:
        p.send(names.feedback, key=k, value=v)
    p.flush()
    p.close()


async def raw_consume(bootstrap: str, total: int, partitions: int) -> dict:
    """``{"rate": records/s, "per_cpu_s": records per CPU-second}`` of the worker's Kafka
    client and settings, all partitions assigned, no processing (first record to last)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from ingest.app import IngestConfig, consumer_settings
    from ingest.worker import BATCH_MAX_RECORDS, POLL_TIMEOUT_MS

    kw = consumer_settings(IngestConfig(bootstrap=bootstrap, state_path=Path(tempfile.gettempdir()) / "unused"))
    for k in ("group_id", "partition_assignment_strategy", "session_timeout_ms", "heartbeat_interval_ms",
              "metadata_max_age_ms"):
        kw.pop(k)
    c = AIOKafkaConsumer(**kw)
    await c.start()
    try:
        tps = [TopicPartition(t, p) for t in (topic_names().completions, topic_names().feedback) for p in range(partitions)]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        n, t0, c0 = 0, None, None
        deadline = time.monotonic() + 300
        while n < total and time.monotonic() < deadline:
            batch = await c.getmany(timeout_ms=POLL_TIMEOUT_MS, max_records=BATCH_MAX_RECORDS)
            for recs in batch.values():
                if recs and t0 is None:
                    t0, c0 = time.perf_counter(), time.process_time()
                n += len(recs)
        if n < total:
            raise RuntimeError(f"raw consumer read {n} of {total} records")
        return {"rate": n / (time.perf_counter() - t0), "per_cpu_s": n / (time.process_time() - c0)}
    finally:
        await c.stop()


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` (all their threads), from /proc."""
    tck = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
        except (OSError, IndexError):
            pass
    return total / tck


def counters(state: Path) -> dict[str, int]:
    """The workers' durable counters (read-only; empty before the state file exists)."""
    if not state.exists():
        return {}
    try:
        db = sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=5)
        try:
            return dict(db.execute("SELECT name, value FROM counters").fetchall())
        finally:
            db.close()
    except sqlite3.OperationalError:
        return {}


def pg_counters(url: str, group: str) -> dict[str, int]:
    """The summed counters of consumer group ``group``'s workers in PostgreSQL (empty before
    its tables exist)."""
    import psycopg

    from ingest.state_pg import schema_name

    try:
        with psycopg.connect(url, autocommit=True) as db:
            return {k: int(v) for k, v in db.execute(
                f'SELECT name, sum(value) FROM "{schema_name(group)}".counters GROUP BY name').fetchall()}
    except psycopg.Error:
        return {}


def children(pid: int) -> list[int]:
    """``pid`` and its direct children (the PostgreSQL postmaster and its backends)."""
    out = [pid]
    for st in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(st.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(st.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def assignments(log: Path) -> list[tuple[float, list[str]]]:
    """``(unix time, partitions)`` of every "ingest assigned" line of a worker log."""
    import datetime as dt

    out = []
    for ln in log.read_text(errors="replace").splitlines():
        if "ingest assigned" in ln:
            t = dt.datetime.strptime(ln[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((t, json.loads(ln.split("ingest assigned", 1)[1])))
    return out


def joined(bootstrap: str, total: int, labels: int, workers: int, group: str, args, pg=None,
           broker_pid: int | None = None) -> dict:
    """Run ``workers`` ingest processes on their own group/state until every record is
    consumed and every label sealed. Rate and records per CPU-second between the first
    counter reading at >= 10 % of the records (and after the last worker got its
    partitions: a group rebalance pauses consumption) and the first at >= 90 %.

    ``pg``: an ``ingest.pglocal.PgServer``: each worker gets its own FLYWHEEL_HOME (its own
    host: no shared file), the join state is PostgreSQL, the shards go to one shared
    directory (object storage's stand-in); the database's CPU (postmaster + backends) and
    the broker's (``broker_pid``) are measured over the same window. None: one home, the
    SQLite state shared by the workers."""
    home = Path(tempfile.mkdtemp(prefix=f"fw-bench-{group}-"))
    env = dict(os.environ, FLYWHEEL_HOME=str(home), FLYWHEEL_KAFKA_BOOTSTRAP=bootstrap, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "ingest", "--app-id", group, "--seal-after-s", str(args.seal_after_s),
           "--tick-s", str(args.tick_s), "--loglevel", "info"]
    if args.checkpoint_s is not None:
        cmd += ["--checkpoint-s", str(args.checkpoint_s)]
    logs = [home / f"worker{i}.log" for i in range(workers)]
    envs = [env] * workers
    if pg is not None:
        envs = [dict(env, FLYWHEEL_HOME=str(home / f"host{i}"), FLYWHEEL_INGEST_STATE=pg.url,
                     FLYWHEEL_SAMPLES=str(home / "objectstore" / "samples")) for i in range(workers)]
    load = os.getloadavg()[0]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=open(lg, "wb"), stderr=subprocess.STDOUT,
                              start_new_session=True) for e, lg in zip(envs, logs)]
    state = home / "ingest" / "state.sqlite"
    read = (lambda: counters(state)) if pg is None else (lambda: pg_counters(pg.url, group))

    def others() -> tuple[float, float]:  # (database CPU s, broker CPU s)
        return (cpu_s(children(pg.proc.pid)) if pg is not None else 0.0,
                cpu_s([broker_pid]) if broker_pid else 0.0)
    marks: dict[float | str, tuple[float, int, float]] = {}  # fraction or "settled" -> (time, records, cpu s)
    other: dict[float | str, tuple[float, float]] = {}  # same keys -> (database cpu s, broker cpu s)
    t_start = time.perf_counter()
    sealed: dict[str, tuple[float, float]] = {}  # "first" / "all" samples -> (time, cpu s)
    samples_at_90 = 0
    settled = False
    try:
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline:
            c = read()
            n = c.get("consumed_completions", 0) + c.get("consumed_feedback", 0)
            now = time.perf_counter()
            if not settled:  # every worker holds partitions (one generation of the group)
                a = [assignments(lg) for lg in logs]
                settled = all(x and x[-1][1] for x in a) and len({p for x in a for p in x[-1][1]}) == sum(
                    len(x[-1][1]) for x in a)
                if settled:  # the CPU from here counts every record folded after it, none before
                    marks["settled"] = (now, n, cpu_s([p.pid for p in procs]))
                    other["settled"] = others()
            for f in (0.0, 0.1, 0.9, 1.0):
                if f not in marks and n > 0 and n >= f * total and (settled or f in (0.0, 1.0)):
                    marks[f] = (now, n, cpu_s([p.pid for p in procs]))
                    other[f] = others()
                    if f == 0.9:
                        samples_at_90 = c.get("samples", 0)
            # no label is due before the first vote's fold + seal_after_s (the counters lag the
            # fold by less than its batch): between all consumed and this reading the worker idles
            if 1.0 in marks and "idle_end" not in marks and now >= marks[0.0][0] + args.seal_after_s - 0.5:
                marks["idle_end"] = (now, c.get("samples", 0), cpu_s([p.pid for p in procs]))
            for k, want in (("first", 1), ("all", labels)):
                if k not in sealed and c.get("samples", 0) >= want:
                    sealed[k] = (now, cpu_s([p.pid for p in procs]))
            if 1.0 in marks and "all" in sealed:
                break
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a worker exited: {logs[0].read_text()[-2000:]}")
            time.sleep(0.02)
        else:
            raise RuntimeError(f"{workers} worker(s): {read()} after {args.timeout_s}s "
                               f"({total} records, {labels} labels)")
        if 0.1 not in marks or 0.9 not in marks:
            raise RuntimeError("the group settled after 90 % of the records: use more --completions")
        (t1, n1, c1), (t9, n9, c9) = marks[0.1], marks[0.9]
        (d1, b1), (d9, b9) = other[0.1], other[0.9]
        if t9 - t1 < 0.05 or n9 == n1:
            # the counters move by checkpoints (D81: every --checkpoint-s): one of them covered
            # 10-90 % of the records, so the window is from the group's settling to the last record
            (t1, n1, c1), (t9, n9, c9) = marks["settled"], marks[1.0]
            (d1, b1), (d9, b9) = other["settled"], other[1.0]
        c = read()
        rebalances = sum(len(assignments(lg)) for lg in logs) - workers
        (tf, cf), (ta, ca) = sealed["first"], sealed["all"]
        # the idle wait between all consumed and the first label due (--seal-after-s keeps the
        # join window apart from sealing): neither joining nor sealing, left out of "pipeline"
        ti, si, ci = marks.get("idle_end", (marks[1.0][0], 1, marks[1.0][2]))
        idle = (ti - marks[1.0][0], ci - marks[1.0][2]) if si == 0 else (0.0, 0.0)
        return {"rate": (n9 - n1) / (t9 - t1), "per_cpu_s": (n9 - n1) / max(1e-9, c9 - c1),
                "window": (n9 - n1, t9 - t1, c9 - c1), "samples_in_window": samples_at_90,
                "consume_s": marks[1.0][0] - t_start, "sealed_s": ta - t_start, "samples": c.get("samples", 0),
                # None: every label sealed within one reading (one seal round)
                "seal_rate": c.get("samples", 0) / (ta - tf) if ta - tf >= 0.05 else None,
                "seal_cpu_s": ca - marks[1.0][2] - idle[1], "idle": idle,
                # every record consumed + folded and every label sealed, per CPU-second (no
                # start-up, no idle wait); and the same with the idle wait counted
                "pipeline_per_cpu_s": total / max(1e-9, ca - marks[0.0][2] - idle[1]),
                "pipeline_idle_per_cpu_s": total / max(1e-9, ca - marks[0.0][2]),
                # first record to last, workers' CPU only / with the database's and the broker's
                # from the group's settling (no batch in flight yet) to the last record; the 10-90 %
                # window instead starts after a first commit, when the other workers' first
                # batches are in flight: their CPU before it is missed, more so with more workers
                "consume_rate": (marks[1.0][1] - marks["settled"][1]) / max(1e-9, marks[1.0][0] - marks["settled"][0]),
                "consume_per_cpu_s": (marks[1.0][1] - marks["settled"][1]) / max(
                    1e-9, marks[1.0][2] - marks["settled"][2]),
                "consume_all_per_cpu_s": (marks[1.0][1] - marks["settled"][1]) / max(
                    1e-9, marks[1.0][2] - marks["settled"][2] + sum(other[1.0]) - sum(other["settled"])),
                "load": load, "rebalances": rebalances, "db_cpu_s": d9 - d1, "broker_cpu_s": b9 - b1,
                "all_per_cpu_s": (n9 - n1) / max(1e-9, c9 - c1 + d9 - d1 + b9 - b1)}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)


_NOOP_APP = r"""
import json, sys, time
from pathlib import Path
import faust
from faust.worker import Worker
from schemas import topics as T
bootstrap, home, total = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
out = home / "noop.json"
# the settings of the faust ingest worker before D12
app = faust.App("bench-faust-noop", broker=f"kafka://{bootstrap}", store="memory://", datadir=str(home / "faust"),
    broker_session_timeout=6.0, broker_heartbeat_interval=1.0, consumer_auto_offset_reset="earliest",
    topic_allow_declare=False, processing_guarantee="at_least_once", web_enabled=False,
    key_serializer="raw", value_serializer="raw", consumer_max_fetch_size=16 * 1024 * 1024,
    broker_max_poll_records=2000, stream_buffer_maxsize=8192)
kw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
n, marks = [0], {}

def count(k):
    n[0] += k
    for f in (0.1, 0.9):
        if f not in marks and n[0] >= f * total:
            marks[f] = (time.perf_counter(), time.process_time(), n[0])
    if n[0] >= total and not out.exists():
        (t1, c1, n1), (t9, c9, n9) = marks[0.1], marks[0.9]
        out.write_text(json.dumps({"rate": (n9 - n1) / (t9 - t1), "per_cpu_s": (n9 - n1) / (c9 - c1)}))

for name in (topic_names().completions, topic_names().feedback):
    @app.agent(app.topic(name, **kw), name=f"noop-{name}")
    async def noop(stream):
        async for batch in stream.take_events(500, within=0.05):
            count(len(batch))
Worker(app, loglevel="warn", quiet=True).execute_from_commandline()
"""


def faust_noop(bootstrap: str, total: int, args) -> dict:
    """``{"rate", "per_cpu_s"}`` of a do-nothing faust app with the pre-D12 worker's
    settings (10 %..90 %)."""
    home = Path(tempfile.mkdtemp(prefix="fw-bench-noop-"))
    p = subprocess.Popen([sys.executable, "-c", _NOOP_APP, bootstrap, str(home), str(total)], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=open(home / "log", "wb"),
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + args.timeout_s
        while not (home / "noop.json").exists():
            if time.monotonic() > deadline or p.poll() is not None:
                raise RuntimeError(f"faust no-op app: {(home / 'log').read_text()[-2000:]}")
            time.sleep(0.1)
        return json.loads((home / "noop.json").read_text())
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(home, ignore_errors=True)


def report(name: str, r: dict) -> None:
    n, dt_, dc = r["window"]
    print(f"{name}: join {r['rate']:,.0f} records/s, {r['per_cpu_s']:,.0f} per CPU-s (window {n} records in "
          f"{dt_:.2f}s using {dc:.2f} CPU-s = {dc / dt_:.2f} cores, {r['samples_in_window']} labels sealed by "
          f"its end); all consumed "
          f"{r['consume_s']:.1f}s after start (incl. process start + group join); then sealing: "
          f"{r['samples']} labels at "
          f"{'(one round)' if r['seal_rate'] is None else format(r['seal_rate'], ',.0f') + '/s'} "
          f"using {r['seal_cpu_s']:.2f} CPU-s, all sealed "
          f"{r['sealed_s']:.1f}s after start; pipeline (join + seal) {r['pipeline_per_cpu_s']:,.0f} records per "
          f"CPU-s (idle wait before sealing: {r['idle'][0]:.1f}s using {r['idle'][1]:.2f} CPU-s, left out; "
          f"counted: {r['pipeline_idle_per_cpu_s']:,.0f}); rebalances after the first {r['rebalances']}; "
          f"load average before {r['load']:.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (~1 min)")
    ap.add_argument("--completions", type=int, default=None, help="completions produced (default 10000; quick 3000)")
    ap.add_argument("--partitions", type=int, default=2, help="partitions of every topic")
    ap.add_argument("--prompt-tokens", type=int, default=150, help="mean prompt length (tokens)")
    ap.add_argument("--completion-tokens", type=int, default=200, help="mean completion length (tokens)")
    ap.add_argument("--layers", type=int, default=30, help="MoE layers in the routes (SmolLM2-135M: 30)")
    ap.add_argument("--experts", type=int, default=8, help="experts per layer")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token")
    ap.add_argument("--seal-after-s", type=float, default=15.0,
                    help="worker seal_after (s): longer than consuming, so the join window and sealing are "
                         "measured apart")
    ap.add_argument("--tick-s", type=float, default=0.25, help="worker seal tick (s)")
    ap.add_argument("--checkpoint-s", type=float, default=None,
                    help="worker checkpoint interval (s; default: the worker's, 1 s). The counters this bench "
                         "reads move by checkpoints, so a run shorter than a few of them is measured from the "
                         "group's settling to the last record")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="give up on a phase after this long (s)")
    ap.add_argument("--faust-noop", action="store_true", help="also measure a do-nothing faust app (pre-D12 runtime)")
    ap.add_argument("--keep", action="store_true", help="keep the workers' FLYWHEEL_HOME dirs")
    ap.add_argument("--hosts", default="1,2,4",
                    help="worker counts run on separate homes with the PostgreSQL state (issue 12), comma-separated; "
                         "'' skips them; the topics get at least the largest count of partitions")
    ap.add_argument("--state-labels", type=int, default=0,
                    help="measure the in-memory join state instead (ingest.keyed, D81): memory, checkpoint and "
                         "restore times with this many open labels (e.g. 100000); no broker")
    ap.add_argument("--fuzz", type=int, default=0,
                    help="run the schema-driven fuzz at this many records (>= 50000 for the benchmark size) instead")
    ap.add_argument("--profile", action="store_true",
                    help="profile the worker's fold and seal round in-process (no broker) instead")
    ap.add_argument("--profile-top", type=int, default=25, help="functions printed per profile table")
    ap.add_argument("--profile-reps", type=int, default=3, help="unprofiled runs before the profiled one")
    ap.add_argument("--samples-value", choices=["notice", "sample", "both"], default="notice",
                    help="--profile: the samples topic's value the worker encodes (IngestConfig.samples_value); "
                         "both: alternate the two, --profile-reps runs each")
    args = ap.parse_args()
    if args.profile:
        return profile(args)
    if args.state_labels:
        return state_memory(args.state_labels)
    if args.fuzz:
        return fuzz(args.fuzz, args)
    if args.faust_noop and importlib.util.find_spec("faust") is None:  # not a dependency of Flywheel
        print("--faust-noop skipped: faust-streaming is not installed "
              "(pip install faust-streaming==0.15.3 in a separate venv to measure it)", flush=True)
        args.faust_noop = False
    n = args.completions or (3000 if args.quick else 10000)
    hosts = [int(x) for x in args.hosts.split(",") if x.strip()]
    if any(h < 1 for h in hosts):
        ap.error(f"--hosts: worker counts must be >= 1, got {args.hosts!r}")
    partitions = max([args.partitions] + hosts)

    t = time.perf_counter()
    comps, fb = make_events(n, args)
    total = len(comps) + len(fb)
    labels = len({k for k, _ in fb})  # completions with at least one vote: one sample each
    mean_c = sum(len(v) for _, v in comps) / len(comps)
    mean_f = sum(len(v) for _, v in fb) / max(1, len(fb))
    print(f"events: {len(comps)} completions (mean {mean_c / 1024:.1f} KiB, routes "
          f"({args.prompt_tokens}+{args.completion_tokens}-1, {args.layers}, {args.top_k})), {len(fb)} feedback "
          f"(mean {mean_f:.0f} B) -> {labels} labels; built in {time.perf_counter() - t:.1f}s", flush=True)
    b = spawn(partitions=partitions)
    print(f"broker: {partitions} partitions per topic", flush=True)
    res: dict[int, dict] = {}
    try:
        t = time.perf_counter()
        produce(b.bootstrap, comps, fb)
        print(f"produced {total} records in {time.perf_counter() - t:.1f}s", flush=True)
        raw1 = asyncio.run(raw_consume(b.bootstrap, total, partitions))
        print(f"raw aiokafka consume: {raw1['rate']:,.0f} records/s ({raw1['per_cpu_s']:,.0f} per CPU-s)", flush=True)
        one = joined(b.bootstrap, total, labels, 1, "bench-ingest-1", args)
        report("joined, 1 worker", one)
        two = joined(b.bootstrap, total, labels, 2, "bench-ingest-2", args)
        report("joined, 2 workers", two)
        if args.faust_noop:
            noop = faust_noop(b.bootstrap, total, args)
            print(f"faust no-op agents (pre-D12 runtime): {noop['rate']:,.0f} records/s "
                  f"({noop['per_cpu_s']:,.0f} per CPU-s)", flush=True)
        if hosts:
            from ingest import pglocal

            pg = pglocal.start()
            try:
                for w in hosts:
                    res[w] = joined(b.bootstrap, total, labels, w, f"bench-hosts-{w}", args, pg=pg, broker_pid=b.pid)
                    report(f"joined, {w} host(s), PostgreSQL state", res[w])
                    r = res[w]
                    print(f"  same window: workers {r['window'][2]:.2f} CPU-s, PostgreSQL {r['db_cpu_s']:.2f} CPU-s, "
                          f"broker {r['broker_cpu_s']:.2f} CPU-s; {r['all_per_cpu_s']:,.0f} records per CPU-s of "
                          f"all three; settled to last record: {r['consume_rate']:,.0f} records/s, "
                          f"{r['consume_per_cpu_s']:,.0f} per worker CPU-s, "
                          f"{r['consume_all_per_cpu_s']:,.0f} per CPU-s of all three", flush=True)
            finally:
                pg.stop()
        raw2 = asyncio.run(raw_consume(b.bootstrap, total, partitions))
        raw = max(raw1["rate"], raw2["rate"])  # the cores are shared: the stricter baseline of the two
        raw_cpu = max(raw1["per_cpu_s"], raw2["per_cpu_s"])
        print(f"raw aiokafka consume, again: {raw2['rate']:,.0f} records/s ({raw2['per_cpu_s']:,.0f} per CPU-s); "
              f"baseline = max = {raw:,.0f} records/s, {raw_cpu:,.0f} per CPU-s", flush=True)
    finally:
        b.stop()
    print(f"RESULT joined_vs_raw_consume_ratio={one['rate'] / raw:.3f} x target>=0.5")
    print(f"RESULT joined_vs_raw_cpu_efficiency={one['per_cpu_s'] / raw_cpu:.3f} x target>=0.25")
    print(f"RESULT pipeline_vs_raw_cpu_efficiency={one['pipeline_per_cpu_s'] / raw_cpu:.3f} x target>=0.25")
    print(f"RESULT pipeline_with_idle_wait_vs_raw_cpu_efficiency={one['pipeline_idle_per_cpu_s'] / raw_cpu:.3f} x")
    print(f"RESULT two_worker_speedup={two['rate'] / one['rate']:.2f} x target>=1.5")
    print(f"RESULT two_worker_cpu_efficiency={two['per_cpu_s'] / one['per_cpu_s']:.2f} x target>=0.9")
    if 1 in res:  # per CPU-second from the group's settling to the last record (every record, none in flight)
        print(f"RESULT hosts_pg_vs_sqlite_cpu_efficiency="
              f"{res[1]['consume_per_cpu_s'] / one['consume_per_cpu_s']:.2f} x target>=0.75")
        for w in sorted(res):
            if w > 1:
                print(f"RESULT hosts{w}_speedup={res[w]['consume_rate'] / res[1]['consume_rate']:.2f} x "
                      f"target>={0.75 * w:.1f}")
                print(f"RESULT hosts{w}_cpu_efficiency="
                      f"{res[w]['consume_per_cpu_s'] / res[1]['consume_per_cpu_s']:.2f} x target>=0.9")
                print(f"RESULT hosts{w}_all_cpu_efficiency="
                      f"{res[w]['consume_all_per_cpu_s'] / res[1]['consume_all_per_cpu_s']:.2f} x target>=0.9")


def _fold_and_seal(comps, fb, home: Path, batch_size: int, profs=(None, None), samples_value: str = "notice") -> dict:
    """Fold ``comps`` then ``fb`` (``(key, value)`` bytes) through a fresh in-process
    :class:`ingest.worker.Worker` (SQLite state under ``home``) in batches of ``batch_size``
    records, then seal every label. Returns ``{"fold_cpu_s", "seal_cpu_s", "records",
    "samples", "shards"}`` (CPU seconds of this process; ``profs``: two ``cProfile.Profile``
    (or Nones), enabled around the fold and around the seal rounds; ``samples_value``: the
    worker's ``IngestConfig.samples_value``, what the seal rounds encode for the samples topic)."""
    from collections import namedtuple

    from ingest.app import IngestConfig
    from ingest.join import JoinConfig
    from ingest.worker import Worker

    tp_ = namedtuple("TP", "topic partition")
    rec = namedtuple("Rec", "key value offset headers")
    cfg = IngestConfig(join=JoinConfig(seal_after_s=0.001, max_label_age_s=3600, orphan_ttl_s=600),
                       bootstrap="127.0.0.1:1", samples_dir=home / "samples", state_path=home / "state.sqlite",
                       catalog=home / "catalog.duckdb", samples_value=samples_value)
    w = Worker(cfg)
    # the in-memory state's checkpoint (ingest.keyed, D81) after every batch: at least as often
    # as a worker checkpoints (every checkpoint_s, covering several batches); a worker whose
    # state is a database (no checkpoint method) made each batch one transaction instead
    checkpoint = getattr(w, "checkpoint", None)
    try:
        names = topic_names()
        items = [(names.completions, k, v) for k, v in comps] + [(names.feedback, k, v) for k, v in fb]
        pf, ps = profs
        c0 = time.process_time()
        if pf:
            pf.enable()
        for i in range(0, len(items), batch_size):
            batch: dict = {}
            for j, (t, k, v) in enumerate(items[i:i + batch_size]):
                batch.setdefault(tp_(t, 0), []).append(rec(k, v, i + j, ()))
            dead, _, _, _ = w.fold(batch)
            if dead:
                raise RuntimeError(f"{len(dead)} dead letters from valid records: {dead[0]}")
            if checkpoint is not None:
                checkpoint({tp: recs[-1].offset + 1 for tp, recs in batch.items()})
        if pf:
            pf.disable()
        c1 = time.process_time()
        time.sleep(0.01)  # every label due (seal_after 1 ms)
        c2 = time.process_time()
        if ps:
            ps.enable()
        samples, more = 0, True
        while more:
            msgs, orphans, more = w.seal_round()
            samples += len(msgs)
            if orphans:
                raise RuntimeError(f"orphans or malformed at sealing: {orphans[0].dead_letters[:1]}")
        if checkpoint is not None:
            checkpoint()  # the labels marked sealed
        if ps:
            ps.disable()
        c3 = time.process_time()
        return {"fold_cpu_s": c1 - c0, "seal_cpu_s": c3 - c2, "records": len(items), "samples": samples,
                "shards": len(list((home / "samples").glob("**/*.parquet")))}
    finally:
        w._pool.shutdown()
        w._fold_pool.shutdown()
        w.store.close()


def _rss() -> int:
    """This process's resident memory (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def state_memory(n: int) -> None:
    """``--state-labels N``: N open labels (a minimal completion and 1-3 users' votes each, as
    :func:`make_events` draws them; bodies of ~0.6 KiB, written by the checkpoints and then
    held as references) folded in process into :class:`ingest.keyed.KeyedState` over a SQLite
    checkpoint store, in getmany-sized batches with a checkpoint after each. Prints the
    state's memory (resident-set growth, and the state's own estimate), the last full
    checkpoint's time, and the time for another worker to restore the partitions (what a
    successor of a SIGKILLed worker spends before folding, Kafka's rejoin aside)."""
    import gc
    import tracemalloc

    from ingest.join import JoinConfig, Joiner, parse_completion, parse_event
    from ingest.keyed import KeyedState
    from ingest.state import StateStore
    from ingest.worker import BATCH_MAX_RECORDS, configure_gc

    configure_gc()
    small = argparse.Namespace(prompt_tokens=2, completion_tokens=2, layers=1, experts=8, top_k=1)
    comps, fb = make_events(n, small, seed=1)
    comps = [(parse_completion(v), v) for _, v in comps]
    feedback_topic = topic_names().feedback
    fb = [(parse_event(FeedbackEvent, v, feedback_topic), v) for _, v in fb]
    home = Path(tempfile.mkdtemp(prefix="fw-bench-state-"))
    parts = 6
    cfg = JoinConfig(seal_after_s=3600, max_label_age_s=7200, orphan_ttl_s=3600)
    try:
        k = KeyedState(StateStore(home / "state.sqlite", owner="a"))
        k.assign(range(parts), parts)
        j = Joiner(k, cfg)
        gc.collect()
        rss0 = _rss()
        tracemalloc.start()  # the state's own allocations (the resident set also keeps freed arenas)
        t_ck = 0.0
        for fold, records in ((j.on_completions, comps), (j.on_feedbacks, fb)):
            for i in range(0, len(records), BATCH_MAX_RECORDS):
                with k.transaction():
                    fold(records[i:i + BATCH_MAX_RECORDS])
                t = time.perf_counter()
                k.checkpoint()
                t_ck = time.perf_counter() - t  # the last checkpoint's time
        del comps, fb
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        grew = _rss() - rss0
        est = k.memory_bytes()
        n_open = k.open_count()
        c0, t0 = time.process_time(), time.perf_counter()
        k2 = KeyedState(StateStore(home / "state.sqlite", owner="b"))
        k2.assign(range(parts), parts)
        restore_s, restore_cpu = time.perf_counter() - t0, time.process_time() - c0
        assert k2.open_count() == n_open
        per = 100_000 / max(1, n_open)
        print(f"{n_open} open labels, {k.dedupe_sizes()[0]} dedupe entries: the state holds {held / 2**20:.1f} MiB "
              f"(traced; the worker's estimate {est / 2**20:.1f} MiB; resident set grew {grew / 2**20:.1f} MiB, "
              f"freed arenas included); last checkpoint of a batch {1000 * t_ck:.0f} ms (traced); restore by "
              f"another worker {restore_s:.2f} s ({restore_cpu:.2f} CPU-s)", flush=True)
        print(f"RESULT state_memory_mib_per_100k_open_labels={held * per / 2**20:.1f} MiB")
        print(f"RESULT state_restore_s_per_100k_open_labels={restore_s * per:.2f} s")
        k.close()
        k2.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def profile(args) -> None:
    """``--profile``: the worker's fold and seal round on this run's records, in-process, first
    unprofiled, then under cProfile (tables printed: own time, cumulative time)."""
    import cProfile
    import io
    import pstats

    from ingest.worker import BATCH_MAX_RECORDS, configure_gc

    configure_gc()  # the worker process's collector settings (ingest.worker.run)
    n = args.completions or (3000 if args.quick else 10000)
    comps, fb = make_events(n, args)
    labels = len({k for k, _ in fb})
    print(f"profile: {len(comps)} completions, {len(fb)} feedback -> {labels} labels, batches of "
          f"{BATCH_MAX_RECORDS}", flush=True)
    modes = ["notice", "sample"] if args.samples_value == "both" else [args.samples_value]
    runs = [("unprofiled", (None, None), m) for _ in range(args.profile_reps) for m in modes] + [
        ("cProfile", (cProfile.Profile(time.process_time), cProfile.Profile(time.process_time)), modes[0])]
    fold_s, seal_s = [], []
    by_mode: dict[str, list[float]] = {m: [] for m in modes}
    for name, profs, mode in runs:
        home = Path(tempfile.mkdtemp(prefix="fw-bench-profile-"))
        try:
            r = _fold_and_seal(comps, fb, home, BATCH_MAX_RECORDS, profs, mode)
        finally:
            shutil.rmtree(home, ignore_errors=True)
        if r["samples"] != labels:
            raise RuntimeError(f"{r['samples']} samples, expected {labels}")
        if profs[0] is None:
            by_mode[mode].append(r["seal_cpu_s"])
        print(f"{name} (samples topic: {mode}): fold {r['fold_cpu_s']:.2f} CPU-s ({r['records'] / r['fold_cpu_s']:,.0f} records per CPU-s), "
              f"sealing {r['samples']} labels into {r['shards']} shard(s) {r['seal_cpu_s']:.2f} CPU-s "
              f"({1e3 * r['seal_cpu_s'] / r['samples']:.3f} ms per label); pipeline "
              f"{r['records'] / (r['fold_cpu_s'] + r['seal_cpu_s']):,.0f} records per CPU-s", flush=True)
        if profs[0] is None:
            fold_s.append(r["fold_cpu_s"])
            seal_s.append(r["seal_cpu_s"])
            if len(fold_s) == args.profile_reps * len(modes):
                if len(modes) > 1:  # alternated in this process: the samples topic's value alone
                    med = {m: sorted(v)[len(v) // 2] for m, v in by_mode.items()}
                    print("sealing by samples-topic value, median of "
                          f"{args.profile_reps}: " + ", ".join(f"{m} {1e3 * v / r['samples']:.3f} ms per label"
                                                              for m, v in med.items()), flush=True)
                    print(f"RESULT seal_notice_vs_sample_cpu={med['notice'] / med['sample']:.3f} x")
                f, sl = sorted(fold_s)[len(fold_s) // 2], sorted(seal_s)[len(seal_s) // 2]
                print(f"median of {len(fold_s)}: fold {f:.2f} CPU-s ({r['records'] / f:,.0f} records per CPU-s), "
                      f"sealing {sl:.2f} CPU-s ({1e3 * sl / r['samples']:.3f} ms per label), pipeline "
                      f"{r['records'] / (f + sl):,.0f} records per CPU-s", flush=True)
        for part, prof in zip(("fold", "sealing"), profs):
            if prof is None:
                continue
            for key in ("tottime", "cumulative"):
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.profile_top)
                print(f"--- {part}: top {args.profile_top} by {key} (CPU time, profiler overhead included) ---")
                print("\n".join(ln for ln in out.getvalue().splitlines() if ln.strip()
                                and not ln.lstrip().startswith(("Ordered by", "List reduced"))))


def fuzz(n: int, args) -> None:
    """The schema-driven fuzz (``tests/test_ingest_fuzz.run_fuzz``) at ``n`` records on a fresh
    broker (6 partitions); its checks raise ``AssertionError`` on any loss or misnamed field."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_ingest_fuzz import run_fuzz

    scale = n / 10_000
    b = spawn()
    home = Path(tempfile.mkdtemp(prefix="fw-bench-fuzz-"))
    try:
        r = run_fuzz(b.bootstrap, home / "home", home / "worker.log", n_valid=int(400 * scale),
                     n_bad_c=int(300 * scale), n_sc=int(300 * scale), n_sf=int(2000 * scale), n_records=n,
                     timeout_s=args.timeout_s, seal_after_s=15.0, orphan_ttl_s=60.0)
    finally:
        b.stop()
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    print(f"fuzz: {r['records']:,} records ({r['refused']:,} refused by the contract), produced in "
          f"{r['produced_s']:.1f}s; one worker decided every one {r['decided_s']:.1f}s after its start using "
          f"{r['worker_cpu_s']:.1f} CPU-s: {r['samples']:,} samples, {r['dead']:,} dead letters "
          f"({r['quarantined']} quarantined at sealing); checks passed", flush=True)
    print(f"RESULT fuzz_records={r['records']} records target>=50000")
    print(f"RESULT fuzz_checks_passed=1 bool target>=1")
    print(f"RESULT fuzz_records_per_worker_cpu_s={r['records'] / max(1e-9, r['worker_cpu_s']):.0f} records/CPU-s "
          f"target>=0")
    print(f"RESULT fuzz_decided_s={r['decided_s']:.1f} s target>=0")


if __name__ == "__main__":
    main()
