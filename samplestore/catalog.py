"""DuckDB catalog over the sample shards, and the shard finder the learner reads through.

The catalog file (``schemas.settings.catalog_path()``) holds only views over the Parquet
glob, with the glob **relative to the catalog's folder**: open it with plain DuckDB from that
folder (``cd $FLYWHEEL_HOME && duckdb catalog.duckdb``) or set ``file_search_path`` to it;
copying the home elsewhere keeps the catalog valid. It is opened briefly and closed, because
other processes (learner, ``flywheel data stats``) open it too and DuckDB allows one writer at
a time. Every view is documented with an example query in ``docs/data.md``.

Views:
    samples: every shard row (``schemas.arrow.SAMPLE_SCHEMA``) plus the hive partition
        columns ``date`` (DATE) and ``hour`` (INTEGER), the UTC day and hour of the shard's
        first seal.
    votes_by_version: per model_version, all splits: samples, votes_up, votes_down,
        thumbs_up_rate (= votes_up / (votes_up + votes_down)), mean_reward.
    votes_by_split: the same per model_version and split (``train`` | ``eval``): feedback
        on eval prompts is counted apart, never pooled with train.
    label_balance: per model_version, split and label: samples.
    shards: per shard file (path relative to the catalog): samples, first_sealed_at,
        last_sealed_at.
    deadletters: every dead letter file row; deadletters_by_reason: per source_topic, field
        and reason kind (the reason up to its first ``:``): n.

Finding new samples without a scan (:func:`find_shards`): shard names carry the time of
their first seal (``samplestore.shards.shard_path``) inside ``date=/hour=`` partitions, so the
shards sealed at or after a watermark are found by listing the partitions from the
watermark's hour on; older partitions are never opened.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from samplestore.shards import HOUR_MS, shard_time
from schemas import settings
from schemas.arrow import ADDED_AFTER_2, SAMPLE_SCHEMA, format_version, table_to_samples
from schemas.events import RewardedSample

OLD_LAYOUT_PREFIX = "model_version="


class OldShardsError(RuntimeError):
    """Shards in the format-1 layout or format are present: run ``flywheel data migrate``."""


def _sql_type(t: pa.DataType) -> str:
    if pa.types.is_struct(t):
        return "STRUCT(" + ", ".join(f"{f.name} {_sql_type(f.type)}" for f in t) + ")"
    if pa.types.is_list(t):
        return _sql_type(t.value_type) + "[]"
    if pa.types.is_timestamp(t):
        return "TIMESTAMPTZ" if t.tz else "TIMESTAMP"
    simple = {pa.string(): "VARCHAR", pa.int64(): "BIGINT", pa.int32(): "INTEGER", pa.float32(): "FLOAT",
              pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN", pa.binary(): "BLOB"}
    return simple[t]


def _has_shards(samples_dir: Path) -> bool:
    return any(Path(samples_dir).glob("**/*.parquet"))


def old_layout(samples_dir: Path) -> bool:
    """True when ``samples_dir`` holds format-1 partitions (``model_version=<v>/date=...``)."""
    d = Path(samples_dir)
    return d.is_dir() and any(e.name.startswith(OLD_LAYOUT_PREFIX) for e in os.scandir(d))


def _check_readable(samples_dir: Path) -> None:
    """Raise :class:`OldShardsError` for mixed layouts or format-1 files (one footer read)."""
    d = Path(samples_dir)
    if not old_layout(d):
        return
    if any(e.name.startswith("date=") for e in os.scandir(d)):
        raise OldShardsError(f"samples_dir {d}: shards in both the old (model_version=...) and the new "
                             "(date=.../hour=...) layout; run `flywheel data migrate` once")
    first = next(d.glob("**/*.parquet"), None)
    if first is not None and format_version(pq.read_schema(first)) < 2:
        raise OldShardsError(f"samples_dir {d}: format-1 shards (JSON sampling/routes, integer times); run "
                             "`flywheel data migrate` once")


def samples_sql(samples_dir: Path, base: Path | None = None) -> str:
    """A SELECT over every shard with the hive columns; with ``base``, the glob is written
    relative to it. An empty typed SELECT when there are no shards.

    Raises:
        OldShardsError: format-1 shards are present (``flywheel data migrate``).
    """
    samples_dir = Path(samples_dir)
    if _has_shards(samples_dir):
        _check_readable(samples_dir)
        root = os.path.relpath(samples_dir, base) if base is not None else str(samples_dir)
        g = str(Path(root) / "**" / "*.parquet").replace("'", "''")
        hive = ("{'model_version': VARCHAR, 'date': VARCHAR}" if old_layout(samples_dir)
                else "{'date': DATE, 'hour': INTEGER}")
        # union_by_name: format-2 files lack expert_routes_codec (read as null = raw routes); the
        # empty typed SELECT gives the column its type when no file has it yet
        return (f"SELECT * FROM read_parquet('{g}', hive_partitioning=true, hive_types={hive}, union_by_name=true)"
                f" UNION ALL BY NAME ({_added_sql()})")
    cols = ", ".join(f"CAST(NULL AS {_sql_type(f.type)}) AS {f.name}" for f in SAMPLE_SCHEMA)
    return f"SELECT {cols}, CAST(NULL AS DATE) AS date, CAST(NULL AS INTEGER) AS hour LIMIT 0"


def _added_sql() -> str:
    """An empty SELECT of the columns added after format 2 (``schemas.arrow.ADDED_AFTER_2``), typed."""
    return "SELECT " + ", ".join(f"CAST(NULL AS {_sql_type(SAMPLE_SCHEMA.field(c).type)}) AS {c}"
                                 for c in ADDED_AFTER_2) + " LIMIT 0"


def deadletters_dir(samples_dir: Path) -> Path:
    """Where the worker keeps its dead-letter files: next to the samples root."""
    return Path(samples_dir).parent / "deadletters"


def _deadletters_sql(samples_dir: Path, base: Path | None) -> str:
    d = deadletters_dir(samples_dir)
    if any(d.glob("*.parquet")):
        root = os.path.relpath(d, base) if base is not None else str(d)
        g = str(Path(root) / "*.parquet").replace("'", "''")
        return f"SELECT * FROM read_parquet('{g}')"
    return ("SELECT CAST(NULL AS VARCHAR) AS source_topic, CAST(NULL AS VARCHAR) AS key, CAST(NULL AS VARCHAR) "
            "AS field, CAST(NULL AS VARCHAR) AS reason, CAST(NULL AS VARCHAR) AS payload, CAST(NULL AS BIGINT) "
            "AS at LIMIT 0")


_VOTES = ("count(*) AS samples, sum(votes_up)::BIGINT AS votes_up, sum(votes_down)::BIGINT AS votes_down, "
          "sum(votes_up) / nullif(sum(votes_up) + sum(votes_down), 0) AS thumbs_up_rate, "
          "avg(reward) AS mean_reward")


def _shards_sql(samples_dir: Path, base: Path | None) -> str:
    if not _has_shards(samples_dir):
        return ("SELECT CAST(NULL AS VARCHAR) AS path, CAST(NULL AS BIGINT) AS samples, CAST(NULL AS TIMESTAMPTZ) "
                "AS first_sealed_at, CAST(NULL AS TIMESTAMPTZ) AS last_sealed_at LIMIT 0")
    src = samples_sql(samples_dir, base).replace("hive_partitioning=true", "filename=true, hive_partitioning=true")
    return (f"SELECT filename AS path, count(*) AS samples, min(sealed_at) AS first_sealed_at, "
            f"max(sealed_at) AS last_sealed_at FROM ({src}) GROUP BY filename ORDER BY path")


def _views(samples_dir: Path, base: Path | None = None) -> list[str]:
    """The catalog's CREATE VIEW statements (globs relative to ``base`` when given)."""
    return [
        f"CREATE OR REPLACE VIEW samples AS {samples_sql(samples_dir, base)}",
        f"CREATE OR REPLACE VIEW votes_by_version AS SELECT model_version, {_VOTES} FROM samples "
        "GROUP BY model_version ORDER BY model_version",
        f"CREATE OR REPLACE VIEW votes_by_split AS SELECT model_version, split, {_VOTES} FROM samples "
        "GROUP BY model_version, split ORDER BY model_version, split",
        "CREATE OR REPLACE VIEW label_balance AS SELECT model_version, split, label, count(*) AS samples "
        "FROM samples GROUP BY model_version, split, label ORDER BY model_version, split, label",
        f"CREATE OR REPLACE VIEW shards AS {_shards_sql(samples_dir, base)}",
        f"CREATE OR REPLACE VIEW deadletters AS {_deadletters_sql(samples_dir, base)}",
        "CREATE OR REPLACE VIEW deadletters_by_reason AS SELECT source_topic, field, "
        "split_part(reason, ':', 1) AS reason, count(*) AS n FROM deadletters "
        "GROUP BY ALL ORDER BY n DESC, source_topic, field, reason",
    ]


