"""The vote's fast path gives the per-record path's outcome on every input (D96).

``ingest.join.parse_event`` validates a feedback value in bytes with no escape sequence by
``_fast_feedback`` (the contract's validator less the checks such a value always passes, and
the duplicate-key quote count written out for the vote's fields) and anything else by
``_parse_checked``, the per-record path it had before. Here both run on the same inputs, the
reference being ``_parse_checked``: the same FeedbackEvent (values, types, the fields set),
or a DeadLetter with the same field, reason and payload. The inputs are the ingest mix, the
hostile corpora of ``tests/test_ingest_pace.py``, ``tests/test_ingest_fuzz.py`` and
``tests/test_ingest_hostile.py``, the bytes the fast path's argument rests on (raw control
characters, bytes that are not UTF-8, overlong and surrogate encodings), every bound the
dropped or moved checks enforce, at and past it, and random byte edits of valid votes."""

from __future__ import annotations

import json
import random
import uuid

import pytest

from ingest import join
from schemas.events import MAX_EVENT_TIME_MS, MIN_EVENT_TIME_MS, DeadLetter, FeedbackEvent
from schemas.settings import topic_names

SRC = topic_names().feedback
T0 = 1_750_000_000_000  # ms
CID = "00000000-0000-4000-8000-000000000002"


def outcome(res):
    """What a caller can see of a parse: the event's type, values and fields set, or the dead
    letter's fields (its ``at`` is the clock)."""
    if isinstance(res, DeadLetter):
        return ("dead", res.model_dump(exclude={"at"}))
    assert type(res) is FeedbackEvent
    d = res.__dict__
    return ("event", {k: (type(v), v) for k, v in d.items()}, frozenset(res.model_fields_set),
            res.__pydantic_extra__, res.__pydantic_private__)


def same(raw, key=b"k") -> bool:
    """Assert that the fast path and the per-record path agree on ``raw``; True when the fast
    path decided it (accepted it itself)."""
    want = outcome(join._parse_checked(FeedbackEvent, raw, SRC, key))
    assert outcome(join.parse_event(FeedbackEvent, raw, SRC, key)) == want, raw[:300]
    if isinstance(raw, bytes):
        fast = join._fast_feedback(raw)
        if fast is not None:
            assert want[0] == "event" and outcome(fast) == want, raw[:300]
            assert join._feedback_strings(fast) == join._json_strings(fast), raw[:300]
            return True
    return False


def vote(**kw) -> dict:
    d = {"schema_version": 1, "event_id": str(uuid.UUID(int=1, version=4)), "completion_id": CID,
         "user_hash": "u1", "kind": "thumb", "value": 1, "created_at": T0}
    d.update(kw)
    return {k: v for k, v in d.items() if v is not _DROP}


_DROP = object()


def raw_of(obj, ensure_ascii: bool = False) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")


# -- the ingest mix: every realistic vote takes the fast path, with the same event -----------------

def test_every_vote_of_the_ingest_mix_takes_the_fast_path_with_the_same_event():
    import argparse

    from bench.ingest import make_events

    small = argparse.Namespace(prompt_tokens=2, completion_tokens=2, layers=1, experts=8, top_k=1)
    _, fb = make_events(300, small)
    assert len(fb) > 500
    assert all(same(v, k) for k, v in fb)


# -- the existing hostile corpora ------------------------------------------------------------------

def test_the_duplicate_key_corpus_of_test_ingest_pace():
    """Random spacing, quotes, colons and backslashes in keys and values, numbers as text, a
    key of the top object or of ``metadata`` repeated with another value or the same."""
    from test_ingest_pace import _encode, _vote_obj

    fast = 0
    for seed in range(1500):
        rng = random.Random(seed)
        obj = _vote_obj(rng)
        if rng.random() < 0.5:  # the corpus's votes are scores; thumbs and edits too
            obj.update(rng.choice([{"kind": "thumb", "value": rng.choice([1, -1, 2])},
                                   {"kind": "edit", "value": None, "final_text": "kept"},
                                   {"kind": "edit", "value": 0.25}]))
            obj.pop("name")
        fast += same(_encode(obj, rng, dup=rng.random() < 0.5).encode())
    assert fast > 150  # (the corpus has backslashes in half its votes: those take the per-record path)


def test_the_fuzz_corpora_of_test_ingest_fuzz():
    """``bad_feedback`` (deep nesting, bytes that are not UTF-8, non-finite values, duplicates,
    wrong types and units, unknown schema versions, truncations, unknown fields) and the
    schema fuzz (one field changed: a value drawn from its JSON Schema, an edge value, a wrong
    type, missing, repeated, nested deep, an unknown field)."""
    from test_ingest_fuzz import bad_feedback, schema_fuzz

    rng = random.Random(7)
    for _ in range(600):
        raw = bad_feedback(rng)
        if raw is not None and len(raw) < 20_000:  # (the deep-nesting ones are the hostile test's below)
            same(raw)
    _, fb, _ = schema_fuzz(0, 1500, seed=3, now=T0)
    fast = sum(same(raw, key) for key, raw, _, _ in fb)
    assert fast > 100


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"a":' * 100_000, b"[" * 100_000 + b"]" * 100_000,
                                 '{"x": "\ud800"}'.encode("utf-8", "surrogatepass"), b"\xff\xfe\x00garbage", b"",
                                 b"null", b"1e999999", b"{}", b"[]", b'"x"', b"42"])
