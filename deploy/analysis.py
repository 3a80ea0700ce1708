"""Canary analysis: a pure function of the evidence and the persisted failure counts.

Each metric is judged into PASS | FAIL | INCONCLUSIVE | ERROR | SKIPPED:

* **mean reward** (the quality signal by default, ``quality = reward``): the samples' reward
  by the declared reward policy, the reward the learner trains on. A sequential test that
  stays valid at every look without a normal approximation: each arm's mean gets an
  empirical-Bernstein confidence sequence for observations bounded by the policy's clip
  (Howard, Ramdas, McAuliffe, Sekhon 2021, Theorem 4, mixed over a grid of rates;
  :func:`deploy.stats.eb_mean_bounds`) at ``alpha / 2``, so the box of both means holds at
  every look with probability ``1 - alpha``. The margin is relative to the stable's distance
  from the policy's worst reward ``-reward_clip``, as a rate's is from 0: PASS when every point
  of the box has ``mean_c + clip > (1 - reward_delta) (mean_s + clip)``, FAIL when every point
  has ``mean_c < mean_s``
  (:func:`reward_bounds`, :func:`check_reward`). For a policy of thumbs alone (reward +-1 per
  sample) this is the thumbs-up rule on rates exactly (``mean + 1 = 2 rate``) when
  ``reward_delta`` equals ``delta``; the reward test's default margin is the narrower 0.08, so
  that a candidate at half the stable's mean reward is not promoted (D113). The thumbs-up test
  then guards the thumbs signal (FAIL when shown worse by more than ``signal_margin``).
  Shards written before the reward policy (no rewarded sample on either arm) decide on the
  thumbs-up rate as before; ``quality = thumbs`` asks for that test always.
* **feedback signals, both ways** (:func:`check_signal_guards`): the shares of rewarded
  samples that were regenerated, followed up dissatisfied and copied, each with the same
  always-valid bounds; a candidate shown worse by more than ``signal_margin`` (relative) and
  ``signal_floor`` (absolute) on any of them fails: more regenerates or dissatisfied
  follow-ups, or fewer copies, so a candidate that avoids negative signals by answering
  less is caught by the positive one (and by the no-answer and length guards below).
* **thumbs-up rate** (the quality signal with ``quality = thumbs`` or thumbs-only shards): a
  sequential test that stays valid when looked at
  after every vote, on the RELATIVE difference ``rate(candidate) / rate(stable) - 1``, so a
  margin means the same at a 0.05 and a 0.5 base rate. Its always-valid (1 - ``alpha``)
  bounds ``[lo, hi]`` are normal-mixture mSPRTs (Johari, Pekelis and Walsh 2017),
  :func:`deploy.stats.noninferiority_bounds`: ``lo`` on the log rate ratio, ``hi`` a score
  test on the difference (so an arm with no up-vote yet does not blow up the variance),
  mixing standard deviation ``tau`` (default ``-log(1 - delta)``; docs/decisions.md D48).
  When both arms carry a pre-canary covariate (the voting
  users' earlier thumbs-up rate, ``ArmStats.x_sum``...), each arm's rate is CUPED-adjusted
  first (:func:`deploy.stats.cuped_rate`): fewer votes for the same width, same guarantee.
  FAIL (the candidate is surely worse) when ``hi < 0``; PASS (non-inferior: keeps at least
  ``1 - delta`` of the stable's rate) when ``lo > -delta``; else INCONCLUSIVE (keep
  collecting until the step's deadline). INCONCLUSIVE too while an arm has fewer than
  ``min_votes`` votes (burn-in of the normal approximation). FAIL takes precedence over
  PASS. Error rates by simulation, controller's polling included: ``bench/canary.py``.
* **operational** (error rate, p99 latency, tokens/s): each check compares candidate with
  stable.
* **reward-hacking guards**: mean completion length (longer by more than
  ``max_length_ratio`` or shorter than ``min_length_ratio`` times; over the replies that
  finished on their own when both arms give ``truncated_tokens``, so a candidate cut at
  ``max_tokens`` less often is not called shorter for that: the truncated share has its own
  guard; D60), and the shares of replies
  with no answer (the workload's own ``has_answer``), cut at ``max_tokens`` and repetitive
  (:func:`deploy.replies.is_repetitive`), each not to rise by more than its absolute limit
  nor, past a small floor and shown at 95 %, to more than ``max_share_ratio`` times the
  baseline's. Each is
  checked against the stable version and, when the analysis is given the first version's
  figures (``first``), against it too (``<guard>_vs_first``), so drift cannot compound over
  versions that each look close to their parent; given the stable's lifetime figures too
  (``stable_all``), that check goes through the stable's window (:func:`check_guards`). The figures should cover every served
  completion of an arm, not only the voted ones (``deploy.replies``).
* A failed operational or guard check FAILs the metric only after
  ``failure_limit`` failed checks in a row (Flagger's ``threshold``, Argo Rollouts'
  ``failureLimit``). Before that it is INCONCLUSIVE ("failed check k of N"). A passing
  check resets the count. The counts are input and output of :func:`analyze`, persisted by
  the controller.

ERROR means the data could not be read or is invalid (NaN, source failure): kept apart
from INCONCLUSIVE (too little data) so an outage of the metrics source is never mistaken
for "wait for more votes". Combination is worst-wins: FAIL > ERROR > INCONCLUSIVE >
PASS/SKIPPED. FAIL -> ROLLBACK; ERROR or INCONCLUSIVE -> HOLD; all PASS/SKIPPED ->
PROMOTE (advance). With empty data the sequential test is INCONCLUSIVE, so the decision
is never PROMOTE or ROLLBACK on empty data.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Optional

import numpy as np

from pydantic import Field
from pydantic.dataclasses import dataclass as config_dataclass

from deploy.stats import (cuped_rate, cuped_theta, eb_mean_bounds, margin_tau, newcombe_interval,
                          noninferiority_bounds, relative_box_bounds, relative_margin_scale)

OPERATIONAL = ("error_rate", "p99_latency", "tokens_per_s")
GUARDS = ("completion_length", "no_answer", "truncated", "repetitive")
QUALITY = ("reward", "thumbs")  # what the sequential test judges (AnalysisConfig.quality)
#: The feedback signals guarded both ways (:func:`check_signal_guards`): ``(metric and ArmStats
#: field, worse direction, the confidence sequence's fixed center, what it counts)``. A
#: negative signal fails when it rises, a positive one when it falls.
SIGNAL_GUARDS = (("regenerated", "up", 0.0, "replies regenerated"),
                 ("dissatisfied", "up", 0.0, "dissatisfied follow-ups"),
                 ("copied", "down", 0.5, "replies copied"))
#: The kept share of edited replies, guarded downward: a mean of shares in [0, 1] over the
#: samples with an edit (``edited``, ``kept_sum``, ``kept_sq_sum``), not a count of samples.
KEPT_GUARD = ("kept_share", "down", 0.5, "kept share of edited replies")
VS_FIRST = "_vs_first"  # suffix of a guard checked against the first version


class Outcome(str, Enum):
    """Decision of one analysis."""

    PROMOTE = "PROMOTE"  # every metric passed: advance the canary (or promote at the last step)
    HOLD = "HOLD"  # inconclusive (too few votes) or metrics error: keep the current weight
    ROLLBACK = "ROLLBACK"  # some metric failed: the candidate is worse


class Check(str, Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    INCONCLUSIVE = "INCONCLUSIVE"
    ERROR = "ERROR"
    SKIPPED = "SKIPPED"


_SEVERITY = {Check.PASS: 0, Check.SKIPPED: 0, Check.INCONCLUSIVE: 1, Check.ERROR: 2, Check.FAIL: 3}


@dataclass
class ArmStats:
    """Observed traffic of one version during the canary.

    Fields:
        votes_up, votes_down: thumbs votes on its samples (counts, >= 0).
        errors, requests: failed and total requests (counts, >= 0, errors <= requests).
        p99_ms: 99th percentile request latency (ms), None if not measured.
        tokens_per_s: generation throughput (tokens/s), None if not measured.
        latency_samples: completions behind ``p99_ms`` and ``tokens_per_s`` (count), None
            if the source does not say. Requests routed before the canary's baseline but
            finished after it are in the latency histogram and not in ``requests``, so the
            minimum-sample gate of latency and tokens/s uses this count when it is given.
        completions: completions behind the guard figures (count, >= 0; 0: guards not measured).
        completion_tokens: their completion tokens in all (count).
        no_answer: those with no answer (empty reply, or none the workload can parse) (count).
        truncated: those cut at ``max_tokens`` (``finish_reason == "length"``) (count).
        repetitive: those that repeat themselves (:func:`deploy.replies.is_repetitive`) (count).
        truncated_tokens: the completion tokens of the truncated ones (count), None if the
            source does not say (the length guard then uses every reply).
        x_sum, xx_sum, xy_sum: CUPED sufficient statistics over the arm's votes of a covariate
            ``x`` fixed before the canary started (the voting user's earlier thumbs-up rate):
            ``sum x``, ``sum x^2``, ``sum x y`` with ``y`` = 1 for an up-vote (floats; None: no
            covariate, the test uses the plain rates).
        rewarded: samples of the arm that carry a reward under the judged reward policy
            (count, >= 0; 0 on shards written before the reward policy, which then decide on
            thumbs, :func:`check_quality`).
        reward_sum, reward_sq_sum: ``sum r`` and ``sum r^2`` of their rewards (floats).
        reward_min, reward_max: the smallest and largest of those rewards (None when
            ``rewarded`` is 0): a reward outside ``[-reward_clip, reward_clip]`` is an ERROR.
        regenerated, dissatisfied, copied: of those samples, the ones a user regenerated
            (``regenerated > 0``), followed up dissatisfied (``followup < 0``) and copied
            (``copied > 0``) (counts, <= ``rewarded``; the signal guards).
        edited: of those samples, the ones with an edit's kept share (count, <= ``rewarded``).
        kept_sum, kept_sq_sum: ``sum k`` and ``sum k^2`` of their kept shares ``k`` in
            ``[0, 1]`` (floats; the kept-share guard, :data:`KEPT_GUARD`).
        reward_policy: the digest of the reward policy those rewards are by (None: not
            known); the reward test compares two arms only under the same policy.
    """

    votes_up: int = 0
    votes_down: int = 0
    errors: int = 0
    requests: int = 0
    p99_ms: float | None = None
    tokens_per_s: float | None = None
    latency_samples: int | None = None
    completions: int = 0
    completion_tokens: int = 0
    no_answer: int = 0
    truncated: int = 0
    repetitive: int = 0
    truncated_tokens: int | None = None
    x_sum: float | None = None
    xx_sum: float | None = None
    xy_sum: float | None = None
    rewarded: int = 0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    reward_min: float | None = None
    reward_max: float | None = None
    regenerated: int = 0
    dissatisfied: int = 0
    copied: int = 0
    edited: int = 0
    kept_sum: float = 0.0
    kept_sq_sum: float = 0.0
    reward_policy: str | None = None

    def __post_init__(self):
        for f in ("votes_up", "votes_down", "errors", "requests", "latency_samples", "completions",
                  "completion_tokens", "no_answer", "truncated", "repetitive", "truncated_tokens",
                  "rewarded", "regenerated", "dissatisfied", "copied", "edited"):
            v = getattr(self, f)
            if f in ("latency_samples", "truncated_tokens") and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{f}: must be an int >= 0, got {v!r}")
        if self.errors > self.requests:
            raise ValueError(f"errors: {self.errors} > requests {self.requests}")
        for f in ("no_answer", "truncated", "repetitive"):
            if getattr(self, f) > self.completions:
                raise ValueError(f"{f}: {getattr(self, f)} > completions {self.completions}")
        for f in ("p99_ms", "tokens_per_s"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, (int, float)) or v < 0):
                raise ValueError(f"{f}: must be a number >= 0 or None, got {v!r}")
        for f in ("regenerated", "dissatisfied", "copied", "edited"):
            if getattr(self, f) > self.rewarded:
                raise ValueError(f"{f}: {getattr(self, f)} > rewarded {self.rewarded}")
        for f in ("reward_sum", "reward_sq_sum", "reward_min", "reward_max"):
            v = getattr(self, f)
            if f in ("reward_min", "reward_max") and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{f}: must be a finite number, got {v!r}")
        if self.reward_sq_sum < 0:
            raise ValueError(f"reward_sq_sum: must be >= 0, got {self.reward_sq_sum}")
        for f in ("kept_sum", "kept_sq_sum"):  # shares in [0, 1]: 0 <= sum k^2 <= sum k <= edited
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= self.edited + 1e-9:
                raise ValueError(f"{f}: must be a number in [0, edited = {self.edited}], got {v!r}")
        if self.kept_sq_sum > self.kept_sum + 1e-9:
            raise ValueError(f"kept_sq_sum: {self.kept_sq_sum} > kept_sum {self.kept_sum} (shares are in [0, 1])")

        cov = (self.x_sum, self.xx_sum, self.xy_sum)
        if any(v is not None for v in cov):
            if any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in cov):
                raise ValueError(f"x_sum, xx_sum, xy_sum: all three finite numbers or all None, got {cov}")
            if self.xx_sum < 0:
                raise ValueError(f"xx_sum: must be >= 0, got {self.xx_sum}")

    @property
    def votes(self) -> int:
        return self.votes_up + self.votes_down

    @property
    def has_covariate(self) -> bool:
        return self.x_sum is not None


def _f(default, description, unit=None, cli=True, **bounds):
    """A :class:`AnalysisConfig` field: default, help, unit and bounds (one declaration)."""
    extra = {"unit": unit} if unit else {}
    if not cli:
        extra["cli"] = False
    return Field(default, description=description, json_schema_extra=extra or None, **bounds)


@config_dataclass
class AnalysisConfig:
    """Thresholds of the canary analysis; each field's ``description`` is its help (the
    ``flywheel controller`` option of the same name, ``[controller]`` in ``flywheel.toml``).

    Quality (sequential test): ``quality`` (``reward``: the mean reward by the declared reward
    policy, :func:`check_reward`; ``thumbs``: the thumbs-up rate, :func:`check_thumbs`;
    shards without reward columns decide on thumbs either way), ``min_votes`` (burn-in, in
    votes or rewarded samples), ``alpha``, ``delta`` (the thumbs-up test's RELATIVE
    non-inferiority margin: PASS when the always-valid lower bound of ``rate(candidate) /
    rate(stable) - 1`` is above ``-delta``), ``reward_delta`` (the reward test's margin, the
    same rule on the distance from the worst reward, ``mean + reward_clip``: D90, D113), ``tau`` and ``cuped`` (:func:`deploy.stats.cuped_rate`;
    thumbs only), ``reward_clip`` (every reward is in ``[-reward_clip, reward_clip]``: the
    reward policy's clip) and ``reward_center``.

    Signal guards (each feedback signal's share, both ways, :func:`check_signal_guards`):
    ``signal_margin`` and ``signal_floor``.

    Operational (error rate, p99 latency, tokens/s): ``min_requests`` per arm before these
    are judged (latency and tokens/s are gated on ``latency_samples`` when the source gives
    it, else on ``requests``; only a source that counts neither has them judged as given),
    the limits ``max_error_rate_increase``, ``max_p99_ratio``, ``min_tokens_per_s_ratio``,
    and ``failure_limit`` (Flagger's threshold, Argo's failureLimit).

    Reward-hacking guards (from each arm's completions; also against the first version):
    ``min_guard_completions`` and the limits on length, no-answer, truncated and repetitive
    replies.

    Raises:
        ValueError (pydantic's ValidationError): a value out of its bounds or not finite,
            naming the field.
    """

    min_votes: int = _f(10, "votes per arm before the sequential thumbs-up test decides (burn-in)", "votes", ge=1)
    alpha: float = _f(0.05, "error level of the always-valid interval, in (0, 1)")
    delta: float = _f(0.2, "relative non-inferiority margin in (0, 1): advance when the always-valid lower bound "
                      "of rate(candidate) / rate(stable) - 1 is above -delta (0.2: the candidate keeps more than "
                      "80 % of the stable's thumbs-up rate)")
    reward_delta: float = _f(0.08, "relative non-inferiority margin of the reward test in (0, 1), on the distance "
                             "from the worst reward (D90): advance when the always-valid lower bound of (mean "
                             "reward(candidate) + clip) / (mean reward(stable) + clip) - 1 is above -reward_delta "
                             "(0.08: under the default [reward] policy a candidate at half a stable's mean reward "
                             "is outside the margin for any stable mean above +0.19; D113)")
    tau: Optional[float] = _f(None, "mixing standard deviation of the mSPRT on the log rate ratio (default "
                              "-log(1 - delta): the distance of a candidate exactly at the margin); > 0")
    quality: str = _f("reward", "what the sequential test judges: reward (the mean reward of the samples by the "
                      "declared reward policy; shards without reward columns decide on thumbs) or thumbs (the "
                      "thumbs-up rate)")
    reward_clip: Optional[float] = _f(None, "bound of the samples' rewards: the reward policy clips every reward "
                                      "to [-reward_clip, reward_clip]; the reward test's bounds need it (a reward "
                                      "outside is an error); > 0 (default: the clip of this process' [reward] policy)")
    reward_center: float = _f(0.0, "fixed center of the reward test's empirical-Bernstein variance process, in "
                              "[-reward_clip, reward_clip]: any value is valid, one near the stable's mean reward "
                              "gives the narrowest bounds (default 0, the policy's neutral reward)")
    signal_margin: float = _f(0.1, "a feedback signal's share fails its guard when shown (always-valid bounds) worse "
                              "than the stable's by more than this relative margin: a negative signal (regenerated, "
                              "dissatisfied follow-up) above (1 + margin) times, a positive one (copied) below "
                              "(1 - margin) times the stable's; in [0, 1)", ge=0)
    signal_floor: float = _f(0.01, "the shown change of a signal's share must also exceed this absolute share "
                             "before its guard fails; in [0, 1]", ge=0, le=1)
    cuped: bool = Field(True, description="adjust each arm's thumbs-up rate by the voting users' pre-canary "
                        "thumbs-up rate when both arms carry it (CUPED)", json_schema_extra={"flags": "--cuped/--no-cuped"})
    min_requests: int = _f(20, "requests per arm before error rate, p99 latency and tokens/s are judged",
                           "requests", ge=1)
    max_error_rate_increase: float = _f(0.02, "allowed absolute error-rate increase of the candidate", ge=0)
    max_p99_ratio: float = _f(1.5, "allowed candidate/stable p99 latency ratio", ge=0)
    min_tokens_per_s_ratio: float = _f(0.67, "required candidate/stable tokens/s ratio", ge=0)
    failure_limit: int = _f(3, "failed checks in a row before an operational metric or a reward-hacking guard "
                            "fails the step", "checks", ge=1)
    min_guard_completions: int = _f(10, "completions per arm before the reward-hacking guards are judged",
                                    "completions", ge=1)
    max_length_ratio: float = _f(1.5, "allowed candidate/stable mean completion length", ge=0)
    min_length_ratio: float = _f(0.67, "required candidate/stable mean completion length (replies that collapse "
                                 "to a bare answer or a format shortcut fail too)", ge=0)
    max_no_answer_increase: float = _f(0.15, "allowed absolute increase of the share of replies with no answer",
                                       ge=0)
    max_truncated_increase: float = _f(0.15, "allowed absolute increase of the share of replies cut at max_tokens",
                                       ge=0)
    max_repetitive_increase: float = _f(0.15, "allowed absolute increase of the share of repetitive replies", ge=0)
    max_share_ratio: float = _f(2.0, "allowed candidate/baseline ratio of a guarded share (no answer, truncated, "
                                "repetitive) once the increase is over share_ratio_floor and shown at 95 % (Newcombe): a "
                                "share that more than doubles fails at any base rate (inf: the absolute limits "
                                "alone)", ge=1)
    share_ratio_floor: float = _f(0.05, "increase of a guarded share below which max_share_ratio is not judged "
                                  "(a few replies more on a share near 0 is noise, not drift); in [0, 1], 1 turns "
                                  "the relative rule off", ge=0, le=1)

    def __post_init__(self):  # open bounds: schemas.options cannot give click gt/lt yet
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha: must be in (0, 1), got {self.alpha}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta: must be in (0, 1) (relative margin: the candidate keeps more than "
                             f"1 - delta of the stable's rate), got {self.delta}")
        if not 0 < self.reward_delta < 1:
            raise ValueError(f"reward_delta: must be in (0, 1) (relative margin of the reward test: the candidate "
                             f"keeps more than 1 - reward_delta of the stable's distance from the worst reward), "
                             f"got {self.reward_delta}")
        if self.tau is not None and not self.tau > 0:
            raise ValueError(f"tau: must be > 0 or None (= -log(1 - delta)), got {self.tau}")
        if not 0 <= self.signal_margin < 1:
            raise ValueError(f"signal_margin: must be in [0, 1), got {self.signal_margin}")
        if self.quality not in QUALITY:
            raise ValueError(f"quality: must be one of {QUALITY}, got {self.quality!r}")
        if self.reward_clip is not None and not (math.isfinite(self.reward_clip) and self.reward_clip > 0):
            raise ValueError(f"reward_clip: must be a finite number > 0, got {self.reward_clip!r}")
        if not math.isfinite(self.reward_center):
            raise ValueError(f"reward_center: must be a finite number, got {self.reward_center!r}")
        for f in ("max_error_rate_increase", "max_p99_ratio", "min_tokens_per_s_ratio", "max_length_ratio",
                  "min_length_ratio", "max_no_answer_increase", "max_truncated_increase", "max_repetitive_increase",
                  "share_ratio_floor", "signal_margin", "signal_floor"):
            v = getattr(self, f)
            if not math.isfinite(v):
                raise ValueError(f"{f}: must be a finite number >= 0, got {v!r}")

    @property
    def reward_bound(self) -> float:
        """``reward_clip`` or, when None, the clip of this process' reward policy
        (``schemas.reward.RewardPolicy.from_env()``: ``[reward]`` in ``flywheel.toml`` or the
        ``FLYWHEEL_REWARD__*`` variables).

        Raises:
            ValueError: that policy is refused (the message names the variable or field), or
                ``reward_center`` lies outside ``[-bound, bound]``."""
        from schemas.reward import RewardPolicy

        b = self.reward_clip if self.reward_clip is not None else RewardPolicy.from_env().clip
        if abs(self.reward_center) > b:
            raise ValueError(f"reward_center: must be in [-reward_clip, reward_clip] = [-{b:g}, {b:g}], got "
                             f"{self.reward_center!r}")
        return float(b)

    @property
    def mixing_tau(self) -> float:
        """``tau`` or, when None, ``-log(1 - delta)``."""
        return self.tau if self.tau is not None else margin_tau(self.delta)


@dataclass
class MetricResult:
    name: str
    check: Check
    reason: str
    numbers: dict = field(default_factory=dict)


@dataclass
class Decision:
    """Outcome of one analysis with the per-metric results and a human reason.

    ``failed_checks`` is the updated count of failed checks in a row per operational metric
    and guard (persist it and pass it to the next :func:`analyze`). ``decided_by`` names what
    decided a PROMOTE or ROLLBACK: ``sequential_test``, ``operational`` or ``guard``
    (``error`` for an ERROR hold; None for an inconclusive hold)."""

    outcome: Outcome
    reason: str
    metrics: list[MetricResult]
    inconclusive: bool  # HOLD because of too little data (not an error)
    error: bool  # HOLD because some metric could not be evaluated
    failed_checks: dict[str, int] = field(default_factory=dict)
    decided_by: str | None = None

    def numbers(self) -> dict:
        """JSON-ready numbers of every metric (for the ledger)."""
        return {m.name: {"check": m.check.value, **m.numbers} for m in self.metrics}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["outcome"] = self.outcome.value
        for m in d["metrics"]:
            m["check"] = m["check"].value
        return d


def thumbs_bounds(up_c, n_c, up_s, n_s, cfg: AnalysisConfig, cov_c=None, cov_s=None):
    """The always-valid decision bounds on ``rate_c / rate_s - 1``
    (:func:`deploy.stats.noninferiority_bounds`) on scalars or arrays of counts (unchecked,
    n > 0): the one implementation :func:`check_thumbs` judges with and ``bench/canary.py``
    simulates, vectorised over canaries.

    Args:
        up_c, n_c, up_s, n_s: up-votes and votes per arm.
        cfg: ``alpha``, ``delta``/``tau`` and ``cuped``.
        cov_c, cov_s: ``(x_sum, xx_sum, xy_sum)`` per arm (see :class:`ArmStats`) or None.

    Returns:
        ``(rel, lo, hi, adjusted)``; ``adjusted`` when CUPED was applied (``cfg.cuped`` and
        both arms carry the covariate).
    """
    if not (cfg.cuped and cov_c is not None and cov_s is not None):
        return (*noninferiority_bounds(up_c, n_c, up_s, n_s, cfg.alpha, cfg.mixing_tau), False)
    arms = [(n_c, up_c, *cov_c), (n_s, up_s, *cov_s)]
    theta, mu_x = cuped_theta(arms)
    (mc, vc), (ms, vs) = (cuped_rate(*a, theta, mu_x) for a in arms)
    return (*noninferiority_bounds(up_c, n_c, up_s, n_s, cfg.alpha, cfg.mixing_tau, mc, vc, ms, vs), True)


def thumbs_verdict(lo, hi, delta: float):
    """``(passed, failed)`` of the sequential test from its bounds (scalars or arrays): FAIL
    when ``hi < 0``, PASS when ``lo > -delta`` and not FAIL."""
    failed = hi < 0
    return (lo > -delta) & ~failed, failed


def check_thumbs(c: ArmStats, s: ArmStats, cfg: AnalysisConfig) -> MetricResult:
    """The sequential thumbs-up test (module docstring): PASS when the always-valid lower
    bound of ``rate_c / rate_s - 1`` is above ``-delta``, FAIL when its upper bound is below 0."""
    nums = {"candidate_up": c.votes_up, "candidate_votes": c.votes, "stable_up": s.votes_up,
            "stable_votes": s.votes, "min_votes": cfg.min_votes, "alpha": cfg.alpha, "delta": cfg.delta,
            "tau": cfg.mixing_tau, "scale": "relative",
            "method": "mSPRT (Johari, Pekelis, Walsh 2017), normal mixture: PASS on log(rate_c / rate_s), "
                      "FAIL as a score test on rate_c - rate_s"}
    if c.votes:
        nums["candidate_rate"] = c.votes_up / c.votes
    if s.votes:
        nums["stable_rate"] = s.votes_up / s.votes
    if c.votes < cfg.min_votes or s.votes < cfg.min_votes:
        return MetricResult("thumbs_up", Check.INCONCLUSIVE,
                            f"too few votes: candidate {c.votes}, stable {s.votes}, need {cfg.min_votes} per arm",
                            nums)
    cov = [(a.x_sum, a.xx_sum, a.xy_sum) if a.has_covariate else None for a in (c, s)]
    rel, lo, hi, adjusted = (float(v) for v in thumbs_bounds(float(c.votes_up), float(c.votes), float(s.votes_up),
                                                              float(s.votes), cfg, *cov))
    adjusted = bool(adjusted)
    passed, failed = thumbs_verdict(lo, hi, cfg.delta)
    nums.update(diff=rel, ci_lo=lo, ci_hi=hi, abs_diff=nums["candidate_rate"] - nums["stable_rate"], cuped=adjusted)
    what = (f"thumbs-up {nums['candidate_rate']:.3f} ({c.votes_up}/{c.votes}) vs {nums['stable_rate']:.3f} "
            f"({s.votes_up}/{s.votes}): relative {rel:+.1%}, always-valid {1 - cfg.alpha:.0%} interval "
            f"[{lo:+.1%}, {hi:+.1%}]{' (CUPED)' if adjusted else ''}")
    return _sequential_result("thumbs_up", what, passed, failed, cfg.delta, nums)


def _sequential_result(metric: str, what: str, passed: bool, failed: bool, delta: float,
                       nums: dict) -> MetricResult:
    """The sequential test's result from its verdict (:func:`thumbs_verdict`): FAIL when the
    candidate is surely worse (wins over PASS), PASS when not worse than the margin ``delta``,
    else INCONCLUSIVE; ``what`` describes the figures."""
    if failed:
        return MetricResult(metric, Check.FAIL, f"{what}: candidate surely worse (upper bound < 0)", nums)
    if passed:
        return MetricResult(metric, Check.PASS, f"{what}: not worse than the margin (lower bound > -{delta:.0%})", nums)
    return MetricResult(metric, Check.INCONCLUSIVE, f"{what}: undecided (lower bound <= -{delta:.0%}, "
                        "upper bound >= 0)", nums)


def reward_bounds(n_c, sum_c, sq_c, n_s, sum_s, sq_s, cfg: AnalysisConfig):
    """The reward test's always-valid bounds (scalars or arrays, unchecked): the one
    implementation :func:`check_reward` judges with and ``bench/canary.py`` simulates,
    vectorised over canaries.

    Each arm's mean reward gets the empirical-Bernstein confidence sequence of
    :func:`deploy.stats.eb_mean_bounds` (observations in ``[-b, b]``, ``b`` =
    ``cfg.reward_bound``, the reward policy's clip,
    center ``reward_center``) at level ``alpha / 2`` (``alpha / 4`` per side), so the box
    ``[lc, hc] x [ls, hs]`` holds the two true means at every look at once with probability
    at least ``1 - alpha``. The decision bounds on the relative difference are
    :func:`deploy.stats.relative_box_bounds` of the means' distances from the worst reward
    ``-b`` (the box shifted by ``b``): PASS (``lo > -delta``) when every point of the box has
    ``mean_c + b > (1 - delta) (mean_s + b)`` (the candidate keeps more than ``1 - delta`` of
    the stable's distance from the worst reward, as the thumbs test asks of a rate's distance
    from 0; the distance is floored at :data:`MIN_DISTANCE` ``* b`` only so that a stable at
    exactly ``-b`` divides by no zero), FAIL
    (``hi < 0``) when every point has the candidate's mean below the stable's. A policy of
    thumbs alone (every reward +-1) gets the thumbs-up rule on rates: ``mean + 1 = 2 rate``.

    Args:
        n_c, sum_c, sq_c: the candidate's rewarded samples, ``sum r``, ``sum r^2``.
        n_s, sum_s, sq_s: the same for the stable version.
        cfg: ``alpha``, ``reward_clip``, ``reward_center``.

    Returns:
        ``(rel, lo, hi, (lc, hc), (ls, hs))``: ``rel = (mean_c - mean_s) / (mean_s + b)``,
        the decision bounds, and each arm's bounds of its mean reward (float64).
    """
    b = cfg.reward_bound
    _, lc, hc = eb_mean_bounds(n_c, sum_c, sq_c, -b, b, cfg.alpha / 2, cfg.reward_center)
    _, ls, hs = eb_mean_bounds(n_s, sum_s, sq_s, -b, b, cfg.alpha / 2, cfg.reward_center)
    floor = MIN_DISTANCE * b
    with np.errstate(invalid="ignore", divide="ignore"):
        m_c, m_s = sum_c / np.maximum(n_c, 1), sum_s / np.maximum(n_s, 1)
    rel = (m_c - m_s) / relative_margin_scale(m_s + b, floor)
    lo, hi = relative_box_bounds(lc + b, hc + b, ls + b, hs + b, floor)
    return rel, lo, hi, (lc, hc), (ls, hs)


#: The least distance of the stable's mean reward from the worst reward, as a share of the clip,
#: in the reward test's denominator: only a stable at exactly ``-clip`` reaches it.
MIN_DISTANCE = 1e-12


def _inconsistent_sums(a: ArmStats, b: float) -> str | None:
    """Which of ``a``'s reward sums no ``a.rewarded`` rewards in ``[-b, b]`` (and in
    ``[reward_min, reward_max]`` when given) can have, as ``"<field> <why>"``, or None."""
    n, tol = a.rewarded, 1e-9
    mean, sq = a.reward_sum / n, a.reward_sq_sum / n
    if abs(mean) > b * (1 + tol):
        return f"reward_sum: mean {mean:g} is outside [-{b:g}, {b:g}]"
    if sq > b * b * (1 + tol) or mean * mean > sq * (1 + tol) + tol * b * b:
        return f"reward_sq_sum: mean square {sq:g} is not between the mean's square {mean * mean:g} and {b * b:g}"
    lo_r, hi_r = a.reward_min, a.reward_max
    if lo_r is not None and hi_r is not None and not lo_r - tol * b <= mean <= hi_r + tol * b:
        return f"reward_min/reward_max: the mean {mean:g} is outside [{lo_r:g}, {hi_r:g}]"
    return None


def check_reward(c: ArmStats, s: ArmStats, cfg: AnalysisConfig) -> MetricResult:
    """The sequential reward test (``quality = reward``): PASS when every mean pair in the
    always-valid box of :func:`reward_bounds` keeps more than ``1 - reward_delta`` of the
    stable's distance from the worst reward (``lo > -reward_delta``), FAIL when every pair has the candidate below the stable
    (``hi < 0``), INCONCLUSIVE before ``min_votes`` rewarded samples per arm or while neither
    holds; ERROR when a reward lies outside ``[-reward_clip, reward_clip]`` (the bounds would
    not hold), an arm's sums cannot come from such rewards (:func:`_inconsistent_sums`), the
    bounds are not finite, or the reward policy's clip cannot be read."""
    try:
        b = cfg.reward_bound
    except ValueError as exc:
        return MetricResult("reward", Check.ERROR, f"reward bound: {exc}", {})
    if cfg.reward_clip is None:
        cfg = replace(cfg, reward_clip=b)  # read the policy once per check
    nums = {"candidate_samples": c.rewarded, "stable_samples": s.rewarded, "min_samples": cfg.min_votes,
            "alpha": cfg.alpha, "delta": cfg.reward_delta, "reward_clip": b, "reward_center": cfg.reward_center,
            "scale": "relative to the distance from -reward_clip",
            "method": "empirical-Bernstein confidence sequence per arm (Howard et al. 2021, Thm 4; discrete "
                      "mixture, Ville), alpha/2 per arm; PASS when lc + clip > (1 - reward_delta) (hs + clip), "
                      "FAIL when hc < ls"}
    if c.reward_policy is not None or s.reward_policy is not None:
        nums["reward_policy"] = c.reward_policy or s.reward_policy
        if c.reward_policy != s.reward_policy and c.rewarded and s.rewarded:
            return MetricResult("reward", Check.ERROR, f"the arms' rewards are by different reward policies "
                                f"({c.reward_policy} vs {s.reward_policy}): not comparable", nums)
    for a, name in ((c, "candidate"), (s, "stable")):
        if a.rewarded:
            nums[f"{name}_mean"] = a.reward_sum / a.rewarded
            lo_r, hi_r = a.reward_min, a.reward_max
            if lo_r is not None and hi_r is not None and (lo_r < -b or hi_r > b):
                return MetricResult("reward", Check.ERROR, f"{name} rewards span [{lo_r:g}, {hi_r:g}], outside "
                                    f"reward_clip's [-{b:g}, {b:g}]: set reward_clip to the reward policy's clip",
                                    nums)
            bad = _inconsistent_sums(a, b)
            if bad is not None:
                return MetricResult("reward", Check.ERROR, f"{name} {bad}: no rewards in [-{b:g}, {b:g}] have "
                                    f"these sums (the source's counts are wrong)", nums)
    if c.rewarded < cfg.min_votes or s.rewarded < cfg.min_votes:
        return MetricResult("reward", Check.INCONCLUSIVE, f"too few rewarded samples: candidate {c.rewarded}, "
                            f"stable {s.rewarded}, need {cfg.min_votes} per arm", nums)
    rel, lo, hi, (lc, hc), (ls, hs) = (v for v in reward_bounds(
        float(c.rewarded), c.reward_sum, c.reward_sq_sum, float(s.rewarded), s.reward_sum, s.reward_sq_sum, cfg))
    rel, lo, hi, lc, hc, ls, hs = (float(v) for v in (rel, lo, hi, lc, hc, ls, hs))
    if not all(map(math.isfinite, (rel, lo, hi, lc, hc, ls, hs))):
        return MetricResult("reward", Check.ERROR, f"the reward test's bounds are not finite at reward_clip "
                            f"{b:g} (too small for float64 arithmetic)", nums)
    passed, failed = thumbs_verdict(lo, hi, cfg.reward_delta)
    mc, ms = nums["candidate_mean"], nums["stable_mean"]
    nums.update(diff=rel, ci_lo=lo, ci_hi=hi, abs_diff=mc - ms, candidate_bounds=[lc, hc], stable_bounds=[ls, hs])
    what = (f"mean reward {mc:+.3f} (n={c.rewarded}, always-valid [{lc:+.3f}, {hc:+.3f}]) vs {ms:+.3f} "
            f"(n={s.rewarded}, [{ls:+.3f}, {hs:+.3f}]): relative {rel:+.1%}, decision bounds [{lo:+.1%}, {hi:+.1%}]")
    return _sequential_result("reward", what, passed, failed, cfg.reward_delta, nums)


def judges_reward(c: ArmStats, s: ArmStats, cfg: AnalysisConfig) -> bool:
    """Whether the sequential test judges reward: ``quality = reward`` and some sample of
    either arm carries a reward under the reward policy (shards written before the policy,
    thumbs only, decide on thumbs as before)."""
    return cfg.quality == "reward" and (c.rewarded > 0 or s.rewarded > 0)


def check_quality(c: ArmStats, s: ArmStats, cfg: AnalysisConfig) -> list[MetricResult]:
    """The sequential test and, when it judges reward, the thumbs-up rate as a guard.

    With :func:`judges_reward`, the first result is :func:`check_reward`; the thumbs-up
    test (:func:`check_thumbs`) then guards the thumbs signal: FAIL when its always-valid
    upper bound of ``rate_c / rate_s - 1`` is below ``-signal_margin``, SKIPPED before
    ``min_votes`` votes per arm (thumbs come on a few replies; waiting for them would hold
    every canary), PASS otherwise, its interval kept in the numbers. Otherwise the first and
    only result is :func:`check_thumbs`, which decides as it always has."""
    if not judges_reward(c, s, cfg):
        return [check_thumbs(c, s, cfg)]
    t = check_thumbs(c, s, cfg)
    t.numbers["role"] = "guard"
    if c.votes < cfg.min_votes or s.votes < cfg.min_votes:
        t = MetricResult("thumbs_up", Check.SKIPPED, f"thumbs-up guard: {t.reason}", t.numbers)
    elif t.numbers["ci_hi"] < -cfg.signal_margin:
        t = MetricResult("thumbs_up", Check.FAIL, f"{t.reason.split(': ')[0]}: thumbs-up surely worse by more "
                         f"than {cfg.signal_margin:.0%} (upper bound < -{cfg.signal_margin:.0%})", t.numbers)
    else:
        t = MetricResult("thumbs_up", Check.PASS, f"{t.reason.split(': ')[0]}: thumbs-up not shown worse", t.numbers)
    return [check_reward(c, s, cfg), t]


def signal_bounds(k_c, n_c, k_s, n_s, cfg: AnalysisConfig, worse: str, center: float, sq_c=None, sq_s=None):
    """A signal guard's verdict on shares ``k / n`` (scalars or arrays, unchecked): each arm's
    share gets the empirical-Bernstein confidence sequence of
    :func:`deploy.stats.eb_mean_bounds` on ``[0, 1]`` with the fixed ``center`` at level
    ``alpha / 2``, the same box as the reward test's. ``worse = "up"`` (a negative signal)
    fails when ``lc > (1 + signal_margin) hs`` and ``lc - hs > signal_floor``; ``"down"``
    (a positive signal) when ``hc < (1 - signal_margin) ls`` and ``ls - hc > signal_floor``:
    the candidate's share is shown worse than the stable's by more than the relative margin.
    A mean of values in ``[0, 1]`` (the kept share) passes their sums of squares ``sq_c`` /
    ``sq_s``; a share of counts has ``sum x^2 = sum x = k`` (the default).

    Returns ``(failed, (lc, hc), (ls, hs))``."""
    _, lc, hc = eb_mean_bounds(n_c, k_c, k_c if sq_c is None else sq_c, 0.0, 1.0, cfg.alpha / 2, center)
    _, ls, hs = eb_mean_bounds(n_s, k_s, k_s if sq_s is None else sq_s, 0.0, 1.0, cfg.alpha / 2, center)
    m, f = cfg.signal_margin, cfg.signal_floor
    if worse == "up":
        failed = (lc > (1 + m) * hs) & (lc - hs > f)
    else:
        failed = (hc < (1 - m) * ls) & (ls - hc > f)
    return failed, (lc, hc), (ls, hs)


def check_signal_guards(c: ArmStats, s: ArmStats, cfg: AnalysisConfig) -> list[MetricResult]:
    """Each feedback signal's share of the rewarded samples, candidate against stable
    (:data:`SIGNAL_GUARDS`, :func:`signal_bounds`): a candidate that regenerates or
    dissatisfies more, or is copied less, fails, so one that avoids negative signals by
    answering less (fewer regenerates, but fewer copies too) is caught as well as one that
    draws more of them; and the mean kept share of edited replies (:data:`KEPT_GUARD`), which
    fails when it falls. SKIPPED when neither arm has the guard's samples (shards without the
    signal columns; no edits). Before ``min_guard_completions`` of them per arm a share guard
    is INCONCLUSIVE (its samples are the reward test's, which waits for as many), while the
    kept-share guard is SKIPPED: edits come on a few replies, and, as the thumbs-up guard
    (:func:`check_quality`), a guard on a rare signal fails a canary once it has its samples
    but never holds one for want of them. Always-valid, so the failure limit only delays a
    FAIL."""
    out = []
    g, worse, center, label = KEPT_GUARD
    guards = [(g, worse, center, label, "rewarded samples", c.rewarded, getattr(c, g), None, s.rewarded,
               getattr(s, g), None) for g, worse, center, label in SIGNAL_GUARDS]
    guards.append((g, worse, center, label, "edited samples", c.edited, c.kept_sum, c.kept_sq_sum, s.edited,
                   s.kept_sum, s.kept_sq_sum))
    for g, worse, center, label, what_n, nc, kc, sqc, ns, ks, sqs in guards:
        if nc == 0 and ns == 0:
            out.append(MetricResult(g, Check.SKIPPED, f"{g} not measured (no {what_n})"))
            continue
        nums = {"candidate_n": nc, "baseline_n": ns, "against": "stable", "worse": worse,
                "margin": cfg.signal_margin, "floor": cfg.signal_floor, "center": center}
        if min(nc, ns) < cfg.min_guard_completions:
            rare = g == KEPT_GUARD[0]
            out.append(MetricResult(g, Check.SKIPPED if rare else Check.INCONCLUSIVE,
                                    f"{g}: {nc} vs {ns} {what_n}, need {cfg.min_guard_completions} per arm"
                                    + (" (a rare signal's guard: not judged yet, holds nothing)" if rare else ""),
                                    nums))
            continue
        failed, (lc, hc), (ls, hs) = signal_bounds(float(kc), float(nc), float(ks), float(ns), cfg, worse, center,
                                                   sqc, sqs)
        rc, rs = kc / nc, ks / ns
        nums.update(candidate_share=rc, baseline_share=rs, candidate_bounds=[float(lc), float(hc)],
                    baseline_bounds=[float(ls), float(hs)])
        what = (f"{label} {rc:.3f} [{float(lc):.3f}, {float(hc):.3f}] vs {rs:.3f} [{float(ls):.3f}, {float(hs):.3f}] "
                "(stable, always-valid)")
        if bool(failed):
            more = "more" if worse == "up" else "less"
            out.append(MetricResult(g, Check.FAIL, f"{what}: surely {more} than the stable's by over "
                                    f"{cfg.signal_margin:.0%} and {cfg.signal_floor:g}", nums))
        else:
            out.append(MetricResult(g, Check.PASS, what, nums))
    return out


def check_errors(c: ArmStats, s: ArmStats, cfg: AnalysisConfig) -> MetricResult:
    nums = {"candidate_errors": c.errors, "candidate_requests": c.requests,
            "stable_errors": s.errors, "stable_requests": s.requests}
    if c.requests < cfg.min_requests or s.requests < cfg.min_requests:
        return MetricResult("error_rate", Check.INCONCLUSIVE,
                            f"too few requests: candidate {c.requests}, stable {s.requests}, "
                            f"need {cfg.min_requests}", nums)
    rc, rs = c.errors / c.requests, s.errors / s.requests
    nums.update(candidate_rate=rc, stable_rate=rs, max_increase=cfg.max_error_rate_increase)
    if rc - rs > cfg.max_error_rate_increase:
        return MetricResult("error_rate", Check.FAIL,
                            f"error rate {rc:.3f} vs {rs:.3f}: +{rc - rs:.3f} > {cfg.max_error_rate_increase}", nums)
    return MetricResult("error_rate", Check.PASS, f"error rate {rc:.3f} vs {rs:.3f}", nums)


def _ratio_check(name: str, cv, sv, limit: float, higher_is_worse: bool, unit: str,
                 n: tuple[int, int] | None = None, min_n: int = 0) -> MetricResult:
    nums = {"candidate": cv, "stable": sv, "limit_ratio": limit}
    if cv is None or sv is None:
        return MetricResult(name, Check.SKIPPED, f"{name} not measured", nums)
    if n is not None and min(n) < min_n:  # a p99 of 6 requests is their max
        nums.update(candidate_n=n[0], stable_n=n[1])
        return MetricResult(name, Check.INCONCLUSIVE, f"{name}: {n[0]} vs {n[1]} completions, need {min_n} "
                            "per arm", nums)
    if any(isinstance(v, float) and not math.isfinite(v) for v in (cv, sv)):
        return MetricResult(name, Check.ERROR, f"{name} is not a finite number ({cv} vs {sv})", nums)
    if sv == 0:
        return MetricResult(name, Check.INCONCLUSIVE, f"{name}: stable is 0 {unit}", nums)
    r = cv / sv
    nums["ratio"] = r
    bad = r > limit if higher_is_worse else r < limit
    op = ">" if higher_is_worse else "<"
    if bad:
        return MetricResult(name, Check.FAIL, f"{name} {cv:.1f} vs {sv:.1f} {unit}: ratio {r:.2f} {op} {limit}", nums)
    return MetricResult(name, Check.PASS, f"{name} {cv:.1f} vs {sv:.1f} {unit}: ratio {r:.2f}", nums)


_SHARE_GUARDS = (("no_answer", "max_no_answer_increase", "replies with no answer"),
                 ("truncated", "max_truncated_increase", "replies cut at max_tokens"),
                 ("repetitive", "max_repetitive_increase", "repetitive replies"))


def _mean_length(a: ArmStats) -> float | None:
    """Mean length (tokens) of the replies that finished on their own (not cut at
    ``max_tokens``), or None when the source gives no ``truncated_tokens`` or every reply
    was cut."""
    finished = a.completions - a.truncated
    if a.truncated_tokens is None or finished <= 0:
        return None
    return (a.completion_tokens - a.truncated_tokens) / finished


def _share_increase_lower(up_c: int, n_c: int, share_s: float, n_s: int) -> float:
    """Lower bound of Newcombe's 95 % interval (method 10) of a share's increase, candidate
    ``up_c / n_c`` minus the baseline's ``share_s`` counted over ``n_s`` completions (a
    bridged share is rounded to a count at ``n_s``, the smallest of the arms it was moved
    through, so the stable window's noise is in the interval)."""
    up_s = min(n_s, max(0, round(share_s * n_s)))
    return newcombe_interval(up_s, n_s, up_c, n_c)[1]


def check_guards(c: ArmStats, s: ArmStats, cfg: AnalysisConfig, suffix: str = "",
                 against: str = "stable", bridge: tuple[ArmStats, ArmStats] | None = None) -> list[MetricResult]:
    """Reward-hacking guards: the candidate's replies must not drift from the baseline ``s``
    (the stable version, or the first version with ``suffix=VS_FIRST``) in length, either way,
    nor in the shares with no answer, cut at ``max_tokens`` or repetitive (module docstring).
    A share fails when it rises by more than its absolute limit (``max_*_increase``) or to more
    than ``max_share_ratio`` times the baseline's, by more than ``share_ratio_floor``, with the
    increase shown at 95 % (Newcombe's interval above 0): relative, so that 0.03 -> 0.11 over
    ~100 replies fails like 0.3 -> 0.7 would, while 0/50 -> 3/50 in a canary's first
    minutes does not (D64).

    ``bridge``: ``(stable in the canary's window, stable over all its completions)``. The
    candidate's figures come from the canary's window, a baseline's over its whole life, and a
    window is not a fair sample of a version's replies (short replies finish first, so a
    canary's first completions are short for both arms). With a bridge, the baseline is moved
    into the window through the stable, which was served beside the candidate: length
    ``l_s * l_stable_window / l_stable_all``, shares ``r_s + r_stable_window - r_stable_all``,
    so the check compares the candidate with the stable in the same window and the stable's
    whole life with the baseline's (drift still compounds into it) (D60)."""
    names = [g + suffix for g in GUARDS]
    n = (c.completions, s.completions)
    if c.completions == 0 and s.completions == 0:
        return [MetricResult(g, Check.SKIPPED, f"{g} not measured") for g in names]
    arms = [c, s, *(bridge or ())]
    if min(a.completions for a in arms) < cfg.min_guard_completions:
        why = (f"{n[0]} vs {n[1]} completions ({against}"
               + (f", stable {bridge[0].completions} in the window)" if bridge else ")")
               + f", need {cfg.min_guard_completions} per arm")
        return [MetricResult(g, Check.INCONCLUSIVE, f"{g}: {why}", {"candidate_n": n[0], "baseline_n": n[1]})
                for g in names]
    lengths, over = [_mean_length(a) for a in arms], "finished"
    if any(x is None for x in lengths):  # a source without truncated_tokens, or an arm with every reply cut
        lengths, over = [a.completion_tokens / a.completions for a in arms], "all"
    lc, ls = lengths[0], lengths[1]
    if bridge and lengths[3]:
        ls = ls * lengths[2] / lengths[3]
    nums = {"candidate": lc, "baseline": ls, "against": against, "max_ratio": cfg.max_length_ratio,
            "min_ratio": cfg.min_length_ratio, "candidate_n": n[0], "baseline_n": n[1], "over": over,
            "bridged": bridge is not None}
    what = (f"mean reply length {lc:.1f} vs {ls:.1f} tokens ({against}"
            + (" through the stable's window" if bridge else "")
            + (", replies not cut at max_tokens)" if over == "finished" else ")"))
    if ls == 0:
        out = [MetricResult(names[0], Check.INCONCLUSIVE, f"{what}: baseline is 0 tokens", nums)]
    else:
        r = nums["ratio"] = lc / ls
        if r > cfg.max_length_ratio:
            out = [MetricResult(names[0], Check.FAIL, f"{what}: ratio {r:.2f} > {cfg.max_length_ratio}", nums)]
        elif r < cfg.min_length_ratio:
            out = [MetricResult(names[0], Check.FAIL, f"{what}: ratio {r:.2f} < {cfg.min_length_ratio}", nums)]
        else:
            out = [MetricResult(names[0], Check.PASS, f"{what}: ratio {r:.2f}", nums)]
    for (g, limit_f, label), name in zip(_SHARE_GUARDS, names[1:]):
        limit = getattr(cfg, limit_f)
        rc, rs = getattr(c, g) / c.completions, getattr(s, g) / s.completions
        if bridge:  # a share stays in [0, 1] whatever the two windows' difference
            rs = min(1.0, max(0.0, rs + getattr(bridge[0], g) / bridge[0].completions
                              - getattr(bridge[1], g) / bridge[1].completions))
        nums = {"candidate_share": rc, "baseline_share": rs, "against": against, "max_increase": limit,
                "max_ratio": cfg.max_share_ratio, "ratio_floor": cfg.share_ratio_floor,
                "candidate_n": n[0], "baseline_n": n[1], "bridged": bridge is not None}
        if rc - rs > limit:
            out.append(MetricResult(name, Check.FAIL, f"{label} {rc:.2f} vs {rs:.2f} ({against}): "
                                    f"+{rc - rs:.2f} > {limit}", nums))
        elif rc - rs > cfg.share_ratio_floor and rc > cfg.max_share_ratio * rs and (
                lo := _share_increase_lower(getattr(c, g), c.completions, rs,
                                            min(a.completions for a in arms[1:]))) > 0:
            nums["increase_ci95_lo"] = lo
            out.append(MetricResult(name, Check.FAIL, f"{label} {rc:.2f} vs {rs:.2f} ({against}): "
                                    f"more than {cfg.max_share_ratio:g}x, +{rc - rs:.2f} > "
                                    f"{cfg.share_ratio_floor}, 95 % lower bound +{lo:.3f}", nums))
        else:
            out.append(MetricResult(name, Check.PASS, f"{label} {rc:.2f} vs {rs:.2f} ({against})", nums))
    return out


def _apply_failure_limit(m: MetricResult, counts: dict[str, int], limit: int) -> MetricResult:
    """Flagger/Argo semantics: FAIL only at the ``limit``-th failed check in a row."""
    if m.check == Check.FAIL:
        counts[m.name] = counts.get(m.name, 0) + 1
        m.numbers["failed_checks"] = counts[m.name]
        if counts[m.name] < limit:
            return MetricResult(m.name, Check.INCONCLUSIVE,
                                f"{m.reason} (failed check {counts[m.name]} of {limit} in a row)", m.numbers)
        m.reason = f"{m.reason} ({counts[m.name]} failed checks in a row, limit {limit})"
    elif m.check == Check.PASS:
        counts[m.name] = 0
    return m


def analyze(candidate: ArmStats, stable: ArmStats, cfg: AnalysisConfig | None = None,
            source_error: str | None = None, skipped: dict[str, str] | None = None,
            failed_checks: dict[str, int] | None = None, first: ArmStats | None = None,
            stable_all: ArmStats | None = None) -> Decision:
    """Compare ``candidate`` with ``stable``; worst metric wins. Pure: same inputs, same output.

    Args:
        candidate, stable: observed stats of each arm during the canary.
        cfg: thresholds (defaults of :class:`AnalysisConfig`).
        source_error: set when the metrics could not be read (e.g. Parquet unreadable):
            the decision is HOLD with ``error=True``.
        skipped: ``{metric: reason}`` for metrics the source does not provide
            (``error_rate``, ``p99_latency``, ``tokens_per_s`` or a guard): SKIPPED with that
            reason. The sequential test (``reward``, or ``thumbs_up`` when it judges thumbs)
            cannot be skipped (ValueError).
        failed_checks: failed checks in a row so far per operational metric and guard (the
            previous decision's ``failed_checks``; not modified).
        first: the first version's guard figures (``completions`` ... ``repetitive``), or None:
            each guard is then also checked against it (``<guard>_vs_first``).
        stable_all: the stable version's guard figures over all its completions, or None: with
            ``first``, the first version is compared through the stable's window
            (:func:`check_guards`' ``bridge``).

    Returns:
        :class:`Decision` with per-metric numbers, a one-line reason, the updated
        ``failed_checks`` and ``decided_by``.
    """
    cfg = cfg or AnalysisConfig()
    counts = dict(failed_checks or {})
    if source_error:
        m = MetricResult("source", Check.ERROR, f"metrics unavailable: {source_error}")
        return Decision(Outcome.HOLD, f"HOLD (error): {m.reason}", [m], inconclusive=False, error=True,
                        failed_checks=counts, decided_by="error")
    results = _judge_each(candidate, stable, cfg, first, stable_all)
    # Errors/requests are judged only once requests are counted: with no request counts at
    # all (source did not provide them) the metric is skipped rather than holding forever.
    names = [m.name for m in results]
    i_err = names.index("error_rate")
    if candidate.requests == 0 and stable.requests == 0 and results[i_err].check == Check.INCONCLUSIVE:
        results[i_err] = MetricResult("error_rate", Check.SKIPPED, "error rate not measured", results[i_err].numbers)
    for name, why in (skipped or {}).items():
        if name not in names[1:]:
            raise ValueError(f"skipped: {name!r} is not a skippable metric ({', '.join(names[1:])})")
        results[names.index(name)] = MetricResult(name, Check.SKIPPED, f"{name} skipped: {why}", {"skipped": why})
    results = [results[0]] + [_apply_failure_limit(m, counts, cfg.failure_limit) for m in results[1:]]
    return _worst_wins(results, counts)


def _judge_each(candidate: ArmStats, stable: ArmStats, cfg: AnalysisConfig, first: ArmStats | None,
                stable_all: ArmStats | None) -> list[MetricResult]:
    """Every metric's result, the sequential test first (:func:`analyze`'s arguments)."""
    if candidate.latency_samples is not None and stable.latency_samples is not None:
        n_lat: tuple[int, int] | None = (candidate.latency_samples, stable.latency_samples)
    elif candidate.requests or stable.requests:
        n_lat = (candidate.requests, stable.requests)
    else:
        n_lat = None  # the source counts neither: judged as given
    return [
        *check_quality(candidate, stable, cfg),
        check_errors(candidate, stable, cfg),
        _ratio_check("p99_latency", candidate.p99_ms, stable.p99_ms, cfg.max_p99_ratio, True, "ms",
                     n_lat, cfg.min_requests),
        _ratio_check("tokens_per_s", candidate.tokens_per_s, stable.tokens_per_s,
                     cfg.min_tokens_per_s_ratio, False, "tokens/s", n_lat, cfg.min_requests),
        *check_guards(candidate, stable, cfg),
        *check_signal_guards(candidate, stable, cfg),
        *(check_guards(candidate, first, cfg, VS_FIRST, "first version",
                       bridge=(stable, stable_all) if stable_all is not None and stable_all.completions else None)
          if first is not None else []),
    ]


def _worst_wins(results: list[MetricResult], counts: dict[str, int]) -> Decision:
    """The decision of judged ``results`` (the sequential test first): any FAIL rolls back,
    then an ERROR or INCONCLUSIVE holds, else PROMOTE; the reason lists the metrics of the
    deciding severity (every PASS for a promotion)."""
    worst = max(results, key=lambda m: _SEVERITY[m.check])
    sev = _SEVERITY[worst.check]
    bad = [m for m in results if _SEVERITY[m.check] == sev]
    decided_by = None
    if worst.check == Check.FAIL:
        outcome, tag = Outcome.ROLLBACK, "ROLLBACK"
        first_bad = bad[0].name
        decided_by = ("sequential_test" if first_bad == results[0].name else
                      "operational" if first_bad in OPERATIONAL else "guard")
    elif worst.check == Check.ERROR:
        outcome, tag, decided_by = Outcome.HOLD, "HOLD (error)", "error"
    elif worst.check == Check.INCONCLUSIVE:
        outcome, tag = Outcome.HOLD, "HOLD (inconclusive)"
    else:
        outcome, tag, decided_by = Outcome.PROMOTE, "PROMOTE", "sequential_test"
        bad = [m for m in results if m.check == Check.PASS]
    reason = f"{tag}: " + "; ".join(m.reason for m in bad)
    return Decision(outcome, reason, results,
                    inconclusive=worst.check == Check.INCONCLUSIVE,
                    error=worst.check == Check.ERROR, failed_checks=counts, decided_by=decided_by)
