"""Statistics of thumbs-up rates: intervals, tests, and the canary's always-valid interval.

The one home of these formulas: the canary analysis (:mod:`deploy.analysis`), the demo's
report and the learning experiment import them from here. Pure functions on counts, no I/O.

* :func:`wilson_interval` - score interval of one proportion (Wilson 1927).
* :func:`newcombe_interval` - interval of a difference of two independent proportions from
  two Wilson intervals (Newcombe 1998, method 10).
* :func:`two_proportion_z` - fixed-horizon one-sided pooled z-test (valid at ONE look only).
* :func:`msprt_interval` - always-valid interval of a difference of two proportions (mSPRT,
  Johari, Pekelis and Walsh 2017), valid when looked at after every vote.
* :func:`ratio_interval` - always-valid interval of the relative difference
  ``rate_c / rate_s - 1`` (the same mixture boundary on the log of the rate ratio): the
  canary's test, so that a margin means the same at every base rate.
* :func:`cuped_rate` - a CUPED-adjusted rate (Deng, Xu, Kohavi, Walker 2013) from sufficient
  statistics of a pre-canary covariate, for :func:`ratio_bounds_from_means`.
"""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054  # Phi^-1(0.975)


def normal_cdf(x: float) -> float:
    """Standard normal CDF Phi(x)."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _check_counts(up: int, n: int, name: str) -> None:
    if n < 0 or not 0 <= up <= max(n, 0):
        raise ValueError(f"{name}: need 0 <= up <= n, got up={up}, n={n}")


def wilson_interval(up: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``up / n`` (95 % by default).

    Returns:
        ``(lo, hi)`` in [0, 1]; ``(0, 1)`` when ``n == 0``.

    Raises:
        ValueError: ``up`` outside [0, n].
    """
    _check_counts(up, n, "wilson_interval")
    if n == 0:
        return 0.0, 1.0
    ph = up / n
    den = 1 + z * z / n
    c = (ph + z * z / (2 * n)) / den
    h = z * math.sqrt(ph * (1 - ph) / n + z * z / (4 * n * n)) / den
    return max(0.0, c - h), min(1.0, c + h)


def newcombe_interval(up1: int, n1: int, up2: int, n2: int, z: float = Z95) -> tuple[float, float, float]:
    """Difference ``p2 - p1`` of two independent proportions with Newcombe's hybrid score
    interval (Newcombe 1998, Stat. Med. 17:873, method 10; 95 % by default).

    Returns:
        ``(diff, lo, hi)``.

    Raises:
        ValueError: an arm has ``n == 0`` or ``up`` outside [0, n].
    """
    if n1 <= 0 or n2 <= 0:
        raise ValueError(f"newcombe_interval: both arms need n > 0, got n1={n1}, n2={n2}")
    p1, p2 = up1 / n1, up2 / n2
    l1, u1 = wilson_interval(up1, n1, z)
    l2, u2 = wilson_interval(up2, n2, z)
    d = p2 - p1
    return d, d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2), d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)


def two_proportion_z(up_c: int, n_c: int, up_s: int, n_s: int) -> tuple[float, float]:
    """One-sided pooled two-proportion z-test of H1: rate_c < rate_s, at ONE fixed horizon.

    ``z = (p_c - p_s) / sqrt(p (1 - p) (1/n_c + 1/n_s))`` with the pooled ``p``; p-value
    ``Phi(z)``. Repeating it at every look inflates its false-positive rate far above alpha
    (``bench/canary.py``); the canary uses :func:`msprt_interval` instead.

    Returns:
        ``(z, p_value)``; ``(0, 0.5)`` when the pooled rate is 0 or 1 (no variance).

    Raises:
        ValueError: an arm has ``n == 0`` or ``up`` outside [0, n].
    """
    if n_c <= 0 or n_s <= 0:
        raise ValueError(f"n: both arms need votes, got n_c={n_c}, n_s={n_s}")
    if not (0 <= up_c <= n_c and 0 <= up_s <= n_s):
        raise ValueError(f"up: must be within [0, n], got {up_c}/{n_c}, {up_s}/{n_s}")
    z = float(pooled_z(np.float64(up_c), np.float64(n_c), np.float64(up_s), np.float64(n_s)))
    return z, normal_cdf(z)