def test_the_hostile_values_of_test_ingest_hostile(raw):
    same(raw)


def test_text_values_take_the_per_record_path():
    """A ``str`` value (tests and tools pass text) is never the fast path's: the same outcome."""
    for obj in (vote(), vote(user_hash="\ud800"), vote(value=True)):
        text = json.dumps(obj)
        assert outcome(join.parse_event(FeedbackEvent, text, SRC, "k")) == outcome(
            join._parse_checked(FeedbackEvent, text, SRC, "k"))


# -- what the fast path's argument rests on --------------------------------------------------------

# raw bytes inside a string with no escape: control characters, not UTF-8, an overlong NUL,
# an encoded surrogate (CESU-8), a BOM, DEL, and valid multi-byte text
RAW_IN_STRING = [b"\x00", b"a\x00b", b"\x01", b"\x1f", b"\x7f", b"\xff", b"\xc0\x80", b"\xed\xa0\x80",
                 b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xef\xbb\xbf", "\u00e9t\u00e9".encode(),
                 "\U0001f600".encode(), b"\xe2\x80\xa8"]


@pytest.mark.parametrize("field", ["user_hash", "comment", "metadata_key", "metadata_value", "final_text", "key"])
@pytest.mark.parametrize("inner", RAW_IN_STRING)
def test_raw_bytes_in_every_text_field(field, inner):
    """The dropped text check (no NUL, no lone surrogate) is passed by any string the JSON
    parser decodes from raw bytes: each such byte sequence in each text field (and in a key)
    gives the per-record outcome."""
    marker = "\u2603MARK"
    if field == "metadata_key":
        obj = vote(metadata={marker: "v"})
    elif field == "metadata_value":
        obj = vote(metadata={"k": marker})
    elif field == "final_text":
        obj = vote(kind="edit", value=_DROP, final_text=marker)
    elif field == "key":
        obj = vote(**{marker: 1})
    else:
        obj = vote(**{field: marker})
    raw = raw_of(obj).replace(marker.encode(), inner)
    same(raw)


@pytest.mark.parametrize("escape", ["\\u0000", "\\ud800", "\\udfff", "\\ud83d\\ude00", "\\n", "\\\"", "\\\\", "\\/"])
def test_escapes_take_the_per_record_path_with_the_same_outcome(escape):
    raw = raw_of(vote(comment="X")).replace(b'"X"', b'"a' + escape.encode() + b'b"')
    assert not same(raw)


@pytest.mark.parametrize("ms", [MIN_EVENT_TIME_MS - 1, MIN_EVENT_TIME_MS, MAX_EVENT_TIME_MS, MAX_EVENT_TIME_MS + 1,
                                1_750_000_000, 0, -1, 2**63, 2**64, T0 + 0.5, float(T0), str(T0), None, True])
def test_created_at_bounds(ms):
    """``_check_ms`` moved into the integer's bounds: the same decision at and past each."""
    same(raw_of(vote(created_at=ms)))


@pytest.mark.parametrize("text,n", [("a", 4096), ("a", 4097), ("\u00e9", 4096), ("\u00e9", 4097),
                                    ("\U0001f600", 4096), ("\U0001f600", 4097), ("", 0)])
def test_comment_length_in_code_points(text, n):
    """The comment's Python length check moved into the string schema: code points both."""
    same(raw_of(vote(comment=text * n)))


@pytest.mark.parametrize("meta", [
    {}, {"k": ""}, {"": "v"}, {"k" * 64: "v"}, {"k" * 65: "v"}, {"\U0001f600" * 64: "v"}, {"\U0001f600" * 65: "v"},
    {"k": "v" * 512}, {"k": "v" * 513}, {"k": "\u00e9" * 512}, {"k": "\u00e9" * 513},
    {f"k{i}": "v" for i in range(16)}, {f"k{i}": "v" for i in range(17)}, {"k": 1}, {"k": None}, {"k": ["v"]}])
def test_metadata_bounds(meta):
    same(raw_of(vote(metadata=meta)))


