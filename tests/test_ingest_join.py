"""Join semantics (issue 4 item 2), pure: no Kafka, state in SQLite (:memory: or a file)."""

from __future__ import annotations

import json
import uuid

import pytest

from ingest.join import JoinConfig, Joiner, kept_share, parse_event
from ingest.state import StateStore
from schemas.settings import topic_names
from schemas.events import CompletionEvent, DeadLetter, FeedbackEvent, SamplingParams
from schemas.reward import RewardPolicy, ScoreSpec

T0 = 1_700_000_000_000  # ms
CFG = JoinConfig(seal_after_s=10, max_label_age_s=100, orphan_ttl_s=20)


def completion(cid=None, created_at=T0, version="v0001") -> CompletionEvent:
    return CompletionEvent(
        completion_id=cid or uuid.uuid4(), request_id="r", created_at=created_at, model_version=version,
        pod="p0", user_hash="author", prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5],
        behavior_logprobs=[-0.5, -1.25], sampling=SamplingParams(), finish_reason="stop",
        ttft_ms=1.0, latency_ms=2.0)


def vote(cid, user, value, created_at=T0, eid=None, kind="thumb", name=None, final_text=None) -> FeedbackEvent:
    return FeedbackEvent(event_id=eid or uuid.uuid4(), completion_id=cid, user_hash=user, kind=kind,
                         value=value, created_at=created_at, name=name, final_text=final_text)


@pytest.fixture()
def j():
    return Joiner(StateStore(":memory:"), CFG)


def test_duplicate_event_id_counts_once(j):
    c = completion()
    j.on_completion(c, now=T0)
    v = vote(c.completion_id, "u1", 1)
    assert j.on_feedback(v, now=T0 + 1)[0] == "folded"
    assert j.on_feedback(v, now=T0 + 2)[0] == "duplicate"
    assert j.tick(T0 + 1 + 9_999).samples == []
    # seal_after counts from the last *folded* vote: the duplicate at T0+2 does not extend it
    res = j.tick(T0 + 1 + 10_000)
    (s,) = res.samples
    assert (s.votes_up, s.votes_down, s.n_votes, s.label, s.reward) == (1, 0, 1, True, 1.0)
    assert s.event_ids == [str(v.event_id)]
    assert s.behavior_logprobs == [-0.5, -1.25] and s.model_version == "v0001"


def test_multi_user_aggregate_and_thumb_values():
    j = Joiner(StateStore(), JoinConfig(seal_after_s=10, max_label_age_s=100, orphan_ttl_s=20,
                                        reward=RewardPolicy(thumb_up=0.75, thumb_down=-0.25)))
    c = completion()
    j.on_completion(c, now=T0)
    vs = [vote(c.completion_id, "u1", 1), vote(c.completion_id, "u2", 1), vote(c.completion_id, "u3", -1)]
    for i, v in enumerate(vs):
        j.on_feedback(v, now=T0 + i)
    (s,) = j.tick(T0 + 2 + 10_000).samples
    assert (s.votes_up, s.votes_down, s.n_votes, s.label) == (2, 1, 3, True)
    assert s.reward == pytest.approx((2 * 0.75 - 0.25) / 3)  # the mean of each user's thumb value, by hand
    assert s.thumb == pytest.approx(1 / 3) and (s.copied, s.regenerated, s.kept_share, s.followup, s.scores) == (
        0, 0, None, None, {})
    assert s.reward_policy == RewardPolicy(thumb_up=0.75, thumb_down=-0.25).digest() != RewardPolicy().digest()
    assert sorted(s.event_ids) == sorted(str(v.event_id) for v in vs)


def test_flip_last_vote_wins_by_created_at_then_arrival(j):
    c = completion()
    j.on_completion(c, now=T0)
    up = vote(c.completion_id, "u1", 1, created_at=T0 + 100)
    down = vote(c.completion_id, "u1", -1, created_at=T0 + 200)
    stale_up = vote(c.completion_id, "u1", 1, created_at=T0 + 150)  # arrives last, older vote
    for i, v in enumerate([up, down, stale_up]):
        j.on_feedback(v, now=T0 + i)
    (s,) = j.tick(T0 + 2 + 10_000).samples
    assert (s.votes_up, s.votes_down, s.n_votes, s.label, s.reward) == (0, 1, 1, False, -1.0)
    assert set(s.event_ids) == {str(up.event_id), str(down.event_id), str(stale_up.event_id)}
    # a tie on created_at: the later arrival wins
    c2 = completion()
    j.on_completion(c2, now=T0)
    j.on_feedback(vote(c2.completion_id, "u1", -1, created_at=T0), now=T0)
    j.on_feedback(vote(c2.completion_id, "u1", 1, created_at=T0), now=T0 + 1)
    (s2,) = j.tick(T0 + 1 + 10_000).samples
    assert (s2.votes_up, s2.votes_down) == (1, 0)


