"""Parquet shards of RewardedSamples (layout: ``schemas.arrow``).

``<samples_dir>/model_version=<v>/date=<YYYY-MM-DD>/part-<uuid>.parquet``; ``date`` is the
UTC day of ``sealed_at``. Each shard is written to a hidden temp file in the same
directory, fsynced, renamed (atomic on POSIX) and the directory fsynced, so a reader never
sees a partial file and a shard that exists is complete and durable.
"""

from __future__ import annotations

import datetime as dt
import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.arrow import SAMPLE_SCHEMA, samples_to_table
from schemas.events import DeadLetter, RewardedSample

ROW_GROUP_ROWS = 4096  # rows per Parquet row group: a learner batch reads whole groups
# dictionary-encode only the repetitive columns: trying it on the large unique ones (expert
# routes, ~10 KiB of base64 each) made a shard ~5x slower to write (bench/RESULTS.md)
DICTIONARY_COLUMNS = ["sampling", "finish_reason"]
# expert_routes is already zstd inside (base64 text): compressing it again saved ~25 % of its
# bytes for 2-3x the shard's write time; every other column is zstd
COMPRESSION = {f.name: "none" if f.name == "expert_routes" else "zstd" for f in SAMPLE_SCHEMA}
STATISTICS_COLUMNS = ["completion_id", "created_at", "reward", "label", "n_votes", "votes_up", "votes_down",
                      "sealed_at"]  # min/max for filters; none on the token/route payloads


def partition_dir(samples_dir: Path, model_version: str, sealed_at_ms: int) -> Path:
    """``samples_dir/model_version=<v>/date=<YYYY-MM-DD>`` (UTC day of ``sealed_at_ms``)."""
    if not model_version or "/" in model_version or model_version.startswith("."):
        raise ValueError(f"model_version: {model_version!r} cannot be a directory name")
    day = dt.datetime.fromtimestamp(sealed_at_ms / 1000, tz=dt.timezone.utc).strftime("%Y-%m-%d")
    return Path(samples_dir) / f"model_version={model_version}" / f"date={day}"


def shard_namer(samples_dir: Path):
    """A ``RewardedSample -> path`` function giving one new shard path per partition
    (model_version, date) per call of the namer's owner (one tick)."""
    names: dict[tuple[str, int], str] = {}

    def shard_for(s: RewardedSample) -> str:
        k = (s.model_version, s.sealed_at // 86_400_000)  # UTC day
        if k not in names:
            d = partition_dir(samples_dir, s.model_version, s.sealed_at)
            names[k] = str(d / f"part-{uuid.uuid4().hex}.parquet")
        return names[k]

    return shard_for


def write_shard(samples: list[RewardedSample], path: str | Path) -> Path:
    """Write ``samples`` (all one model_version and day) to ``path`` atomically.

    Returns the path. Raises ``ValueError`` on an empty list.
    """
    if not samples:
        raise ValueError("samples: empty, nothing to write")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    table = samples_to_table(samples)
    with open(tmp, "wb") as f:
        pq.write_table(table, f, row_group_size=ROW_GROUP_ROWS, compression=COMPRESSION,
                       use_dictionary=DICTIONARY_COLUMNS, write_statistics=STATISTICS_COLUMNS)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


DEADLETTER_SCHEMA = pa.schema([("source_topic", pa.string()), ("key", pa.string()), ("field", pa.string()),
                               ("reason", pa.string()), ("payload", pa.string()), ("at", pa.int64())])


def write_deadletters(dead: list[DeadLetter], deadletters_dir: str | Path) -> Path | None:
    """Append ``dead`` as one atomic Parquet file ``deadletters_dir/part-<uuid>.parquet``
    (for the catalog's ``deadletters_by_reason``; the topic ``flywheel.deadletter`` stays the
    record). Returns the path, or None for an empty list."""
    if not dead:
        return None
    cols = {f.name: [getattr(d, f.name) for d in dead] for f in DEADLETTER_SCHEMA}
    path = Path(deadletters_dir) / f"part-{uuid.uuid4().hex}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    pq.write_table(pa.table(cols, schema=DEADLETTER_SCHEMA), tmp)
    os.rename(tmp, path)
    return path
