"""EventLog across a real broker outage and a pod restart: every event arrives exactly once."""

from __future__ import annotations

import time
from collections import Counter

from schemas.settings import topic_names
from flywheel.broker import free_port, spawn
from serving.eventlog import EventLog
from tests.test_serving_app import consume


def test_outage_spills_and_replays_exactly_once(tmp_path):
    port = free_port()
    b = spawn(port)
    ev = EventLog(b.bootstrap, tmp_path / "ev.journal", send_timeout_s=1.0, retry_interval_s=0.3)
    try:
        ev.emit(topic_names().completions, "warmup", b"w")
        assert ev.flush(20) and ev.counters.sent == 1
        b.stop()
        n = 500
        t0 = time.perf_counter()
        for i in range(n):
            ev.emit(topic_names().completions, f"k{i:04d}", f"v{i}".encode())
        emit_ms = (time.perf_counter() - t0) * 1000
        assert emit_ms < 500, f"emit blocked: {emit_ms:.0f} ms for {n} events"
        deadline = time.monotonic() + 20
        while ev.counters.spilled < n and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ev.counters.spilled == n and not ev.kafka_up
        b = spawn(port)  # a new memory-only broker on the same port; spawn recreates the topics
        assert ev.flush(60), vars(ev.counters)
        # n + 1 + 1: the warm-up (acked by the lost broker, so re-sent) and one more, to see a duplicate
        recs = consume(b.bootstrap, topic_names().completions, n + 2, timeout_s=6)
        keys = [r.key.decode() for r in recs]
        assert len(keys) == n + 1 and len(set(keys)) == n + 1
        assert sorted(keys) == [f"k{i:04d}" for i in range(n)] + ["warmup"]
        assert all(r.value == (b"w" if r.key == b"warmup" else f"v{int(r.key[1:])}".encode()) for r in recs)
        assert ev.counters.replayed == n + 1 and ev.counters.failed == 0
        assert ev.counters.resent == 1 and ev.counters.broker_losses == 1
        assert ev.journal_pending() == 0
    finally:
        ev.close(timeout_s=1)
        b.stop()


def test_journal_replayed_in_order_after_restart(tmp_path):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: Kafka unreachable from the start
    j = tmp_path / "ev.journal"
    ev = EventLog(dead, j, send_timeout_s=0.5, retry_interval_s=0.2)
    n = 60
    for i in range(n):  # one key -> one partition -> Kafka keeps emission order
        ev.emit(topic_names().feedback, "same-key", f"{i}".encode())
    deadline = time.monotonic() + 20
    while ev.counters.spilled < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ev.counters.spilled == n
    ev.close(timeout_s=0.5)  # the "pod" dies with everything in its journal
    assert j.stat().st_size > 0

    b = spawn()
    ev2 = EventLog(b.bootstrap, j)  # restart: reads the journal at start
    try:
        assert ev2.flush(30)
        assert ev2.counters.replayed == n
        recs = consume(b.bootstrap, topic_names().feedback, n + 1, timeout_s=4)
        assert [r.value.decode() for r in sorted(recs, key=lambda r: r.offset)] == [str(i) for i in range(n)]
        assert j.stat().st_size == 0  # drained journal is truncated
    finally:
        ev2.close(timeout_s=1)
        b.stop()


def test_full_queue_spills_without_blocking(tmp_path):
    b = spawn()
    dead = f"127.0.0.1:{free_port()}"
    ev = EventLog(dead, tmp_path / "ev.journal", max_queue=5, send_timeout_s=0.5)
    n = 200
    t0 = time.perf_counter()
    for i in range(n):
        ev.emit(topic_names().completions, f"q{i}", b"x")
    assert (time.perf_counter() - t0) < 50  # fsync'd spills, never a wait on Kafka (200 x the 0.5 s send timeout)
    deadline = time.monotonic() + 20
    while ev.counters.spilled < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ev.counters.spilled == n and ev.counters.sent == 0
    ev.close(timeout_s=0.5)
    ev2 = EventLog(b.bootstrap, tmp_path / "ev.journal")
    try:
        assert ev2.flush(30)
        keys = [r.key.decode() for r in consume(b.bootstrap, topic_names().completions, n)]
        assert sorted(keys) == sorted(f"q{i}" for i in range(n))
    finally:
        ev2.close(timeout_s=1)
        b.stop()


