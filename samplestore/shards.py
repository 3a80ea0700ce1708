"""Parquet shards of RewardedSamples (format and columns: ``schemas.arrow``).

``<samples_dir>/date=<YYYY-MM-DD>/hour=<HH>/part-<sealed_ms>-<uuid>.parquet``: the UTC day and
hour of the shard's first ``sealed_at``, and that ``sealed_at`` (ms, 13 digits) in the name,
so a reader finds the shards sealed after a watermark by listing the newest partitions only
(``samplestore.catalog.find_shards``). Each shard is written to a hidden temp file in the same
directory, fsynced, renamed (atomic on POSIX) and the directory fsynced, so a reader never
sees a partial file and a shard that exists is complete and durable.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

import pydantic_core

from schemas.arrow import FORMAT_VERSION, SAMPLE_SCHEMA, samples_to_table, unwritable_column
from schemas.events import DeadLetter, RewardedSample, SampleNotice

ROW_GROUP_ROWS = 4096  # rows per Parquet row group: a learner batch reads whole groups
HOUR_MS = 3_600_000
# dictionary-encode only the repetitive columns: on the large unique ones (routes, token
# lists) it slows the write and saves nothing
DICTIONARY_COLUMNS = ["model_version", "split", "finish_reason", "expert_routes_dtype", "expert_routes_codec",
                      "reward_policy"]


def _leaf_paths(t: pa.DataType, name: str) -> list[str]:
    """Parquet's column paths under one field (what a per-column setting is keyed by)."""
    if pa.types.is_list(t):
        return _leaf_paths(t.value_type, f"{name}.list.element")
    if pa.types.is_struct(t):
        return [p for f in t for p in _leaf_paths(f.type, f"{name}.{f.name}")]
    return [name]


# every column zstd-compressed except the routes: since format 3 they are the zstd frame serving
# wrote (D65), which Parquet's zstd would only spend CPU on again. Keyed by leaf path: a column
# left out of the dict is written uncompressed.
COMPRESSION = {p: "none" if p == "expert_routes" else "zstd"
               for f in SAMPLE_SCHEMA for p in _leaf_paths(f.type, f.name)}
STATISTICS_COLUMNS = ["completion_id", "model_version", "split", "created_at", "sealed_at", "reward", "label",
                      "n_votes", "votes_up", "votes_down"]  # min/max for filters; none on the payloads
SHARD_NAME = re.compile(r"^part-(\d{13})-[0-9a-zA-Z_-]+\.parquet$")


class BadShardError(ValueError):
    """A shard row that is not a valid :class:`schemas.events.RewardedSample` (a NaN reward, a
    reward beyond ``schemas.reward.REWARD_LIMIT``, routes that do not fill their shape, ...).

    Attributes: ``path`` (the shard file), ``row`` (0-based row in it), ``completion_id`` (the
    row's, or None when unreadable), ``field`` (the first refused field, dotted for a nested
    one: ``sampling.top_p``) and ``reason`` (why, with the value). The message names all of
    them. The learner reads such a shard as it reads every contract break: the cycle stops
    before training and consumes nothing (``learner.data.SpilledSamples.from_shards``).
    """

    def __init__(self, path: str | Path, row: int, completion_id: str | None, field: str, reason: str):
        self.path, self.row, self.completion_id, self.field, self.reason = Path(path), row, completion_id, field, reason
        super().__init__(f"shard {self.path}: row {row} (completion_id {completion_id}): {field}: {reason}; "
                         f"not a valid RewardedSample (schemas.events), so the cycle trains on nothing and "
                         f"consumes nothing: move the shard out of the samples directory to train on the others")

    @classmethod
    def of(cls, path: str | Path, row: int, completion_id: str | None, exc: Exception) -> "BadShardError":
        """The error for row ``row`` of ``path`` that ``schemas.arrow.row_to_sample`` refused
        with ``exc``: a ``pydantic.ValidationError`` gives its first error's location and
        message (and the refused value); a ``ValueError`` whose text starts ``"<field>: "``
        (``schemas.arrow.routes_from_raw``) gives that field; any other the exception's type."""
        import pydantic

        if isinstance(exc, pydantic.ValidationError):
            e = exc.errors()[0]
            field = ".".join(str(x) for x in e["loc"]) or "row"
            reason = e["msg"].removeprefix("Value error, ")
            if "input" in e and not isinstance(e["input"], (dict, list)):
                reason += f", got {e['input']!r}"
            return cls(path, row, completion_id, field, reason)
        head, sep, rest = str(exc).partition(": ")
        if sep and head.isidentifier():
            return cls(path, row, completion_id, head, rest)
        return cls(path, row, completion_id, "row", f"{type(exc).__name__}: {exc}")


def partition_dir(samples_dir: Path, sealed_at_ms: int) -> Path:
    """``samples_dir/date=<YYYY-MM-DD>/hour=<HH>`` (UTC day and hour of ``sealed_at_ms``).

    Raises:
        ValueError: ``sealed_at_ms`` is negative or beyond year 9999."""
    if not 0 <= int(sealed_at_ms) < 253_402_300_800_000:
        raise ValueError(f"sealed_at: {sealed_at_ms} ms is not a time between 1970 and 9999")
    t = dt.datetime.fromtimestamp(int(sealed_at_ms) / 1000, tz=dt.timezone.utc)
    return Path(samples_dir) / f"date={t:%Y-%m-%d}" / f"hour={t:%H}"


