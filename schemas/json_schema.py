"""Published event contracts: JSON Schema (draft 2020-12) of every Kafka value, from the
pydantic models themselves (``flywheel schemas export``; ``docs/kafka.md``, "Event contracts").

Each contract is exported as ``<Name>.v<schema_version>.schema.json``. The schema is generated
in pydantic's *validation* mode: it describes what Flywheel's consumers accept (a field with a
default may be omitted). Checks that JSON Schema cannot express stay in the models and are
listed in each schema's ``description`` suffix (:data:`NOT_IN_SCHEMA`): a value valid under the
schema can still be dead-lettered by ingest for those.

Bounds: every number carries ``minimum``/``maximum`` (or ``exclusiveMinimum``) and every text
field the ``pattern`` :data:`schemas.events.TEXT_PATTERN` (no NUL, no lone surrogate), the same
rules the models enforce; ``tests/test_schemas_bounds.py`` checks, field by field, that a value
just inside each bound passes and one just outside fails in both.

Compatibility rule (Confluent Schema Registry's BACKWARD mode, per ``schema_version``):
within one ``schema_version`` a contract may only gain optional fields; an event valid under
an earlier export of that version stays valid (:func:`compatibility_problems` checks it).
Removing or renaming a field, a new required field, or any change of an existing field's
type or bounds needs the next ``schema_version`` and a new file; consumers refuse versions
they do not know (``schema_version`` is a ``const`` in the schema and a ``Literal`` in the model).
Two exceptions were made within v1 (decisions D43 and D107): the bounds they added refuse
only values that no consumer could use (they crashed ingest or the learner, overflowed an
Arrow column, were refused by the models already, or no reward policy can produce), so they
tightened v1 rather than start v2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import TypeAdapter

DIALECT = "https://json-schema.org/draft/2020-12/schema"
ID_BASE = "urn:flywheel:schema:"

NOT_IN_SCHEMA = {
    "CompletionEvent": "len(behavior_logprobs) == len(completion_token_ids); "
                       "expert_routes.shape[0] == len(prompt) + len(completion) - 1; no NaN (not JSON)",
    "FeedbackEvent": "no NaN (not JSON)",
    "RewardedSample": "event_ids are distinct; no NaN (not JSON)",
    "SampleNotice": "event_ids are distinct; no NaN (not JSON)",
}


@dataclass(frozen=True)
class Contract:
    """One published contract: its name, the topic short name it travels on, and its model."""

    name: str
    topic: str
    model: object  # a pydantic model class or a dataclass

    @property
    def version(self) -> int:
        """The contract's ``schema_version`` (the model's default, else :data:`events.SCHEMA_VERSION`)."""
        from schemas.events import SCHEMA_VERSION

        fields = getattr(self.model, "model_fields", {})
        f = fields.get("schema_version")
        return int(f.default) if f is not None and f.default is not None else SCHEMA_VERSION

    @property
    def filename(self) -> str:
        return f"{self.name}.v{self.version}.schema.json"


def contracts() -> list[Contract]:
    """Every value Flywheel writes to Kafka, in topic order."""
    from schemas.ledger import LedgerEntry
    from schemas.events import CompletionEvent, DeadLetter, FeedbackEvent, RewardedSample, SampleNotice

    # flywheel.samples carries a SampleNotice, or a RewardedSample with
    # [ingest] samples_value = "sample" (D67); RewardedSample is also the shard row's contract
    return [Contract("CompletionEvent", "completions", CompletionEvent),
            Contract("FeedbackEvent", "feedback", FeedbackEvent),
            Contract("SampleNotice", "samples", SampleNotice),
            Contract("RewardedSample", "samples", RewardedSample),
            Contract("DeadLetter", "deadletter", DeadLetter),
            Contract("DeploymentEvent", "deployments", LedgerEntry)]


def schema_of(c: Contract) -> dict:
    """The JSON Schema of one contract, with ``$schema``, ``$id``, title and topic."""
    from schemas.topics import SPECS

    s = TypeAdapter(c.model).json_schema(mode="validation")
    s["title"] = c.name
    desc = (s.get("description") or "").strip()
    extra = NOT_IN_SCHEMA.get(c.name)
    if extra:
        desc += f"\n\nChecked by the consumer, not expressible here: {extra}."
    s["description"] = desc
    s["x-flywheel-topic"] = SPECS[c.topic].base
    s["x-flywheel-key"] = SPECS[c.topic].key
    s["x-flywheel-schema-version"] = c.version
    return {"$schema": DIALECT, "$id": ID_BASE + c.filename, **s}


def export(out_dir: Path) -> list[Path]:
    """Write every contract's schema to ``out_dir`` (created); returns the files written.

    Files are JSON with sorted keys and a trailing newline, so a re-export of unchanged models
    is byte-identical (a diff shows exactly what changed)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for c in contracts():
        p = out_dir / c.filename
        p.write_text(json.dumps(schema_of(c), indent=2, sort_keys=True) + "\n")
        written.append(p)
    return written


def _props(schema: dict) -> tuple[dict, set[str]]:
    return schema.get("properties", {}), set(schema.get("required", []))


def _strip_docs(x):
    """A schema fragment without its human text (description, title, examples): a reworded
    description is not a contract change."""
    if isinstance(x, dict):
        return {k: _strip_docs(v) for k, v in x.items() if k not in ("description", "title", "examples")}
    if isinstance(x, list):
        return [_strip_docs(v) for v in x]
    return x


def compatibility_problems(old: dict, new: dict) -> list[str]:
    """Why ``new`` breaks the BACKWARD rule against ``old`` (same ``schema_version``); empty if it does not.

    Broken by: another ``schema_version`` under the same file name, a removed field, a new
    required field, a changed definition of an existing field or of a shared ``$defs`` entry,
    or a change of ``additionalProperties``. Pure: works on two schema dicts.
    """
    out = []
    if old.get("x-flywheel-schema-version") != new.get("x-flywheel-schema-version"):
        return [f"schema_version {old.get('x-flywheel-schema-version')} -> "
                f"{new.get('x-flywheel-schema-version')}: a new version is a new file, not an edit"]
    (op, oreq), (np_, nreq) = _props(old), _props(new)
    for f in op:
        if f not in np_:
            out.append(f"{f}: removed")
        elif _strip_docs(op[f]) != _strip_docs(np_[f]):
            out.append(f"{f}: definition changed")
    for f in sorted(nreq - oreq):
        out.append(f"{f}: newly required" + ("" if f in op else " (a new field must be optional)"))
    if old.get("additionalProperties") != new.get("additionalProperties"):
        out.append("additionalProperties changed")
    for name, d in (old.get("$defs") or {}).items():
        nd = (new.get("$defs") or {}).get(name)
        if nd is None:
            out.append(f"$defs/{name}: removed")
            continue
        sub = compatibility_problems({**d, "x-flywheel-schema-version": 0}, {**nd, "x-flywheel-schema-version": 0})
        out.extend(f"$defs/{name}.{p}" for p in sub)
    return out
