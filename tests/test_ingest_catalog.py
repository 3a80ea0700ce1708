"""Shards (atomic, partitioned by seal hour) and the DuckDB catalog, on real files."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest

from samplestore import catalog, shards as writer
from schemas.events import RewardedSample, SamplingParams

DAY1 = 1_767_225_600_000  # 2026-01-01T00:00:00Z, ms
HOUR = 3_600_000


def sample(version, up, down, sealed_at, reward=None, split="train") -> RewardedSample:
    return RewardedSample(
        completion_id=uuid.uuid4(), model_version=version, created_at=sealed_at - 1000, user_hash="a",
        prompt_token_ids=[1, 2], completion_token_ids=[3, 4, 5], behavior_logprobs=[-0.25, -0.5, -1.0],
        sampling=SamplingParams(temperature=0.5), finish_reason="stop",
        reward=(up - down) / (up + down) if reward is None else reward, label=up > down, n_votes=up + down,
        votes_up=up, votes_down=down, event_ids=[str(uuid.uuid4()) for _ in range(up + down)],
        sealed_at=sealed_at, split=split)


def test_partition_layout_and_atomic_write(tmp_path):
    s = sample("0001", 1, 0, DAY1 + 5)
    name = writer.shard_namer(tmp_path)
    p = Path(name(s))
    assert p.parent == tmp_path / "date=2026-01-01" / "hour=00"
    assert p.name.startswith(f"part-{DAY1 + 5:013d}-") and writer.shard_time(p) == DAY1 + 5
    assert name(sample("0002", 1, 0, DAY1 + 9)) == str(p)  # same hour, same shard in one tick
    assert Path(name(sample("0001", 1, 0, DAY1 + 86_400_000 + 5 * HOUR))).parent.parts[-2:] == (
        "date=2026-01-02", "hour=05")
    writer.write_shard([s], p)
    assert sorted(os.listdir(p.parent)) == [p.name]  # no temp file left behind
    assert pq.read_table(p).num_rows == 1
    with pytest.raises(ValueError, match="sealed_at"):
        writer.partition_dir(tmp_path, -1)
    with pytest.raises(ValueError, match="tag"):
        writer.shard_path(tmp_path, DAY1, "a/b")
    with pytest.raises(ValueError, match="samples"):
        writer.write_shard([], p)


def test_catalog_views_and_read_samples(tmp_path, fw_home):
    sd = tmp_path / "samples"
    assert catalog.read_samples(sd) == []  # no shard yet: empty, typed
    assert catalog.query("SELECT * FROM votes_by_split", sd) == []
    a = [sample("0001", 2, 1, DAY1), sample("0001", 0, 1, DAY1 + 10)]
    b = [sample("0002", 3, 0, DAY1 + 20), sample("0002", 1, 1, DAY1 + 30, reward=0.0)]
    e = [sample("0002", 0, 2, DAY1 + 40, split="eval")]
    for group in (a, b, e):
        writer.write_shard(group, writer.shard_namer(sd)(group[0]))
    cat = catalog.refresh_catalog(sd, tmp_path / "cat.duckdb")
    con = duckdb.connect(str(cat), read_only=True)
    con.execute("SET file_search_path = ?", [str(cat.parent)])
    vbv = con.execute("SELECT model_version, samples, votes_up, votes_down, thumbs_up_rate "
                      "FROM votes_by_version").fetchall()
    vbs = con.execute("SELECT model_version, split, samples, votes_up, votes_down FROM votes_by_split").fetchall()
    lb = con.execute("SELECT * FROM label_balance").fetchall()
    sh = con.execute("SELECT samples FROM shards").fetchall()
    con.close()
    assert vbv == [("0001", 2, 2, 2, 0.5), ("0002", 3, 4, 3, 4 / 7)]  # by hand, all splits
    assert vbs == [("0001", "train", 2, 2, 2), ("0002", "eval", 1, 0, 2), ("0002", "train", 2, 4, 1)]
    assert lb == [("0001", "train", False, 1), ("0001", "train", True, 1), ("0002", "eval", False, 1),
                  ("0002", "train", False, 1), ("0002", "train", True, 1)]
    assert sorted(sh) == [(1,), (2,), (2,)]
    got = catalog.read_samples(sd)
    # exact round trip, except reward which the shard stores as float32 (schemas.arrow)
    assert [s.model_dump(exclude={"reward"}) for s in got] == [s.model_dump(exclude={"reward"}) for s in a + b + e]
    assert [s.reward for s in got] == [float(np.float32(s.reward)) for s in a + b + e]
    assert [s.completion_id for s in catalog.read_samples(sd, since_ms=DAY1 + 20)] == [
        b[0].completion_id, b[1].completion_id, e[0].completion_id]


def test_find_shards_lists_only_partitions_from_the_watermark(tmp_path):
    sd = tmp_path / "samples"
    times = [DAY1 + 5, DAY1 + HOUR + 7, DAY1 + 86_400_000 + 3 * HOUR, DAY1 + 86_400_000 + 3 * HOUR + 9]
    paths = [writer.write_shard([sample("v1", 1, 0, t)], writer.shard_path(sd, t)) for t in times]
    assert [s.path for s in catalog.find_shards(sd)] == paths
    assert [s.sealed_ms for s in catalog.find_shards(sd, DAY1 + HOUR + 7)] == times[1:]
    assert [s.sealed_ms for s in catalog.find_shards(sd, DAY1 + HOUR + 8)] == times[2:]
    # an unreadable file in an older partition is never opened: only names are listed
    (sd / "date=2026-01-01" / "hour=00" / f"part-{DAY1 + 6:013d}-x.parquet").write_bytes(b"not parquet")
    new = catalog.find_shards(sd, times[2])
    assert catalog.count_rows(new) == 2 and catalog.read_shards(new, ["completion_id"]).num_rows == 2
    writer.write_shard([sample("v1", 1, 0, times[3] + 1, split="eval")], writer.shard_path(sd, times[3] + 1))
    new = catalog.find_shards(sd, times[2])
    assert catalog.count_rows(new) == 3 and catalog.count_rows(new, "train") == 2 and catalog.count_rows(new, "eval") == 1
    with pytest.raises(ValueError, match="split"):
        catalog.count_rows(new, "test")


def test_data_stats_cli(tmp_path, fw_home):
    sd = fw_home / "data" / "samples"
    group = [sample("0007", 1, 0, DAY1), sample("0007", 1, 2, DAY1)]
    writer.write_shard(group, writer.shard_namer(sd)(group[0]))
    out = subprocess.run([sys.executable, "-m", "flywheel.cli", "data", "stats"], capture_output=True, text=True,
                         env=dict(os.environ, COLUMNS="200"), timeout=60, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    assert "votes_by_version" in out.stdout and "votes_by_split" in out.stdout and "label_balance" in out.stdout
    # 2 up / 4 votes = 0.5; mean reward (1 + (1-2)/3) / 2 = 0.3333 (by hand)
    assert "0007" in out.stdout and "0.5000" in out.stdout and "0.3333" in out.stdout


def test_deadletters_by_reason(tmp_path):
    from schemas.events import DeadLetter

    sd = tmp_path / "samples"
    assert catalog.query("SELECT * FROM deadletters_by_reason", sd) == []
    mk = lambda f, r: DeadLetter(source_topic="flywheel.feedback", key=None, field=f, reason=r, payload="{}", at=10**12)
    writer.write_deadletters([mk("completion_id", "late: x"), mk("completion_id", "late: y")],
                             catalog.deadletters_dir(sd))
    writer.write_deadletters([mk("value", "bad JSON: z")], catalog.deadletters_dir(sd))
    rows = catalog.query("SELECT field, reason, n FROM deadletters_by_reason", sd)
    assert rows == [{"field": "completion_id", "reason": "late", "n": 2}, {"field": "value", "reason": "bad JSON", "n": 1}]
