"""Canary decision rules under continuous monitoring: the sequential test vs today's z-test.

Simulates canaries exactly as :class:`deploy.controller.RolloutController` polls them: votes
arrive one at a time, each on the candidate with the current step's traffic share, and the
thumbs-up decision is checked after every new vote (``--every k``: every k votes). Per
canary and per rule:

* thumbs FAIL (roll back) as soon as the rule fails;
* a step advances when the rule passes and the step has ``min_votes_per_step`` new
  candidate votes (the controller's gate); passing the last step is a promotion;
* a step that reaches its deadline (``--step-deadline-votes`` votes) takes the configured
  deadline outcome (production default: roll back).

Rules, side by side on the SAME simulated vote streams:

* ``sequential`` (new): :func:`deploy.analysis.check_thumbs`'s rule: always-valid mSPRT
  interval of rate(candidate) - rate(stable) (``deploy.stats.msprt_bounds``, alpha, tau =
  delta); FAIL when hi < 0, PASS when lo > -delta, after ``min_votes`` per arm.
* ``current_rule`` (before issue 10): one-sided pooled z-test repeated at every look; FAIL
  when p < alpha, PASS as soon as each arm has 20 votes and p >= alpha.

Cases: A/A (equal rates), candidate worse by 2*delta, candidate better by delta. Figures:
false rollback rate on A/A, false promotion rate of the 2*delta-worse candidate, promotion
rate of the delta-better one, median votes to a decision; binomial 95 % Wilson intervals on
each rate. Run: ``python bench/canary.py [--quick] [--canaries N]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.stats import msprt_bounds, pooled_z, wilson_interval  # noqa: E402

PROMOTE, ROLLBACK, DEADLINE_ROLLBACK = 1, 2, 3


@dataclass
class SimConfig:
    """One simulated rollout policy (units: votes, rates in [0, 1])."""

    steps: tuple[float, ...] = (0.25, 0.5, 1.0)
    min_votes_per_step: int = 10
    step_deadline_votes: int = 600
    every: int = 1
    alpha: float = 0.05
    delta: float = 0.1
    min_votes: int = 10  # sequential rule's burn-in per arm
    current_min_votes: int = 20  # today's rule's min_votes


def rule_sequential(uc, nc, us, ns, cfg: SimConfig):
    """(pass, fail) boolean arrays of the sequential rule (same formula as the analysis)."""
    ok = (nc >= cfg.min_votes) & (ns >= cfg.min_votes)
    _, lo, hi = msprt_bounds(uc, np.maximum(nc, 1), us, np.maximum(ns, 1), cfg.alpha, cfg.delta)
    fail = ok & (hi < 0)
    return ok & (lo > -cfg.delta) & ~fail, fail


def rule_current(uc, nc, us, ns, cfg: SimConfig):
    """(pass, fail) of the pre-issue-10 rule: repeated one-sided z-test, PASS when not
    significantly worse once each arm has ``current_min_votes``."""
    ok = (nc >= cfg.current_min_votes) & (ns >= cfg.current_min_votes)
    z = pooled_z(uc, np.maximum(nc, 1), us, np.maximum(ns, 1))
    p = _phi(z)
    fail = ok & (p < cfg.alpha)
    return ok & ~fail, fail


_erfc = np.vectorize(math.erfc, otypes=[float])


def _phi(z):
    """Phi(z) on an array: the same formula as ``deploy.stats.normal_cdf``."""
    return 0.5 * _erfc(-z / math.sqrt(2.0))


def simulate(rule, p_stable: float, p_cand: float, n: int, cfg: SimConfig, seed: int):
    """Simulate ``n`` canaries in lockstep (one vote each per iteration).

    Returns ``(outcome, votes)`` int arrays: outcome PROMOTE / ROLLBACK / DEADLINE_ROLLBACK,
    votes = total votes seen when the decision was taken."""
    rng = np.random.default_rng(seed)
    uc = np.zeros(n); nc = np.zeros(n); us = np.zeros(n); ns = np.zeros(n)
    step = np.zeros(n, dtype=int)
    step_votes = np.zeros(n)  # candidate votes in the current step
    step_total = np.zeros(n)  # all votes in the current step (deadline)
    outcome = np.zeros(n, dtype=int)
    votes = np.zeros(n, dtype=int)
    weights = np.asarray(cfg.steps)
    t = 0
    while (outcome == 0).any():
        t += 1
        act = outcome == 0
        to_c = rng.random(n) < weights[np.minimum(step, len(weights) - 1)]
        up = rng.random(n) < np.where(to_c, p_cand, p_stable)
        c, s = act & to_c, act & ~to_c
        nc += c; uc += c & up; ns += s; us += s & up
        step_votes += c; step_total += act
        if t % cfg.every:
            continue
        ok, bad = rule(uc, nc, us, ns, cfg)
        roll = act & bad
        outcome[roll] = ROLLBACK
        votes[roll] = t
        adv = act & ~roll & ok & (step_votes >= cfg.min_votes_per_step)
        last = adv & (step == len(weights) - 1)
        outcome[last] = PROMOTE
        votes[last] = t
        nxt = adv & ~last
        step[nxt] += 1
        step_votes[nxt] = 0
        step_total[nxt] = 0
        dead = (outcome == 0) & (step_total >= cfg.step_deadline_votes)
        outcome[dead] = DEADLINE_ROLLBACK
        votes[dead] = t
    return outcome, votes


def rate(x: np.ndarray) -> dict:
    k, n = int(x.sum()), int(x.size)
    lo, hi = wilson_interval(k, n)
    return {"rate": k / n, "ci95": [lo, hi], "k": k, "n": n}


def run(cfg: SimConfig, n: int, p_stable: float, seed: int) -> dict:
    cases = {"aa": p_stable, "worse_2delta": p_stable - 2 * cfg.delta, "better_delta": p_stable + cfg.delta}
    out = {}
    for name, rule in (("sequential", rule_sequential), ("current_rule", rule_current)):
        res = {}
        for i, (case, pc) in enumerate(cases.items()):
            o, v = simulate(rule, p_stable, pc, n, cfg, seed + 1000 * i)  # same streams for both rules
            res[case] = {"promote": rate(o == PROMOTE), "rollback": rate((o == ROLLBACK) | (o == DEADLINE_ROLLBACK)),
                         "rollback_by_test": rate(o == ROLLBACK), "deadline": rate(o == DEADLINE_ROLLBACK),
                         "median_votes": float(np.median(v)), "p90_votes": float(np.percentile(v, 90))}
        out[name] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2,000 canaries per case, one base rate")
    ap.add_argument("--canaries", type=int, default=None, help="canaries per case (default 4000; --quick 2000)")
    ap.add_argument("--every", type=int, default=1, help="check after every k votes (default 1)")
    ap.add_argument("--delta", type=float, default=0.1, help="non-inferiority margin (rate units)")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = ap.parse_args()
    n = a.canaries or (2000 if a.quick else 4000)
    cfg = SimConfig(every=a.every, delta=a.delta, alpha=a.alpha)
    bases = (0.4,) if a.quick else (0.4, 0.25)
    t0 = time.time()
    allres = {}
    for p in bases:
        r = run(cfg, n, p, a.seed)
        allres[p] = r
        print(f"\nbase thumbs-up rate {p}: {n} canaries per case, steps {cfg.steps}, check every {cfg.every} vote(s), "
              f"delta {cfg.delta}, alpha {cfg.alpha}, step deadline {cfg.step_deadline_votes} votes -> roll back")
        print(f"{'rule':<14}{'case':<14}{'promote':>22}{'rollback':>22}{'deadline':>10}{'median votes':>14}")
        for rule, res in r.items():
            for case, x in res.items():
                pr, rb = x["promote"], x["rollback"]
                print(f"{rule:<14}{case:<14}{pr['rate']:>8.3f} [{pr['ci95'][0]:.3f},{pr['ci95'][1]:.3f}]"
                      f"{rb['rate']:>8.3f} [{rb['ci95'][0]:.3f},{rb['ci95'][1]:.3f}]{x['deadline']['rate']:>10.3f}"
                      f"{x['median_votes']:>14.0f}")
    print(f"\n({time.time() - t0:.1f} s)")
    if a.json:
        a.json.write_text(json.dumps({str(k): v for k, v in allres.items()}, indent=1))
    r = allres[bases[0]]
    for suffix, rule in (("", "sequential"), ("_current_rule", "current_rule")):
        x = r[rule]
        print(f"RESULT canary_false_rollback_rate{suffix}={x['aa']['rollback_by_test']['rate']:.4f} "
              f"target<={cfg.alpha} (A/A, rolled back by the test; base {bases[0]}, n={n})")
        print(f"RESULT canary_false_promotion_rate{suffix}={x['worse_2delta']['promote']['rate']:.4f} "
              f"target<=0.05 (candidate worse by 2*delta={2 * cfg.delta:g})")
        print(f"RESULT canary_promotion_rate_better{suffix}={x['better_delta']['promote']['rate']:.4f} "
              f"(candidate better by delta={cfg.delta:g})")
        med = float(np.median([x[c]['median_votes'] for c in x]))
        print(f"RESULT canary_median_votes_to_decision{suffix}={med:.0f} votes (median over the three cases of "
              f"each case's median)")


if __name__ == "__main__":
    main()
