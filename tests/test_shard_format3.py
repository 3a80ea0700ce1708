"""Shard format 3 (D65): the routes column holds the zstd frame serving wrote, byte for byte,
and every reader of shards (plain pyarrow, the catalog's DuckDB views, ``samplestore.catalog.
read_shards``, the learner's ``SpilledSamples``) hands it back bit-exact; format-2 shards (raw
routes, no ``expert_routes_codec`` column) still read, alone and next to format-3 shards."""

from __future__ import annotations

import base64
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from samplestore import catalog, shards as writer
from learner.data import SpilledSamples
from schemas.arrow import FORMAT_VERSION, table_to_samples
from schemas.events import ExpertRoutes, RewardedSample, SamplingParams

T0 = 1_767_225_600_000 + 7 * 3_600_000 + 123  # 2026-01-01T07:00:00.123Z


def routes_of(rng, P: int, C: int, experts: int) -> np.ndarray:
    return rng.integers(0, experts, (P + C - 1, 3, 2)).astype("uint8" if experts <= 256 else "uint16")


def served(arr: np.ndarray, level: int, checksum: bool = False) -> ExpertRoutes:
    """Routes as a serving pod may log them: any zstd level, with or without a checksum (the
    frame is kept as written, so a re-encoding would show)."""
    frame = zstandard.ZstdCompressor(level=level, write_checksum=checksum).compress(arr.tobytes())
    return ExpertRoutes(shape=arr.shape, dtype=str(arr.dtype), data=base64.b64encode(frame).decode())


def make(n: int, t: int, seed: int) -> tuple[list[RewardedSample], dict[str, np.ndarray | None]]:
    rng = np.random.default_rng(seed)
    out, arrays = [], {}
    for i in range(n):
        P, C = 3 + i, 2 + i
        arr = None if i == 2 else routes_of(rng, P, C, 300 if i == 1 else 8)
        s = RewardedSample(
            completion_id=uuid.uuid4(), model_version="v000007", created_at=t - 60_000 - i, user_hash=f"u{i}",
            prompt_token_ids=list(range(P)), completion_token_ids=list(range(C)), behavior_logprobs=[-0.5] * C,
            sampling=SamplingParams(seed=i), expert_routes=None if arr is None else served(arr, 1 + 6 * i, i % 2 == 1),
            finish_reason="length", reward=1.0, label=True, n_votes=1, votes_up=1, votes_down=0,
            event_ids=[str(uuid.uuid4())], sealed_at=t + i)
        out.append(s)
        arrays[str(s.completion_id)] = arr
    return out, arrays


FORMAT2 = pa.schema([  # format 2 as it was written (D59's shards), defined here, not from Flywheel's code
    ("completion_id", pa.string()), ("model_version", pa.string()), ("split", pa.string()),
    ("created_at", pa.timestamp("ms", tz="UTC")), ("sealed_at", pa.timestamp("ms", tz="UTC")),
    ("user_hash", pa.string()), ("prompt_token_ids", pa.list_(pa.int32())),
    ("completion_token_ids", pa.list_(pa.int32())), ("behavior_logprobs", pa.list_(pa.float32())),
    ("sampling", pa.struct([("temperature", pa.float64()), ("top_p", pa.float64()), ("top_k", pa.int32()),
                            ("max_tokens", pa.int32()), ("seed", pa.int64()), ("logprobs_kind", pa.string())])),
    ("expert_routes", pa.binary()), ("expert_routes_shape", pa.list_(pa.int32())),
    ("expert_routes_dtype", pa.string()), ("finish_reason", pa.string()), ("reward", pa.float32()),
    ("label", pa.bool_()), ("n_votes", pa.int32()), ("votes_up", pa.int32()), ("votes_down", pa.int32()),
    ("event_ids", pa.list_(pa.string())),
], metadata={b"flywheel.samples.format": b"2"})


def write_format2(samples_dir, samples: list[RewardedSample], arrays) -> None:
    rows = []
    for s in samples:
        arr = arrays[str(s.completion_id)]
        rows.append({**s.model_dump(exclude={"expert_routes", "sampling"}), "completion_id": str(s.completion_id),
                     "sampling": s.sampling.model_dump(),
                     "expert_routes": None if arr is None else arr.astype(arr.dtype.newbyteorder("<")).tobytes(),
                     "expert_routes_shape": None if arr is None else list(arr.shape),
                     "expert_routes_dtype": None if arr is None else str(arr.dtype)})
    p = writer.shard_path(samples_dir, samples[0].sealed_at)
    p.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, FORMAT2), p)


