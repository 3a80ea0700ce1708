"""The one reader of ingest's sample shards that the rollout's queries select from.

:func:`samples_source` gives the DuckDB ``FROM`` clause over every shard under a samples
directory and the expression of ``created_at`` in ms; the controller's vote and reward counts
(:mod:`deploy.controller`) and the CUPED covariate (:mod:`deploy.history`) both query through
it, so both read the same rows the same way.
"""

from __future__ import annotations

from pathlib import Path


def samples_source(con, samples_dir: Path) -> tuple[str, str, set[str]]:
    """``(FROM clause, created_at in ms expression, the shards' column names)`` over the
    sample shards, read with ``union_by_name`` so that shards written before a column existed
    (``split``, the reward policy's ``reward_policy``, ``regenerated``, ``followup``,
    ``copied``) read as null in it: ``created_at`` is a UTC timestamp in current shards and
    integer ms in older ones.

    Args:
        con: an open DuckDB connection (the query runs on it).
        samples_dir: the root of the hive-partitioned Parquet shards.

    Raises:
        duckdb.Error: what DuckDB raises when no shard matches or a shard is unreadable.
    """
    glob = str(Path(samples_dir) / "**" / "*.parquet").replace("'", "''")
    src = f"read_parquet('{glob}', hive_partitioning=true, hive_types_autocast=false, union_by_name=true)"
    cols = {c[0]: str(c[1]) for c in con.execute(f"DESCRIBE SELECT * FROM {src}").fetchall()}
    t = cols.get("created_at", "BIGINT").upper()
    created = "epoch_ms(created_at)" if t.startswith("TIMESTAMP") else "created_at"
    return src, created, set(cols)
