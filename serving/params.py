"""Request-level types shared by the engines and the HTTP layer: the validation error and
the generation request/result.

Sampling parameters themselves are :class:`schemas.events.SamplingParams` (the contract
logged with every completion): behavior logprobs are always **raw** (temperature 1, no
top-p/top-k), whatever the request's sampling parameters.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from schemas.events import SamplingParams

log = logging.getLogger("flywheel.serving.params")


class ServingValidationError(ValueError):
    """A client mistake, rendered as the OpenAI 400 error naming ``parameter``.

    Args:
        parameter: the offending request field (dotted path for nested ones).
        value: the value received (repr is shown, truncated).
        reason: why it is rejected.
        status: HTTP status (400 bad input and a prompt the context cannot take, 404 unknown
            model, 429 queue full...; a request body over its size bound is 413, refused
            before it is parsed: ``serving.http.limits``).
        code: OpenAI's ``error.code`` (``context_length_exceeded``, ``queue_full``...) or None.
    """

    def __init__(self, parameter: str, value: Any, reason: str, status: int = 400,
                 code: str | None = None):
        self.parameter = parameter
        self.value = value
        self.reason = reason
        self.status = status
        self.code = code
        v = repr(value)
        super().__init__(f"{parameter}: {reason} (got {v[:200]})")


class ContextLengthError(ServingValidationError):
    """A prompt the model's context cannot take: OpenAI's 400 ``invalid_request_error`` with
    code ``context_length_exceeded`` and ``param`` the prompt's field (``messages`` for chat
    completions, ``prompt`` for completions), which the ``openai`` client raises as
    ``openai.BadRequestError``. The message keeps OpenAI's words ("maximum context length is
    N tokens"), which client libraries match on, and says what to shorten.

    Three cases (all counts in tokens):

    * the prompt alone leaves no room for one new token (``prompt_tokens > context - 1``);
    * the prompt is longer than the server's own bound (``prompt_tokens > max_prompt_tokens``);
    * the prompt plus an explicit new-token budget does not fit (``prompt_tokens + asked >
      context``; ``budget_field`` names the budget: ``max_tokens`` or ``max_completion_tokens``).

    Args:
        parameter: ``messages`` or ``prompt``.
        prompt_tokens: the prompt's length.
        context: the model's maximum context length, or None (unbounded).
        max_prompt_tokens: the server's bound on prompts, or None.
        asked: the new tokens asked for (case 3), or None.
        budget_field: the request field that asked them (case 3).
    """

    def __init__(self, parameter: str, prompt_tokens: int, *, context: int | None,
                 max_prompt_tokens: int | None = None, asked: int | None = None,
                 budget_field: str = "max_tokens"):
        super().__init__(parameter, prompt_tokens, "context length exceeded", status=400,
                         code="context_length_exceeded")
        self.prompt_tokens = prompt_tokens
        self.context = context
        self.asked = asked
        what = "the messages" if parameter == "messages" else "the prompt"
        if asked is not None:
            msg = (f"{parameter}: this model's maximum context length is {context} tokens, however you "
                   f"requested {prompt_tokens + asked} tokens ({prompt_tokens} in {what}, {asked} in "
                   f"{budget_field}); reduce the length of {what} or {budget_field}")
        elif context is not None and prompt_tokens > context - 1:
            msg = (f"{parameter}: this model's maximum context length is {context} tokens, however "
                   f"{what} resulted in {prompt_tokens} tokens (at most {context - 1}, leaving room "
                   f"for one new token); reduce the length of {what}")
        else:
            msg = (f"{parameter}: {what} resulted in {prompt_tokens} tokens, more than this server's "
                   f"max_prompt_tokens ({max_prompt_tokens})"
                   + (f"; the model's maximum context length is {context} tokens" if context is not None else "")
                   + f"; reduce the length of {what}")
        ValueError.__init__(self, msg)


@dataclass
class GenRequest:
    """One generation request for an engine.

    Attributes:
        prompt_token_ids: the prompt, token ids (len >= 1).
        sampling: sampling parameters (temperature 0 = greedy).
        model: the loaded weights to run on (a :class:`serving.engine_base.LoadedModel`); requests
            are only ever batched with others on the same weights.
        stop_token_ids: ids that end generation (finish_reason ``stop``); the stop token is
            kept in the completion (it was sampled and has a behavior logprob).
        top_logprobs: also return the k most likely tokens (raw logprobs) per step; 0 = off.
        on_token: called from the engine thread with ``(token_id, logprob)`` per sampled token.
        on_step: called from the engine thread with each :class:`StepOutput` (new tokens of
            one engine step), before the request's result resolves.
        stop_check: called from the engine thread with the completion ids so far; True stops
            (finish_reason ``stop``), used for stop strings.
        request_id: the engine's id of this request (``abort(request_id)``); unique per engine.
        cancelled: set by ``abort``; the engine ends the request at its next step.
        structured: vLLM engine only: ``{"json": schema}`` / ``{"regex": ...}`` etc. passed
            to vLLM's structured outputs (``StructuredOutputsParams``); the torch engine
            refuses a request that sets it.
    """

    prompt_token_ids: list[int]
    sampling: SamplingParams
    model: Any = None
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0
    on_token: Callable[[int, float], None] | None = None
    stop_check: Callable[[list[int]], bool] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    on_step: Callable[["StepOutput"], None] | None = None
    request_id: str = field(default_factory=lambda: f"gen-{uuid.uuid4().hex}")
    structured: dict | None = None

    def emit_step(self, out: "StepOutput") -> None:
        """Deliver one step's tokens to ``on_token`` (per token) and ``on_step``; a failing
        callback is logged and never breaks the engine's batch."""
        try:
            if self.on_token is not None:
                for t, lp in zip(out.token_ids, out.logprobs):
                    self.on_token(t, lp)
            if self.on_step is not None:
                self.on_step(out)
        except Exception:  # noqa: BLE001 - a broken stream must not break the batch
            log.exception("stream callback of %s failed", self.request_id)


