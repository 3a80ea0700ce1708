"""Errors in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.

Client mistakes (:class:`serving.params.ServingValidationError`, request validation) are
400 (a prompt the context cannot take included: ``context_length_exceeded`` naming
``messages`` or ``prompt``, as OpenAI answers it), 404 ``model_not_found``, 429 with
``Retry-After`` when the queue is full; a request body over its size bound is 413
``request_too_large`` (``serving.http.limits``); weight-slot conflicts 409; anything
unexpected 500. :class:`CatchAllMiddleware`
answers unexpected exceptions itself, so the connection stays open for the next request
(Starlette's outermost error middleware re-raises after answering, and uvicorn then closes
the keep-alive connection).
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.params import ServingValidationError
from serving.slots import SlotError

log = logging.getLogger("flywheel.serving.http")

# a validator around a type in pydantic's union tags: function-before[_no_bool(), int] names int
_VALIDATOR_TAG = re.compile(r"function-(?:before|after|wrap|plain)\[\w+\(\), ([^\]]+)\]")
RETRY_AFTER_S = 1  # seconds a client should wait after a 429 (queue full)

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          409: "conflict", 429: "rate_limit_error"}


def error_body(message: str, param: str | None, type_: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_error_body(exc: ServingValidationError) -> dict:
    """A :class:`ServingValidationError` in the OpenAI shape (``param`` = its parameter)."""
    t = "invalid_request_error" if exc.status in (400, 404, 413) else _TYPES.get(exc.status, "invalid_request_error")
    return error_body(str(exc), exc.parameter, type_=t, code=exc.code)


def _is_union_tag(part) -> bool:
    # pydantic names the member of a union an error came from: 'str', 'list[int]', 'function-after[...]'
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "uuid"})


def pydantic_error_param(e: dict, errors: list[dict] | None = None) -> tuple[str | None, str]:
    """``(param, message)`` for one pydantic error dict (FastAPI's ``exc.errors()[i]`` or
    ``ValidationError.errors()[i]``): the dotted field path without ``body``, and a message
    that starts with it. Model-level checks that name their field as ``"field: reason"``
    (and our ``lone_surrogate`` / ``non_finite`` errors) are attributed to that field. A value
    that matches no member of a union (``prompt: 5``) names the field and the accepted types,
    gathered from ``errors`` (all the errors of the same validation)."""
    ctx = e.get("ctx") or {}
    if e.get("type") in ("lone_surrogate", "non_finite") and "field" in ctx:
        return str(ctx["field"]), str(e.get("msg"))
    raw_loc = [x for x in e.get("loc", ()) if x != "body"]
    tag_at = next((i for i, x in enumerate(raw_loc) if _is_union_tag(x)), None)
    if tag_at is not None:
        head = raw_loc[:tag_at]
        param = ".".join(str(x) for x in head) or None
        members = []
        for x in errors or [e]:
            loc = [y for y in x.get("loc", ()) if y != "body"]
            if loc[:tag_at] == head and len(loc) > tag_at and _is_union_tag(loc[tag_at]):
                t = _VALIDATOR_TAG.sub(r"\1", str(loc[tag_at]))  # list[function-before[_no_bool(), int]] -> list[int]
                if t not in members:
                    members.append(t)
        if len(members) > 1:  # a union (one error per member); else a dict key that looks like a tag
            got = type(e.get("input")).__name__
            return param, f"{param or 'body'}: must be one of {', '.join(members)} (got {got})"
    loc = [str(x) for x in raw_loc]
    msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
    param = ".".join(loc) or None
    if param is None and ": " in msg:  # a model-level check: "field: reason"
        param = msg.split(": ", 1)[0]
        return param, msg
    return param, f"{param or 'body'}: {msg}"


def json_response(body: dict, status: int, headers: dict | None = None) -> JSONResponse:
    """A JSON response whose encoding cannot fail on odd strings (ASCII escapes)."""
    return _AsciiJSON(body, status_code=status, headers=headers)


class _AsciiJSON(JSONResponse):
    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def install(app: FastAPI) -> None:
    """Register the error handlers and :class:`CatchAllMiddleware` on ``app``."""

    @app.exception_handler(ServingValidationError)
    async def _sve(_req: Request, exc: ServingValidationError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else None
        return json_response(validation_error_body(exc), exc.status, headers)

    @app.exception_handler(RequestValidationError)
    async def _rve(req: Request, exc: RequestValidationError):
        errs = exc.errors()
        e = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        if e.get("type") == "json_invalid":
            return json_response(error_body(f"body: invalid JSON ({e.get('msg')})", None), 400)
        ctype = req.headers.get("content-type", "")
        if tuple(e.get("loc", ())) == ("body",) and "json" not in ctype.lower():
            # FastAPI reads a body as JSON only under a JSON content type; any other one
            # reaches validation as raw bytes, whose own message would not say why
            got = f"content-type {ctype[:80]!r}" if ctype else "no content-type"
            return json_response(error_body(f"body: send a JSON object with content-type application/json "
                                            f"(got {got})", None), 400)
        param, msg = pydantic_error_param(e, errs)
        return json_response(error_body(msg, param), 400)

    @app.exception_handler(SlotError)
    async def _slot(_req: Request, exc: SlotError):
        body = error_body(str(exc), None, type_="conflict")
        body["detail"] = str(exc)  # plain reason for admin clients
        return json_response(body, 409)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        t = _TYPES.get(exc.status_code, "invalid_request_error")
        code = "request_too_large" if exc.status_code == 413 else None  # a chunked body cut (limits.py)
        return json_response(error_body(str(exc.detail), None, type_=t, code=code), exc.status_code,
                             getattr(exc, "headers", None))

    app.add_middleware(CatchAllMiddleware)


class CatchAllMiddleware:
    """ASGI middleware: an exception that escapes the app is logged and answered 500 in the
    OpenAI shape (when no response has started), and not re-raised, so the server keeps the
    connection. A response already under way (a stream) is ended where it is."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def _send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, receive, _send)
        except Exception as exc:  # noqa: BLE001 - the last line of defence, logged
            log.exception("internal error on %s", scope.get("path"))
            if started:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            resp = json_response(error_body(f"internal error: {type(exc).__name__}", None, type_="server_error"),
                                 500)
            await resp(scope, receive, send)
