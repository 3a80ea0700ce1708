"""Event contracts on Kafka (DESIGN §2): CompletionEvent, FeedbackEvent, RewardedSample.

Internal events forbid unknown fields: a producer that adds a field without bumping
``schema_version`` is a bug we want to see, not data we silently drop. Events travel as
UTF-8 JSON (``to_bytes`` / ``from_bytes``); expert routes travel zstd-compressed and
base64-encoded inside the JSON (:class:`ExpertRoutes`).
"""

from __future__ import annotations

import base64
import hashlib
import time
import uuid
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

SCHEMA_VERSION = 1


def now_ms() -> int:
    """Wall-clock time in ms since the epoch (UTC)."""
    return int(time.time() * 1000)


def hash_user(user_id: str, salt: str) -> str:
    """Salted SHA-256 of a raw user id (hex, 32 chars). Raw ids never leave the pod."""
    return hashlib.sha256(f"{salt}:{user_id}".encode()).hexdigest()[:32]


# Event times are ms since the epoch (UTC). A value below this bound (2001-09-09T01:46:40Z)
# is refused: it is almost surely seconds, and a vote stamped in seconds would look 55 years
# old to the join (issue 11, defect 2).
MIN_EVENT_TIME_MS = 10**12


def _check_ms(name: str, v: int) -> int:
    if v < MIN_EVENT_TIME_MS:
        unit = "seconds" if 10**9 <= v < 10**11 else "not milliseconds"
        raise ValueError(f"{name}: {v} is before 2001-09-09 in ms since the epoch (looks like {unit}); "
                         f"event times are milliseconds since the epoch, UTC")
    return v


# Clock skew (Hardening II, defect 3). One rule for every receiver, HTTP (serving) and Kafka
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
        temperature: >= 0; 0 means greedy.
        top_p: in (0, 1]; 1 disables nucleus filtering.
        top_k: 0 or -1 disables; else keep the k most likely tokens.
        max_tokens: >= 1, new tokens at most.
        seed: per-request RNG seed, or None.
    """

    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    max_tokens: int = Field(128, ge=1)
    seed: int | None = None
    logprobs_kind: Literal["raw"] = "raw"


class ExpertRoutes(_Event):
    """Expert routes of one completion, vLLM's layout.

    ``to_array()`` gives a ``(prompt_len + completion_len - 1, moe_layers, top_k)`` array of
    dtype uint8 (uint16 when there are more than 256 experts): the experts selected for
    every token that went through a forward pass, in order.
    """

    shape: tuple[int, int, int]
    dtype: Literal["uint8", "uint16"] = "uint8"
    codec: Literal["zstd"] = "zstd"
    data: str  # base64 of the zstd-compressed C-order bytes

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

        raw = zstandard.ZstdDecompressor().decompress(base64.b64decode(self.data))
        arr = np.frombuffer(raw, dtype=self.dtype)
        if arr.size != int(np.prod(self.shape)):
            raise ValueError(f"expert_routes: payload has {arr.size} values, shape {self.shape} needs "
                             f"{int(np.prod(self.shape))}")
        return arr.reshape(self.shape)


class CompletionEvent(_Event):
    """One served completion, as the serving pod logged it (key: completion_id).

    Shapes: ``behavior_logprobs`` has one float32 per completion token;
    ``expert_routes`` is ``(len(prompt) + len(completion) - 1, moe_layers, top_k)`` or None
    for dense models. Times: ``created_at`` ms since epoch UTC; ``ttft_ms``/``latency_ms`` ms.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    completion_id: uuid.UUID
    request_id: str
    created_at: int = Field(ge=0)
    model_version: str = Field(min_length=1)
    pod: str
    user_hash: str
    prompt_token_ids: list[int] = Field(min_length=1)
    completion_token_ids: list[int]
    behavior_logprobs: list[float]
    sampling: SamplingParams
    expert_routes: ExpertRoutes | None = None
    finish_reason: Literal["stop", "length", "abort"]
    ttft_ms: float = Field(ge=0)
    latency_ms: float = Field(ge=0)
    # ``eval`` completions are held out: their feedback is measured, never trained on
    # (chosen by serving with schemas.split.choose_split). Last field: the join reads the head.
    split: Literal["train", "eval"] = "train"

    @field_validator("created_at")
    @classmethod
    def _created_at_ms(cls, v: int) -> int:
        return _check_ms("created_at", v)

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


