"""Feedback routes: ``POST /v1/feedback`` and ``POST /v1/feedback/batch`` (auth: API key
or feedback-only key; contract in docs/sdk.md, "HTTP API")."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from serving.http.serving_openai import USER_HEADER
from serving.http.state import ServingState, get_state
from serving.protocol import FeedbackBatchRequest, FeedbackRequest

router = APIRouter(tags=["feedback"])


@router.post("/v1/feedback")
async def feedback(body: FeedbackRequest, request: Request, st: ServingState = Depends(get_state)):
    """Publish one FeedbackEvent keyed by completion_id; ``{"event_id", "accepted", "duplicate"}``."""
    return await st.feedback.accept(body, request.headers.get(USER_HEADER))


@router.post("/v1/feedback/batch")
async def feedback_batch(body: FeedbackBatchRequest, request: Request, st: ServingState = Depends(get_state)):
    """Publish 1 to 100 events, each checked on its own; per-event results."""
    return await st.feedback.accept_batch(body.events, request.headers.get(USER_HEADER))