def check(got: list[RewardedSample], want: list[RewardedSample], arrays) -> None:
    by_id = {str(s.completion_id): s for s in want}
    assert sorted(str(s.completion_id) for s in got) == sorted(by_id)
    for s in got:
        ref, arr = by_id[str(s.completion_id)], arrays[str(s.completion_id)]
        if arr is None:
            assert s.expert_routes is None
            continue
        assert np.array_equal(s.expert_routes.to_array(), arr) and s.expert_routes.to_array().dtype == arr.dtype
        assert s.prompt_token_ids == ref.prompt_token_ids and s.sealed_at == ref.sealed_at


def test_format3_keeps_the_served_frame_and_every_reader_gets_it_back_bit_exact(tmp_path):
    samples, arrays = make(4, T0, seed=1)
    p = writer.write_shard(samples, writer.shard_path(tmp_path, samples[0].sealed_at))
    f = pq.ParquetFile(p)
    assert f.schema_arrow.metadata[b"flywheel.samples.format"] == str(FORMAT_VERSION).encode()
    rg = f.metadata.row_group(0)
    # the frame is not packed twice; every other column (nested leaves included) is zstd
    assert {rg.column(c).path_in_schema for c in range(rg.num_columns)
            if rg.column(c).compression != "ZSTD"} == {"expert_routes"}
    frames = {str(s.completion_id): base64.b64decode(s.expert_routes.data) if s.expert_routes else None
              for s in samples}
    for r in pq.read_table(p).to_pylist():  # the file alone, plain pyarrow
        assert r["expert_routes"] == frames[r["completion_id"]]
        assert r["expert_routes_codec"] == (None if frames[r["completion_id"]] is None else "zstd")
        if r["expert_routes"] is not None:
            arr = np.frombuffer(zstandard.ZstdDecompressor().decompress(r["expert_routes"]),
                                r["expert_routes_dtype"]).reshape(r["expert_routes_shape"])
            assert np.array_equal(arr, arrays[r["completion_id"]])
    readers = {
        "catalog.read_samples": catalog.read_samples(tmp_path),
        "read_shards": table_to_samples(catalog.read_shards(catalog.find_shards(tmp_path, 0))),
    }
    spilled = SpilledSamples.from_shards([p], tmp_path / "spill" / "samples.arrow")
    readers["SpilledSamples"] = spilled.take(list(range(len(spilled))))
    for name, got in readers.items():
        check(got, samples, arrays)
        for s in got:  # the served frame, bit-exact, not re-encoded
            want = frames[str(s.completion_id)]
            assert (base64.b64decode(s.expert_routes.data) if s.expert_routes else None) == want, name


def test_a_format2_shard_still_reads_alone_and_next_to_format3(tmp_path):
    old, old_arrays = make(3, T0, seed=2)
    write_format2(tmp_path, old, old_arrays)
    assert catalog.format_version(pq.read_schema(next(tmp_path.glob("**/*.parquet")))) == 2
    check(catalog.read_samples(tmp_path), old, old_arrays)  # only format 2: no codec column anywhere
    check(table_to_samples(catalog.read_shards(catalog.find_shards(tmp_path, 0))), old, old_arrays)
    new, new_arrays = make(3, T0 + 3_600_000, seed=3)
    writer.write_shard(new, writer.shard_path(tmp_path, new[0].sealed_at))
    arrays = old_arrays | new_arrays
    check(catalog.read_samples(tmp_path), old + new, arrays)
    shards = catalog.find_shards(tmp_path, 0)
    assert len(shards) == 2
    check(table_to_samples(catalog.read_shards(shards)), old + new, arrays)
    assert catalog.read_shards(shards, ["completion_id"]).num_rows == 6
    spilled = SpilledSamples.from_shards([s.path for s in shards], tmp_path / "spill" / "s.arrow")
    check(spilled.take(list(range(len(spilled)))), old + new, arrays)
    # the catalog's views over both formats
    catalog.refresh_catalog(tmp_path, tmp_path / "catalog.duckdb")
    got = catalog.query("SELECT expert_routes_codec AS c, count(*) AS n FROM samples "
                        "WHERE expert_routes IS NOT NULL GROUP BY ALL ORDER BY c NULLS FIRST", tmp_path)
    assert got == [{"c": None, "n": 2}, {"c": "zstd", "n": 2}]
