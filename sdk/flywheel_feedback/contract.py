"""The FeedbackEvent contract, as Flywheel publishes it: the JSON Schema (draft 2020-12) that
``flywheel schemas export`` writes as ``FeedbackEvent.v1.schema.json``, shipped in this package.

The schema is the one source of what an event may hold: the kinds, the per-kind value rules
the schema states, every bound (``|value| <= 1e6``, text lengths, metadata sizes) and the text
rule (no NUL, no lone surrogate). :func:`check_event` validates an event with it before the
client queues anything; ``tests/test_sdk_dist.py`` proves that the shipped file is byte for
byte the export of ``schemas.events.FeedbackEvent``.

Refresh after a change of ``schemas/events.py``::

    flywheel schemas export docs/schemas && cp docs/schemas/FeedbackEvent.v1.schema.json sdk/flywheel_feedback/
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

SCHEMA_FILE = "FeedbackEvent.v1.schema.json"


@lru_cache(maxsize=1)
def schema() -> dict:
    """The shipped FeedbackEvent JSON Schema (a dict; do not mutate it)."""
    return json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))


@lru_cache(maxsize=1)
def _validator():
    import jsonschema_rs

    return jsonschema_rs.validator_for(schema())


def kinds() -> tuple[str, ...]:
    """The event kinds the schema allows, in its order (``properties.kind.enum``)."""
    return tuple(schema()["properties"]["kind"]["enum"])


def topic_base() -> str:
    """The topic events travel on, without prefix (the schema's ``x-flywheel-topic``)."""
    return schema()["x-flywheel-topic"]


def _kind(err) -> str:
    return type(err.kind).__name__


def _specific(err):
    """The error inside an ``anyOf`` / ``oneOf`` that says what is wrong: the first one of its
    branches that is not a type mismatch (``"x" is not of type "null"`` says nothing)."""
    while _kind(err) in ("AnyOf", "OneOfNotValid") and getattr(err.kind, "context", None):
        subs = [x for branch in err.kind.context for x in branch]
        if not subs:
            break
        err = next((x for x in subs if _kind(x) != "Type"), subs[0])
    return err


def _field(err) -> str:
    """The top-level event field an error is about (``event`` when none)."""
    if err.instance_path:
        return str(err.instance_path[0])
    if _kind(err) == "Required":
        return str(err.kind.property)
    if _kind(err) == "AdditionalProperties" and err.kind.unexpected:
        return str(err.kind.unexpected[0])
    return "event"


def _message(err) -> str:
    """What is wrong, with a long value given by its size rather than quoted whole."""
    k = _kind(err)
    if k in ("MaxLength", "MinLength") and isinstance(err.instance, str):
        return f"{'at most' if k == 'MaxLength' else 'at least'} {err.kind.limit} characters, got {len(err.instance)}"
    if k in ("MaxProperties", "MinProperties") and isinstance(err.instance, dict):
        return f"{'at most' if k == 'MaxProperties' else 'at least'} {err.kind.limit} keys, got {len(err.instance)}"
    msg = err.message
    return msg if len(msg) <= 200 else msg[:160] + f"... ({len(msg)} characters)"


def check_event(event: dict) -> None:
    """Validate ``event`` (a FeedbackEvent as JSON: ``user_hash``, ``created_at`` and the rest)
    against the shipped schema (``jsonschema_rs``, draft 2020-12; a few microseconds).

    Raises:
        ValueError: ``"<field>: <what the schema says> (FeedbackEvent schema)"`` for the first
            error; ``<field>`` is the top-level field, the error the most specific one inside
            an ``anyOf`` / ``oneOf``.
    """
    v = _validator()
    if v.is_valid(event):
        return
    err = _specific(next(iter(v.iter_errors(event))))
    raise ValueError(f"{_field(err)}: {_message(err)} (FeedbackEvent schema)")
