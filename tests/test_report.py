"""The demo report's statistics and per-version counts."""

import pytest

from deploy.stats import newcombe_interval
from flywheel.report import wilson_interval
from samplestore.votes import samples_by_version
from samplestore.shards import write_shard
from schemas.events import RewardedSample, SamplingParams


def test_wilson_interval_matches_hand_values():
    # 1 up of 10: the textbook Wilson 95 % interval is [0.0179, 0.4042]
    lo, hi = wilson_interval(1, 10)
    assert lo == pytest.approx(0.0179, abs=1e-4) and hi == pytest.approx(0.4042, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_samples_by_version_counts_each_versions_votes(tmp_path):
    import uuid

    def sample(v, up, down):
        return RewardedSample(completion_id=uuid.uuid4(), model_version=v, created_at=1_700_000_000_000,
                              user_hash="u", prompt_token_ids=[1], completion_token_ids=[2], behavior_logprobs=[-0.5],
                              sampling=SamplingParams(), finish_reason="stop", reward=1.0, label=up > down,
                              n_votes=up + down, votes_up=up, votes_down=down,
                              event_ids=[str(uuid.uuid4()) for _ in range(up + down)], sealed_at=1_700_000_000_000)
    for v, votes in {"v000000": [(1, 0), (0, 2)], "v000001": [(3, 1)]}.items():
        d = tmp_path / f"model_version={v}" / "date=2026-11-30"
        d.mkdir(parents=True)
        write_shard([sample(v, u, dn) for u, dn in votes], d / "part-a.parquet")
    assert samples_by_version(tmp_path) == {
        "v000000": {"samples": 2, "votes_up": 1, "votes_down": 2, "mean_reward": 1.0},
        "v000001": {"samples": 1, "votes_up": 3, "votes_down": 1, "mean_reward": 1.0}}
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
    from flywheel.report import eval_gain, split_figures
    from samplestore.votes import votes_by_completion

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


def _rows(version, votes, prompt_prefix="p", repeat=1):
    """Synthetic votes_by_completion rows: ``votes`` = [(up, down)] one per prompt, each
    prompt's vote repeated ``repeat`` times (clustered); returns (rows, key_of)."""
    import uuid

    rows, key_of = [], {}
    for i, (up, down) in enumerate(votes):
        for _ in range(repeat):
            cid = str(uuid.uuid4())
            rows.append({"completion_id": cid, "model_version": version, "split": "eval", "votes_up": up,
                         "votes_down": down})
            key_of[cid] = f"{prompt_prefix}{version}{i}"
    return rows, key_of


def test_cluster_bootstrap_gain_widens_with_repeated_prompts():
    """Independent prompts: the bootstrap interval is about Wald's (hand: 0.3 -> 0.5 on 200
    prompts each, half-width 1.96 sqrt(.21/200 + .25/200) = 0.0940). The same votes each
    repeated 4 times on their prompt: Newcombe's interval narrows about 2x (it counts 4x the
    votes), the cluster bootstrap's stays (design effect 4: the same information)."""
    from flywheel.report import cluster_bootstrap_gain

    a, ka = _rows("v0", [(1, 0)] * 60 + [(0, 1)] * 140)
    b, kb = _rows("v2", [(1, 0)] * 100 + [(0, 1)] * 100)
    g = cluster_bootstrap_gain(a + b, {**ka, **kb}, "v0", "v2", n_boot=4000, seed=1)
    assert g["diff"] == pytest.approx(0.2) and g["prompts"] == 400 and g["dropped"] == 0
    half = (g["ci95"][1] - g["ci95"][0]) / 2
    assert half == pytest.approx(0.0940, rel=0.1)
    a4, ka4 = _rows("v0", [(1, 0)] * 60 + [(0, 1)] * 140, repeat=4)
    b4, kb4 = _rows("v2", [(1, 0)] * 100 + [(0, 1)] * 100, repeat=4)
    g4 = cluster_bootstrap_gain(a4 + b4, {**ka4, **kb4}, "v0", "v2", n_boot=4000, seed=1)
    half4 = (g4["ci95"][1] - g4["ci95"][0]) / 2
    assert g4["diff"] == pytest.approx(0.2) and half4 == pytest.approx(half, rel=0.1)
    _, nlo, nhi = newcombe_interval(240, 800, 400, 800)
    assert (nhi - nlo) / 2 < 0.6 * half4  # the independent-votes interval is ~2x too narrow here
    assert cluster_bootstrap_gain(a, ka, "v0", "v9") is None


def test_kind_and_reply_figures_by_hand():
    from flywheel.report import kind_figures, reply_figures

    rows = [{"completion_id": c, "model_version": "v1", "split": sp, "votes_up": u, "votes_down": d}
            for c, sp, u, d in (("a", "train", 1, 0), ("b", "eval", 0, 1), ("c", "eval", 1, 0), ("d", "eval", 1, 0),
                                ("e", "eval", 0, 1))]
    kinds = kind_figures(rows, {"a": "train", "b": "fresh", "c": "fresh", "d": "harder", "e": "unseen"})["v1"]
    assert {k: (x["votes_up"], x["votes"]) for k, x in kinds.items()} == {
        "train": (1, 1), "fresh": (1, 2), "harder": (1, 1), "unseen": (0, 1)}
    assert kinds["fresh"]["ci95"] == pytest.approx(list(wilson_interval(1, 2)))
    # tokens 10, 20, 30, 40: mean 25, s = sqrt(500/3) = 12.910, half-width 1.96 s / 2 = 12.652
    rf = reply_figures([{"tokens": t, "has_answer": t > 10, "finish_reason": "length" if t == 40 else "stop"}
                        for t in (10, 20, 30, 40)])
    assert rf["n"] == 4 and rf["mean_tokens"] == 25.0
    assert rf["mean_tokens_ci95"] == pytest.approx([25 - 12.652, 25 + 12.652], abs=1e-3)
    assert (rf["no_answer"]["votes_up"], rf["truncated"]["votes_up"]) == (1, 1)
    assert rf["no_answer"]["ci95"] == pytest.approx(list(wilson_interval(1, 4)))


def test_print_report_shows_kinds_replies_and_both_gain_intervals():
    from rich.console import Console

    from flywheel.report import print_report, reply_figures

    rate = {"votes_up": 3, "votes": 10, "rate": 0.3, "ci95": list(wilson_interval(3, 10))}
    v = {"version": "v000002", "parent": "v000001", "samples": 10, "votes_up": 3, "votes_down": 7,
         "thumbs_up_rate": 0.3, "ci95": rate["ci95"], "decision": "PROMOTE", "reason": "ok",
         "splits": {"eval": {"all": rate, "by_family": {}}},
         "kinds": {"train": rate, "fresh": rate, "harder": rate, "unseen": rate},
         "replies": reply_figures([{"tokens": 5, "has_answer": True, "finish_reason": "stop"}] * 3)}
    g = {"from": "v000000", "to": "v000002", "diff": 0.1, "ci95": [-0.05, 0.25], "n_from": 10, "n_to": 10,
         "up_from": 2, "up_to": 3, "cluster_ci95": [-0.1, 0.3],
         "by_kind": {"fresh": {"up_from": 2, "n_from": 10, "up_to": 3, "n_to": 10, "diff": 0.1,
                               "ci95": [-0.05, 0.25], "cluster_ci95": [-0.1, 0.3], "prompts": 7}}}
    c = Console(record=True, width=240, force_terminal=True)
    print_report({"versions": [v], "eval_gain": g, "events_accepted": 1, "events_in_samples": 1,
                  "events_dead_lettered": 0, "events_lost": 0, "wall_s": 1.0}, c)
    out = c.export_text()
    assert "fresh" in out and "harder" in out and "unseen" in out and "5.0 [5.0,5.0]" in out
    assert "eval gain on fresh prompts v000000 -> v000002: 2/10 -> 3/10" in out
    assert "cluster bootstrap over 7 prompts [-0.100, +0.300]" in out
    assert "cluster bootstrap over prompts [-0.100, +0.300]" in out


def test_a_run_without_thumbs_reports_the_mean_reward_not_a_zero_rate(tmp_path, capsys):
    """``--signals implicit`` sends no thumbs: the thumbs-up rate is no figure ("-", None in
    report.json), the mean reward is shown, and the plot draws the mean reward."""
    from flywheel.report import print_report, write_plot

    lo, hi = wilson_interval(0, 0)
    vs = [{"version": "v000000", "parent": None, "samples": 7, "votes_up": 0, "votes_down": 0,
           "thumbs_up_rate": None, "ci95": [lo, hi], "mean_reward": 0.0072, "decision": "base"},
          {"version": "v000001", "parent": "v000000", "samples": 5, "votes_up": 0, "votes_down": 0,
           "thumbs_up_rate": None, "ci95": [lo, hi], "mean_reward": -0.3571, "decision": "ROLLBACK"}]
    print_report({"versions": vs, "events_accepted": 12, "events_in_samples": 12, "events_dead_lettered": 0,
                  "events_lost": 0, "wall_s": 296.0})  # not a terminal: printed 200 columns wide
    out = capsys.readouterr().out
    assert "+0.007" in out and "-0.357" in out and "0.000 [" not in out
    write_plot({"versions": vs}, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
