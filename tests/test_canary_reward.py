"""The canary judges the reward the learner trains on and guards each feedback signal.

The empirical-Bernstein confidence sequence (``deploy.stats.eb_boundary``,
``eb_mean_bounds``) against hand-worked values and a brute-force bisection of its defining
equation written here; the reward test's and each signal guard's decision on hand-built
windows; thumbs-only evidence (shards written before the reward policy) deciding as before;
the controller's one query reading shards with and without the reward columns together.
"""

from __future__ import annotations

import math
from dataclasses import replace
import uuid
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from deploy.analysis import AnalysisConfig, ArmStats, Check, Outcome, analyze, check_reward, reward_bounds
from deploy.controller import judged_policy
from samplestore.votes import canary_counts
from deploy.stats import EB_GRID, eb_boundary, eb_mean_bounds, psi_e
from schemas.arrow import samples_to_table
from schemas.events import RewardedSample, SamplingParams

CFG = AnalysisConfig(min_votes=10, delta=0.2, reward_delta=0.2, failure_limit=1, reward_clip=1.0)


def mixture_root(v: float, alpha: float, c: float, grid=EB_GRID) -> float:
    """Independent reference: the S at which mean_k exp(l_k S - psi_k V) = 1/alpha, by plain
    bisection with the math module (psi_E,c(l) = (-log(1 - c l) - c l) / c^2)."""
    lams = [g / c for g in grid]
    psis = [(-math.log(1 - c * lam) - c * lam) / (c * c) for lam in lams]

    def m(s: float) -> float:
        return sum(math.exp(lam * s - p * v) for lam, p in zip(lams, psis)) / len(lams)

    lo, hi = 0.0, 1.0
    while m(hi) < 1 / alpha:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if m(mid) < 1 / alpha else (lo, mid)
    return hi


def test_eb_boundary_one_rate_by_hand():
    # one rate l = 0.5 / c with c = 2 (rewards in [-1, 1]): l = 0.25,
    # psi = (-ln(0.5) - 0.5) / 4 = (0.6931472 - 0.5) / 4 = 0.0482868;
    # exp(l u - psi V) = 1 / alpha  =>  u = (ln(1 / 0.05) + psi V) / l
    # V = 2.25: u = (2.9957323 + 0.1086453) / 0.25 = 12.4175104
    assert psi_e(0.25, 2.0) == pytest.approx(0.0482868, abs=1e-7)
    assert float(eb_boundary(2.25, 0.05, 2.0, grid=(0.5,))) == pytest.approx(12.4175104, abs=1e-6)
    # V = 0: u = ln(20) / 0.25 = 11.9829291
    assert float(eb_boundary(0.0, 0.05, 2.0, grid=(0.5,))) == pytest.approx(11.9829291, abs=1e-6)


@pytest.mark.parametrize("v,alpha,c", [(0.0, 0.05, 2.0), (3.5, 0.0125, 2.0), (160.0, 0.025, 2.0),
                                       (4000.0, 0.0125, 1.0), (2.5e5, 0.05, 1.0)])
def test_eb_boundary_matches_a_brute_force_of_its_equation(v, alpha, c):
    u = float(eb_boundary(v, alpha, c))
    ref = mixture_root(v, alpha, c)
    assert u == pytest.approx(ref, rel=1e-9)
    assert u >= ref * (1 - 1e-12)  # Newton from above: never narrower than exact


