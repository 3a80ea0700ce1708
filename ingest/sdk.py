"""Feedback SDK, as imported inside Flywheel: the ``flywheel_feedback`` package (``sdk/``,
also its own distribution ``flywheel-feedback`` for product backends that do not install
Flywheel; decision D73). ``from ingest.sdk import FeedbackClient`` and the other names below
are the same objects as ``flywheel_feedback``'s. Guide and wire contract: ``docs/sdk.md``.
"""

from __future__ import annotations

from flywheel_feedback.client import (  # noqa: F401
    KINDS, MAX_BATCH, AsyncFeedbackClient, ClientClosed, FeedbackClient, QueueFull, build_event,
)

__all__ = ["AsyncFeedbackClient", "ClientClosed", "FeedbackClient", "QueueFull",
           "build_event", "KINDS", "MAX_BATCH"]
