"""Event contracts on Kafka (DESIGN §2): CompletionEvent, FeedbackEvent, RewardedSample.

Internal events forbid unknown fields: a producer that adds a field without bumping
``schema_version`` is a bug we want to see, not data we silently drop. Events travel as
UTF-8 JSON (``to_bytes`` / ``from_bytes``); expert routes travel zstd-compressed and
base64-encoded inside the JSON (:class:`ExpertRoutes`).
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
import uuid
from typing import Annotated, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from schemas.reward import REWARD_LIMIT

SCHEMA_VERSION = 1


def now_ms() -> int:
    """Wall-clock time in ms since the epoch (UTC)."""
    return int(time.time() * 1000)


def hash_user(user_id: str, salt: str) -> str:
    """Salted SHA-256 of a raw user id (hex, 32 chars). Raw ids never leave the pod."""
    return hashlib.sha256(f"{salt}:{user_id}".encode()).hexdigest()[:32]


# ----------------------------------------------------------------------------- bounds
# Every numeric field of every event has a stated range, and every string refuses NUL and lone
# surrogates, in the models and in the exported JSON Schemas alike (D43): a
# producer in another language that validates with the published schema refuses what Flywheel
# refuses. Integer ranges are those of the Arrow column the value lands in (schemas.arrow).

# Event times are ms since the epoch (UTC). A value below this bound (2001-09-09T01:46:40Z)
# is refused: it is almost surely seconds, and a vote stamped in seconds would look 55 years
# old to the join.
MIN_EVENT_TIME_MS = 10**12
# ... and one above 2100-01-01T00:00:00Z is refused: it is no clock's reading, and an
# unbounded integer would overflow ingest's state store.
MAX_EVENT_TIME_MS = 4_102_444_800_000
MAX_DURATION_MS = 86_400_000.0  # ttft_ms, latency_ms: at most one day
INT32_MAX = 2**31 - 1  # token ids, counts, top_k, max_tokens, route shape (Arrow int32)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # sampling seed (Arrow int64)
FLOAT32_MAX = 3.4028234663852886e38  # largest finite float32: logprobs (Arrow float32)
# A reward's |value| and a feedback score's |value|: the bound of every reward policy
# (schemas.reward.REWARD_LIMIT: no weight, thumb value, score range or clip exceeds it, so a
# combined reward never does). One constant, so the contract refuses what no policy produces.
SCORE_MAX_ABS = REWARD_LIMIT
MAX_ID_CHARS = 256  # request_id, pod, user_hash, model_version, event ids, topic, field
# Text: no NUL (U+0000) and no lone surrogate (U+D800..U+DFFF), written as the allowed ranges
# U+0001..U+D7FF and U+E000..U+10FFFF (the last endpoint a literal character, not an escape),
# so one pattern means the same in Python's ``re`` (jsonschema), Rust's ``regex``
# (jsonschema-rs: it refuses a surrogate escape) and ECMA-262 with the ``u`` flag (ajv).
TEXT_PATTERN = "^[\\u0001-\\ud7ff\\ue000-\U0010ffff]*$"
_UNSAFE_TEXT = re.compile("[\x00\ud800-\udfff]")


class _JsonKeywords:
    """Annotation that adds JSON Schema keywords for a check a validator does (pydantic's
    ``__get_pydantic_json_schema__`` hook), so the exported schema states the same rule.
    A keyword given as None is removed."""

    def __init__(self, **keywords):
        self.keywords = keywords

    def __get_pydantic_json_schema__(self, core_schema, handler):
        out = handler(core_schema)
        for k, v in self.keywords.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = v
        return out


def _check_text(v: str) -> str:
    """Refuse NUL and lone surrogates (``ValueError`` naming the index and code point)."""
    m = _UNSAFE_TEXT.search(v)
    if m is not None:
        what = "NUL" if m.group() == "\x00" else "a lone surrogate"
        raise ValueError(f"{what} (U+{ord(m.group()):04X}) at index {m.start()}: text must be valid "
                         f"Unicode without NUL")
    return v


def _check_ms(v: int) -> int:
    """Refuse an event time outside [MIN_EVENT_TIME_MS, MAX_EVENT_TIME_MS], saying why."""
    if v < MIN_EVENT_TIME_MS:
        unit = "seconds" if 10**9 <= v < 10**11 else "not milliseconds"
        raise ValueError(f"{v} is before 2001-09-09 in ms since the epoch (looks like {unit}); "
                         f"event times are milliseconds since the epoch, UTC")
    if v > MAX_EVENT_TIME_MS:
        raise ValueError(f"{v} is after 2100-01-01 in ms since the epoch ({MAX_EVENT_TIME_MS}); "
                         f"event times are milliseconds since the epoch, UTC")
    return v


#: Any text field: no NUL, no lone surrogate.
Text = Annotated[str, AfterValidator(_check_text), _JsonKeywords(pattern=TEXT_PATTERN)]
#: An identifier-like text field (ids, names, pods): 1 to MAX_ID_CHARS characters, as :data:`Text`.
IdText = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS), AfterValidator(_check_text),
                   _JsonKeywords(pattern=TEXT_PATTERN)]
#: An event time, ms since the epoch (UTC), within [MIN_EVENT_TIME_MS, MAX_EVENT_TIME_MS].
EventTimeMs = Annotated[int, AfterValidator(_check_ms),
                        _JsonKeywords(minimum=MIN_EVENT_TIME_MS, maximum=MAX_EVENT_TIME_MS)]
#: A token id of the model's vocabulary, stored as Arrow int32: [0, 2**31 - 1].
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
#: A count stored as Arrow int32: [0, 2**31 - 1].
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
#: A log-probability: finite as float32, <= 0.
Logprob = Annotated[float, Field(ge=-FLOAT32_MAX, le=0.0)]
#: A duration in ms: [0, MAX_DURATION_MS].
DurationMs = Annotated[float, Field(ge=0.0, le=MAX_DURATION_MS)]


def escape_text(v: str) -> str:
    """``v`` with each NUL and lone surrogate written as a ``\\uXXXX`` escape (6 characters):
    what a dead letter carries, so a record is quarantined whatever bytes it holds."""
    return _UNSAFE_TEXT.sub(lambda m: f"\\u{ord(m.group()):04x}", v)


# Clock skew. One rule for every receiver, HTTP (serving) and Kafka
# (ingest) alike: an event time more than MAX_FUTURE_SKEW_MS ahead of the receiver's clock is
# refused (422 over HTTP; dead-lettered with field ``created_at`` on Kafka); one within the
# tolerance is clamped to the receiver's clock, so a vote from a fast clock never outranks the
# same user's later real vote by more than the receiver's own ordering.
MAX_FUTURE_SKEW_MS = 300_000


def clamp_event_time(name: str, v: int, now: int | None = None) -> int:
    """Apply the clock-skew rule to an event time ``v`` (ms since the epoch, UTC).

    Returns ``min(v, now)``; raises ``ValueError`` naming ``name`` when ``v`` is more than
    :data:`MAX_FUTURE_SKEW_MS` after ``now`` (default: this process's wall clock, ms).
    """
    now = now_ms() if now is None else now
    if v > now + MAX_FUTURE_SKEW_MS:
        raise ValueError(f"{name}: {v} is {v - now} ms in the future, beyond the "
                         f"{MAX_FUTURE_SKEW_MS} ms clock-skew tolerance")
    return min(v, now)


class _Event(BaseModel):
    """Base of every Kafka event: unknown fields and non-finite floats (NaN, +-Infinity) are
    refused at validation, so neither reaches a sample or an importance ratio."""

    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)

    def to_bytes(self) -> bytes:
        """JSON encoding used on Kafka."""
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, raw: bytes | str):
        """Parse and validate; raises ``pydantic.ValidationError`` naming the bad field."""
        return cls.model_validate_json(raw)


class SamplingParams(_Event):
    """The sampling parameters a completion was generated with.

    Behavior logprobs are always **raw**: log p of the sampled token under the model's
    unprocessed distribution at temperature 1 (no temperature, top-p or top-k applied),
    so the learner's importance ratio compares like with like (trl#4159, trl#6789).

    Fields:
        temperature: in [0, 2]; 0 means greedy.
        top_p: in (0, 1]; 1 disables nucleus filtering.
        top_k: in [-1, 2**31 - 1]; 0 or -1 disables; else keep the k most likely tokens.
        max_tokens: in [1, 2**31 - 1], new tokens at most.
        seed: per-request RNG seed in [-2**63, 2**63 - 1] (int64), or None.
    """

    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)
    max_tokens: int = Field(128, ge=1, le=INT32_MAX)
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    logprobs_kind: Literal["raw"] = "raw"


BASE64_PATTERN = r"^[A-Za-z0-9+/]*={0,2}$"  # RFC 4648 base64, padded
_BASE64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _check_base64(v: str) -> str:
    """:data:`BASE64_PATTERN` without a regex: alphabet characters, then at most two ``=``.
    The same rule at a fifth of the cost on a 10 KB routes string (the pattern was about a
    third of a completion's validation, D65); the exported schema states the pattern."""
    body = v.rstrip("=")
    if len(v) - len(body) > 2 or not body.isascii() or body.encode().translate(None, _BASE64_ALPHABET):
        raise ValueError(f"not base64 (RFC 4648 alphabet, at most two '=' at the end; pattern {BASE64_PATTERN})")
    return v


#: A base64 string (:data:`BASE64_PATTERN`), checked by :func:`_check_base64`.
Base64Text = Annotated[str, AfterValidator(_check_base64), _JsonKeywords(pattern=BASE64_PATTERN)]


class ExpertRoutes(_Event):
    """Expert routes of one completion, vLLM's layout.

    ``to_array()`` gives a ``(prompt_len + completion_len - 1, num_hidden_layers, top_k)``
    array of dtype uint8 (uint16 when there are more than 256 experts): the experts selected
    for every token that went through a forward pass, one column per transformer layer in
    order (a dense layer's column is 0 and is never read; D38).
    """

    shape: tuple[Count, Count, Count]
    dtype: Literal["uint8", "uint16"] = "uint8"
    codec: Literal["zstd"] = "zstd"
    data: Base64Text  # base64 of the zstd-compressed C-order bytes

    @classmethod
    def from_array(cls, routes: np.ndarray) -> "ExpertRoutes":
        """Encode a ``(T-1, L, k)`` integer array (values must fit the dtype)."""
        import zstandard

        if routes.ndim != 3:
            raise ValueError(f"expert_routes: expected 3 dims (tokens-1, layers, top_k), got {routes.shape}")
        dtype = "uint8" if routes.size == 0 or int(routes.max()) < 256 else "uint16"
        arr = np.ascontiguousarray(routes.astype(dtype))
        comp = zstandard.ZstdCompressor(level=3).compress(arr.tobytes())
        return cls(shape=tuple(int(x) for x in arr.shape), dtype=dtype,
                   data=base64.b64encode(comp).decode())

    def to_array(self) -> np.ndarray:
        """Decode to a ``(T-1, L, k)`` array of ``self.dtype``.

        Raises:
            ValueError: the payload does not decode to ``shape``.
        """
        import zstandard

        try:
            raw = zstandard.ZstdDecompressor().decompress(base64.b64decode(self.data))
        except (zstandard.ZstdError, ValueError) as exc:  # (binascii.Error is a ValueError)
            raise ValueError(f"expert_routes: payload does not decode: {exc}") from exc
        arr = np.frombuffer(raw, dtype=self.dtype)
        if arr.size != int(np.prod(self.shape)):
            raise ValueError(f"expert_routes: payload has {arr.size} values, shape {self.shape} needs "
                             f"{int(np.prod(self.shape))}")
        return arr.reshape(self.shape)


class CompletionEvent(_Event):
    """One served completion, as the serving pod logged it (key: completion_id).

    Shapes: ``behavior_logprobs`` has one float32 per completion token;
    ``expert_routes`` is ``(len(prompt) + len(completion) - 1, num_hidden_layers, top_k)`` or None
    for dense models. Times: ``created_at`` ms since epoch UTC; ``ttft_ms``/``latency_ms`` ms.

    Bounds (also in the exported JSON Schema): ``created_at`` in [10**12, 4102444800000]
    (2001-09-09 to 2100-01-01); token ids in [0, 2**31 - 1] (int32); logprobs in
    [-FLOAT32_MAX, 0]; ``ttft_ms``/``latency_ms`` in [0, 86400000]; text fields without NUL
    or lone surrogates, ids 1-256 characters.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    completion_id: uuid.UUID
    request_id: IdText
    created_at: EventTimeMs
    model_version: IdText
    pod: IdText
    user_hash: IdText
    prompt_token_ids: list[TokenId] = Field(min_length=1)
    completion_token_ids: list[TokenId]
    behavior_logprobs: list[Logprob]
    sampling: SamplingParams
    expert_routes: ExpertRoutes | None = None
    finish_reason: Literal["stop", "length", "abort"]
    ttft_ms: DurationMs
    latency_ms: DurationMs
    # ``eval`` completions are held out: their feedback is measured, never trained on
    # (chosen by serving with schemas.split.choose_split). Last field: the join reads the head.
    split: Literal["train", "eval"] = "train"

    @model_validator(mode="after")
    def _check_lengths(self):
        if len(self.behavior_logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"behavior_logprobs: {len(self.behavior_logprobs)} values for "
                f"{len(self.completion_token_ids)} completion tokens")
        if self.expert_routes is not None:
            want = len(self.prompt_token_ids) + len(self.completion_token_ids) - 1
            if self.expert_routes.shape[0] != want:
                raise ValueError(f"expert_routes: {self.expert_routes.shape[0]} token rows, expected "
                                 f"prompt+completion-1 = {want}")
        return self


FeedbackKind = Literal["thumb", "score", "edit", "regenerate", "copy", "followup"]

SCORE_NAME_PATTERN = r"^[A-Za-z0-9_.:/-]{1,64}$"
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_FINAL_TEXT_CHARS = 65536  # an edit's final_text
#: The namespace of serving-derived feedback ids: a ``regenerate`` or ``followup`` that serving
#: emits has ``event_id = uuid5(SIGNAL_NAMESPACE, f"{kind}:{earlier_completion_id}:{later_completion_id}")``
#: (:func:`signal_event_id`), so a retried request or a second pod yields the same id (deduped).
SIGNAL_NAMESPACE = uuid.UUID("6f1c0d2e-8a4b-5c3d-9e7f-0a1b2c3d4e5f")


def signal_event_id(kind: str, earlier_completion_id: uuid.UUID | str, later_completion_id: uuid.UUID | str) -> uuid.UUID:
    """The deterministic ``event_id`` of a serving-derived signal (``regenerate`` or
    ``followup``) about ``earlier_completion_id``, seen when ``later_completion_id`` was asked:
    ``uuid5(SIGNAL_NAMESPACE, f"{kind}:{earlier}:{later}")`` with both ids in canonical form."""
    return uuid.uuid5(SIGNAL_NAMESPACE, f"{kind}:{uuid.UUID(str(earlier_completion_id))}:"
                                        f"{uuid.UUID(str(later_completion_id))}")


# the per-kind value rules, stated once for the model (_check_value) and the exported schema
_KIND_VALUES = {"thumb": (1.0, -1.0), "copy": (1.0,), "regenerate": (1.0,), "followup": (1.0, -1.0)}
_KIND_MEANING = {"thumb": "a thumb is +1 or -1", "copy": "a copy is 1 (the user copied the reply)",
                 "regenerate": "a regenerate is 1 (the user asked again)",
                 "followup": "a followup is +1 (satisfied) or -1 (dissatisfied)"}


class FeedbackEvent(_Event):
    """One user signal about a completion (key: completion_id).

    ``event_id`` is set by the client and is the idempotency key: the same event delivered
    twice counts once. Per ``kind`` (each a component of the reward policy,
    ``schemas.reward``):

    * ``thumb``: ``value`` +1 (up) or -1 (down).
    * ``score``: ``name`` says what it scores (e.g. ``helpfulness``, pattern
      ``[A-Za-z0-9_.:/-]{1,64}``), ``value`` any number in [-1e6, 1e6]; ``name`` is refused
      on other kinds.
    * ``copy``: ``value`` 1 (the user copied the reply).
    * ``regenerate``: ``value`` 1 (the user asked again: a negative signal for this
      completion).
    * ``edit``: exactly one of ``value``, the share of the reply the user kept, in [0, 1], or
      ``final_text``, the user's final text (at most 65536 characters, no NUL or lone
      surrogate), from which the join computes the kept share against the completion's text
      (``ingest.join.kept_share``). ``final_text`` is refused on other kinds, and ``value`` is
      required on every other kind.
    * ``followup``: ``value`` +1 (the next turn shows the user satisfied) or -1 (dissatisfied).

    ``regenerate`` and ``followup`` that serving emits carry ``metadata={"source": "serving"}``
    and the deterministic ``event_id`` of :func:`signal_event_id`. ``metadata``: at most 16
    string -> string pairs (keys 1-64 chars, values at most 512 chars).

    ``name``, ``metadata`` and ``final_text`` are optional and left out of the JSON when unset
    (and ``value`` when an edit carries ``final_text``), so an event that uses none of them
    encodes exactly as before they existed.

    Bounds (also in the exported JSON Schema, the per-kind rules as ``allOf`` if/then):
    ``created_at`` in [10**12, 4102444800000] ms; ``value`` as above, in [-1e6, 1e6] for a
    score; text without NUL or lone surrogates.
    """

    model_config = ConfigDict(json_schema_extra={"allOf": [
        # kind absent means "thumb" (the default), and `properties` holds vacuously then
        {"if": {"properties": {"kind": {"const": "thumb"}}},
         "then": {"properties": {"value": {"enum": [1, -1]}}, "required": ["value"]}},
        {"if": {"properties": {"kind": {"const": "score"}}, "required": ["kind"]},
         "then": {"properties": {"name": {"type": "string"}}, "required": ["name", "value"]},
         "else": {"properties": {"name": {"type": "null"}}}},
        {"if": {"properties": {"kind": {"const": "copy"}}, "required": ["kind"]},
         "then": {"properties": {"value": {"const": 1}}, "required": ["value"]}},
        {"if": {"properties": {"kind": {"const": "regenerate"}}, "required": ["kind"]},
         "then": {"properties": {"value": {"const": 1}}, "required": ["value"]}},
        {"if": {"properties": {"kind": {"const": "followup"}}, "required": ["kind"]},
         "then": {"properties": {"value": {"enum": [1, -1]}}, "required": ["value"]}},
        {"if": {"properties": {"kind": {"const": "edit"}}, "required": ["kind"]},
         "then": {"oneOf": [
             {"properties": {"value": {"type": "number", "minimum": 0, "maximum": 1},
                             "final_text": {"type": "null"}}, "required": ["value"]},
             {"properties": {"final_text": {"type": "string"}, "value": {"type": "null"}},
              "required": ["final_text"]}]},
         "else": {"properties": {"final_text": {"type": "null"}}}},
    ]})

    schema_version: Literal[1] = SCHEMA_VERSION
    event_id: uuid.UUID
    completion_id: uuid.UUID
    user_hash: IdText
    kind: FeedbackKind = "thumb"
    # a JSON number: true or "1" is refused, never read as +1; None only for an edit with final_text
    value: Annotated[float, Strict(), Field(ge=-SCORE_MAX_ABS, le=SCORE_MAX_ABS)] | None = None
    comment: Annotated[Text, Field(max_length=4096)] | None = None
    created_at: Annotated[EventTimeMs, Strict()]
    name: Annotated[str, Field(pattern=SCORE_NAME_PATTERN)] | None = None
    metadata: Annotated[dict[Annotated[Text, Field(min_length=1, max_length=MAX_METADATA_KEY_CHARS)],
                             Annotated[Text, Field(max_length=MAX_METADATA_VALUE_CHARS)]],
                        Field(max_length=MAX_METADATA_KEYS),
                        _JsonKeywords(patternProperties=None, propertyNames={
                            "minLength": 1, "maxLength": MAX_METADATA_KEY_CHARS, "pattern": TEXT_PATTERN},
                            additionalProperties={"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS,
                                                  "pattern": TEXT_PATTERN})] | None = None
    final_text: Annotated[Text, Field(max_length=MAX_FINAL_TEXT_CHARS)] | None = None

    @model_validator(mode="after")
    def _check_value(self):
        kind, v = self.kind, self.value
        if kind == "edit":
            if (v is None) == (self.final_text is None):
                raise ValueError("value: an edit carries exactly one of value (the kept share, in [0, 1]) "
                                 "or final_text (the user's final text)")
            if v is not None and not 0.0 <= v <= 1.0:
                raise ValueError(f"value: an edit's value is the kept share, in [0, 1], got {v}")
        else:
            if v is None:
                raise ValueError(f"value: a {kind} needs a value")
            if self.final_text is not None:
                raise ValueError(f"final_text: only an edit has a final_text, not a {kind}")
            allowed = _KIND_VALUES.get(kind)
            if allowed is not None and v not in allowed:
                raise ValueError(f"value: {_KIND_MEANING[kind]}, got {v}")
        if kind == "score" and self.name is None:
            raise ValueError("name: a score needs a name (what it scores, e.g. 'helpfulness')")
        if kind != "score" and self.name is not None:
            raise ValueError(f"name: only a score has a name, not a {kind}")
        return self

    def to_bytes(self) -> bytes:
        """JSON encoding used on Kafka (``name``, ``metadata``, ``final_text`` and an edit's
        absent ``value`` omitted when unset)."""
        unset = {f for f in ("name", "metadata", "final_text", "value") if getattr(self, f) is None}
        return self.model_dump_json(exclude=unset or None).encode()


def _distinct(v: list[str]) -> list[str]:
    """Refuse a list that holds an id twice (``ValueError`` naming ``event_ids``)."""
    if len(set(v)) != len(v):
        raise ValueError("event_ids: duplicates")
    return v


#: A label's feedback event ids, each once (:class:`RewardedSample`, :class:`SampleNotice`).
EventIds = Annotated[list[IdText], AfterValidator(_distinct)]
#: A reward policy's reward: [-REWARD_LIMIT, REWARD_LIMIT] = [-1e6, 1e6], what any policy's clip
#: allows (a learner's advantages, means and squares of such rewards stay finite in float32).
Reward = Annotated[float, Field(ge=-REWARD_LIMIT, le=REWARD_LIMIT)]
#: A label's vote count: at least one, int32.
NVotes = Annotated[int, Field(ge=1, le=INT32_MAX)]
#: A reward policy's digest (``schemas.reward.RewardPolicy.digest``): 16 lowercase hex characters.
PolicyDigest = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
#: A mean of +1/-1 judgements (thumbs, followups): [-1, 1].
MeanJudgement = Annotated[float, Field(ge=-1.0, le=1.0)]
#: A share: [0, 1].
Share = Annotated[float, Field(ge=0.0, le=1.0)]
#: Score name -> the mean of users' last values (at most 1024 names).
ScoreMeans = Annotated[dict[Annotated[str, Field(pattern=SCORE_NAME_PATTERN)],
                            Annotated[float, Field(ge=-SCORE_MAX_ABS, le=SCORE_MAX_ABS)]], Field(max_length=1024)]


class RewardedSample(_Event):
    """A sealed, reward-labelled completion: the learner's unit of data.

    ``model_version`` is the version that produced the completion (the behavior policy).
    ``reward`` is the reward policy's combined scalar (``schemas.reward.RewardPolicy.combine``
    of the component fields below) and ``label = reward > 0``; ``reward_policy`` is that
    policy's digest (None on samples sealed before policies had one). ``event_ids`` are all
    distinct feedback events folded into the label, including signals a user later replaced
    (so every accepted event is in exactly one sample); ``votes_up``/``votes_down`` count
    each user's last thumb, ``n_votes`` each user's last signal of every kind (a score: of
    every name). ``split`` is copied from the completion: ``eval`` samples measure every
    version on prompts no version learned from, and the learner refuses them.

    Components (each user's last signal per kind; ``docs/data.md``): ``thumb`` the mean of
    thumbs in [-1, 1] (None: no thumb); ``copied`` / ``regenerated`` how many users copied /
    asked again; ``kept_share`` the mean kept share of edits in [0, 1] (None: no edit);
    ``followup`` the mean of followup judgements in [-1, 1] (None: none); ``scores`` score
    name -> mean value ({}: none).

    Bounds as :class:`CompletionEvent` for the completion's fields; ``created_at`` and
    ``sealed_at`` in [10**12, 4102444800000] ms; ``reward`` in [-1e6, 1e6]
    (``schemas.reward.REWARD_LIMIT``, the bound of every policy's clip); the components as
    above (``scores`` values in [-1e6, 1e6]); counts in [0, 2**31 - 1] (``n_votes`` >= 1).
    """

    completion_id: uuid.UUID
    model_version: IdText
    created_at: EventTimeMs
    user_hash: IdText
    prompt_token_ids: list[TokenId]
    completion_token_ids: list[TokenId]
    behavior_logprobs: list[Logprob]
    sampling: SamplingParams
    expert_routes: ExpertRoutes | None = None
    finish_reason: IdText
    reward: Reward
    label: bool
    n_votes: NVotes
    votes_up: Count
    votes_down: Count
    event_ids: EventIds
    sealed_at: EventTimeMs
    split: Literal["train", "eval"] = "train"
    reward_policy: PolicyDigest | None = None
    thumb: MeanJudgement | None = None
    copied: Count = 0
    regenerated: Count = 0
    kept_share: Share | None = None
    followup: MeanJudgement | None = None
    scores: ScoreMeans = Field(default_factory=dict)


#: A shard's path under the samples root, as ``samplestore.shards.shard_path`` names it.
SHARD_REF_PATTERN = r"^date=[0-9]{4}-[0-9]{2}-[0-9]{2}/hour=[0-9]{2}/part-[0-9]{13}-[0-9A-Za-z_-]{1,64}\.parquet$"


class SampleNotice(_Event):
    """The value of ``flywheel.samples`` (key: completion_id): one sealed sample, by reference
    to its row in a durable Parquet shard (a claim check: the shard holds the sample, the topic
    says where and carries the label). The worker publishes it after the shard is durable, so
    the row it names exists. ``[ingest] samples_value = "sample"`` publishes the whole
    :class:`RewardedSample` instead (decision D67).

    Fields: ``shard`` is the shard's path relative to the samples root (``FLYWHEEL_SAMPLES``;
    ``date=YYYY-MM-DD/hour=HH/part-<sealed ms>-<id>.parquet``, :data:`SHARD_REF_PATTERN`);
    ``row`` is the sample's 0-based row in it; ``shard_format`` is the shard's format version
    (its Parquet metadata ``flywheel.samples.format``, ``schemas.arrow.FORMAT_VERSION``). The
    rest are the :class:`RewardedSample`'s own values, same bounds: ``created_at`` and
    ``sealed_at`` ms since the epoch (UTC), ``reward`` the reward policy's reward (in
    [-1e6, 1e6], ``schemas.reward.REWARD_LIMIT``), the vote counts int32, ``event_ids``
    distinct, ``reward_policy`` and the components (``thumb``, ``copied``, ``regenerated``,
    ``kept_share``, ``followup``, ``scores``) as in the sample.
    """

    completion_id: uuid.UUID
    model_version: IdText
    split: Literal["train", "eval"]
    created_at: EventTimeMs
    sealed_at: EventTimeMs
    reward: Reward
    label: bool
    n_votes: NVotes
    votes_up: Count
    votes_down: Count
    event_ids: EventIds
    reward_policy: PolicyDigest | None = None
    thumb: MeanJudgement | None = None
    copied: Count = 0
    regenerated: Count = 0
    kept_share: Share | None = None
    followup: MeanJudgement | None = None
    scores: ScoreMeans = Field(default_factory=dict)
    shard: str = Field(pattern=SHARD_REF_PATTERN)  # (the pattern bounds its length)
    row: Count
    shard_format: Annotated[int, Field(ge=1, le=INT32_MAX)]


class DeadLetter(_Event):
    """An event the join could not use, with the field and the reason.

    A dead letter must carry any record, so its text fields never refuse: NUL and lone
    surrogates in them (from a hostile key or field name) are written as ``\\uXXXX`` escapes
    (:func:`escape_text`) before validation, and the topic holds only valid text (the exported
    schema's ``pattern``). ``at``: ms since the epoch, UTC.
    """

    source_topic: Text
    key: Text | None = None
    field: Text
    reason: Text
    payload: Text  # the raw value, utf-8 with replacement
    at: EventTimeMs

    @field_validator("source_topic", "key", "field", "reason", "payload", mode="before")
    @classmethod
    def _escape(cls, v):
        return escape_text(v) if isinstance(v, str) else v
