"""Records that stopped the join (Hardening II, defects 1-3) and a sample that cannot be
written, through the worker's own fold and seal round (``ingest.processor.Processor.fold`` /
``seal_round``, as :class:`ingest.worker.Worker` runs them) on a real SQLite state and real Parquet shards. The consumer is left out:
records are handed to ``fold`` as the batch ``getmany`` returns (the Kafka path end to end is
``tests/test_ingest_fuzz.py``).
"""

from __future__ import annotations

import json
import uuid
from collections import namedtuple

import pyarrow.parquet as pq
import pytest

from ingest.app import IngestConfig
from ingest.join import JoinConfig
from ingest.worker import Worker
from schemas.settings import topic_names
from schemas.events import MAX_FUTURE_SKEW_MS, CompletionEvent, DeadLetter, now_ms

TP = namedtuple("TP", "topic partition")
Rec = namedtuple("Rec", "key value offset headers")


def completion(cid: str, **kw) -> bytes:
    d = dict(schema_version=1, completion_id=cid, request_id="r", created_at=now_ms(), model_version="v0001",
             pod="p0", user_hash="author", prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5, 6],
             behavior_logprobs=[-0.5, -1.25, -0.3],
             sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": None},
             finish_reason="stop", ttft_ms=1.0, latency_ms=2.0)
    d.update(kw)
    return json.dumps(d, separators=(",", ":")).encode()  # serving's layout: the head first


def vote(cid: str, user: str = "u1", value: int = 1, **kw) -> bytes:
    d = dict(schema_version=1, event_id=str(uuid.uuid4()), completion_id=cid, user_hash=user, kind="thumb",
             value=value, created_at=now_ms())
    d.update(kw)
    return json.dumps(d).encode()


def batch(*items: tuple[str, bytes]) -> dict:
    """``{TopicPartition: [records]}`` as ``getmany`` returns, one partition per topic."""
    out: dict = {}
    for i, (topic, value) in enumerate(items):
        out.setdefault(TP(topic, 0), []).append(Rec(b"k", value, i, ()))
    return out


@pytest.fixture
def worker(tmp_path):
    cfg = IngestConfig(join=JoinConfig(seal_after_s=0.001, max_label_age_s=3600, orphan_ttl_s=600),
                       bootstrap="127.0.0.1:1", samples_dir=tmp_path / "samples",
                       state_path=tmp_path / "state.sqlite", catalog=tmp_path / "catalog.duckdb")
    w = Worker(cfg)
    yield w
    w._pool.shutdown()
    w._fold_pool.shutdown()
    w.store.close()


def seal(w: Worker):
    """One seal round after the labels are due: ``(rows in shards, dead letters)``."""
    import time

    time.sleep(0.01)
    msgs, orphans, _ = w.seal_round()
    rows = {}
    for f in (w.cfg.samples_dir).glob("**/*.parquet"):
        for r in pq.read_table(f).to_pylist():
            rows[r["completion_id"]] = r
    dead = [d for res in orphans for d in res.dead_letters]
    for res in orphans:
        w.joiner.commit_dead(res)
    return rows, dead, msgs


def check_notices(w: Worker, msgs) -> None:
    """Each samples-topic value is a SampleNotice (D67) naming the shard row of its own key's
    sample: row numbers count the rows written, after any quarantined sample."""
    from schemas.events import SampleNotice

    for key, value in msgs:
        n = SampleNotice.from_bytes(value)
        row = pq.read_table(w.cfg.samples_dir / n.shard).slice(n.row, 1).to_pylist()[0]
        assert key.decode() == str(n.completion_id) == row["completion_id"]
        assert (n.votes_up, n.votes_down, sorted(n.event_ids)) == (row["votes_up"], row["votes_down"],
                                                                    sorted(row["event_ids"]))


