"""Canary decisions under continuous looks, simulated on the controller's own code path.

Simulates canaries as :class:`deploy.controller.RolloutController` runs them: votes arrive
one at a time, each on the candidate with the current step's traffic share; every ``every``
votes (a controller poll) the thumbs-up test is evaluated with
:func:`deploy.analysis.thumbs_bounds` and :func:`deploy.analysis.thumbs_verdict` (the
functions :func:`deploy.analysis.check_thumbs` judges with, vectorised over canaries), and
the step logic of :func:`deploy.decide.decide_step` is applied:

* FAIL (upper bound < 0): roll back at once;
* PASS with ``min_votes_per_step`` new candidate votes in the step: advance, or promote after
  the last analysed share (the final 100 % is the promotion itself, D27);
* a step still undecided after ``step_deadline_votes`` votes: deadline outcome roll back.

Each vote comes from a user with their own thumbs-up propensity ``u ~ Beta`` (mean = the
stable's rate, concentration ``kappa``); the candidate multiplies it by its rate ratio. The
user's earlier thumbs-up rate over ``history`` votes before the canary is the CUPED
covariate. Rules, side by side on the SAME vote streams:

* ``relative``: the canary's test (relative margin, ``AnalysisConfig(cuped=False)``);
* ``relative_cuped``: the same with the users' history as CUPED covariate (issue 23 item 2);
* ``absolute``: the rule before issue 23: mSPRT on ``rate_c - rate_s`` with an absolute
  margin (``deploy.stats.msprt_bounds``, tau = margin), at the demo's 0.2 / production 0.1.

Settings (``SETTINGS``): the demo's (one analysed share of 50 %, 20-vote burn-in, ~450-vote
deadline, a look every vote: ``flywheel.demo.DemoConfig``) and production's (the controller's
defaults, ``deploy.controller.ControllerConfig``: shares 5/25/50 %, 10-vote burn-in, a
36,000-vote step deadline = the 3,600 s deadline at an assumed 10 votes/s, a look every 50
votes = 5 s polls). Base rates 0.05, 0.2, 0.5; candidates equal, better by the margin
(ratio 1 + delta), worse by half the margin, by the margin, by twice it, and half as good.
Figures: promotion rate with its Wilson 95 % interval and the number of canaries, the rollback
and deadline shares, median votes to a decision. Run: ``python bench/canary.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.analysis import AnalysisConfig, thumbs_bounds, thumbs_verdict  # noqa: E402
from deploy.controller import ControllerConfig, parse_steps  # noqa: E402
from deploy.wiring import ControllerRunConfig  # noqa: E402
from flywheel.demo import DemoConfig  # noqa: E402
from deploy.stats import msprt_bounds, wilson_interval  # noqa: E402

PROMOTE, ROLLBACK, DEADLINE_ROLLBACK = 1, 2, 3
RULES = ("relative", "relative_cuped", "absolute")


# Votes per second the settings assume: the demo's ~0.75 (its traffic), production's 10.
DEMO_VOTES_PER_S = 0.75
PRODUCTION_VOTES_PER_S = 10.0
_DEMO = DemoConfig(out=Path("flywheel-demo"))  # the demo's canary settings (flywheel/demo.py), its overrides of the controller's
_PRODUCTION = ControllerConfig()  # the controller's defaults (deploy/controller.py, deploy/analysis.py)


@dataclass(frozen=True)
class SimConfig:
    """One simulated rollout policy (units: votes; rates in [0, 1]); the defaults are the
    demo's settings, read from ``flywheel.demo.DemoConfig`` and the controller's models.

    Fields:
        shares: the analysed candidate shares (the final 1.0, the promotion, is not simulated).
        min_votes: votes per arm before the test decides (``AnalysisConfig.min_votes``).
        min_votes_per_step: new candidate votes a step needs before it advances.
        step_deadline_votes: votes after which an undecided step is rolled back.
        every: votes between two looks (one controller poll).
        alpha: error level; delta: relative margin; abs_delta: the absolute rule's margin.
        kappa: concentration of the users' Beta propensities (smaller: more heterogeneous).
        history: each user's votes before the canary (the CUPED covariate's sample size).
    """

    shares: tuple[float, ...] = parse_steps(_DEMO.controller["steps"])[:-1]
    min_votes: int = _DEMO.controller["min_votes"]
    min_votes_per_step: int = _DEMO.controller["min_votes"]  # the demo sets no --min-votes-per-step
    step_deadline_votes: int = round(_DEMO.controller["deadline_s"] * DEMO_VOTES_PER_S)
    every: int = 1
    alpha: float = _PRODUCTION.analysis.alpha  # the demo keeps the controller's
    delta: float = _DEMO.controller["delta"]
    abs_delta: float = 0.2
    kappa: float = 4.0
    history: int = 10

    def analysis(self, cuped: bool) -> AnalysisConfig:
        return AnalysisConfig(min_votes=self.min_votes, alpha=self.alpha, delta=self.delta, cuped=cuped)


# The demo's settings (flywheel/demo.py DEMO_CONTROLLER: steps, min_votes, delta, deadline_s at
# ~0.75 votes/s) and production's (the controller's defaults at 10 votes/s).
SETTINGS = {
    "demo": SimConfig(),
    "production": SimConfig(shares=_PRODUCTION.steps[:-1], min_votes=_PRODUCTION.analysis.min_votes,
                            min_votes_per_step=_PRODUCTION.votes_per_step,
                            step_deadline_votes=round(_PRODUCTION.deadline_s * PRODUCTION_VOTES_PER_S),
                            every=round(ControllerRunConfig().poll_s * PRODUCTION_VOTES_PER_S),
                            alpha=_PRODUCTION.analysis.alpha, delta=_PRODUCTION.analysis.delta, abs_delta=0.1),
}
BASES = (0.05, 0.2, 0.5)


def cases(delta: float) -> dict[str, float]:
    """Candidate rate / stable rate per case."""
    return {"equal": 1.0, "better_margin": 1 + delta, "worse_half_margin": 1 - delta / 2,
            "worse_margin": 1 - delta, "worse_2margin": max(1 - 2 * delta, 0.0), "half_as_good": 0.5}


def _verdicts(rule: str, st: dict, cfg: SimConfig):
    uc, nc, us, ns = st["uc"], np.maximum(st["nc"], 1), st["us"], np.maximum(st["ns"], 1)
    ok = (st["nc"] >= cfg.min_votes) & (st["ns"] >= cfg.min_votes)
    if rule == "absolute":
        _, lo, hi = msprt_bounds(uc, nc, us, ns, cfg.alpha, cfg.abs_delta)
        passed, failed = thumbs_verdict(lo, hi, cfg.abs_delta)
    else:
        cuped = rule == "relative_cuped"
        cov = ((st["xc"], st["xxc"], st["xyc"]), (st["xs"], st["xxs"], st["xys"])) if cuped else (None, None)
        _, lo, hi, _ = thumbs_bounds(uc, nc, us, ns, cfg.analysis(cuped), *cov)
        passed, failed = thumbs_verdict(lo, hi, cfg.delta)
    return ok & passed, ok & failed


def simulate(p_stable: float, ratio: float, n: int, cfg: SimConfig, seed: int, rules=RULES) -> dict:
    """Simulate ``n`` canaries per rule on the same vote streams (lockstep, ``every`` votes per look).

    Returns ``{rule: (outcome, votes)}``: int arrays, outcome PROMOTE / ROLLBACK /
    DEADLINE_ROLLBACK, votes = total votes when the decision was taken."""
    rng = np.random.default_rng(seed)
    k = cfg.every
    a, b = p_stable * cfg.kappa, (1 - p_stable) * cfg.kappa
    keys = ("uc", "nc", "us", "ns", "xc", "xxc", "xyc", "xs", "xxs", "xys")
    state = {r: {key: np.zeros(n) for key in keys} for r in rules}
    ctl = {r: {"step": np.zeros(n, int), "step_c": np.zeros(n), "step_all": np.zeros(n),
               "outcome": np.zeros(n, int), "votes": np.zeros(n, int)} for r in rules}
    shares = np.asarray(cfg.shares)
    t = 0
    while any((ctl[r]["outcome"] == 0).any() for r in rules):
        u = rng.beta(a, b, (n, k))  # users' propensities
        x = rng.binomial(cfg.history, u) / cfg.history  # their earlier thumbs-up rate (covariate)
        draw_arm = rng.random((n, k))
        draw_vote = rng.random((n, k))
        t += k
        for r in rules:
            c, st = ctl[r], state[r]
            act = c["outcome"] == 0
            if not act.any():
                continue
            to_c = draw_arm < shares[np.minimum(c["step"], len(shares) - 1)][:, None]
            y = draw_vote < np.where(to_c, np.minimum(ratio * u, 1.0), u)
            m = act[:, None]
            for arm, sel in (("c", to_c & m), ("s", ~to_c & m)):
                st["n" + arm] += sel.sum(1)
                st["u" + arm] += (sel & y).sum(1)
                st["x" + arm] += (sel * x).sum(1)
                st["xx" + arm] += (sel * x * x).sum(1)
                st["xy" + arm] += (sel * x * y).sum(1)
            c["step_c"] += (to_c & m).sum(1)
            c["step_all"] += act * k
            ok, bad = _verdicts(r, st, cfg)
            roll = act & bad
            c["outcome"][roll], c["votes"][roll] = ROLLBACK, t
            adv = act & ~roll & ok & (c["step_c"] >= cfg.min_votes_per_step)
            last = adv & (c["step"] == len(shares) - 1)
            c["outcome"][last], c["votes"][last] = PROMOTE, t
            nxt = adv & ~last
            c["step"][nxt] += 1
            c["step_c"][nxt] = 0
            c["step_all"][nxt] = 0
            dead = (c["outcome"] == 0) & (c["step_all"] >= cfg.step_deadline_votes)
            c["outcome"][dead], c["votes"][dead] = DEADLINE_ROLLBACK, t
    return {r: (ctl[r]["outcome"], ctl[r]["votes"]) for r in rules}


def rate(x: np.ndarray) -> dict:
    k, n = int(x.sum()), int(x.size)
    lo, hi = wilson_interval(k, n)
    return {"rate": k / n, "ci95": [lo, hi], "k": k, "n": n}


def summarise(o: np.ndarray, v: np.ndarray) -> dict:
    decided = o != DEADLINE_ROLLBACK
    return {"promote": rate(o == PROMOTE), "rollback_by_test": rate(o == ROLLBACK),
            "deadline": rate(o == DEADLINE_ROLLBACK), "median_votes": float(np.median(v)),
            "median_votes_decided": float(np.median(v[decided])) if decided.any() else None}


def run(cfg: SimConfig, n: int, p_stable: float, seed: int, which=None, rules=RULES) -> dict:
    """``{case: {rule: summary}}`` at one base rate (every case, or those named in ``which``)."""
    out = {}
    for i, (case, ratio) in enumerate(cases(cfg.delta).items()):
        if which and case not in which:
            continue
        res = simulate(p_stable, ratio, n, cfg, seed + 1000 * i, rules)
        out[case] = {r: summarise(*res[r]) for r in rules}
    return out


def _print_table(name: str, cfg: SimConfig, p: float, n: int, res: dict) -> None:
    print(f"\n{name} settings, stable rate {p}: {n} canaries per case and rule; shares {cfg.shares}, burn-in "
          f"{cfg.min_votes}, step deadline {cfg.step_deadline_votes} votes -> roll back, a look every {cfg.every} "
          f"vote(s); relative margin {cfg.delta:g} (absolute rule {cfg.abs_delta:g})")
    print(f"{'case':<19}{'cand':>6} {'rule':<15}{'promote [95% CI]':>24}{'test rb':>9}{'deadline':>9}"
          f"{'med votes':>10}")
    for case, by_rule in res.items():
        pc = p * cases(cfg.delta)[case]
        for r, x in by_rule.items():
            pr = x["promote"]
            print(f"{case:<19}{pc:>6.3f} {r:<15}{pr['rate']:>8.3f} [{pr['ci95'][0]:.3f},{pr['ci95'][1]:.3f}]"
                  f"{x['rollback_by_test']['rate']:>9.3f}{x['deadline']['rate']:>9.3f}{x['median_votes']:>10.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="500 canaries per case, base rate 0.2 only")
    ap.add_argument("--canaries", type=int, default=None, help="canaries per case (default 2000; --quick 500)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = ap.parse_args()
    n = a.canaries or (500 if a.quick else 2000)
    bases = (0.2,) if a.quick else BASES
    t0 = time.time()
    allres: dict = {}
    for name, cfg in SETTINGS.items():
        for p in bases:
            res = run(cfg, n, p, a.seed)
            allres.setdefault(name, {})[str(p)] = res
            _print_table(name, cfg, p, n, res)
    print(f"\n({time.time() - t0:.1f} s)")
    if a.json:
        a.json.write_text(json.dumps(allres, indent=1))
    demo, prod = allres["demo"]["0.2"], allres["production"]["0.2"]
    d_cfg, p_cfg = SETTINGS["demo"], SETTINGS["production"]
    m = f"base 0.2, n={n}"
    print(f"RESULT canary_false_rollback_rate={prod['equal']['relative']['rollback_by_test']['rate']:.4f} "
          f"target<={p_cfg.alpha} (equal candidate rolled back by the test; production settings, {m})")
    print(f"RESULT canary_false_promotion_rate={prod['worse_2margin']['relative']['promote']['rate']:.4f} "
          f"target<=0.05 (candidate worse by 2*delta, ratio {1 - 2 * p_cfg.delta:g}; production settings, {m})")
    print(f"RESULT canary_promotion_rate_better={prod['better_margin']['relative']['promote']['rate']:.4f} "
          f"(candidate better by delta, ratio {1 + p_cfg.delta:g}; production settings, {m})")
    print(f"RESULT canary_promotion_rate_half_as_good={demo['half_as_good']['relative']['promote']['rate']:.4f} "
          f"target<=0.05 (candidate at half the stable's rate; demo settings, {m}; absolute rule "
          f"{demo['half_as_good']['absolute']['promote']['rate']:.4f})")
    eq = prod["equal"]
    print(f"RESULT canary_promotion_rate_equal={eq['relative']['promote']['rate']:.4f} target>=0.8 "
          f"(equal candidate; production settings, {m}; absolute rule {eq['absolute']['promote']['rate']:.4f})")
    plain, cuped = prod["equal"]["relative"]["median_votes"], prod["equal"]["relative_cuped"]["median_votes"]
    print(f"RESULT canary_median_votes_to_decision={plain:.0f} votes (equal candidate, production settings, {m})")
    print(f"RESULT canary_cuped_votes_ratio={cuped / plain:.3f} target<1 (median votes to a decision with CUPED on "
          f"the users' history / without; equal candidate, production settings, {m}, kappa {p_cfg.kappa:g})")


if __name__ == "__main__":
    main()
