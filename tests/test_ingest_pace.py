"""Issue 24's cheaper paths give the answers of the ones they replaced (D65): the routes'
base64 check without a regex refuses exactly what the contract's pattern refuses, and the
shard's list columns built through numpy hold the same values and refuse the same ones."""

from __future__ import annotations

import json
import random
import uuid
from typing import Annotated

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import Field, TypeAdapter, ValidationError

from schemas.settings import topic_names
from schemas.arrow import FORMAT_VERSION, samples_to_table, unwritable_column
from schemas.events import BASE64_PATTERN, ExpertRoutes, RewardedSample, SamplingParams

# the contract's rule as it was written: pydantic's own pattern check (its regex engine)
PATTERN = TypeAdapter(Annotated[str, Field(pattern=BASE64_PATTERN)])
NEW = TypeAdapter(ExpertRoutes)


def pattern_ok(v: str) -> bool:
    try:
        PATTERN.validate_python(v)
    except ValidationError:
        return False
    return True


def new_ok(v: str) -> bool:
    try:
        NEW.validate_python({"shape": [0, 0, 0], "data": v})
    except ValidationError as exc:
        assert [e["loc"] for e in exc.errors()] == [("data",)]
        return False
    return True


EDGES = ["", "=", "==", "===", "A", "A=", "A==", "A===", "AB=C", "AB==\n", "\nAB", "AB\n", "A B", "AB==A",
         "ab+/09==", "é", "AB\x00", "AB==\x00", "\u0660", "ＡＢ", "A-_", "A=B=", "====", "A\r\n"]


@pytest.mark.parametrize("v", EDGES)
def test_base64_check_refuses_what_the_pattern_refuses_edges(v):
    assert new_ok(v) == pattern_ok(v)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ABZaz09+/=\n\r -_é\x00\u0660")), max_size=12))
def test_base64_check_refuses_what_the_pattern_refuses(v):
    assert new_ok(v) == pattern_ok(v)


def sample(rng: random.Random, **kw) -> RewardedSample:
    P, C = rng.randint(1, 40), rng.randint(0, 40)
    d = dict(completion_id=uuid.uuid4(), model_version="v1", created_at=1_767_225_600_000, user_hash="u",
             prompt_token_ids=[rng.randrange(2**31) for _ in range(P)],
             completion_token_ids=[rng.randrange(2**31) for _ in range(C)],
             behavior_logprobs=[-rng.random() * 10 ** rng.randint(-3, 30) for _ in range(C)],
             sampling=SamplingParams(), finish_reason="stop", reward=1.0, label=True, n_votes=1, votes_up=1,
             votes_down=0, event_ids=[str(uuid.uuid4())], sealed_at=1_767_225_600_001)
    d.update(kw)
    return RewardedSample.model_construct(**d)


def test_list_columns_hold_the_values_pyarrow_makes_of_the_lists():
    rng = random.Random(7)
    samples = [sample(rng) for _ in range(60)]
    t = samples_to_table(samples)
    for name, typ in (("prompt_token_ids", pa.list_(pa.int32())), ("completion_token_ids", pa.list_(pa.int32())),
                      ("behavior_logprobs", pa.list_(pa.float32()))):
        want = pa.array([getattr(s, name) for s in samples], typ)  # Arrow's own conversion of the lists
        assert t.column(name).combine_chunks().equals(want), name


@pytest.mark.parametrize("name,bad", [("prompt_token_ids", [1, 2**31, 3]), ("completion_token_ids", [-2**31 - 1]),
                                      ("prompt_token_ids", [1, 2**70])])
def test_a_token_id_beyond_int32_is_refused_and_named(name, bad):
    rng = random.Random(1)
    s = sample(rng, **{name: bad, **({"behavior_logprobs": [-0.5]} if name == "completion_token_ids" else {})})
    with pytest.raises((OverflowError, pa.ArrowInvalid, ValueError, TypeError)):
        samples_to_table([sample(rng), s])
    assert unwritable_column(s)[0] == name


# -- duplicate keys: the quote count against the full check (D67) ---------------------------------

