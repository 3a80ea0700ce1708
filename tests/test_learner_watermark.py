"""The learner finds new shards by a watermark (no scan of history) and keeps bounded state."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pyarrow.parquet as pq

from samplestore import catalog, shards as writer
from learner.cycle import consume, count_new, new_shards, new_state, save_state, upgrade_state
from schemas.events import RewardedSample, SamplingParams

T0 = 1_767_225_600_000  # 2026-01-01T00:00Z
MIN = 60_000
HOUR = 3_600_000


def shard(sd, t: int, n: int = 2, split: str = "train"):
    rows = [RewardedSample(completion_id=uuid.uuid4(), model_version="v000000", created_at=t - MIN, user_hash="u",
                           prompt_token_ids=[1], completion_token_ids=[2], behavior_logprobs=[-1.0],
                           sampling=SamplingParams(), finish_reason="stop", reward=1.0, label=True, n_votes=1,
                           votes_up=1, votes_down=0, event_ids=[str(uuid.uuid4())], sealed_at=t + i, split=split)
            for i in range(n)]
    return writer.write_shard(rows, writer.shard_path(sd, t)), rows


def test_watermark_finds_new_and_late_shards_and_forgets_old_names(tmp_path):
    sd, L = tmp_path / "s", 10 * MIN
    st = new_state()
    shard(sd, T0)
    shard(sd, T0 + 5 * MIN)
    got = new_shards(sd, st, L)
    assert [s.sealed_ms for s in got] == [T0, T0 + 5 * MIN]
    st = consume(st, got, L)
    assert st["watermark_ms"] == T0 + 5 * MIN and len(st["consumed"]) == 2
    assert new_shards(sd, st, L) == []
    # a shard sealed before the watermark but within the lateness appears late: found once
    shard(sd, T0 + 2 * MIN)
    late = new_shards(sd, st, L)
    assert [s.sealed_ms for s in late] == [T0 + 2 * MIN]
    st = consume(st, late, L)
    assert st["watermark_ms"] == T0 + 5 * MIN
    # two hours on: every name older than watermark - lateness is forgotten (bounded state),
    # and those partitions are not listed any more (an unreadable file there is never opened)
    for h in range(1, 25):
        shard(sd, T0 + h * 5 * MIN + HOUR)
        st = consume(st, new_shards(sd, st, L), L)
    assert st["watermark_ms"] == T0 + 24 * 5 * MIN + HOUR
    assert all(t >= st["watermark_ms"] - L for t in st["consumed"].values()) and len(st["consumed"]) <= 3
    (sd / "date=2026-01-01" / "hour=00" / "part-x.parquet").write_bytes(b"junk")  # old partition
    assert new_shards(sd, st, L) == []
    shard(sd, st["watermark_ms"] + 1, n=3)
    shard(sd, st["watermark_ms"] + 2, n=2, split="eval")
    save_state(tmp_path / "state", st)
    assert count_new(sd, tmp_path / "state", L) == 3  # train split only, from new shards only


def test_format1_state_is_upgraded_by_one_scan(tmp_path):
    sd, L = tmp_path / "s", 10 * MIN
    _, a = shard(sd, T0)
    _, b = shard(sd, T0 + HOUR)
    _, c = shard(sd, T0 + 2 * HOUR)
    old = {"trained": [str(s.completion_id) for s in a + b], "cycles": [{"version": "v000001"}] * 150}
    st = upgrade_state(old, sd, L)
    assert st["format"] == 2 and "trained" not in st and len(st["cycles"]) == 100
    assert st["watermark_ms"] == T0 + 2 * HOUR  # the oldest untrained shard: nothing falls behind
    assert [s.sealed_ms for s in new_shards(sd, st, L)] == [T0 + 2 * HOUR]
    st = upgrade_state({"trained": [str(s.completion_id) for s in a + b + c], "cycles": []}, sd, L)
    assert st["watermark_ms"] == T0 + 2 * HOUR and new_shards(sd, st, L) == []
    # the daemon's poll upgrades a stored format-1 state once and saves it
    import json

    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "learner_state.json").write_text(json.dumps(old))
    assert count_new(sd, tmp_path / "state", L) == 2
    assert json.loads((tmp_path / "state" / "learner_state.json").read_text())["format"] == 2


def test_find_shards_with_foreign_file_names_uses_the_partition_hour(tmp_path):
    sd = tmp_path / "s"
    p, _ = shard(sd, T0 + 3 * HOUR + 5)
    foreign = p.parent / "part-experiment-1.parquet"
    pq.write_table(pa.table({"x": [1]}), foreign)
    got = catalog.find_shards(sd, T0 + 3 * HOUR)
    assert {(s.path.name, s.sealed_ms) for s in got} == {(p.name, T0 + 3 * HOUR + 5),
                                                         ("part-experiment-1.parquet", T0 + 3 * HOUR)}
