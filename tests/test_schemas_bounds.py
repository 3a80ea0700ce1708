"""Contract bounds, field by field: every bound in the exported JSON Schemas (``flywheel schemas
export``) is found by walking the schema, and for each one a value just inside it passes and one
just outside fails, in pydantic (Python objects and JSON bytes) and in the independent
``jsonschema`` validator alike. Every number and every text field has a bound to test."""

from __future__ import annotations

import copy
import json
import math
import uuid

import jsonschema
import numpy as np
import pytest
from pydantic import TypeAdapter, ValidationError

from schemas.events import (TEXT_PATTERN, CompletionEvent, DeadLetter, ExpertRoutes, FeedbackEvent, RewardedSample,
                            SampleNotice, SamplingParams, escape_text)
from schemas.json_schema import contracts, schema_of
from schemas.ledger import LedgerEntry

T0 = 1_750_000_000_000
SAMPLING = {"temperature": 0.7, "top_p": 0.95, "top_k": -1, "max_tokens": 16, "seed": 7, "logprobs_kind": "raw"}
ROUTES = ExpertRoutes.from_array(np.arange(16, dtype=np.uint8).reshape(4, 2, 2) % 4).model_dump(mode="json")
COMPLETION = {"schema_version": 1, "completion_id": str(uuid.UUID(int=1)), "request_id": "req-1", "created_at": T0,
              "model_version": "v000001", "pod": "pod-a", "user_hash": "u" * 32, "prompt_token_ids": [1, 2, 3],
              "completion_token_ids": [4, 5], "behavior_logprobs": [-0.5, -1.25], "sampling": SAMPLING,
              "expert_routes": None, "finish_reason": "stop", "ttft_ms": 12.5, "latency_ms": 40.0, "split": "train"}
SCORE = {"schema_version": 1, "event_id": str(uuid.UUID(int=2)), "completion_id": str(uuid.UUID(int=1)),
         "user_hash": "u" * 32, "kind": "score", "value": 0.25, "comment": "fine", "created_at": T0 + 5,
         "name": "helpfulness", "metadata": {"k": "v"}}
SAMPLE = {k: v for k, v in COMPLETION.items() if k not in ("schema_version", "request_id", "pod", "ttft_ms",
                                                           "latency_ms")}
EDIT = {k: v for k, v in SCORE.items() if k not in ("name", "value")} | {"kind": "edit", "final_text": "kept"}
COMPONENTS = {"reward_policy": "0123456789abcdef", "thumb": 0.5, "copied": 1, "regenerated": 0, "kept_share": 0.5,
              "followup": -1.0, "scores": {"helpfulness": 3.0}}
SAMPLE.update(reward=1.0, label=True, n_votes=1, votes_up=1, votes_down=0, event_ids=[SCORE["event_id"]],
              sealed_at=T0 + 600_000, **COMPONENTS)
NOTICE = {k: SAMPLE[k] for k in ("completion_id", "model_version", "split", "created_at", "sealed_at", "reward",
                                  "label", "n_votes", "votes_up", "votes_down", "event_ids", *COMPONENTS)}
NOTICE.update(shard="date=2025-06-15/hour=15/part-1750000600000-0f0e.parquet", row=3, shard_format=3)
DEAD = {"source_topic": "flywheel.feedback", "key": "k", "field": "value", "reason": "bad", "payload": "{}",
        "at": T0}

DICT_KEY = object()  # path step: the (only) key of a dict


class DictValue(str):
    """Path step: the value under this key of a dict."""


DEPLOYMENT = {"version": "v000001", "stable": "v000000", "step": 1, "weight": 0.25, "decision": "ADVANCE",
              "reason": "lower bound above -delta", "numbers": {"n": 40}, "actor": "controller", "ts": T0}


def _contract_schemas() -> dict[str, dict]:
    return {c.name: schema_of(c) for c in contracts()}