def pooled_z(up_c, n_c, up_s, n_s):
    """The pooled two-proportion z statistic on arrays (or scalars) of counts, 0 where the
    pooled rate is 0 or 1; the core of :func:`two_proportion_z`, unchecked (n > 0)."""
    p = (up_c + up_s) / (n_c + n_s)
    se = np.sqrt(p * (1 - p) * (1 / n_c + 1 / n_s))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(se > 0, (up_c / n_c - up_s / n_s) / np.where(se > 0, se, 1.0), 0.0)


def msprt_halfwidth(var: float, alpha: float, tau: float) -> float:
    """Half-width of the always-valid interval of a normal mean with estimator variance
    ``var`` under the normal-mixture mSPRT with mixing N(0, tau^2).

    The mixture likelihood ratio of H0: theta = theta0 after data with estimate ``x`` is
    ``L = sqrt(V / (V + tau^2)) * exp(tau^2 (x - theta0)^2 / (2 V (V + tau^2)))``
    (Johari, Pekelis, Walsh 2017, "Always valid inference", eq. 11 / Robbins 1970). By Ville's
    inequality ``P(sup_n L_n >= 1/alpha) <= alpha`` under H0, so the set of theta0 with
    ``L < 1/alpha`` is a confidence sequence:
    ``|x - theta0| < sqrt(2 V (V + tau^2) / tau^2 * log(sqrt((V + tau^2) / V) / alpha))``.

    Args:
        var: variance of the estimator (> 0).
        alpha: error level in (0, 1).
        tau: mixing standard deviation (> 0), the effect size the test is tuned to.

    Returns:
        The half-width (same units as the estimate).

    Raises:
        ValueError: ``var <= 0``, ``alpha`` outside (0, 1) or ``tau <= 0``.
    """
    if not var > 0:
        raise ValueError(f"var: must be > 0, got {var}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha: must be in (0, 1), got {alpha}")
    if not tau > 0:
        raise ValueError(f"tau: must be > 0, got {tau}")
    t2 = tau * tau
    return math.sqrt(2 * var * (var + t2) / t2 * math.log(math.sqrt((var + t2) / var) / alpha))


def msprt_interval(up_c: int, n_c: int, up_s: int, n_s: int, alpha: float,
                   tau: float = 0.1) -> tuple[float, float, float]:
    """Always-valid (1 - alpha) interval of ``rate_c - rate_s`` (candidate minus stable).

    Method: the two-sample mSPRT of Johari, Pekelis and Walsh (2017) as Optimizely's Stats
    Engine runs it: the difference of the two observed rates is treated as a normal mean
    with variance ``V = q_c (1 - q_c) / n_c + q_s (1 - q_s) / n_s`` and the normal-mixture
    boundary of :func:`msprt_halfwidth` is applied. The rates inside ``V`` are shrunk
    toward 1/2 by one pseudo-vote per arm, ``q = (up + 0.5) / (n + 1)``, so that an arm
    with all-up or all-down votes does not report zero variance. The guarantee is
    asymptotic (normal approximation of the rates); its error rates at the vote counts a
    canary sees are measured by simulation in ``bench/canary.py``.

    Args:
        up_c, n_c: candidate's thumbs-up votes and all its votes (counts).
        up_s, n_s: the same for the stable version.
        alpha: error level in (0, 1): the interval covers the true difference at every
            look simultaneously with probability >= 1 - alpha (asymptotically).
        tau: mixing standard deviation (> 0), the difference the test is tuned to detect
            fastest (rate units; the canary uses its non-inferiority margin).

    Returns:
        ``(diff, lo, hi)`` with ``diff = up_c / n_c - up_s / n_s``, clipped to [-1, 1].

    Raises:
        ValueError: an arm has ``n == 0``, ``up`` outside [0, n], or bad ``alpha``/``tau``.
    """
    if n_c <= 0 or n_s <= 0:
        raise ValueError(f"msprt_interval: both arms need votes, got n_c={n_c}, n_s={n_s}")
    _check_counts(up_c, n_c, "candidate")
    _check_counts(up_s, n_s, "stable")
    msprt_halfwidth(0.25, alpha, tau)  # validates alpha and tau
    d, lo, hi = msprt_bounds(np.float64(up_c), np.float64(n_c), np.float64(up_s), np.float64(n_s), alpha, tau)
    return float(d), float(lo), float(hi)


