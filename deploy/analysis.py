"""Canary analysis: pure functions that compare a candidate version with the stable one.

Metrics, each judged on its own into PASS | FAIL | INCONCLUSIVE | ERROR | SKIPPED:

* thumbs-up rate: one-sided two-proportion z-test (pooled standard error) of
  H1 "candidate's thumbs-up rate is lower than stable's". FAIL when p < ``alpha``;
  INCONCLUSIVE while either arm has fewer than ``min_votes`` votes; PASS otherwise
  ("not significantly worse"). z = (p_c - p_s) / sqrt(p(1-p)(1/n_c + 1/n_s)),
  p = (up_c + up_s) / (n_c + n_s), p-value = Phi(z) = 0.5 * erfc(-z / sqrt 2).
* error rate: FAIL when the candidate's error rate exceeds stable's by more than
  ``max_error_rate_increase`` (absolute), needs ``min_requests`` requests per arm.
* p99 latency (ms): FAIL when candidate p99 > stable p99 * ``max_p99_ratio``.
* tokens/s: FAIL when candidate < stable * ``min_tokens_per_s_ratio``.

Latency and tokens/s are SKIPPED when not measured (None). ERROR means the data could not
be read or is invalid (NaN, source failure): it is kept apart from INCONCLUSIVE (too little
data) so that an outage of the metrics source is never mistaken for "wait for more votes".

Combination is worst-wins: FAIL > ERROR > INCONCLUSIVE > PASS/SKIPPED. FAIL -> ROLLBACK;
ERROR or INCONCLUSIVE -> HOLD; all PASS/SKIPPED -> PROMOTE. With empty data the thumbs-up
metric is INCONCLUSIVE, so the decision can never be PROMOTE or ROLLBACK on empty data.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum


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
    """

    votes_up: int = 0
    votes_down: int = 0
    errors: int = 0
    requests: int = 0
    p99_ms: float | None = None
    tokens_per_s: float | None = None
    latency_samples: int | None = None

    def __post_init__(self):
        for f in ("votes_up", "votes_down", "errors", "requests", "latency_samples"):
            v = getattr(self, f)
            if f == "latency_samples" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{f}: must be an int >= 0, got {v!r}")
        if self.errors > self.requests:
            raise ValueError(f"errors: {self.errors} > requests {self.requests}")
        for f in ("p99_ms", "tokens_per_s"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, (int, float)) or v < 0):
                raise ValueError(f"{f}: must be a number >= 0 or None, got {v!r}")

    @property
    def votes(self) -> int:
        return self.votes_up + self.votes_down


@dataclass
class AnalysisConfig:
    """Thresholds of the canary analysis.

    Fields:
        min_votes: votes per arm before the thumbs-up test is run (default 20).
        alpha: one-sided significance level of "candidate worse" (default 0.05).
        min_requests: requests per arm before the error rate, p99 latency and tokens/s are
            judged (default 20). Latency and tokens/s are gated on ``latency_samples`` when
            the source gives it, else on ``requests``; only a source that counts neither
            (both 0 and no ``latency_samples``) has latency/tokens judged as given.
        max_error_rate_increase: allowed absolute error-rate increase (default 0.02).
        max_p99_ratio: allowed candidate/stable p99 latency ratio (default 1.5).
        min_tokens_per_s_ratio: required candidate/stable tokens/s ratio (default 0.67).
    """

    min_votes: int = 20
    alpha: float = 0.05
    min_requests: int = 20
    max_error_rate_increase: float = 0.02
    max_p99_ratio: float = 1.5
    min_tokens_per_s_ratio: float = 0.67

    def __post_init__(self):
        if self.min_votes < 1:
            raise ValueError(f"min_votes: must be >= 1, got {self.min_votes}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha: must be in (0, 1), got {self.alpha}")
        if self.min_requests < 1:
            raise ValueError(f"min_requests: must be >= 1, got {self.min_requests}")


@dataclass
class MetricResult:
    name: str
    check: Check
    reason: str
    numbers: dict = field(default_factory=dict)