@pytest.mark.parametrize("obj", [
    vote(kind="edit", value=_DROP, final_text="x" * 65536), vote(kind="edit", value=_DROP, final_text="x" * 65537),
    vote(kind="edit", value=0.5, final_text="x"), vote(kind="edit", value=_DROP), vote(kind="edit", value=1.5),
    vote(kind="score", name="helpfulness", value=1e6), vote(kind="score", name="helpfulness", value=1e6 + 1),
    vote(kind="score", value=3), vote(kind="thumb", name="x"), vote(kind="copy", value=2), vote(kind="followup"),
    vote(kind="regenerate", value=1), vote(kind="other"), vote(value=_DROP), vote(user_hash=""),
    vote(user_hash="u" * 256), vote(user_hash="u" * 257), vote(user_hash=None), vote(comment=None),
    vote(schema_version=2), vote(schema_version="1"), vote(schema_version=_DROP), vote(kind=_DROP),
    vote(event_id="4DA5E709-D471-4D60-88A7-0639EB1167B3"), vote(event_id="4da5e709d4714d6088a70639eb1167b3"),
    vote(event_id="urn:uuid:4da5e709-d471-4d60-88a7-0639eb1167b3"), vote(event_id="{4da5e709-d471-4d60-88a7-0639eb1167b3}"),
    vote(event_id="4da5e709-d471-4d60-88a7-0639eb1167b"), vote(completion_id=7), vote(extra=1)])
def test_every_rule_of_the_vote_contract(obj):
    same(raw_of(obj))
    same(raw_of(obj, ensure_ascii=True))


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-0", b"1.0", b"true", b'"1"', b"1e0"])
def test_number_literals(value):
    same(raw_of(vote(value=123456)).replace(b"123456", value))


def test_repeated_keys_and_framing():
    """A repeated key (top level and in ``metadata``, same or another value, first or last),
    two objects in one value, trailing bytes, whitespace and a BOM around the object."""
    base = raw_of(vote(comment="c", metadata={"a": "b"}))
    cases = [base[:-1] + b',"value":1}', base[:-1] + b',"value":-1}', b'{"value":1,' + base[1:],
             base[:-1] + b',"comment":"c"}', base[:-1] + b',"comment":null}',
             base.replace(b'{"a":"b"}', b'{"a":"b","a":"b"}'), base.replace(b'{"a":"b"}', b'{"a":"b","a":"c"}'),
             base + b"," + base, base + base, base + b"]", b"[" + base + b"]", b" \n\t" + base + b" \r\n",
             b"\xef\xbb\xbf" + base, base[:-1], base + b"}", base.replace(b",", b" , "),
             base.replace(b":", b" : "), base.replace(b'"a":"b"', b'"a":"b",'), base.replace(b"{", b"{,", 1)]
    for raw in cases:
        same(raw)


def test_random_byte_edits_of_valid_votes():
    """Valid votes with one to three bytes inserted, deleted or replaced from JSON's structural
    bytes, quotes, backslashes, digits and bytes that are not text: the same outcome."""
    rng = random.Random(11)
    alphabet = [b'"', b"\\", b"{", b"}", b"[", b"]", b",", b":", b" ", b"0", b"1", b"-", b"e", b".", b"\x00", b"\x01",
                b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"a", b"n", b"\xc3\xa9"]
    bases = [raw_of(vote()), raw_of(vote(comment="works", kind="thumb", value=-1)),
             raw_of(vote(kind="score", name="h", value=0.5, metadata={"k": "v", "x": "y"})),
             raw_of(vote(kind="edit", value=_DROP, final_text="final text"))]
    fast = 0
    for _ in range(4000):
        b = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(b) + 1)
            op = rng.random()
            if op < 0.4:
                b[i:i] = rng.choice(alphabet)
            elif op < 0.7 and i < len(b):
                del b[i]
            elif i < len(b):
                b[i:i + 1] = rng.choice(alphabet)
        fast += same(bytes(b))
    assert fast > 40  # (edits inside a string or of a digit keep the vote valid: 84 of these 4000)


def test_the_fast_validator_runs_no_python_check_but_the_models():
    """What makes the fast path cheaper: of the contract's Python validators only the model's
    own (``FeedbackEvent._check_value``, the per-kind rules) is left; the text, length and time
    checks are dropped or run in pydantic-core (a pydantic upgrade that changes the schema's
    layout would leave them in: slower, still the same outcomes)."""
    def functions(s, out):
        if isinstance(s, dict):
            if "function" in s and isinstance(s["function"], dict):
                out.append(s["function"]["function"])
            for k, v in s.items():
                if k == "fields":  # (a field may be called "metadata")
                    functions(list(v.values()), out)
                elif k not in ("function", "metadata", "cls", "config"):
                    functions(v, out)
        elif isinstance(s, list):
            for x in s:
                functions(x, out)
        return out

    full = functions(FeedbackEvent.__pydantic_core_schema__, [])
    fast = functions(join._unchecked_text(FeedbackEvent.__pydantic_core_schema__), [])
    assert len(full) >= 12 and [getattr(f, "__name__", f) for f in fast] == ["_check_value"]