def _sub(schema: dict, name: str) -> dict:
    """A ``$defs`` entry as a schema of its own (refs still resolve)."""
    return {"$schema": schema["$schema"], **schema["$defs"][name], "$defs": schema["$defs"]}


def cases() -> list[tuple[str, type, dict, dict]]:
    """(name, model, valid base object, schema) for every event model and nested model."""
    s = _contract_schemas()
    return [("CompletionEvent", CompletionEvent, COMPLETION, s["CompletionEvent"]),
            ("FeedbackEvent", FeedbackEvent, SCORE, s["FeedbackEvent"]),
            ("FeedbackEvent(edit)", FeedbackEvent, EDIT, s["FeedbackEvent"]),
            ("RewardedSample", RewardedSample, SAMPLE, s["RewardedSample"]),
            ("SampleNotice", SampleNotice, NOTICE, s["SampleNotice"]),
            ("DeadLetter", DeadLetter, DEAD, s["DeadLetter"]),
            ("SamplingParams", SamplingParams, SAMPLING, _sub(s["CompletionEvent"], "SamplingParams")),
            ("ExpertRoutes", ExpertRoutes, ROUTES, _sub(s["CompletionEvent"], "ExpertRoutes")),
            ("DeploymentEvent", _Adapted(LedgerEntry), DEPLOYMENT, s["DeploymentEvent"])]


class _Adapted:
    """A dataclass contract (the ledger row) validated as pydantic validates it on export."""

    def __init__(self, t):
        self.ta = TypeAdapter(t)

    def model_validate(self, obj):
        return self.ta.validate_python(obj)

    def model_validate_json(self, raw):
        return self.ta.validate_json(raw)


def sites(node: dict, path: tuple = ()):
    """Every (path, schema node) under ``node`` that is a leaf value (not a $ref'd model)."""
    if "$ref" in node:
        return
    for branch in node.get("anyOf", []):
        if branch.get("type") != "null":
            yield from sites(branch, path)
    if node.get("type") == "object" and "properties" in node:
        for name, sub in node["properties"].items():
            yield from sites(sub, path + (name,))
        return
    if node.get("type") == "object":
        yield path, node
        if isinstance(node.get("additionalProperties"), dict):  # True: a free-form object (ledger numbers)
            yield from sites(node["additionalProperties"], path + (DictValue("k"),))
        if "propertyNames" in node:
            yield path + (DICT_KEY,), {"type": "string", **node["propertyNames"]}
        return
    if node.get("type") == "array":
        yield path, node
        for i, sub in enumerate(node.get("prefixItems", [])):
            yield from sites(sub, path + (i,))
        if isinstance(node.get("items"), dict):
            yield from sites(node["items"], path + (0,))
        return
    if "type" in node:
        yield path, node


def put(obj: dict, path: tuple, value) -> dict:
    """A deep copy of ``obj`` with ``value`` at ``path``."""
    out = copy.deepcopy(obj)
    cur = out
    for step in path[:-1]:
        cur = cur[step]
    last = path[-1]
    if last is DICT_KEY:  # the key replaced, its value kept
        v = next(iter(cur.values()))
        cur.clear()
        cur[value] = v
    else:
        cur[last] = value
    return out