def test_eb_mean_bounds_hand_case_and_clipping():
    # 400 rewards in [-1, 1], sum 100 (mean 0.25), sum of squares 160; center 0: V = 160.
    # Two-sided alpha 0.05 -> alpha / 2 per side: u = root of the mixture at V = 160, 0.025.
    u = mixture_root(160.0, 0.025, 2.0)
    mean, lo, hi = eb_mean_bounds(400, 100.0, 160.0, -1.0, 1.0, 0.05, center=0.0)
    assert float(mean) == 0.25
    assert float(lo) == pytest.approx((100 - u) / 400, rel=1e-9) and float(hi) == pytest.approx((100 + u) / 400)
    # center 0.25 instead: V = 160 - 2 * 0.25 * 100 + 400 * 0.0625 = 135: narrower
    _, lo2, hi2 = eb_mean_bounds(400, 100.0, 160.0, -1.0, 1.0, 0.05, center=0.25)
    assert float(hi2) == pytest.approx((100 + mixture_root(135.0, 0.025, 2.0)) / 400, rel=1e-9)
    assert hi2 - lo2 < hi - lo
    # few observations: clipped to the bounds; none: the whole range
    assert eb_mean_bounds(3, 3.0, 3.0, 0.0, 1.0, 0.05)[1:] == (pytest.approx(0.0), pytest.approx(1.0))
    m0, lo0, hi0 = eb_mean_bounds(0, 0.0, 0.0, -1.0, 1.0, 0.05)
    assert math.isnan(float(m0)) and (float(lo0), float(hi0)) == (-1.0, 1.0)


def test_eb_bounds_hold_at_every_look():
    """Coverage at every look at once, not at one: 400 streams of 3,000 rewards in
    {-1, -0.5, 0.5, 1}, looked at every 10; the share of streams whose bounds ever exclude the
    true mean is at most alpha (seeded)."""
    rng = np.random.default_rng(7)
    vals, p = np.array([-1.0, -0.5, 0.5, 1.0]), np.array([0.2, 0.2, 0.3, 0.3])
    mu = float(vals @ p)
    x = rng.choice(vals, size=(400, 3000), p=p)
    s1, s2 = np.cumsum(x, 1)[:, 9::10], np.cumsum(x * x, 1)[:, 9::10]
    n = np.arange(10, 3001, 10)[None, :]
    _, lo, hi = eb_mean_bounds(n, s1, s2, -1.0, 1.0, 0.05)
    ever_out = ((lo > mu) | (hi < mu)).any(1).mean()
    assert ever_out <= 0.05


def arm(n: int, mean: float, sd: float, regenerated: int = 0, dissatisfied: int = 0, copied: int = 0,
        up: int = 0, down: int = 0, **kw) -> ArmStats:
    """An arm of ``n`` rewarded samples with the given mean and standard deviation."""
    return ArmStats(votes_up=up, votes_down=down, rewarded=n, reward_sum=mean * n,
                    reward_sq_sum=(sd * sd + mean * mean) * n, reward_min=-1.0, reward_max=1.0,
                    regenerated=regenerated, dissatisfied=dissatisfied, copied=copied, **kw)


def test_reward_test_bounds_by_hand():
    c, s = arm(5000, 0.30, 0.5, 500, 500, 2000), arm(20000, 0.25, 0.5, 2000, 2000, 8000)
    rel, lo, hi, (lc, hc), (ls, hs) = (np.asarray(v, dtype=float) for v in reward_bounds(
        5000.0, c.reward_sum, c.reward_sq_sum, 20000.0, s.reward_sum, s.reward_sq_sum, CFG))
    # each arm: the mixture at alpha / 2 per arm (alpha / 4 per side), center 0
    uc = mixture_root(c.reward_sq_sum, 0.0125, 2.0)
    us = mixture_root(s.reward_sq_sum, 0.0125, 2.0)
    assert float(lc) == pytest.approx(0.30 - uc / 5000, rel=1e-9) and float(hs) == pytest.approx(0.25 + us / 20000)
    # relative to each stable bound's distance from the worst reward, -1
    assert float(rel) == pytest.approx(0.05 / 1.25)
    assert float(lo) == pytest.approx((float(lc) - float(hs)) / (float(hs) + 1))
    assert float(hi) == pytest.approx((float(hc) - float(ls)) / (float(ls) + 1))
    d = analyze(c, s, CFG)
    assert d.outcome == Outcome.PROMOTE, d.reason
    assert d.numbers()["reward"]["check"] == "PASS" and d.numbers()["thumbs_up"]["check"] == "SKIPPED"


