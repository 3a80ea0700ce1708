"""Completions are validated once: their head at consume time, the whole body at sealing.

``ingest.join.parse_completion`` checks only what the join needs (schema_version,
completion_id, created_at, model_version) when the value has serving's layout; the full
CompletionEvent contract is checked by ``Joiner.tick`` before a sample is built (or an
unlabelled completion is dropped). A body that fails it is dead-lettered with the field and
reason, and so is every vote folded into it: each accepted event ends in exactly one sample or
dead letter. The reference for "valid" is ``CompletionEvent.model_validate_json`` itself.
"""

from __future__ import annotations

import json
import random
import uuid

import pytest

from ingest.join import CompletionHead, JoinConfig, Joiner, parse_completion, parse_event
from ingest.state import StateStore
from schemas.settings import topic_names
from schemas.events import CompletionEvent, DeadLetter, ExpertRoutes, FeedbackEvent, SamplingParams

T0 = 1_700_000_000_000  # ms
CFG = JoinConfig(seal_after_s=10, max_label_age_s=100, orphan_ttl_s=20)


def completion(cid=None, version="v0001", routes=True) -> CompletionEvent:
    import numpy as np

    r = ExpertRoutes.from_array(np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2) % 8) if routes else None
    return CompletionEvent(
        completion_id=cid or uuid.uuid4(), request_id="r", created_at=T0, model_version=version,
        pod="p0", user_hash="author", prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5],
        behavior_logprobs=[-0.5, -1.25], sampling=SamplingParams(), expert_routes=r, finish_reason="stop",
        ttft_ms=1.0, latency_ms=2.0)


def vote(cid, user, value) -> FeedbackEvent:
    return FeedbackEvent(event_id=uuid.uuid4(), completion_id=cid, user_hash=user, value=value, created_at=T0)


def raw_with(c: CompletionEvent, **changes) -> bytes:
    """``c``'s JSON in serving's field order with some fields replaced (not validated)."""
    d = json.loads(c.to_bytes())
    d.update(changes)
    return json.dumps(d, separators=(",", ":")).encode()


@pytest.fixture()
def j():
    return Joiner(StateStore(":memory:"), CFG)


def test_head_of_a_valid_completion_is_what_full_validation_gives():
    c = completion()
    head = parse_completion(c.to_bytes())
    assert isinstance(head, CompletionHead)
    assert (head.completion_id, head.created_at, head.model_version) == (c.completion_id, T0, "v0001")


@pytest.mark.parametrize("changes,field", [
    ({"completion_id": "nope"}, "completion_id"),
    ({"created_at": -1}, "created_at"),
    ({"model_version": ""}, "model_version"),
    ({"schema_version": 2}, "schema_version"),
])
def test_bad_head_is_dead_lettered_at_consume(changes, field):
    dl = parse_completion(raw_with(completion(), **changes), topic_names().completions, b"k")
    assert isinstance(dl, DeadLetter) and dl.field == field and dl.key == "k"
    assert dl.source_topic == topic_names().completions


def test_other_layouts_are_validated_in_full_at_consume():
    """No fast path without serving's layout: the whole value is validated, as before."""
    c = completion()
    sorted_ok = json.dumps(json.loads(c.to_bytes()), sort_keys=True).encode()  # spaces: no fast path
    assert isinstance(parse_completion(sorted_ok), CompletionEvent)
    bad = json.loads(c.to_bytes())
    bad["behavior_logprobs"] = [-0.5]
    dl = parse_completion(json.dumps(bad, sort_keys=True).encode(), topic_names().completions, b"k")
    assert isinstance(dl, DeadLetter) and dl.field == "value" and "behavior_logprobs" in dl.reason
    assert isinstance(parse_completion(b"{oops"), DeadLetter)
    assert isinstance(parse_completion(None), DeadLetter)


BODY_DEFECTS = [  # (changes, field named by the dead letter, text in the reason)
    ({"behavior_logprobs": [-0.5]}, "value", "behavior_logprobs: 1 values for 2 completion tokens"),
    ({"prompt_token_ids": [1, "x", 3]}, "prompt_token_ids.1", "integer"),
    ({"prompt_token_ids": []}, "prompt_token_ids", "at least 1"),
    ({"completion_token_ids": [4, 5.5]}, "completion_token_ids.1", "integer"),
    ({"sampling": {"temperature": 9}}, "sampling.temperature", "less than or equal to 2"),
    ({"finish_reason": "eos"}, "finish_reason", "'stop'"),
    ({"extra": 1}, "extra", "Extra inputs"),
    ({"expert_routes": {"shape": [3, 2, 2], "data": "AA=="}}, "value", "expert_routes: 3 token rows"),
]


