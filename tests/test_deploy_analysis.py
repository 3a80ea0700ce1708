"""Canary analysis: table tests against hand-computed statistics."""

from __future__ import annotations

import math

import pytest

from deploy.analysis import AnalysisConfig, ArmStats, Check, Outcome, analyze
from deploy.analysis import thumbs_bounds
from deploy.stats import (margin_tau, msprt_interval, newcombe_interval, ratio_interval, two_proportion_z,
                          wilson_interval)

ALPHA = AnalysisConfig().alpha  # the canary's error level (its one declaration)


def test_two_proportion_z_matches_hand_computation():
    # 30/100 vs 45/100: pooled p = 75/200 = 0.375; se = sqrt(.375*.625*(1/100+1/100)) = 0.0684653
    # z = (0.30 - 0.45) / 0.0684653 = -2.19089; Phi(-2.19089) = 0.014229 (normal table)
    z, p = two_proportion_z(30, 100, 45, 100)
    assert z == pytest.approx(-2.19089, abs=1e-5)
    assert p == pytest.approx(0.014229, abs=2e-6)
    # equal rates: z = 0, p = 0.5; no variance (all up): defined as z = 0, p = 0.5
    assert two_proportion_z(20, 40, 10, 20) == pytest.approx((0.0, 0.5))
    assert two_proportion_z(10, 10, 10, 10) == (0.0, 0.5)
    with pytest.raises(ValueError, match="n:"):
        two_proportion_z(0, 0, 1, 2)


