"""flywheel-feedback: the non-blocking client a product uses to report what its users did with
a Flywheel completion (thumbs, scores, copies, regenerations, edits, follow-ups).

Installs alone (``pip install flywheel-feedback``: httpx and jsonschema-rs, no torch); inside a
Flywheel install the same module is ``ingest.sdk``. Usage and the HTTP wire contract:
``docs/sdk.md``.
"""

from flywheel_feedback.client import (
    KINDS, MAX_BATCH, AsyncFeedbackClient, ClientClosed, FeedbackClient, QueueFull, build_event,
)

__version__ = "0.2.0"

__all__ = ["AsyncFeedbackClient", "ClientClosed", "FeedbackClient", "QueueFull", "build_event", "KINDS",
           "MAX_BATCH", "__version__"]