def msprt_bounds(up_c, n_c, up_s, n_s, alpha: float, tau: float):
    """:func:`msprt_interval` on arrays (or scalars) of counts, unchecked (n > 0): the one
    implementation of the formula, used by the analysis and, vectorised over thousands of
    simulated canaries, by ``bench/canary.py``. Returns ``(diff, lo, hi)`` arrays (float64)."""
    qc, qs = (up_c + 0.5) / (n_c + 1), (up_s + 0.5) / (n_s + 1)
    var = qc * (1 - qc) / n_c + qs * (1 - qs) / n_s
    t2 = tau * tau
    h = np.sqrt(2 * var * (var + t2) / t2 * np.log(np.sqrt((var + t2) / var) / alpha))
    d = up_c / n_c - up_s / n_s
    return d, np.maximum(-1.0, d - h), np.minimum(1.0, d + h)


def mixture_halfwidth(var, alpha: float, tau: float):
    """:func:`msprt_halfwidth` on arrays, unchecked (var > 0): the one formula of the
    normal-mixture boundary, ``sqrt(2 V (V + tau^2) / tau^2 * log(sqrt((V + tau^2) / V) / alpha))``."""
    t2 = tau * tau
    return np.sqrt(2 * var * (var + t2) / t2 * np.log(np.sqrt((var + t2) / var) / alpha))


def ratio_bounds_from_means(m_c, v_c, m_s, v_s, alpha: float, tau: float):
    """Always-valid bounds of ``rate_c / rate_s - 1`` from each arm's estimated rate ``m``
    (> 0) and the variance ``v`` of that estimate (arrays or scalars, unchecked).

    The log rate ratio ``theta = log m_c - log m_s`` has delta-method variance
    ``V = v_c / m_c^2 + v_s / m_s^2`` and the normal-mixture boundary of
    :func:`mixture_halfwidth` is applied to it (the mSPRT of Johari, Pekelis and Walsh 2017
    on an asymptotically normal statistic; an asymptotic confidence sequence in the sense of
    Waudby-Smith, Arbour, Sinha, Kennedy and Ramdas 2021, "Time-uniform central limit theory
    and asymptotic confidence sequences"). The bounds of ``theta`` are mapped back with
    ``exp(.) - 1``, which is monotone, so the coverage is that of ``theta``.

    Returns ``(rel, lo, hi)`` arrays (float64): ``rel = m_c / m_s - 1``, ``lo >= -1``.
    """
    m_c = np.maximum(m_c, 1e-9)
    m_s = np.maximum(m_s, 1e-9)
    var = np.maximum(v_c / (m_c * m_c) + v_s / (m_s * m_s), 1e-18)
    theta = np.log(m_c) - np.log(m_s)
    h = mixture_halfwidth(var, alpha, tau)
    lo, hi = np.clip(theta - h, -50.0, 50.0), np.clip(theta + h, -50.0, 50.0)  # e^50: no overflow
    return np.expm1(theta), np.expm1(lo), np.expm1(hi)


