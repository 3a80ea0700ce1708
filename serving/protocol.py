"""Wire models for the endpoints serving exposes: OpenAI requests (unknown extras are logged
and ignored; known OpenAI parameters we do not support are rejected) and feedback.

Every request model refuses, before any field is validated and naming the field by its
dotted path: a lone UTF-16 surrogate in any string (``"\\ud800"`` is valid JSON but not
Unicode; error type ``lone_surrogate``) and NaN / Infinity in any number (``non_finite``).
A boolean is never taken for a number (``true`` is not 1).
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from schemas.events import (
    MAX_FINAL_TEXT_CHARS, MAX_METADATA_KEY_CHARS, MAX_METADATA_KEYS, MAX_METADATA_VALUE_CHARS, SCORE_NAME_PATTERN,
    SamplingParams,
)
from serving.params import ServingValidationError

log = logging.getLogger("flywheel.serving.protocol")

# OpenAI parameters we do not implement: rejected unless at their neutral value.
_UNSUPPORTED_NEUTRAL: dict[str, tuple] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""), "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
}


STRUCTURED_FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls")  # vLLM engine only
MAX_N = 16  # choices per request at most
MAX_FEEDBACK_BATCH = 100  # events per POST /v1/feedback/batch at most


def find_bad_value(obj: Any, path: str = "") -> tuple[str, str, str] | None:
    """The first lone surrogate or non-finite float in a decoded JSON value, depth first.

    Returns:
        ``(path, kind, description)`` with ``path`` dotted (``messages.0.content``; ``""``
        for the value itself), ``kind`` ``lone_surrogate`` or ``non_finite``; None if clean.
    """
    # (parent entry, key, value); a path is spelled out only for the value that is refused
    stack: list[tuple[Any, Any, Any]] = [(None, path, obj)]

    def spell(entry) -> str:
        parts = []
        while entry is not None:
            parent, key, _ = entry
            if key != "":
                parts.append(str(key))
            entry = parent
        return ".".join(reversed(parts))

    while stack:
        entry = stack.pop()
        x = entry[2]
        t = type(x)
        if t is str:
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as exc:
                return spell(entry), "lone_surrogate", f"U+{ord(x[exc.start]):04X} at character {exc.start}"
        elif t is float:
            if not math.isfinite(x):
                return spell(entry), "non_finite", repr(x)
        elif t is dict:
            for k in reversed(list(x)):
                if isinstance(k, str):
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return (spell(entry) or "body"), "lone_surrogate", "in a key"
                stack.append((entry, k, x[k]))
        elif t is list:
            if set(map(type, x)) == {int}:  # token ids: nothing to check
                continue
            for k in range(len(x) - 1, -1, -1):
                stack.append((entry, k, x[k]))
    return None


def _no_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("must be a number, not a boolean")
    return v


# strict: a JSON number only ("0.7" and true are refused with the field named, never coerced)
Num = Annotated[float, BeforeValidator(_no_bool), Strict()]
Int = Annotated[int, BeforeValidator(_no_bool), Strict()]
Bool = Annotated[bool, Strict()]  # true / false only ("yes" and 1 are refused, never coerced)


class WireModel(BaseModel):
    """Base of every request body: refuses lone surrogates and non-finite numbers anywhere in
    the body (extras included), raising pydantic errors of type ``lone_surrogate`` /
    ``non_finite`` whose ``ctx["field"]`` is the dotted path (the HTTP layer names it)."""

    model_config = ConfigDict(allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _clean_unicode_and_numbers(cls, data: Any) -> Any:
        bad = find_bad_value(data)
        if bad is not None:
            field, kind, what = bad
            field = field or "body"
            if kind == "lone_surrogate":
                raise PydanticCustomError("lone_surrogate", "{field}: contains a lone UTF-16 surrogate "
                                          "({what}), which is not valid Unicode", {"field": field, "what": what})
            raise PydanticCustomError("non_finite", "{field}: must be a finite number, got {what}",
                                      {"field": field, "what": what})
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Bool = False


class _Base(WireModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(..., description="the served model name (sticky split between stable and candidate) "
                                        "or a served version id; anything else is 404 model_not_found")
    temperature: Num | None = Field(None, description="0..2; 0 greedy; default 1")
    top_p: Num | None = Field(None, description="(0, 1]; default 1")
    top_k: Int | None = Field(None, description="-1/0 off, else keep k most likely")
    seed: Int | None = Field(None, ge=-(2**63), le=2**63 - 1,
                             description="int64; with n > 1, choice i is sampled with seed + i")
    n: Int | None = Field(1, description=f"choices, 1..{MAX_N}; each is its own completion (own "
                                         "completion_id, event and feedback target)")
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = Field(
        None, max_length=MAX_METADATA_KEYS,
        description='OpenAI request metadata (str -> str); {"flywheel_split": "train"|"eval"} picks the '
                    "completion's split (else a stable hash of the prompt with the pod's eval share)")

    def check_supported(self, structured: bool = False) -> None:
        """Raise ServingValidationError for unsupported parameters; log ignored extras.

        Args:
            structured: the engine does structured outputs and tool calls (the vLLM engine):
                ``response_format``, ``tools``, ``tool_choice`` and ``parallel_tool_calls``
                are then read by :meth:`structured_outputs` and :meth:`tool_spec` instead of
                refused; on an engine without them a non-neutral value is a 400 that says so.
        """
        extras = dict(self.model_extra or {})
        for name, neutral in _UNSUPPORTED_NEUTRAL.items():
            if name in extras:
                v = extras.pop(name)
                if v in neutral:
                    continue
                if name in STRUCTURED_FIELDS and not structured:
                    raise ServingValidationError(name, v, "needs the vLLM engine (flywheel serve --engine vllm): "
                                                 "this pod runs the torch engine, which has no structured "
                                                 "outputs or tool calls")
                if name not in STRUCTURED_FIELDS:
                    raise ServingValidationError(name, v, "is not supported by this server")
        if extras:
            log.info("ignoring unknown request fields: %s", sorted(extras))
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise ServingValidationError("n", self.n, f"must be in [1, {MAX_N}]")
        if self.stream_options is not None and not self.stream:
            raise ServingValidationError("stream_options", self.stream_options.model_dump(),
                                         "only allowed with stream: true (as OpenAI and vLLM)")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ServingValidationError("stop", self.stop, "up to 4 non-empty strings")

    def structured_outputs(self) -> dict | None:
        """``response_format`` as vLLM ``StructuredOutputsParams`` keywords: ``json_schema``
        -> ``{"json": schema}``, ``json_object`` -> ``{"json_object": True}``, ``text`` or
        absent -> None.

        Raises:
            ServingValidationError: another type, or a ``json_schema`` without a ``schema`` object.
        """
        rf = (self.model_extra or {}).get("response_format")
        if rf is None:
            return None
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise ServingValidationError("response_format.type", rf, "must be text, json_object or json_schema")
        if rf["type"] == "text":
            return None
        if rf["type"] == "json_object":
            return {"json_object": True}
        schema = (rf.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ServingValidationError("response_format.json_schema.schema", schema, "must be a JSON Schema object")
        return {"json": schema}

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The request's :class:`SamplingParams`; raises ServingValidationError naming the field."""
        kw: dict[str, Any] = {"max_tokens": max_tokens, "seed": self.seed}
        if self.temperature is not None:
            kw["temperature"] = self.temperature
        if self.top_p is not None:
            kw["top_p"] = self.top_p
        if self.top_k is not None:
            kw["top_k"] = 0 if self.top_k == 0 else self.top_k
        try:
            return SamplingParams(**kw)
        except ValidationError as exc:
            e = exc.errors()[0]
            field = ".".join(str(x) for x in e["loc"])
            raise ServingValidationError(field, e.get("input"), e["msg"]) from None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, i: int) -> str:
        """The message's text (content parts joined); ``i`` is its index, for errors.

        Raises:
            ServingValidationError: no ``content`` on a message other than an assistant's
                (which may carry only ``tool_calls``), or a non-text content part.
        """
        if self.content is None:
            if self.role != "assistant":
                raise ServingValidationError(f"messages.{i}.content", None,
                                             f"is required for a {self.role} message")
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, p in enumerate(self.content):
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ServingValidationError(f"messages.{i}.content.{j}", p.get("type"),
                                             "only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)


class ChatCompletionRequest(_Base):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)

    def tool_spec(self) -> list[dict] | None:
        """The request's ``tools`` when the model may call them (``tool_choice`` absent,
        ``auto`` or ``none``-less), else None.

        Raises:
            ServingValidationError: ``tool_choice`` ``required`` or a named function (not
                supported: only ``auto`` and ``none``), or tools with ``stream`` (tool calls
                are parsed from the whole completion).
        """
        extra = self.model_extra or {}
        tools, choice = extra.get("tools"), extra.get("tool_choice", "auto")
        if not tools or choice == "none":
            return None
        if choice != "auto":
            raise ServingValidationError("tool_choice", choice, "only 'auto' and 'none' are supported")
        if self.stream:
            raise ServingValidationError("stream", True, "tool calls are parsed from the whole completion: "
                                         "use stream=false with tools")
        return list(tools)