@dataclass
class StepOutput:
    """What one engine step produced for one request (vLLM's ``RequestOutput`` with
    ``RequestOutputKind.DELTA``): the new tokens since the previous output.

    Attributes:
        request_id: :attr:`GenRequest.request_id`.
        token_ids: new token ids (usually one; vLLM may coalesce several; [] on a final
            output that adds no token, e.g. an abort between steps).
        logprobs: raw behavior logprob of each new token (float, nats; temperature 1,
            unfiltered), same length as ``token_ids``.
        top_logprobs: per new token ``[(token_id, logprob), ...]`` (k most likely, raw) when
            the request asked for them, else [].
        finished: True on the request's last output.
        result: on the last output, the whole :class:`GenResult` (expert routes, finish
            reason, timings); None before.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list = field(default_factory=list)
    finished: bool = False
    result: "GenResult | None" = None


@dataclass
class GenResult:
    """What an engine returns for one request.

    Attributes:
        completion_token_ids: sampled tokens, in order.
        behavior_logprobs: float32 log p of each sampled token under the raw distribution
            (temperature 1, unfiltered), one per completion token.
        top_logprobs: per step, ``[(token_id, logprob), ...]`` (k most likely, raw) or [].
        expert_routes: uint8/uint16 ndarray ``(prompt_len + completion_len - 1,
            num_hidden_layers, top_k)`` (dense layers' columns 0; D38), or None for dense models.
        finish_reason: ``stop`` | ``length`` | ``abort``.
        ttft_ms / latency_ms: time from submit to the first token / to the end (ms).
        queue_ms: time from submit until its batch started (ms), part of both above.
        version: the weights version that produced it.
        batch_size: requests in the batch it ran in.
        cached_tokens: prompt tokens taken from the prefix cache instead of prefilled
            (``serving.prefix_cache``; 0 without it).
    """

    completion_token_ids: list[int]
    behavior_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    expert_routes: Any
    finish_reason: str
    ttft_ms: float
    latency_ms: float
    version: str
    batch_size: int = 1
    queue_ms: float = 0.0  # submit -> its batch started (ms); latency_ms - queue_ms = engine time
    cached_tokens: int = 0  # prompt tokens from the prefix cache