def test_wilson_interval_hand_values():
    # by hand, z = 1.96: den = 1 + 3.8416/100 = 1.038416; centre = (0.18 + 0.019208)/den = 0.191838
    # half = 1.96*sqrt(0.18*0.82/100 + 3.8416/40000)/den = 0.074837 -> (0.11700, 0.26668)
    lo, hi = wilson_interval(18, 100)
    assert lo == pytest.approx(0.11700, abs=1e-4) and hi == pytest.approx(0.26668, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_msprt_interval_matches_hand_computation():
    # 40/200 vs 90/200, alpha 0.05, tau 0.1 (deploy.stats.msprt_interval docstring):
    # q_c = 40.5/201 = 0.201493, q_s = 90.5/201 = 0.450249
    # V = 0.201493*0.798507/200 + 0.450249*0.549751/200 = 0.0020421
    # h = sqrt(2 V (V + .01)/.01 * ln(sqrt((V + .01)/V)/.05)) = 0.13819; d = -0.25
    d, lo, hi = msprt_interval(40, 200, 90, 200, alpha=0.05, tau=0.1)
    assert d == pytest.approx(-0.25)
    assert lo == pytest.approx(-0.38819, abs=1e-5) and hi == pytest.approx(-0.11181, abs=1e-5)
    # symmetric when the arms are equal; wider at a smaller n (45/100: h = 0.22920)
    assert msprt_interval(45, 100, 45, 100, ALPHA) == pytest.approx((0.0, -0.22920, 0.22920), abs=1e-5)
    with pytest.raises(ValueError, match="both arms need votes"):
        msprt_interval(0, 0, 1, 2, ALPHA)
    with pytest.raises(ValueError, match="tau"):
        msprt_interval(1, 2, 1, 2, ALPHA, tau=0)


def test_ratio_interval_matches_hand_computation():
    # 40/200 vs 90/200, alpha 0.05, tau = -ln(0.7) = 0.356675 (relative margin 0.3):
    # q_c = 40.5/201 = 0.201493, q_s = 90.5/201 = 0.450249; theta = ln(q_c/q_s) = -0.804048
    # V = 0.798507/(200*0.201493) + 0.549751/(200*0.450249) = 0.025920
    # h = sqrt(2 V (V + tau^2)/tau^2 * ln(sqrt((V + tau^2)/V)/0.05)) = 0.492302
    # rel = e^theta - 1 = -0.552486; lo = e^(theta-h) - 1 = -0.726472; hi = e^(theta+h) - 1 = -0.267832
    r, lo, hi = ratio_interval(40, 200, 90, 200, alpha=0.05, tau=margin_tau(0.3))
    assert margin_tau(0.3) == pytest.approx(0.356675, abs=1e-6)
    assert r == pytest.approx(-0.552486, abs=1e-6)
    assert lo == pytest.approx(-0.726472, abs=1e-6) and hi == pytest.approx(-0.267832, abs=1e-6)
    with pytest.raises(ValueError, match="both arms need votes"):
        ratio_interval(0, 0, 1, 2, ALPHA)
    with pytest.raises(ValueError, match="tau"):
        ratio_interval(1, 2, 1, 2, ALPHA, tau=0)


def test_relative_margin_means_the_same_at_every_base_rate():
    """A candidate keeping 80 % of the stable's rate sits exactly at a 0.2 relative margin,
    at a 0.05 and at a 0.5 base rate alike: with 10,000 votes per arm neither passes. The
    absolute rule (margin 0.1) calls 0.04 vs 0.05 non-inferior though it is 20 % worse."""
    cfg = AnalysisConfig(min_votes=10, delta=0.2)
    for up_c, up_s in ((400, 500), (4000, 5000)):
        d = analyze(ArmStats(up_c, 10_000 - up_c), ArmStats(up_s, 10_000 - up_s), cfg)
        t = d.numbers()["thumbs_up"]
        assert t["diff"] == pytest.approx(-0.2, abs=2e-3) and t["ci_lo"] < -0.2 < t["ci_hi"] < 0
        assert d.outcome == Outcome.ROLLBACK  # surely worse (upper bound < 0), never promoted
    assert msprt_interval(400, 10_000, 500, 10_000, ALPHA, tau=0.1)[1] > -0.1  # the absolute rule would pass it


def test_cuped_matches_a_per_vote_reference_and_narrows_the_interval():
    """CUPED from ArmStats' sufficient statistics equals the textbook per-vote computation
    (Deng et al. 2013: theta from within-arm pooled covariance, adjusted mean
    ybar - theta (xbar - mean x)), and a predictive covariate narrows the interval."""
    import numpy as np

    rng = np.random.default_rng(3)
    arms = []
    for n, scale in ((1000, 0.9), (2000, 1.0)):
        u = rng.beta(0.5, 1.5, n)  # users' propensities (heterogeneous, mean 0.25)
        x = rng.binomial(10, u) / 10  # their earlier thumbs-up rate
        y = (rng.random(n) < scale * u).astype(float)
        arms.append((x, y))
    (xc, yc), (xs, ys) = arms
    sxx = ((xc - xc.mean()) ** 2).sum() + ((xs - xs.mean()) ** 2).sum()
    sxy = ((xc - xc.mean()) * (yc - yc.mean())).sum() + ((xs - xs.mean()) * (ys - ys.mean())).sum()
    theta = sxy / sxx
    mu = np.concatenate([xc, xs]).mean()

    def ref(x, y):  # shrunk rate as in ratio_interval, then the adjustment and its variance
        q = (y.sum() + 0.5) / (len(y) + 1)
        var = (q * (1 - q) - 2 * theta * np.cov(x, y, bias=True)[0, 1] + theta ** 2 * x.var()) / len(y)
        return q - theta * (x.mean() - mu), var

    (mc, vc), (ms, vs) = ref(xc, yc), ref(xs, ys)
    tau = margin_tau(0.2)

    def h(V, tau):
        return math.sqrt(2 * V * (V + tau ** 2) / tau ** 2 * math.log(math.sqrt((V + tau ** 2) / V) / 0.05))

    th = math.log(mc / ms)
    lo = math.expm1(th - h(vc / mc ** 2 + vs / ms ** 2, tau))
    # upper bound: score test on the difference, pooled variance times CUPED's variance ratio
    qc, qs = (yc.sum() + 0.5) / (len(yc) + 1), (ys.sum() + 0.5) / (len(ys) + 1)
    wald = qc * (1 - qc) / len(yc) + qs * (1 - qs) / len(ys)
    p = (yc.sum() + ys.sum() + 1) / (len(yc) + len(ys) + 2)
    v0 = p * (1 - p) * (1 / len(yc) + 1 / len(ys)) * min((vc + vs) / wald, 1.0)
    hi = (mc - ms + h(v0, tau * p)) / ms

    def stats(x, y):
        return ArmStats(int(y.sum()), int(len(y) - y.sum()), x_sum=float(x.sum()), xx_sum=float((x * x).sum()),
                        xy_sum=float((x * y).sum()))

    c, s = stats(xc, yc), stats(xs, ys)
    cfg = AnalysisConfig(delta=0.2)
    t = analyze(c, s, cfg).numbers()["thumbs_up"]
    assert t["cuped"] is True
    assert (t["diff"], t["ci_lo"], t["ci_hi"]) == pytest.approx((math.expm1(th), lo, hi), rel=1e-9)
    plain = analyze(ArmStats(c.votes_up, c.votes_down), ArmStats(s.votes_up, s.votes_down), cfg).numbers()["thumbs_up"]
    assert plain["cuped"] is False
    # the PASS side's half-width on the log scale
    assert math.log1p(t["diff"]) - math.log1p(t["ci_lo"]) < 0.95 * (math.log1p(plain["diff"]) -
                                                                      math.log1p(plain["ci_lo"]))
    # the same function on arrays (what bench/canary.py simulates) gives the same bounds
    arr = thumbs_bounds(np.array([c.votes_up] * 2, float), np.array([c.votes] * 2, float),
                        np.array([s.votes_up] * 2, float), np.array([s.votes] * 2, float), cfg,
                        (np.full(2, c.x_sum), np.full(2, c.xx_sum), np.full(2, c.xy_sum)),
                        (np.full(2, s.x_sum), np.full(2, s.xx_sum), np.full(2, s.xy_sum)))
    assert arr[1] == pytest.approx([t["ci_lo"]] * 2, rel=1e-12)
    with pytest.raises(ValueError, match="x_sum"):
        ArmStats(1, 1, x_sum=1.0)


def test_newcombe_interval_hand_values():
    # 18/100 -> 36/100: Wilson (0.11700, 0.26668) and (0.27271, 0.45762) (z = 1.96)
    # lo = 0.18 - sqrt((0.36 - 0.27271)^2 + (0.26668 - 0.18)^2) = 0.18 - 0.12302 = 0.05698
    # hi = 0.18 + sqrt((0.45762 - 0.36)^2 + (0.18 - 0.11700)^2) = 0.18 + 0.11611 = 0.29611
    d, lo, hi = newcombe_interval(18, 100, 36, 100)
    assert d == pytest.approx(0.18) and lo == pytest.approx(0.05698, abs=2e-4) and hi == pytest.approx(0.29611, abs=2e-4)


# relative margin 0.3 so that equal rates at 200 votes per arm pass (lower bound -28.5 % > -30 %)
CFG = AnalysisConfig(min_votes=20, alpha=0.05, delta=0.3, min_requests=20, failure_limit=1)

# (name, candidate, stable, source_error, outcome, inconclusive, error, worst metric)
TABLE = [
    ("empty data holds", ArmStats(), ArmStats(), None, Outcome.HOLD, True, False, "thumbs_up"),
    ("too few candidate votes", ArmStats(5, 4), ArmStats(50, 50), None, Outcome.HOLD, True, False, "thumbs_up"),
    # relative [-72.6 %, -26.8 %]: upper bound < 0
    ("surely worse rolls back", ArmStats(40, 160), ArmStats(90, 110), None, Outcome.ROLLBACK, False, False,
     "thumbs_up"),
    # relative [-28.5 %, +39.9 %]: lower bound > -delta
    ("equal promotes", ArmStats(90, 110), ArmStats(90, 110), None, Outcome.PROMOTE, False, False, None),
    ("better promotes", ArmStats(110, 90), ArmStats(90, 110), None, Outcome.PROMOTE, False, False, None),
    # 30/100 vs 45/100: [-62.6 %, +20.0 %] is undecided (a repeated z-test rolled this back: p = 0.014)
    ("worse but not surely: keep collecting", ArmStats(30, 70), ArmStats(45, 55), None, Outcome.HOLD, True, False,
     "thumbs_up"),
    ("latency fails, worst wins", ArmStats(90, 110, p99_ms=900.0), ArmStats(90, 110, p99_ms=400.0), None,
     Outcome.ROLLBACK, False, False, "p99_latency"),
    ("throughput fails", ArmStats(90, 110, tokens_per_s=5.0), ArmStats(90, 110, tokens_per_s=17.0), None,
     Outcome.ROLLBACK, False, False, "tokens_per_s"),
    ("error rate fails", ArmStats(90, 110, errors=10, requests=100), ArmStats(90, 110, errors=1, requests=100), None,
     Outcome.ROLLBACK, False, False, "error_rate"),
    ("error rate within bound", ArmStats(90, 110, errors=2, requests=100), ArmStats(90, 110, errors=1, requests=100),
     None, Outcome.PROMOTE, False, False, None),
    ("NaN latency is an error, not inconclusive", ArmStats(90, 110, p99_ms=float("nan")),
     ArmStats(90, 110, p99_ms=1.0), None, Outcome.HOLD, False, True, "p99_latency"),
    ("source failure holds as error", ArmStats(), ArmStats(), "parquet unreadable", Outcome.HOLD, False, True, "source"),
    ("error beats inconclusive", ArmStats(1, 0, p99_ms=float("nan")), ArmStats(1, 0, p99_ms=1.0), None,
     Outcome.HOLD, False, True, "p99_latency"),
]


@pytest.mark.parametrize("name,cand,stable,err,outcome,inconclusive,error,worst", TABLE, ids=[t[0] for t in TABLE])
def test_analysis_table(name, cand, stable, err, outcome, inconclusive, error, worst):
    d = analyze(cand, stable, CFG, source_error=err)
    assert d.outcome == outcome, d.reason
    assert (d.inconclusive, d.error) == (inconclusive, error)
    assert d.reason.startswith({Outcome.PROMOTE: "PROMOTE", Outcome.ROLLBACK: "ROLLBACK",
                                Outcome.HOLD: "HOLD"}[outcome])
    if worst:
        assert worst in {m.name for m in d.metrics if m.check in (Check.FAIL, Check.ERROR, Check.INCONCLUSIVE)}


def test_rollback_reason_carries_the_interval():
    d = analyze(ArmStats(40, 160), ArmStats(90, 110), CFG)
    n = d.numbers()["thumbs_up"]
    assert n["check"] == "FAIL" and d.decided_by == "sequential_test"
    # lower bound: test_ratio_interval_matches_hand_computation's (the same counts and margin).
    # upper bound, the score test on the difference (deploy.stats.noninferiority_bounds):
    # p = 131/402 = 0.325871, V0 = p (1 - p) (2/200) = 0.0021968, tau_d = 0.356675 p = 0.116230
    # h = sqrt(2 V0 (V0 + tau_d^2)/tau_d^2 ln(sqrt((V0 + tau_d^2)/V0)/0.05)) = 0.142570
    # hi = (0.201493 - 0.450249 + 0.142570) / 0.450249 = -0.235839
    assert n["ci_lo"] == pytest.approx(-0.726472, abs=1e-6) and n["ci_hi"] == pytest.approx(-0.235839, abs=1e-6)
    assert n["candidate_rate"] == 0.20 and n["stable_rate"] == 0.45 and n["abs_diff"] == pytest.approx(-0.25)
    assert "[-72.6%, -23.6%]" in d.reason and "surely worse" in d.reason


def test_operational_failure_needs_failure_limit_checks_in_a_row():
    cfg = AnalysisConfig(min_votes=20, delta=0.3, failure_limit=3)
    bad_c, bad_s = ArmStats(90, 110, p99_ms=900.0), ArmStats(90, 110, p99_ms=400.0)
    ok_c = ArmStats(90, 110, p99_ms=410.0)
    counts: dict = {}
    for k in (1, 2):
        d = analyze(bad_c, bad_s, cfg, failed_checks=counts)
        assert d.outcome == Outcome.HOLD and f"failed check {k} of 3 in a row" in d.reason, d.reason
        counts = d.failed_checks
    d = analyze(ok_c, bad_s, cfg, failed_checks=counts)  # a passing check resets the count
    assert d.outcome == Outcome.PROMOTE and d.failed_checks["p99_latency"] == 0
    counts = d.failed_checks
    for _ in range(2):
        counts = analyze(bad_c, bad_s, cfg, failed_checks=counts).failed_checks
    d = analyze(bad_c, bad_s, cfg, failed_checks=counts)
    assert d.outcome == Outcome.ROLLBACK and d.decided_by == "operational" and "3 failed checks in a row" in d.reason
    assert counts == {"p99_latency": 2}  # the input is not modified


def test_guards_fail_a_candidate_that_games_length():
    """A candidate that pads its replies (a shortcut to a naive reward) fails the length
    guard even while its thumbs-up rate looks fine."""
    cfg = AnalysisConfig(min_votes=20, delta=0.3, failure_limit=1, min_guard_completions=20)
    stable = ArmStats(90, 110, completions=200, completion_tokens=200 * 40, no_answer=20, truncated=10)
    long = ArmStats(110, 90, completions=200, completion_tokens=200 * 120, no_answer=20, truncated=150)
    d = analyze(long, stable, cfg)
    assert d.outcome == Outcome.ROLLBACK and d.decided_by == "guard"
    checks = {m.name: m.check for m in d.metrics}
    assert checks["completion_length"] == Check.FAIL and checks["truncated"] == Check.FAIL
    assert "ratio 3.00 > 1.5" in d.reason and "0.75 vs 0.05" in d.reason
    empty = ArmStats(110, 90, completions=200, completion_tokens=200 * 2, no_answer=120, truncated=0)
    d = analyze(empty, stable, cfg)
    assert d.outcome == Outcome.ROLLBACK and {m.name: m.check for m in d.metrics}["no_answer"] == Check.FAIL
    few = ArmStats(110, 90, completions=5, completion_tokens=5 * 400, no_answer=5, truncated=5)
    d = analyze(few, stable, cfg)
    assert d.outcome == Outcome.HOLD and d.inconclusive  # too few completions to judge a guard


def test_a_candidate_cut_at_max_tokens_less_often_is_not_called_shorter():
    """The full demo's case (seed 0, docs/experiments.md run H): the stable's replies are cut
    at 48 tokens 17 % of the time, the candidate's 2 %; the replies that finish are 18 and 14
    tokens long. Over every reply the candidate looks 0.64x as long (the rule over every
    reply rolled it back); over the finished replies the ratio is 0.78 and the guard passes.
    A candidate whose finished replies collapse to a bare answer still fails."""
    cfg = AnalysisConfig(min_votes=20, delta=0.3, failure_limit=1, min_guard_completions=20)
    # stable: 166 finished replies of 18 tokens + 34 cut at 48; candidate: 196 of 14 + 4 cut
    stable = ArmStats(40, 160, completions=200, completion_tokens=166 * 18 + 34 * 48, no_answer=10, truncated=34,
                      truncated_tokens=34 * 48)
    concise = ArmStats(40, 160, completions=200, completion_tokens=196 * 14 + 4 * 48, no_answer=10, truncated=4,
                       truncated_tokens=4 * 48)
    all_ratio = (concise.completion_tokens / 200) / (stable.completion_tokens / 200)
    assert all_ratio < cfg.min_length_ratio  # what the guard measured over every reply
    d = analyze(concise, stable, cfg)
    m = {x.name: x for x in d.metrics}
    assert m["completion_length"].check == Check.PASS
    assert m["completion_length"].numbers["ratio"] == pytest.approx(14 / 18)
    assert m["completion_length"].numbers["over"] == "finished"
    bare = ArmStats(40, 160, completions=200, completion_tokens=190 * 3 + 10 * 48, no_answer=10, truncated=10,
                    truncated_tokens=10 * 48)
    d = analyze(bare, stable, cfg)
    m = {x.name: x for x in d.metrics}
    assert m["completion_length"].check == Check.FAIL and d.outcome == Outcome.ROLLBACK
    assert m["completion_length"].numbers["ratio"] == pytest.approx(3 / 18)
    assert "replies not cut at max_tokens" in m["completion_length"].reason
    # a source without truncated_tokens: the mean over every reply, as before
    old = ArmStats(40, 160, completions=200, completion_tokens=concise.completion_tokens, no_answer=10, truncated=4)
    m = {x.name: x for x in analyze(old, stable, cfg).metrics}
    assert m["completion_length"].check == Check.FAIL and m["completion_length"].numbers["over"] == "all"
    assert m["completion_length"].numbers["ratio"] == pytest.approx(all_ratio)
    with pytest.raises(ValueError, match="truncated_tokens"):
        ArmStats(truncated_tokens=-1)


def _arm(n, finished_mean, cut=0, cut_len=48, no_answer=0):
    """ArmStats of ``n`` replies: ``n - cut`` finished with the given mean length, ``cut`` cut at ``cut_len``."""
    return ArmStats(completions=n, completion_tokens=round((n - cut) * finished_mean) + cut * cut_len,
                    truncated=cut, truncated_tokens=cut * cut_len, no_answer=no_answer)


def test_the_first_version_is_compared_through_the_stables_window():
    """Seed 1's case (docs/experiments.md run I): 12 completions into its canary, the
    candidate's finished replies averaged 9.4 tokens against the first version's 17.8 over its
    whole life (0.53: rolled back), while its whole canary averaged 24. Short replies finish
    first, so a window's first completions are short for both arms: the stable's were 11.0
    in the same window against 18.3 over its life. Through the stable the first version is
    17.8 * 11.0 / 18.3 = 10.7 tokens in this window and the ratio 0.88 passes. Drift that
    compounds (stable 0.7x the first over its life, candidate 0.7x the stable) still fails."""
    cfg = AnalysisConfig(min_votes=20, delta=0.3, failure_limit=1, min_guard_completions=10)
    cand, st_win = _arm(12, 9.4), _arm(14, 11.0)
    first, st_all = _arm(330, 17.8, cut=52), _arm(257, 18.3, cut=46)
    direct = {m.name: m for m in analyze(cand, st_win, cfg, first=first).metrics}["completion_length_vs_first"]
    assert direct.check == Check.FAIL and direct.numbers["ratio"] == pytest.approx(9.4 / 17.8, rel=5e-3)
    d = analyze(cand, st_win, cfg, first=first, stable_all=st_all)
    m = {x.name: x for x in d.metrics}["completion_length_vs_first"]
    assert m.check == Check.PASS and m.numbers["bridged"] is True
    assert m.numbers["ratio"] == pytest.approx((9.4 / 11.0) * (18.3 / 17.8), rel=5e-3)
    assert "through the stable's window" in m.reason
    # compounding drift: the stable is 0.7x the first over its life, the candidate 0.7x the stable
    d = analyze(_arm(40, 0.7 * 12.6), _arm(40, 12.6), cfg, first=_arm(300, 18.0), stable_all=_arm(300, 12.6))
    m = {x.name: x for x in d.metrics}
    assert m["completion_length"].check == Check.PASS  # 0.70 against the stable alone
    assert m["completion_length_vs_first"].check == Check.FAIL
    assert m["completion_length_vs_first"].numbers["ratio"] == pytest.approx(0.49, abs=0.01)
    # shares move the same way: the first version 0.05 no-answer, the stable 0.10 over its
    # life and 0.10 in the window, the candidate 0.25: +0.20 against the first, over 0.15
    # (the absolute limits alone here: max_share_ratio inf)
    absolute = AnalysisConfig(min_votes=20, delta=0.3, failure_limit=1, min_guard_completions=10,
                              max_share_ratio=math.inf)
    d = analyze(_arm(40, 15, no_answer=10), _arm(40, 15, no_answer=4), absolute,
                first=_arm(200, 15, no_answer=10), stable_all=_arm(200, 15, no_answer=20))
    m = {x.name: x for x in d.metrics}
    assert m["no_answer"].check == Check.PASS  # +0.15 against the stable in the window: not over 0.15
    assert m["no_answer_vs_first"].check == Check.FAIL
    assert m["no_answer_vs_first"].numbers["baseline_share"] == pytest.approx(0.05)
    # a bridge that would take the first version's share below 0 is clipped at 0
    d = analyze(_arm(40, 15, no_answer=2), _arm(40, 15, no_answer=0), absolute,
                first=_arm(200, 15, no_answer=2), stable_all=_arm(200, 15, no_answer=60))
    m = {x.name: x for x in d.metrics}
    assert m["no_answer_vs_first"].numbers["baseline_share"] == 0.0  # 0.01 + 0 - 0.30, clipped


def test_a_share_that_more_than_doubles_fails_at_a_low_base_rate():
    """Run O's v000001 (docs/experiments.md, D64): in its canary's window 10 of 95 replies had
    no answer against the stable's 3 of 105 (+0.076, under the absolute limit 0.15); over its
    whole life it had 29/303 against v000000's 17/368. The relative rule fails it: 0.105 is more
    than 2x 0.029, +0.076 is over the 0.05 floor, and Newcombe's 95 % interval of the increase
    is above 0 (lower bound +0.0065, computed by deploy.stats.newcombe_interval and by hand
    below). Run S's first canary (3/50 against 0/50 in the first minutes): 6x and +0.06, but
    the increase is not shown ([-0.021, +0.162]), so it passes. The same +0.076 at a 0.30 base
    rate passes (ratio 1.25), and 1/100 -> 5/100 (5x, +0.04) passes on the floor."""
    cfg = AnalysisConfig(min_votes=20, delta=0.3, failure_limit=1, min_guard_completions=10)
    m = {x.name: x for x in analyze(_arm(95, 20, no_answer=10), _arm(105, 20, no_answer=3), cfg).metrics}
    assert m["no_answer"].check == Check.FAIL
    assert "more than 2x" in m["no_answer"].reason and "+0.08 > 0.05" in m["no_answer"].reason
    assert m["no_answer"].numbers["candidate_share"] == pytest.approx(10 / 95)
    # Newcombe method 10 by hand: Wilson bounds of each share, then the hybrid lower bound
    def wilson(x, n, z=1.959963984540054):
        p = x / n
        c, h = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return c - h, c + h
    (l1, _), (_, u2) = wilson(10, 95), wilson(3, 105)
    lo = 10 / 95 - 3 / 105 - math.sqrt((10 / 95 - l1) ** 2 + (u2 - 3 / 105) ** 2)
    assert m["no_answer"].numbers["increase_ci95_lo"] == pytest.approx(lo) and lo > 0
    assert m["no_answer"].check == Check.FAIL
    m = {x.name: x for x in analyze(_arm(50, 20, no_answer=3), _arm(50, 20, no_answer=0), cfg).metrics}
    assert m["no_answer"].check == Check.PASS  # 0 -> 0.06: more than 2x and +0.06, not shown at 95 %
    m = {x.name: x for x in analyze(_arm(100, 20, no_answer=38), _arm(100, 20, no_answer=30), cfg).metrics}
    assert m["no_answer"].check == Check.PASS
    m = {x.name: x for x in analyze(_arm(100, 20, no_answer=5), _arm(100, 20, no_answer=1), cfg).metrics}
    assert m["no_answer"].check == Check.PASS
    m = {x.name: x for x in analyze(_arm(300, 20, cut=36), _arm(300, 20, cut=15), cfg).metrics}
    assert m["truncated"].check == Check.FAIL  # 0.12 vs 0.05 over 300 each: 2.4x, +0.07, shown
    with pytest.raises(ValueError, match="max_share_ratio"):
        AnalysisConfig(max_share_ratio=0.5)


def test_never_decides_on_empty_data_whatever_the_threshold():
    for mv in (1, 5, 100):
        d = analyze(ArmStats(), ArmStats(), AnalysisConfig(min_votes=mv))
        assert d.outcome == Outcome.HOLD and d.inconclusive


@pytest.mark.parametrize("kwargs,field", [({"votes_up": -1}, "votes_up"), ({"errors": 3, "requests": 1}, "errors"),
                                          ({"p99_ms": -5.0}, "p99_ms"), ({"votes_down": 1.5}, "votes_down")])
def test_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ArmStats(**kwargs)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="alpha"):
        AnalysisConfig(alpha=1.5)
    with pytest.raises(ValueError, match="min_votes"):
        AnalysisConfig(min_votes=0)
    with pytest.raises(ValueError, match="delta"):
        AnalysisConfig(delta=float("nan"))
    with pytest.raises(ValueError, match="max_p99_ratio"):
        AnalysisConfig(max_p99_ratio=float("inf"))


