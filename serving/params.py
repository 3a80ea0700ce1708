"""Request-level types shared by the engines and the HTTP layer: the validation error and
the generation request/result.

Sampling parameters themselves are :class:`schemas.events.SamplingParams` (the contract
logged with every completion): behavior logprobs are always **raw** (temperature 1, no
top-p/top-k), whatever the request's sampling parameters.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from schemas.events import SamplingParams


class ServingValidationError(ValueError):
    """A client mistake, rendered as the OpenAI 400 error naming ``parameter``.

    Args:
        parameter: the offending request field (dotted path for nested ones).
        value: the value received (repr is shown, truncated).
        reason: why it is rejected.
        status: HTTP status (400 bad input, 413 prompt too long, 429 queue full...).
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


@dataclass
class GenRequest:
    """One generation request for an engine.

    Attributes:
        prompt_token_ids: the prompt, token ids (len >= 1).
        sampling: sampling parameters (temperature 0 = greedy).
        model: the loaded weights to run on (a :class:`serving.engine.LoadedModel`); requests
            are only ever batched with others on the same weights.
        stop_token_ids: ids that end generation (finish_reason ``stop``); the stop token is
            kept in the completion (it was sampled and has a behavior logprob).
        top_logprobs: also return the k most likely tokens (raw logprobs) per step; 0 = off.
        on_token: called from the engine thread with ``(token_id, logprob)`` per sampled token.
        stop_check: called from the engine thread with the completion ids so far; True stops
            (finish_reason ``stop``), used for stop strings.
    """

    prompt_token_ids: list[int]
    sampling: SamplingParams
    model: Any = None
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0
    on_token: Callable[[int, float], None] | None = None
    stop_check: Callable[[list[int]], bool] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class GenResult:
    """What an engine returns for one request.

    Attributes:
        completion_token_ids: sampled tokens, in order.
        behavior_logprobs: float32 log p of each sampled token under the raw distribution
            (temperature 1, unfiltered), one per completion token.
        top_logprobs: per step, ``[(token_id, logprob), ...]`` (k most likely, raw) or [].
        expert_routes: uint8/uint16 ndarray ``(prompt_len + completion_len - 1, moe_layers,
            top_k)``, or None for dense models.
        finish_reason: ``stop`` | ``length`` | ``abort``.
        ttft_ms / latency_ms: time from submit to the first token / to the end (ms).
        queue_ms: time from submit until its batch started (ms), part of both above.
        version: the weights version that produced it.
        batch_size: requests in the batch it ran in.
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
