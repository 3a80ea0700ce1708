"""``flywheel data migrate``: rewrite format-1 shards into the format-2 layout, once.

Format 1: ``<samples_dir>/model_version=<v>/date=<d>/part-<uuid>.parquet`` with JSON strings
for ``sampling`` and ``expert_routes``, integer-ms times and ``model_version`` only in the
directory name. Format 2: ``schemas.arrow`` (columns) and ``samplestore.shards`` (layout).

Crash-safe and idempotent: each old shard is written to its new path (atomic rename; the
name is derived from the old path, so a rerun finds it) before the old file is removed; a
rerun after a crash finishes the rest and never duplicates a row.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from samplestore.catalog import OLD_LAYOUT_PREFIX
from samplestore.shards import shard_path, write_table
from schemas.arrow import SAMPLE_SCHEMA, conform, format_version, upgrade_v1_table


def _version_of(path: Path, root: Path) -> str:
    for part in path.relative_to(root).parts:
        if part.startswith(OLD_LAYOUT_PREFIX):
            return part[len(OLD_LAYOUT_PREFIX):]
    raise ValueError(f"{path}: no model_version=<v> directory above it")


def migrate(samples_dir: str | Path, dry_run: bool = False) -> dict[str, int]:
    """Convert every shard under ``samples_dir/model_version=*/`` to the current format in the
    new layout (routes stay raw bytes, ``expert_routes_codec`` null) and remove the old files and empty directories.

    Returns ``{"shards": files converted, "samples": rows, "already": files whose new copy
    existed (a rerun after a crash)}``. ``dry_run`` counts without writing.

    Raises:
        ValueError: a row does not decode (names the column and the completion id).
    """
    root = Path(samples_dir)
    out = {"shards": 0, "samples": 0, "already": 0}
    if not root.is_dir():
        return out
    old = sorted(p for d in root.iterdir() if d.is_dir() and d.name.startswith(OLD_LAYOUT_PREFIX)
                 for p in d.rglob("*.parquet") if not p.name.startswith("."))
    for p in old:
        table = pq.read_table(p, partitioning=None)
        version = _version_of(p, root)
        if format_version(table.schema) < 2:
            table = upgrade_v1_table(table, version)
        else:
            table = conform(table.select([f.name for f in SAMPLE_SCHEMA if f.name in table.column_names]))
            table = table.select([f.name for f in SAMPLE_SCHEMA]).cast(SAMPLE_SCHEMA)
        out["samples"] += table.num_rows
        out["shards"] += 1
        if dry_run or table.num_rows == 0:
            continue
        table = table.sort_by([("sealed_at", "ascending"), ("completion_id", "ascending")])
        first = int(pc.cast(table.column("sealed_at"), "int64")[0].as_py())
        tag = "m" + hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest()[:31]
        new = shard_path(root, first, tag)
        if new.exists():
            out["already"] += 1
        else:
            write_table(table, new)
        os.remove(p)
    if not dry_run:
        for d in sorted((d for d in root.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
            if any(part.startswith(OLD_LAYOUT_PREFIX) for part in d.relative_to(root).parts) and not any(d.iterdir()):
                d.rmdir()
    return out
