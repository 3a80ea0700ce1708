"""A bound on request bodies: a body over ``max_bytes`` is refused 413 before it is held
in memory (by its ``Content-Length`` at once, or while a chunked body streams in)."""

from __future__ import annotations

from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.http.errors import error_body, json_response

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


class BodyLimitMiddleware:
    """ASGI middleware refusing bodies over ``max_bytes`` (bytes) with 413.

    A declared ``Content-Length`` over the bound is answered at once; an undeclared
    (chunked) body raises an HTTP 413 from ``receive`` as soon as it passes the bound, which
    FastAPI hands to the app's error handlers.
    """

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = int(max_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_bytes
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
