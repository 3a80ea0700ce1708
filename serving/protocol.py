"""OpenAI wire models for the endpoints serving exposes (requests accept unknown extras,
which are logged and ignored; known OpenAI parameters we do not support are rejected)."""

from __future__ import annotations

import logging
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.events import SamplingParams
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


MAX_N = 16  # choices per request at most


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(..., description="a served version id, or any name (sticky split)")
    temperature: float | None = Field(None, description="0..2; 0 greedy; default 1")
    top_p: float | None = Field(None, description="(0, 1]; default 1")
    top_k: int | None = Field(None, description="-1/0 off, else keep k most likely")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1,
                             description="int64; with n > 1, choice i is sampled with seed + i")
    n: int | None = Field(1, description=f"choices, 1..{MAX_N}; each is its own completion (own "
                                         "completion_id, event and feedback target)")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    user: str | None = Field(None, max_length=256)

    def check_supported(self) -> None:
        """Raise ServingValidationError for unsupported parameters; log ignored extras."""
        extras = dict(self.model_extra or {})
        for name, neutral in _UNSUPPORTED_NEUTRAL.items():
            if name in extras:
                v = extras.pop(name)
                if v not in neutral:
                    raise ServingValidationError(name, v, "is not supported by this server")
        if extras:
            log.info("ignoring unknown request fields: %s", sorted(extras))
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise ServingValidationError("n", self.n, f"must be in [1, {MAX_N}]")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ServingValidationError("stop", self.stop, "up to 4 non-empty strings")

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
        if self.content is None:
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
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(_Base):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1, description="default 16")
    logprobs: int | None = Field(None, ge=0, le=20)


class FeedbackRequest(BaseModel):
    """``POST /v1/feedback`` body. ``value``: +1 / -1 for thumbs."""

    model_config = ConfigDict(extra="forbid")
    completion_id: uuid.UUID
    value: float
    event_id: uuid.UUID | None = None
    kind: Literal["thumb", "edit", "regenerate", "copy"] = "thumb"
    comment: str | None = Field(None, max_length=4096)
    user: str | None = Field(None, max_length=256)


def error_body(message: str, param: str | None, type_: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