def test_oversized_event_kept_out_of_band_and_does_not_stall(tmp_path, broker):
    ev = EventLog(broker.bootstrap, tmp_path / "ev.journal", max_request_bytes=2000)
    try:
        ev.emit(topic_names().completions, "small-1", b"a")
        ev.emit(topic_names().completions, "big", b"x" * 10_000)
        ev.emit(topic_names().completions, "small-2", b"b")
        assert ev.flush(20)
        assert ev.counters.sent == 2 and ev.counters.failed == 1 and ev.counters.spilled == 0
        keys = sorted(r.key.decode() for r in consume(broker.bootstrap, topic_names().completions, 2))
        assert keys == ["small-1", "small-2"]
        import base64
        import json
        kept = [json.loads(x) for x in (tmp_path / "ev.journal.rejected").read_text().splitlines()]
        assert [(k["key"], len(base64.b64decode(k["value"]))) for k in kept] == [("big", 10_000)]
    finally:
        ev.close(timeout_s=1)


def test_events_acked_by_a_lost_broker_are_sent_again(tmp_path):
    """A memory-only broker restarts between batches (no send fails): what it acked is gone.
    The acks of the new broker (another cluster id) make the log re-send what the lost one
    acked in the window, once; nothing is missing on the new broker. (An event sent while the
    broker restarts may land twice: a batch persisted after its ack timed out is journaled
    and sent again, the at-least-once case of the module docstring.)"""
    port = free_port()
    b = spawn(port)
    ev = EventLog(b.bootstrap, tmp_path / "ev.journal", send_timeout_s=1.0, retry_interval_s=0.3)
    try:
        for i in range(50):
            ev.emit(topic_names().feedback, f"a{i:02d}", f"{i}".encode())
        assert ev.flush(20) and ev.counters.sent == 50
        b.stop()
        b = spawn(port)
        for i in range(30):
            ev.emit(topic_names().feedback, f"b{i:02d}", f"{i}".encode())
        assert ev.flush(60), vars(ev.counters)
        keys = Counter(r.key.decode() for r in consume(b.bootstrap, topic_names().feedback, 111, timeout_s=6))
        assert sorted(keys) == [f"a{i:02d}" for i in range(50)] + [f"b{i:02d}" for i in range(30)]
        assert {k: n for k, n in keys.items() if k[0] == "a"} == {f"a{i:02d}": 1 for i in range(50)}
        assert ev.counters.resent == 50 and ev.counters.broker_losses == 1 and ev.counters.failed == 0
    finally:
        ev.close(timeout_s=1)
        b.stop()