def test_seal_commit_then_late_and_duplicate(j):
    c = completion()
    j.on_completion(c, now=T0)
    v = vote(c.completion_id, "u1", 1)
    j.on_feedback(v, now=T0)
    res = j.tick(T0 + 10_000, shard_for=lambda s: "/x/part-1.parquet")
    assert list(res.shards) == ["/x/part-1.parquet"]
    assert j.tick(T0 + 20_000).samples == []  # claimed: not sealed twice
    j.commit_sealed(res.samples, "/x/part-1.parquet")
    late = vote(c.completion_id, "u2", -1)
    outcome, dl = j.on_feedback(late, now=T0 + 20_000)
    assert outcome == "late" and isinstance(dl, DeadLetter)
    assert dl.field == "completion_id" and dl.reason.startswith("late")
    assert json.loads(dl.payload)["event_id"] == str(late.event_id)
    j.mark_dead([str(late.event_id)])
    assert j.on_feedback(late, now=T0 + 20_001)[0] == "duplicate"
    assert j.on_feedback(v, now=T0 + 20_001)[0] == "duplicate"  # replay of a sealed vote
    assert j.on_completion(c, now=T0 + 20_001) == "sealed"
    assert j.store.counters()["feedback_late"] == 1


def test_late_policy_drop():
    j = Joiner(StateStore(), JoinConfig(seal_after_s=10, late_policy="drop"))
    c = completion()
    j.on_completion(c, now=T0)
    j.on_feedback(vote(c.completion_id, "u1", 1), now=T0)
    res = j.tick(T0 + 10_000)
    j.commit_sealed(res.samples, "")
    assert j.on_feedback(vote(c.completion_id, "u2", 1), now=T0 + 11_000) == ("late", None)


def test_orphan_waits_then_dead_letter(j):
    cid = uuid.uuid4()
    v = vote(cid, "u1", 1)
    j.on_feedback(v, raw=v.to_bytes(), now=T0)
    assert j.tick(T0 + 19_999).dead_letters == []
    res = j.tick(T0 + 20_000)
    (dl,) = res.dead_letters
    assert dl.field == "completion_id" and "orphan" in dl.reason and "orphan_ttl_s=20" in dl.reason
    assert FeedbackEvent.from_bytes(dl.payload).event_id == v.event_id  # the raw event is kept
    j.commit_dead(res)
    assert j.store.open_count() == 0
    assert j.on_feedback(v, now=T0 + 20_001)[0] == "duplicate"


def test_orphan_then_completion_in_time_joins(j):
    cid = uuid.uuid4()
    v = vote(cid, "u1", -1)
    j.on_feedback(v, now=T0)
    j.on_completion(completion(cid), now=T0 + 5_000)
    res = j.tick(T0 + 10_000)
    (s,) = res.samples
    assert s.label is False and s.event_ids == [str(v.event_id)] and res.dead_letters == []


def test_unlabelled_completion_dropped_and_age_seals(j):
    quiet = completion(created_at=T0)
    j.on_completion(quiet, now=T0)
    busy = completion(created_at=T0)
    j.on_completion(busy, now=T0)
    # a vote every 5 s keeps seal_after (10 s) from firing; max_label_age (100 s) seals it
    for k in range(30):
        j.on_feedback(vote(busy.completion_id, f"u{k}", 1), now=T0 + 5_000 * k)
        res = j.tick(T0 + 5_000 * k)
        if k * 5_000 < 100_000:
            assert res.samples == []
        if res.samples:
            break
    assert res.dropped == [str(quiet.completion_id)]
    (s,) = res.samples
    assert s.completion_id == busy.completion_id and s.n_votes == 21  # votes at 0..100 s
    assert j.store.counters()["completions_dropped_unlabelled"] == 1


def test_kind_of_weight_0_is_dead_lettered():
    j = Joiner(StateStore(":memory:"), JoinConfig(seal_after_s=10, max_label_age_s=100, orphan_ttl_s=20,
                                                  reward=RewardPolicy(copy_weight=0, thumb_weight=0)))
    c = completion()
    j.on_completion(c, now=T0)
    for kind in ("copy", "thumb"):
        out, dl = j.on_feedback(vote(c.completion_id, "u1", 1.0, kind=kind), now=T0)
        assert out == "unsupported" and dl.field == "kind"
        assert dl.reason == f"kind {kind!r} is not used: weight 0 in the reward policy"
    assert j.on_feedback(vote(c.completion_id, "u1", 1.0, kind="regenerate"), now=T0)[0] == "folded"
    assert j.store.counters()["feedback_unsupported"] == 2


@pytest.mark.parametrize("raw,field,needle", [
    (b"{not json", "value", "bad JSON"),
    (b"[1, 2]", "value", "JSON object"),
    (json.dumps({"schema_version": 2}).encode(), "schema_version", "unknown schema_version 2"),
    (json.dumps({"event_id": str(uuid.uuid4()), "user_hash": "u", "value": 1, "created_at": T0}).encode(),
     "completion_id", "Field required"),
    (json.dumps({"event_id": "nope", "completion_id": str(uuid.uuid4()), "user_hash": "u", "value": 1,
                 "created_at": T0}).encode(), "event_id", "UUID"),
    (json.dumps({"event_id": str(uuid.uuid4()), "completion_id": str(uuid.uuid4()), "user_hash": "u",
                 "value": "up", "created_at": T0}).encode(), "value", "number"),
    (json.dumps({"event_id": str(uuid.uuid4()), "completion_id": str(uuid.uuid4()), "user_hash": "u",
                 "value": 1, "created_at": T0, "extra": 1}).encode(), "extra", "Extra inputs"),
    (b"\xff\xfe", "value", "bad JSON"),
])
def test_malformed_feedback_dead_letter_names_field(raw, field, needle):
    dl = parse_event(FeedbackEvent, raw, topic_names().feedback, b"k")
    assert isinstance(dl, DeadLetter)
    assert dl.field == field and needle in dl.reason, (dl.field, dl.reason)
    assert dl.source_topic == topic_names().feedback and dl.key == "k"


