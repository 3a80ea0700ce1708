"""Sample shards an analyst opens with plain pyarrow/DuckDB (format 3), and the one-time
migration of format-1 shards (JSON strings, integer-ms times, model_version in the path)."""

from __future__ import annotations

import base64
import json
import shutil
import uuid
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from samplestore import catalog, shards as writer
from ingest.migrate import migrate
from schemas.arrow import FORMAT_VERSION
from schemas.events import ExpertRoutes, RewardedSample, SamplingParams

T0 = 1_767_225_600_000 + 7 * 3_600_000 + 123  # 2026-01-01T07:00:00.123Z


def make(n: int, version: str = "v000003", split: str = "train", t: int = T0, seed: int = 0) -> list[RewardedSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        P, C = 3 + i, 2 + i
        routes = rng.integers(0, 300 if i == 1 else 8, (P + C - 1, 3, 2))  # row 1 needs uint16
        out.append(RewardedSample(
            completion_id=uuid.uuid4(), model_version=version, created_at=t - 60_000 - i, user_hash=f"u{i}",
            prompt_token_ids=list(range(P)), completion_token_ids=list(range(C)),
            behavior_logprobs=[-0.5] * C, sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=i),
            expert_routes=None if i == 2 else ExpertRoutes.from_array(routes), finish_reason="length",
            reward=1.0, label=True, n_votes=1, votes_up=1, votes_down=0, event_ids=[str(uuid.uuid4())],
            sealed_at=t + i, split=split))
    return out


def test_one_file_read_alone_with_pyarrow_has_every_field(tmp_path):
    samples = make(3, split="eval")
    p = writer.write_shard(samples, writer.shard_path(tmp_path, samples[0].sealed_at))
    t = pq.read_table(p)  # the file alone: no directory names, no Flywheel decoder
    assert t.schema.metadata[b"flywheel.samples.format"] == str(FORMAT_VERSION).encode()
    assert t.schema.field("created_at").type == pa.timestamp("ms", tz="UTC")
    assert t.schema.field("sealed_at").type == pa.timestamp("ms", tz="UTC")
    assert t.schema.field("expert_routes").type == pa.binary()
    assert pa.types.is_struct(t.schema.field("sampling").type)
    rows = t.to_pylist()
    for s, r in zip(samples, rows):
        assert r["model_version"] == "v000003" and r["split"] == "eval"
        assert int(r["sealed_at"].timestamp() * 1000) == s.sealed_at
        assert r["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_tokens": 128,
                                 "seed": s.sampling.seed, "logprobs_kind": "raw"}
        if s.expert_routes is None:
            assert r["expert_routes"] is None and r["expert_routes_shape"] is None and r["expert_routes_codec"] is None
        else:  # format 3: the zstd frame as served (D65)
            assert r["expert_routes_codec"] == "zstd"
            raw = zstandard.ZstdDecompressor().decompress(r["expert_routes"])
            arr = np.frombuffer(raw, r["expert_routes_dtype"]).reshape(r["expert_routes_shape"])
            assert np.array_equal(arr, s.expert_routes.to_array()) and arr.dtype == s.expert_routes.to_array().dtype
    assert rows[1]["expert_routes_dtype"] == "uint16" and rows[0]["expert_routes_dtype"] == "uint8"
    # plain DuckDB on the same file: timestamps, struct fields, blob length
    con = duckdb.connect()
    got = con.execute("SELECT epoch_ms(sealed_at), sampling.top_k, octet_length(expert_routes), split "
                      "FROM read_parquet(?) ORDER BY sealed_at", [str(p)]).fetchall()
    assert got[0] == (T0, 20, len(base64.b64decode(samples[0].expert_routes.data)), "eval")


def write_v1(samples_dir: Path, samples: list[RewardedSample], version: str, day: str) -> Path:
    """A format-1 shard, written here from the format-1 definition (not Flywheel's code)."""
    schema = pa.schema([("completion_id", pa.string()), ("created_at", pa.int64()), ("user_hash", pa.string()),
                        ("prompt_token_ids", pa.list_(pa.int32())), ("completion_token_ids", pa.list_(pa.int32())),
                        ("behavior_logprobs", pa.list_(pa.float32())), ("sampling", pa.string()),
                        ("expert_routes", pa.string()), ("finish_reason", pa.string()), ("reward", pa.float32()),
                        ("label", pa.bool_()), ("n_votes", pa.int32()), ("votes_up", pa.int32()),
                        ("votes_down", pa.int32()), ("event_ids", pa.list_(pa.string())), ("sealed_at", pa.int64())])
    rows = [{**s.model_dump(mode="json", exclude={"model_version", "split", "sampling", "expert_routes"}),
             "sampling": s.sampling.model_dump_json(),
             "expert_routes": s.expert_routes.model_dump_json() if s.expert_routes else None} for s in samples]
    d = samples_dir / f"model_version={version}" / f"date={day}"
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"part-{uuid.uuid4().hex}.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema), p)
    return p