def ratio_bounds(up_c, n_c, up_s, n_s, alpha: float, tau: float):
    """:func:`ratio_interval` on arrays (or scalars) of counts, unchecked (n > 0): the one
    implementation of the canary's test, used by :mod:`deploy.analysis` and, vectorised over
    thousands of simulated canaries, by ``bench/canary.py``. Returns ``(rel, lo, hi)``."""
    qc, qs = (up_c + 0.5) / (n_c + 1), (up_s + 0.5) / (n_s + 1)
    return ratio_bounds_from_means(qc, qc * (1 - qc) / n_c, qs, qs * (1 - qs) / n_s, alpha, tau)


def noninferiority_bounds(up_c, n_c, up_s, n_s, alpha: float, tau: float, m_c=None, v_c=None, m_s=None,
                          v_s=None):
    """The canary's two decision bounds on ``rate_c / rate_s - 1`` (arrays or scalars,
    unchecked, n > 0).

    * ``lo`` (PASS when > ``-delta``): :func:`ratio_bounds_from_means`'s lower bound, the
      normal-mixture mSPRT on the log rate ratio with mixing sd ``tau``.
    * ``hi`` (FAIL when < 0): "surely worse" is the same event on every scale, and it is
      tested on the difference ``m_c - m_s`` as a score test: with the variance under
      equal rates, ``V0 = p (1 - p) (1/n_c + 1/n_s)`` (``p`` the pooled rate shrunk by one
      pseudo-vote; times CUPED's variance ratio ``(v_c + v_s) / Wald`` when adjusted), the
      mSPRT of Johari, Pekelis and Walsh (2017) with mixing sd ``tau * p`` (the log-scale
      ``tau`` in rate units), reported relative to the stable (``hi_diff / m_s``). On the
      log scale an arm with no up-vote yet has an unbounded variance, so a candidate
      nobody likes would wait for the deadline; the observed-rate variance of a difference
      is too small when an arm has few up-votes by chance (false rollbacks above alpha at a
      5 % share); the pooled variance has neither fault (``bench/canary.py``).

    ``m``, ``v``: each arm's rate estimate and its variance (default: the shrunk rate
    ``q = (up + 0.5) / (n + 1)`` and ``q (1 - q) / n``; CUPED's from :func:`cuped_rate`).

    Returns ``(rel, lo, hi)`` (float64).
    """
    if m_c is None:
        m_c = (up_c + 0.5) / (n_c + 1)
        v_c = m_c * (1 - m_c) / n_c
    if m_s is None:
        m_s = (up_s + 0.5) / (n_s + 1)
        v_s = m_s * (1 - m_s) / n_s
    qc, qs = (up_c + 0.5) / (n_c + 1), (up_s + 0.5) / (n_s + 1)
    wald = qc * (1 - qc) / n_c + qs * (1 - qs) / n_s
    rel, lo, _ = ratio_bounds_from_means(m_c, v_c, m_s, v_s, alpha, tau)
    p = (up_c + up_s + 1.0) / (n_c + n_s + 2.0)
    v0 = p * (1 - p) * (1 / n_c + 1 / n_s) * np.minimum((v_c + v_s) / wald, 1.0)
    hi_diff = m_c - m_s + mixture_halfwidth(np.maximum(v0, 1e-18), alpha, tau * p)
    return rel, lo, np.maximum(hi_diff / np.maximum(m_s, 1e-9), -1.0)


def margin_tau(delta: float) -> float:
    """The mixing standard deviation a relative margin ``delta`` implies on the log scale:
    ``-log(1 - delta)`` (the log-ratio distance of a candidate exactly at the margin)."""
    return -math.log1p(-delta)


