"""Canary analysis: table tests against hand-computed statistics."""

from __future__ import annotations

import math

import pytest

from deploy.analysis import (AnalysisConfig, ArmStats, Check, Outcome, analyze, two_proportion_z,
                             wilson_interval)


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


CFG = AnalysisConfig(min_votes=20, alpha=0.05, min_requests=20)

# (name, candidate, stable, source_error, outcome, inconclusive, error, worst metric)
TABLE = [
    ("empty data holds", ArmStats(), ArmStats(), None, Outcome.HOLD, True, False, "thumbs_up"),
    ("too few candidate votes", ArmStats(5, 4), ArmStats(50, 50), None, Outcome.HOLD, True, False, "thumbs_up"),
    ("clearly worse rolls back", ArmStats(30, 70), ArmStats(45, 55), None, Outcome.ROLLBACK, False, False, "thumbs_up"),
    ("equal promotes", ArmStats(45, 55), ArmStats(45, 55), None, Outcome.PROMOTE, False, False, None),
    ("better promotes", ArmStats(60, 40), ArmStats(45, 55), None, Outcome.PROMOTE, False, False, None),
    # 38/100 vs 45/100: z = -0.07/sqrt(.415*.585*.02) = -1.0046, p = 0.1576 > 0.05: not worse
    ("slightly worse, not significant", ArmStats(38, 62), ArmStats(45, 55), None, Outcome.PROMOTE, False, False, None),
    ("latency fails, worst wins", ArmStats(45, 55, p99_ms=900.0), ArmStats(45, 55, p99_ms=400.0), None,
     Outcome.ROLLBACK, False, False, "p99_latency"),
    ("throughput fails", ArmStats(45, 55, tokens_per_s=5.0), ArmStats(45, 55, tokens_per_s=17.0), None,
     Outcome.ROLLBACK, False, False, "tokens_per_s"),
    ("error rate fails", ArmStats(45, 55, errors=10, requests=100), ArmStats(45, 55, errors=1, requests=100), None,
     Outcome.ROLLBACK, False, False, "error_rate"),
    ("error rate within bound", ArmStats(45, 55, errors=2, requests=100), ArmStats(45, 55, errors=1, requests=100),
     None, Outcome.PROMOTE, False, False, None),
    ("NaN latency is an error, not inconclusive", ArmStats(45, 55, p99_ms=float("nan")), ArmStats(45, 55, p99_ms=1.0),
     None, Outcome.HOLD, False, True, "p99_latency"),
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


def test_rollback_reason_carries_the_numbers():
    d = analyze(ArmStats(30, 70), ArmStats(45, 55), CFG)
    n = d.numbers()["thumbs_up"]
    assert n["check"] == "FAIL"
    assert n["z"] == pytest.approx(-0.15 / math.sqrt(0.375 * 0.625 * 0.02))
    assert n["candidate_rate"] == 0.30 and n["stable_rate"] == 0.45
    assert "z=-2.19" in d.reason and "p=0.0142" in d.reason


def test_slightly_worse_p_value_by_hand():
    d = analyze(ArmStats(38, 62), ArmStats(45, 55), CFG)
    n = d.numbers()["thumbs_up"]
    # pooled 83/200 = 0.415; z = -0.07 / sqrt(0.415*0.585*0.02) = -1.00457; Phi(-1.00457) = 0.15756
    assert n["z"] == pytest.approx(-1.00457, abs=1e-4)
    assert n["p_value"] == pytest.approx(0.15756, abs=2e-4)


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


def test_config_docstrings_name_every_field():
    import dataclasses

    from deploy.controller import ControllerConfig

    for cls in (AnalysisConfig, ArmStats, ControllerConfig):
        for f in dataclasses.fields(cls):
            assert f"{f.name}" in cls.__doc__, f"{cls.__name__}.{f.name} is not documented"


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
    d = analyze(many_c, many_s, cfg)
    assert d.outcome == Outcome.ROLLBACK and "ratio 3.00 > 1.5" in d.reason