def test_a_round_of_several_chunks_names_every_row(worker):
    """A round converts each claimed chunk (``SEAL_CHUNK`` labels) as it comes: the shard holds
    every sample once, and each notice names its own row across the chunks."""
    from ingest.worker import SEAL_CHUNK

    cids = [str(uuid.uuid4()) for _ in range(2 * SEAL_CHUNK + 37)]
    worker.fold(batch(*[(topic_names().completions, completion(c)) for c in cids]))
    worker.fold(batch(*[(topic_names().feedback, vote(c)) for c in cids]))
    rows, dead, msgs = seal(worker)
    assert sorted(rows) == sorted(cids) and not dead and len(msgs) == len(cids)
    check_notices(worker, msgs)
    from schemas.events import SampleNotice

    assert sorted(SampleNotice.from_bytes(v).row for _, v in msgs) == list(range(len(cids)))
    (shard,) = list(worker.cfg.samples_dir.glob("**/*.parquet"))
    assert pq.read_metadata(shard).num_rows == len(cids)


def test_samples_value_sample_publishes_the_whole_sample(tmp_path):
    """``samples_value = "sample"``: the topic carries each RewardedSample, equal to its row."""
    from samplestore.catalog import read_samples
    from schemas.events import RewardedSample

    cfg = IngestConfig(join=JoinConfig(seal_after_s=0.001), bootstrap="127.0.0.1:1", samples_value="sample",
                       samples_dir=tmp_path / "samples", state_path=tmp_path / "state.sqlite",
                       catalog=tmp_path / "catalog.duckdb")
    w = Worker(cfg)
    try:
        cids = [str(uuid.uuid4()) for _ in range(3)]
        w.fold(batch(*[(topic_names().completions, completion(c)) for c in cids], *[(topic_names().feedback, vote(c)) for c in cids]))
        rows, dead, msgs = seal(w)
        got = {str(s.completion_id): s for s in read_samples(cfg.samples_dir)}
        assert sorted(got) == sorted(cids) and not dead
        assert sorted(k.decode() for k, _ in msgs) == sorted(cids)
        for k, v in msgs:
            s, row = RewardedSample.from_bytes(v), got[k.decode()]
            f32 = {"reward", "behavior_logprobs"}  # float32 columns in the shard
            assert s.model_dump(exclude=f32) == row.model_dump(exclude=f32)
            assert s.behavior_logprobs == pytest.approx(row.behavior_logprobs, rel=1e-6) and s.reward == row.reward
    finally:
        w._pool.shutdown()
        w._fold_pool.shutdown()
        w.store.close()


def test_created_at_beyond_any_integer_is_dead_lettered_and_the_batch_folds(worker):
    """Defect 1: created_at = 10**19 raised OverflowError out of the fold at every restart."""
    ok, bad, ahead = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
    dead, eids, _, _ = worker.fold(batch(
        (topic_names().completions, completion(bad, created_at=10**19)), (topic_names().completions, completion(ok)),
        (topic_names().completions, completion(ahead, created_at=now_ms() + MAX_FUTURE_SKEW_MS + 600_000)),
        (topic_names().feedback, vote(ok))))
    assert [(d.source_topic, d.field) for d in dead] == [(topic_names().completions, "created_at")] * 2
    assert "2100" in dead[0].reason and str(10**19) in dead[0].payload  # the contract's bound
    assert dead[1].reason.startswith("future:") and ahead in dead[1].payload  # the clock rule
    rows, dead, _ = seal(worker)
    assert list(rows) == [ok] and rows[ok]["votes_up"] == 1 and not dead