def test_state_survives_reopen_and_recover(tmp_path):
    """The SQLite state is what a killed worker restarts from; recover() finishes claims."""
    path = tmp_path / "state.sqlite"
    j = Joiner(StateStore(path), CFG)
    a, b = completion(), completion()
    for c in (a, b):
        j.on_completion(c, now=T0)
        j.on_feedback(vote(c.completion_id, "u1", 1), now=T0)
    shard_a, shard_b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    res = j.tick(T0 + 10_000, shard_for=lambda s: str(shard_a if s.completion_id == a.completion_id else shard_b))
    assert len(res.samples) == 2
    shard_a.write_bytes(b"x")  # a's shard was renamed into place; the worker dies before commit
    j.store.close()
    j2 = Joiner(StateStore(path), CFG)
    assert j2.recover(lambda p: __import__("os").path.exists(p)) == {"sealed": 1, "released": 1, "live": 0}
    assert j2.on_completion(a, now=T0 + 11_000) == "sealed"
    (s,) = j2.tick(T0 + 11_000).samples  # b is sealed again, a is not
    assert s.completion_id == b.completion_id


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="seal_after_s"):
        JoinConfig(seal_after_s=0)
    with pytest.raises(ValueError, match="late_policy"):
        JoinConfig(late_policy="keep")


def test_group_commit_batch_and_savepoints(tmp_path):
    """Batched state: a failing unit rolls back alone; an unflushed batch is lost on a kill
    (its offsets were never committed: they are committed only after the state's commit)."""
    path = tmp_path / "s.sqlite"
    st = StateStore(path)
    j = Joiner(st, CFG)
    a, b = completion(), completion()
    st.begin_batch()
    j.on_completion(a, now=T0)
    with pytest.raises(RuntimeError):
        with st.transaction():
            st.bump("x")
            raise RuntimeError("boom")
    st.begin_batch()
    j.on_completion(b, now=T0)
    assert st.get(str(a.completion_id)) is not None and "x" not in st.counters()
    st.flush()
    st.begin_batch()
    j.on_feedback(vote(a.completion_id, "u1", 1), now=T0)
    st.db.close()  # killed: no flush
    st2 = StateStore(path)
    assert st2.open_count() == 2 and st2.counters().get("feedback_folded") is None
    assert st2.get(str(a.completion_id)).votes == {}


_HOLDER = """
import sys, time
from ingest.join import Joiner, JoinConfig
from ingest.state import StateStore
j = Joiner(StateStore(sys.argv[1], owner="worker-a"), JoinConfig(seal_after_s=10, max_label_age_s=100, orphan_ttl_s=20))
res = j.tick(int(sys.argv[2]), shard_for=lambda s: sys.argv[3])
print(len(res.samples), flush=True)
time.sleep(600)  # 'writing the shard' until killed
"""


