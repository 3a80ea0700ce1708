"""The fixed eval set's paired comparison (flywheel.report): exact McNemar against the binomial
tail worked by hand, the paired bootstrap's determinism and its stratification by run, and a
hand-built 2x2 of pairs."""

from __future__ import annotations

import pytest

from flywheel.report import fixed_figures, mcnemar_exact, paired_bootstrap, paired_comparison, signal_figures


@pytest.mark.parametrize("b,c,p", [
    (1, 6, 2 * (1 + 7) / 2 ** 7),  # P[X <= 1], X ~ Bin(7, 1/2) = (C(7,0) + C(7,1)) / 128
    (6, 1, 2 * (1 + 7) / 2 ** 7),  # symmetric
    (0, 5, 2 * 1 / 2 ** 5),
    (2, 9, 2 * (1 + 11 + 55) / 2 ** 11),  # 67/1024 = 0.0654296875
    (3, 3, 1.0),  # 2 * 42/64 > 1: capped
    (0, 0, 1.0),  # no discordant pair
])
def test_mcnemar_exact_is_the_two_sided_binomial_tail(b, c, p):
    assert mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)


def test_mcnemar_refuses_negative_counts():
    with pytest.raises(ValueError, match="only_first"):
        mcnemar_exact(-1, 2)


def _rows(pairs, kind="fresh", run=None):
    out = []
    for i, (a, b) in enumerate(pairs):
        for v, x in (("v0", a), ("v2", b)):
            out.append({"version": v, "key": f"{kind}-{i}", "kind": kind, "family": "chain_sum", "passed": x,
                        **({"run": run} if run is not None else {})})
    return out


def test_paired_comparison_counts_the_2x2_by_hand():
    # 3 right under both, 1 right under the first only, 4 under the last only, 2 under neither
    pairs = [(1, 1)] * 3 + [(1, 0)] + [(0, 1)] * 4 + [(0, 0)] * 2
    rows = _rows(pairs) + _rows([(0, 1), (1, 1)], kind="unseen") + [
        {"version": "v1", "key": "fresh-0", "kind": "fresh", "passed": True},  # another version: ignored
        {"version": "v2", "key": "only-last", "kind": "fresh", "passed": True}]  # unpaired: left out
    c = paired_comparison(rows, "v0", "v2", seed=3)
    assert (c["prompts"], c["both"], c["only_from"], c["only_to"], c["neither"]) == (12, 4, 1, 5, 2)
    assert c["rate_from"] == pytest.approx(5 / 12) and c["rate_to"] == pytest.approx(9 / 12)
    assert c["diff"] == pytest.approx(4 / 12)
    assert c["mcnemar_p"] == pytest.approx(2 * (1 + 6) / 2 ** 6)  # b=1, c=5
    f = c["by_kind"]["fresh"]
    assert (f["prompts"], f["only_from"], f["only_to"], f["diff"]) == (10, 1, 4, pytest.approx(0.3))
    u = c["by_kind"]["unseen"]
    assert (u["prompts"], u["only_to"], u["mcnemar_p"]) == (2, 1, 1.0)
    lo, hi = c["ci95"]
    assert lo <= c["diff"] <= hi
    assert paired_comparison(rows, "v0", "v9") is None


def test_paired_bootstrap_is_deterministic_and_degenerate_when_all_pairs_agree():
    d = [1, 0, 0, -1, 1, 1, 0, 0, 1, 0]
    assert paired_bootstrap([d], seed=7) == paired_bootstrap([d], seed=7)
    assert paired_bootstrap([d], seed=7, n_boot=500) == paired_bootstrap([d], seed=7, n_boot=500)
    assert paired_bootstrap([[1] * 5], seed=0) == [1.0, 1.0]  # no spread to resample
    assert paired_bootstrap([[]]) is None


def test_stratified_bootstrap_keeps_each_runs_prompt_count():
    """Stratified by run, every resample keeps run 0's 4 prompts (all +1) and run 1's 4 (all 0):
    the mean is exactly 0.5 in every resample; pooled without strata it is not."""
    a, b = [1, 1, 1, 1], [0, 0, 0, 0]
    assert paired_bootstrap([a, b], seed=1) == [0.5, 0.5]
    lo, hi = paired_bootstrap([a + b], seed=1)
    assert lo < 0.5 < hi


def test_pooled_comparison_pairs_within_a_run():
    rows = _rows([(0, 1), (0, 1), (1, 1)], run=0) + _rows([(1, 0), (0, 0)], run=1)  # same keys in both runs
    c = paired_comparison(rows, "v0", "v2", seed=0, strata_key="run")
    assert (c["prompts"], c["only_to"], c["only_from"]) == (5, 2, 1)
    assert c["diff"] == pytest.approx(1 / 5)


def test_fixed_figures_rates_by_kind():
    f = fixed_figures(_rows([(1, 0), (0, 0)]) + _rows([(1, 1)], kind="harder"))
    assert f["v0"]["all"]["votes_up"] == 2 and f["v0"]["all"]["votes"] == 3
    assert f["v2"]["by_kind"]["harder"]["rate"] == 1.0 and f["v2"]["by_kind"]["fresh"]["rate"] == 0.0


def test_signal_figures_sent_and_joined():
    comps = {
        "a": {"version": "v0", "kind": "train", "thumb": 1, "action": ("copy", 1.0)},
        "b": {"version": "v0", "kind": "train", "thumb": None, "action": ("edit", 0.25)},
        "c": {"version": "v0", "kind": "train", "thumb": -1, "action": ("followup", -1.0)},
        "d": {"version": "v0", "kind": "train", "thumb": None, "action": None},
        "e": {"version": "v0", "kind": "fresh", "thumb": None, "action": ("regenerate", 1.0)},
    }
    s = signal_figures(comps)
    t = s["v0"]["train"]
    assert t["replies"] == 4 and t["joined"] is None
    assert t["sent"]["thumb"]["votes_up"] == 2 and t["sent"]["thumb_up"]["rate"] == 0.5
    assert t["sent"]["copy"]["rate"] == 0.25 and t["sent"]["edit"]["rate"] == 0.25
    assert t["sent"]["mean_kept_share"] == 0.25 and t["sent"]["followup_dissatisfied"]["votes_up"] == 1
    assert s["v0"]["fresh"]["sent"]["regenerate"]["rate"] == 1.0
    joined = {"a": {"copied": 2, "regenerated": 0, "kept_share": None, "followup": None},
              "b": {"copied": 0, "regenerated": 0, "kept_share": 0.5, "followup": None}}
    j = signal_figures(comps, joined)["v0"]["train"]["joined"]
    assert j["copy"]["votes_up"] == 1 and j["edit"]["votes_up"] == 1 and j["mean_kept_share"] == 0.5
    assert j["followup_dissatisfied"]["votes_up"] == 0  # c's followup not joined yet