def test_reward_test_clear_loss_rolls_back_and_equal_waits_when_few():
    d = analyze(arm(3000, 0.05, 0.6), arm(3000, 0.30, 0.6), CFG)
    assert d.outcome == Outcome.ROLLBACK and d.decided_by == "sequential_test"
    assert d.numbers()["reward"]["ci_hi"] < 0
    d = analyze(arm(300, 0.25, 0.6), arm(300, 0.25, 0.6), CFG)
    assert d.outcome == Outcome.HOLD and d.inconclusive
    assert analyze(arm(5, 0.25, 0.6), arm(500, 0.25, 0.6), CFG).numbers()["reward"]["check"] == "INCONCLUSIVE"


def test_reward_margin_is_relative_to_the_stables_distance_from_the_worst_reward():
    """The PASS bound is lc > hs - delta max(hs + clip, floor): a stable mean of -0.4 is 0.6
    above the worst reward -1, so the candidate may be lower by 0.12 (20 % of 0.6), not by 0.08
    (20 % of |-0.4|) nor 0.2. Surely worse still wins: -0.45 against -0.40 over 200,000
    samples each is a FAIL."""
    base = arm(200_000, -0.40, 0.5)
    r = analyze(arm(200_000, -0.45, 0.5), base, CFG).numbers()["reward"]
    assert r["ci_lo"] > -0.2 and r["ci_hi"] < 0 and r["check"] == "FAIL"
    assert r["diff"] == pytest.approx(-0.05 / 0.60)
    # -0.50: 0.10 below, inside the 0.12 margin (an |mean| reading, 0.08, would put it outside)
    assert analyze(arm(200_000, -0.50, 0.5), base, CFG).numbers()["reward"]["ci_lo"] > -0.2
    assert analyze(arm(200_000, -0.55, 0.5), base, CFG).numbers()["reward"]["ci_lo"] < -0.2
    near_worst = arm(200_000, -0.99, 0.05)  # 0.01 above the worst reward: the rule still holds there
    r = analyze(arm(200_000, -0.99, 0.05), near_worst, CFG).numbers()["reward"]
    (lc, _), (_, hs) = r["candidate_bounds"], r["stable_bounds"]
    assert r["ci_lo"] == pytest.approx((lc - hs) / (hs + 1), rel=1e-9)
    assert (r["check"] == "PASS") == (lc + 1 > 0.8 * (hs + 1))
    assert analyze(arm(200, 0.0, 0.5), arm(200, 0.0, 0.5), CFG).numbers()["reward"]["check"] == "INCONCLUSIVE"


def test_the_reward_test_decides_on_reward_delta_and_keeps_half_the_mean_out():
    """The reward test's margin is ``reward_delta`` (default 0.08), the thumbs-up test's is
    ``delta``. A candidate at +0.16 against +0.228, 2,000 samples each (sd 0.6), keeps 1.16 /
    1.228 = 0.945 of the stable's distance from the worst reward -1; its decision bounds
    (about [-0.139, +0.036]) pass a 0.2 margin whatever ``delta`` is and are undecided at 0.08.
    Worked by hand: a candidate at half a stable mean m keeps (m / 2 + 1) / (m + 1), outside
    the 0.08 margin exactly when m > 2 * 0.08 / (1 - 2 * 0.08) = 0.1905 (the bench's stable,
    +0.228, keeps 0.907 at half its mean)."""
    assert AnalysisConfig().reward_delta == 0.08 and AnalysisConfig().delta == 0.2
    c, s = arm(2_000, 0.16, 0.6), arm(2_000, 0.228, 0.6)
    wide = AnalysisConfig(min_votes=10, delta=0.05, reward_delta=0.2, failure_limit=1, reward_clip=1.0)
    r = check_reward(c, s, wide)
    assert r.numbers["diff"] == pytest.approx(1.16 / 1.228 - 1)
    assert -0.2 < r.numbers["ci_lo"] < -0.08 and r.numbers["ci_hi"] > 0, r.numbers
    assert r.check == Check.PASS and r.numbers["delta"] == 0.2
    r = check_reward(c, s, replace(wide, delta=0.5, reward_delta=0.08))
    assert r.check == Check.INCONCLUSIVE and "lower bound <= -8%" in r.reason and r.numbers["delta"] == 0.08
    for m, outside in ((0.18, False), (0.19, False), (0.191, True), (0.228, True), (0.5, True)):
        assert ((m / 2 + 1) / (m + 1) < 1 - 0.08) == outside, m
    assert (0.114 + 1) / (0.228 + 1) == pytest.approx(0.9072, abs=1e-4)
    with pytest.raises(ValueError, match="reward_delta"):
        AnalysisConfig(reward_delta=1.0)