def test_recover_leaves_a_live_workers_claims(tmp_path):
    """Worker B starting next to live worker A (a real process holding claims) must not
    release A's claims; once A is SIGKILLed, B finishes them (shard absent: sealed again)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "state.sqlite"
    jb = Joiner(StateStore(path, owner="worker-b"), CFG)
    c = completion()
    jb.on_completion(c, now=T0)
    jb.on_feedback(vote(c.completion_id, "u1", 1), now=T0)
    shard = tmp_path / "a.parquet"
    a = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path), str(T0 + 10_000), str(shard)],
                         cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, text=True)
    try:
        assert a.stdout.readline().strip() == "1"  # A claimed the label
        assert jb.store.claims()[0][2] == "worker-a"
        assert jb.recover(os.path.exists) == {"sealed": 0, "released": 0, "live": 1}
        assert jb.tick(T0 + 20_000).samples == []  # still A's: B does not seal it too
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait(10)
    assert jb.recover(os.path.exists) == {"sealed": 0, "released": 1, "live": 0}
    (s,) = jb.tick(T0 + 20_000).samples
    assert s.completion_id == c.completion_id
    owners = Path(str(path) + ".owners")
    assert not (owners / "worker-a.lock").exists()  # dead owner collected
    assert [f.name for f in owners.iterdir()] == ["worker-b.lock"]


def test_prune_bounded_retention():
    """Dedupe/sealed rows are forgotten after dedupe_retention_s; replays older than the
    horizon are expired (counted, never folded), so a pruned label is never sealed twice; an
    expired vote is dead-lettered (field created_at), so no accepted vote vanishes."""
    cfg = JoinConfig(seal_after_s=10, max_label_age_s=100, orphan_ttl_s=20, dedupe_retention_s=1000)
    j = Joiner(StateStore(), cfg)
    c = completion(created_at=T0)
    v = vote(c.completion_id, "u1", 1, created_at=T0)
    j.on_completion(c, now=T0)
    j.on_feedback(v, now=T0)
    res = j.tick(T0 + 10_000)
    j.commit_sealed(res.samples, "")
    assert j.store.dedupe_sizes() == (1, 1)
    assert j.prune(T0 + 10_000 + 999_999) == (0, 0)  # horizon not reached (sealed at T0+10 s)
    assert j.on_feedback(v, now=T0 + 500_000)[0] == "duplicate"
    assert j.prune(T0 + 10_001 + 1_000_000) == (1, 1)
    assert j.store.dedupe_sizes() == (0, 0)
    later = T0 + 2_000_000
    assert j.on_completion(c, now=later) == "expired"  # a replay of the pruned completion
    outcome, dl = j.on_feedback(v, now=later)
    assert outcome == "expired" and dl.field == "created_at" and "expired" in dl.reason
    assert j.tick(later + 100_000).samples == [] and j.store.open_count() == 0
    cnt = j.store.counters()
    assert (cnt["completions_expired"], cnt["feedback_expired"], cnt["pruned_events"]) == (1, 1, 1)
    # fresh traffic inside the horizon still joins and dedupes
    c2 = completion(created_at=later)
    v2 = vote(c2.completion_id, "u1", -1, created_at=later)
    j.on_completion(c2, now=later)
    assert j.on_feedback(v2, now=later)[0] == "folded" and j.on_feedback(v2, now=later)[0] == "duplicate"
    with pytest.raises(ValueError, match="dedupe_retention_s"):
        JoinConfig(max_label_age_s=100, orphan_ttl_s=20, dedupe_retention_s=120)


def test_old_layout_migrates_and_legacy_claims_recover(tmp_path):
    """A state file written before claim owners/retention existed opens (columns added);
    its ownerless claims count as a dead worker's and are released; its events are kept."""
    import sqlite3

    path = tmp_path / "old.sqlite"
    c = completion()
    st = Joiner(StateStore(":memory:"), CFG)
    st.on_completion(c, now=T0)
    st.on_feedback(vote(c.completion_id, "u1", 1), now=T0)
    row = (st.store.db.execute("SELECT state FROM labels").fetchone()[0], c.model_dump_json())
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE labels(completion_id TEXT PRIMARY KEY, state TEXT NOT NULL, completion TEXT, "
        "due_at INTEGER NOT NULL, claim TEXT); CREATE TABLE events(event_id TEXT PRIMARY KEY, completion_id TEXT);"
        "CREATE TABLE sealed(completion_id TEXT PRIMARY KEY, sealed_at INTEGER NOT NULL, shard TEXT);"
        "CREATE TABLE counters(name TEXT PRIMARY KEY, value INTEGER NOT NULL);")
    old.execute("INSERT INTO labels VALUES(?,?,?,?,?)", (str(c.completion_id), row[0], row[1], T0, "shard:/nope"))
    old.execute("INSERT INTO events VALUES('e-old', ?)", (str(c.completion_id),))
    old.commit()
    old.close()
    j = Joiner(StateStore(path), CFG)
    assert j.store.claims() == [(str(c.completion_id), "shard:/nope", None)]
    assert j.recover(lambda p: False) == {"sealed": 0, "released": 1, "live": 0}
    (s,) = j.tick(T0 + 10_000).samples
    assert s.completion_id == c.completion_id
    assert j.prune(T0 + 10**12) == (0, 0) and j.store.event_seen("e-old")  # no `at`: kept


def test_batch_fold_matches_reference_join_and_one_by_one(tmp_path):
    """Folding consumer batches (one transaction each, ``on_completions``/``on_feedbacks``)
    gives the samples of the independent reference join and the same state, counters and
    dedupe set as folding the same events one at a time."""
    import random

    from test_ingest_e2e import make_traffic, reference_join

    comps, fb = make_traffic(40, seed=11)
    fb += [fb[0], fb[3]]  # duplicates inside one batch too
    events = [("c", c) for c in comps] + [("f", e) for e in fb]
    random.Random(5).shuffle(events)  # votes may arrive before their completion (orphans that join)
    one = Joiner(StateStore(tmp_path / "one.sqlite"), CFG)
    many = Joiner(StateStore(tmp_path / "many.sqlite"), CFG)
    for kind, ev in events:
        (one.on_completion if kind == "c" else one.on_feedback)(ev, ev.to_bytes(), now=T0)
    rng = random.Random(6)
    i = 0
    while i < len(events):
        chunk = events[i:i + rng.randint(1, 60)]
        i += len(chunk)
        with many.store.transaction():  # completions first, as the worker folds a batch
            many.on_completions([(e, e.to_bytes()) for k, e in chunk if k == "c"], now=T0)
            many.on_feedbacks([(e, e.to_bytes()) for k, e in chunk if k == "f"], now=T0)

    def snapshot(j):
        db = j.store.db
        labels = {cid: (json.loads(st)["votes"], sorted(json.loads(st)["event_ids"]))
                  for cid, st in db.execute("SELECT completion_id, state FROM labels")}
        return labels, {r[0] for r in db.execute("SELECT event_id FROM events")}, j.store.counters()

    assert snapshot(one) == snapshot(many)
    expected = reference_join(comps, fb)
    got = {str(s.completion_id): (s.votes_up, s.votes_down, set(s.event_ids)) for s in many.tick(T0 + 10_000).samples}
    assert got == expected
    assert many.store.counters()["feedback_duplicate"] == sum(1 for _ in fb) - len({e.event_id for e in fb})