def ratio_interval(up_c: int, n_c: int, up_s: int, n_s: int, alpha: float,
                   tau: float | None = None) -> tuple[float, float, float]:
    """Always-valid (1 - alpha) interval of the relative difference ``rate_c / rate_s - 1``
    (candidate over stable, minus one), valid when looked at after every vote.

    Method: the rates are shrunk toward 1/2 by one pseudo-vote per arm,
    ``q = (up + 0.5) / (n + 1)`` (an arm with no up-votes keeps a finite log), and the log
    rate ratio ``log q_c - log q_s`` is treated as a normal mean with the delta-method
    variance ``V = (1 - q_c) / (n_c q_c) + (1 - q_s) / (n_s q_s)``; the normal-mixture mSPRT
    boundary (Johari, Pekelis and Walsh 2017, eq. 11; :func:`msprt_halfwidth`) gives a
    confidence sequence for it, mapped back with ``exp(.) - 1``. A relative margin ``delta``
    ("the candidate keeps at least ``1 - delta`` of the stable's thumbs-up rate") then means
    the same at a 0.05 and at a 0.5 base rate. The guarantee is asymptotic (normal
    approximation of the log ratio); its error rates at the vote counts a canary sees are
    measured by simulation in ``bench/canary.py``.

    Args:
        up_c, n_c: candidate's thumbs-up votes and all its votes (counts).
        up_s, n_s: the same for the stable version.
        alpha: error level in (0, 1).
        tau: mixing standard deviation on the log-ratio scale (> 0); None = 0.223, the
            log-ratio distance of a candidate at 80 % of the stable's rate.

    Returns:
        ``(rel, lo, hi)``: ``rel = q_c / q_s - 1`` and its always-valid bounds, ``lo >= -1``.

    Raises:
        ValueError: an arm has ``n == 0``, ``up`` outside [0, n], or bad ``alpha``/``tau``.
    """
    if n_c <= 0 or n_s <= 0:
        raise ValueError(f"ratio_interval: both arms need votes, got n_c={n_c}, n_s={n_s}")
    _check_counts(up_c, n_c, "candidate")
    _check_counts(up_s, n_s, "stable")
    tau = margin_tau(0.2) if tau is None else tau
    msprt_halfwidth(0.25, alpha, tau)  # validates alpha and tau
    r, lo, hi = ratio_bounds(np.float64(up_c), np.float64(n_c), np.float64(up_s), np.float64(n_s), alpha, tau)
    return float(r), float(lo), float(hi)


def cuped_rate(n, sum_y, sum_x, sum_xx, sum_xy, theta, mu_x):
    """CUPED-adjusted rate of one arm and the variance of that estimate, from sufficient
    statistics (arrays or scalars, unchecked, n > 0).

    Each vote ``i`` has outcome ``y_i`` (1 = thumbs up) and a covariate ``x_i`` measured
    before the canary started (the voting user's earlier thumbs-up rate). The adjusted mean
    is ``q - theta (xbar - mu_x)`` with ``q`` the shrunk rate (Deng, Xu, Kohavi and Walker 2013, "Improving the
    sensitivity of online controlled experiments by utilizing pre-experiment data", eq. 2)
    with ``theta`` and ``mu_x`` pooled over both arms (:func:`cuped_theta`); its variance is
    ``(s_yy - 2 theta s_xy + theta^2 s_xx) / n`` with the arm's own (co)variances, ``s_yy``
    from the rate shrunk by one pseudo-vote as in :func:`ratio_bounds`. Because ``x`` is
    fixed before the arm is assigned, ``E[xbar_c - xbar_s] = 0`` and the adjustment removes
    variance, not effect.

    Returns ``(rate, var)``.
    """
    ybar, xbar = sum_y / n, sum_x / n
    q = (sum_y + 0.5) / (n + 1)
    s_xx = np.maximum(sum_xx / n - xbar * xbar, 0.0)
    s_xy = sum_xy / n - xbar * ybar
    var = np.maximum(q * (1 - q) - 2 * theta * s_xy + theta * theta * s_xx, 1e-12) / n
    return np.maximum(q - theta * (xbar - mu_x), 1e-9), var


