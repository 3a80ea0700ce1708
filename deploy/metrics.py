"""Canary metrics: per-version serving figures for the analysis, and the controller's own exports.

Two metric providers give the analysis the same fields (``errors``, ``requests``, ``p99_ms``,
``tokens_per_s``, ``latency_samples`` per version), chosen by :func:`metric_provider`:
``scrape`` (:class:`ServingMetricsSource`, the embedded default: the controller reads every
pod's ``/metrics`` itself) and ``prometheus`` (:class:`PrometheusMetricsSource`: PromQL on the
team's Prometheus). :class:`ControllerMetrics` is what ``flywheel controller`` exports.

What the ``scrape`` provider reads from serving's ``/metrics`` (Prometheus text, summed over
pods; counters are cumulative, so each figure is the difference between now and a baseline
taken when the canary started; the ``prometheus`` provider computes the same differences per
series in PromQL):

* requests per version: ``flywheel_version_requests_total{version}`` (completions served).
* errors per version: ``flywheel_requests_total{version, status}`` with status >= 500, or
  ``flywheel_version_errors_total{version}``; then requests come from the same family.
* p99 latency (reported in ms): histogram ``flywheel_version_latency_seconds{version, le}``
  (engine time; a pod of an older release exports ``flywheel_version_latency_ms``), quantile by linear interpolation inside the bucket
  (Prometheus ``histogram_quantile``) over the bucket counts observed since the baseline.
* tokens/s: the version's decode rate, ``flywheel_version_decode_tokens_total{version}`` over
  ``flywheel_version_decode_seconds_total{version}`` (tokens after the first over the seconds
  after the first token, vLLM's inter-token notion; it does not depend on how long the replies
  are). A pod of an older release exports neither: then ``flywheel_decode_tokens_per_second{version}``
  histogram mean (sum / count), else ``flywheel_version_tokens_total{version}`` over the summed
  seconds of ``flywheel_version_latency_seconds{version}`` (or ``_ms``): tokens per engine
  second, which counts each request's prefill once and so reads lower for shorter replies.
  In a fleet of mixed releases the decode rate is that of the pods that export it.

A family without a ``version`` label cannot tell the arms apart: that metric is SKIPPED with
the reason naming what serving would have to export. Too few requests
since the baseline leaves latency/tokens unmeasured (None -> SKIPPED) and error rate
INCONCLUSIVE, as for any other metric.

The baseline is persisted (JSON, atomic rewrite) keyed by candidate and canary start, so a
restarted controller keeps measuring from the canary's start, not from its own restart.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from schemas.events import now_ms

REQUESTS = "flywheel_version_requests"
HTTP_REQUESTS = "flywheel_requests"
ERRORS = "flywheel_version_errors"
LATENCY = ("flywheel_version_latency_seconds", "flywheel_version_latency_ms")  # seconds; ms from older pods
VERSION_TOKENS = "flywheel_version_tokens"
DECODE_TOKENS = "flywheel_version_decode_tokens"  # tokens after the first (counter)
DECODE_SECONDS = "flywheel_version_decode_seconds"  # seconds after the first token (counter)
TOKENS_PER_S = "flywheel_decode_tokens_per_second"

# Flat sample map: (sample name, sorted label items) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Prometheus text exposition -> ``{(sample_name, labels): value}``.

    Raises:
        ValueError: the text is not valid exposition format.
    """
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def merge(many: list[Samples]) -> Samples:
    """Sum the samples of several pods (counters and histogram buckets add up)."""
    out: Samples = defaultdict(float)
    for m in many:
        for k, v in m.items():
            out[k] += v
    return dict(out)


def delta(now: Samples, base: Samples) -> Samples:
    """``now - base`` per sample; a sample that went down (pod restarted, counter reset)
    counts from zero: its current value."""
    return {k: (v - base.get(k, 0.0) if v >= base.get(k, 0.0) else v) for k, v in now.items()}


