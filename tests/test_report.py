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


def test_split_figures_and_eval_gain_by_hand(tmp_path):
    """Votes by split and family from real shards; the eval gain's Newcombe interval by hand."""
    import uuid

    def sample(v, split, up, down):
        return RewardedSample(completion_id=uuid.uuid4(), model_version=v, created_at=1_700_000_000_000,
                              user_hash="u", prompt_token_ids=[1], completion_token_ids=[2], behavior_logprobs=[-0.5],
                              sampling=SamplingParams(), finish_reason="stop", reward=1.0, label=up > down,
                              n_votes=up + down, votes_up=up, votes_down=down, split=split,
                              event_ids=[str(uuid.uuid4()) for _ in range(up + down)], sealed_at=1_700_000_000_000)
    from flywheel.report import eval_gain, split_figures, votes_by_completion

    v0 = [sample("v000000", "eval", 1, 0) for _ in range(18)] + [sample("v000000", "eval", 0, 1) for _ in range(82)]
    v2 = [sample("v000002", "eval", 1, 0) for _ in range(36)] + [sample("v000002", "eval", 0, 1) for _ in range(64)]
    tr = [sample("v000000", "train", 1, 0) for _ in range(5)]
    for i, batch in enumerate((v0, v2, tr)):
        d = tmp_path / "date=2023-11-14" / f"hour={i}"  # the writer's layout
        d.mkdir(parents=True)
        write_shard(batch, d / "part-a.parquet")
    family_of = {str(s.completion_id): ("gcd" if i % 2 else "chain_sum") for i, s in enumerate(v0 + v2 + tr)}
    rows = votes_by_completion(tmp_path)
    assert len(rows) == 205
    fig = split_figures(rows, family_of)
    assert fig["v000000"]["eval"]["all"]["votes_up"] == 18 and fig["v000000"]["eval"]["all"]["votes"] == 100
    assert fig["v000000"]["train"]["all"]["votes_up"] == 5
    fams = fig["v000000"]["eval"]["by_family"]
    assert fams["gcd"]["votes"] + fams["chain_sum"]["votes"] == 100
    assert fams["chain_sum"]["votes_up"] == 9 and fams["gcd"]["votes_up"] == 9  # alternating ids over the 18 ups
    g = eval_gain(fig, "v000000", "v000002")
    # 18/100 -> 36/100: Newcombe method 10: [0.0570, 0.2962] (tests/test_deploy_analysis.py by hand)
    assert g["diff"] == pytest.approx(0.18) and g["ci95"] == pytest.approx([0.05698, 0.29620], abs=2e-4)
    assert (g["n_from"], g["n_to"], g["from"], g["to"]) == (100, 100, "v000000", "v000002")
    assert eval_gain(fig, "v000000", "v000009") is None


def test_plot_with_zero_up_votes_renders(tmp_path):
    """0 up-votes: Wilson's lower bound may round a hair above 0.0; the error bars stay >= 0."""
    from flywheel.report import write_plot

    lo, hi = wilson_interval(0, 3)
    v = {"version": "v000001", "decision": "ROLLBACK", "votes_up": 0, "votes_down": 3, "thumbs_up_rate": 0.0,
         "ci95": [lo + 1e-17, hi], "splits": {"eval": {"all": {"votes_up": 0, "votes": 3, "rate": 0.0,
                                                              "ci95": [1e-17, hi]}}}}
    write_plot({"versions": [v]}, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