@dataclass
class Decision:
    """Outcome of one analysis with the per-metric results and a human reason."""

    outcome: Outcome
    reason: str
    metrics: list[MetricResult]
    inconclusive: bool  # HOLD because of too little data (not an error)
    error: bool  # HOLD because some metric could not be evaluated

    def numbers(self) -> dict:
        """JSON-ready numbers of every metric (for the ledger)."""
        return {m.name: {"check": m.check.value, **m.numbers} for m in self.metrics}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["outcome"] = self.outcome.value
        for m in d["metrics"]:
            m["check"] = m["check"].value
        return d


def normal_cdf(x: float) -> float:
    """Standard normal CDF Phi(x)."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def two_proportion_z(up_c: int, n_c: int, up_s: int, n_s: int) -> tuple[float, float]:
    """One-sided pooled two-proportion z-test of H1: rate_c < rate_s.

    Returns:
        ``(z, p_value)``; z = 0, p = 0.5 when the pooled rate is 0 or 1 (no variance).

    Raises:
        ValueError: an arm has n = 0 or up > n.
    """
    if n_c <= 0 or n_s <= 0:
        raise ValueError(f"n: both arms need votes, got n_c={n_c}, n_s={n_s}")
    if not (0 <= up_c <= n_c and 0 <= up_s <= n_s):
        raise ValueError(f"up: must be within [0, n], got {up_c}/{n_c}, {up_s}/{n_s}")
    p = (up_c + up_s) / (n_c + n_s)
    se = math.sqrt(p * (1 - p) * (1 / n_c + 1 / n_s))
    if se == 0:
        return 0.0, 0.5
    z = (up_c / n_c - up_s / n_s) / se
    return z, normal_cdf(z)


def wilson_interval(up: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval of a proportion (95 % by default); (0, 1) when n = 0."""
    if n == 0:
        return 0.0, 1.0
    ph = up / n
    den = 1 + z * z / n
    c = (ph + z * z / (2 * n)) / den
    h = z * math.sqrt(ph * (1 - ph) / n + z * z / (4 * n * n)) / den
    return max(0.0, c - h), min(1.0, c + h)


def check_thumbs(c: ArmStats, s: ArmStats, cfg: AnalysisConfig) -> MetricResult:
    nums = {"candidate_up": c.votes_up, "candidate_votes": c.votes, "stable_up": s.votes_up,
            "stable_votes": s.votes, "min_votes": cfg.min_votes, "alpha": cfg.alpha}
    if c.votes:
        nums["candidate_rate"] = c.votes_up / c.votes
    if s.votes:
        nums["stable_rate"] = s.votes_up / s.votes
    if c.votes < cfg.min_votes or s.votes < cfg.min_votes:
        return MetricResult("thumbs_up", Check.INCONCLUSIVE,
                            f"too few votes: candidate {c.votes}, stable {s.votes}, need {cfg.min_votes} per arm",
                            nums)
    z, pv = two_proportion_z(c.votes_up, c.votes, s.votes_up, s.votes)
    nums.update(z=z, p_value=pv)
    rates = f"{nums['candidate_rate']:.3f} vs {nums['stable_rate']:.3f}"
    if pv < cfg.alpha:
        return MetricResult("thumbs_up", Check.FAIL,
                            f"thumbs-up {rates}: candidate worse (z={z:.2f}, one-sided p={pv:.4f} < {cfg.alpha})",
                            nums)
    return MetricResult("thumbs_up", Check.PASS,
                        f"thumbs-up {rates}: not worse (z={z:.2f}, one-sided p={pv:.4f})", nums)


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
    if any(isinstance(v, float) and math.isnan(v) for v in (cv, sv)):
        return MetricResult(name, Check.ERROR, f"{name} is NaN", nums)
    if sv == 0:
        return MetricResult(name, Check.INCONCLUSIVE, f"{name}: stable is 0 {unit}", nums)
    r = cv / sv
    nums["ratio"] = r
    bad = r > limit if higher_is_worse else r < limit
    op = ">" if higher_is_worse else "<"
    if bad:
        return MetricResult(name, Check.FAIL, f"{name} {cv:.1f} vs {sv:.1f} {unit}: ratio {r:.2f} {op} {limit}", nums)
    return MetricResult(name, Check.PASS, f"{name} {cv:.1f} vs {sv:.1f} {unit}: ratio {r:.2f}", nums)