def shard_path(samples_dir: Path, sealed_at_ms: int, tag: str | None = None) -> Path:
    """A new shard path for samples first sealed at ``sealed_at_ms``:
    ``partition_dir(...)/part-<sealed_at_ms:013d>-<tag or a uuid4 hex>.parquet``.

    Raises:
        ValueError: ``tag`` has characters other than letters, digits, ``_`` and ``-``."""
    tag = tag or uuid.uuid4().hex
    p = partition_dir(samples_dir, sealed_at_ms) / f"part-{int(sealed_at_ms):013d}-{tag}.parquet"
    if not SHARD_NAME.match(p.name):
        raise ValueError(f"tag: {tag!r} must be letters, digits, '_' or '-'")
    return p


def shard_time(path: str | Path) -> int | None:
    """The ``sealed_ms`` in a shard's file name (a lower bound of its rows' ``sealed_at``),
    or None when the name does not follow :func:`shard_path`."""
    m = SHARD_NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def shard_namer(samples_dir: Path):
    """A ``RewardedSample -> path`` function giving one new shard path per hour partition
    per call of the namer's owner (one tick); the first sample named in a partition gives
    the name's time, so callers name samples in ``sealed_at`` order."""
    names: dict[int, str] = {}

    def shard_for(s: RewardedSample) -> str:
        k = s.sealed_at // HOUR_MS
        if k not in names:
            names[k] = str(shard_path(samples_dir, s.sealed_at))
        return names[k]

    return shard_for


def write_shard(samples: list[RewardedSample], path: str | Path) -> Path:
    """Write ``samples`` (in :data:`schemas.arrow.SAMPLE_SCHEMA`) to ``path`` atomically.

    Returns the path. Raises ``ValueError`` on an empty list.
    """
    if not samples:
        raise ValueError("samples: empty, nothing to write")
    return write_table(samples_to_table(samples), path)


def shard_parts(samples: list[RewardedSample], encode: Callable[[RewardedSample, int], bytes] | None = None
                ) -> tuple[list[RewardedSample], pa.Table | None, list[bytes], list[tuple[RewardedSample, str, str]]]:
    """Split ``samples`` into what can be written and what cannot: ``(good samples, their
    table, their values for the samples topic, bad)``, ``bad`` as ``(sample, field, reason)``
    for :meth:`ingest.join.Joiner.quarantine`. One record the shard or the topic refuses (a
    value Arrow or UTF-8 cannot hold that passed the contract) never holds back the others;
    the whole list is converted at once, and one by one only when that fails.

    ``encode``: ``(sample, row) -> bytes``, a good sample's topic value given its 0-based row
    in the table (:func:`notice_encoder`); default the whole sample's JSON (:func:`sample_json`)."""
    encode = encode or sample_json
    try:
        return samples, samples_to_table(samples), [encode(s, i) for i, s in enumerate(samples)], []
    except Exception:  # noqa: BLE001 - found sample by sample below
        pass
    good, values, bad = [], [], []
    for s in samples:
        try:
            samples_to_table([s])
            values.append(encode(s, len(good)))
        except Exception as exc:  # noqa: BLE001 - any refusal quarantines this sample only
            at = unwritable_column(s)
            fld, reason = at if at is not None else (_unserialisable_field(s), f"{type(exc).__name__}: {str(exc)[:200]}")
            bad.append((s, fld, reason))
        else:
            good.append(s)
    return good, (samples_to_table(good) if good else None), values, bad


# = RewardedSample.to_bytes (model_dump_json().encode()): the same bytes, straight from
# pydantic-core, without the str in between (two copies of a ~19 KiB sample)
_sample_json = RewardedSample.__pydantic_serializer__.to_json
# the notice's fields taken from the sample, in the model's order; its last three name the row
_NOTICE_FROM_SAMPLE = tuple(f for f in SampleNotice.model_fields if f not in ("shard", "row", "shard_format"))
if tuple(SampleNotice.model_fields)[-3:] != ("shard", "row", "shard_format"):  # the encoder's key order
    raise ImportError("schemas.events.SampleNotice: shard, row, shard_format must be its last fields")


def sample_json(s: RewardedSample, row: int = 0) -> bytes:
    """The whole sample as the samples topic's value (``samples_value = "sample"``):
    ``RewardedSample.to_bytes``. ``row`` is not used."""
    return _sample_json(s)


def notice_encoder(path: str | Path, samples_dir: str | Path,
                   first_row: int = 0) -> Callable[[RewardedSample, int], bytes]:
    """A ``(sample, row) -> bytes`` giving the :class:`schemas.events.SampleNotice` JSON of a
    sample at row ``first_row + row`` of the shard ``path`` (under ``samples_dir``): the
    samples topic's value by default (D67). ``first_row``: rows of the shard before this chunk.

    Raises:
        ValueError: ``path`` is not under ``samples_dir``."""
    shard = Path(path).relative_to(samples_dir).as_posix()

    def encode(s: RewardedSample, row: int) -> bytes:
        # the model's JSON (its fields in order, from a validated sample's own values) without
        # building the model: the same bytes as SampleNotice(...).to_bytes() (tested)
        d = s.__dict__
        return pydantic_core.to_json({**{k: d[k] for k in _NOTICE_FROM_SAMPLE}, "shard": shard, "row": first_row + row,
                                      "shard_format": FORMAT_VERSION})

    return encode


def _unserialisable_field(s: RewardedSample) -> str:
    """The first field of ``s`` that its JSON encoding refuses (else ``"value"``)."""
    for name in type(s).model_fields:
        try:
            pydantic_core.to_json(getattr(s, name))
        except Exception:  # noqa: BLE001 - names the field
            return name
    return "value"


def write_table(table: pa.Table, path: str | Path) -> Path:
    """Write a :data:`schemas.arrow.SAMPLE_SCHEMA` table to ``path`` atomically (temp file,
    fsync, rename, directory fsync) with the shard's Parquet settings. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
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
