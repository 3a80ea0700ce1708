"""The join: completions + feedback -> sealed RewardedSamples (pure logic, no Kafka).

What it knows: per ``completion_id`` one :class:`LabelState` (the CompletionEvent, each
user's last vote, every folded ``event_id``, vote times), kept in an
:class:`ingest.store.JoinStore`: in the worker, its partitions' state in memory
(:class:`ingest.keyed.KeyedState`), checkpointed to SQLite or PostgreSQL with the consumed
offsets, so that a killed worker's successor continues from the last checkpoint (a database
store directly works too). What it does not know: topics, offsets, partitions, files. The
processor (``ingest.processor``) feeds it parsed events and a clock, and writes what
:meth:`Joiner.tick` hands back.

Semantics:

* **Dedupe**: an ``event_id`` folds at most once, ever (open, sealed or dead-lettered).
* **Last vote wins**: votes are keyed by ``user_hash``; a user's vote with the larger
  ``(created_at, arrival order)`` replaces the earlier one until the label is sealed. The
  superseded event still belongs to the sample (``event_ids`` holds every folded event),
  so each accepted event is in exactly one sample or one dead letter.
* **Seal**: when no new vote arrived for ``seal_after_s`` (processing time) or the
  completion is older than ``max_label_age_s`` (its ``created_at``). Sealing emits one
  RewardedSample and removes the open state.
* **Orphans**: feedback whose completion has not arrived waits ``orphan_ttl_s`` and then
  goes to the dead letters (reason ``orphan``).
* **Late**: feedback for an already sealed completion is counted as ``late`` and, by
  ``late_policy``, dead-lettered (default) or dropped (still counted).
* **Unlabelled**: a completion with no vote by ``max_label_age_s`` is dropped (counted).
* **Every kind is a reward component** under the declared reward policy
  (``schemas.reward.RewardPolicy``, ``JoinConfig.reward``): each user's last signal per kind
  (a score: per name) wins, as for thumbs; at sealing the components become the sample's
  columns (``thumb``, ``copied``, ``regenerated``, ``kept_share``, ``followup``, ``scores``),
  the policy combines them into ``reward`` and ``label = reward > 0``, and the sample carries
  the policy's digest. A kind whose weight is 0, a score whose name is not declared or whose
  value is outside its declared range, and an edit's ``final_text`` on a worker that cannot
  decode completions are dead-lettered with the field and reason (outcome ``unsupported``),
  so they are accounted for.
* **Horizons**: a label is sealed no earlier than its completion's ``created_at`` plus the
  policy's slowest weighted horizon (``RewardPolicy.horizon_s``), and, as before, no later
  than ``max_label_age_s`` (``JoinConfig`` refuses a horizon above it).
* **Kept share** of an edit that carries ``final_text``: :func:`kept_share` of the
  completion's text (its token ids decoded by the worker's tokenizer, ``Joiner(decode=)``)
  and the final text, computed at sealing.
* **Validation once**: feedback is validated in full when consumed; a completion only as far
  as the join needs (:func:`parse_completion`: its head), and in full once, when its label is
  sealed or dropped (:meth:`Joiner.validate`). A body that fails then is dead-lettered with the
  field and reason, with one dead letter per vote folded into it (reason ``malformed
  completion``); the label is recorded as sealed, so a replay folds nothing and a later vote
  is late.
* **Retention** (bounded state): the sealed set keeps a row for ``dedupe_retention_s``
  (default 7 days, Kafka's default topic retention) after sealing, and the dedupe set
  (``events``) keeps a row that long after it was recorded *and* as long as its label is
  open or its sealed row is kept; then :meth:`Joiner.prune` deletes it. The horizon must be longer
  than any redelivery window: the uncommitted tail replayed after a crash (seconds), a
  label's whole life (``max_label_age_s`` + ``orphan_ttl_s``, validated), and a client
  retrying from its buffer. As a second guard, a completion whose ``created_at`` and a
  feedback event whose ``created_at`` are older than the horizon are *expired*: counted
  (``completions_expired``, ``feedback_expired``) and not folded (an expired vote is
  dead-lettered with field ``created_at``, so it is still accounted for), because their dedupe rows
  may be gone (a label sealed at the latest ``created_at + max_label_age_s`` keeps its
  row until ``sealed_at + dedupe_retention_s``), so a replay of a pruned record can
  never seal a label twice.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import uuid
from dataclasses import dataclass, field
from typing import Literal

import pydantic
from pydantic import Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from ingest.label import LabelState, Vote, signal_key
from ingest.store import JoinStore
from schemas.settings import topic_names
from schemas.topics import TopicNames
from schemas.reward import RewardPolicy
from schemas.events import (MAX_FUTURE_SKEW_MS, SCHEMA_VERSION, CompletionEvent, DeadLetter, EventTimeMs,
                            FeedbackEvent, IdText, RewardedSample, clamp_event_time, escape_text,
                            now_ms)


log = logging.getLogger("flywheel.ingest.join")


def kept_share(completion_text: str, final_text: str) -> float:
    """The share of a completion's words that the user's final text kept, in [0, 1].

    Words are the whitespace-separated tokens of each text (``str.split()``); the measure is
    the clipped unigram overlap ``sum over words w of min(count in completion, count in
    final) / words in the completion`` (ROUGE-1 recall of the completion against the final
    text). It ignores order (moving a paragraph keeps it) and costs time linear in both
    lengths, so a 65536-character final text costs the same whatever it holds. An empty
    completion: 1.0 when the final text is empty too, else 0.0.
    """
    a = completion_text.split()
    if not a:
        return 0.0 if final_text.split() else 1.0
    b = collections.Counter(final_text.split())
    return sum(min(n, b[w]) for w, n in collections.Counter(a).items()) / len(a)


_S = {"unit": "s"}


@pydantic_dataclass(frozen=True)
class JoinConfig:
    """Join timing and policies: the one declaration of each (``flywheel ingest``'s options,
    ``[ingest]`` in ``flywheel.toml`` and ``FLYWHEEL_INGEST__<FIELD>`` come from these fields
    through ``schemas.options.config_options``).

    Timing (seconds, each > 0):
        seal_after_s: seal a label when no new vote arrived for this long.
        max_label_age_s: seal (or drop, with no votes) once the completion's
            ``created_at`` is this old.
        orphan_ttl_s: how long feedback waits for its completion before it is
            dead-lettered.
        dedupe_retention_s: how long an event_id / sealed completion is remembered for
            dedupe (7 days, Kafka's default topic retention); must exceed
            ``max_label_age_s + orphan_ttl_s``. Set by programs only.
    Policies:
        late_policy: feedback after its label was sealed: ``"deadletter"`` or ``"drop"``
            (counted in ``late`` either way).
        reward: the reward policy (:class:`schemas.reward.RewardPolicy`; ``[reward]`` in
            ``flywheel.toml`` and ``FLYWHEEL_REWARD__<FIELD>``, the CLI's ``--reward-up`` and
            ``--reward-down`` for its thumb values).

    Raises:
        pydantic.ValidationError (a ValueError): a field out of its bounds, an unknown
            ``late_policy``, ``dedupe_retention_s`` not above ``max_label_age_s +
            orphan_ttl_s``, or the reward policy's slowest horizon above ``max_label_age_s``;
            the message names the field.
    """

    seal_after_s: float = Field(600.0, description="Seal a label after this long without a new vote.",
                                json_schema_extra=_S)
    max_label_age_s: float = Field(3600.0, description="Seal (or drop, with no vote) completions this old.",
                                   json_schema_extra=_S)
    orphan_ttl_s: float = Field(600.0, description="How long feedback waits for its completion.",
                                json_schema_extra=_S)
    late_policy: Literal["deadletter", "drop"] = Field(
        "deadletter", description="Feedback after sealing: deadletter | drop.")
    reward: RewardPolicy = Field(default_factory=RewardPolicy, description="The reward policy.",
                                 json_schema_extra={"cli": False})
    dedupe_retention_s: float = Field(
        7 * 24 * 3600.0, description="How long an event id / sealed completion is remembered for dedupe.",
        json_schema_extra={"unit": "s", "cli": False})

    def __post_init__(self):
        # "> 0" is checked here, not by Field(gt=0): schemas.options.option_for turns gt into
        # typer.Option(min_open=True), which typer does not take (a TypeError at import)
        for name in ("seal_after_s", "max_label_age_s", "orphan_ttl_s", "dedupe_retention_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):  # inf: every fold failed (int(inf) in due_at)
                raise ValueError(f"{name}: must be > 0 seconds and finite, got {v}")
        if not self.dedupe_retention_s > self.max_label_age_s + self.orphan_ttl_s:
            raise ValueError(f"dedupe_retention_s: must exceed max_label_age_s + orphan_ttl_s = "
                             f"{self.max_label_age_s + self.orphan_ttl_s:g} s (a redelivery within a "
                             f"label's life must still dedupe), got {self.dedupe_retention_s:g}")
        if self.reward.horizon_s() > self.max_label_age_s:
            raise ValueError(f"reward.{self.reward.slowest()}: {self.reward.horizon_s():g} s is above "
                             f"max_label_age_s = {self.max_label_age_s:g} s (a label is sealed by then, so a "
                             f"signal that late could never count)")


@dataclass
class TickResult:
    """What one :meth:`Joiner.tick` decided; the runtime makes it durable.

    ``samples``: sealed RewardedSamples (their states are claimed, not yet removed: call
    :meth:`Joiner.commit_sealed` once the shard holding them is durable); ``shards``: the
    same samples by shard path.
    ``dead_letters``: one per event of an orphan past ``orphan_ttl_s`` (states removed and
    event_ids recorded as dead-lettered only by :meth:`Joiner.commit_dead`).
    ``dropped``: completion ids dropped with no vote.
    ``bad_ids``: completions whose stored body failed the full validation at sealing: their
    dead letters (the completion's, with field and reason, and one per folded vote) are in
    ``dead_letters``; claimed ``"bad:"`` until :meth:`Joiner.commit_dead` records them.
    """

    samples: list[RewardedSample] = field(default_factory=list)
    shards: dict[str, list[RewardedSample]] = field(default_factory=dict)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    dead_event_ids: list[str] = field(default_factory=list)
    orphan_ids: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    bad_ids: list[str] = field(default_factory=list)
    bad_event_ids: list[str] = field(default_factory=list)


def _payload(raw: bytes | str) -> str:
    return raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw


def _fold_into(st: LabelState, ev: FeedbackEvent, raw: bytes | str | None, eid: str, now: int) -> None:
    """Fold one accepted event into its open label ``st``: the user's vote (a thumb) or signal
    of its kind is replaced when this one is later by ``(created_at, seq)``; its raw JSON is
    kept while the completion has not arrived (an orphan's dead letter needs it); ``now`` in
    ms since the epoch."""
    st.seq += 1
    vote = Vote(event_id=eid, value=None if ev.value is None else float(ev.value),
                created_at=ev.created_at, seq=st.seq, text=ev.final_text)
    last = st.votes if ev.kind == "thumb" else st.signals.setdefault(signal_key(ev), {})
    cur = last.get(ev.user_hash)
    if cur is None or (vote.created_at, vote.seq) > (cur.created_at, cur.seq):
        last[ev.user_hash] = vote
    st.event_ids.append(eid)
    if st.completion is None:
        st.pending_raw[eid] = _raw_text(raw, ev)
    st.first_vote_at = st.first_vote_at or now
    st.last_vote_at = now


def _raw_text(raw: bytes | str | None, ev) -> str:
    """An event's JSON as text (as consumed, else re-serialised): for dead letters and orphans."""
    return _payload(raw) if raw is not None else ev.model_dump_json()


def dead_letter(source_topic: str, key: bytes | str | None, fld: str, reason: str,
                raw: bytes | str, at: int | None = None) -> DeadLetter:
    """Build a :class:`schemas.events.DeadLetter` (payload kept as utf-8 with replacement; the
    model escapes NUL and lone surrogates in any of its strings, so it can always be published)."""
    return DeadLetter(source_topic=source_topic, key=_payload(key) if key is not None else None, field=fld,
                      reason=reason, payload=_payload(raw), at=now_ms() if at is None else at)


def parse_event(model: type[CompletionEvent] | type[FeedbackEvent], raw: bytes | str,
                source_topic: str, key: bytes | str | None = None):
    """Validate one Kafka value as ``model``.

    Returns the event, or a :class:`DeadLetter` naming the field (pydantic ``loc`` joined
    by ``.``, ``"value"`` for undecodable JSON or a null record) and the reason. Never raises.

    "Valid" is the full contract (``schemas.events``): a completion's lists are parsed so
    that ``behavior_logprobs`` is checked against the completion tokens and the routes'
    first dimension against prompt + completion - 1 (the learner's importance ratio and
    router replay need both); the routes' zstd/base64 payload stays opaque (decoded only by
    the learner).

    A feedback value in bytes first tries :func:`_fast_feedback` (the same outcome, about a
    quarter less CPU per vote; ``docs/decisions.md`` D96); whatever it does not accept is
    decided by :func:`_parse_checked`, the per-record path.
    """
    if model is FeedbackEvent and type(raw) is bytes:
        ev = _fast_feedback(raw)
        if ev is not None:
            return ev
    return _parse_checked(model, raw, source_topic, key)


def _parse_checked(model, raw: bytes | str, source_topic: str, key: bytes | str | None):
    """:func:`parse_event` without the feedback fast path: one record validated against the
    full contract, then the duplicate-key check. Never raises."""
    if raw is None:
        return dead_letter(source_topic, key, "value", "null record value (tombstone)", b"")
    try:
        return _parse_event(model, raw, source_topic, key)
    except Exception as exc:  # noqa: BLE001 - any byte sequence must end as a dead letter, never stop the join
        return dead_letter(source_topic, key, "value", f"unparseable record: {type(exc).__name__}: {str(exc)[:200]}", raw)


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _refuse_duplicates(pairs: list[tuple[str, object]]) -> dict:
    d: dict = {}
    for k, v in pairs:
        if k in d:
            raise _DuplicateKey(k)
        d[k] = v
    return d


def duplicate_key(raw: bytes | str) -> str | None:
    """The first key that appears twice in one JSON object of ``raw`` (at any depth), or
    None. JSON parsers disagree on which copy wins, so such a record is refused, never
    guessed at. ``raw`` must already be known to parse."""
    try:
        json.loads(raw, object_pairs_hook=_refuse_duplicates)
    except _DuplicateKey as exc:
        return exc.key
    return None


def _json_strings(m: pydantic.BaseModel) -> int:
    """How many JSON strings (object keys included) the JSON that validated as ``m`` held, if
    none of its keys was repeated: one key per field it set (``model_fields_set``), one more
    for a text, UUID or literal value, and those of its nested models, dicts and lists of text.
    Exact for the event contracts, whose models forbid unknown keys and hold no list of
    objects, and because pydantic turns no JSON number, boolean or null into a ``str``."""
    d = m.__dict__
    n = 0
    for name in m.model_fields_set:
        v = d[name]
        t = type(v)
        if t is str or t is uuid.UUID:
            n += 2
        elif t is list or t is tuple:
            n += 1 + (len(v) if v and isinstance(v[0], (str, uuid.UUID)) else 0)
        elif isinstance(v, pydantic.BaseModel):
            n += 1 + _json_strings(v)
        elif t is dict:
            n += 1 + sum(1 + isinstance(x, str) for x in v.values())
        else:  # a number, a boolean or null
            n += 1
    return n


def _maybe_duplicate_key(raw: bytes | str, ev: pydantic.BaseModel) -> str | None:
    """:func:`duplicate_key` of ``raw``, which validated as the event ``ev``, behind a count.

    When ``raw`` holds exactly two ``"`` per JSON string of ``ev`` (:func:`_json_strings`), no
    key is repeated: a repeated key adds at least its own two quotes to a count that ``ev``
    holds once, and nothing removes quotes (escaped quotes and numbers sent as text only add
    some), so an equal count proves it. Any other count (a duplicate, an escaped quote, a
    number sent as text, a type this count does not know) is decided by :func:`duplicate_key`.
    ``tests/test_ingest_pace.py`` checks the two agree."""
    b = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if len(b) - len(b.replace(b'"', b"")) == 2 * _json_strings(ev):  # (replace: a memchr loop)
        return None
    return duplicate_key(raw)


def _unchecked_text(schema):
    """A copy of a pydantic-core schema without the checks that JSON with no escape sequence
    always passes, and with the length and time checks made in pydantic-core instead of in
    Python (the same conditions):

    * ``schemas.events._check_text`` (no NUL, no lone surrogate) is dropped. Without a ``\\``
      every string is its raw bytes between two quotes, and the JSON parser refuses a raw
      control character in a string (NUL included) and bytes that are not UTF-8 (which
      cannot encode a surrogate): such a string always passes it.
    * pydantic's ``max_length`` / ``min_length`` Python validators on a string (``len``, code
      points) become the string schema's ``max_length`` / ``min_length`` (code points).
    * ``schemas.events._check_ms`` (``MIN_EVENT_TIME_MS <= v <= MAX_EVENT_TIME_MS``) becomes
      ``ge`` / ``le`` on the integer.

    Any other validator is kept as it is (it runs, so it refuses what it refused)."""
    from schemas import events

    if isinstance(schema, list):
        return [_unchecked_text(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    if schema.get("type") == "function-after":
        fn = schema["function"]["function"]
        inner = _unchecked_text(schema["schema"])
        if fn is events._check_text:
            return inner
        if fn is events._check_ms and inner.get("type") == "int" and not {"ge", "le", "gt", "lt"} & set(inner):
            return {**inner, "ge": events.MIN_EVENT_TIME_MS, "le": events.MAX_EVENT_TIME_MS}
        f = getattr(fn, "func", None)  # (pydantic's validators are partials of these two)
        k = {"max_length_validator": "max_length", "min_length_validator": "min_length"}.get(getattr(f, "__name__", ""))
        if (k and f.__module__ == "pydantic._internal._validators" and inner.get("type") == "str"
                and set(fn.keywords) == {k} and not fn.args and k not in inner):
            return {**inner, k: fn.keywords[k]}
        return {**schema, "schema": inner}
    return {k: {name: _unchecked_text(f) for name, f in v.items()} if k == "fields" and isinstance(v, dict)
            else v if k in ("function", "cls", "metadata", "config") else _unchecked_text(v) for k, v in schema.items()}


def _feedback_validator():
    """The pydantic-core validator of :class:`FeedbackEvent` without the checks of
    :func:`_unchecked_text`, under the model's own config (it builds ``FeedbackEvent``
    instances, ``model_validator`` included)."""
    import pydantic_core

    schema = FeedbackEvent.__pydantic_core_schema__
    inner = schema["schema"] if schema.get("type") == "function-after" else schema
    return pydantic_core.SchemaValidator(_unchecked_text(schema), inner.get("config"))


_FEEDBACK_FAST = _feedback_validator()


def _feedback_strings(ev: FeedbackEvent) -> int:
    """:func:`_json_strings` of a :class:`FeedbackEvent`, written out for its fields: one per
    key set; one per value of ``event_id``, ``completion_id``, ``user_hash`` (required), of
    ``kind`` when set, of ``comment``, ``name``, ``final_text`` when not null (only a JSON
    string sets them to a string); two per ``metadata`` pair (text keys and values).
    ``tests/test_ingest_vote_fastpath.py`` checks the two agree."""
    d = ev.__dict__
    fs = ev.__pydantic_fields_set__
    n = len(fs) + 3 + ("kind" in fs) + (d["comment"] is not None) + (d["name"] is not None) + (
        d["final_text"] is not None)
    m = d["metadata"]
    return n + 2 * len(m) if m else n


def _fast_feedback(raw: bytes) -> FeedbackEvent | None:
    """The event that :func:`_parse_checked` returns for ``raw`` (a feedback value), or None
    when that is not shown cheaply (then :func:`_parse_checked` decides: the event, or the
    dead letter with its field and reason). Never raises.

    Taken only for a value with no ``\\`` and no NUL byte (no escape sequence): it is
    validated by ``_FEEDBACK_FAST``, which is the contract's validator less checks such a
    value always passes (:func:`_unchecked_text`), so it accepts exactly the values the full
    validator accepts, as the same event. The duplicate-key proof is
    :func:`_maybe_duplicate_key`'s quote count: with no escape every ``"`` delimits a string,
    so two per string of the event mean no key was repeated; any other count, or a refusal,
    goes to the per-record path."""
    if b"\\" in raw or b"\x00" in raw:
        return None
    try:
        ev = _FEEDBACK_FAST.validate_json(raw)
    except Exception:  # noqa: BLE001 - refused or odd: the per-record path decides, with field and reason
        return None
    if len(raw) - len(raw.replace(b'"', b"")) != 2 * _feedback_strings(ev):
        return None
    return ev


def _parse_event(model, raw: bytes | str, source_topic: str, key: bytes | str | None):
    try:  # fast path: pydantic-core parses and validates in one pass (= model_validate_json)
        ev = model.__pydantic_validator__.validate_json(raw)
    except (pydantic.ValidationError, ValueError):
        pass
    else:
        dup = _maybe_duplicate_key(raw, ev)
        if dup is not None:
            return dead_letter(source_topic, key, dup, f"duplicate key {dup!r} in one JSON object", raw)
        return ev
    try:  # UTF-8 only (json.loads would also read UTF-16/32 and a BOM, which the fast path refuses)
        obj = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw, object_pairs_hook=_refuse_duplicates)
    except _DuplicateKey as exc:  # (a repeated key whose first copy the fast path refused)
        return dead_letter(source_topic, key, exc.key, f"duplicate key {exc.key!r} in one JSON object", raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        return dead_letter(source_topic, key, "value", f"bad JSON: {type(exc).__name__}: {str(exc)[:200]}", raw)
    if not isinstance(obj, dict):
        return dead_letter(source_topic, key, "value", f"expected a JSON object, got {type(obj).__name__}", raw)
    if "schema_version" in obj and obj["schema_version"] != SCHEMA_VERSION:
        return dead_letter(source_topic, key, "schema_version",
                           f"unknown schema_version {repr(obj['schema_version'])[:40]} (this worker reads {SCHEMA_VERSION})", raw)
    bad = lone_surrogate(obj)
    if bad is not None:
        return dead_letter(source_topic, key, bad, "lone surrogate in a string (not valid Unicode text; "
                           "it cannot be stored or written as UTF-8)", raw)
    try:
        return model.model_validate(obj)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "value"
        return dead_letter(source_topic, key, loc, f"{err['msg']} (input {str(err.get('input'))[:80]!r})", raw)


def lone_surrogate(obj) -> str | None:
    """The path (keys and list indices joined by ``.``) of the first string, key or value, of
    a decoded JSON value that holds a lone surrogate (``"\\ud800"`` is valid JSON but not
    Unicode text: UTF-8 cannot encode it, so the state, a shard or a dead letter would fail
    on it), or None. Iterative, so any depth the decoder accepted is walked."""
    stack = [(obj, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "value"
        elif isinstance(v, dict):
            for k, x in v.items():
                p = f"{path}.{k}" if path else str(k)
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return escape_text(p)
                stack.append((x, p))
        elif isinstance(v, list):
            stack.extend((x, f"{path}.{i}" if path else str(i)) for i, x in enumerate(v))
    return None


def check_clock(ev, raw: bytes | str, source_topic: str, key: bytes | str | None, now: int):
    """The clock-skew rule (``schemas.events.clamp_event_time``) on a consumed event's
    ``created_at`` (ms): more than ``MAX_FUTURE_SKEW_MS`` after ``now`` (the worker's clock,
    ms) -> a :class:`DeadLetter` with field ``created_at``; else ``ev`` with ``created_at``
    clamped to at most ``now``, so a vote from a fast clock never outranks the same user's
    later vote. Never raises."""
    if ev.created_at > now:  # (most events are in the past: nothing to do)
        try:
            ev.created_at = clamp_event_time("created_at", ev.created_at, now)
        except ValueError as exc:
            return dead_letter(source_topic, key, "created_at", f"future: {exc}", raw, now)
    return ev


class CompletionHead(pydantic.BaseModel):
    """The fields of a CompletionEvent that the join needs at consume time (the rest of the
    body is validated once, at sealing: :meth:`Joiner.tick`)."""

    model_config = pydantic.ConfigDict(extra="ignore")
    schema_version: Literal[1] = SCHEMA_VERSION
    completion_id: uuid.UUID
    created_at: EventTimeMs  # the contract's own field types: refused here as at sealing
    model_version: IdText


_HEAD_END = b',"prompt_token_ids":'  # serving's layout: the id fields come first, then the token lists
_HEAD_MAX = 4096  # bytes searched for _HEAD_END
_HEAD_VALIDATOR = CompletionHead.__pydantic_validator__


def parse_completion(raw: bytes | str, source_topic: str = "flywheel.completions", key: bytes | str | None = None):
    """Consume-time check of one completion value: a :class:`CompletionHead`, or a
    :class:`DeadLetter` (field and reason) like :func:`parse_event`. Never raises.

    Fast path: when the value starts with the id fields (serving's layout: everything
    before ``"prompt_token_ids"`` within the first ``_HEAD_MAX`` bytes), only that prefix is
    parsed (~2 us instead of ~30-50 us for the full 18 KiB body with its ~500 numbers).
    Otherwise the whole value is validated now (:func:`parse_event`). Either way the full
    :class:`CompletionEvent` contract is checked once, at sealing (or when an unlabelled
    completion is dropped): a body that fails then is dead-lettered with the field and reason,
    with its votes (``Joiner.tick``), and never becomes a sample.
    """
    if isinstance(raw, bytes):
        i = raw.find(_HEAD_END, 0, _HEAD_MAX)
        if i > 0:
            try:
                return _HEAD_VALIDATOR.validate_json(raw[:i] + b"}")  # = CompletionHead.model_validate_json
            except Exception:  # noqa: BLE001 - decided by parse_event below, which never raises
                pass  # decided by the full validation below (dead letter with field + reason)
    return parse_event(CompletionEvent, raw, source_topic, key)


# Joiner.seal copies this with every field replaced (RewardedSample.model_copy(update=...)):
# never read as a sample itself
_SAMPLE_TEMPLATE = RewardedSample.model_construct(**{name: None for name in RewardedSample.model_fields})


class Joiner:
    """Folds parsed events into :class:`LabelState` s and seals them.

    Args:
        store: the durable state, an :class:`ingest.store.JoinStore` (SQLite
            :class:`ingest.state.StateStore` or PostgreSQL :class:`ingest.state_pg.PgStateStore`);
            every method leaves it consistent, so a crash between two calls loses nothing.
        config: :class:`JoinConfig`.
        decode: ``completion_token_ids (list[int]) -> text (str)``, the completion's text for
            an edit's kept share (:func:`kept_share`); None: an edit carrying ``final_text``
            is dead-lettered (field ``final_text``), one carrying ``value`` is folded.

    Times passed as ``now`` are processing time in ms since the epoch (UTC).

    Raises:
        TypeError: ``store`` lacks a method of :class:`ingest.store.JoinStore` (named).
    """

    def __init__(self, store: JoinStore, config: JoinConfig | None = None, decode=None,
                 topics: TopicNames | None = None):
        if not isinstance(store, JoinStore):
            missing = sorted(m for m in dir(JoinStore) if not m.startswith("_") and not hasattr(store, m))
            raise TypeError(f"store: {type(store).__name__} is not a JoinStore (missing {', '.join(missing)})")
        self.store = store
        self.cfg = config or JoinConfig()
        self.decode = decode
        self.undecodable = 0  # final-text edits left out (decode failed) not yet counted in the store
        self.policy_digest = self.cfg.reward.digest()
        # the source topics named in dead letters (default: this process's settings' names)
        names = topics or topic_names()
        self.tc, self.tf = names.completions, names.feedback

    def due_at(self, st: LabelState) -> int:
        """Processing time (ms) at which :meth:`tick` must look at ``st``: an orphan's
        ``first_seen_at + orphan_ttl_s``; a label with no vote at its completion's ``created_at +
        max_label_age_s``; else the earlier of that and ``last_vote_at + seal_after_s``, the
        latter no earlier than ``created_at`` plus the reward policy's slowest horizon (if any)."""
        cfg = self.cfg
        if st.completion is None:
            return st.first_seen_at + int(cfg.orphan_ttl_s * 1000)
        age_due = st.created_at + int(cfg.max_label_age_s * 1000)
        if st.last_vote_at is None:
            return age_due
        quiet = st.last_vote_at + int(cfg.seal_after_s * 1000)
        hz = cfg.reward.horizon_ms  # (0: no horizon, as for thumbs alone)
        return min(age_due, max(quiet, st.created_at + hz) if hz else quiet)

    # -- events ---------------------------------------------------------------------------
    def on_completion(self, ev: CompletionEvent, raw: bytes | str | None = None, now: int | None = None) -> str:
        """Fold one completion; see :meth:`on_completions`."""
        return self.on_completions([(ev, raw)], now)[0]

    def on_completions(self, items: list[tuple[CompletionEvent, bytes | str | None]],
                       now: int | None = None) -> list[str]:
        """Fold ``(event, raw JSON)`` completions in order, in one transaction (a few
        statements for the whole list). ``raw`` is stored as is (the validated bytes as
        consumed; None: re-serialised from the event).

        Returns one outcome per item: ``"new"``, ``"duplicate"`` (its completion is already
        stored, e.g. twice in one batch), ``"sealed"`` (already sealed: ignored, e.g. a replay
        after a crash) or ``"expired"`` (``created_at`` older than ``dedupe_retention_s``:
        ignored, see the module docstring).
        """
        now = now_ms() if now is None else now
        out: list[str] = []
        horizon = now - self.cfg.dedupe_retention_s * 1000
        n: collections.Counter[str] = collections.Counter()  # counter bumps, written once
        with self.store.transaction():
            cids = [str(ev.completion_id) for ev, _ in items]
            sealed = self.store.sealed_among(cids)
            states = self.store.get_many(cids)
            dirty: dict[str, LabelState] = {}
            for (ev, raw), cid in zip(items, cids):
                if ev.created_at < horizon:
                    n["completions_expired"] += 1
                    out.append("expired")
                    continue
                if cid in sealed:
                    n["completions_after_seal"] += 1
                    out.append("sealed")
                    continue
                st = states.get(cid)
                if st is not None and st.completion is not None:
                    n["completions_duplicate"] += 1
                    out.append("duplicate")
                    continue
                if st is None:  # (a claimed "dead:" orphan takes it too: commit_dead keeps it)
                    st = states[cid] = LabelState(completion_id=cid, first_seen_at=now)
                st.completion = raw if raw is not None else ev.model_dump_json()
                st.created_at = ev.created_at
                st.pending_raw = {}
                dirty[cid] = st
                n["completions"] += 1
                out.append("new")
            self.store.put_many([(st, self.due_at(st)) for st in dirty.values()])
            for k, v in n.items():
                self.store.bump(k, v)
        return out

    def on_feedback(self, ev: FeedbackEvent, raw: bytes | str | None = None,
                    now: int | None = None) -> tuple[str, DeadLetter | None]:
        """Fold one feedback event; see :meth:`on_feedbacks`."""
        return self.on_feedbacks([(ev, raw)], now)[0]

    def on_feedbacks(self, items: list[tuple[FeedbackEvent, bytes | str | None]],
                     now: int | None = None) -> list[tuple[str, DeadLetter | None]]:
        """Fold ``(event, raw JSON)`` feedback events in order, in one transaction; the
        result equals folding them one by one.

        Returns one ``(outcome, dead_letter)`` per item: outcome is ``"folded"``,
        ``"duplicate"`` (this event_id was already folded, sealed or dead-lettered, or
        decided earlier in ``items``), ``"late"`` (its label is sealed or being sealed; a
        DeadLetter is returned when ``late_policy="deadletter"``), ``"expired"``
        (``created_at`` older than ``dedupe_retention_s``: counted, DeadLetter returned) or
        ``"unsupported"`` (the reward policy gives it no component: a kind of weight 0, a
        score not declared or outside its range, or an edit's ``final_text`` without a
        ``decode``; DeadLetter returned with the field and reason). A returned
        dead letter is not yet recorded: publish it, then call :meth:`mark_dead` (a crash in
        between re-decides it on replay: dead letters are at-least-once, never lost).
        """
        now = now_ms() if now is None else now
        out: list[tuple[str, DeadLetter | None]] = []
        horizon = now - self.cfg.dedupe_retention_s * 1000
        thumbs_on = self.cfg.reward.thumb_weight > 0
        n: collections.Counter[str] = collections.Counter()  # counter bumps, written once
        with self.store.transaction():
            eids = [str(ev.event_id) for ev, _ in items]
            cids = [str(ev.completion_id) for ev, _ in items]
            seen = self.store.events_seen(eids)
            sealed = self.store.sealed_among(cids)
            states = self.store.get_many(cids)
            dirty: dict[str, LabelState] = {}
            folded: list[tuple[str, str, int]] = []
            dropped: list[str] = []
            for (ev, raw), eid, cid in zip(items, eids, cids):
                if eid in seen:
                    n["feedback_duplicate"] += 1
                    out.append(("duplicate", None))
                    continue
                seen.add(eid)  # decided here: a later copy in ``items`` is a duplicate
                early = self._refuse_early(ev, raw, cid, horizon, now, thumbs_on)
                if early is not None:
                    n[f"feedback_{early[0]}"] += 1
                    out.append(early)
                    continue
                st = states.get(cid)
                # a label claimed for a shard is being sealed (maybe right now, by the seal
                # thread): its sample is decided, so this vote is late like after the seal
                if cid in sealed or (st is not None and (st.claim or "").startswith(("shard:", "bad:"))):
                    n["feedback_late"] += 1
                    if self.cfg.late_policy == "deadletter":
                        out.append(("late", dead_letter(self.tf, cid, "completion_id",
                                                        f"late: label of completion {cid} already sealed", _raw_text(raw, ev), now)))
                    else:
                        dropped.append(eid)
                        out.append(("late", None))
                    continue
                if st is None:
                    st = states[cid] = LabelState(completion_id=cid, first_seen_at=now)
                if eid in st.event_ids:  # also guarded by the events table; kept for in-memory stores
                    out.append(("duplicate", None))
                    continue
                _fold_into(st, ev, raw, eid, now)
                dirty[cid] = st
                folded.append((eid, cid, now))
                n["feedback_folded"] += 1
                out.append(("folded", None))
            self.store.put_many([(st, self.due_at(st)) for st in dirty.values()])
            self.store.add_events(folded)
            if dropped:
                self.store.mark_dead(dropped, now)
            for k, v in n.items():
                self.store.bump(k, v)
        return out

    def _refuse_early(self, ev: FeedbackEvent, raw: bytes | str | None, cid: str, horizon: int, now: int,
                      thumbs_on: bool) -> tuple[str, DeadLetter] | None:
        """``("expired", dead letter)`` for an event older than the dedupe horizon (ms),
        ``("unsupported", dead letter)`` for one the reward policy gives no component, or None:
        the checks that need no label state."""
        if ev.created_at < horizon:
            return "expired", dead_letter(
                self.tf, cid, "created_at", f"expired: created_at {ev.created_at} ms is older than the dedupe "
                f"horizon (dedupe_retention_s={self.cfg.dedupe_retention_s})", _raw_text(raw, ev), now)
        refused = None if ev.kind == "thumb" and thumbs_on else self._refusal(ev)
        if refused is not None:
            return "unsupported", dead_letter(self.tf, cid, refused[0], refused[1], _raw_text(raw, ev), now)
        return None

    def _refusal(self, ev: FeedbackEvent) -> tuple[str, str] | None:
        """Why ``ev`` has no component under the reward policy, as ``(field, reason)``, or None."""
        refused = self.cfg.reward.refusal(ev.kind, ev.name, ev.value)
        if refused is None and ev.kind == "edit" and ev.final_text is not None and self.decode is None:
            return "final_text", ("an edit's final_text needs the completion's text, and this worker has no "
                                  "tokenizer to decode it (send the kept share as value, or give the worker "
                                  "the model's tokenizer.json: docs/data.md)")
        return refused

    # -- time ----------------------------------------------------------------------------
    def validate(self, st: LabelState) -> CompletionEvent | DeadLetter:
        """The full :class:`CompletionEvent` validation of a state's stored body: the one
        validation of a completion's token ids, logprobs and routes (at consume time only its
        head is checked, :func:`parse_completion`). Returns the event, or a DeadLetter (source
        topic completions) naming the field and the reason; also when the body's
        ``completion_id`` / ``created_at`` differ from the head the join used (a duplicated key).
        The returned event's ``created_at`` is the one the join used: clamped to the worker's
        clock at consume time (:func:`check_clock`) when it was ahead of it."""
        ev = parse_event(CompletionEvent, st.completion, self.tc, st.completion_id)
        if isinstance(ev, DeadLetter):
            return ev
        for name, got, want in (("completion_id", str(ev.completion_id), st.completion_id),
                                ("created_at", ev.created_at, st.created_at)):
            # (a created_at ahead of the worker's clock within the tolerance was clamped)
            if got != want and not (name == "created_at" and want < got <= want + MAX_FUTURE_SKEW_MS):
                return dead_letter(self.tc, st.completion_id, name,
                                   f"duplicate key: the body's {name} {got} differs from the first one {want}",
                                   st.completion)
        ev.created_at = st.created_at
        return ev

    def seal(self, st: LabelState, now: int, ev: CompletionEvent | None = None) -> RewardedSample:
        """The RewardedSample of a state with a completion and at least one vote.

        ``ev``: the validated completion (:meth:`validate`); None validates it here (raises
        ``ValueError`` naming the field when the body is malformed). The sample is assembled
        from validated parts without a second validation pass."""
        if ev is None:
            ev = self.validate(st)
            if isinstance(ev, DeadLetter):
                raise ValueError(f"{ev.field}: {ev.reason}")
        up = sum(1 for v in st.votes.values() if v.value > 0)
        down = sum(1 for v in st.votes.values() if v.value < 0)
        c = self.components(st, ev)
        reward = self.cfg.reward.combine(**c)
        n_votes = up + down + sum(len(us) for us in st.signals.values())
        # every field given: a shallow copy of a template with all of them replaced is the
        # model_construct result (no validation, every field set) at half its cost
        return _SAMPLE_TEMPLATE.model_copy(update=dict(
            completion_id=ev.completion_id, model_version=ev.model_version, created_at=ev.created_at,
            user_hash=ev.user_hash, prompt_token_ids=ev.prompt_token_ids,
            completion_token_ids=ev.completion_token_ids, behavior_logprobs=ev.behavior_logprobs,
            sampling=ev.sampling, expert_routes=ev.expert_routes, finish_reason=ev.finish_reason,
            reward=reward, label=reward > 0, n_votes=n_votes,
            votes_up=up, votes_down=down, event_ids=list(st.event_ids), sealed_at=now, split=ev.split,
            reward_policy=self.policy_digest, **c))

    def components(self, st: LabelState, ev: CompletionEvent) -> dict:
        """The component fields of a label's sample (``thumb``, ``copied``, ``regenerated``,
        ``kept_share``, ``followup``, ``scores``; :class:`schemas.events.RewardedSample`),
        each over the users' last signals: thumbs and followups averaged (+1/-1), copies and
        regenerates counted (users), kept shares averaged (an edit with ``final_text``:
        :func:`kept_share` against ``ev``'s decoded completion; left out when this joiner
        has no ``decode``, and when ``decode`` raises or returns no text: counted in
        ``edit_undecodable``, logged, the label sealed from its other signals), scores averaged
        per name."""
        thumbs = [v.value for v in st.votes.values()]
        sig = st.signals
        shares = []
        text = None
        for v in sig.get("edit", {}).values():
            if v.text is None:
                shares.append(v.value)
            elif self.decode is not None:
                if text is None:
                    try:
                        text = self.decode(ev.completion_token_ids)
                        if not isinstance(text, str):
                            raise TypeError(f"decode returned {type(text).__name__}, not str")
                    except Exception as exc:  # noqa: BLE001 - one undecodable completion must not stop every seal
                        log.warning("completion %s: its text cannot be decoded (%s: %s); its final_text edits are "
                                    "left out of its reward", st.completion_id, type(exc).__name__, str(exc)[:200])
                        text = False
                if text is False:
                    self.undecodable += 1
                else:
                    shares.append(kept_share(text, v.text))
        follow = [v.value for v in sig.get("followup", {}).values()]
        scores = {k[6:]: sum(v.value for v in us.values()) / len(us)
                  for k, us in sorted(sig.items()) if k.startswith("score:") and us}
        return dict(thumb=sum(thumbs) / len(thumbs) if thumbs else None,
                    copied=len(sig.get("copy", ())), regenerated=len(sig.get("regenerate", ())),
                    kept_share=sum(shares) / len(shares) if shares else None,
                    followup=sum(follow) / len(follow) if follow else None, scores=scores)

    def _malformed(self, st: LabelState, dl: DeadLetter, res: TickResult, now: int) -> None:
        """A completion whose body failed :meth:`validate`: its dead letter, and one per folded
        vote (each accepted event ends in exactly one sample or dead letter)."""
        res.dead_letters.append(dl)
        for eid in st.event_ids:
            res.dead_letters.append(dead_letter(
                self.tf, st.completion_id, "completion_id",
                f"malformed completion: {st.completion_id} failed validation ({dl.field}: {dl.reason})",
                json.dumps({"event_id": eid, "completion_id": st.completion_id}), now))
            res.bad_event_ids.append(eid)
        res.bad_ids.append(st.completion_id)

    def quarantine(self, bad: list[tuple[RewardedSample, str, str]], now: int | None = None) -> TickResult:
        """Sealed samples that cannot be written (a value that passed the contract but that the
        shard or the samples topic refuses), as ``(sample, field, reason)``: each label is claimed
        ``"bad:"`` (so a shard holding the others, once written, never marks it sealed, also
        after a crash: :meth:`recover` releases a dead owner's ``"bad:"`` claim and it is
        quarantined again), and the returned :class:`TickResult` holds their dead letters (the
        completion's, reason ``unwritable sample: ...`` with the field, and one per folded vote)
        in ``dead_letters`` with ``bad_ids`` / ``bad_event_ids`` for :meth:`commit_dead`."""
        now = now_ms() if now is None else now
        res = TickResult()
        with self.store.transaction():
            for s, fld, reason in bad:
                cid = str(s.completion_id)
                st = self.store.get(cid)
                body = st.completion if st is not None and st.completion else json.dumps({"completion_id": cid})
                dl = dead_letter(self.tc, cid, fld, f"unwritable sample: {reason}", body, now)
                st = st or LabelState(completion_id=cid, event_ids=list(s.event_ids))
                self._malformed(st, dl, res, now)
            self.store.claim_many([(cid, "bad:") for cid in res.bad_ids])
            self.store.bump("samples_quarantined", len(res.bad_ids))
        return res

    def tick(self, now: int | None = None, shard_for=None, limit: int = 10_000) -> TickResult:
        """Decide every state due by ``now``: seal, orphan, or drop.

        Args:
            now: processing time, ms.
            shard_for: ``RewardedSample -> str``, the shard path that will hold the sample
                (``samplestore.shards.shard_path``); recorded in the claim so that recovery after
                a crash can tell whether the shard was written (default: ``""``).
            limit: most states looked at in one tick.

        Sealed states are *claimed* (hidden from later ticks) with their shard path and kept
        until :meth:`commit_sealed`; orphans are claimed until :meth:`commit_dead`; dropped
        completions are removed here (nothing to write). Every stored completion body is
        validated here, once (:meth:`validate`); one that fails is claimed ``"bad:"`` and
        dead-lettered with its votes (``bad_ids``, until :meth:`commit_dead`), never sealed.
        Returns a :class:`TickResult` whose ``shards`` maps shard path -> its samples.
        """
        now = now_ms() if now is None else now
        res = TickResult()
        claims: list[tuple[str, str]] = []
        with self.store.transaction():
            for st in self.store.due(now, limit):
                if st.completion is None:
                    for eid in st.event_ids:
                        res.dead_letters.append(dead_letter(
                            self.tf, st.completion_id, "completion_id",
                            f"orphan: completion {st.completion_id} not seen within orphan_ttl_s="
                            f"{self.cfg.orphan_ttl_s:g}", st.pending_raw.get(eid, json.dumps({"event_id": eid})), now))
                        res.dead_event_ids.append(eid)
                    res.orphan_ids.append(st.completion_id)
                    claims.append((st.completion_id, "dead:"))
                elif isinstance(ev := self.validate(st), DeadLetter):
                    self._malformed(st, ev, res, now)
                    claims.append((st.completion_id, "bad:"))
                elif not (st.votes or any(st.signals.values())):
                    res.dropped.append(st.completion_id)
                    self.store.delete(st.completion_id)
                    self.store.bump("completions_dropped_unlabelled")
                else:
                    sample = self.seal(st, now, ev)
                    path = shard_for(sample) if shard_for else ""
                    res.samples.append(sample)
                    res.shards.setdefault(path, []).append(sample)
                    claims.append((st.completion_id, "shard:" + path))
            self.store.claim_many(claims)
            if self.undecodable:
                self.store.bump("edit_undecodable", self.undecodable)
                self.undecodable = 0
        return res

    def recover(self, shard_exists, previous_owners: bool = False) -> dict[str, int]:
        """Finish or undo the claims that dead workers left (at start, and periodically).

        Only claims whose owner is dead (:meth:`ingest.state.StateStore.owner_alive`) are
        touched; a live worker's claims (it may be writing that shard now) and this worker's
        own are left alone (counted in ``live``). A dead owner's state claimed for a shard
        that exists (``shard_exists(path) -> bool``) is marked sealed (the sample is on disk;
        sealing again would count it twice); any other dead claim is released, so the label is
        sealed again (its shard never appeared) or the orphan dead-lettered again (dead letters
        are at-least-once). Returns ``{"sealed", "released", "live"}`` counts.

        ``previous_owners``: the store holds partitions this worker owns now
        (:class:`ingest.keyed.KeyedState`), so another worker's claim there is a previous
        owner's, which can no longer checkpoint it: its state claimed for a shard that exists
        (shards are renamed into place whole) is marked sealed even while that worker still
        runs.
        """
        out = {"sealed": 0, "released": 0, "live": 0}
        alive: dict[str | None, bool] = {}
        dead_owners = set()
        with self.store.transaction():
            for cid, claim, owner in self.store.claims():
                if owner == self.store.owner:
                    out["live"] += 1
                    continue
                if owner not in alive:
                    alive[owner] = self.store.owner_alive(owner)
                if alive[owner] and not previous_owners:
                    out["live"] += 1
                    continue
                if claim.startswith("shard:") and claim[6:] and shard_exists(claim[6:]):
                    self.store.mark_sealed(cid, now_ms(), claim[6:])
                    self.store.delete(cid)
                    out["sealed"] += 1
                elif alive[owner]:
                    out["live"] += 1
                else:
                    dead_owners.add(owner)
                    self.store.unclaim(cid)
                    out["released"] += 1
        for owner in dead_owners | set(self.store.dead_owners()):  # also those that held no claim
            self.store.forget_owner(owner)
        return out

    def prune(self, now: int | None = None) -> tuple[int, int]:
        """Forget dedupe rows (``events``) and sealed rows older than ``dedupe_retention_s``
        (see the module docstring for why that is safe). Returns ``(events, sealed)`` deleted."""
        now = now_ms() if now is None else now
        with self.store.transaction():
            n = self.store.prune(now - int(self.cfg.dedupe_retention_s * 1000))
            self.store.bump("pruned_events", n[0])
            self.store.bump("pruned_sealed", n[1])
        return n

    def commit_sealed(self, samples: list[RewardedSample], shard: str) -> None:
        """Mark ``samples`` sealed (state removed) once ``shard`` holding them is durable."""
        with self.store.transaction():
            self.store.mark_sealed_many([(str(s.completion_id), s.sealed_at, shard) for s in samples])
            self.store.delete_many([str(s.completion_id) for s in samples])
            self.store.bump("samples", len(samples))

    def commit_dead(self, res: TickResult, now: int | None = None) -> None:
        """Mark the orphans and malformed completions (``bad_ids``, removed and recorded as
        sealed) of ``res`` dead-lettered once their dead letters are published.

        An orphan's state is removed unless something was folded into it while its dead
        letters were being published (the consumer runs concurrently with the seal thread):
        then only the dead-lettered votes are removed, the claim is released, and a state
        still without its completion waits ``orphan_ttl_s`` again from ``now``."""
        now = now_ms() if now is None else now
        dead = set(res.dead_event_ids)
        with self.store.transaction():
            self.store.mark_dead(res.dead_event_ids, now)
            gone = []
            for cid in res.orphan_ids:
                st = self.store.get(cid)
                if st is None:
                    continue
                rest = [e for e in st.event_ids if e not in dead]
                if not rest and st.completion is None:
                    gone.append(cid)
                    continue
                st.event_ids = rest
                st.votes = {u: v for u, v in st.votes.items() if v.event_id not in dead}
                st.signals = {k: {u: v for u, v in us.items() if v.event_id not in dead} for k, us in st.signals.items()}
                st.pending_raw = {e: r for e, r in st.pending_raw.items() if e not in dead}
                if st.completion is None:
                    st.first_seen_at = now
                self.store.unclaim(cid)
                self.store.put(st, self.due_at(st))
            for cid in res.bad_ids:  # decided: a replay of it is ignored, a later vote is late
                self.store.mark_sealed(cid, now, "")
                gone.append(cid)
            self.store.mark_dead(res.bad_event_ids, now)
            self.store.delete_many(gone)
            self.store.bump("feedback_orphaned", len(res.dead_event_ids))
            self.store.bump("deadletter_malformed_completion", len(res.bad_ids))
            self.store.bump("feedback_completion_malformed", len(res.bad_event_ids))

    def mark_dead(self, event_ids: list[str]) -> None:
        """Record ``event_ids`` as dead-lettered (published); later copies are duplicates."""
        with self.store.transaction():
            self.store.mark_dead(event_ids)

    def release(self, completion_ids: list[str]) -> None:
        """Undo a claim (the shard or dead letter could not be written); retried next tick."""
        with self.store.transaction():
            for cid in completion_ids:
                self.store.unclaim(cid)
