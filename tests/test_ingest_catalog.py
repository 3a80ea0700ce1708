"""Shards (atomic, partitioned) and the DuckDB catalog, on real files."""

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

from ingest import catalog, writer
from schemas.events import RewardedSample, SamplingParams

DAY1 = 1_767_225_600_000  # 2026-01-01T00:00:00Z, ms


def sample(version, up, down, sealed_at, reward=None) -> RewardedSample:
    return RewardedSample(
        completion_id=uuid.uuid4(), model_version=version, created_at=sealed_at - 1000, user_hash="a",
        prompt_token_ids=[1, 2], completion_token_ids=[3, 4, 5], behavior_logprobs=[-0.25, -0.5, -1.0],
        sampling=SamplingParams(temperature=0.5), finish_reason="stop",
        reward=(up - down) / (up + down) if reward is None else reward, label=up > down, n_votes=up + down,
        votes_up=up, votes_down=down, event_ids=[str(uuid.uuid4()) for _ in range(up + down)],
        sealed_at=sealed_at)


def test_partition_layout_and_atomic_write(tmp_path):
    s = sample("0001", 1, 0, DAY1 + 5)
    name = writer.shard_namer(tmp_path)
    p = Path(name(s))
    assert p.parent == tmp_path / "model_version=0001" / "date=2026-01-01"
    assert name(sample("0001", 1, 0, DAY1 + 9)) == str(p)  # same partition, same shard in one tick
    assert Path(name(sample("0001", 1, 0, DAY1 + 86_400_000))).parent.name == "date=2026-01-02"
    writer.write_shard([s], p)
    assert sorted(os.listdir(p.parent)) == [p.name]  # no temp file left behind
    assert pq.read_table(p).num_rows == 1
    with pytest.raises(ValueError, match="model_version"):
        writer.partition_dir(tmp_path, "a/b", DAY1)
    with pytest.raises(ValueError, match="samples"):
        writer.write_shard([], p)


def test_catalog_views_and_read_samples(tmp_path, fw_home):
    sd = tmp_path / "samples"
    assert catalog.read_samples(sd) == []  # no shard yet: empty, typed
    a = [sample("0001", 2, 1, DAY1), sample("0001", 0, 1, DAY1 + 10)]
    b = [sample("0002", 3, 0, DAY1 + 20), sample("0002", 1, 1, DAY1 + 30, reward=0.0)]
    for group in (a, b):
        writer.write_shard(group, writer.shard_namer(sd)(group[0]))
    cat = catalog.refresh_catalog(sd, tmp_path / "cat.duckdb")
    con = duckdb.connect(str(cat), read_only=True)
    vbv = con.execute("SELECT model_version, samples, votes_up, votes_down, thumbs_up_rate "
                      "FROM votes_by_version").fetchall()
    lb = con.execute("SELECT * FROM label_balance").fetchall()
    con.close()
    assert vbv == [("0001", 2, 2, 2, 0.5), ("0002", 2, 4, 1, 0.8)]  # by hand
    assert lb == [("0001", False, 1), ("0001", True, 1), ("0002", False, 1), ("0002", True, 1)]
    got = catalog.read_samples(sd)
    # exact round trip, except reward which the shard stores as float32 (schemas.arrow)
    assert [s.model_dump(exclude={"reward"}) for s in got] == [s.model_dump(exclude={"reward"}) for s in a + b]
    assert [s.reward for s in got] == [float(np.float32(s.reward)) for s in a + b]
    assert [s.completion_id for s in catalog.read_samples(sd, since_ms=DAY1 + 20)] == [b[0].completion_id,
                                                                                   b[1].completion_id]


def test_data_stats_cli(tmp_path, fw_home):
    sd = fw_home / "data" / "samples"
    group = [sample("0007", 1, 0, DAY1), sample("0007", 1, 2, DAY1)]
    writer.write_shard(group, writer.shard_namer(sd)(group[0]))
    out = subprocess.run([sys.executable, "-m", "flywheel.cli", "data", "stats"], capture_output=True, text=True,
                         env=dict(os.environ, COLUMNS="200"), timeout=60, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    assert "votes_by_version" in out.stdout and "label_balance" in out.stdout
    # 2 up / 4 votes = 0.5; mean reward (1 + (1-2)/3) / 2 = 0.3333 (by hand)
    assert "0007" in out.stdout and "0.5000" in out.stdout and "0.3333" in out.stdout


def test_deadletters_by_reason(tmp_path):
    from schemas.events import DeadLetter

    sd = tmp_path / "samples"
    assert catalog.query("SELECT * FROM deadletters_by_reason", sd) == []
    mk = lambda f, r: DeadLetter(source_topic="flywheel.feedback", key=None, field=f, reason=r, payload="{}", at=1)
    writer.write_deadletters([mk("completion_id", "late: x"), mk("completion_id", "late: y")],
                             catalog.deadletters_dir(sd))
    writer.write_deadletters([mk("value", "bad JSON: z")], catalog.deadletters_dir(sd))
    rows = catalog.query("SELECT field, reason, n FROM deadletters_by_reason", sd)
    assert rows == [{"field": "completion_id", "reason": "late", "n": 2}, {"field": "value", "reason": "bad JSON", "n": 1}]