def test_config_docstrings_name_every_field():
    import dataclasses

    from deploy.controller import ControllerConfig

    from schemas.options import model_fields

    for cls in (AnalysisConfig, ArmStats, ControllerConfig):
        helps = {k: v.description for k, v in model_fields(cls).items()} if hasattr(cls, "__pydantic_fields__") else {}
        for f in dataclasses.fields(cls):  # a config model's field is documented by its help (Field description)
            assert helps.get(f.name) or f"{f.name}" in cls.__doc__, f"{cls.__name__}.{f.name} is not documented"


def test_latency_and_tokens_need_min_requests_per_arm():
    """A p99 over 6 requests is their max: too few to roll back on."""
    cfg = AnalysisConfig(min_votes=5, min_requests=20)
    few_c = ArmStats(votes_up=10, votes_down=10, errors=0, requests=6, p99_ms=3000.0, tokens_per_s=2.0)
    few_s = ArmStats(votes_up=10, votes_down=10, errors=0, requests=6, p99_ms=1000.0, tokens_per_s=8.0)
    d = analyze(few_c, few_s, cfg)
    lat = next(m for m in d.metrics if m.name == "p99_latency")
    tps = next(m for m in d.metrics if m.name == "tokens_per_s")
    assert lat.check == Check.INCONCLUSIVE and tps.check == Check.INCONCLUSIVE
    assert d.outcome != Outcome.ROLLBACK
    many_c = ArmStats(votes_up=10, votes_down=10, errors=0, requests=20, p99_ms=3000.0, tokens_per_s=8.0)
    many_s = ArmStats(votes_up=10, votes_down=10, errors=0, requests=20, p99_ms=1000.0, tokens_per_s=8.0)
    d = analyze(many_c, many_s, AnalysisConfig(min_votes=5, min_requests=20, failure_limit=1))
    assert d.outcome == Outcome.ROLLBACK and "ratio 3.00 > 1.5" in d.reason


