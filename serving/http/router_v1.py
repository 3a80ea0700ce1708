"""OpenAI inference routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``
(auth: API key, see :mod:`serving.http.auth`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from serving.http.state import ServingState, get_state
from serving.protocol import ChatCompletionRequest, CompletionRequest

router = APIRouter(tags=["v1"])


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, st: ServingState = Depends(get_state)):
    """OpenAI chat completions (non-streaming and SSE streaming)."""
    return await st.openai.chat(body, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, st: ServingState = Depends(get_state)):
    """OpenAI (legacy) text completions (non-streaming and SSE streaming)."""
    return await st.openai.completions(body, request)


@router.get("/v1/models")
async def models(st: ServingState = Depends(get_state)):
    """The served model name (sticky split), then the versions this pod serves (stable first)."""
    return st.openai.models()
