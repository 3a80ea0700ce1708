"""Hostile records and wrong units (issue 11, defects 1-3): each is reproduced first, in the
pure join (no Kafka); the worker-level fuzz run is ``tests/test_ingest_fuzz.py``."""

from __future__ import annotations

import json
import math
import uuid

import pytest

from ingest.join import JoinConfig, Joiner, parse_completion, parse_event
from ingest.state import StateStore
from schemas.settings import topic_names
from schemas.events import CompletionEvent, DeadLetter, FeedbackEvent, RewardedSample
from schemas.manifest import VersionManifest

T0 = 1_700_000_000_000  # ms
CFG = JoinConfig(seal_after_s=10, max_label_age_s=100, orphan_ttl_s=20)


def completion_obj(**kw) -> dict:
    d = dict(completion_id=str(uuid.uuid4()), request_id="r", created_at=T0, model_version="v000000",
             pod="p0", user_hash="a", prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5, 6],
             behavior_logprobs=[-0.5, -1.25, -0.3],
             sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": None},
             finish_reason="stop", ttft_ms=1.0, latency_ms=2.0)
    d.update(kw)
    return d


def vote_obj(cid: str, created_at: int = T0, value=1) -> dict:
    return dict(event_id=str(uuid.uuid4()), completion_id=cid, user_hash="u1", kind="thumb",
                value=value, created_at=created_at)


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"a":' * 100_000, b"[" * 100_000 + b"]" * 100_000,
                                 '{"x": "\ud800"}', b"\xff\xfe\x00garbage", b"", b"null", b"1e999999"])