def probes(node: dict, base_value):
    """(keyword, value just inside, [values just outside]) for each bound of one schema node."""
    t = node.get("type")
    if t in ("integer", "number"):
        step = (lambda x, d: x + d) if t == "integer" else (lambda x, d: math.nextafter(x, d * math.inf))
        for kw, sign in (("minimum", -1), ("maximum", 1)):
            if kw in node:
                yield kw, node[kw], [step(node[kw], sign)]
        for kw, sign in (("exclusiveMinimum", -1), ("exclusiveMaximum", 1)):
            if kw in node:
                yield kw, step(node[kw], -sign), [node[kw]]
    if t == "string":
        if "minLength" in node and node["minLength"] > 0:
            yield "minLength", "a" * node["minLength"], ["a" * (node["minLength"] - 1)]
        if "maxLength" in node:
            yield "maxLength", "a" * node["maxLength"], ["a" * (node["maxLength"] + 1)]
        if node.get("pattern") == TEXT_PATTERN:
            yield "pattern", "é😀\u2028z", ["a\x00b", "a\ud800", "\udfff"]
        elif "pattern" in node:
            yield "pattern", base_value, [base_value + "\x00", base_value + "!", base_value + "\ud800"]
    if t == "array":
        if node.get("minItems", 0) > 0:
            yield "minItems", base_value[:node["minItems"]], [base_value[:node["minItems"] - 1]]
        if "maxItems" in node:
            yield "maxItems", base_value[:node["maxItems"]], [base_value + base_value[:1]]
    if t == "object" and "maxProperties" in node:
        n, v = node["maxProperties"], next(iter(base_value.values()))
        yield "maxProperties", {f"k{i}": v for i in range(n)}, [{f"k{i}": v for i in range(n + 1)}]


def get(obj, path):
    for step in path:
        if step is DICT_KEY:
            return next(iter(obj))
        obj = obj[step]
    return obj


def _validator(schema: dict) -> jsonschema.Draft202012Validator:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def _pydantic_accepts(model, obj) -> tuple[bool, object]:
    try:
        return True, model.model_validate(obj)
    except ValidationError as exc:
        return False, exc


def _pydantic_json_accepts(model, obj) -> bool:
    try:
        model.model_validate_json(json.dumps(obj))
        return True
    except ValidationError:
        return False


def test_bases_are_valid():
    for name, model, base, schema in cases():
        _validator(schema).validate(base)
        model.model_validate(base)
        model.model_validate_json(json.dumps(base))


def test_every_number_and_text_field_is_bounded():
    """The completeness rule the probes below rely on: every integer and number has both a lower
    and an upper bound, every free-text string the text pattern (or a stricter pattern), an enum
    or a format."""
    unbounded = []
    for name, _model, _base, schema in cases():
        for path, node in sites(schema):
            t = node.get("type")
            where = f"{name}.{'.'.join(str(p) for p in path)}"
            if t in ("integer", "number"):
                lo = "minimum" in node or "exclusiveMinimum" in node
                hi = "maximum" in node or "exclusiveMaximum" in node
                if not (lo and hi) and "const" not in node and "enum" not in node:
                    unbounded.append(where)
            elif t == "string" and not ({"pattern", "enum", "const", "format"} & set(node)):
                unbounded.append(where)
    assert unbounded == []


def test_each_bound_just_inside_passes_and_just_outside_fails():
    checked = 0
    for name, model, base, schema in cases():
        v = _validator(schema)
        for path, node in sites(schema):
            if path and path[0] not in base:  # a field of another kind (an edit's final_text on a score)
                continue
            for kw, inside, outsides in probes(node, get(base, path) if path else base):
                what = f"{name}.{'.'.join(str(p) for p in path)} {kw}"
                obj = put(base, path, inside)
                assert not list(v.iter_errors(obj)), (what, inside)
                ok, res = _pydantic_accepts(model, obj)
                assert ok, (what, inside, res)
                assert _pydantic_json_accepts(model, obj), (what, inside)
                for out in outsides:
                    bad = put(base, path, out)
                    errs = list(v.iter_errors(bad))
                    assert errs, (what, out)
                    assert any(list(e.absolute_path)[:1] == [path[0]] for e in errs), (what, out, errs)
                    ok, res = _pydantic_accepts(model, bad)
                    if model is DeadLetter and kw == "pattern":  # escaped, not refused: it must carry any record
                        assert ok and get(res.model_dump(), path) == escape_text(out), (what, out)
                        assert not list(v.iter_errors(json.loads(res.to_bytes()))), (what, out)
                        continue
                    assert not ok, (what, out)
                    assert res.errors()[0]["loc"][0] == path[0], (what, out, res.errors())
                    assert not _pydantic_json_accepts(model, bad), (what, out)
                checked += 1
    # a floor, so a schema walk that silently finds nothing fails: 7 models, ~70 bounds
    assert checked >= 70, checked


