"""The topics an ingest worker reads and writes (names from ``schemas.topics``).

Values travel as raw bytes: parsing happens in the worker, so a malformed value becomes
a dead letter with its field and reason instead of a client decode error.
"""

from __future__ import annotations

from schemas import topics as T

CONSUMED = (T.COMPLETIONS, T.FEEDBACK)  # co-partitioned by completion_id
PRODUCED = (T.SAMPLES, T.DEADLETTER)