def test_vote_for_a_label_being_sealed_is_late(j):
    """The seal thread claims a label, then a vote arrives before the shard is committed:
    the vote is late (dead letter), never folded into a state that is about to vanish."""
    c = completion()
    j.on_completion(c, now=T0)
    first = vote(c.completion_id, "u1", 1)
    j.on_feedback(first, now=T0)
    res = j.tick(T0 + 10_000, shard_for=lambda s: "/x/part.parquet")  # claimed, shard being written
    racing = vote(c.completion_id, "u2", -1)
    outcome, dl = j.on_feedback(racing, now=T0 + 10_001)
    assert outcome == "late" and dl.field == "completion_id" and dl.reason.startswith("late")
    j.commit_sealed(res.samples, "/x/part.parquet")
    (s,) = res.samples
    assert s.event_ids == [str(first.event_id)] and (s.votes_up, s.votes_down) == (1, 0)
    assert j.store.open_count() == 0


def test_orphan_commit_dead_keeps_what_arrived_meanwhile(j):
    """An orphan's votes are being dead-lettered (claimed) when its completion and a new vote
    arrive: commit_dead removes only the dead-lettered vote; the label then joins normally."""
    cid = uuid.uuid4()
    old = vote(cid, "u1", 1)
    j.on_feedback(old, now=T0)
    res = j.tick(T0 + 20_000)  # orphan_ttl_s=20: claimed "dead:"
    assert [d.reason.split(":")[0] for d in res.dead_letters] == ["orphan"]
    assert j.on_completion(completion(cid), now=T0 + 20_001) == "new"
    new = vote(cid, "u2", -1)
    assert j.on_feedback(new, now=T0 + 20_002)[0] == "folded"
    j.commit_dead(res, now=T0 + 20_003)
    assert j.on_feedback(old, now=T0 + 20_004)[0] == "duplicate"  # dead-lettered: recorded
    assert j.tick(T0 + 20_002 + 9_999).samples == []  # seal_after counts from the new vote
    (s,) = j.tick(T0 + 20_002 + 10_000).samples
    assert s.event_ids == [str(new.event_id)] and (s.votes_up, s.votes_down, s.label) == (0, 1, False)
    assert j.store.counters()["feedback_orphaned"] == 1


def test_null_record_value_is_a_dead_letter():
    dl = parse_event(CompletionEvent, None, topic_names().completions, b"k")
    assert isinstance(dl, DeadLetter) and dl.field == "value" and "null" in dl.reason


def test_body_segments_are_read_back_and_collected(tmp_path, monkeypatch):
    """Completion bodies live in per-worker segment files: a sealed sample carries the exact
    bytes folded; a rotated segment with no open label is deleted, a live peer's segment and
    the open segment are kept, a dead owner's unreferenced segment is deleted."""
    from ingest import state as state_mod

    monkeypatch.setattr(state_mod, "SEGMENT_BYTES", 1)  # rotate after every append
    path = tmp_path / "state.sqlite"
    j = Joiner(StateStore(path, owner="w1"), CFG)
    peer = StateStore(path, owner="w2")  # a live peer (holds its owner lock)
    cs = [completion() for _ in range(3)]
    for c in cs:
        j.on_completion(c, c.to_bytes(), now=T0)
        j.on_feedback(vote(c.completion_id, "u1", 1), now=T0)
    segs = sorted(f.name for f in j.store.bodies_dir.iterdir())
    assert segs == ["w1.1.seg", "w1.2.seg", "w1.3.seg"]
    (j.store.bodies_dir / "w2.1.seg").write_bytes(b"x")  # the live peer's
    (j.store.bodies_dir / "dead.1.seg").write_bytes(b"x")  # a killed worker's, unreferenced
    assert j.store.collect_segments() == 1  # only dead.1.seg: every w1 segment is referenced
    res = j.tick(T0 + 10_000)
    assert sorted(s.completion_id for s in res.samples) == sorted(c.completion_id for c in cs)
    by_id = {s.completion_id: s for s in res.samples}
    for c in cs:  # the bytes read back are the bytes folded
        assert by_id[c.completion_id].behavior_logprobs == c.behavior_logprobs
    j.commit_sealed(res.samples, "")
    assert j.store.collect_segments() == 2  # w1.1, w1.2 rotated and unreferenced; w1.3 is open
    assert sorted(f.name for f in j.store.bodies_dir.iterdir()) == ["w1.3.seg", "w2.1.seg"]
    peer.close()


def test_interim_inline_body_layout_migrates(tmp_path):
    """A state file whose completions table held the bodies inline (``body NOT NULL``, no
    segment columns) opens: its bodies are kept and sealed; new bodies go to segments."""
    import sqlite3

    path = tmp_path / "interim.sqlite"
    c = completion()
    mem = Joiner(StateStore(":memory:"), CFG)
    mem.on_completion(c, now=T0)
    mem.on_feedback(vote(c.completion_id, "u1", 1), now=T0)
    state = mem.store.db.execute("SELECT state FROM labels").fetchone()[0]
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE labels(completion_id TEXT PRIMARY KEY, state TEXT NOT NULL, due_at INTEGER NOT NULL, "
        "claim TEXT, owner TEXT); CREATE TABLE completions(completion_id TEXT PRIMARY KEY, body BLOB NOT NULL);")
    db.execute("INSERT INTO labels VALUES(?,?,?,NULL,NULL)", (str(c.completion_id), state, T0 + 10_000))
    db.execute("INSERT INTO completions VALUES(?,?)", (str(c.completion_id), c.to_bytes()))
    db.commit()
    db.close()
    j = Joiner(StateStore(path), CFG)
    c2 = completion()
    j.on_completion(c2, c2.to_bytes(), now=T0)
    j.on_feedback(vote(c2.completion_id, "u1", -1), now=T0)
    got = {s.completion_id: s for s in j.tick(T0 + 10_000).samples}
    assert set(got) == {c.completion_id, c2.completion_id}
    assert got[c.completion_id].behavior_logprobs == c.behavior_logprobs and got[c2.completion_id].label is False
    assert [f.name for f in j.store.bodies_dir.iterdir()] == [f"{j.store.owner}.1.seg"]