def _vote_obj(rng: random.Random) -> dict:
    d = {"schema_version": 1, "event_id": str(uuid.UUID(int=rng.getrandbits(128))),
         "completion_id": str(uuid.UUID(int=rng.getrandbits(128))), "user_hash": rng.choice(["u", ":x", 'q"t', "a b"]),
         "kind": "score", "value": rng.choice([0.5, 1, -3]), "created_at": 1_750_000_000_000 + rng.randrange(10**6),
         "name": "helpfulness"}
    if rng.random() < 0.5:
        d["metadata"] = {rng.choice(["k", ":k", "a\\b"]): rng.choice(["v", '"', ""]) for _ in range(rng.randrange(1, 4))}
    if rng.random() < 0.3:
        d["comment"] = rng.choice(['say "hi"', "x\\y", ":", "\u00e9t\u00e9"])
    return d


def _completion_obj(rng: random.Random) -> dict:
    n = rng.randrange(1, 4)
    return {"schema_version": 1, "completion_id": str(uuid.UUID(int=rng.getrandbits(128))), "request_id": "r\"1",
            "created_at": 1_750_000_000_000, "model_version": "v1", "pod": "p", "user_hash": "u",
            "prompt_token_ids": [1, 2], "completion_token_ids": list(range(n)), "behavior_logprobs": [-0.5] * n,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "seed": rng.choice([None, 3])},
            "expert_routes": rng.choice([None, {"shape": [n + 1, 1, 1], "data": "KLUv/SAEIQAAAQIDBA=="}]),
            "finish_reason": "stop", "ttft_ms": 1.0, "latency_ms": 2.0, "split": "train"}


def _encode(obj, rng: random.Random, dup: bool) -> str:
    """``obj`` as JSON text: random spacing, some numbers sent as text (pydantic's lax mode
    reads them), and with ``dup`` one key of one object written twice."""
    ws = lambda: rng.choice(["", "", " ", "\n "])  # noqa: E731
    targets = []

    def enc(v, path=()):
        if isinstance(v, dict):
            items = list(v.items())
            if items:
                targets.append(path)
            parts = [f"{ws()}{json.dumps(k)}{ws()}:{ws()}{enc(x, path + (k,))}" for k, x in items]
            if dup and path == chosen[0] and items:
                k, x = rng.choice(items)
                other = rng.choice([x, 7, "7", None, [1], {"z": 1}])
                parts.insert(rng.randrange(len(parts) + 1), f"{json.dumps(k)}:{json.dumps(other)}")
            return "{" + ",".join(parts) + ws() + "}"
        if isinstance(v, list):
            return "[" + ",".join(enc(x, path) for x in v) + "]"
        if isinstance(v, float) and rng.random() < 0.1:
            return json.dumps(str(v))  # a number as text
        return json.dumps(v, ensure_ascii=rng.random() < 0.5)

    chosen = [()]
    enc(obj)  # collect the objects' paths
    chosen[0] = rng.choice(targets)
    targets.clear()
    return enc(obj)


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 2**32), st.booleans(), st.sampled_from(["vote", "completion"]))
def test_the_quote_count_decides_as_the_full_duplicate_check(seed, dup, kind):
    """``_maybe_duplicate_key(raw, ev)`` (a quote count against the validated event) gives the
    reference ``duplicate_key`` answer on every text that validates: random spacing, quotes,
    colons and backslashes in values and keys, numbers sent as text, and a key of the top
    object or a nested one repeated with another value or the same."""
    from ingest.join import _maybe_duplicate_key, duplicate_key
    from schemas.events import CompletionEvent, FeedbackEvent

    from ingest.join import parse_event
    from schemas.events import DeadLetter

    rng = random.Random(seed)
    model = FeedbackEvent if kind == "vote" else CompletionEvent
    raw = _encode(_vote_obj(rng) if kind == "vote" else _completion_obj(rng), rng, dup).encode()
    want = duplicate_key(raw)
    if want is not None:  # whichever path decides, a repeated key is refused, never guessed
        got = parse_event(model, raw, "t", "k")
        assert isinstance(got, DeadLetter), raw
    try:
        ev = model.__pydantic_validator__.validate_json(raw)
    except ValidationError:
        return  # decided by parse_event's second path, checked above
    assert _maybe_duplicate_key(raw, ev) == want, raw