def test_a_value_the_state_refuses_is_dead_lettered_alone(worker, monkeypatch):
    """Whatever a record carries that the state refuses (here an integer SQLite cannot hold,
    past the contract's bounds and the clock rule, both taken away) costs that record only:
    the batch is folded record by record, the culprit dead-lettered (``unfoldable``)."""
    ok, bad = str(uuid.uuid4()), str(uuid.uuid4())
    from ingest import join

    monkeypatch.setattr("ingest.processor.check_clock", lambda ev, *a: ev)
    monkeypatch.setattr(join, "_HEAD_VALIDATOR", join.pydantic.TypeAdapter(dict).validator)
    real = join.parse_completion

    def unbounded(raw, *a):  # the head as an unchecked object: 10**19 reaches the state
        ev = real(raw, *a)
        return ev if isinstance(ev, DeadLetter) else type("Head", (), {
            "completion_id": uuid.UUID(ev["completion_id"]), "created_at": ev["created_at"]})()

    monkeypatch.setattr("ingest.processor.parse_completion", unbounded)
    dead, _, _, _ = worker.fold(batch((topic_names().completions, completion(bad, created_at=10**19)),
                                      (topic_names().completions, completion(ok)), (topic_names().feedback, vote(ok))))
    assert [(d.source_topic, d.field) for d in dead] == [(topic_names().completions, "value")]
    assert dead[0].reason.startswith("unfoldable: OverflowError")
    monkeypatch.undo()
    rows, _, _ = seal(worker)
    assert list(rows) == [ok]


def test_lone_surrogates_are_dead_lettered_naming_the_field(worker):
    """Defect 2: a vote whose user_hash is a lone surrogate crashed the worker
    (PydanticSerializationError), a completion's wedged its shard."""
    cid, cid2 = str(uuid.uuid4()), str(uuid.uuid4())
    raw_vote = vote(cid, user="\ud800")  # json.dumps writes the escape "\\ud800": valid JSON
    assert b"\\ud800" in raw_vote
    dead, eids, _, _ = worker.fold(batch(
        (topic_names().completions, completion(cid)), (topic_names().completions, completion(cid2, user_hash="a\udfffb")),
        (topic_names().feedback, raw_vote), (topic_names().feedback, vote(cid)), (topic_names().feedback, vote(cid2)),
        (topic_names().feedback, vote(cid, user="x", metadata={"\udc80": "v"}))))
    assert sorted((d.source_topic, d.field) for d in dead) == [
        (topic_names().completions, "user_hash"), (topic_names().feedback, "metadata.\\udc80"), (topic_names().feedback, "user_hash")]
    assert all("surrogate" in d.reason for d in dead)
    for d in dead:
        d.to_bytes()  # publishable
    rows, dead, msgs = seal(worker)
    # the good label is written; the refused completion's vote waits as an orphan (dead-lettered
    # after orphan_ttl_s, like any vote whose completion never came)
    assert list(rows) == [cid] and len(msgs) == 1 and rows[cid]["votes_up"] == 1 and not dead
    assert worker.stats()["open_labels"] == 1


