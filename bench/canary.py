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
deadline, a look every vote: ``flywheel.demo_config.DemoConfig``) and production's (the controller's
defaults, ``deploy.controller.ControllerConfig``: shares 5/25/50 %, 10-vote burn-in, a
36,000-vote step deadline = the 3,600 s deadline at an assumed 10 votes/s, a look every 50
votes = 5 s polls). Base rates 0.05, 0.2, 0.5; candidates equal, better by the margin
(ratio 1 + delta), worse by half the margin, by the margin, by twice it, and half as good.
Figures: promotion rate with its Wilson 95 % interval and the number of canaries, the rollback
and deadline shares, median votes to a decision.

**The reward test** (``quality = reward``, the controller's default; :func:`simulate_reward`):
replies instead of votes. Each simulated reply is good, bad or a refusal; its user may thumb it
(on 10 % of replies), copy it, regenerate it and follow up satisfied or not, with
probabilities by the reply's kind (:data:`USER`); a reply nobody signalled on makes no sample;
a sample's reward is the declared reward policy's (``schemas.reward.RewardPolicy()``'s
``combine``: thumb +-1 overriding the implicit components, copy +0.5, regenerate -0.5,
follow-up +-0.5, clip 1). Per look, the analysis' own vectorised functions judge: the reward
test (:func:`deploy.analysis.reward_bounds`), the signal guards
(:func:`deploy.analysis.signal_bounds`), the thumbs-up guard and the no-answer guard on served
replies (a refusal has no answer; the guard's absolute limit, ``max_no_answer_increase``), each
guard with the failure limit; ``thumbs`` is the thumbs-up test alone on the same replies. Production settings in
replies: 100 replies/s (10 votes/s at 10 % thumbed), a look every 500, a 360,000-reply step
deadline. Cases: equal, half the stable's good replies, half the stable's mean reward, abstaining
(30 % more refusals) and a selective abstainer (the refusals mostly on prompts it would answer
badly). Every case is judged by both rules on the same replies, so the table shows what the
reward test costs and catches beside the thumbs-up test.

Run: ``python bench/canary.py [--quick]`` (``--quick``: 500 thumbs canaries at base 0.2 and 200
reward canaries per case, a few minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.analysis import (SIGNAL_GUARDS, AnalysisConfig, reward_bounds, signal_bounds, thumbs_bounds,  # noqa: E402
                             thumbs_verdict)
from deploy.controller import ControllerConfig, parse_steps  # noqa: E402
from deploy.wiring import ControllerRunConfig  # noqa: E402
from flywheel.demo_config import DemoConfig  # noqa: E402
from deploy.stats import msprt_bounds, wilson_interval  # noqa: E402

PROMOTE, ROLLBACK, DEADLINE_ROLLBACK, GUARD_ROLLBACK = 1, 2, 3, 4
RULES = ("relative", "relative_cuped", "absolute")


# Votes per second the settings assume: the demo's ~0.75 (its traffic), production's 10.
DEMO_VOTES_PER_S = 0.75
PRODUCTION_VOTES_PER_S = 10.0
_DEMO = DemoConfig(out=Path("flywheel-demo"))  # the demo's canary settings (flywheel/demo_config.py), its overrides of the controller's
_PRODUCTION = ControllerConfig()  # the controller's defaults (deploy/controller.py, deploy/analysis.py)


@dataclass(frozen=True)
class SimConfig:
    """One simulated rollout policy (units: votes; rates in [0, 1]); the defaults are the
    demo's settings, read from ``flywheel.demo_config.DemoConfig`` and the controller's models.

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


# The demo's settings (flywheel/demo_config.py DEMO_CONTROLLER: steps, min_votes, delta, deadline_s at
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


# ---------------------------------------------------------------------------------------------
# The reward test and the signal guards (quality = reward), on simulated users' feedback.

#: Production's reply rate: thumbs come on THUMB_SHARE of replies, so the 10 votes/s the thumbs
#: settings assume are 100 replies/s; a look every 5 s is 500 replies, the 3,600 s step deadline
#: 360,000.
THUMB_SHARE = 0.10
PRODUCTION_REPLIES_PER_S = PRODUCTION_VOTES_PER_S / THUMB_SHARE

#: What a simulated user does with one reply, by the reply's kind: P(thumb given), P(up | thumb),
#: P(copied), P(regenerated), P(follow-up given), P(satisfied | follow-up). A good reply is copied
#: and followed up satisfied, a bad one regenerated and followed up dissatisfied; a refusal (no
#: answer) is rarely copied and less often regenerated than a bad answer (the user gives up).
USER = {"good": (THUMB_SHARE, 0.85, 0.55, 0.05, 0.5, 0.80),
        "bad": (THUMB_SHARE, 0.25, 0.15, 0.35, 0.5, 0.30),
        "refusal": (THUMB_SHARE, 0.40, 0.02, 0.08, 0.3, 0.50)}
#: The stable version's replies: good, bad, refusal shares.
STABLE_MIX = (0.60, 0.35, 0.05)


@dataclass(frozen=True)
class Outcomes:
    """Every outcome one reply can have (a category per kind x thumb x copy x regenerate x
    follow-up), with what the canary counts for it: whether it becomes a sample (a reply no
    user signalled on has no sample), its reward by the declared policy
    (``schemas.reward.RewardPolicy().combine``), thumbs up / down, regenerated, dissatisfied,
    copied; and ``p[kind]``, each category's probability for a reply of that kind."""

    kind: np.ndarray
    sample: np.ndarray
    reward: np.ndarray
    up: np.ndarray
    down: np.ndarray
    regen: np.ndarray
    dissat: np.ndarray
    copied: np.ndarray
    p: dict


def outcomes(policy=None) -> Outcomes:
    """Enumerate the categories of :data:`USER` under ``policy`` (default: the reward
    policy's defaults)."""
    from schemas.reward import RewardPolicy

    policy = policy or RewardPolicy()
    rows, probs = [], {k: [] for k in USER}
    for kind, (pt, pu, pc, pr, pf, ps) in USER.items():
        for thumb, p_t in ((None, 1 - pt), (1.0, pt * pu), (-1.0, pt * (1 - pu))):
            for cop, p_c in ((0, 1 - pc), (1, pc)):
                for reg, p_r in ((0, 1 - pr), (1, pr)):
                    for fol, p_f in ((None, 1 - pf), (1.0, pf * ps), (-1.0, pf * (1 - ps))):
                        sample = thumb is not None or cop or reg or fol is not None
                        r = policy.combine(thumb=thumb, copied=cop, regenerated=reg, followup=fol) if sample else 0.0
                        rows.append((kind, sample, r, thumb == 1.0, thumb == -1.0, reg, fol == -1.0, cop))
                        for k in USER:
                            probs[k].append(p_t * p_c * p_r * p_f if k == kind else 0.0)
    cols = list(zip(*rows))
    return Outcomes(np.array(cols[0]), *(np.array(c, dtype=np.float64) for c in cols[1:]),
                    p={k: np.array(v) for k, v in probs.items()})


def category_probs(o: Outcomes, mix) -> np.ndarray:
    """Category probabilities of a version whose replies are good, bad, refusal in ``mix``."""
    p = sum(w * o.p[k] for w, k in zip(mix, USER))
    return p / p.sum()


def mean_reward(o: Outcomes, mix) -> float:
    """A version's mean reward over its samples (what the reward test estimates)."""
    p = category_probs(o, mix)
    return float((p * o.sample * o.reward).sum() / (p * o.sample).sum())


def reward_cases(o: Outcomes) -> dict[str, tuple]:
    """The candidates' reply mixes: ``equal``; ``half_the_good_replies`` (half the stable's
    good replies, the rest bad, refusals as the stable's); ``half_as_good_reward`` (fewer good replies,
    refusals as the stable's, so that its mean reward over samples is half the stable's; found
    by bisection); ``abstains`` (refuses on 30 % more of the prompts: a refusal share 0.30 above
    the stable's, its other replies good and bad in the stable's proportions: fewer
    regenerates, fewer copies, more replies with no answer); ``abstains_selective`` (the same
    0.30 more refusals, two thirds of them on prompts it would have answered badly: 0.20 fewer
    bad replies and 0.10 fewer good ones; its mean reward is above the stable's)."""
    target = mean_reward(o, STABLE_MIX) / 2
    lo, hi = 0.0, STABLE_MIX[0]
    for _ in range(60):
        g = (lo + hi) / 2
        lo, hi = (lo, g) if mean_reward(o, (g, 1 - STABLE_MIX[2] - g, STABLE_MIX[2])) > target else (g, hi)
    half = (lo, 1 - STABLE_MIX[2] - lo, STABLE_MIX[2])
    keep = (1 - STABLE_MIX[2] - 0.30) / (1 - STABLE_MIX[2])
    abstain = (STABLE_MIX[0] * keep, STABLE_MIX[1] * keep, STABLE_MIX[2] + 0.30)
    selective = (STABLE_MIX[0] - 0.10, STABLE_MIX[1] - 0.20, STABLE_MIX[2] + 0.30)
    half_good = (STABLE_MIX[0] / 2, 1 - STABLE_MIX[2] - STABLE_MIX[0] / 2, STABLE_MIX[2])
    return {"equal": STABLE_MIX, "half_the_good_replies": half_good, "half_as_good_reward": half, "abstains": abstain,
            "abstains_selective": selective}


@dataclass(frozen=True)
class RewardSim:
    """Production's rollout settings in replies (the controller's defaults,
    ``ControllerConfig``; ``deploy.analysis.AnalysisConfig``'s defaults with the reward
    policy's clip 1): shares 5/25/50 %, a look every ``every`` replies, an undecided step rolled
    back after ``deadline`` replies, ``min_per_step`` new candidate samples (reward) or votes
    (thumbs) before a step advances."""

    shares: tuple[float, ...] = _PRODUCTION.steps[:-1]
    every: int = round(ControllerRunConfig().poll_s * PRODUCTION_REPLIES_PER_S)
    deadline: int = round(_PRODUCTION.deadline_s * PRODUCTION_REPLIES_PER_S)
    min_per_step: int = _PRODUCTION.votes_per_step
    analysis: AnalysisConfig = field(default_factory=lambda: replace(_PRODUCTION.analysis, reward_clip=1.0))


def simulate_reward(o: Outcomes, mix_s, mix_c, n: int, sim: RewardSim, seed: int,
                    rules=("reward", "thumbs")) -> dict:
    """Simulate ``n`` canaries per rule on the same reply streams, each look judged by the
    analysis' own vectorised functions: ``reward`` (:func:`deploy.analysis.reward_bounds`,
    the signal guards of :func:`deploy.analysis.signal_bounds` and the thumbs-up guard, each
    guard failing after ``failure_limit`` failed looks in a row, as :func:`deploy.analysis.analyze`
    applies it, and the no-answer guard on served replies with its absolute limit
    ``max_no_answer_increase``) and ``thumbs`` (the thumbs-up test alone, ``quality = thumbs``).

    Returns ``{rule: (outcome, replies, samples, by_guard)}``: outcome PROMOTE / ROLLBACK /
    DEADLINE_ROLLBACK / GUARD_ROLLBACK per canary, the replies and samples seen when decided,
    and how many rollbacks each guard decided."""
    cfg = sim.analysis
    pc, ps = category_probs(o, mix_c), category_probs(o, mix_s)
    served, refusal = np.ones_like(o.sample), (o.kind == "refusal").astype(np.float64)
    stats = np.stack([o.sample, o.sample * o.reward, o.sample * o.reward ** 2, o.up, o.down,
                      o.sample * o.regen, o.sample * o.dissat, o.sample * o.copied, served, refusal],
                     axis=1)  # (categories, 10)
    shares = np.asarray(sim.shares)
    out = {}
    for rule in rules:
        acc = {a: np.zeros((n, stats.shape[1])) for a in "cs"}
        step = np.zeros(n, int)
        step_n, step_all = np.zeros(n), np.zeros(n)
        outcome, replies, samples = np.zeros(n, int), np.zeros(n, int), np.zeros(n, int)
        fails = {g: np.zeros(n, int) for g in ("thumbs_up", *(g for g, *_ in SIGNAL_GUARDS), "no_answer")}
        by_guard = {g: 0 for g in fails}
        t = 0
        r = np.random.default_rng(seed)  # the same reply streams for every rule
        while (outcome == 0).any():
            t += sim.every
            act = outcome == 0
            n_c = r.binomial(sim.every, shares[np.minimum(step, len(shares) - 1)])
            got_c = r.multinomial(n_c, pc) @ stats
            got_s = r.multinomial(sim.every - n_c, ps) @ stats
            got_c[~act], got_s[~act] = 0, 0
            acc["c"] += got_c
            acc["s"] += got_s
            step_all += act * sim.every
            c, s_ = acc["c"], acc["s"]
            if rule == "reward":
                step_n += got_c[:, 0]
                ok = (c[:, 0] >= cfg.min_votes) & (s_[:, 0] >= cfg.min_votes)
                _, lo, hi, _, _ = reward_bounds(c[:, 0], c[:, 1], c[:, 2], s_[:, 0], s_[:, 1], s_[:, 2], cfg)
                passed, failed = thumbs_verdict(lo, hi, cfg.reward_delta)
                passed, failed = ok & passed, ok & failed
                g_ok = (c[:, 0] >= cfg.min_guard_completions) & (s_[:, 0] >= cfg.min_guard_completions)
                verdicts = {}
                for k, (g, worse, center, _) in enumerate(SIGNAL_GUARDS):
                    bad, _, _ = signal_bounds(c[:, 5 + k], c[:, 0], s_[:, 5 + k], s_[:, 0], cfg, worse, center)
                    verdicts[g] = (g_ok, g_ok & bad)
                nc_v, ns_v = c[:, 3] + c[:, 4], s_[:, 3] + s_[:, 4]
                v_ok = (nc_v >= cfg.min_votes) & (ns_v >= cfg.min_votes)
                _, _, thi, _ = thumbs_bounds(c[:, 3], np.maximum(nc_v, 1), s_[:, 3], np.maximum(ns_v, 1), cfg)
                verdicts["thumbs_up"] = (v_ok, v_ok & (thi < -cfg.signal_margin))
                # the no-answer guard over served replies (a refusal is a reply with no answer), its
                # absolute limit only (deploy.analysis.check_guards also fails a relative rise)
                a_ok = (c[:, 8] >= cfg.min_guard_completions) & (s_[:, 8] >= cfg.min_guard_completions)
                rise = c[:, 9] / np.maximum(c[:, 8], 1) - s_[:, 9] / np.maximum(s_[:, 8], 1)
                verdicts["no_answer"] = (a_ok, a_ok & (rise > cfg.max_no_answer_increase))
                guard_fail, guard_hold = np.zeros(n, bool), np.zeros(n, bool)
                for g, (judged, bad) in verdicts.items():
                    fails[g] = np.where(bad, fails[g] + 1, np.where(judged, 0, fails[g]))
                    hit = act & (fails[g] >= cfg.failure_limit) & ~guard_fail & ~failed
                    by_guard[g] += int(hit.sum())
                    guard_fail |= fails[g] >= cfg.failure_limit
                    guard_hold |= (fails[g] > 0) | (~judged & (g != "thumbs_up"))
                passed = passed & ~guard_hold
            else:
                step_n += got_c[:, 3] + got_c[:, 4]
                nc_v, ns_v = c[:, 3] + c[:, 4], s_[:, 3] + s_[:, 4]
                ok = (nc_v >= cfg.min_votes) & (ns_v >= cfg.min_votes)
                _, lo, hi, _ = thumbs_bounds(c[:, 3], np.maximum(nc_v, 1), s_[:, 3], np.maximum(ns_v, 1), cfg)
                passed, failed = thumbs_verdict(lo, hi, cfg.delta)
                passed, failed, guard_fail = ok & passed, ok & failed, np.zeros(n, bool)
            roll = act & failed
            g_roll = act & ~roll & guard_fail
            adv = act & ~roll & ~g_roll & passed & (step_n >= sim.min_per_step)
            last = adv & (step == len(shares) - 1)
            nxt = adv & ~last
            dead = act & ~roll & ~g_roll & ~adv & (step_all >= sim.deadline)
            for mask, code in ((roll, ROLLBACK), (g_roll, GUARD_ROLLBACK), (last, PROMOTE), (dead, DEADLINE_ROLLBACK)):
                outcome[mask], replies[mask] = code, t
                samples[mask] = (c[:, 0] + s_[:, 0])[mask]
            step[nxt] += 1
            step_n[nxt], step_all[nxt] = 0, 0
        out[rule] = (outcome, replies, samples, by_guard)
    return out


def summarise_reward(o: np.ndarray, replies: np.ndarray, samples: np.ndarray, by_guard: dict) -> dict:
    return {"promote": rate(o == PROMOTE), "rollback": rate((o == ROLLBACK) | (o == GUARD_ROLLBACK)
                                                            | (o == DEADLINE_ROLLBACK)),
            "rollback_by_test": rate(o == ROLLBACK), "rollback_by_guard": rate(o == GUARD_ROLLBACK),
            "deadline": rate(o == DEADLINE_ROLLBACK), "by_guard": by_guard,
            "median_replies": float(np.median(replies)), "median_samples": float(np.median(samples))}


def run_reward(n: int, seed: int, sim: RewardSim | None = None, which=None) -> dict:
    """``{case: {rule: summary}}`` for the :func:`reward_cases` at production's settings."""
    sim = sim or RewardSim()
    o = outcomes()
    out = {}
    for i, (case, mix) in enumerate(reward_cases(o).items()):
        if which and case not in which:
            continue
        rules = ("reward", "thumbs")
        res = simulate_reward(o, STABLE_MIX, mix, n, sim, seed + 1000 * i, rules)
        out[case] = {r: summarise_reward(*res[r]) for r in rules}
        out[case]["mix"] = list(mix)
        out[case]["mean_reward"] = mean_reward(o, mix)
    return out


def _print_reward_table(sim: RewardSim, n: int, res: dict) -> None:
    o = outcomes()
    p = category_probs(o, STABLE_MIX)
    print(f"\nreward test (quality = reward) at production settings: {n} canaries per case; shares {sim.shares}, "
          f"a look every {sim.every} replies, step deadline {sim.deadline} replies -> roll back; reward_delta "
          f"{sim.analysis.reward_delta:g}, thumbs-up test delta {sim.analysis.delta:g}; thumbs on "
          f"{THUMB_SHARE:.0%} of replies, {float((p * o.sample).sum()):.0%} of the stable's replies become samples; "
          f"stable mean reward {mean_reward(o, STABLE_MIX):+.3f} (mix good/bad/refusal {STABLE_MIX})")
    print(f"{'case':<21}{'rule':<8}{'mean r':>8}{'promote [95% CI]':>24}{'test rb':>9}{'guard rb':>9}{'deadline':>9}"
          f"{'med replies':>12}{'med samples':>12}  guards that decided")
    for case, by_rule in res.items():
        for r, x in by_rule.items():
            if r in ("mix", "mean_reward"):
                continue
            pr = x["promote"]
            print(f"{case:<21}{r:<8}{by_rule['mean_reward']:>+8.3f}{pr['rate']:>8.3f} [{pr['ci95'][0]:.3f},"
                  f"{pr['ci95'][1]:.3f}]{x['rollback_by_test']['rate']:>9.3f}{x['rollback_by_guard']['rate']:>9.3f}"
                  f"{x['deadline']['rate']:>9.3f}{x['median_replies']:>12.0f}{x['median_samples']:>12.0f}  "
                  f"{ {g: k for g, k in x['by_guard'].items() if k} }")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="500 canaries per case, base rate 0.2 only")
    ap.add_argument("--canaries", type=int, default=None, help="canaries per case (default 2000; --quick 500)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--reward-canaries", type=int, default=None,
                    help="canaries per case of the reward test (default 1000; --quick 200)")
    a = ap.parse_args()
    n = a.canaries or (500 if a.quick else 2000)
    n_rw = a.reward_canaries or (a.canaries if a.canaries and a.canaries < 200 else (200 if a.quick else 1000))
    bases = (0.2,) if a.quick else BASES
    t0 = time.time()
    allres: dict = {}
    for name, cfg in SETTINGS.items():
        for p in bases:
            res = run(cfg, n, p, a.seed)
            allres.setdefault(name, {})[str(p)] = res
            _print_table(name, cfg, p, n, res)
    sim = RewardSim()
    rw = run_reward(n_rw, a.seed, sim)
    allres["reward"] = rw
    _print_reward_table(sim, n_rw, rw)
    print(f"\n({time.time() - t0:.1f} s)")
    if a.json:
        a.json.write_text(json.dumps(allres, indent=1))
    m = f"production settings, n={n_rw}"
    eq = rw["equal"]
    hg = rw["half_the_good_replies"]
    print(f"RESULT canary_promotion_rate_half_the_good_replies={hg['reward']['promote']['rate']:.4f} target<=0.05 "
          f"(half the stable's good replies, mean reward {hg['mean_reward']:+.3f} vs {eq['mean_reward']:+.3f}; "
          f"reward test and guards; thumbs-up test on the same replies {hg['thumbs']['promote']['rate']:.4f}; {m})")
    half = rw["half_as_good_reward"]
    rd = sim.analysis.reward_delta
    ratio = (half["mean_reward"] + 1) / (eq["mean_reward"] + 1)
    print(f"RESULT canary_promotion_rate_half_as_good_reward={half['reward']['promote']['rate']:.4f} target<=0.05 "
          f"(mean reward half the stable's, {half['mean_reward']:+.3f}: {ratio:.3f} of its distance from the worst "
          f"reward, reward_delta {rd:g}, D113; thumbs-up test on the same replies "
          f"{half['thumbs']['promote']['rate']:.4f}; {m})")
    ab = rw["abstains"]["reward"]
    print(f"RESULT canary_catches_abstention={ab['rollback']['rate']:.4f} target>=0.95 (refuses on 30 % more of the "
          f"prompts: rolled back, {ab['rollback_by_test']['rate']:.3f} by the reward test, "
          f"{ab['rollback_by_guard']['rate']:.3f} by a guard {ab['by_guard']}; {m})")
    sel = rw["abstains_selective"]["reward"]
    print(f"RESULT canary_promotion_rate_selective_abstention={sel['promote']['rate']:.4f} (the same refusals, two "
          f"thirds on prompts it would answer badly: mean reward {rw['abstains_selective']['mean_reward']:+.3f}; "
          f"guards that rolled it back {sel['by_guard']}; {m})")
    print(f"RESULT canary_reward_false_rollback_rate={eq['reward']['rollback']['rate']:.4f} target<=0.05 (equal "
          f"candidate rolled back by the reward test, a guard or the deadline; {m})")
    print(f"RESULT canary_reward_median_replies_to_decision={eq['reward']['median_replies']:.0f} (equal candidate, "
          f"{eq['reward']['median_samples']:.0f} samples; thumbs-only on the same replies "
          f"{eq['thumbs']['median_replies']:.0f} replies, {THUMB_SHARE:.0%} of them thumbed; {m})")
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