def _by_version(s: Samples, name: str, **match: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (n, labels), v in s.items():
        d = dict(labels)
        if n == name and "version" in d and all(d.get(k) == val for k, val in match.items()):
            out[d["version"]] += v
    return out


def _has_family(s: Samples, name: str) -> bool:
    return any(n == name for n, _ in s)


def _has_version_label(s: Samples, name: str) -> bool:
    return any(n == name and "version" in dict(labels) for n, labels in s)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Quantile ``q`` of a cumulative histogram ``[(le, count), ...]`` (Prometheus
    ``histogram_quantile``: linear interpolation inside the bucket; the highest finite bound
    when the rank falls in ``+Inf``). None when the histogram is empty."""
    b = sorted(buckets)
    if not b or b[-1][1] <= 0:
        return None
    rank = q * b[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in b:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def arm_metrics(d: Samples, version: str) -> tuple[dict, dict[str, str]]:
    """Per-version figures from the delta samples ``d``.

    Returns:
        ``(fields, skipped)``: ``fields`` for :class:`deploy.analysis.ArmStats` (``errors``,
        ``requests``, ``p99_ms`` in ms, ``tokens_per_s``, ``latency_samples``: the
        histogram's observations since the baseline), and ``{metric: reason}`` for the
        metrics serving does not export per version.
    """
    fields: dict = {}
    skipped: dict[str, str] = {}
    if _has_version_label(d, HTTP_REQUESTS + "_total"):
        by_status = defaultdict(float)
        for (n, labels), v in d.items():
            lab = dict(labels)
            if n == HTTP_REQUESTS + "_total" and lab.get("version") == version:
                by_status[lab.get("status", "")] += v
        fields["requests"] = int(sum(by_status.values()))
        fields["errors"] = int(sum(v for st, v in by_status.items() if st[:1] == "5"))
    elif _has_version_label(d, ERRORS + "_total"):
        fields["requests"] = int(_by_version(d, REQUESTS + "_total").get(version, 0.0))
        fields["errors"] = min(int(_by_version(d, ERRORS + "_total").get(version, 0.0)), fields["requests"])
    else:
        skipped["error_rate"] = (f"serving exports no per-version error count ({HTTP_REQUESTS}_total or "
                                 f"{ERRORS}_total with a version label)")
    if "requests" not in fields and _has_version_label(d, REQUESTS + "_total"):
        # request counts still gate latency/tokens (min_requests) even without an error family
        fields["requests"] = int(_by_version(d, REQUESTS + "_total").get(version, 0.0))
    lat = next((n for n in LATENCY if _has_version_label(d, n + "_bucket")), None)
    if lat is None:
        skipped["p99_latency"] = f"serving exports no per-version latency histogram ({LATENCY[0]} with a version label)"
    else:
        buckets = [(float(dict(labels)["le"]), v) for (n, labels), v in d.items()
                   if n == lat + "_bucket" and dict(labels).get("version") == version]
        p99 = histogram_quantile(0.99, buckets)
        to_ms = 1.0 if lat.endswith("_ms") else 1000.0
        fields["p99_ms"] = None if p99 is None else p99 * to_ms
        # completions observed since the baseline: includes requests routed before it and
        # finished after it (not in the request counter's delta), so it gates p99 and tokens/s
        fields["latency_samples"] = int(max((c for le, c in buckets if math.isinf(le)), default=0.0))
    lat_sum = next((n for n in LATENCY if _has_version_label(d, n + "_sum")), None)
    if _has_version_label(d, DECODE_TOKENS + "_total") and _has_version_label(d, DECODE_SECONDS + "_total"):
        # the decode rate: tokens after the first over the seconds after the first token
        toks = _by_version(d, DECODE_TOKENS + "_total").get(version, 0.0)
        secs = _by_version(d, DECODE_SECONDS + "_total").get(version, 0.0)
        fields["tokens_per_s"] = toks / secs if secs > 0 else None
    elif (not _has_version_label(d, TOKENS_PER_S + "_count") and _has_version_label(d, VERSION_TOKENS + "_total")
            and lat_sum is not None):
        # serving's per-version counters: generated tokens / summed engine seconds
        toks = _by_version(d, VERSION_TOKENS + "_total").get(version, 0.0)
        secs = _by_version(d, lat_sum + "_sum").get(version, 0.0) / (1000.0 if lat_sum.endswith("_ms") else 1.0)
        fields["tokens_per_s"] = toks / secs if secs > 0 else None
    elif not _has_version_label(d, TOKENS_PER_S + "_count"):
        skipped["tokens_per_s"] = f"serving exports no per-version tokens/s ({TOKENS_PER_S} with a version label)"
    else:
        n = _by_version(d, TOKENS_PER_S + "_count").get(version, 0.0)
        s = _by_version(d, TOKENS_PER_S + "_sum").get(version, 0.0)
        fields["tokens_per_s"] = s / n if n > 0 else None
    return fields, skipped


class ServingMetricsSource:
    """``arm_metrics`` callable for :class:`deploy.controller.RolloutController`: scrapes
    every pod's ``/metrics``, subtracts each pod's baseline taken at the canary's start and
    returns ``(candidate_fields, stable_fields, skipped)``.

    Baselines are per pod (by base URL), so the pod set may change during a canary (pods found
    by DNS, ``deploy.discovery``): a pod first seen after the start counts from its first
    scrape (its earlier requests are not the canary's), a pod that left stops counting, and a
    pod whose counters went down (restarted) counts from zero (:func:`delta`).

    Args:
        admins: :class:`deploy.serving_client.ServingAdmin` per pod (the controller replaces
            the list when the pods change).
        baseline_path: JSON file holding the baselines (survives a controller restart).

    Raises (from ``__call__``):
        ServingAdminError: a pod's ``/metrics`` is unreachable (the controller records ERROR).
        ValueError: a pod's ``/metrics`` text does not parse.
    """

    def __init__(self, admins, baseline_path: Path):
        self.admins = list(admins)
        self.baseline_path = Path(baseline_path)

    def scrape_pods(self) -> dict[str, Samples]:
        """``{pod base URL: samples}`` of every pod now."""
        return {a.base_url: parse(a.metrics_text()) for a in self.admins}

    def scrape(self) -> Samples:
        """The samples of every pod, summed (:func:`merge`)."""
        return merge(list(self.scrape_pods().values()))

    def _baseline(self, key: str, now: dict[str, Samples]) -> dict[str, Samples]:
        """Each pod's baseline for canary ``key``; a pod without one gets ``now`` (saved)."""
        try:
            saved = json.loads(self.baseline_path.read_text())
        except (OSError, ValueError):
            saved = {}
        pods: dict[str, Samples] = {}
        if saved.get("key") == key and isinstance(saved.get("pods"), dict):
            pods = {u: {(n, tuple(tuple(x) for x in labels)): v for n, labels, v in samples}
                    for u, samples in saved["pods"].items()}
        new = {u: now[u] for u in now if u not in pods}
        if new or saved.get("key") != key:
            pods.update(new)
            self.baseline_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.baseline_path.with_name(f".{self.baseline_path.name}.{uuid.uuid4().hex}")
            tmp.write_text(json.dumps({"key": key, "pods": {
                u: [[n, list(labels), v] for (n, labels), v in smp.items()] for u, smp in pods.items()}}))
            os.replace(tmp, self.baseline_path)
        return pods

    def mark(self, st) -> None:
        """Take the baseline now for the canary ``st`` just started (called by the controller
        at START; if it fails, the first analysis takes it)."""
        try:
            self.baseline_path.unlink(missing_ok=True)
            self._baseline(f"{st.candidate}@{st.canary_started_ms}", self.scrape_pods())
        except Exception:  # noqa: BLE001 - best effort; __call__ retries and reports errors
            pass

    def __call__(self, st) -> tuple[dict, dict, dict[str, str]]:
        now = self.scrape_pods()
        base = self._baseline(f"{st.candidate}@{st.canary_started_ms}", now)
        d = merge([delta(smp, base[u]) for u, smp in now.items()])
        c, skipped = arm_metrics(d, st.candidate)
        s, _ = arm_metrics(d, st.stable)
        return c, s, skipped


# -- the same figures from a Prometheus server (PromQL) ---------------------------------------

class PrometheusQueryError(RuntimeError):
    """A PromQL query failed: Prometheus unreachable, or it answered an error (the message
    names the query and Prometheus's ``errorType: error``)."""


class PrometheusMetricsSource:
    """``arm_metrics`` callable that asks a Prometheus server instead of scraping the pods
    (the ``prometheus`` metric provider, as Flagger's and Argo Rollouts' are).

    The figures are those of the ``scrape`` provider, computed by PromQL on the series
    Prometheus scraped: per series (pod, version, bucket), the value now minus the value at
    the canary's start (``x - x offset <ms>ms``); a series that did not exist then, or that
    went down since (a restarted pod), counts from zero. Then per version:

    * requests / errors: ``sum by (version)`` of that delta of
      ``flywheel_version_requests_total`` and ``flywheel_version_errors_total``;
    * p99 (ms): ``histogram_quantile(0.99, sum by (version, le) (delta of LAT_bucket))`` with
      ``LAT`` = ``flywheel_version_latency_seconds`` (or ``flywheel_version_latency_ms``);
      ``latency_samples`` from the delta of ``LAT_count``;
    * tokens/s: delta of ``flywheel_version_decode_tokens_total`` over the delta of
      ``flywheel_version_decode_seconds_total`` (the decode rate) when Prometheus has the latter
      for any version; else (pods of an older release) delta of ``flywheel_version_tokens_total``
      over the delta of ``LAT_sum``.

    Not ``increase()``: it extrapolates each series to the window's ends by its own factor
    (a bucket that was 0 at the start extrapolates less than ``+Inf``), which moves a p99 of
    a few dozen requests by several buckets. The value at the start is the last scrape at or
    before it (``scrape_interval`` resolution).

    Args:
        url: Prometheus base URL (``http://prometheus:9090``).
        selector: extra label matchers for every series, e.g. ``job="flywheel-serving"``
            (PromQL syntax, without braces; empty: every series of these names).
        timeout_s: per query (s).
        clock: returns now in ms since epoch (the window's end).

    Raises (from ``__call__``):
        PrometheusQueryError: a query failed (the controller records ERROR and holds).
    """

    def __init__(self, url: str, selector: str = "", timeout_s: float = 10.0, clock=None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url: must start with http:// or https://, got {url!r}")
        if "{" in selector or "}" in selector:
            raise ValueError(f"selector: label matchers without braces, e.g. job=\"flywheel-serving\"; got {selector!r}")
        self.url = url.rstrip("/")
        self.selector = selector.strip()
        self.timeout_s = timeout_s
        self.clock = clock or now_ms

    def query(self, promql: str, at_ms: int | None = None) -> list[tuple[dict, float]]:
        """Run an instant query (at ``at_ms``, default the server's now); returns
        ``[(labels, value)]`` of the vector result (NaN values included)."""
        import httpx

        params = {"query": promql}
        if at_ms is not None:
            params["time"] = f"{at_ms / 1000:.3f}"
        try:
            r = httpx.get(self.url + "/api/v1/query", params=params, timeout=self.timeout_s)
            body = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise PrometheusQueryError(f"{self.url}: {type(exc).__name__}: {exc} (query {promql})") from exc
        if body.get("status") != "success":
            raise PrometheusQueryError(f"{self.url}: {body.get('errorType')}: {body.get('error')} (query {promql})")
        data = body["data"]
        if data.get("resultType") != "vector":
            raise PrometheusQueryError(f"{self.url}: expected a vector, got {data.get('resultType')} (query {promql})")
        return [(res["metric"], float(res["value"][1])) for res in data["result"]]

    def delta(self, name: str, since_ms: int, now_ms: int) -> str:
        """PromQL: per series of ``name``, its value at ``now_ms`` minus its value at
        ``since_ms``, or its value when it did not exist then or went down since."""
        x = f"{name}{{{self.selector}}}" if self.selector else name
        off = max(now_ms - since_ms, 1)
        return f"(({x} - {x} offset {off}ms) >= 0 or {x})"

    def arm_fields(self, st) -> tuple[dict[str, dict], dict[str, str]]:
        """``({version: ArmStats fields}, {metric: skip reason})`` for both arms of ``st``."""
        now = self.clock()

        def by_version(promql: str) -> dict[str, float]:
            return {lab["version"]: v for lab, v in self.query(promql, now) if "version" in lab}

        def total(name: str) -> dict[str, float]:
            return by_version(f"sum by (version) ({self.delta(name, st.canary_started_ms, now)})")

        req, err = total(REQUESTS + "_total"), total(ERRORS + "_total")
        lat, p99, n_lat, lat_s = None, {}, {}, {}
        for name in LATENCY:
            n_lat = total(name + "_count")
            if n_lat:
                lat = name
                p99 = by_version(f"histogram_quantile(0.99, sum by (version, le) "
                                 f"({self.delta(name + '_bucket', st.canary_started_ms, now)}))")
                lat_s = total(name + "_sum")
                break
        dec_s = total(DECODE_SECONDS + "_total")
        if dec_s:  # the decode rate, as the scrape provider prefers it
            toks, tok_s = total(DECODE_TOKENS + "_total"), dec_s
        else:  # pods of an older release: tokens per engine second
            toks = total(VERSION_TOKENS + "_total") if lat else {}
            tok_s = {v: x * (1.0 if lat and lat.endswith("_seconds") else 0.001) for v, x in lat_s.items()}
        skipped: dict[str, str] = {}
        if lat is None:
            skipped["p99_latency"] = (f"Prometheus has no per-version latency histogram ({LATENCY[0]} or "
                                      f"{LATENCY[1]}) with {self.selector or 'any labels'}")
            if not dec_s:
                skipped["tokens_per_s"] = (f"Prometheus has no {DECODE_SECONDS}_total and no per-version latency "
                                           f"histogram with {self.selector or 'any labels'}")
        to_ms = 1.0 if lat and lat.endswith("_ms") else 1000.0
        out: dict[str, dict] = {}
        for v in (st.candidate, st.stable):
            n = int(round(req.get(v, 0.0)))
            f: dict = {"requests": n, "errors": min(int(round(err.get(v, 0.0))), n)}
            if lat:
                q = p99.get(v)
                f["p99_ms"] = q * to_ms if q is not None and math.isfinite(q) else None
                f["latency_samples"] = int(round(n_lat.get(v, 0.0)))
            if "tokens_per_s" not in skipped:
                secs = tok_s.get(v, 0.0)
                f["tokens_per_s"] = toks.get(v, 0.0) / secs if secs > 0 else None
            out[v] = f
        return out, skipped

    def mark(self, st) -> None:
        """Nothing to do: the window starts at ``st.canary_started_ms``."""

    def __call__(self, st) -> tuple[dict, dict, dict[str, str]]:
        fields, skipped = self.arm_fields(st)
        return fields[st.candidate], fields[st.stable], skipped


def metric_provider(kind: str, admins=None, baseline_path: Path | None = None, prometheus_url: str | None = None,
                    selector: str = ""):
    """The controller's canary metric provider by name.

    ``scrape`` (the embedded default): :class:`ServingMetricsSource` over ``admins`` with its
    baseline in ``baseline_path``; ``prometheus``: :class:`PrometheusMetricsSource` on
    ``prometheus_url`` with ``selector``.

    Raises:
        ValueError: unknown ``kind``, or ``prometheus`` without a URL (names the field).
    """
    if kind == "scrape":
        return ServingMetricsSource(admins or [], baseline_path)
    if kind == "prometheus":
        if not prometheus_url:
            raise ValueError("prometheus_url: required by the prometheus metric provider")
        return PrometheusMetricsSource(prometheus_url, selector)
    raise ValueError(f"metrics provider: must be 'scrape' or 'prometheus', got {kind!r}")


# -- what the controller itself exports ---------------------------------------------------------

DECISIONS = ("START", "ADVANCE", "HOLD", "PROMOTE", "ROLLBACK", "FAILED", "ABORT", "RELOAD")


class ControllerMetrics:
    """The rollout controller's own Prometheus metrics (``flywheel controller --metrics-port``).

    * ``flywheel_canary_phase{phase}``: 1 for the current :class:`deploy.controller.RolloutPhase`.
    * ``flywheel_canary_step`` (index, -1 without a canary), ``flywheel_canary_weight`` (0..1),
      ``flywheel_canary_info{candidate, stable}`` (1), ``flywheel_canary_started_timestamp_seconds``,
      ``flywheel_canary_step_started_timestamp_seconds`` (unix s),
      ``flywheel_canary_step_deadline_seconds`` (the policy's step deadline).
    * From the last analysis (the ledger row's numbers), per ``arm`` (``candidate``, ``stable``):
      ``flywheel_canary_votes{arm, vote}``, ``flywheel_canary_thumbs_up_rate{arm}``,
      ``flywheel_canary_error_rate{arm}``, ``flywheel_canary_p99_latency_seconds{arm}``,
      ``flywheel_canary_tokens_per_second{arm}``; ``flywheel_canary_thumbs_up_diff_bound{bound}``
      (the always-valid interval of rate(candidate) - rate(stable), ``lower``/``upper``);
      under the reward test (D74): ``flywheel_canary_reward_mean{arm}``,
      ``flywheel_canary_rewarded_samples{arm}`` and ``flywheel_canary_reward_diff_bound{bound}``
      (the decision bounds of the relative mean-reward difference, ``lower``/``upper``);
      ``flywheel_canary_check{metric, check}``: 1 for each metric's current check.
    * ``flywheel_controller_decisions_total{decision}`` (:data:`DECISIONS` and the manual ones),
      ``flywheel_controller_reconcile_errors_total``,
      ``flywheel_controller_last_reconcile_timestamp_seconds`` (last step that succeeded).
    """

    def __init__(self, config=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector

        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_* (start time, CPU seconds, resident memory)
        self.phase = Gauge("flywheel_canary_phase", "1 for the rollout's current phase", ["phase"], registry=r)
        self.step = Gauge("flywheel_canary_step", "canary step index (-1: no canary)", registry=r)
        self.weight = Gauge("flywheel_canary_weight", "candidate's traffic share (0..1)", registry=r)
        self.info = Gauge("flywheel_canary_info", "candidate and stable version of the rollout", ["candidate", "stable"],
                          registry=r)
        self.started = Gauge("flywheel_canary_started_timestamp_seconds", "canary start (unix s)", registry=r)
        self.step_started = Gauge("flywheel_canary_step_started_timestamp_seconds", "current step's start (unix s)",
                                  registry=r)
        self.deadline = Gauge("flywheel_canary_step_deadline_seconds", "an undecided step rolls back after this (s)",
                              registry=r)
        self.votes = Gauge("flywheel_canary_votes", "thumb votes since the canary started", ["arm", "vote"], registry=r)
        self.thumbs = Gauge("flywheel_canary_thumbs_up_rate", "thumbs-up share of the votes", ["arm"], registry=r)
        self.diff_bound = Gauge("flywheel_canary_thumbs_up_diff_bound", "always-valid interval of the thumbs-up "
                                "relative difference candidate / stable - 1", ["bound"], registry=r)
        self.reward = Gauge("flywheel_canary_reward_mean", "mean reward of the rewarded samples, by the reward "
                            "policy", ["arm"], registry=r)
        self.rewarded = Gauge("flywheel_canary_rewarded_samples", "samples with a reward since the canary started",
                              ["arm"], registry=r)
        self.reward_bound = Gauge("flywheel_canary_reward_diff_bound", "always-valid decision bounds of the relative "
                                  "mean-reward difference candidate vs stable", ["bound"], registry=r)
        self.errors = Gauge("flywheel_canary_error_rate", "server-side error share of requests", ["arm"], registry=r)
        self.p99 = Gauge("flywheel_canary_p99_latency_seconds", "p99 engine latency", ["arm"], registry=r)
        self.tps = Gauge("flywheel_canary_tokens_per_second", "decode rate: tokens after the first per second after "
                         "the first token", ["arm"], registry=r)
        self.check = Gauge("flywheel_canary_check", "1 for each analysis metric's current check", ["metric", "check"],
                           registry=r)
        self.decisions = Counter("flywheel_controller_decisions", "ledger decisions by outcome", ["decision"],
                                 registry=r)
        for d in DECISIONS:
            self.decisions.labels(d)
        self.errors_total = Counter("flywheel_controller_reconcile_errors", "reconcile steps that raised", registry=r)
        self.last_ok = Gauge("flywheel_controller_last_reconcile_timestamp_seconds", "last reconcile step that "
                             "succeeded (unix s)", registry=r)
        if config is not None:
            self.deadline.set(config.step_deadline_s)
        self.step.set(-1)

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread (prometheus_client);
        returns the server (``shutdown()`` stops it)."""
        from prometheus_client import start_http_server

        return start_http_server(port, addr=addr, registry=self.registry)[0]

    def status(self, st) -> None:
        """The persisted status ``st`` after a successful reconcile step."""
        for p in type(st.phase):
            self.phase.labels(p.value).set(1.0 if p == st.phase else 0.0)
        in_canary = st.phase.value == "canary"
        self.step.set(st.step if in_canary else -1)
        self.weight.set(st.weight if in_canary else 0.0)
        self.info.clear()
        if st.candidate:
            self.info.labels(st.candidate, st.stable or "").set(1)
        self.started.set(st.canary_started_ms / 1000.0)
        self.step_started.set(st.step_started_ms / 1000.0)
        self.last_ok.set(time.time())

    def reconcile_failed(self) -> None:
        self.errors_total.inc()

    def decision(self, decision: str, st, numbers: dict) -> None:
        """One ledger decision and its analysis ``numbers`` (``Decision.numbers()`` plus the
        controller's fields; metrics absent from it keep their last value)."""
        self.decisions.labels(decision).inc()
        checks = {k: v["check"] for k, v in numbers.items() if isinstance(v, dict) and "check" in v}
        if checks:
            self.check.clear()
            for metric, chk in checks.items():
                self.check.labels(metric, chk).set(1)
        t = numbers.get("thumbs_up") or {}
        for arm in ("candidate", "stable"):
            if f"{arm}_votes" in t:
                up = t.get(f"{arm}_up", 0)
                self.votes.labels(arm, "up").set(up)
                self.votes.labels(arm, "down").set(t[f"{arm}_votes"] - up)
            _set(self.thumbs.labels(arm), t.get(f"{arm}_rate"))
            _set(self.errors.labels(arm), (numbers.get("error_rate") or {}).get(f"{arm}_rate"))
            p99_ms = (numbers.get("p99_latency") or {}).get(arm)
            _set(self.p99.labels(arm), None if p99_ms is None else p99_ms / 1000.0)
            _set(self.tps.labels(arm), (numbers.get("tokens_per_s") or {}).get(arm))
        _set(self.diff_bound.labels("lower"), t.get("ci_lo"))
        _set(self.diff_bound.labels("upper"), t.get("ci_hi"))
        rw = numbers.get("reward") or {}
        for arm in ("candidate", "stable"):
            _set(self.reward.labels(arm), rw.get(f"{arm}_mean"))
            _set(self.rewarded.labels(arm), rw.get(f"{arm}_samples"))
        _set(self.reward_bound.labels("lower"), rw.get("ci_lo"))
        _set(self.reward_bound.labels("upper"), rw.get("ci_hi"))


def _set(gauge, v) -> None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        gauge.set(v)