FeedbackKind = Literal["thumb", "score", "edit", "regenerate", "copy"]

SCORE_NAME_PATTERN = r"^[A-Za-z0-9_.:/-]{1,64}$"
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class FeedbackEvent(_Event):
    """One user signal about a completion (key: completion_id).

    ``event_id`` is set by the client and is the idempotency key: the same event
    delivered twice counts once. For ``kind="thumb"``, ``value`` is +1 (up) or -1 (down);
    for ``kind="score"``, ``value`` is any finite number and ``name`` says what it scores
    (e.g. ``helpfulness``); ``name`` is refused on other kinds. ``metadata``: at most 16
    string -> string pairs (keys 1-64 chars, values at most 512 chars).

    ``name`` and ``metadata`` are optional and left out of the JSON when unset, so an event
    that uses neither encodes exactly as before they existed.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    event_id: uuid.UUID
    completion_id: uuid.UUID
    user_hash: str
    kind: FeedbackKind = "thumb"
    value: Annotated[float, Strict()]  # a JSON number: true or "1" is refused, never read as +1
    comment: str | None = Field(None, max_length=4096)
    created_at: Annotated[int, Strict()] = Field(ge=0)
    name: str | None = Field(None, pattern=SCORE_NAME_PATTERN)
    metadata: dict[str, str] | None = None

    @field_validator("created_at")
    @classmethod
    def _created_at_ms(cls, v: int) -> int:
        return _check_ms("created_at", v)

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys, got {len(v)}")
        for k, x in v.items():
            if not 1 <= len(k) <= MAX_METADATA_KEY_CHARS:
                raise ValueError(f"key {k[:80]!r}: 1 to {MAX_METADATA_KEY_CHARS} characters")
            if len(x) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"value of {k!r}: at most {MAX_METADATA_VALUE_CHARS} characters, got {len(x)}")
        return v

    @model_validator(mode="after")
    def _check_value(self):
        if self.kind == "thumb" and self.value not in (1.0, -1.0):
            raise ValueError(f"value: a thumb is +1 or -1, got {self.value}")
        if self.kind == "score" and self.name is None:
            raise ValueError("name: a score needs a name (what it scores, e.g. 'helpfulness')")
        if self.kind != "score" and self.name is not None:
            raise ValueError(f"name: only a score has a name, not a {self.kind}")
        return self

    def to_bytes(self) -> bytes:
        """JSON encoding used on Kafka (``name`` and ``metadata`` omitted when unset)."""
        unset = {f for f in ("name", "metadata") if getattr(self, f) is None}
        return self.model_dump_json(exclude=unset or None).encode()


class RewardedSample(_Event):
    """A sealed, reward-labelled completion: the learner's unit of data.

    ``model_version`` is the version that produced the completion (the behavior policy).
    ``label`` is True for desirable (net up-votes), False for undesirable; ``reward`` is the
    shaped scalar (see ``ingest`` reward config). ``event_ids`` are all distinct feedback
    events folded into the label, including votes a user later replaced (so every accepted
    event is in exactly one sample); ``votes_up``/``votes_down``/``n_votes`` count each
    user's last vote only. ``split`` is copied from the completion: ``eval`` samples measure
    every version on prompts no version learned from, and the learner refuses them.
    """

    completion_id: uuid.UUID
    model_version: str
    created_at: int
    user_hash: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    behavior_logprobs: list[float]
    sampling: SamplingParams
    expert_routes: ExpertRoutes | None = None
    finish_reason: str
    reward: float
    label: bool
    n_votes: int = Field(ge=1)
    votes_up: int = Field(ge=0)
    votes_down: int = Field(ge=0)
    event_ids: list[str]
    sealed_at: int
    split: Literal["train", "eval"] = "train"

    @field_validator("event_ids")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("event_ids: duplicates")
        return v


class DeadLetter(_Event):
    """An event the join could not use, with the field and the reason."""

    source_topic: str
    key: str | None = None
    field: str
    reason: str
    payload: str  # the raw value, utf-8 with replacement
    at: int