def cuped_theta(arms):
    """Pooled CUPED coefficient and covariate mean over arms given as tuples
    ``(n, sum_y, sum_x, sum_xx, sum_xy)``: ``theta = sum_a S_xy,a / sum_a S_xx,a`` with each
    arm's sums centred on its own means (so a true difference between the arms does not
    leak into ``theta``), ``mu_x`` the mean of ``x`` over all votes. Returns
    ``(theta, mu_x)``; theta is 0 where ``x`` does not vary."""
    sxx = sum(s_xx - s_x * s_x / n for n, _, s_x, s_xx, _ in arms)
    sxy = sum(s_xy - s_x * s_y / n for n, s_y, s_x, _, s_xy in arms)
    n_all = sum(a[0] for a in arms)
    mu_x = sum(a[2] for a in arms) / n_all
    with np.errstate(divide="ignore", invalid="ignore"):
        theta = np.where(sxx > 1e-12, sxy / np.where(sxx > 1e-12, sxx, 1.0), 0.0)
    return theta, mu_x


# ---------------------------------------------------------------------------------------------
# Always-valid bounds of a bounded mean: the canary's reward test and its signal guards.

#: The mixture's grid of betting rates ``lambda * c`` (``c`` the range of the observations):
#: 12 rates spaced geometrically over [0.005, 0.8], equal weights. A rate ``r`` is the one a
#: boundary is tightest at when ``V`` is about ``2 log(1/alpha) / (r / c)^2``: the grid spans
#: the few samples of a canary's first looks to about a million.
EB_GRID = tuple(float(x) for x in np.geomspace(0.005, 0.8, 12))


def psi_e(lam, c: float):
    """Howard et al. (2021)'s sub-exponential CGF ``psi_E,c(lambda) = (-log(1 - c lambda) -
    c lambda) / c^2`` for ``0 <= lambda < 1/c`` (arrays or scalars)."""
    x = np.asarray(lam, dtype=np.float64) * c
    return (-np.log1p(-x) - x) / (c * c)


def eb_boundary(v, alpha: float, c: float, grid=EB_GRID):
    """The one-sided empirical-Bernstein boundary ``u(V)`` of a bounded mean, crossed with
    probability at most ``alpha`` at ANY time (arrays or scalars ``v >= 0``, unchecked).

    Method (Howard, Ramdas, McAuliffe, Sekhon 2021, "Time-uniform, nonparametric,
    nonasymptotic confidence sequences", Ann. Statist. 49(2), Theorem 4): for observations
    ``X_i`` in ``[a, b]``, ``c = b - a``, a predictable center ``X^_{i-1}`` in ``[a, b]`` (here
    a constant fixed before the canary), ``S_t = sum (X_i - mu)`` and ``V_t = sum (X_i - X^)^2``,
    each ``exp(lambda S_t - psi_E,c(lambda) V_t)`` with ``0 <= lambda < 1/c`` is a nonnegative
    supermartingale (Fan, Grama, Liu 2015's inequality ``exp(l x - x^2 (-log(1 - l) - l)) <=
    1 + l x`` for ``x >= -1``). Their average over the rates ``lambda_k = grid_k / c`` (a
    discrete mixture) is one too, and by Ville's inequality it reaches ``1/alpha`` with
    probability at most ``alpha``. ``u(V)`` is the ``S`` at which the mixture equals
    ``1/alpha``: the root of ``log mean_k exp(lambda_k u - psi_k V) = log(1/alpha)``, found by
    Newton's method from above (the left side is convex and increasing in ``u``, so every
    iterate stays at or above the root: the boundary returned is never narrower than exact).

    Args:
        v: ``V_t`` (>= 0).
        alpha: crossing probability in (0, 1).
        c: range ``b - a`` of the observations (> 0).
        grid: the rates ``lambda * c``, each in (0, 1).

    Returns:
        ``u`` (float64, same shape as ``v``), in the units of the observations' sum.
    """
    lam = np.asarray(grid, dtype=np.float64) / c
    psi = psi_e(lam, c)
    v = np.asarray(v, dtype=np.float64)[..., None]
    log_target = math.log(len(lam) / alpha)  # log(K / alpha): sum_k exp(.) = K / alpha
    u = np.min((log_target + psi * v) / lam, axis=-1)  # one term alone reaches K / alpha: u >= root
    for _ in range(60):
        e = lam * u[..., None] - psi * v
        m = e.max(axis=-1, keepdims=True)
        w = np.exp(e - m)
        sw = w.sum(axis=-1)
        f = m[..., 0] + np.log(sw) - log_target
        step = f / ((w * lam).sum(axis=-1) / sw)
        u = u - np.maximum(step, 0.0)
        if not np.any(step > 1e-12 * np.maximum(u, 1.0)):
            break
    return u