@pytest.mark.parametrize("changes,field,needle", BODY_DEFECTS)
def test_malformed_body_is_dead_lettered_with_its_votes_at_sealing(j, changes, field, needle):
    c = completion()
    raw = raw_with(c, **changes)
    with pytest.raises(Exception):
        CompletionEvent.model_validate_json(raw)  # the reference: really invalid
    head = parse_completion(raw, topic_names().completions, str(c.completion_id).encode())
    assert isinstance(head, CompletionHead)  # consume time: the head is fine
    assert j.on_completion(head, raw, now=T0) == "new"
    votes = [vote(c.completion_id, "u1", 1), vote(c.completion_id, "u2", -1)]
    for v in votes:
        assert j.on_feedback(v, now=T0)[0] == "folded"
    res = j.tick(T0 + 10_000)
    assert res.samples == [] and res.bad_ids == [str(c.completion_id)]
    first, *rest = res.dead_letters
    assert (first.source_topic, first.field, first.key) == (topic_names().completions, field, str(c.completion_id))
    assert needle in first.reason, first.reason
    assert first.payload == raw.decode()
    assert sorted(json.loads(d.payload)["event_id"] for d in rest) == sorted(str(v.event_id) for v in votes)
    assert all(d.field == "completion_id" and d.reason.startswith("malformed completion:") and field in d.reason
               for d in rest)
    assert j.tick(T0 + 20_000).dead_letters == []  # claimed "bad:": decided once
    late = vote(c.completion_id, "u3", 1)
    out, dl = j.on_feedback(late, now=T0 + 10_001)  # its label is decided: late, like after a seal
    assert out == "late" and dl is not None
    j.commit_dead(res, now=T0 + 10_002)
    assert j.store.open_count() == 0
    assert j.on_completion(head, raw, now=T0 + 10_003) == "sealed"  # a replay folds nothing
    assert [j.on_feedback(v, now=T0 + 10_004)[0] for v in votes] == ["duplicate", "duplicate"]
    cnt = j.store.counters()
    assert (cnt["deadletter_malformed_completion"], cnt["feedback_completion_malformed"]) == (1, 2)


def test_unlabelled_malformed_body_is_dead_lettered_not_dropped(j):
    c = completion()
    raw = raw_with(c, behavior_logprobs=[-0.5])
    j.on_completion(parse_completion(raw), raw, now=T0)
    res = j.tick(T0 + 100_000)  # max_label_age_s: would be dropped if it were valid
    assert res.dropped == [] and res.bad_ids == [str(c.completion_id)]
    assert [d.source_topic for d in res.dead_letters] == [topic_names().completions]
    ok = completion()
    j.on_completion(parse_completion(ok.to_bytes()), ok.to_bytes(), now=T0)
    assert j.tick(T0 + 100_000).dropped == [str(ok.completion_id)]


def test_duplicated_key_after_the_head_is_dead_lettered(j):
    """The head is read from the first bytes; a later duplicate key (JSON: the last wins)
    must not seal a sample under other values than the join used."""
    c, other = completion(), uuid.uuid4()
    raw = c.to_bytes()[:-1] + f',"completion_id":"{other}"}}'.encode()
    head = parse_completion(raw)
    assert head.completion_id == c.completion_id
    assert CompletionEvent.model_validate_json(raw).completion_id == other
    j.on_completion(head, raw, now=T0)
    j.on_feedback(vote(c.completion_id, "u1", 1), now=T0)
    res = j.tick(T0 + 10_000)
    assert res.samples == [] and res.dead_letters[0].field == "completion_id"
    assert "duplicate key" in res.dead_letters[0].reason


def test_valid_bodies_seal_exactly_as_the_full_validation_reads_them(j):
    """Random valid completions, through head + seal: the samples carry the fully validated
    event's values (reference: ``CompletionEvent.model_validate_json`` of the same bytes)."""
    rng = random.Random(7)
    raws = []
    for _ in range(20):
        p, n = rng.randint(1, 30), rng.randint(0, 30)
        import numpy as np

        routes = ExpertRoutes.from_array(np.array([[[rng.randrange(8)] * 2] * 3] * (p + n - 1), dtype=np.uint8))
        c = CompletionEvent(
            completion_id=uuid.uuid4(), request_id="r", created_at=T0 + rng.randint(0, 5), model_version="v1",
            pod="p", user_hash="u", prompt_token_ids=[rng.randrange(50_000) for _ in range(p)],
            completion_token_ids=[rng.randrange(50_000) for _ in range(n)],
            behavior_logprobs=[-rng.random() * 5 for _ in range(n)], sampling=SamplingParams(temperature=0.3),
            expert_routes=routes if p + n > 1 else None, finish_reason="length", ttft_ms=0, latency_ms=1)
        raws.append(c.to_bytes())
        head = parse_completion(raws[-1])
        assert isinstance(head, CompletionHead)
        j.on_completion(head, raws[-1], now=T0)
        j.on_feedback(vote(c.completion_id, "u1", 1), now=T0)
    got = {s.completion_id: s for s in j.tick(T0 + 10_000).samples}
    assert len(got) == 20
    for raw in raws:
        ref = CompletionEvent.model_validate_json(raw)
        s = got[ref.completion_id]
        assert (s.prompt_token_ids, s.completion_token_ids, s.behavior_logprobs, s.created_at) == (
            ref.prompt_token_ids, ref.completion_token_ids, ref.behavior_logprobs, ref.created_at)
        assert s.expert_routes == ref.expert_routes and s.sampling == ref.sampling


def test_feedback_still_validated_in_full_at_consume():
    dl = parse_event(FeedbackEvent, b'{"event_id":"nope"}', topic_names().feedback, b"k")
    assert isinstance(dl, DeadLetter) and dl.field == "event_id"


def test_new_state_json_fast_path_is_the_general_encoding():
    """A new completion's LabelState is encoded by a template; it must be the same JSON as the
    general pydantic-core encoding and read back to the same state."""
    import pydantic_core

    from ingest.join import LabelState

    st = LabelState(completion_id=str(uuid.uuid4()), completion=b"{}", created_at=T0, first_seen_at=T0 + 5)
    general = pydantic_core.to_json({
        "completion_id": st.completion_id, "created_at": T0, "event_ids": [], "votes": {},
        "first_seen_at": T0 + 5, "first_vote_at": None, "last_vote_at": None, "seq": 0, "pending_raw": {}}).decode()
    assert st.to_json() == general
    back = LabelState.from_json(st.to_json(), completion=b"{}")
    assert back == st