def test_migrate_format1_shards_once_crash_safe(tmp_path):
    sd = tmp_path / "samples"
    a, b = make(3, "v000001", seed=1), make(2, "v000002", t=T0 + 86_400_000, seed=2)
    pa_ = write_v1(sd, a, "v000001", "2026-01-01")
    write_v1(sd, b, "v000002", "2026-01-02")
    with pytest.raises(catalog.OldShardsError, match="flywheel data migrate"):
        catalog.find_shards(sd)
    with pytest.raises(catalog.OldShardsError, match="flywheel data migrate"):
        catalog.refresh_catalog(sd, tmp_path / "cat.duckdb")
    assert migrate(sd, dry_run=True) == {"shards": 2, "samples": 5, "already": 0}
    # a crash after the new copy of the first shard was written, before the old one was removed
    keep = tmp_path / "keep.parquet"
    shutil.copy(pa_, keep)
    assert migrate(sd) == {"shards": 2, "samples": 5, "already": 0}
    pa_.parent.mkdir(parents=True)
    shutil.copy(keep, pa_)
    assert migrate(sd) == {"shards": 1, "samples": 3, "already": 1}  # found its copy: no duplicate
    assert not any(p.name.startswith("model_version=") for p in sd.iterdir())
    assert migrate(sd) == {"shards": 0, "samples": 0, "already": 0}
    got = catalog.read_samples(sd)
    want = a + b
    assert [s.model_dump(exclude={"reward", "behavior_logprobs"}) for s in got] == [
        s.model_dump(exclude={"reward", "behavior_logprobs"}) for s in want]
    assert [s.split for s in got] == ["train"] * 5 and [s.model_version for s in got] == ["v000001"] * 3 + ["v000002"] * 2
    assert [s.sealed_ms for s in catalog.find_shards(sd)] == [a[0].sealed_at, b[0].sealed_at]


def test_catalog_views_hold_paths_relative_to_the_catalog(tmp_path):
    home = tmp_path / "h"
    sd = home / "data" / "samples"
    writer.write_shard(make(2), writer.shard_path(sd, T0))
    cat = catalog.refresh_catalog(sd, home / "catalog.duckdb")
    con = duckdb.connect(str(cat), read_only=True)
    sql = con.execute("SELECT sql FROM duckdb_views() WHERE view_name = 'samples'").fetchone()[0]
    con.close()
    assert "'data/samples/**/*.parquet'" in sql and str(tmp_path) not in sql
    moved = tmp_path / "elsewhere"
    shutil.move(home, moved)
    con = duckdb.connect(str(moved / "catalog.duckdb"), read_only=True)
    con.execute("SET file_search_path = ?", [str(moved)])
    assert con.execute("SELECT count(*), min(date)::VARCHAR, min(hour) FROM samples").fetchone() == (2, "2026-01-01", 7)
    assert json.loads(json.dumps(con.execute("SELECT * FROM votes_by_split").fetchall())) == [
        ["v000003", "train", 2, 2, 0, 1.0, 1.0]]


def test_migrate_cli_then_learner_finds_the_shards(tmp_path):
    import os
    import subprocess
    import sys

    from learner.cycle import count_new, new_state, save_state

    home = tmp_path / "home"
    sd = home / "data" / "samples"
    write_v1(sd, make(3, "v000001", seed=5), "v000001", "2026-01-01")
    env = {**os.environ, "FLYWHEEL_HOME": str(home), "COLUMNS": "200"}
    env.pop("FLYWHEEL_SAMPLES", None)
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "flywheel.cli", "data", "migrate"], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "converted 1 shards (3 samples)" in r.stdout
    con = duckdb.connect(str(home / "catalog.duckdb"), read_only=True)
    con.execute("SET file_search_path = ?", [str(home)])
    assert con.execute("SELECT model_version, split, samples FROM votes_by_split").fetchall() == [("v000001", "train", 3)]
    con.close()
    save_state(tmp_path / "state", new_state())
    assert count_new(sd, tmp_path / "state", 600_000) == 3
