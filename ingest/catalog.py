"""DuckDB catalog over the sample shards, and a reader for the learner.

The catalog file (``schemas.settings.catalog_path()``) holds only views over the Parquet
glob; it is opened briefly and closed, because other processes (learner, ``flywheel data
stats``) open it too and DuckDB allows one writer at a time.

Views:
    samples: every shard row plus the hive partition columns ``model_version``, ``date``
        (both VARCHAR).
    votes_by_version: per model_version: samples, votes_up, votes_down, thumbs_up_rate
        (= votes_up / (votes_up + votes_down)), mean_reward.
    label_balance: per model_version and label: samples.
    deadletters_by_reason: per source_topic, field and reason kind (the reason up to its
        first ``:``): count (from ``<samples_dir>/../deadletters/*.parquet``).
"""

from __future__ import annotations

import time
from pathlib import Path

import duckdb

from schemas import settings
from schemas.arrow import SAMPLE_SCHEMA, row_to_sample
from schemas.events import RewardedSample

_TYPES = {"string": "VARCHAR", "int64": "BIGINT", "int32": "INTEGER", "float": "FLOAT", "bool": "BOOLEAN",
          "list<item: int32>": "INTEGER[]", "list<item: float>": "FLOAT[]", "list<item: string>": "VARCHAR[]"}


def _glob(samples_dir: Path) -> str:
    return str(Path(samples_dir) / "**" / "*.parquet")


def _has_shards(samples_dir: Path) -> bool:
    return any(Path(samples_dir).glob("**/*.parquet"))


def samples_sql(samples_dir: Path) -> str:
    """A SELECT over every shard (hive columns as VARCHAR); an empty typed SELECT when none."""
    if _has_shards(samples_dir):
        g = _glob(samples_dir).replace("'", "''")
        return (f"SELECT * FROM read_parquet('{g}', hive_partitioning=true, "
                f"hive_types={{'model_version': VARCHAR, 'date': VARCHAR}})")
    cols = ", ".join(f"CAST(NULL AS {_TYPES[str(f.type)]}) AS {f.name}" for f in SAMPLE_SCHEMA)
    return f"SELECT {cols}, CAST(NULL AS VARCHAR) AS model_version, CAST(NULL AS VARCHAR) AS date LIMIT 0"


def deadletters_dir(samples_dir: Path) -> Path:
    """Where the worker keeps its dead-letter files: next to the samples root."""
    return Path(samples_dir).parent / "deadletters"


def _deadletters_sql(samples_dir: Path) -> str:
    d = deadletters_dir(samples_dir)
    if any(d.glob("*.parquet")):
        g = str(d / "*.parquet").replace("'", "''")
        return f"SELECT * FROM read_parquet('{g}')"
    return ("SELECT CAST(NULL AS VARCHAR) AS source_topic, CAST(NULL AS VARCHAR) AS key, CAST(NULL AS VARCHAR) "
            "AS field, CAST(NULL AS VARCHAR) AS reason, CAST(NULL AS VARCHAR) AS payload, CAST(NULL AS BIGINT) "
            "AS at LIMIT 0")


def _views(samples_dir: Path) -> list[str]:
    return [
        f"CREATE OR REPLACE VIEW samples AS {samples_sql(samples_dir)}",
        "CREATE OR REPLACE VIEW votes_by_version AS SELECT model_version, count(*) AS samples, "
        "sum(votes_up)::BIGINT AS votes_up, sum(votes_down)::BIGINT AS votes_down, "
        "sum(votes_up) / nullif(sum(votes_up) + sum(votes_down), 0) AS thumbs_up_rate, "
        "avg(reward) AS mean_reward FROM samples GROUP BY model_version ORDER BY model_version",
        "CREATE OR REPLACE VIEW label_balance AS SELECT model_version, label, count(*) AS samples "
        "FROM samples GROUP BY model_version, label ORDER BY model_version, label",
        f"CREATE OR REPLACE VIEW deadletters AS {_deadletters_sql(samples_dir)}",
        "CREATE OR REPLACE VIEW deadletters_by_reason AS SELECT source_topic, field, "
        "split_part(reason, ':', 1) AS reason, count(*) AS n FROM deadletters "
        "GROUP BY ALL ORDER BY n DESC, source_topic, field, reason",
    ]


def refresh_catalog(samples_dir: Path | None = None, catalog: Path | None = None,
                    timeout_s: float = 10.0) -> Path:
    """(Re)create the catalog views; opens the DuckDB file briefly and closes it.

    Retries while another process holds the file's lock. Raises ``duckdb.IOException``
    after ``timeout_s`` seconds.
    """
    samples_dir = Path(samples_dir or settings.samples_dir())
    catalog = Path(catalog or settings.catalog_path())
    catalog.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            con = duckdb.connect(str(catalog))
            break
        except duckdb.IOException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    try:
        for q in _views(samples_dir):
            con.execute(q)
    finally:
        con.close()
    return catalog


def query(sql: str, samples_dir: Path | None = None) -> list[dict]:
    """Run ``sql`` against the catalog views, in an in-memory DuckDB (no file lock)."""
    samples_dir = Path(samples_dir or settings.samples_dir())
    con = duckdb.connect()
    try:
        for q in _views(samples_dir):
            con.execute(q.replace("CREATE OR REPLACE VIEW", "CREATE OR REPLACE TEMP VIEW"))
        cur = con.execute(sql)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]
    finally:
        con.close()


def read_samples(samples_dir: Path | str | None = None, since_ms: int | None = None) -> list[RewardedSample]:
    """Every RewardedSample in the shards, with ``sealed_at >= since_ms`` if given, ordered
    by ``sealed_at`` then ``completion_id``."""
    where = f" WHERE sealed_at >= {int(since_ms)}" if since_ms is not None else ""
    rows = query(f"SELECT * FROM samples{where} ORDER BY sealed_at, completion_id",
                 Path(samples_dir) if samples_dir else None)
    return [row_to_sample(r) for r in rows]