def test_sealed_sample_is_the_constructed_sample_and_its_topic_value_is_to_bytes(j):
    """Sealing's cheap paths (issue 24) give what the plain ones gave: the sample equals
    ``RewardedSample.model_construct`` of the same values with every field set, it round-trips
    through the contract, and the samples-topic values of ``shard_parts`` are ``to_bytes``."""
    import numpy as np

    from samplestore import shards as writer
    from schemas.events import ExpertRoutes, RewardedSample

    c = completion().model_copy(update={"split": "eval", "expert_routes": ExpertRoutes.from_array(
        np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2))})
    j.on_completion(c, now=T0)
    vs = [vote(c.completion_id, "u1", 1), vote(c.completion_id, "u2", -1), vote(c.completion_id, "u1", -1, T0 + 5)]
    for i, v in enumerate(vs):
        j.on_feedback(v, now=T0 + i)
    samples = j.tick(T0 + 2 + 10_000).samples
    (s,) = samples
    assert s == RewardedSample.model_construct(**s.__dict__)
    assert s.model_fields_set == set(RewardedSample.model_fields)
    assert (s.votes_up, s.votes_down, s.split, s.event_ids) == (0, 2, "eval", [str(v.event_id) for v in vs])
    assert RewardedSample.model_validate_json(s.to_bytes()) == s
    good, table, values, bad = writer.shard_parts(samples)
    assert (good, bad, values) == (samples, [], [s.to_bytes()]) and table.num_rows == 1


# --------------------------------------------------------------------------- every kind
# A policy with every kind weighted, thumbs not overriding and a wide clip, so each component
# shows in the reward; values worked out by hand in each test.
WIDE = RewardPolicy(scores={"helpfulness": ScoreSpec(min=1, max=5, weight=0.5)}, thumb_overrides=False, clip=10)
WORDS = ["alpha", "beta", "gamma", "delta"]


def decode(ids):
    return " ".join(WORDS[i] for i in ids)


def joiner(policy=WIDE, decoder=decode, **kw) -> Joiner:
    cfg = dict(seal_after_s=10, max_label_age_s=100, orphan_ttl_s=20) | kw
    return Joiner(StateStore(":memory:"), JoinConfig(reward=policy, **cfg), decode=decoder)


def test_every_kind_is_a_component_of_the_reward():
    j = joiner()
    c = completion()
    j.on_completion(c, now=T0)
    cid = c.completion_id
    evs = [vote(cid, "u1", 1, kind="copy"), vote(cid, "u2", 1, kind="copy"),
           vote(cid, "u3", 1, kind="regenerate"),
           vote(cid, "u1", 0.75, kind="edit"), vote(cid, "u2", 0.25, kind="edit"),
           vote(cid, "u1", 1, kind="followup"), vote(cid, "u2", -1, kind="followup"),
           vote(cid, "u3", 1, kind="followup"),
           vote(cid, "u1", 4, kind="score", name="helpfulness"),
           vote(cid, "u2", 2, kind="score", name="helpfulness", created_at=T0),
           vote(cid, "u2", 5, kind="score", name="helpfulness", created_at=T0 + 1),  # u2's last score
           vote(cid, "u1", 1, kind="copy", created_at=T0 + 2)]  # u1 copied twice: one user
    assert [j.on_feedback(e, now=T0 + i)[0] for i, e in enumerate(evs)] == ["folded"] * len(evs)
    (s,) = j.tick(T0 + len(evs) + 10_000).samples
    assert (s.thumb, s.copied, s.regenerated, s.votes_up, s.votes_down) == (None, 2, 1, 0, 0)
    assert s.kept_share == pytest.approx(0.5) and s.followup == pytest.approx(1 / 3)
    assert s.scores == {"helpfulness": pytest.approx(4.5)}
    # by hand: copy +0.5, regenerate -0.5, edit 0.5 * (2 * 0.5 - 1) = 0, followup 0.5 / 3,
    # helpfulness 0.5 * (2 * (4.5 - 1) / 4 - 1) = 0.375
    assert s.reward == pytest.approx(0.5 - 0.5 + 0 + 0.5 / 3 + 0.375) and s.label is True
    assert s.n_votes == 2 + 1 + 2 + 3 + 2  # each user's last signal of each kind
    assert sorted(s.event_ids) == sorted(str(e.event_id) for e in evs)
    assert s.reward_policy == WIDE.digest()