class CompletionRequest(_Base):
    prompt: str | list[Int] | list[str] | list[list[Int]]
    max_tokens: Int | None = Field(None, ge=1, description="default 16")
    logprobs: Int | None = Field(None, ge=0, le=20)


class FeedbackRequest(WireModel):
    """``POST /v1/feedback`` body (docs/sdk.md, "HTTP API").

    ``kind``: one of the feedback kinds of :class:`schemas.events.FeedbackEvent` (``thumb``,
    ``score``, ``edit``, ``regenerate``, ``copy``, ``followup``). ``value``: a finite number,
    never a boolean; +1 / -1 for ``thumb`` and ``followup``, 1 for ``copy`` and ``regenerate``,
    the kept share in [0, 1] for an ``edit`` (absent when the edit carries ``final_text``, the
    user's final text, at most 65536 characters; the join computes the kept share then).
    ``name``: what a ``score`` scores (required for ``score``, refused on other kinds). ``metadata``: at most
    16 str -> str pairs. ``event_id``: the idempotency key (made by serving when absent).
    ``created_at``: when the user gave the feedback, ms since the epoch (UTC; default: when
    the pod receives it); more than ``schemas.events.MAX_FUTURE_SKEW_MS`` ahead of the pod's
    clock it is refused (422), less than that ahead it is clamped to the pod's clock.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    completion_id: uuid.UUID
    value: Num | None = None
    event_id: uuid.UUID | None = None
    kind: Literal["thumb", "score", "edit", "regenerate", "copy", "followup"] = "thumb"
    name: str | None = Field(None, pattern=SCORE_NAME_PATTERN)
    metadata: dict[Annotated[str, Field(min_length=1, max_length=MAX_METADATA_KEY_CHARS)],
                   Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]] | None = Field(
        None, max_length=MAX_METADATA_KEYS)
    comment: str | None = Field(None, max_length=4096)
    user: str | None = Field(None, max_length=256)
    created_at: Int | None = None
    final_text: str | None = Field(None, max_length=MAX_FINAL_TEXT_CHARS)


class FeedbackBatchRequest(BaseModel):
    """``POST /v1/feedback/batch`` body: 1 to 100 events, each a :class:`FeedbackRequest`
    body, checked one by one (a bad event never refuses the others)."""

    model_config = ConfigDict(extra="forbid")
    events: list[Any] = Field(..., min_length=1, max_length=MAX_FEEDBACK_BATCH)
