"""Who may call what, checked before any request body is read (OpenAI conventions).

Three kinds of bearer token (``Authorization: Bearer <token>``):

* API keys: every ``/v1/*`` path (inference, models, feedback).
* Feedback-only keys, safe for a browser to hold: ``POST /v1/feedback`` and
  ``POST /v1/feedback/batch`` only; any other ``/v1/*`` path answers 403.
* The admin token: ``/admin/*`` only.

A missing or wrong token is 401 (``WWW-Authenticate: Bearer``), a valid token on a path it
may not call 403. With no API key configured ``/v1/*`` is open; with no admin token
``/admin/*`` is (local use: ``flywheel serve`` refuses a non-loopback host without one).
``/health``, ``/healthz``, ``/metrics`` and the OpenAPI docs are always open.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from serving.http.errors import error_body, json_response

FEEDBACK_PATHS = frozenset({"/v1/feedback", "/v1/feedback/batch"})


def load_keys(env_var: str, path: str | Path | None = None) -> set[str] | None:
    """Keys from a file (one per line, ``#`` comments) and/or a comma-separated env var;
    None when neither gives one (that kind of auth off)."""
    keys: set[str] = set()
    if path:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.add(line)
    env = os.environ.get(env_var)
    if env:
        keys.update(k.strip() for k in env.split(",") if k.strip())
    return keys or None


def _matches(token: str, keys: set[str] | frozenset[str]) -> bool:
    # compare against every key, in constant time per key: no early exit on the first match
    hit = False
    for k in keys:
        hit |= hmac.compare_digest(token.encode(), k.encode())
    return hit


@dataclass(frozen=True)
class AuthPolicy:
    """The pod's tokens. None (or empty) turns that check off.

    Attributes:
        api_keys: bearer keys for ``/v1/*``.
        feedback_keys: bearer keys for the feedback paths only (:data:`FEEDBACK_PATHS`).
        admin_token: bearer token for ``/admin/*``.
    """

    api_keys: frozenset[str] | None = None
    feedback_keys: frozenset[str] | None = None
    admin_token: str | None = None

    def decide(self, path: str, token: str | None) -> tuple[int, str] | None:
        """None if a request for ``path`` bearing ``token`` may proceed, else
        ``(status, reason)`` with status 401 (missing or wrong token) or 403 (a feedback-only
        key off the feedback paths)."""
        if path == "/admin" or path.startswith("/admin/"):
            if not self.admin_token:
                return None
            if token is None:
                return 401, "missing Authorization: Bearer <admin token>"
            return None if _matches(token, {self.admin_token}) else (401, "invalid admin token")
        if path.startswith("/v1/"):
            if not self.api_keys:
                return None
            if token is None:
                return 401, "missing Authorization: Bearer <key>"
            if _matches(token, self.api_keys):
                return None
            if self.feedback_keys and _matches(token, self.feedback_keys):
                if path in FEEDBACK_PATHS:
                    return None
                return 403, (f"this key may only post feedback ({', '.join(sorted(FEEDBACK_PATHS))}), "
                             f"not call {path}")
            return 401, "invalid API key"
        return None


def bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of the ``Authorization: Bearer`` header in raw ASGI headers, or None."""
    for k, v in headers:
        if k == b"authorization":
            h = v.decode("latin-1")
            return h[7:].strip() if h[:7].lower() == "bearer " else None
    return None


class AuthMiddleware:
    """ASGI middleware applying an :class:`AuthPolicy` before routing, so an
    unauthenticated request is refused 401 whatever its body holds."""

    def __init__(self, app, policy: AuthPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            denied = self.policy.decide(scope.get("path", ""), bearer(scope.get("headers") or []))
            if denied is not None:
                status, reason = denied
                t = "authentication_error" if status == 401 else "permission_error"
                headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
                return await json_response(error_body(reason, None, type_=t), status, headers)(scope, receive, send)
        return await self.app(scope, receive, send)