def analyze(candidate: ArmStats, stable: ArmStats, cfg: AnalysisConfig | None = None,
            source_error: str | None = None, skipped: dict[str, str] | None = None) -> Decision:
    """Compare ``candidate`` with ``stable``; worst metric wins.

    Args:
        candidate, stable: observed stats of each arm during the canary.
        cfg: thresholds (defaults of :class:`AnalysisConfig`).
        source_error: set when the metrics could not be read (e.g. Parquet unreadable):
            the decision is HOLD with ``error=True``.
        skipped: ``{metric: reason}`` for metrics the source does not provide
            (``error_rate``, ``p99_latency``, ``tokens_per_s``): SKIPPED with that reason.
            ``thumbs_up`` cannot be skipped (ValueError).

    Returns:
        :class:`Decision` with per-metric numbers and a one-line reason.
    """
    cfg = cfg or AnalysisConfig()
    if source_error:
        m = MetricResult("source", Check.ERROR, f"metrics unavailable: {source_error}")
        return Decision(Outcome.HOLD, f"HOLD (error): {m.reason}", [m], inconclusive=False, error=True)
    if candidate.latency_samples is not None and stable.latency_samples is not None:
        n_lat: tuple[int, int] | None = (candidate.latency_samples, stable.latency_samples)
    elif candidate.requests or stable.requests:
        n_lat = (candidate.requests, stable.requests)
    else:
        n_lat = None  # the source counts neither: judged as given
    results = [
        check_thumbs(candidate, stable, cfg),
        check_errors(candidate, stable, cfg),
        _ratio_check("p99_latency", candidate.p99_ms, stable.p99_ms, cfg.max_p99_ratio, True, "ms",
                     n_lat, cfg.min_requests),
        _ratio_check("tokens_per_s", candidate.tokens_per_s, stable.tokens_per_s,
                     cfg.min_tokens_per_s_ratio, False, "tokens/s", n_lat, cfg.min_requests),
    ]
    # Errors/requests are judged only once requests are counted: with no request counts at
    # all (source did not provide them) the metric is skipped rather than holding forever.
    if candidate.requests == 0 and stable.requests == 0 and results[1].check == Check.INCONCLUSIVE:
        results[1] = MetricResult("error_rate", Check.SKIPPED, "error rate not measured", results[1].numbers)
    for name, why in (skipped or {}).items():
        idx = [m.name for m in results].index(name) if name in [m.name for m in results] else -1
        if idx <= 0:
            raise ValueError(f"skipped: {name!r} is not a skippable metric "
                             f"(error_rate, p99_latency, tokens_per_s)")
        results[idx] = MetricResult(name, Check.SKIPPED, f"{name} skipped: {why}", {"skipped": why})
    worst = max(results, key=lambda m: _SEVERITY[m.check])
    sev = _SEVERITY[worst.check]
    bad = [m for m in results if _SEVERITY[m.check] == sev]
    if worst.check == Check.FAIL:
        outcome, tag = Outcome.ROLLBACK, "ROLLBACK"
    elif worst.check == Check.ERROR:
        outcome, tag = Outcome.HOLD, "HOLD (error)"
    elif worst.check == Check.INCONCLUSIVE:
        outcome, tag = Outcome.HOLD, "HOLD (inconclusive)"
    else:
        outcome, tag = Outcome.PROMOTE, "PROMOTE"
        bad = [m for m in results if m.check == Check.PASS]
    reason = f"{tag}: " + "; ".join(m.reason for m in bad)
    return Decision(outcome, reason, results,
                    inconclusive=worst.check == Check.INCONCLUSIVE,
                    error=worst.check == Check.ERROR)
