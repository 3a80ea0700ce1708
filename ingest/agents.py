"""The ingest agents: completions and feedback in, shards + samples + dead letters out.

Crash safety (no label lost, none counted twice; issue 4 item 3):

1. An agent folds each event into the SQLite join state (``ingest.state``) before the event
   is acked; faust commits only acked offsets. Agents take batches of events
   (``take_events``: faust acks a batch only after the agent body is done with it); the
   state of a batch is one SQLite commit (group commit), flushed at the end of the body,
   and also from faust's ``on_commit_initiated`` hook (a safety net: it runs synchronously
   before faust computes the offsets to commit). A dead letter decided on an event is delivered (producer ack awaited) before
   the event is acked. So a committed offset never covers an event whose effect is not
   durable; a killed worker loses only an unflushed batch whose offsets were not committed.
2. After a crash, the uncommitted tail is consumed again; every event_id folded or
   dead-lettered is in the ``events`` table and every sealed completion in ``sealed`` (for
   ``JoinConfig.dedupe_retention_s``, far longer than that tail), so replays are
   recognised as duplicates and fold nothing.
3. The seal timer claims due labels with the path of the shard that will hold them and the
   worker's owner id (one transaction), writes the shard atomically (temp + fsync +
   rename), then marks them sealed. A worker killed between the rename and the mark is
   repaired by :meth:`ingest.join.Joiner.recover` (at start, and every ``RECOVER_EVERY_S``
   by the live workers): the shard exists, so the labels are marked sealed, not sealed
   again; a shard that never appeared releases its labels to be sealed again. Recovery
   touches only claims of dead owners (an owner is alive while its process holds its
   ``flock``), so a worker starting next to a live one never releases a claim the live
   one is still writing.
4. Nothing depends on end offsets, lag, or changelog highwaters (wrong on the embedded
   broker, DESIGN §3).
5. A restart of the memory-only embedded broker loses topics, data and committed offsets:
   the workers' heartbeats fail (unknown member), they rejoin the group, find no committed
   offset and read the recreated topics from the beginning (``auto_offset_reset=
   "earliest"``); open labels stay in the SQLite state and are sealed as usual.
   ``tests/test_ingest_scale.py`` checks it with three workers on one partition.

Counters ``consumed_completions`` / ``consumed_feedback`` count deliveries (a replayed
record counts again); they are how ``bench/ingest.py`` measures consumption.

Samples on ``flywheel.samples`` and dead letters are at-least-once (a crash between the
shard and the publish re-publishes nothing but may miss the topic copy of a shard's
samples; the shards are the source of truth the learner reads).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from faust.sensors import Sensor

from schemas import topics as T
from schemas.events import CompletionEvent, DeadLetter, FeedbackEvent, now_ms

from ingest import catalog, topics, writer
from ingest.join import Joiner, parse_event
from ingest.state import StateStore

log = logging.getLogger("ingest")

BATCH_EVENTS = 500  # events per agent batch (faust take_events) = one SQLite commit ...
BATCH_AGE_S = 0.05  # ... or what arrived within this long (s)
RECOVER_EVERY_S = 5.0  # live workers finish/release dead workers' claims this often (s)
CATALOG_EVERY_S = 60.0  # catalog views re-created at most this often once they see files (s)
PRUNE_EVERY_S = 60.0  # dedupe/sealed rows older than dedupe_retention_s deleted this often (s)


class _FlushBeforeCommit(Sensor):
    """faust calls ``on_commit_initiated`` synchronously before it computes and commits
    offsets: flushing the state there makes every acked event durable before its offset is
    committed."""

    def __init__(self, store: StateStore):
        super().__init__()
        self.store = store

    def on_commit_initiated(self, consumer):
        self.store.flush()


def attach(app, cfg) -> Joiner:
    """Declare the topics, agents and seal timer of ``cfg`` (an ``IngestConfig``) on ``app``."""
    completions, feedback, samples_topic, deadletter = topics.declare(app)
    store = StateStore(cfg.state_path)
    joiner = Joiner(store, cfg.join)
    app.sensors.add(_FlushBeforeCommit(store))
    log.warning("ingest owner %s", store.owner)
    rec = joiner.recover(lambda p: Path(p).exists())
    if rec["sealed"] or rec["released"]:
        log.warning("ingest recover: %s", rec)
    last_stats = {"at": 0.0, "c": None, "recover": time.monotonic(), "prune": 0.0,
                  "cat_samples": False, "cat_dead": False, "cat_at": 0.0}
    dead_seen: list[DeadLetter] = []  # for the catalog file, written at the next tick
    dead_dir = catalog.deadletters_dir(cfg.samples_dir)

    async def publish_dead(dl: DeadLetter) -> None:
        fut = await deadletter.send(key=(dl.key or "").encode(), value=dl.to_bytes())
        await fut  # delivered before the source event is acked
        dead_seen.append(dl)

    @app.on_partitions_assigned.connect
    async def on_assigned(app, assigned, **kwargs):
        mine = sorted(f"{tp.topic}:{tp.partition}" for tp in assigned if tp.topic in (T.COMPLETIONS, T.FEEDBACK))
        log.warning("ingest assigned %s", json.dumps(mine))

    async def parse_or_dead_letter(ev, model, topic: str, counter: str):
        """The validated event, or None after a malformed one went to the dead-letter topic."""
        parsed = parse_event(model, ev.message.value, topic, ev.message.key)
        if isinstance(parsed, DeadLetter):
            await publish_dead(parsed)
            with store.transaction():
                store.bump(counter)
            return None
        store.begin_batch()
        return parsed

    async def fold_completion(ev) -> None:
        parsed = await parse_or_dead_letter(ev, CompletionEvent, T.COMPLETIONS, "deadletter_malformed_completion")
        if parsed is not None:
            joiner.on_completion(parsed, ev.message.value)

    async def fold_feedback(ev) -> None:
        parsed = await parse_or_dead_letter(ev, FeedbackEvent, T.FEEDBACK, "deadletter_malformed_feedback")
        if parsed is None:
            return
        _, dl = joiner.on_feedback(parsed, ev.message.value)
        if dl is not None:
            store.flush()
            await publish_dead(dl)
            joiner.mark_dead([str(parsed.event_id)])

    # take_events acks a batch only after this body has finished with it, and the body
    # flushes the state first: durable before acked, acked before committed.
    @app.agent(completions, name="ingest-completions")
    async def on_completions(stream):
        async for batch in stream.take_events(BATCH_EVENTS, within=BATCH_AGE_S):
            for ev in batch:
                await fold_completion(ev)
            store.begin_batch()
            with store.transaction():
                store.bump("consumed_completions", len(batch))
            store.flush()

    @app.agent(feedback, name="ingest-feedback")
    async def on_feedback(stream):
        async for batch in stream.take_events(BATCH_EVENTS, within=BATCH_AGE_S):
            for ev in batch:
                await fold_feedback(ev)
            store.begin_batch()
            with store.transaction():
                store.bump("consumed_feedback", len(batch))
            store.flush()

    @app.timer(cfg.tick_s, name="ingest-seal")
    async def seal():
        store.flush()  # claims and seals below are their own durable transactions
        if time.monotonic() - last_stats["recover"] > RECOVER_EVERY_S:  # a dead peer's claims
            last_stats["recover"] = time.monotonic()
            rec = joiner.recover(lambda p: Path(p).exists())
            if rec["sealed"] or rec["released"]:
                log.warning("ingest recover: %s", rec)
        if time.monotonic() - last_stats["prune"] > PRUNE_EVERY_S:
            last_stats["prune"] = time.monotonic()
            joiner.prune()
        res = joiner.tick(now_ms(), writer.shard_namer(cfg.samples_dir))
        wrote, wrote_dead = 0, False
        for path, samples in res.shards.items():
            try:
                writer.write_shard(samples, path)
            except Exception:
                log.exception("ingest: shard %s failed; labels released, retried next tick", path)
                joiner.release([str(s.completion_id) for s in samples])
                continue
            joiner.commit_sealed(samples, path)
            wrote += len(samples)
            for s in samples:
                await samples_topic.send(key=str(s.completion_id).encode(), value=s.to_bytes())
        if res.dead_letters:
            try:
                for dl in res.dead_letters:
                    await publish_dead(dl)
                joiner.commit_dead(res)
            except Exception:
                log.exception("ingest: orphan dead letters failed; retried next tick")
                joiner.release(res.orphan_ids)
        if dead_seen:
            try:
                writer.write_deadletters(list(dead_seen), dead_dir)
                dead_seen.clear()
                wrote_dead = True
            except Exception:
                log.exception("ingest: dead-letter file failed; retried next tick")
        # the views read the Parquet globs at query time: a refresh is needed only when the
        # first shard / dead-letter file appears (the view SQL changes), else now and then
        if (wrote and not last_stats["cat_samples"]) or (wrote_dead and not last_stats["cat_dead"]) or (
                (wrote or wrote_dead) and time.monotonic() - last_stats["cat_at"] > CATALOG_EVERY_S):
            try:
                catalog.refresh_catalog(cfg.samples_dir, cfg.catalog)
                last_stats["cat_samples"] |= bool(wrote)
                last_stats["cat_dead"] |= wrote_dead
                last_stats["cat_at"] = time.monotonic()
            except Exception as exc:  # the shards are the truth; the views are rebuilt next time
                log.warning("ingest: catalog refresh failed: %s", exc)
        if time.monotonic() - last_stats["at"] > 5.0:
            c = store.counters()
            c["open_labels"] = store.open_count()
            if c != last_stats["c"]:
                log.warning("ingest stats %s", json.dumps(c, sort_keys=True))
                last_stats["c"] = c
            last_stats["at"] = time.monotonic()

    return joiner