def test_thumb_value_and_score_name_rules_in_both():
    v = _validator(_contract_schemas()["FeedbackEvent"])
    thumb = {k: x for k, x in SCORE.items() if k != "name"} | {"kind": "thumb"}
    no_kind = {k: x for k, x in thumb.items() if k != "kind"}  # kind defaults to thumb
    rows = [(thumb | {"value": 1}, True), (thumb | {"value": -1.0}, True), (no_kind | {"value": -1}, True),
            (thumb | {"value": 0}, False), (thumb | {"value": 0.5}, False), (no_kind | {"value": 2}, False),
            (thumb | {"value": 1, "name": "x"}, False), ({**SCORE, "value": 3.0}, True),
            ({k: x for k, x in SCORE.items() if k != "name"}, False)]
    # the kinds added with the reward policy: copy and regenerate are 1, followup +1/-1, an edit
    # exactly one of value (kept share in [0, 1]) or final_text; value required on all others
    rows += [(thumb | {"kind": "copy", "value": 1}, True), (thumb | {"kind": "copy", "value": 0.0}, False),
             (thumb | {"kind": "regenerate", "value": 1.0}, True), (thumb | {"kind": "regenerate", "value": -1}, False),
             (thumb | {"kind": "followup", "value": -1}, True), (thumb | {"kind": "followup", "value": 0.5}, False),
             (thumb | {"kind": "edit", "value": 0.3}, True), (thumb | {"kind": "edit", "value": 0}, True),
             (thumb | {"kind": "edit", "value": 1.5}, False), (thumb | {"kind": "edit", "value": -0.1}, False),
             (EDIT, True), (EDIT | {"value": 0.5}, False), ({k: x for k, x in EDIT.items() if k != "final_text"}, False),
             (EDIT | {"final_text": None}, False), (EDIT | {"final_text": "x" * 65537}, False),
             (thumb | {"value": 1, "final_text": "x"}, False), ({k: x for k, x in thumb.items() if k != "value"}, False),
             ({k: x for k, x in no_kind.items() if k != "value"}, False),
             ({k: x for k, x in SCORE.items() if k != "value"}, False), (EDIT | {"kind": "followup", "value": 1}, False),
             (thumb | {"kind": "nope", "value": 1}, False)]
    for obj, want in rows:
        assert (not list(v.iter_errors(obj))) is want, obj
        assert _pydantic_accepts(FeedbackEvent, obj)[0] is want, obj


def test_a_dead_letter_carries_any_text_escaped():
    """NUL and lone surrogates from a hostile record reach the dead letter as escapes, never
    as an exception in the worker and never as bytes a consumer cannot decode."""
    dl = DeadLetter(source_topic="flywheel.feedback", key="\ud800k", field="\x00", reason="r\udfff",
                    payload="{\"a\": \"\x00\"}", at=T0)
    assert (dl.key, dl.field, dl.reason, dl.payload) == ("\\ud800k", "\\u0000", "r\\udfff", "{\"a\": \"\\u0000\"}")
    raw = dl.to_bytes()
    raw.decode("utf-8")
    assert DeadLetter.from_bytes(raw) == dl


def test_the_schemas_mean_the_same_to_a_rust_validator():
    """A producer in another language can load the published schemas and refuses what we refuse:
    jsonschema-rs (Rust ``regex``, which has no surrogate escapes) compiles every one and agrees
    on the text bound, NUL and all (its strings cannot hold a lone surrogate at all)."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    s = _contract_schemas()
    for name, schema in s.items():
        jsonschema_rs.validator_for(json.loads(json.dumps(schema)))
    v = jsonschema_rs.validator_for(json.loads(json.dumps(s["FeedbackEvent"])))
    for text, want in (("é😀\u2028z\U0010ffff", True), ("a\x00b", False), ("", False)):
        assert v.is_valid({**SCORE, "user_hash": text}) is want, repr(text)