def test_a_repeated_key_after_an_empty_string_is_refused():
    """Found by the test above: the regex filter this count replaced read ``"",":k"`` as the key
    ``","`` and missed the second ``":k"``, so the record passed with a duplicate key."""
    from ingest.join import parse_event
    from schemas.events import DeadLetter, FeedbackEvent

    raw = (b'{"event_id":"00000000-0000-0000-0000-000000000001","completion_id":"00000000-0000-0000-0000-000000000002",'
           b'"user_hash":"u","value":1,"created_at":1750000000000,"metadata":{":k":"",":k":"x"}}')
    dl = parse_event(FeedbackEvent, raw, topic_names().feedback, "k")
    assert isinstance(dl, DeadLetter) and dl.field == ":k" and "duplicate key" in dl.reason


@settings(max_examples=2000, deadline=None)
@given(st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", max_size=40), st.integers(0, 2))
def test_pybase64_decodes_every_contract_valid_payload_as_binascii(body, pad):
    """Sealing decodes the routes with pybase64 (D67): on every string the contract lets
    through (the alphabet, then at most two ``=``) it returns binascii's bytes, or refuses
    where binascii refuses (excess padding is read the same lenient way)."""
    import binascii

    import pybase64

    s = body + "=" * pad
    try:
        want = binascii.a2b_base64(s)
    except binascii.Error:
        with pytest.raises(binascii.Error):
            pybase64.b64decode(s)
    else:
        assert pybase64.b64decode(s) == want


def test_the_notice_is_the_sample_notice_models_json():
    """The samples topic's notice, encoded without building the model, is byte for byte
    ``SampleNotice(...).to_bytes()`` of the same values, and validates."""
    from pathlib import Path

    from samplestore import shards as writer
    from schemas.events import SampleNotice

    s = RewardedSample.model_validate(dict(
        completion_id=str(uuid.UUID(int=7)), model_version="v000002", created_at=1_750_000_000_000, user_hash="u",
        prompt_token_ids=[1], completion_token_ids=[2], behavior_logprobs=[-0.25], sampling=SamplingParams(),
        finish_reason="stop", reward=1 / 3, label=True, n_votes=3, votes_up=2, votes_down=1,
        event_ids=["e1", "e2", "e3"], sealed_at=1_750_000_600_000, split="eval", reward_policy="0123456789abcdef",
        thumb=1 / 3, copied=1, regenerated=0, kept_share=None, followup=-1.0, scores={"helpfulness": 0.5}))
    path = writer.shard_path(Path("/data/s"), s.sealed_at, tag="abc")
    got = writer.notice_encoder(path, "/data/s")(s, 11)
    want = SampleNotice(**{k: getattr(s, k) for k in SampleNotice.model_fields if hasattr(s, k)},
                        shard="date=2025-06-15/hour=15/part-1750000600000-abc.parquet", row=11,
                        shard_format=FORMAT_VERSION)
    assert got == want.to_bytes() and SampleNotice.from_bytes(got) == want


@pytest.mark.parametrize("first", ["null", "1", "{}", "[]", '"\\ud800"'])
def test_a_repeated_key_whose_first_copy_is_invalid_is_refused(first):
    """Found by a new user: a repeated metadata key whose first copy the fast path refuses went
    to the second path, which read the last copy and accepted the record."""
    from ingest.join import parse_event
    from schemas.events import DeadLetter, FeedbackEvent

    raw = ('{"event_id":"00000000-0000-0000-0000-000000000001","completion_id":"00000000-0000-0000-0000-000000000002",'
           '"user_hash":"u","value":1,"created_at":1750000000000,"metadata":{"a":' + first + ',"a":"v"}}').encode()
    dl = parse_event(FeedbackEvent, raw, topic_names().feedback, "k")
    assert isinstance(dl, DeadLetter) and dl.field == "a" and "duplicate key" in dl.reason


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-32"])
def test_a_value_not_in_utf8_is_refused_not_decoded(encoding):
    """Kafka values are UTF-8 JSON: a BOM or UTF-16/32 is refused as bad JSON (field ``value``)
    by both paths (the second used to detect the encoding and read the last of a repeated key)."""
    from ingest.join import parse_event
    from schemas.events import DeadLetter, FeedbackEvent

    text = ('{"event_id":"00000000-0000-0000-0000-000000000001","completion_id":"00000000-0000-0000-0000-000000000002",'
            '"user_hash":"u","value":-1,"created_at":1750000000000,"value":1}')
    for t in (text, text.replace(',"value":1}', "}")):
        dl = parse_event(FeedbackEvent, t.encode(encoding), topic_names().feedback, "k")
        assert isinstance(dl, DeadLetter) and dl.field == "value" and dl.reason.startswith("bad JSON"), dl