def test_any_bytes_end_as_a_dead_letter_never_an_exception(raw):
    """Defect 1: 100,000 nested '[' raised RecursionError out of parse_event."""
    for model in (CompletionEvent, FeedbackEvent):
        dl = parse_event(model, raw, topic_names().completions, b"k")
        assert isinstance(dl, DeadLetter) and dl.field and dl.reason
    assert isinstance(parse_completion(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")),
                      DeadLetter)


def test_deep_nesting_is_named_as_bad_json():
    dl = parse_event(CompletionEvent, b"[" * 100_000, topic_names().completions)
    assert dl.field == "value" and ("recursion" in dl.reason.lower() or "bad JSON" in dl.reason)


def test_feedback_in_seconds_is_dead_lettered_naming_created_at():
    """Defect 2: created_at in seconds was counted 'expired' and vanished."""
    raw = json.dumps(vote_obj(str(uuid.uuid4()), created_at=1_700_000_000)).encode()
    dl = parse_event(FeedbackEvent, raw, topic_names().feedback)
    assert isinstance(dl, DeadLetter) and dl.field == "created_at" and "seconds" in dl.reason
    dl = parse_completion(json.dumps(completion_obj(created_at=1_700_000_000)).encode())
    assert isinstance(dl, DeadLetter) and dl.field == "created_at"


def test_expired_vote_in_ms_is_dead_lettered_not_dropped():
    """An old (but well-formed, ms) vote ends in a dead letter, so accepted = samples + dead letters."""
    j = Joiner(StateStore(":memory:"), CFG)
    now = T0 + (CFG.dedupe_retention_s + 1) * 1000
    ev = FeedbackEvent.model_validate(vote_obj(str(uuid.uuid4()), created_at=T0))
    outcome, dl = j.on_feedback(ev, now=now)
    assert outcome == "expired" and isinstance(dl, DeadLetter)
    assert dl.field == "created_at" and "expired" in dl.reason and dl.source_topic == topic_names().feedback
    j.mark_dead([str(ev.event_id)])
    assert j.on_feedback(ev, now=now)[0] == "duplicate"  # a replay is not dead-lettered twice


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logprobs_never_reach_a_sample(bad):
    """Defect 3: behavior_logprobs [NaN, Infinity, -0.3] were sealed into a sample."""
    obj = completion_obj(behavior_logprobs=[bad, -0.2, -0.3])
    raw = json.dumps(obj, separators=(",", ":")).encode()  # serving's layout; NaN / Infinity literals
    assert b"NaN" in raw or b"Infinity" in raw
    dl = parse_event(CompletionEvent, raw, topic_names().completions)
    assert isinstance(dl, DeadLetter) and dl.field == "behavior_logprobs.0" and "finite" in dl.reason
    # through the join: the head passes at consume time, the body is refused at sealing, with its vote
    j = Joiner(StateStore(":memory:"), CFG)
    head = parse_completion(raw)
    assert not isinstance(head, DeadLetter)
    j.on_completion(head, raw, now=T0)
    j.on_feedback(FeedbackEvent.model_validate(vote_obj(obj["completion_id"])), now=T0)
    res = j.tick(T0 + 10_001)
    assert res.samples == []
    body, vote = res.dead_letters  # the body, and the vote folded into it
    assert body.field == "behavior_logprobs.0" and body.source_topic == topic_names().completions
    assert vote.source_topic == topic_names().feedback and "behavior_logprobs.0" in vote.reason


@pytest.mark.parametrize("field,value", [("ttft_ms", float("inf")), ("latency_ms", float("nan"))])
def test_non_finite_timings_refused(field, value):
    dl = parse_event(CompletionEvent, json.dumps(completion_obj(**{field: value})).encode(), topic_names().completions)
    assert isinstance(dl, DeadLetter) and dl.field == field


def test_non_finite_refused_in_feedback_samples_and_manifests():
    dl = parse_event(FeedbackEvent, json.dumps(vote_obj(str(uuid.uuid4()), value=float("nan"))).encode(),
                     topic_names().feedback)
    assert isinstance(dl, DeadLetter) and dl.field == "value"
    s = completion_obj()
    for k in ("request_id", "pod", "ttft_ms", "latency_ms"):
        s.pop(k)
    s.update(reward=float("nan"), label=True, n_votes=1, votes_up=1, votes_down=0, event_ids=["e"],
             sealed_at=T0)
    with pytest.raises(ValueError, match="reward"):
        RewardedSample.model_validate(s)
    with pytest.raises(ValueError, match=r"metrics\.loss: non-finite"):
        VersionManifest(version="v000001", parent="v000000", created_at=T0, kind="delta", tensors={},
                        metrics={"loss": math.inf})


def test_duplicate_keys_are_refused_not_guessed():
    """JSON parsers disagree on which copy of a repeated key wins: refuse the record."""
    cid = str(uuid.uuid4())
    raw = ('{"event_id":"%s","completion_id":"%s","user_hash":"u","value":1,"value":-1,'
           '"created_at":%d}' % (uuid.uuid4(), cid, T0))
    dl = parse_event(FeedbackEvent, raw, topic_names().feedback)
    assert isinstance(dl, DeadLetter) and dl.field == "value" and "duplicate key" in dl.reason
    # the same text inside a string value is not a duplicate key
    ok = json.dumps({**vote_obj(cid), "comment": 'he wrote "value": 1 twice, "value": 2'})
    assert isinstance(parse_event(FeedbackEvent, ok, topic_names().feedback), FeedbackEvent)
    body = completion_obj()
    raw = json.dumps(body, separators=(",", ":"))[:-1] + ',"finish_reason":"length"}'
    assert isinstance(parse_event(CompletionEvent, raw, topic_names().completions), DeadLetter)


@pytest.mark.parametrize("value", ["true", "false", '"1"', '"-1"', "null"])
def test_a_vote_value_must_be_a_json_number(value):
    """A producer writing straight to Kafka cannot have `true` or "1" counted as an up-vote."""
    raw = ('{"event_id":"%s","completion_id":"%s","user_hash":"u","value":%s,"created_at":%d}'
           % (uuid.uuid4(), uuid.uuid4(), value, T0))
    dl = parse_event(FeedbackEvent, raw, topic_names().feedback)
    assert isinstance(dl, DeadLetter) and dl.field == "value", dl
    ok = raw.replace(f'"value":{value}', '"value":-1')
    assert parse_event(FeedbackEvent, ok, topic_names().feedback).value == -1.0