def test_user_history_covariate_hand_values(tmp_path):
    """The controller's CUPED covariate from Parquet shards: each user's pre-canary rate,
    shrunk toward the window's pooled rate by 2 pseudo-votes (deploy.history docstring)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from deploy.history import user_history_covariate

    rows = [  # (version, created_at ms, user, up, down)
        ("v0", 500, "B", 5, 0),  # before the 9 s lookback window: not counted
        ("v0", 2000, "A", 2, 0), ("v0", 3000, "A", 1, 1), ("v0", 4000, "B", 0, 4),  # history: A 3/4, B 0/4
        ("v1", 10_000, "A", 1, 1), ("v1", 11_000, "C", 1, 0),  # canary (since 10 s); C has no history
        ("v0", 10_500, "B", 0, 2), ("v0", 12_000, "A", 1, 0),
    ]
    d = tmp_path / "samples" / "date=2026-01-01" / "hour=00"
    d.mkdir(parents=True)
    pq.write_table(pa.table({
        "model_version": [r[0] for r in rows], "created_at": pa.array([r[1] for r in rows], pa.timestamp("ms", "UTC")),
        "user_hash": [r[2] for r in rows], "votes_up": pa.array([r[3] for r in rows], pa.int32()),
        "votes_down": pa.array([r[4] for r in rows], pa.int32())}), d / "part-0.parquet")
    got = user_history_covariate(tmp_path / "samples", 10_000, ("v1", "v0"), lookback_ms=9000, prior_votes=2.0)
    # p0 = 3/8; x_A = (3 + 0.75)/6 = 0.625, x_B = 0.75/6 = 0.125, x_C = p0 = 0.375
    # v1: A (n 2, up 1), C (n 1, up 1): x_sum 1.625, xx_sum 2*0.390625 + 0.140625, xy_sum 0.625 + 0.375
    # v0: B (n 2, up 0), A (n 1, up 1): x_sum 0.875, xx_sum 2*0.015625 + 0.390625, xy_sum 0.625
    assert got["v1"] == pytest.approx({"x_sum": 1.625, "xx_sum": 0.921875, "xy_sum": 1.0})
    assert got["v0"] == pytest.approx({"x_sum": 0.875, "xx_sum": 0.421875, "xy_sum": 0.625})
    assert user_history_covariate(tmp_path / "samples", 1000, ("v0",), lookback_ms=400) == {}  # no history


def test_repetition_measure_hand_values():
    from deploy.replies import is_repetitive, seq_rep_n

    # 1 2 3 4 1 2 3 4 1 2: 4-grams (1234)(2341)(3412)(4123)(1234)(2341)(3412): 4 unique of 7
    assert seq_rep_n([1, 2, 3, 4, 1, 2, 3, 4, 1, 2]) == pytest.approx(1 - 4 / 7)
    assert seq_rep_n([1, 2, 3]) == 0.0 and seq_rep_n(list(range(20))) == 0.0
    assert is_repetitive([5] * 8) and not is_repetitive([5] * 7)  # too short to call
    assert not is_repetitive([1, 2, 3, 4, 1, 2, 3, 4, 1, 2])  # 0.43 <= 0.5


def test_guards_see_shorter_replies_and_drift_from_the_first_version():
    cfg = AnalysisConfig(min_votes=20, delta=0.3, failure_limit=1, min_guard_completions=20)
    stable = ArmStats(90, 110, completions=200, completion_tokens=200 * 40)
    short = ArmStats(90, 110, completions=200, completion_tokens=200 * 20)  # half the length
    d = analyze(short, stable, cfg)
    assert d.outcome == Outcome.ROLLBACK and d.decided_by == "guard" and "ratio 0.50 < 0.67" in d.reason
    # each version 1.3x its parent passes against the stable, but not against the first version
    first = ArmStats(completions=500, completion_tokens=500 * 40)
    parent = ArmStats(90, 110, completions=200, completion_tokens=200 * 52)
    child = ArmStats(90, 110, completions=200, completion_tokens=200 * 68)
    assert analyze(child, parent, cfg).outcome == Outcome.PROMOTE
    d = analyze(child, parent, cfg, first=first)
    checks = {m.name: m.check for m in d.metrics}
    assert d.outcome == Outcome.ROLLBACK and d.decided_by == "guard"
    assert checks["completion_length"] == Check.PASS and checks["completion_length_vs_first"] == Check.FAIL
    assert "ratio 1.70 > 1.5" in d.reason and "first version" in d.reason


def test_a_candidate_gaming_the_verifier_by_format_fails_a_guard():
    """A candidate that learned the verifier's format, not the task: every reply ends in a
    number (has_answer is true), as a bare guess or padded with a repeated number. Counted
    over every served completion by deploy.replies with the workload's own judge, it fails
    the shorter-reply guard and the repetition guard while its thumbs-up rate looks equal."""
    from deploy.replies import ServedCompletions
    from flywheel.workload import WorkloadReplyJudge

    def enc(text):
        return [ord(ch) for ch in text]

    served = ServedCompletions("unused:0", judge=WorkloadReplyJudge(lambda ids: "".join(chr(i) for i in ids)))
    prompt = enc("What is 3 + 4? Reply with the answer as a number.")
    t = 1_000_000

    def serve(version, reply, finish="stop"):
        served.add({"model_version": version, "created_at": t, "prompt_token_ids": prompt,
                    "completion_token_ids": enc(reply), "finish_reason": finish})

    for i in range(40):  # the stable reasons, and sometimes says no number
        serve("v000001", "Let me add them: 3 plus 4 makes 7, so the answer is 7." if i % 4 else "I am not sure.")
        serve("v000002", "7" if i % 2 else "answer 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7 7")
        serve("v000000", "Three plus four: that is 7, the answer is 7.")
    g = served.counts(t - 1, ("v000001", "v000002"))
    assert g["v000001"]["no_answer"] == 10 and g["v000002"]["no_answer"] == 0  # the format is right
    assert g["v000002"]["repetitive"] == 20 and g["v000001"]["repetitive"] == 0
    cfg = AnalysisConfig(min_votes=20, delta=0.3, failure_limit=1, min_guard_completions=20)
    first = ArmStats(**served.counts(0, ("v000000",))["v000000"])
    d = analyze(ArmStats(60, 40, **g["v000002"]), ArmStats(60, 40, **g["v000001"]), cfg, first=first)
    checks = {m.name: m.check for m in d.metrics}
    assert checks["thumbs_up"] == Check.PASS
    assert d.outcome == Outcome.ROLLBACK and d.decided_by == "guard"
    assert checks["completion_length"] == Check.FAIL and checks["repetitive"] == Check.FAIL
    assert checks["completion_length_vs_first"] == Check.FAIL and checks["repetitive_vs_first"] == Check.FAIL
    assert served.counts(t + 1000) == {}  # nothing served from the next second on


def test_served_completions_reads_every_completion_from_the_topic(broker):
    """The completions topic of a real broker, read from its start: every record counted
    once per version (voted or not), a record that does not parse skipped, and the
    ``since_ms`` filter to the second."""
    import json
    import time

    from kafka import KafkaProducer

    from deploy.replies import ServedCompletions, load_judge

    topic = "flywheel.completions"
    prod = KafkaProducer(bootstrap_servers=broker.bootstrap)
    recs = [("v1", 5_000, [1, 2, 3], "stop"), ("v1", 5_999, [], "stop"), ("v1", 7_000, [4] * 10, "length"),
            ("v0", 6_500, [9, 9], "stop")]
    for v, ms, toks, fin in recs:
        prod.send(topic, json.dumps({"model_version": v, "created_at": ms, "prompt_token_ids": [1],
                                     "completion_token_ids": toks, "finish_reason": fin}).encode())
    prod.send(topic, b"not json")
    prod.flush()
    prod.close()
    served = ServedCompletions(broker.bootstrap, topic=topic).start()
    try:
        deadline = time.monotonic() + 20
        while served.records + served.skipped < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        served.stop()
    assert served.records == 4 and served.skipped == 1
    assert served.counts(0) == {
        "v1": {"completions": 3, "completion_tokens": 13, "no_answer": 1, "truncated": 1, "repetitive": 1,
               "truncated_tokens": 10},
        "v0": {"completions": 1, "completion_tokens": 2, "no_answer": 0, "truncated": 0, "repetitive": 0,
               "truncated_tokens": 0}}
    # since 5.5 s: whole seconds from 6 s on
    assert served.counts(5_500) == {
        "v1": {"completions": 1, "completion_tokens": 10, "no_answer": 0, "truncated": 1, "repetitive": 1,
               "truncated_tokens": 10},
        "v0": {"completions": 1, "completion_tokens": 2, "no_answer": 0, "truncated": 0, "repetitive": 0,
               "truncated_tokens": 0}}
    with pytest.raises(ValueError, match="module:attribute"):
        load_judge("flywheel.workload")
    with pytest.raises(ValueError, match="cannot load"):
        load_judge("flywheel.workload:nothing_here")