@pytest.mark.parametrize("k_c,n_c,k_s,n_s", [(620, 1000, 3100, 5000), (130, 1000, 1000, 5000), (90, 600, 300, 3000),
                                           (9_000, 10**6, 10_000, 10**6), (10_000, 10**6, 10_000, 10**6)])
def test_a_thumbs_only_reward_is_judged_as_the_thumbs_up_rate(k_c, n_c, k_s, n_s):
    """Rewards of +-1 (a policy of thumbs alone): the decision bounds equal the relative rule
    on up-rates, ``rate_lo(c) / rate_hi(s) - 1``, with each rate's bounds computed here on
    0/1 observations in [0, 1] (the same confidence sequence, centered at 1/2: ``mean + 1 = 2
    rate`` maps one onto the other)."""
    def bounds(k, n):
        return eb_mean_bounds(float(n), float(k), float(k), 0.0, 1.0, CFG.alpha / 2, 0.5)[1:]
    (pc_lo, pc_hi), (ps_lo, ps_hi) = bounds(k_c, n_c), bounds(k_s, n_s)
    _, lo, hi, _, _ = reward_bounds(float(n_c), 2.0 * k_c - n_c, float(n_c), float(n_s), 2.0 * k_s - n_s,
                                    float(n_s), CFG)
    assert float(lo) == pytest.approx(pc_lo / ps_hi - 1, rel=1e-9, abs=1e-12)
    assert float(hi) == pytest.approx(pc_hi / ps_lo - 1, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("guard,cand", [
    ("regenerated", dict(regenerated=700)),
    ("dissatisfied", dict(dissatisfied=700)),
    ("copied", dict(copied=1500)),
])
def test_each_signal_guard_fails_a_worse_candidate(guard, cand):
    """Equal mean reward (the reward test passes), one signal worse: 700 vs 500 of 5,000
    (+40 %, regenerated or dissatisfied) or 1,500 vs 2,000 copied (-25 %): that guard FAILs."""
    base = dict(regenerated=500, dissatisfied=500, copied=2000)
    c = arm(5000, 0.25, 0.4, **{**base, **cand})
    s = arm(40000, 0.25, 0.4, **{k: 8 * v for k, v in base.items()})
    d = analyze(c, s, CFG)
    checks = {m.name: m.check for m in d.metrics}
    assert checks["reward"] == Check.PASS
    assert checks[guard] == Check.FAIL and d.outcome == Outcome.ROLLBACK and d.decided_by == "guard"
    assert [g for g in ("regenerated", "dissatisfied", "copied") if checks[g] == Check.FAIL] == [guard]
    # the same shares moved the other way (fewer regenerates, more copies) pass
    better = {k: 2 * base[k] - v for k, v in cand.items()}
    d2 = analyze(arm(5000, 0.25, 0.4, **{**base, **better}), s, CFG)
    assert d2.outcome == Outcome.PROMOTE, d2.reason


def test_signal_guard_bounds_by_hand():
    # copied 1500/5000 vs 16000/40000, shares on [0, 1] with center 0.5:
    # V = k - 2 * 0.5 * k + n * 0.25 = n / 4; each side at alpha / 4 (alpha / 2 per arm)
    d = analyze(arm(5000, 0.25, 0.4, copied=1500), arm(40000, 0.25, 0.4, copied=16000), CFG)
    m = next(x for x in d.metrics if x.name == "copied")
    hc = 0.3 + mixture_root(5000 / 4, 0.0125, 1.0) / 5000
    ls = 0.4 - mixture_root(40000 / 4, 0.0125, 1.0) / 40000
    assert m.numbers["candidate_bounds"][1] == pytest.approx(hc, rel=1e-9)
    assert m.numbers["baseline_bounds"][0] == pytest.approx(ls, rel=1e-9)
    assert hc < 0.9 * ls and ls - hc > 0.01 and m.check == Check.FAIL


def test_kept_share_guard_by_hand_fails_a_candidate_whose_edits_keep_less():
    """Kept share of edited replies, a mean of values in [0, 1] with center 0.5: candidate 2,000
    edits keeping 0.5 on average (each reply keeps 0.5: sum k^2 = 500), stable 8,000 keeping
    0.8 (each 0.8: sum k^2 = 5,120). V = sum k^2 - 2 * 0.5 * sum k + n / 4."""
    c = arm(4000, 0.25, 0.4, edited=2000, kept_sum=1000.0, kept_sq_sum=500.0)
    s = arm(16000, 0.25, 0.4, edited=8000, kept_sum=6400.0, kept_sq_sum=5120.0)
    d = analyze(c, s, CFG)
    m = next(x for x in d.metrics if x.name == "kept_share")
    vc = 500.0 - 1000.0 + 2000 / 4  # 0: every candidate reply keeps exactly the center
    vs = 5120.0 - 6400.0 + 8000 / 4
    hc = 0.5 + mixture_root(vc, 0.0125, 1.0) / 2000
    ls = 0.8 - mixture_root(vs, 0.0125, 1.0) / 8000
    assert m.numbers["candidate_bounds"][1] == pytest.approx(hc, rel=1e-9)
    assert m.numbers["baseline_bounds"][0] == pytest.approx(ls, rel=1e-9)
    assert hc < 0.9 * ls and m.check == Check.FAIL and d.outcome == Outcome.ROLLBACK and d.decided_by == "guard"
    # the same kept share on both arms passes; no edits on either arm: not measured
    same = analyze(arm(4000, 0.25, 0.4, edited=2000, kept_sum=1600.0, kept_sq_sum=1280.0), s, CFG)
    assert next(x for x in same.metrics if x.name == "kept_share").check == Check.PASS
    none = analyze(arm(4000, 0.25, 0.4), arm(16000, 0.25, 0.4), CFG)
    assert next(x for x in none.metrics if x.name == "kept_share").check == Check.SKIPPED
    # a kept share outside [0, 1] is refused, naming the field
    with pytest.raises(ValueError, match="kept_sum"):
        arm(10, 0.0, 0.1, edited=2, kept_sum=3.0)
    with pytest.raises(ValueError, match="kept_sq_sum"):
        arm(10, 0.0, 0.1, edited=2, kept_sum=1.0, kept_sq_sum=1.5)


def test_few_edits_never_hold_a_canary_the_reward_test_passed():
    """Edits are rare: with 3 against 5 edited samples (min_guard_completions 10) the kept-share
    guard is SKIPPED, so a candidate the reward test passes is promoted (it was held to the
    step deadline by an INCONCLUSIVE guard); with enough edits it still judges."""
    cfg = replace(CFG, min_guard_completions=10)
    c = arm(5000, 0.30, 0.5, edited=3, kept_sum=1.5, kept_sq_sum=0.75)
    s = arm(20000, 0.25, 0.5, edited=5, kept_sum=4.0, kept_sq_sum=3.2)
    d = analyze(c, s, cfg)
    kept = next(x for x in d.metrics if x.name == "kept_share")
    assert kept.check == Check.SKIPPED and "3 vs 5 edited samples" in kept.reason
    assert d.numbers()["reward"]["check"] == "PASS" and d.outcome == Outcome.PROMOTE, d.reason
    many = analyze(arm(5000, 0.30, 0.5, edited=2000, kept_sum=1000.0, kept_sq_sum=500.0),
                   arm(20000, 0.25, 0.5, edited=8000, kept_sum=6400.0, kept_sq_sum=5120.0), cfg)
    assert next(x for x in many.metrics if x.name == "kept_share").check == Check.FAIL


def test_thumbs_guard_and_the_failure_limit():
    """Under the reward test the thumbs-up rate is a guard: FAIL when shown worse by more than
    signal_margin; with failure_limit 3 it takes three failed looks in a row."""
    c, s = arm(4000, 0.25, 0.4, up=100, down=300), arm(4000, 0.25, 0.4, up=250, down=150)
    d = analyze(c, s, CFG)
    assert d.numbers()["thumbs_up"]["check"] == "FAIL" and d.decided_by == "guard"
    cfg3 = AnalysisConfig(min_votes=10, delta=0.2, reward_delta=0.2, failure_limit=3, reward_clip=1.0)
    counts: dict = {}
    for look in range(3):
        d = analyze(c, s, cfg3, failed_checks=counts)
        counts = d.failed_checks
        assert d.outcome == (Outcome.ROLLBACK if look == 2 else Outcome.HOLD)


def test_a_candidate_that_answers_less_is_caught():
    """Fewer regenerates and an equal mean reward, bought by refusing: copies fall 0.40 ->
    0.30 of samples: rolled back by the copied guard though the reward test passes."""
    s = arm(40000, 0.22, 0.6, regenerated=8000, dissatisfied=10000, copied=16000)
    c = arm(8000, 0.23, 0.6, regenerated=1200, dissatisfied=2000, copied=2400)
    d = analyze(c, s, CFG)
    checks = {m.name: m.check for m in d.metrics}
    assert checks["reward"] == Check.PASS and checks["regenerated"] == Check.PASS
    assert checks["copied"] == Check.FAIL and d.outcome == Outcome.ROLLBACK


def test_thumbs_only_evidence_decides_as_before():
    """No rewarded sample on either arm (shards written before the reward policy): the
    thumbs-up test decides, exactly as with quality = thumbs, and the signal guards skip."""
    for c, s in ((ArmStats(40, 160), ArmStats(90, 110)), (ArmStats(90, 110), ArmStats(90, 110)),
                 (ArmStats(30, 70), ArmStats(45, 55))):
        cfg = AnalysisConfig(min_votes=20, delta=0.3, failure_limit=1)
        d = analyze(c, s, cfg)
        d_thumbs = analyze(c, s, AnalysisConfig(min_votes=20, delta=0.3, failure_limit=1, quality="thumbs"))
        assert (d.outcome, d.reason, d.decided_by) == (d_thumbs.outcome, d_thumbs.reason, d_thumbs.decided_by)
        assert d.metrics[0].name == "thumbs_up"
        assert {m.name: m.check for m in d.metrics}["copied"] == Check.SKIPPED
    # quality = thumbs judges thumbs even when rewards are there
    d = analyze(arm(3000, 0.05, 0.6, up=90, down=110), arm(3000, 0.30, 0.6, up=90, down=110),
                AnalysisConfig(min_votes=20, delta=0.3, failure_limit=1, quality="thumbs", reward_clip=1.0))
    assert d.metrics[0].name == "thumbs_up" and "reward" not in d.numbers()


def test_bad_input_names_the_field():
    m = check_reward(arm(100, 0.2, 0.5, reward_policy="a" * 16),
                     ArmStats(rewarded=100, reward_sum=20.0, reward_sq_sum=30.0, reward_min=-1.0, reward_max=2.5,
                              reward_policy="a" * 16), CFG)
    assert m.check == Check.ERROR and "reward_clip" in m.reason
    m = check_reward(arm(100, 0.2, 0.5, reward_policy="a" * 16), arm(100, 0.2, 0.5, reward_policy="b" * 16), CFG)
    assert m.check == Check.ERROR and "different reward policies" in m.reason
    for kw, field in (({"quality": "votes"}, "quality"), ({"reward_clip": 0.0}, "reward_clip"),
                      ({"signal_margin": 1.0}, "signal_margin"),
                      ({"reward_center": float("nan")}, "reward_center")):
        with pytest.raises(ValueError, match=field):
            AnalysisConfig(**kw)
    with pytest.raises(ValueError, match="reward_center"):
        AnalysisConfig(reward_clip=1.0, reward_center=2.0).reward_bound
    with pytest.raises(ValueError, match="copied"):
        ArmStats(rewarded=3, copied=4)
    with pytest.raises(ValueError, match="reward_sum"):
        ArmStats(rewarded=3, reward_sum=float("inf"))


def test_reward_bound_defaults_to_the_policys_clip(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_REWARD__CLIP", "2.5")
    assert AnalysisConfig().reward_bound == 2.5
    monkeypatch.setenv("FLYWHEEL_REWARD__CLIP", "-1")
    m = check_reward(arm(100, 0.2, 0.5), arm(100, 0.2, 0.5), AnalysisConfig())
    assert m.check == Check.ERROR and "CLIP" in m.reason


# ------------------------------------------------------------------ the controller's query
B = 1_700_000_000_000  # ms


def write_samples(root: Path, version: str, created_at: int, rows: list[dict], old: bool = False) -> None:
    """One shard of samples; ``old`` drops the reward policy's columns (a format-3 shard)."""
    samples = []
    for i, r in enumerate(rows):
        thumb = r.get("thumb")
        samples.append(RewardedSample(
            completion_id=uuid.uuid4(), model_version=version, created_at=created_at, user_hash=f"u{i}",
            prompt_token_ids=[1, 2], completion_token_ids=[3, 4, 5], behavior_logprobs=[-0.5] * 3,
            sampling=SamplingParams(), finish_reason="stop", reward=r["reward"], label=r["reward"] > 0,
            n_votes=1, votes_up=int(thumb == 1.0), votes_down=int(thumb == -1.0), event_ids=[str(uuid.uuid4())],
            sealed_at=created_at, reward_policy=None if old else r.get("policy", "a" * 16), thumb=thumb,
            copied=r.get("copied", 0), regenerated=r.get("regenerated", 0), followup=r.get("followup"),
            kept_share=r.get("kept_share")))
    t = samples_to_table(samples)
    if old:
        t = t.drop_columns([c for c in ("reward_policy", "thumb", "copied", "regenerated", "kept_share", "followup",
                                        "scores") if c in t.column_names])
    d = root / f"model_version={version}" / "date=2026-11-30"
    d.mkdir(parents=True, exist_ok=True)
    pq.write_table(t, d / f"part-{uuid.uuid4().hex}.parquet")


def test_canary_counts_reads_reward_columns_beside_old_shards(tmp_path):
    root = tmp_path / "samples"
    write_samples(root, "v000000", B + 1000, [{"reward": 1.0, "thumb": 1.0}, {"reward": -1.0, "thumb": -1.0}],
                  old=True)
    write_samples(root, "v000000", B + 3000, [
        {"reward": 0.5, "copied": 1}, {"reward": -0.5, "regenerated": 2}, {"reward": -0.5, "followup": -1.0},
        {"reward": 1.0, "thumb": 1.0, "copied": 1}])
    write_samples(root, "v000001", B + 3000, [{"reward": 0.5, "copied": 1, "kept_share": 0.5},
                                              {"reward": 0.0, "followup": 0.0, "kept_share": 0.25}])
    write_samples(root, "v000001", B + 9000, [{"reward": -0.5, "regenerated": 1, "followup": -1.0}])
    write_samples(root, "v000001", B + 9000, [{"reward": 0.25, "policy": "b" * 16}])
    cc = canary_counts(root, B, B + 8000)
    # votes keep counting thumbs from old and new shards alike
    assert cc.votes == {"v000000": (2, 1, 6), "v000001": (0, 0, 4)}
    # v000000 under policy p: rewards 0.5, -0.5, -0.5, 1.0 -> sum 0.5, squares 1.75
    assert cc.rewards["v000000"] == {"a" * 16: {"rewarded": 4, "reward_sum": 0.5, "reward_sq_sum": 1.75,
                                                "reward_min": -0.5, "reward_max": 1.0, "regenerated": 1,
                                                "dissatisfied": 1, "copied": 2, "edited": 0, "kept_sum": 0.0,
                                                "kept_sq_sum": 0.0}}
    # v000001: kept shares 0.5 and 0.25 -> 2 edited, sum 0.75, squares 0.3125
    assert cc.rewards["v000001"]["a" * 16] == {"rewarded": 3, "reward_sum": 0.0, "reward_sq_sum": 0.5,
                                               "reward_min": -0.5, "reward_max": 0.5, "regenerated": 1,
                                               "dissatisfied": 1, "copied": 1, "edited": 2, "kept_sum": 0.75,
                                               "kept_sq_sum": 0.3125}
    assert cc.step_rewarded == {"v000001": {"a" * 16: 1, "b" * 16: 1}}
    assert judged_policy(cc, "v000001", "v000000") == "a" * 16
    # only old shards: no reward evidence at all, the votes as before
    old = tmp_path / "old"
    write_samples(old, "v000000", B + 1000, [{"reward": 1.0, "thumb": 1.0}], old=True)
    cc_old = canary_counts(old, B, B)
    assert cc_old.rewards == {} and cc_old.votes == {"v000000": (1, 0, 1)}
    assert judged_policy(cc_old, "v000001", "v000000") is None


@pytest.mark.parametrize("bad,field", [
    ({"reward_sum": 500.0, "reward_sq_sum": 2500.0, "reward_min": None, "reward_max": None}, "reward_sum"),
    ({"reward_sum": 10.0, "reward_sq_sum": 150.0}, "reward_sq_sum"),  # mean square 1.5 > clip^2
    ({"reward_sum": 60.0, "reward_sq_sum": 10.0}, "reward_sq_sum"),  # mean^2 0.36 > mean square 0.1
    ({"reward_sum": 90.0, "reward_sq_sum": 85.0, "reward_min": -1.0, "reward_max": -0.5}, "reward_min/reward_max"),
])
def test_sums_no_rewards_in_the_clip_can_have_are_an_error(bad, field):
    """An arm whose sums no rewards in [-clip, clip] can have (a mean outside the clip, a mean
    square above clip^2 or below the mean's square, a mean outside [min, max]) is an ERROR
    naming the field, never a decision on an inverted box."""
    c = ArmStats(**{**dict(votes_up=0, votes_down=0, rewarded=100, reward_min=-1.0, reward_max=1.0), **bad})
    d = analyze(c, arm(5000, 0.2, 0.5), CFG)
    r = d.numbers()["reward"]
    assert r["check"] == "ERROR" and d.outcome == Outcome.HOLD and d.error, d.reason
    assert f"candidate {field}:" in d.reason


def test_bench_keeps_half_the_good_replies_out_and_catches_abstention():
    """bench/canary.py's reward simulation, run small (seeded): a candidate with half the
    stable's good replies is not promoted, one that refuses on 30 % more prompts is rolled back."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import canary

    r = canary.run_reward(20, seed=3, which={"half_the_good_replies", "abstains"})
    assert r["half_the_good_replies"]["reward"]["promote"]["k"] == 0
    assert r["half_the_good_replies"]["mix"] == pytest.approx([0.30, 0.65, 0.05])
    assert r["abstains"]["reward"]["rollback"]["k"] == 20
    assert r["abstains"]["reward"]["by_guard"]["no_answer"] == 20  # 0.35 vs 0.05 of replies unanswered