def eb_mean_bounds(n, total, sq_total, lower: float, upper: float, alpha: float, center: float | None = None,
                   grid=EB_GRID):
    """Always-valid two-sided ``(1 - alpha)`` bounds of the mean of observations in
    ``[lower, upper]`` from their count ``n``, ``sum x`` and ``sum x^2`` (arrays or scalars,
    unchecked): the empirical-Bernstein confidence sequence of :func:`eb_boundary` with
    ``alpha / 2`` per side, ``V = sum (x - center)^2 = sq_total - 2 center total + n center^2``.
    It holds at every look at once, whatever the stopping rule, without a normal
    approximation; it needs only the bounds and a ``center`` fixed before the data
    (default the midpoint of ``[lower, upper]``; any fixed value in the range is valid, one
    near the mean gives the narrowest bounds). Order-free: ``V`` is a sum, so the bounds are
    a function of the counts a DuckDB query returns.

    Returns:
        ``(mean, lo, hi)`` (float64); an arm with ``n == 0`` gets ``mean = NaN``,
        ``[lower, upper]``. The bounds are clipped to ``[lower, upper]``.
    """
    c = float(upper) - float(lower)
    center = (float(lower) + float(upper)) / 2 if center is None else float(center)
    n = np.asarray(n, dtype=np.float64)
    total = np.asarray(total, dtype=np.float64)
    v = np.maximum(np.asarray(sq_total, dtype=np.float64) - 2 * center * total + n * center * center, 0.0)
    u = eb_boundary(v, alpha / 2, c, grid)
    safe = np.maximum(n, 1.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, total / safe, np.nan)
    lo = np.where(n > 0, np.maximum((total - u) / safe, lower), lower)
    hi = np.where(n > 0, np.minimum((total + u) / safe, upper), upper)
    return mean, lo, hi


def relative_margin_scale(m, floor: float):
    """The denominator of a relative difference: ``max(|m|, floor)`` (arrays or scalars), ``m``
    on a scale whose 0 is the worst value (the reward test passes a mean's distance from the
    policy's worst reward); the floor keeps a stable at 0 from asking the candidate to be shown
    better than it."""
    return np.maximum(np.abs(m), floor)


def relative_box_bounds(lc, hc, ls, hs, floor: float):
    """The canary's decision bounds of the relative difference of two means from each arm's
    always-valid bounds ``[lc, hc]`` (candidate) and ``[ls, hs]`` (stable) (arrays or
    scalars): ``lo = (lc - hs) / max(|hs|, floor)``, ``hi = (hc - ls) / max(|ls|, floor)``.

    ``lo > -delta`` exactly when ``lc > g(hs)`` with ``g(m) = m - delta max(|m|, floor)``,
    which is increasing in ``m``: every ``(mu_c, mu_s)`` in the box then has ``mu_c > mu_s -
    delta max(|mu_s|, floor)`` (the candidate keeps more than ``1 - delta`` of the stable's
    mean, on the scale the caller chose: the reward test's is the distance from the policy's
    worst reward, :func:`deploy.analysis.reward_bounds`). ``hi < 0`` exactly when
    ``hc < ls``: every point of the box has ``mu_c < mu_s`` (surely worse).

    Returns ``(lo, hi)`` (float64)."""
    return (lc - hs) / relative_margin_scale(hs, floor), (hc - ls) / relative_margin_scale(ls, floor)
