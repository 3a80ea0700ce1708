"""bench/canary.py's simulation, run small: the sequential rule keeps its error rates under
continuous looks, the repeated z-test does not (issue 10 item 2). Deterministic (seeded)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import canary  # noqa: E402

from deploy.analysis import AnalysisConfig, ArmStats, Check, check_thumbs  # noqa: E402


def test_bench_rule_is_the_analysis_rule():
    """The vectorised rule the bench simulates decides exactly as check_thumbs does."""
    cfg = canary.SimConfig(delta=0.1, alpha=0.05, min_votes=10)
    acfg = AnalysisConfig(min_votes=10, alpha=0.05, delta=0.1)
    rng = np.random.default_rng(0)
    nc, ns = rng.integers(1, 400, 300).astype(float), rng.integers(1, 400, 300).astype(float)
    uc, us = np.floor(nc * rng.random(300)), np.floor(ns * rng.random(300))
    ok, bad = canary.rule_sequential(uc, nc, us, ns, cfg)
    for i in range(300):
        m = check_thumbs(ArmStats(int(uc[i]), int(nc[i] - uc[i])), ArmStats(int(us[i]), int(ns[i] - us[i])), acfg)
        assert (m.check == Check.PASS, m.check == Check.FAIL) == (bool(ok[i]), bool(bad[i])), (i, m.reason)


def test_error_rates_under_continuous_looks():
    cfg = canary.SimConfig()
    r = canary.run(cfg, 2000, 0.4, seed=0)
    seq, cur = r["sequential"], r["current_rule"]
    # new rule: targets hold with their Wilson upper bound (2,000 canaries per case)
    assert seq["aa"]["rollback_by_test"]["ci95"][1] <= cfg.alpha
    assert seq["worse_2delta"]["promote"]["ci95"][1] <= 0.05
    assert seq["better_delta"]["promote"]["rate"] >= 0.8
    # today's rule, looked at after every vote: both error rates far above their targets
    assert cur["aa"]["rollback_by_test"]["ci95"][0] > cfg.alpha
    assert cur["worse_2delta"]["promote"]["ci95"][0] > 0.05


def test_bench_prints_result_lines_last():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "canary.py"), "--quick", "--canaries", "500"],
                         capture_output=True, text=True, timeout=120, check=True).stdout.strip().splitlines()
    names = [ln.split("=")[0] for ln in out[-8:]]
    assert names == ["RESULT canary_false_rollback_rate", "RESULT canary_false_promotion_rate",
                     "RESULT canary_promotion_rate_better", "RESULT canary_median_votes_to_decision",
                     "RESULT canary_false_rollback_rate_current_rule", "RESULT canary_false_promotion_rate_current_rule",
                     "RESULT canary_promotion_rate_better_current_rule",
                     "RESULT canary_median_votes_to_decision_current_rule"]
