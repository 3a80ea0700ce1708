"""Published event contracts: the JSON Schemas that ``flywheel schemas export`` writes validate
real events (a real serving pod on the tiny model, a real Tansu broker, read back from Kafka)
with the independent ``jsonschema`` validator; the compatibility rule is enforced."""

from __future__ import annotations

import copy
import json
import os
import time
import uuid
from pathlib import Path

import httpx
import jsonschema
import pytest
from typer.testing import CliRunner

from schemas.settings import topic_names
from flywheel.cli import app
from schemas.json_schema import compatibility_problems, contracts, schema_of

PUBLISHED = Path(__file__).resolve().parents[1] / "docs" / "schemas"


def validator(schema: dict) -> jsonschema.Draft202012Validator:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def consume_all(bootstrap: str, topic: str, keys: set[str], want: int, timeout_s: float = 20.0) -> list:
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, consumer_timeout_ms=500)
    parts = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic)]
    c.assign(parts)
    c.seek_to_beginning(*parts)
    out: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(out) < want:
        for recs in c.poll(timeout_ms=300).values():
            out.extend(r for r in recs if (r.key or b"").decode() in keys)
    c.close()
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, dict]:
    """``flywheel schemas export DIR`` run as a user would; {contract name: schema} read back."""
    d = tmp_path_factory.mktemp("schemas")
    r = CliRunner().invoke(app, ["schemas", "export", str(d), "-o", "json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert sorted(p.name for p in d.iterdir()) == sorted(
        f"{n}.v1.schema.json" for n in ("CompletionEvent", "FeedbackEvent", "SampleNotice", "RewardedSample",
                                        "DeadLetter", "DeploymentEvent"))
    return {row["contract"]: json.loads(Path(row["file"]).read_text()) for row in rows}


@pytest.fixture(scope="module")
def real_events(tiny_moe_dir, tmp_path_factory):
    """A completion and a feedback from a real pod, read back from Kafka as raw bytes."""
    from flywheel.broker import spawn
    from serving.commands import build_pod
    from servers import ServerThread
    from serving.slots import CheckpointStore

    b = spawn(partitions=2, die_with_parent=True)
    p = build_pod(CheckpointStore(tiny_moe_dir), pod="pod-schemas", max_batch=2, bootstrap=b.bootstrap,
                  journal=tmp_path_factory.mktemp("j") / "ev.journal")
    srv = ServerThread(p.app).start()
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "flywheel", "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 4,
            "user": "alice"})
        assert r.status_code == 200, r.text
        cid = r.json()["id"]
        f = httpx.post(srv.url + "/v1/feedback", timeout=30, json={"completion_id": cid, "value": 1, "user": "bob",
                                                                   "comment": "nice"})
        assert f.status_code == 200, f.text
        (comp,) = consume_all(b.bootstrap, topic_names().completions, {cid}, 1)
        (fb,) = consume_all(b.bootstrap, topic_names().feedback, {cid}, 1)
        from deploy import ledger

        ledger.publish(b.bootstrap, ledger.LedgerEntry(version="v000001", stable="v000000", step=1, weight=0.05,
                                                       decision="STEP", reason="schemas test",
                                                       numbers={"votes": 3}, ts=int(time.time() * 1000)),
                       topic_names().deployments)
        (dep,) = consume_all(b.bootstrap, topic_names().deployments, {"v000001"}, 1)
        yield {"completion": comp.value, "feedback": fb.value, "deployment": dep.value, "cid": cid}
    finally:
        srv.stop()
        p.close()
        b.stop()


def test_real_events_from_a_pod_validate(exported, real_events):
    comp, fb = json.loads(real_events["completion"]), json.loads(real_events["feedback"])
    assert comp["completion_id"] == fb["completion_id"] == real_events["cid"]
    validator(exported["CompletionEvent"]).validate(comp)
    validator(exported["FeedbackEvent"]).validate(fb)
    validator(exported["DeploymentEvent"]).validate(json.loads(real_events["deployment"]))

    # the sample and the dead letter as ingest's join builds them from those same bytes
    from ingest.join import JoinConfig, Joiner, parse_event
    from ingest.state import StateStore
    from schemas.events import CompletionEvent, FeedbackEvent

    j = Joiner(StateStore(":memory:"), JoinConfig())
    c_ev = CompletionEvent.from_bytes(real_events["completion"])
    j.on_completion(c_ev, real_events["completion"], now=c_ev.created_at)
    j.on_feedback(FeedbackEvent.from_bytes(real_events["feedback"]), real_events["feedback"], now=c_ev.created_at)
    (sample,) = j.tick(c_ev.created_at + 10 ** 9).samples
    validator(exported["RewardedSample"]).validate(json.loads(sample.to_bytes()))
    # the samples topic's default value: the notice of that sample at row 4 of a shard
    from samplestore import shards as writer

    path = writer.shard_path(Path("/srv/samples"), sample.sealed_at)
    notice = json.loads(writer.notice_encoder(path, "/srv/samples")(sample, 4))
    validator(exported["SampleNotice"]).validate(notice)
    assert notice["shard"] == path.relative_to("/srv/samples").as_posix() and notice["row"] == 4
    dl = parse_event(FeedbackEvent, real_events["feedback"].replace(b'"value":1.0', b'"value":"up"'),
                     topic_names().feedback, real_events["cid"])
    assert dl.field == "value"
    validator(exported["DeadLetter"]).validate(json.loads(dl.to_bytes()))