def test_thumb_overrides_the_implicit_kinds():
    j = joiner(policy=WIDE.model_copy(update={"thumb_overrides": True}))
    c = completion()
    j.on_completion(c, now=T0)
    cid = c.completion_id
    for i, e in enumerate([vote(cid, "u1", 1, kind="copy"), vote(cid, "u2", 1, kind="followup"),
                           vote(cid, "u3", 5, kind="score", name="helpfulness"), vote(cid, "u4", -1)]):
        j.on_feedback(e, now=T0 + i)
    (s,) = j.tick(T0 + 3 + 10_000).samples
    # copy and followup are recorded but left out: thumb -1 + helpfulness 0.5 * 1
    assert (s.thumb, s.copied, s.followup, s.scores) == (-1.0, 1, 1.0, {"helpfulness": 5.0})
    assert s.reward == pytest.approx(-0.5) and s.label is False and (s.votes_up, s.votes_down, s.n_votes) == (0, 1, 4)


def test_edit_final_text_kept_share_against_the_decoded_completion():
    j = joiner()
    c = completion().model_copy(update={"completion_token_ids": [0, 1, 0, 2],
                                        "behavior_logprobs": [-0.1] * 4})  # "alpha beta alpha gamma"
    j.on_completion(c, now=T0)
    e = vote(c.completion_id, "u1", None, kind="edit", final_text="alpha  beta\ngamma extra")
    assert j.on_feedback(e, e.to_bytes(), now=T0)[0] == "folded"
    (s,) = j.tick(T0 + 10_000).samples
    # kept: alpha min(2, 1) + beta 1 + gamma 1 = 3 of 4 words; component 2 * 0.75 - 1 = 0.5
    assert s.kept_share == pytest.approx(0.75) and s.reward == pytest.approx(0.5 * 0.5) and s.n_votes == 1


def test_kept_share_measure_by_hand():
    assert kept_share("a b c d", "a b c d") == 1.0
    assert kept_share("a b c d", "d c b a") == 1.0  # order is not measured
    assert kept_share("a a a b", "a x") == 0.25
    assert kept_share("a b", "") == 0.0
    assert kept_share("", "") == 1.0 and kept_share(" \n", "x") == 0.0


def test_edit_final_text_without_a_tokenizer_is_dead_lettered():
    j = joiner(decoder=None)
    c = completion()
    j.on_completion(c, now=T0)
    out, dl = j.on_feedback(vote(c.completion_id, "u1", None, kind="edit", final_text="x"), now=T0)
    assert out == "unsupported" and dl.field == "final_text" and "tokenizer" in dl.reason
    assert j.on_feedback(vote(c.completion_id, "u1", 0.5, kind="edit"), now=T0)[0] == "folded"


@pytest.mark.parametrize("name,value,field,reason", [
    ("tone", 3, "name", "score 'tone' is not declared in the reward policy ([reward.scores]; declared: helpfulness)"),
    ("helpfulness", 6, "value", "score 'helpfulness': 6 is outside its declared range [1, 5] in the reward policy"),
    ("helpfulness", 0.5, "value", "score 'helpfulness': 0.5 is outside its declared range [1, 5] in the reward policy"),
])
def test_score_not_declared_or_out_of_range_is_dead_lettered(name, value, field, reason):
    j = joiner()
    c = completion()
    j.on_completion(c, now=T0)
    out, dl = j.on_feedback(vote(c.completion_id, "u1", value, kind="score", name=name), now=T0)
    assert (out, dl.field, dl.reason) == ("unsupported", field, reason)


def test_score_of_weight_0_is_dead_lettered():
    j = joiner(policy=RewardPolicy(scores={"tone": ScoreSpec(min=0, max=1, weight=0)}))
    c = completion()
    j.on_completion(c, now=T0)
    out, dl = j.on_feedback(vote(c.completion_id, "u1", 1, kind="score", name="tone"), now=T0)
    assert (out, dl.field, dl.reason) == ("unsupported", "name", "score 'tone': weight 0 in the reward policy")


def test_label_waits_for_the_slowest_weighted_horizon():
    j = joiner(policy=RewardPolicy(edit_horizon_s=50, copy_horizon_s=30, followup_weight=0, followup_horizon_s=90))
    c = completion()
    j.on_completion(c, now=T0)
    j.on_feedback(vote(c.completion_id, "u1", 1), now=T0 + 1)
    # quiet since T0 + 1 for seal_after_s = 10 s, but edits may arrive until T0 + 50 s (followup: weight 0)
    assert j.tick(T0 + 49_999).samples == []
    (s,) = j.tick(T0 + 50_000).samples
    # a signal after the horizon but within seal_after_s of it still counts
    j2 = joiner(policy=RewardPolicy(edit_horizon_s=50))
    j2.on_completion(c, now=T0)
    j2.on_feedback(vote(c.completion_id, "u1", 1, kind="copy"), now=T0 + 45_000)
    assert j2.tick(T0 + 54_999).samples == []
    (s2,) = j2.tick(T0 + 55_000).samples
    assert s2.copied == 1 and s2.reward == 0.5
    # never later than max_label_age_s
    j3 = joiner(policy=RewardPolicy(edit_horizon_s=100), max_label_age_s=100)
    j3.on_completion(c, now=T0)
    for t in range(0, 100_001, 5_000):
        j3.on_feedback(vote(c.completion_id, "u1", 1, kind="copy"), now=T0 + t)
    assert j3.tick(T0 + 99_999).samples == [] and len(j3.tick(T0 + 100_000).samples) == 1


