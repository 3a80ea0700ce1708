"""The faust topic handles of the ingest app (names from ``schemas.topics``).

Values travel as raw bytes: parsing happens in the agents, so a malformed value becomes
a dead letter with its field and reason instead of a faust decode error.
"""

from __future__ import annotations

from schemas import topics as T


def declare(app):
    """Return ``(completions, feedback, samples, deadletter)`` faust topics on ``app``."""
    kw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    return (app.topic(T.COMPLETIONS, **kw), app.topic(T.FEEDBACK, **kw),
            app.topic(T.SAMPLES, **kw), app.topic(T.DEADLETTER, **kw))
