"""The demo report's statistics and per-version counts."""

import pytest

from flywheel.report import samples_by_version, wilson_interval
from ingest.writer import write_shard
from schemas.events import RewardedSample, SamplingParams


def test_wilson_interval_matches_hand_values():
    # 1 up of 10: the textbook Wilson 95 % interval is [0.0179, 0.4042]
    lo, hi = wilson_interval(1, 10)
    assert lo == pytest.approx(0.0179, abs=1e-4) and hi == pytest.approx(0.4042, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_samples_by_version_counts_each_versions_votes(tmp_path):
    import uuid

    def sample(v, up, down):
        return RewardedSample(completion_id=uuid.uuid4(), model_version=v, created_at=0, user_hash="u",
                              prompt_token_ids=[1], completion_token_ids=[2], behavior_logprobs=[-0.5],
                              sampling=SamplingParams(), finish_reason="stop", reward=1.0, label=up > down,
                              n_votes=up + down, votes_up=up, votes_down=down,
                              event_ids=[str(uuid.uuid4()) for _ in range(up + down)], sealed_at=0)
    for v, votes in {"v000000": [(1, 0), (0, 2)], "v000001": [(3, 1)]}.items():
        d = tmp_path / f"model_version={v}" / "date=2026-11-30"
        d.mkdir(parents=True)
        write_shard([sample(v, u, dn) for u, dn in votes], d / "part-a.parquet")
    assert samples_by_version(tmp_path) == {"v000000": {"samples": 2, "votes_up": 1, "votes_down": 2},
                                            "v000001": {"samples": 1, "votes_up": 3, "votes_down": 1}}
    assert samples_by_version(tmp_path / "empty") == {}