def test_horizon_above_max_label_age_is_refused():
    with pytest.raises(ValueError, match=r"reward\.edit_horizon_s: 200 s is above max_label_age_s = 100 s"):
        JoinConfig(max_label_age_s=100, reward=RewardPolicy(edit_horizon_s=200))
    with pytest.raises(ValueError, match=r"reward\.scores\.tone\.horizon_s: 4000 s"):
        JoinConfig(reward=RewardPolicy(scores={"tone": ScoreSpec(min=0, max=1, horizon_s=4000)}))
    JoinConfig(max_label_age_s=100, reward=RewardPolicy(edit_horizon_s=200, edit_weight=0))  # not weighted: fine


@pytest.mark.parametrize("kind,value,name", [("copy", 1, None), ("regenerate", 1, None), ("edit", 0.5, None),
                                             ("followup", -1, None), ("score", 3, "helpfulness")])
def test_signal_after_sealing_is_late(kind, value, name):
    j = joiner()
    c = completion()
    j.on_completion(c, now=T0)
    j.on_feedback(vote(c.completion_id, "u1", 1), now=T0)
    res = j.tick(T0 + 10_000)
    j.commit_sealed(res.samples, "")
    e = vote(c.completion_id, "u2", value, kind=kind, name=name)
    out, dl = j.on_feedback(e, now=T0 + 11_000)
    assert out == "late" and dl.field == "completion_id" and dl.reason.startswith("late")
    assert j.on_feedback(e, now=T0 + 11_001)[0] == "late"  # not recorded until mark_dead
    j.mark_dead([str(e.event_id)])
    assert j.on_feedback(e, now=T0 + 11_002)[0] == "duplicate"


def test_signals_survive_reopen(tmp_path):
    """Every kind's last signals (an edit's final text too) are in the stored state."""
    path = tmp_path / "state.sqlite"
    j = Joiner(StateStore(path), JoinConfig(seal_after_s=10, max_label_age_s=100, orphan_ttl_s=20, reward=WIDE),
               decode=decode)
    c = completion().model_copy(update={"completion_token_ids": [0, 1], "behavior_logprobs": [-0.1] * 2})
    evs = [vote(c.completion_id, "u1", None, kind="edit", final_text="alpha"),
           vote(c.completion_id, "u2", 1, kind="regenerate"), vote(c.completion_id, "u2", 2, kind="score",
                                                                   name="helpfulness")]
    for e in evs:  # orphans first: the state holds them without the completion
        j.on_feedback(e, e.to_bytes(), now=T0)
    j.on_completion(c, now=T0)
    j.store.close()
    j2 = Joiner(StateStore(path), JoinConfig(seal_after_s=10, max_label_age_s=100, orphan_ttl_s=20, reward=WIDE),
                decode=decode)
    (s,) = j2.tick(T0 + 10_000).samples
    # edit: "alpha" of "alpha beta" = 0.5 -> 0; regenerate -0.5; helpfulness 0.5 * (2 * 1 / 4 - 1) = -0.25
    assert (s.kept_share, s.regenerated, s.scores) == (0.5, 1, {"helpfulness": 2.0})
    assert s.reward == pytest.approx(-0.75) and s.label is False and s.n_votes == 3


def test_an_undecodable_completion_leaves_its_final_text_edits_out_and_seals_every_label():
    """A ``decode`` that raises (or returns no text) on one completion: its final-text edits are
    left out of its reward (counted in ``edit_undecodable``), its other signals still label it,
    and the other labels of the same tick seal as usual."""
    def picky(ids):
        if 3 in ids:
            raise RuntimeError("cannot decode")
        return None if 2 in ids else decode(ids)

    j = joiner(decoder=picky)
    bad, none, good = (completion().model_copy(update={"completion_token_ids": ids, "behavior_logprobs": [-0.1] * 2})
                       for ids in ([0, 3], [0, 2], [0, 1]))
    for c in (bad, none, good):
        j.on_completion(c, now=T0)
    for c in (bad, none, good):
        assert j.on_feedback(vote(c.completion_id, "u1", None, kind="edit", final_text="alpha"), now=T0)[0] == "folded"
    assert j.on_feedback(vote(good.completion_id, "u2", None, kind="edit", final_text="alpha beta"), now=T0)[0] == "folded"
    j.on_feedback(vote(bad.completion_id, "u2", 1, kind="copy"), now=T0)
    j.on_feedback(vote(bad.completion_id, "u3", None, kind="edit", final_text="beta"), now=T0)
    res = j.tick(T0 + 10_000)
    by = {s.completion_id: s for s in res.samples}
    assert set(by) == {bad.completion_id, none.completion_id, good.completion_id}
    # bad: both edits left out, the copy counts (+0.5 under WIDE); none: nothing left, reward 0
    assert (by[bad.completion_id].kept_share, by[bad.completion_id].copied, by[bad.completion_id].reward) == (None, 1, 0.5)
    assert (by[none.completion_id].kept_share, by[none.completion_id].reward) == (None, 0.0)
    # good: "alpha" of "alpha beta" = 0.5 and "alpha beta" = 1.0: mean 0.75 -> 0.5 * (2 * 0.75 - 1) = 0.25
    assert by[good.completion_id].kept_share == pytest.approx(0.75)
    assert by[good.completion_id].reward == pytest.approx(0.25)
    assert j.store.counters()["edit_undecodable"] == 3
