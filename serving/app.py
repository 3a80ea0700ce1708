"""The serving pod's HTTP API: OpenAI-compatible inference, feedback, admin, metrics.

``create_app`` assembles the parts of :mod:`serving.http` (auth, errors, metrics, the
serving classes and their routers) over an engine + weight slots + event log. Every
completion produces exactly one ``CompletionEvent`` on ``flywheel.completions`` (key =
completion id); every accepted feedback one ``FeedbackEvent`` on ``flywheel.feedback``.
Model names, completion ids and headers: :mod:`serving.http.serving_openai`; feedback:
:mod:`serving.http.serving_feedback`; who may call what: :mod:`serving.http.auth`. Feedback
serving derives itself from chat requests (``regenerate``, ``followup``) goes to
``flywheel.feedback`` too: :mod:`serving.signals`.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from schemas import settings
from schemas.split import check_share
from schemas.topics import TopicNames
from serving.config import DEFAULT_POD, ServeConfig
from serving.eventlog import EventLog
from serving.http import errors
from serving.http.auth import AuthMiddleware, AuthPolicy, load_keys
from serving.http.completion_log import CompletionLogger
from serving.http.limits import DEFAULT_MAX_BODY_BYTES, PROMPT_PATHS, BodyLimitMiddleware, prompt_body_bytes
from serving.http.metrics import RequestCountMiddleware, ServingMetrics
from serving.http.prompts import PromptBuilder
from serving.http.router_admin import router as admin_router
from serving.http.router_feedback import router as feedback_router
from serving.http.router_ops import router as ops_router
from serving.http.router_v1 import router as v1_router
from serving.http.serving_feedback import FeedbackServing
from serving.http.serving_openai import (
    CID_HEADER, CIDS_HEADER, DEFAULT_SERVED_MODEL_NAME, USER_HEADER, VERSION_HEADER, OpenAIServing,
)
from serving.http.state import ServingState
from serving.signals import SignalDetector
from serving.slots import Slots

__all__ = ["create_app", "load_keys", "user_salt", "CID_HEADER", "CIDS_HEADER",
           "USER_HEADER", "VERSION_HEADER", "DEFAULT_SERVED_MODEL_NAME"]


def user_salt(fleet: bool = False, why: str = "") -> str:
    """The pod's user-id salt: :func:`schemas.settings.user_salt` (``FLYWHEEL_USER_SALT``,
    ``FLYWHEEL_USER_SALT_FILE``, else, on one box only, ``$FLYWHEEL_HOME/user_salt``).

    Raises:
        schemas.settings.SaltError: see :func:`schemas.settings.user_salt`.
    """
    return settings.user_salt(fleet=fleet, why=why)


class PortSplitMiddleware:
    """Keeps the operator's paths off the product port (pure ASGI, outermost).

    With an admin port, ``/admin/*`` and ``/metrics`` are answered only on connections to that
    port, and the product paths (``/v1/*``, everything else) only on the others; ``/health``
    and ``/healthz`` on both (probes). A path on the wrong port gets the 404 of an unknown
    path, before auth, so the product port does not even say that ``/admin`` exists. The port
    is the local one of the connection (ASGI ``scope["server"]``), so a Service that forwards
    only the product port cannot reach ``/admin`` whatever path a client sends.

    Args:
        app: the ASGI app.
        admin_port: the TCP port of ``/admin`` and ``/metrics``.
    """

    def __init__(self, app, admin_port: int):
        self.app, self.admin_port = app, admin_port

    @staticmethod
    def is_ops_path(path: str) -> bool:
        return path == "/metrics" or path == "/admin" or path.startswith("/admin/")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in ("/health", "/healthz"):
            port = (scope.get("server") or (None, None))[1]
            if (port == self.admin_port) != self.is_ops_path(scope["path"]):
                resp = errors.json_response(errors.error_body("Not Found", None, code="not_found"), 404)
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(slots: Slots, event_log: EventLog | None, *, pod: str | None = None, salt: str | None = None,
               api_keys: set[str] | None = None, admin_token: str | None = None,
               feedback_keys: set[str] | None = None, served_model_name: str | None = None,
               eval_share: float | None = None, cors_origins: list[str] | None = None,
               max_prompt_tokens: int = 8192, default_max_tokens: int = 256,
               max_body_bytes: int | None = None, admin_port: int | None = None,
               signals: SignalDetector | None = None, topics: TopicNames | None = None) -> FastAPI:
    """The FastAPI app of one serving pod.

    Args:
        slots: stable/candidate weights over the engine (stable must be loaded).
        event_log: where events go; None turns event logging off (benchmarks only).
        pod: pod name written into every CompletionEvent (default ``serving.config.DEFAULT_POD``).
        salt: user-id salt (default :func:`user_salt`).
        api_keys: Bearer keys accepted for ``/v1/*``; None = no auth.
        admin_token: Bearer token for ``/admin/*``; None = no auth (local use only).
        feedback_keys: Bearer keys accepted for the feedback paths only (a browser may hold one).
        served_model_name: the ``model`` name that routes by the sticky split (label
            ``model_name`` on the metrics; default :class:`serving.config.ServeConfig`'s).
        eval_share: share of untagged prompts in the eval split, [0, 1] (:mod:`schemas.split`;
            default :class:`serving.config.ServeConfig`'s).
        cors_origins: browser origins allowed to call the API (CORS; ``["*"]`` for any), so a web
            page can post feedback with a feedback-only key; None = no CORS headers.
        max_prompt_tokens: longer prompts get HTTP 400 ``context_length_exceeded`` (tokens; D77).
        default_max_tokens: chat ``max_tokens`` when the request sets none (tokens).
        max_body_bytes: larger request bodies get HTTP 413 (bytes; default
            ``serving.http.limits.DEFAULT_MAX_BODY_BYTES``); on the inference paths
            the bound is at most :func:`serving.http.limits.prompt_body_bytes` of ``max_prompt_tokens``.
        admin_port: answer ``/admin/*`` and ``/metrics`` only on this local port and the product
            paths only on others (:class:`PortSplitMiddleware`); None = every path on every port.
        signals: derives ``regenerate`` / ``followup`` feedback from chat requests that name a
            user (default :meth:`serving.signals.SignalDetector.from_config` of
            :class:`serving.config.ServeConfig`'s defaults; one with both kinds off derives
            nothing).
        topics: the topic names events go to (default :func:`schemas.settings.topic_names`,
            resolved once here).

    Raises:
        ValueError: ``eval_share`` outside [0, 1].
    """
    serve_defaults = ServeConfig()
    pod = DEFAULT_POD if pod is None else pod
    served_model_name = serve_defaults.served_model_name if served_model_name is None else served_model_name
    eval_share = check_share(serve_defaults.eval_share if eval_share is None else eval_share)
    max_body_bytes = DEFAULT_MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes
    engine = slots.engine
    salt = salt or user_salt()
    openai_box: list[OpenAIServing] = []  # the gauges read it once it exists
    metrics = ServingMetrics(
        served_model_name, event_log, queue_depth=engine.queue_depth,
        running=lambda: openai_box[0].running() if openai_box else 0.0,
        swap_pause_s=lambda: None if slots.last_swap_pause_ms is None else slots.last_swap_pause_ms / 1000)
    topics = topics or settings.topic_names()
    completions_log = CompletionLogger(event_log, pod, topics.completions, on_emit=lambda kind: metrics.events_accepted.labels(kind).inc())
    prompts = PromptBuilder(engine.tokenizer, engine.max_positions, max_prompt_tokens)
    signals = SignalDetector.from_config(serve_defaults) if signals is None else signals
    openai = OpenAIServing(slots, prompts, completions_log, metrics, salt=salt, served_model_name=served_model_name,
                           eval_share=eval_share, default_max_tokens=default_max_tokens, signals=signals,
                           feedback_topic=topics.feedback)
    openai_box.append(openai)
    feedback = FeedbackServing(event_log, completions_log, metrics, salt, topics.feedback)

    app = FastAPI(title="Flywheel serving", version="1")
    app.state.flywheel = ServingState(pod=pod, slots=slots, event_log=event_log, metrics=metrics,
                                      completions_log=completions_log, openai=openai, feedback=feedback)
    app.state.slots = slots
    app.state.metrics = metrics
    app.state.event_log = event_log
    for r in (v1_router, feedback_router, admin_router, ops_router):
        app.include_router(r)
    _install_middlewares(app, metrics, prompts, max_body_bytes=max_body_bytes, api_keys=api_keys,
                         feedback_keys=feedback_keys, admin_token=admin_token, cors_origins=cors_origins,
                         admin_port=admin_port)
    return app


def _install_middlewares(app: FastAPI, metrics: ServingMetrics, prompts: PromptBuilder, *, max_body_bytes: int,
                         api_keys: set[str] | None, feedback_keys: set[str] | None, admin_token: str | None,
                         cors_origins: list[str] | None, admin_port: int | None) -> None:
    """The pod's middlewares, innermost first: the catch-all error handler, the body limits
    (a prompt path's bound from ``prompts``' token limit), auth, the request counter, CORS
    and the admin-port split (:func:`create_app`'s arguments of the same names)."""
    errors.install(app)  # CatchAllMiddleware: innermost of the middlewares below
    prompt_limit = min(max_body_bytes, prompt_body_bytes(prompts.max_prompt_tokens))
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes,  # only after auth
                       path_limits={p: prompt_limit for p in PROMPT_PATHS})
    policy = AuthPolicy(api_keys=frozenset(api_keys) if api_keys else None,
                        feedback_keys=frozenset(feedback_keys) if feedback_keys else None,
                        admin_token=admin_token or None)
    app.add_middleware(AuthMiddleware, policy=policy)
    app.add_middleware(RequestCountMiddleware, metrics=metrics)  # counts refusals too
    if cors_origins:  # outermost: a browser's preflight (no token) is answered before auth
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type", "x-flywheel-user", "x-flywheel-split"],
                           expose_headers=[CID_HEADER, CIDS_HEADER, VERSION_HEADER, "x-flywheel-split"], max_age=600)
    if admin_port is not None:  # outermost: a path on the wrong port is unknown there, before auth
        app.add_middleware(PortSplitMiddleware, admin_port=admin_port)
