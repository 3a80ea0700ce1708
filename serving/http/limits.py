"""A bound on request bodies: a body over its path's limit is refused 413 before it is held
in memory (by its ``Content-Length`` at once, or while a chunked body streams in).

Inference paths have a tighter limit than the rest (:func:`prompt_body_bytes`): a prompt body
far beyond what ``max_prompt_tokens`` allows is refused before any of it is parsed or
tokenised (tokenising a 7.5 MB prompt takes 16-18 s on 2 cores)."""

from __future__ import annotations

from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.http.errors import error_body, json_response

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
PROMPT_PATHS = ("/v1/completions", "/v1/chat/completions")
MIN_PROMPT_BODY_BYTES = 1024 * 1024
PROMPT_BODY_BYTES_PER_TOKEN = 128  # JSON bytes one allowed prompt token may take (escapes, long tokens)


def prompt_body_bytes(max_prompt_tokens: int) -> int:
    """The body limit of the inference paths (bytes): 128 bytes per allowed prompt token, at
    least 1 MiB (1 MiB for the default 8192 tokens). A body of that size holds far more
    tokens than allowed (about 600,000 for 1 MiB of English with a byte-level BPE), so no
    prompt within ``max_prompt_tokens`` is refused by it."""
    return max(MIN_PROMPT_BODY_BYTES, PROMPT_BODY_BYTES_PER_TOKEN * int(max_prompt_tokens))


class BodyLimitMiddleware:
    """ASGI middleware refusing bodies over their path's limit (bytes) with 413.

    A declared ``Content-Length`` over the bound is answered at once, before the body is
    read (with ``Connection: close``); an undeclared (chunked) body raises an HTTP 413 from
    ``receive`` as soon as it passes the bound, which FastAPI hands to the app's error handlers.

    Args:
        max_bytes: the limit of every path not in ``path_limits``.
        path_limits: ``{path: limit}`` for paths with their own limit (exact match).
    """

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES, path_limits: dict[str, int] | None = None):
        self.app = app
        self.max_bytes = int(max_bytes)
        self.path_limits = {k: int(v) for k, v in (path_limits or {}).items()}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        reason = f"body: larger than {limit} bytes"
        for k, v in scope.get("headers") or []:
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = -1
                if declared > limit:
                    return await json_response(error_body(reason, None, code="request_too_large"), 413,
                                               {"Connection": "close"})(scope, receive, send)
                break
        seen = 0

        async def _receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise StarletteHTTPException(413, reason)
            return msg

        return await self.app(scope, _receive, send)