def connect_retry(path: Path, timeout_s: float = 10.0, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """``duckdb.connect(path)``, retried while another process holds the file's lock.

    Raises:
        duckdb.IOException: still locked after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return duckdb.connect(str(path), read_only=read_only)
        except duckdb.IOException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def refresh_catalog(samples_dir: Path | None = None, catalog: Path | None = None,
                    timeout_s: float = 10.0) -> Path:
    """(Re)create the catalog views, their globs relative to the catalog's folder; opens the
    DuckDB file briefly and closes it.

    Raises:
        duckdb.IOException: the file stayed locked by another process for ``timeout_s``.
        OldShardsError: format-1 shards are present (``flywheel data migrate``).
    """
    samples_dir = Path(samples_dir or settings.samples_dir()).absolute()
    catalog = Path(catalog or settings.catalog_path()).absolute()
    catalog.parent.mkdir(parents=True, exist_ok=True)
    con = connect_retry(catalog, timeout_s)
    try:
        con.execute("SET file_search_path = ?", [str(catalog.parent)])  # binds the relative globs
        for q in _views(samples_dir, catalog.parent):
            con.execute(q)
    finally:
        con.close()
    return catalog


def query(sql: str, samples_dir: Path | None = None, params: list | None = None) -> list[dict]:
    """Run ``sql`` against the catalog views, in an in-memory DuckDB (no file lock)."""
    samples_dir = Path(samples_dir or settings.samples_dir())
    con = duckdb.connect()
    try:
        for q in _views(samples_dir):
            con.execute(q.replace("CREATE OR REPLACE VIEW", "CREATE OR REPLACE TEMP VIEW"))
        cur = con.execute(sql, params or [])
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]
    finally:
        con.close()


def read_samples(samples_dir: Path | str | None = None, since_ms: int | None = None) -> list[RewardedSample]:
    """Every RewardedSample in the shards (a full scan: for tests and tools; the learner
    uses :func:`find_shards`), with ``sealed_at >= since_ms`` if given, ordered by
    ``sealed_at`` then ``completion_id``."""
    samples_dir = Path(samples_dir or settings.samples_dir())
    con = duckdb.connect()
    try:
        con.execute(f"CREATE TEMP VIEW samples AS {samples_sql(samples_dir)}")
        where = " WHERE epoch_ms(sealed_at) >= ?" if since_ms is not None else ""
        cols = ", ".join(f.name for f in SAMPLE_SCHEMA)
        tbl = con.sql(f"SELECT {cols} FROM samples{where} ORDER BY sealed_at, completion_id",
                      params=[int(since_ms)] if since_ms is not None else None).to_arrow_table()
    finally:
        con.close()
    return table_to_samples(tbl)


@dataclass(frozen=True)
class Shard:
    """One shard file: ``path``, and ``sealed_ms``, the first seal time in its name (every
    row has ``sealed_at >= sealed_ms``)."""

    path: Path
    sealed_ms: int

    @property
    def name(self) -> str:
        """``date=<d>/hour=<h>/<file>``: unique under one samples root."""
        return "/".join(self.path.parts[-3:])


def _hour_start_ms(date_dir: str, hour_dir: str) -> int | None:
    import datetime as dt

    try:
        d = dt.datetime.strptime(date_dir[5:] + hour_dir[5:], "%Y-%m-%d%H").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return None
    return int(d.timestamp() * 1000)


def find_shards(samples_dir: Path | str, since_ms: int = 0) -> list[Shard]:
    """The shards whose first seal is at or after ``since_ms``, oldest first, found by
    listing only the ``date=``/``hour=`` partitions from ``since_ms``'s hour on (no read of
    any file; older partitions are not opened). A file in a partition whose name does not
    carry a time gets its partition's start hour.

    Raises:
        OldShardsError: ``samples_dir`` holds format-1 partitions (``flywheel data migrate``).
    """
    root = Path(samples_dir)
    if not root.is_dir():
        return []
    if old_layout(root):
        raise OldShardsError(f"samples_dir {root}: shards in the old layout (model_version=.../date=...); "
                             "run `flywheel data migrate` once")
    first_hour = int(since_ms) // HOUR_MS * HOUR_MS
    first_day = first_hour // 86_400_000 * 86_400_000
    out: list[Shard] = []
    for day in sorted(e.name for e in os.scandir(root) if e.is_dir() and e.name.startswith("date=")):
        day_start = _hour_start_ms(day, "hour=00")
        if day_start is None or day_start < first_day:
            continue
        for hour in sorted(e.name for e in os.scandir(root / day) if e.is_dir() and e.name.startswith("hour=")):
            h0 = _hour_start_ms(day, hour)
            if h0 is None or h0 < first_hour:
                continue
            for e in os.scandir(root / day / hour):
                if e.name.startswith(".") or not e.name.endswith(".parquet"):
                    continue
                t = shard_time(e.name)
                t = h0 if t is None else t
                if t >= since_ms:
                    out.append(Shard(Path(e.path), t))
    out.sort(key=lambda s: (s.sealed_ms, s.name))
    return out


def read_shards(shards: list[Shard] | list[Path], columns: list[str] | None = None,
                where: str | None = None) -> pa.Table:
    """The rows of ``shards`` (only these files are opened) as one Arrow table in
    :data:`SAMPLE_SCHEMA` order, optionally only ``columns`` and rows matching the SQL
    predicate ``where`` (e.g. ``"split = 'train'"``); empty list -> empty table."""
    paths = [str(s.path if isinstance(s, Shard) else s) for s in shards]
    cols = columns or [f.name for f in SAMPLE_SCHEMA]
    if not paths:
        return pa.schema([SAMPLE_SCHEMA.field(c) for c in cols]).empty_table()
    con = duckdb.connect()
    try:
        src = "read_parquet(?, hive_partitioning=false, union_by_name=true)"
        if any(c in ADDED_AFTER_2 for c in cols):  # absent from older files: null
            src = f"(SELECT * FROM {src} UNION ALL BY NAME ({_added_sql()}))"
        sql = f"SELECT {', '.join(cols)} FROM {src}"
        return con.sql(sql + (f" WHERE {where}" if where else ""), params=[paths]).to_arrow_table()
    finally:
        con.close()


def count_rows(shards: list[Shard], split: str | None = None) -> int:
    """Rows in ``shards`` (Parquet footers only), or only those of ``split`` (reads the
    dictionary-encoded ``split`` column of these files)."""
    if split is None:
        return sum(pq.ParquetFile(s.path).metadata.num_rows for s in shards)
    if split not in ("train", "eval"):
        raise ValueError(f"split: must be 'train' or 'eval', got {split!r}")
    return read_shards(shards, ["completion_id"], where=f"split = '{split}'").num_rows if shards else 0