def test_a_future_dated_vote_never_outranks_the_users_later_vote(worker):
    """Defect 3: a vote stamped ahead of the worker's clock kept the label against the same
    user's later real vote. Within MAX_FUTURE_SKEW_MS it is clamped to the worker's clock;
    beyond it, dead-lettered with field created_at."""
    cid = str(uuid.uuid4())
    t = now_ms()
    early = vote(cid, value=1, created_at=t + MAX_FUTURE_SKEW_MS // 2)  # a fast clock, within the tolerance
    far = vote(cid, user="u2", value=1, created_at=t + MAX_FUTURE_SKEW_MS + 60_000)
    dead, eids, _, _ = worker.fold(batch((topic_names().completions, completion(cid, created_at=t + 1000)),
                                         (topic_names().feedback, early), (topic_names().feedback, far)))
    assert [(d.field, d.reason.split(":")[0]) for d in dead] == [("created_at", "future")]
    import time

    time.sleep(0.005)
    later = vote(cid, value=-1, created_at=now_ms())  # the same user's real, later vote
    worker.fold(batch((topic_names().feedback, later)))
    rows, dead, _ = seal(worker)
    r = rows[cid]
    assert (r["votes_up"], r["votes_down"], r["reward"]) == (0, 1, -1.0)
    assert sorted(r["event_ids"]) == sorted(json.loads(v)["event_id"] for v in (early, later))
    # the completion's created_at ahead of the clock was clamped too, and its body still seals
    assert r["created_at"].timestamp() * 1000 <= t + 1000 and not dead


def test_a_sample_that_cannot_be_written_is_quarantined_and_its_shard_written(worker, monkeypatch):
    """One write failure never blocks others: a sample whose value Arrow refuses (a token id
    beyond int32 that the contract let through) is dead-lettered with its votes, field named,
    and the rest of its shard is written in the same round (it used to be retried forever,
    holding the shard back)."""
    cids = [str(uuid.uuid4()) for _ in range(4)]
    bad = cids[1]
    items = [(topic_names().completions, completion(c)) for c in cids]
    items += [(topic_names().feedback, vote(c, user=u)) for c in cids for u in ("u1", "u2")]
    worker.fold(batch(*items))
    from ingest.join import Joiner

    real = Joiner.validate

    def validate(self, st):  # the body passes the contract, but with a value no shard can hold
        ev = real(self, st)
        if isinstance(ev, CompletionEvent) and str(ev.completion_id) == bad:
            ev.prompt_token_ids = [1, 2**40, 3]
        return ev

    monkeypatch.setattr(Joiner, "validate", validate)
    rows, dead, msgs = seal(worker)
    assert sorted(rows) == sorted(c for c in cids if c != bad) and len(msgs) == 3
    check_notices(worker, msgs)
    assert [(d.source_topic, d.field) for d in dead] == [(topic_names().completions, "prompt_token_ids")] + [
        (topic_names().feedback, "completion_id")] * 2
    assert dead[0].reason.startswith("unwritable sample:") and bad in dead[0].payload
    assert all(isinstance(d, DeadLetter) and d.key == bad for d in dead)
    # decided: nothing is left open or claimed, and a replayed vote is a duplicate
    c = worker.stats()
    assert c["open_labels"] == 0 and c["samples"] == 3 and c["samples_quarantined"] == 1
    assert worker.store.sealed_among([bad]) == {bad}


@pytest.mark.parametrize("what", ["not zstd", "wrong size", "cut short"])
def test_a_routes_frame_that_does_not_decode_is_quarantined_naming_expert_routes(worker, what):
    """Format 3 keeps the routes' zstd frame as served (D65); the worker still decompresses it
    once at sealing to check it: a frame that is not zstd, decodes to another size than its
    shape, or is cut short passes the contract (base64, shape) but is dead-lettered with its
    votes, field ``expert_routes``, and the rest of its shard is written."""
    import base64

    import zstandard

    rows_, layers, k = 3 + 3 - 1, 2, 2  # prompt 3 + completion 3 - 1 token rows
    good_frame = zstandard.ZstdCompressor(level=3).compress(bytes(range(rows_ * layers * k)))
    frame = {"not zstd": b"\x00" * 40,
             "wrong size": zstandard.ZstdCompressor(level=3).compress(bytes(rows_ * layers * k + 1)),
             "cut short": good_frame[:-3]}[what]
    routes = lambda f: {"shape": [rows_, layers, k], "dtype": "uint8", "codec": "zstd",  # noqa: E731
                        "data": base64.b64encode(f).decode()}
    cids = [str(uuid.uuid4()) for _ in range(3)]
    bad = cids[1]
    items = [(topic_names().completions, completion(c, expert_routes=routes(frame if c == bad else good_frame)))
             for c in cids]
    items += [(topic_names().feedback, vote(c)) for c in cids]
    dead, _, _, _ = worker.fold(batch(*items))
    assert dead == []  # the contract does not decode the routes
    rows, dead, msgs = seal(worker)
    assert sorted(rows) == sorted(c for c in cids if c != bad) and len(msgs) == 2
    check_notices(worker, msgs)
    assert [(d.source_topic, d.field) for d in dead] == [(topic_names().completions, "expert_routes"),
                                                        (topic_names().feedback, "completion_id")]
    assert dead[0].reason.startswith("unwritable sample:") and bad in dead[0].payload
    for c in rows:  # the good ones: the served frame, byte for byte
        assert rows[c]["expert_routes"] == good_frame and rows[c]["expert_routes_codec"] == "zstd"
    c = worker.stats()
    assert c["open_labels"] == 0 and c["samples"] == 2 and c["samples_quarantined"] == 1