def test_offsets_going_back_count_as_a_lost_broker_and_the_window_is_bounded(tmp_path):
    """Same cluster id (a broker started by hand with its default id): an offset at or below
    one acked before shows the loss. Events older than ``resend_window_s`` are not kept."""
    import subprocess

    from flywheel.broker import BrokerProcess, tansu_binary, wait_listening
    from schemas.topic_admin import ensure_topics

    def plain_broker(port):
        url = f"tcp://127.0.0.1:{port}"
        p = subprocess.Popen([str(tansu_binary()), "broker", "--storage-engine", "memory://tansu/",
                              "--listener-url", url, "--advertised-listener-url", url],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_listening(port)
        ensure_topics(f"127.0.0.1:{port}", partitions=1)
        return BrokerProcess(pid=p.pid, port=port, proc=p)

    port = free_port()
    b = plain_broker(port)
    ev = EventLog(b.bootstrap, tmp_path / "ev.journal", send_timeout_s=1.0, retry_interval_s=0.3,
                  resend_window_s=1.5)
    try:
        ev.emit(topic_names().feedback, "old", b"o")
        assert ev.flush(20)
        time.sleep(2.0)  # "old" leaves the window with the next ack
        for i in range(5):
            ev.emit(topic_names().feedback, f"k{i}", b"x")
        assert ev.flush(20) and ev.counters.sent == 6
        b.stop()
        b = plain_broker(port)
        ev.emit(topic_names().feedback, "new", b"n")
        assert ev.flush(60), vars(ev.counters)
        keys = Counter(r.key.decode() for r in consume(b.bootstrap, topic_names().feedback, 8, timeout_s=6))
        assert sorted(keys) == [f"k{i}" for i in range(5)] + ["new"]
        assert all(keys[f"k{i}"] == 1 for i in range(5))
        assert ev.counters.resent == 5 and ev.counters.broker_losses == 1
    finally:
        ev.close(timeout_s=1)
        b.stop()


def test_durable_emit_resolves_on_ack_or_on_the_journal(tmp_path, broker):
    """``emit(durable=True)``: the future resolves once Kafka acked the event, or, with
    Kafka down, once it is fsync'd in the journal (within the send timeout)."""
    ev = EventLog(broker.bootstrap, tmp_path / "ev.journal")
    try:
        assert ev.emit(topic_names().feedback, "k", b"v") is None
        fut = ev.emit(topic_names().feedback, "d", b"v", durable=True)
        assert fut.result(timeout=20) is True and ev.counters.sent >= 1
    finally:
        ev.close(timeout_s=1)
    dead = f"127.0.0.1:{free_port()}"
    ev = EventLog(dead, tmp_path / "ev2.journal", send_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        futs = [ev.emit(topic_names().feedback, f"d{i}", b"v", durable=True) for i in range(20)]
        assert all(f.result(timeout=20) is True for f in futs)
        assert time.monotonic() - t0 < 10 and ev.counters.spilled == 20 and ev.counters.sent == 0
        assert ev.journal_pending() > 0
    finally:
        ev.close(timeout_s=0.5)


def test_a_cancelled_durable_future_does_not_stop_the_log(tmp_path):
    """A waiter that gave up cancels its durable future (asyncio.wrap_future does so on a
    timeout); settling it must not raise in the log's thread, which would stop every later
    event. Kafka is unreachable, so events go to the journal, held back by its lock meanwhile."""
    j = tmp_path / "ev.journal"
    ev = EventLog(f"127.0.0.1:{free_port()}", j, send_timeout_s=0.3, retry_interval_s=60)
    try:
        with ev._jlock:
            gave_up = ev.emit(topic_names().feedback, "k", b"first", durable=True)
            assert gave_up.cancel()
        later = ev.emit(topic_names().feedback, "k", b"second", durable=True)
        assert later.result(timeout=20) is True  # the log is still running
        assert ev._thread.is_alive()
        assert j.read_bytes().count(b"\n") == 2  # both journaled, the cancelled one too
    finally:
        ev.close(timeout_s=0.5)


def test_events_the_consumer_group_has_not_consumed_are_resent_however_old(tmp_path):
    """With ``consumer_group``: an acked event stays re-sendable past ``resend_window_s``
    until the group committed past it on the broker that acked it. The broker restarts
    after the window: what the group consumed is not sent again, everything else is.
    (Without this, a broker restart after an ingest outage longer than the window lost the
    votes acked early in the outage: a hostile trial lost 115 of 1608.)"""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.structs import OffsetAndMetadata

    port = free_port()
    b = spawn(port)
    ev = EventLog(b.bootstrap, tmp_path / "ev.journal", send_timeout_s=1.0, retry_interval_s=0.3,
                  resend_window_s=0.5, consumer_group="g-test", consumed_check_s=0.3)
    try:
        keys = [f"k{i}" for i in range(12)]
        for k in keys:
            ev.emit(topic_names().feedback, k, b"v")
        assert ev.flush(20)
        recs = consume(b.bootstrap, topic_names().feedback, len(keys))
        assert sorted(r.key.decode() for r in recs) == sorted(keys)
        # the group consumes one partition (commits past its last record) and nothing else
        p0 = recs[0].partition
        done = [r for r in recs if r.partition == p0]
        c = KafkaConsumer(bootstrap_servers=b.bootstrap, group_id="g-test", enable_auto_commit=False)
        c.commit({TopicPartition(topic_names().feedback, p0): OffsetAndMetadata(max(r.offset for r in done) + 1, "", -1)})
        c.close()
        time.sleep(1.5)  # every event is past the window now; the group's offsets have been read
        ev.emit(topic_names().feedback, "tick", b"v")  # an ack lets the log drop what is consumed and old
        assert ev.flush(20)
        b.stop()  # memory-only: everything is gone
        b = spawn(port)
        ev.emit(topic_names().feedback, "new", b"v")
        assert ev.flush(60), vars(ev.counters)
        consumed = {r.key.decode() for r in done}
        want = sorted(set(keys) - consumed) + ["new", "tick"]
        got = Counter(r.key.decode() for r in consume(b.bootstrap, topic_names().feedback, len(want) + 5, timeout_s=6))
        assert sorted(got) == sorted(want), (sorted(got), want, consumed)
        assert all(n == 1 for n in got.values()), got
        assert ev.counters.resent == len(want) - 1 and ev.counters.resend_unprotected == 0, vars(ev.counters)
    finally:
        ev.close(timeout_s=1)
        b.stop()