def test_schema_refuses_what_the_model_refuses(exported, real_events):
    v = validator(exported["CompletionEvent"])
    good = json.loads(real_events["completion"])
    for change, field in [({"schema_version": 2}, "schema_version"), ({"surprise": 1}, None),
                          ({"completion_id": "not-a-uuid"}, "completion_id"), ({"finish_reason": "eos"}, "finish_reason"),
                          ({"prompt_token_ids": []}, "prompt_token_ids")]:
        bad = {**good, **change}
        errs = list(v.iter_errors(bad))
        assert errs, change
        if field:
            assert any(field in e.absolute_path or field in e.message for e in errs), (change, errs)
        from pydantic import ValidationError

        from schemas.events import CompletionEvent

        with pytest.raises(ValidationError):
            CompletionEvent.model_validate(bad)


def test_an_event_without_the_optional_fields_is_still_valid(exported, real_events):
    """What a producer built against an earlier export of v1 wrote (none of the fields added
    since as optional) validates under the current schema and the model."""
    from schemas.events import CompletionEvent, FeedbackEvent

    for name, raw, model in [("CompletionEvent", real_events["completion"], CompletionEvent),
                             ("FeedbackEvent", real_events["feedback"], FeedbackEvent)]:
        s = exported[name]
        ev = json.loads(raw)
        # a FeedbackEvent's value is required by its per-kind rules (allOf), not at the top level:
        # only an edit carrying final_text leaves it out
        minimal = {k: v for k, v in ev.items()
                   if k in s["required"] or (name == "FeedbackEvent" and k == "value")}
        assert len(minimal) < len(ev)  # there are optional fields to drop
        validator(s).validate(minimal)
        model.model_validate(minimal)


def test_published_schemas_are_current_and_compatible():
    """docs/schemas holds the export of the code (re-run `flywheel schemas export docs/schemas`
    after a change), and the code's schema never breaks the rule against the published one."""
    for c in contracts():
        now = schema_of(c)
        published = PUBLISHED / c.filename
        assert published.exists(), f"{published} missing: a new schema_version is a new published file"
        old = json.loads(published.read_text())
        assert compatibility_problems(old, now) == [], c.name
        assert old == json.loads(json.dumps(now)), f"{published} is stale: run flywheel schemas export docs/schemas"


def test_compatibility_rule_table():
    base = schema_of(contracts()[1])  # FeedbackEvent
    assert compatibility_problems(base, copy.deepcopy(base)) == []
    cases = []
    added_optional = copy.deepcopy(base)
    added_optional["properties"]["tags"] = {"type": "array", "items": {"type": "string"}}
    cases.append((added_optional, []))
    added_required = copy.deepcopy(added_optional)
    added_required["required"].append("tags")
    cases.append((added_required, ["tags: newly required (a new field must be optional)"]))
    removed = copy.deepcopy(base)
    del removed["properties"]["comment"]
    cases.append((removed, ["comment: removed"]))
    retyped = copy.deepcopy(base)
    retyped["properties"]["value"] = {"type": "integer"}
    cases.append((retyped, ["value: definition changed"]))
    reworded = copy.deepcopy(base)
    reworded["properties"]["value"]["description"] = "the vote"
    cases.append((reworded, []))
    bumped = copy.deepcopy(base)
    bumped["x-flywheel-schema-version"] = 2
    cases.append((bumped, ["schema_version 1 -> 2: a new version is a new file, not an edit"]))
    opened = copy.deepcopy(base)
    opened["additionalProperties"] = True
    cases.append((opened, ["additionalProperties changed"]))
    for new, want in cases:
        assert compatibility_problems(base, new) == want


def test_export_is_byte_stable(tmp_path):
    r1 = CliRunner().invoke(app, ["schemas", "export", str(tmp_path / "a")])
    r2 = CliRunner().invoke(app, ["schemas", "export", str(tmp_path / "b")])
    assert r1.exit_code == r2.exit_code == 0
    for f in (tmp_path / "a").iterdir():
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes()
    assert os.listdir(tmp_path / "a") and r1.stdout.strip().splitlines()[0].endswith(".schema.json")


def test_export_to_a_path_it_cannot_write_is_a_runtime_error(tmp_path):
    (tmp_path / "taken").write_text("a file, not a directory")
    for dest in (tmp_path / "taken", tmp_path / "taken" / "below"):
        r = CliRunner().invoke(app, ["schemas", "export", str(dest)])
        assert r.exit_code == 1, r.output
        assert f"error: cannot write the schemas to {dest}: " in r.stderr and "Traceback" not in r.output
    assert (tmp_path / "taken").read_text() == "a file, not a directory"
